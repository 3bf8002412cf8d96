"""``ple stats``: the row traffic of a token stream through one PLE layer (:func:`ple.data.stats.row_traffic`)."""

from __future__ import annotations

import argparse

from ple.checkpoint import resolve_model
from ple.commands.report import add_json_argument, check_layer_index, emit_json
from ple.common.argtypes import integer, positive_int
from ple.data.tokens import add_token_arguments, read_tokens

__all__ = ["HELP", "add_arguments", "run"]

HELP = "row traffic of a token stream: distinct rows, reuse per step/request, cache hit rates"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="config.json or model directory")
    add_token_arguments(p)
    p.add_argument("--batch", type=positive_int, default=64, help="requests decoded side by side (64)")
    p.add_argument("--request-tokens", type=positive_int, default=256, help="tokens per request (256)")
    p.add_argument(
        "--cache-rows",
        type=positive_int,
        nargs="+",
        default=[1 << 16, 1 << 20],
        help="sizes of the LRU row caches to simulate (65536 1048576)",
    )
    p.add_argument("--layer", type=integer, default=0, help="PLE layer index (default 0)")
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    """Row traffic of a token stream: distinct rows, reuse, bucket load, decode reuse, cache hit rates."""
    from ple.data.stats import row_traffic

    cfg, _ = resolve_model(args.path)
    check_layer_index(cfg, args.layer)
    chunks = read_tokens(args, cfg.vocab_size, cfg.eos_token_id)
    res = row_traffic(
        chunks, cfg, args.layer, batch=args.batch, request_tokens=args.request_tokens, cache_rows=args.cache_rows
    )
    if args.json:
        emit_json(res)
        return 0
    print(
        f"{res['tokens']} tokens, {res['lookups']} lookups, {res['total']['distinct_rows']} distinct rows; "
        f"top 1% of rows serve {res['total']['top1_share']:.1%}, top 10% serve {res['total']['top10_share']:.1%}"
    )
    print("head order  distinct rows  top1%   top10%  distinct n-grams  shared rows  max load")
    for h in res["heads"]:
        print(
            f"{h['head']:4d} {h['order']:5d} {h['distinct_rows']:14d} {h['top1_share']:6.1%} {h['top10_share']:7.1%} "
            f"{h['distinct_ngrams']:17d} {h['shared_rows']:12d} {h['max_bucket_load']:9d}"
        )
    d = res["decode"]
    print(
        f"decode: {d['requests']} requests of {d['request_tokens']} tokens, {d['batch']} at a time, {d['steps']} steps, "
        f"{d['distinct_rows_per_step']:.1f} distinct rows per step"
    )
    print("order  rows/step  within step  within request  across requests     new")
    for o in d["orders"]:
        print(
            f"{o['order']:5d} {o['distinct_rows_per_step']:10.1f} {o['within_step']:12.1%} {o['within_request']:15.1%} "
            f"{o['across_requests']:16.1%} {o['new']:7.1%}"
        )
    for c in d["cache"]:
        per = "  ".join(f"order {k + 2}: {v:.1%}" for k, v in enumerate(c["per_order"]))
        print(f"LRU cache of {c['rows']} rows: hit rate {c['hit_rate']:.1%} ({per})")
    return 0
