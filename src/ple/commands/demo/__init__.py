"""``ple demo``: what a user of ple gets, end to end, on an embedded default (no download).

Two parts, each checked:

1. the model (:mod:`.model`): a deterministic random-weight transformers ``qwen4_exp`` model whose
   PLE tables dominate, saved with ``save_pretrained`` in the published layout (fp8 tables with a
   global scale, sharded), then loaded and run on the same prompts by plain transformers and by
   :func:`ple.integrations.transformers.from_pretrained` with the tables on disk, each in a fresh
   process: tokens equal, largest logit difference, peak resident memory, load and generate time,
   table bytes on disk vs resident, and a second start that reuses the table files;
2. serving (:mod:`.serving`): a PLE layer at the published geometry driven through a
   :class:`~ple.runtime.Session` with every output checked against the one-shot reference, then
   requests of two named adapters and of the base table in one session, each checked against its
   adapter served alone (:mod:`.adapters`).

Exit status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ple.commands.demo import parallel
from ple.commands.demo.serving import (
    DEMO_CONFIG,
    check_real_text,
    print_serving,
    run_serving,
    serve,
    synthesize_checkpoint,
)
from ple.commands.report import add_format_argument, check_destinations
from ple.common.argtypes import byte_size, int_between, non_negative_int, shown_size
from ple.data.tokens import add_token_arguments, given_source
from ple.errors import CommandLineError
from ple.integrations.demo_model import MODEL_DIRECT_BUDGET, MODEL_SIZES
from ple.table.tiers.open import DEFAULT_MEMORY_BUDGET, DEFAULT_TIER, MODEL_TIERS

__all__ = ["DEMO_CONFIG", "HELP", "add_arguments", "run", "serve", "synthesize_checkpoint", "MEMORY_CHECK"]

HELP = "end-to-end run: synthesize, load, serve, check against the reference"

MEMORY_CHECK = 0.9
"""ple's peak resident memory must be lower than plain transformers' by this share of the tables' in-memory size."""
LOGIT_TOLERANCE = 1e-4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smaller tables and workload (about a third of the time)")
    p.add_argument("--only", choices=["model", "serving"], help="run one part only")
    p.add_argument(
        "--tier",
        choices=MODEL_TIERS,
        default=DEFAULT_TIER,
        help="where ple serves the tables from",
    )
    p.add_argument(
        "--memory-budget",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="--tier direct: hot rows each table keeps in memory, a size with its unit (64MiB, 1GiB, 512KiB; the "
        f"rest read from disk; default {shown_size(DEFAULT_MEMORY_BUDGET)} for the serving layer, "
        f"{shown_size(MODEL_DIRECT_BUDGET)} for each of the model's two small tables)",
    )
    tokens = add_token_arguments(p, required=False)  # the serving workload's (default: --real-text 200000)
    tokens.add_argument(
        "--synthetic-tokens", action="store_true", help="serve uniform random tokens instead of real text"
    )
    p.add_argument("--checkpoint", help="serve this qwen4_exp model's PLE layer instead of a synthesized one")
    add_format_argument(
        p,
        "--table-format",
        "serve the serving layer's table from a copy in this format ({names}; made once "
        "like from_pretrained(table_format=) makes it; docs/FORMATS.md); mmap and cached tiers",
    )
    p.add_argument("--config", help="config.json for the synthesized serving layer instead of the embedded one")
    p.add_argument("--layer", type=non_negative_int, default=0, help="PLE layer index to serve (default 0)")
    p.add_argument(
        "--requests", type=int_between(1, 100_000), default=None, help="requests in the workload (default 16, quick 6)"
    )
    p.add_argument("--slots", type=int_between(1, 4096), default=8, help="concurrent requests (state slots)")
    p.add_argument("--num-spec", type=int_between(0, 64), default=3, help="speculative tokens per verify chunk")
    p.add_argument("--chunk", type=int_between(1, 1 << 20), default=64, help="prefill chunk size")
    p.add_argument(
        "--new-tokens", type=int_between(1, 100_000), default=16, help="tokens each prompt generates (model part)"
    )
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument(
        "--workdir",
        help="keep the checkpoints and table files here (an empty or new folder: a folder holding anything is refused)",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout")
    p.add_argument("--output", metavar="PATH", help="also write the results as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (also off when stderr is no terminal)")
    parallel.add_arguments(p)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e6 else f"{n / 1e3:,.1f} KB"


def _model_checks(res: dict[str, Any]) -> dict[str, bool]:
    ple = res["ple"]
    return {
        "tokens_equal": res["tokens_equal"],
        "logits_close": res["max_logit_diff"] <= LOGIT_TOLERANCE,
        # the memory tier reads the checkpoint on every start: no table files to reuse
        "tables_reused_on_second_start": ple["tier"] == "memory" or all(a == "reused" for a in ple["tables"][-1]),
        "memory_saved": res["memory_saved_share_of_tables"] >= MEMORY_CHECK,
    }


def _part(parts: list[str], name: str) -> str:
    """``"1/2 "`` when both parts run (progress and report number them alike), else nothing."""
    return f"{parts.index(name) + 1}/{len(parts)} " if len(parts) > 1 else ""


def _print_model(res: dict[str, Any], number: str = "") -> None:
    ck, plain, ple = res["checkpoint"], res["plain"], res["ple"]
    rows = " + ".join(f"{r[0]:,} x {r[1]}" for r in ck["tables"])
    print(f"== {number}the user's path: a qwen4_exp model with its PLE tables on disk ==")
    print(f"model      : random-weight qwen4_exp (hidden 64, 4 layers, 2 PLE layers), tables {rows}")
    files = ck["published_files"]
    print(
        f"checkpoint : save_pretrained in the published layout: fp8 tables + global scale, "
        f"{files} file{'s' if files != 1 else ''}, {_mb(ck['published_bytes'])} "
        f"(tables {_mb(ck['published_table_bytes'])})"
    )
    print(
        f"plain copy : tables dequantized to fp32 for plain transformers ({_mb(ck['plain_bytes'])}); "
        "transformers reads fp8 tables as a plain cast and ignores weight_scale"
    )
    first, second = ple["tables"][0], ple["tables"][-1]
    print("\neach column is a process of its own, started with the files evicted from the page cache")
    print(f"| {'':28s} | transformers, fp32 tables | ple, 1st start | ple, 2nd start |")
    print(f"|{'-' * 30}|--------------------------:|---------------:|---------------:|")

    def row(name, a, b, c):
        print(f"| {name:28s} | {a:>25s} | {b:>14s} | {c:>14s} |")

    row(
        "load (s)", f"{plain['load_seconds'][0]:.2f}", f"{ple['load_seconds'][0]:.2f}", f"{ple['load_seconds'][-1]:.2f}"
    )
    if ple["tier"] != "memory":
        row("table files", "-", "/".join(sorted(set(first))), "/".join(sorted(set(second))))
    n = f"generate {res['prompts']} x {res['new_tokens']} (s)"
    row(
        n,
        f"{plain['generate_seconds'][0]:.2f}",
        f"{ple['generate_seconds'][0]:.2f}",
        f"{ple['generate_seconds'][-1]:.2f}",
    )
    peaks = ple.get("peak_rss_bytes_per_start", [ple["peak_rss_bytes"]] * 2)
    row("peak resident, process", _mb(plain["peak_rss_bytes"]), _mb(peaks[0]), _mb(peaks[-1]))
    print()
    print(
        f"tokens equal       : {'yes' if res['tokens_equal'] else 'NO'} ({res['prompts']} prompts x {res['new_tokens']} new tokens)"
    )
    print(f"max logit diff     : {res['max_logit_diff']:.2e} (tolerance {LOGIT_TOLERANCE:g})")
    if ple["tier"] == "memory":
        where = f"{_mb(ck['published_table_bytes'])} of fp8 rows read into memory"
    else:
        where = f"{_mb(ple['table_file_bytes'])} on disk, {_mb(ple['table_resident_bytes'])} resident after generate"
        if ple["tier"] == "direct":  # what the tier may hold, not a count of touched pages
            where = (
                f"{_mb(ple['table_file_bytes'])} on disk, at most {_mb(ple['table_resident_bytes'])} in memory "
                "(the row cache and read buffers; nothing mapped)"
            )
        elif ple["tier"] == "cached":
            where += f" (of which {_mb(ple['table_tier_bytes'])} cached rows)"
    print(f"tables             : {_mb(ck['table_bytes_in_memory'])} in transformers' memory (fp32); ple: {where}")
    kept = res["table_bytes_kept_in_memory"]
    what = {
        "memory": "what the tables take beyond ple's fp8 copy in memory",
        "direct": "what the tables take beyond the direct tier's row cache and buffers",
        "cached": "what the tables take beyond the cached rows",
    }.get(ple["tier"] if kept else "", "the tables' in-memory size")
    print(
        f"memory saved       : {_mb(res['memory_saved_bytes'])} of peak resident memory (ple's higher start) = "
        f"{res['memory_saved_share_of_tables']:.0%} of {what} (check: >= {MEMORY_CHECK:.0%})"
    )
    if "memory_saved_anon_bytes" in res and res["memory_saved_share_of_tables"] > 1:
        pad = " " * 21
        print(f"{pad}over 100 %: transformers' peak holds the tables twice, as the model's fp32 copy")
        print(
            f"{pad}(here about {_mb(res['memory_saved_anon_bytes'])} of anonymous memory) and as the checkpoint "
            f"pages it maps while loading ({_mb(res['memory_saved_file_bytes'])} of file pages)"
        )


def run(args) -> int:
    """``ple demo``: both parts (or ``--only`` one); returns the exit status. With ``--ranks N
    --parallel MODE``, the serving workload on several processes instead (:mod:`.parallel`)."""
    inputs = [getattr(args, name, None) for name in ("checkpoint", "config", "tokens", "text")]
    check_destinations([("--output", getattr(args, "output", None))], [p for p in inputs if p is not None])
    if getattr(args, "memory_budget", None) is not None and args.tier != "direct":
        raise CommandLineError(f"--memory-budget is for --tier direct, not --tier {args.tier}")
    table_format = getattr(args, "table_format", None)
    if table_format is not None and (parallel.requested(args) or args.tier == "memory" or args.only == "model"):
        raise CommandLineError(
            "--table-format serves the single-process serving workload's table from a table file: "
            "tier mmap or cached, without --ranks and --only model"
        )
    given = given_source(args)
    if given is not None and (parallel.requested(args) or args.only == "model"):
        raise CommandLineError(
            f"{given}: the token input is the single-process serving workload's: not with --ranks or --only model"
        )
    if parallel.requested(args):
        return parallel.run(args)
    from ple.integrations.demo_model import compare, new_workdir
    from ple.integrations.qwen4_exp import require_transformers

    progress = not args.no_progress and sys.stderr.isatty()
    if args.requests is None:
        args.requests = 6 if args.quick else 16
    only = args.only or ("serving" if args.checkpoint or args.config or table_format else None)
    if only in (None, "model"):
        require_transformers(extra="demo")  # before anything runs: the model part needs transformers
    if (
        only in (None, "serving")
        and not getattr(args, "synthetic_tokens", False)
        and getattr(args, "tokens", None) is None
    ):
        check_real_text()  # and the serving part the tokenizer for its text (ple[demo]), unless told otherwise
    t_start = time.perf_counter()
    tmp = None
    if args.workdir:  # a reused --workdir is refused before anything runs
        work = new_workdir(args.workdir, "ple demo", "its checkpoints and table files")
    else:
        tmp = tempfile.TemporaryDirectory(prefix="ple-demo-")
        work = Path(tmp.name)
    try:
        doc: dict[str, Any] = {}
        checks: dict[str, bool] = {}
        parts = [p for p in ("serving", "model") if only in (None, p)]

        def say(msg: str) -> None:  # on stderr, terminal or not: a long run says what it is doing
            print(f"ple demo: {msg}", file=sys.stderr, flush=True)

        # serving first (and reported first): its peak memory is then this process's own, before the
        # model is built here
        if "serving" in parts:
            say(f"{_part(parts, 'serving')}serving workload: a PLE layer through a Session ...")
            doc["serving"] = run_serving(args, work, progress)
            checks["serving_outputs_equal_reference"] = doc["serving"]["ok"]
            checks["serving_adapters_equal_alone"] = doc["serving"]["adapters"]["ok"]
        if "model" in parts:
            say(f"{_part(parts, 'model')}the user's path: plain transformers vs ple, each in a fresh process ...")
            base = MODEL_SIZES["quick" if args.quick else "default"]
            budget = MODEL_DIRECT_BUDGET if args.memory_budget is None else args.memory_budget
            doc["model"] = compare(
                work / "model",
                base,
                seed=args.seed,
                new_tokens=args.new_tokens,
                tier=args.tier,
                progress=progress,
                say=lambda msg: say(f"  {msg}"),
                memory_budget=budget,
            )
            checks.update(_model_checks(doc["model"]))
        doc["checks"] = checks
        doc["ok"] = all(checks.values())
        doc["wall_seconds"] = time.perf_counter() - t_start
        if args.output:
            Path(args.output).write_text(json.dumps(doc, indent=1))
        if args.json:
            print(json.dumps(doc, indent=1))
            return 0 if doc["ok"] else 1
        if "serving" in doc:
            res = doc["serving"]
            what = "one PLE layer at the published geometry" if res["published_geometry"] else "one PLE layer"
            print(f"== {_part(parts, 'serving')}serving: {what} through a Session ==")
            print_serving(res)
            print()
        if "model" in doc:
            _print_model(doc["model"], _part(parts, "model"))
            print()
            if args.workdir:
                ck = doc["model"]["checkpoint"]
                print(f"kept   : {ck['published']} (a qwen4_exp checkpoint, fp8 tables: try the library on it)")
                print(f"         {ck['plain']} (its fp32 copy for plain transformers)")
                print()
        failed = [k for k, v in checks.items() if not v]
        n = len(checks)
        print(
            f"checks : {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)} ({n} check{'s' if n != 1 else ''})"
        )
        print(f"wall   : {doc['wall_seconds']:.1f} s")
        return 0 if doc["ok"] else 1
    finally:
        if tmp is not None:
            tmp.cleanup()
