"""Row cache in front of a memory-mapped table: hit rate and ms/batch on a Zipf token stream.

    python benchmarks/cache_bench.py [--base 250000] [--warm-tokens 200000] [--batches 32]

The stream: Zipf tokens (``numpy`` zipf, a = 1.1, over the published vocabulary, ranks mapped to
token ids by a fixed permutation, a few EOS). Row ids are the real n-gram ids of the published
hashing (``examples/published-config.json``) with a smaller ``ngram_vocab_size_base`` so the table
is a few million rows (250 000 -> 4 001 280 rows of 160 bytes, fp8, a 640 MB file). The first
``--warm-tokens`` tokens warm the cache (:meth:`CachedTable.warm`); the next ``--batches`` batches
of ``--tokens`` tokens are measured, for a plain memory map and for ``CachedTable(mmap)`` holding 0%,
1% and 10% of the distinct rows the warm-up read. "cold" evicts the file from the page cache before
every batch (the mapping is dropped and the file ``posix_fadvise(DONTNEED)``-ed, as in
``table_bench.py``; the cached rows stay in memory); "cached" leaves the pages in. The cache is
"static" while measured (no refresh in the timed loop). "online" runs an LFU cache from empty over
the whole stream (refresh every 64 lookups) and reports its hit rate on the measured batches. Every
measured batch is checked against the plain memory map. Prints a markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from table_bench import build_file, drop_page_cache, write_report

from ple import PLEConfig, fresh_context, ngram_ids
from ple.table import CachedTable, MmapTable

_REPO = Path(__file__).resolve().parents[1]


def zipf_tokens(n: int, vocab: int, eos: int, a: float, eos_rate: float, seed: int) -> torch.Tensor:
    """``[n]`` int64 tokens: Zipf ranks (rejecting ranks past the vocabulary) -> ids by a fixed permutation."""
    rng = np.random.default_rng(seed)
    ranks = np.empty(0, dtype=np.int64)
    while ranks.size < n:
        z = rng.zipf(a, size=2 * n)
        ranks = np.concatenate([ranks, z[z <= vocab] - 1])
    tokens = rng.permutation(vocab)[ranks[:n]]
    tokens[rng.random(n) < eos_rate] = eos
    return torch.from_numpy(tokens.astype(np.int64))


def stream_ids(cfg: PLEConfig, tokens: torch.Tensor) -> torch.Tensor:
    """``[T, G]`` row ids of the stream read as one request."""
    lay = cfg.layout(0)
    qsl = torch.tensor([0, tokens.numel()])
    return ngram_ids(tokens, qsl, fresh_context(1, lay, cfg.eos_token_id), lay, cfg.eos_token_id)


def measure(path: Path, batches: list[torch.Tensor], refs: list[torch.Tensor], cold: bool, cache: CachedTable | None):
    """ms per batch of ``lookup`` (plain map when ``cache`` is None), and whether every batch was exact.

    Every map of the file is closed before the page cache is dropped (mapped pages are not evicted).
    """
    dtype = torch.bfloat16
    times, ok = [], True
    table = None
    for i, ids in enumerate(batches):
        if cold or i == 0:
            if cache is not None:
                cache.backing.close()
            if table is not None:
                table.close()
            table = None
            gc.collect()
            if cold:
                drop_page_cache(path)
            table = MmapTable.open(path)
            if cache is not None:
                cache.backing = table  # a fresh map; the cached rows stay in memory
        target = table if cache is None else cache
        t0 = time.perf_counter()
        rows = target.lookup(ids, dtype)
        times.append(time.perf_counter() - t0)
        ok = ok and torch.equal(rows, refs[i])
    table.close()
    return times, ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(_REPO / "examples/published-config.json"))
    p.add_argument("--base", type=int, default=250_000, help="ngram_vocab_size_base (table rows ~ 16 x this)")
    p.add_argument("--warm-tokens", type=int, default=200_000)
    p.add_argument("--tokens", type=int, default=256, help="tokens per measured batch")
    p.add_argument("--batches", type=int, default=32)
    p.add_argument("--zipf-a", type=float, default=1.1)
    p.add_argument("--eos-rate", type=float, default=0.002)
    p.add_argument("--fractions", default="0,0.01,0.1", help="cache capacities, fractions of warm-up distinct rows")
    p.add_argument("--no-online", action="store_true", help="skip the online LFU hit-rate run")
    p.add_argument("--dir", default=None, help="folder for the table file (default: a temporary one)")
    p.add_argument("--out", default="out/cache_bench.json")
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]

    cfg = dataclasses.replace(PLEConfig.from_pretrained(args.config), ngram_vocab_size_base=args.base)
    lay = cfg.layout(0)
    n_measure = args.tokens * args.batches
    tokens = zipf_tokens(
        args.warm_tokens + n_measure, cfg.vocab_size, cfg.eos_token_id, args.zipf_a, args.eos_rate, seed=0
    )
    t0 = time.perf_counter()
    ids = stream_ids(cfg, tokens)
    ids_s = time.perf_counter() - t0
    warm_ids = ids[: args.warm_tokens]
    batches = list(ids[args.warm_tokens :].split(args.tokens))
    warm_distinct = int(torch.unique(warm_ids).numel())
    measured = torch.cat(batches)
    seen = torch.isin(measured, warm_ids)
    print(
        f"stream: {tokens.numel()} tokens ({ids_s:.1f} s for the ids), warm-up reads {warm_ids.numel()} rows, "
        f"{warm_distinct} distinct; measured rows seen in the warm-up: {float(seen.float().mean()):.3f}",
        file=sys.stderr,
    )
    bigram = torch.arange(lay.num_heads) // cfg.heads_per_ngram == 0  # heads of order 2
    fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "cache_bench.ple"
        t0 = time.perf_counter()
        build_file(path, lay.padded_rows)
        build_s = time.perf_counter() - t0
        ref_table = MmapTable.open(path)
        refs = [ref_table.lookup(b, torch.bfloat16) for b in batches]
        ref_table.close()

        def record(name, times, ok, cache=None, capacity=None):
            r = {
                "median_batch_ms": statistics.median(times) * 1e3,
                "min_batch_ms": min(times) * 1e3,
                "correct": bool(ok),
            }
            if cache is not None:
                n = cache.hits + cache.misses
                hit = torch.isin(measured, cache.cached_ids)  # [T, G]: which reads the cache serves
                r.update(
                    capacity_rows=capacity,
                    hit_rate=cache.hit_rate,
                    hit_rate_bigram_heads=float(hit[:, bigram].float().mean()),
                    hit_rate_longer_heads=float(hit[:, ~bigram].float().mean()),
                    fetched_rows_per_batch=cache.fetched_rows / len(batches),
                    reads_per_batch=n / len(batches),
                    cache_MB=cache.cache_nbytes / 1e6,
                )
            results[name] = r
            print(f"  {name}: {r['median_batch_ms']:.2f} ms/batch", file=sys.stderr)

        for cold in (True, False):
            mode = "cold" if cold else "cached"
            if not cold:  # page in what the measured batches read
                t = MmapTable.open(path)
                for b in batches:
                    t.lookup(b, torch.bfloat16)
                t.close()
            times, ok = measure(path, batches, refs, cold, None)
            record(f"mmap {mode}", times, ok)
            for frac in fractions:
                capacity = int(round(frac * warm_distinct))
                cache = CachedTable(MmapTable.open(path), capacity, policy="static")
                t0 = time.perf_counter()
                cache.warm(warm_ids)
                warm_s = time.perf_counter() - t0
                cache.reset_stats()
                times, ok = measure(path, batches, refs, cold, cache)
                record(f"cached {frac:.0%} {mode}", times, ok, cache, capacity)
                results[f"cached {frac:.0%} {mode}"]["warm_s"] = warm_s
                cache.close()
        if not args.no_online:
            for frac in fractions:
                if frac == 0:
                    continue
                capacity = int(round(frac * warm_distinct))
                cache = CachedTable(MmapTable.open(path), capacity, refresh_every=64)
                t0 = time.perf_counter()
                for b in warm_ids.split(args.tokens):
                    cache.lookup(b, torch.bfloat16)
                online_s = time.perf_counter() - t0
                warm_rate = cache.hit_rate
                cache.reset_stats()
                ok = all(torch.equal(cache.lookup(b, torch.bfloat16), refs[i]) for i, b in enumerate(batches))
                results[f"online lfu {frac:.0%}"] = {
                    "capacity_rows": capacity,
                    "hit_rate": cache.hit_rate,
                    "hit_rate_during_warmup": warm_rate,
                    "warmup_s": online_s,
                    "refreshes": cache.refreshes,
                    "correct": bool(ok),
                }
                cache.close()

    lines = [
        f"table {lay.padded_rows} x {lay.head_dim} fp8 ({lay.padded_rows * lay.head_dim / 1e9:.2f} GB, built in "
        f"{build_s:.1f} s), published hashing with ngram_vocab_size_base={args.base}; Zipf a={args.zipf_a} "
        f"stream, EOS rate {args.eos_rate}; warm-up {args.warm_tokens} tokens ({warm_distinct} distinct rows); "
        f"{args.batches} batches x {args.tokens} tokens x {lay.num_heads} heads; torch threads "
        f"{torch.get_num_threads()}; load average before {load_before:.1f}, after {os.getloadavg()[0]:.1f}",
        "",
        "| case | capacity rows | cache MB | hit rate | 2-gram / 3-gram heads | rows fetched/batch "
        "| median ms/batch | min ms/batch | correct |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for name, r in results.items():
        cap = f"{r['capacity_rows']}" if "capacity_rows" in r else ""
        mb = f"{r['cache_MB']:.1f}" if "cache_MB" in r else ""
        hr = f"{r['hit_rate']:.3f}" if "hit_rate" in r else ""
        by_order = (
            f"{r['hit_rate_bigram_heads']:.3f} / {r['hit_rate_longer_heads']:.3f}"
            if "hit_rate_bigram_heads" in r
            else ""
        )
        fetched = f"{r['fetched_rows_per_batch']:.0f}" if "fetched_rows_per_batch" in r else ""
        med = f"{r['median_batch_ms']:.2f}" if "median_batch_ms" in r else ""
        mn = f"{r['min_batch_ms']:.2f}" if "min_batch_ms" in r else ""
        lines.append(
            f"| {name} | {cap} | {mb} | {hr} | {by_order} | {fetched} | {med} | {mn} | {'yes' if r['correct'] else 'NO'} |"
        )
    print("\n".join(lines))
    report = {
        "config": {**vars(args), "rows": lay.padded_rows, "head_dim": lay.head_dim, "heads": lay.num_heads},
        "stream": {"warm_rows_distinct": warm_distinct, "measured_rows_seen_in_warmup": float(seen.float().mean())},
        "build_s": build_s,
        "results": results,
    }
    write_report(args.out, report, load_before)
    return 0 if all(r["correct"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
