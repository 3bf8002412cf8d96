"""The benchmark runner: check, then time side by side, then report (markdown, JSON, PNG).

For every selected case the runner builds the inputs, calls ``ple`` and ``transformers`` once
and checks ple's output; a case whose check fails (or raises) is reported as refused, with no
timings. Then each repetition runs ``ple``, ``transformers`` and ``floor`` in rotating order (so
drift on a shared machine hits all three alike), each after the case's untimed ``reset``; the
report gives medians and their ratios. ``--profile CASE`` instead splits ple's time into stages.

Before the first case the runner says how long the run should take (an estimate from one GEMM
timed per dtype on this machine: bf16 without bf16 instructions takes hours at the published
geometry), then reports each case as it goes (``[i/N]``, time left) and, within a long case, its
timing rounds.

Exit status: 0 when every selected case passed its check, 1 when one was refused, 2 for bad
arguments. Targets that are not met are reported, not failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ple.commands.bench import cases as bench_cases
from ple.commands.bench.cases import Case, Fixture, Geometry, Prepared
from ple.commands.bench.timing import NOISY, measure, median_ms, spread, sync_of
from ple.common import argtypes
from ple.errors import CommandLineError, PLEError

__all__ = [
    "LIST_SCHEMA",
    "SCHEMA",
    "add_arguments",
    "case_fields",
    "main",
    "run",
    "run_case",
    "machine_info",
    "versions",
    "markdown_table",
]

SCHEMA = "ple-benchmarks/1"
LIST_SCHEMA = "ple-bench-cases/1"
ROUND_LOG_SECONDS = 20.0
"""Within a case, a timing round is reported when this long has passed since the last line."""
FLOORS_PER_ROUND = 5.0
"""A timing round (ple, transformers, the floor) costs about this many floor GEMMs (ple ~1.2,
transformers ~2-3): the estimate's unit."""
DEFAULT_REPEAT = 3
DEFAULT_MAX_REPEAT = 5
QUICK_REPEAT = 2


# ---------------------------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser`` (used by ``ple bench`` and ``python -m ple.commands.bench``)."""
    parser.add_argument(
        "--cases",
        default=None,
        help="comma-separated case names, prefixes or globs (default: all). Known: "
        + ", ".join(c.name for c in bench_cases.CASES),
    )
    parser.add_argument("--list", action="store_true", help="list the cases and exit (with --json: one JSON document)")
    parser.add_argument(
        "--repeat",
        type=argtypes.positive_int,
        default=None,
        help=f"timed runs per implementation (default {DEFAULT_REPEAT}; {QUICK_REPEAT} with --quick)",
    )
    parser.add_argument(
        "--max-repeat",
        type=argtypes.positive_int,
        default=None,
        help=f"extra rounds while a series is noisy (max/min > {NOISY}), up to this many samples "
        f"(default {DEFAULT_MAX_REPEAT}; --repeat with --quick)",
    )
    parser.add_argument(
        "--warmup", type=argtypes.non_negative_int, default=1, help="untimed runs before timing (default 1)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny geometry and few repeats: a smoke run")
    parser.add_argument("--table-base", type=int, default=None, help="ngram_vocab_size_base of the reduced table")
    parser.add_argument(
        "--synthetic-tokens", action="store_true", help="uniform random tokens instead of real text (ple.data.realtext)"
    )
    parser.add_argument(
        "--memory-budget",
        type=argtypes.byte_size,
        default=None,
        metavar="SIZE",
        help="serve ple's table from the direct tier (a table file read with O_DIRECT) keeping SIZE of rows in "
        "memory, a size with its unit (64MiB, 1GiB, 512MB): half the rows a warm-up of the same text reads most, half a running cache (default: the "
        "table in memory)",
    )
    parser.add_argument("--device", type=argtypes.device, default="cpu", help="torch device (default cpu)")
    parser.add_argument(
        "--threads", type=argtypes.positive_int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the report as one JSON document on stdout instead of the table"
    )
    parser.add_argument("--output", default=None, metavar="PATH", help="also write the JSON report to this file")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write a chart of the medians")
    parser.add_argument("--markdown", default=None, metavar="PATH", help="also write the table to a file")
    parser.add_argument("--profile", default=None, metavar="CASE", help="split ple's time in CASE into stages")
    parser.add_argument("--seed", type=argtypes.non_negative_int, default=0, help="seed of the weights and inputs")
    parser.add_argument("-q", "--quiet", action="store_true", help="only print the table")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ple.commands.bench",
        description="Benchmark the PLE layer against transformers' qwen4_exp module.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except CommandLineError as e:
        parser.error(str(e))  # exit status 2 with the usage, as ``ple bench`` does
    except PLEError as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------------------- environment


_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def _cpu_flags() -> list[str]:
    """The instruction-set flags that decide GEMM speed (bf16 needs avx512_bf16 / amx_bf16)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in _FLAGS_OF_NOTE if x in have]
    except OSError:
        pass
    return []


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """CPU model, cores, torch threads, memory and (for CUDA) the accelerator."""
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cpu_flags": _cpu_flags(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if hasattr(os, "getloadavg"):
        info["load_average"] = list(os.getloadavg())  # other work on the machine makes timings noisy
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    dev = torch.device(device)
    info["device"] = str(dev)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info["accelerator"] = props.name
        info["accelerator_memory_bytes"] = props.total_memory
    return info


def versions() -> dict[str, str | None]:
    from ple import __version__ as ple_version

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "ple": ple_version,
    }
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    from ple.kernels import native as _native

    # which CPU path the layer and the ids ran: the C kernels, or (no compiler, PLE_NATIVE=0) PyTorch
    # (with their instruction set, threads: PyTorch's OpenMP team or threads started per call, and
    # the fused kernel's prefetch plan)
    if _native.available():
        plan = _native.prefetch_lines()
        plan_text = "whole runs" if plan == "all" else f"{plan} lines"
        out["cpu_kernels"] = (
            f"C (ple.kernels.native), {_native.current_isa()}, {_native.team()} threads, prefetch {plan_text}"
        )
    else:
        out["cpu_kernels"] = "PyTorch"
    from ple.kernels import cpu_gemm

    out["cpu_gemm"] = cpu_gemm.describe()  # the bf16 projections' GEMM on the CPU: packed weights or F.linear
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


# ---------------------------------------------------------------------------------------------- estimate


def _gemm_flops_per_second(geo: Geometry, dtype: torch.dtype, device: torch.device, rows: int = 64) -> float:
    """This machine's rate for the projections' GEMM (``[rows, E] x [E, HC*H + H]``) in ``dtype``:
    the best of two calls after one untimed."""
    g = torch.Generator().manual_seed(0)
    cfg = geo.config
    x = torch.randn(rows, geo.embed_dim, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(geo.embed_dim, cfg.hc_hidden_size + cfg.hidden_size, generator=g).to(device=device, dtype=dtype)
    sync = sync_of(device)
    best = float("inf")
    for i in range(3):
        sync()
        t0 = time.perf_counter()
        x @ w
        sync()
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2.0 * x.shape[0] * w.shape[0] * w.shape[1] / max(best, 1e-9)


def estimate_seconds(
    cases: Sequence[Case], geo: Geometry, device: torch.device, repeat: int, warmup: int, max_repeat: int
) -> dict[str, Any]:
    """How long the timed part of a run should take here, before anything is built: per case, its
    GEMM rows (:func:`ple.commands.bench.cases.gemm_tokens`) x the rate one GEMM of its dtype reaches on this
    machine x :data:`FLOORS_PER_ROUND` per round (warm-up, ``repeat`` rounds and the check; up to
    ``max_repeat`` rounds when timings are noisy). Returns ``{"cases": {name: s}, "low_s", "high_s",
    "gflops": {dtype: rate}}``."""
    cfg = geo.config
    flops_per_row = 2.0 * geo.embed_dim * (cfg.hc_hidden_size + cfg.hidden_size)
    rates = {dt: _gemm_flops_per_second(geo, dt, device) for dt in dict.fromkeys(c.dtype for c in cases if c.dtype)}
    per_round = {
        c.name: 0.0
        if c.dtype is None
        else FLOORS_PER_ROUND * bench_cases.gemm_tokens(c, geo) * flops_per_row / rates[c.dtype]
        for c in cases
    }
    return {
        "cases": {n: s * (warmup + repeat + 1) for n, s in per_round.items()},
        "low_s": sum(per_round.values()) * (warmup + repeat + 1),
        "high_s": sum(per_round.values()) * (warmup + max(repeat, max_repeat) + 1),
        "gflops": {bench_cases.dtype_name(dt): r / 1e9 for dt, r in rates.items()},
    }


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def describe_estimate(est: dict[str, Any], cases: Sequence[Case], device: torch.device) -> str:
    """One line: the expected duration, the GEMM rates it rests on, and a hint when it is long."""
    low, high = est["low_s"], est["high_s"]
    span = _duration(low) if _duration(low) == _duration(high) else f"{_duration(low)} to {_duration(high)}"
    rates = ", ".join(f"{k} {v:,.3g} GFLOP/s" for k, v in est["gflops"].items())
    text = f"expected to take about {span} of timed runs" + (f" (one GEMM here: {rates})" if rates else "")
    bf16, fp32 = est["gflops"].get("bf16"), est["gflops"].get("fp32")
    if bf16 is not None and fp32 is not None and bf16 < fp32 / 2:
        text += f"; bf16 GEMMs run {fp32 / bf16:.0f}x slower than fp32 here, so the bf16 cases are slow"
    elif bf16 is not None and device.type == "cpu" and not {"avx512_bf16", "amx_bf16"} & set(_cpu_flags()):
        text += "; this CPU has no bf16 instructions, so the bf16 cases are slow"
    if low > 600:
        text += "; for a shorter run: --quick, or --cases with fewer cases (ple bench --list)"
    return text


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def case_fields(case: Case) -> dict[str, Any]:
    """What a report says of a case before running it (its entry in ``--list --json``)."""
    return {
        "name": case.name,
        "kind": case.kind,
        "dtype": bench_cases.dtype_name(case.dtype),
        "description": case.description,
        "targets": {"speedup_min": case.targets.speedup_min, "floor_max": case.targets.floor_max},
    }


def run_case(
    case: Case,
    fixture: Fixture,
    repeat: int,
    warmup: int,
    log: Callable[[str], None] = lambda s: None,
    prepared: Prepared | None = None,
    max_repeat: int | None = None,
) -> dict[str, Any]:
    """Build (unless ``prepared`` is given), check, then time one case; returns its JSON record.

    A failed or raising check gives ``status`` "check_failed" / "error" and no timings at all.
    """
    rec: dict[str, Any] = {
        **case_fields(case),
        "status": None,
        "shape": None,
        "tokens": None,
        "check": None,
        "median_ms": {"ple": None, "transformers": None, "floor": None},
        "ratios": {"speedup_vs_transformers": None, "ple_over_floor": None, "transformers_over_floor": None},
        "target_met": None,
        "min_ms": {},
        "spread": {},
        "samples_ms": {},
        "aux_median_ms": {},
        "notes": "",
    }
    sync = sync_of(fixture.device)
    t0 = time.perf_counter()
    try:
        prep = prepared if prepared is not None else case.build(fixture)
    except Exception as e:  # a case that cannot be built is refused, the others still run
        rec["status"] = "error"
        rec["check"] = {"passed": False, "detail": f"build failed: {type(e).__name__}: {e}", "metrics": {}}
        log(traceback.format_exc())
        return rec
    rec.update(shape=prep.shape, tokens=prep.tokens, notes=prep.notes)
    log(f"[{case.name}] built in {time.perf_counter() - t0:.1f}s; checking")
    try:
        if prep.reset is not None:
            prep.reset()
        ple_out = prep.ple()
        sync()
        if prep.reset is not None:
            prep.reset()
        tf_out = prep.transformers()
        sync()
        result = prep.check(ple_out, tf_out)
        del ple_out, tf_out
    except Exception as e:
        rec["status"] = "error"
        rec["check"] = {"passed": False, "detail": f"check raised {type(e).__name__}: {e}", "metrics": {}}
        log(traceback.format_exc())
        return rec
    rec["check"] = {"passed": bool(result.passed), "detail": result.detail, "metrics": result.metrics}
    if not result.passed:
        rec["status"] = "check_failed"
        log(f"[{case.name}] CHECK FAILED, not timed: {result.detail}")
        return rec
    log(f"[{case.name}] check passed ({result.detail}); timing {repeat} x")
    fns = {"ple": prep.ple, "transformers": prep.transformers}
    if prep.floor is not None:
        fns["floor"] = prep.floor
    t_timing = last_line = time.perf_counter()
    planned = f"{warmup + repeat}" + ("+" if max_repeat is not None and max_repeat > repeat else "")

    def on_round(i: int) -> None:
        nonlocal last_line
        now = time.perf_counter()
        if now - last_line >= ROUND_LOG_SECONDS:
            last_line = now
            log(f"[{case.name}] timing round {i + 1} of {planned} done ({now - t_timing:.0f} s)")

    samples = measure(fns, repeat, warmup, prep.reset, sync, max_repeat, on_round=on_round)
    aux = measure(prep.aux, repeat, warmup, prep.reset, sync, max_repeat) if prep.aux else {}
    med = {k: median_ms(samples.get(k)) for k in ("ple", "transformers", "floor")}
    speedup = _ratio(med["transformers"], med["ple"])
    over_floor = _ratio(med["ple"], med["floor"])
    rec.update(
        status="ok",
        median_ms=med,
        ratios={
            "speedup_vs_transformers": speedup,
            "ple_over_floor": over_floor,
            "transformers_over_floor": _ratio(med["transformers"], med["floor"]),
        },
        # the targets are the published geometry's: a smaller one (--quick) is not judged against them
        target_met=case.targets.met(speedup, over_floor) if fixture.geometry == bench_cases.PUBLISHED else None,
        min_ms={k: min(v) * 1e3 for k, v in samples.items()},
        spread={k: spread(v) for k, v in samples.items()},
        samples_ms={k: [x * 1e3 for x in v] for k, v in samples.items()},
        aux_median_ms={k: median_ms(v) for k, v in aux.items()},
    )
    log(
        f"[{case.name}] ple {_fmt(med['ple'])} ms, transformers {_fmt(med['transformers'])} ms, floor {_fmt(med['floor'])} ms"
    )
    return rec


# ---------------------------------------------------------------------------------------------- reporting


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def markdown_table(records: list[dict[str, Any]], geometry: Geometry | None = None, gemm: str | None = None) -> str:
    """One row per case: medians (ms), ratios, target, whether it is met (refused cases say why),
    and the noise: the largest max / min among the case's timing series (1.00 = steady); then a line
    naming the floor's GEMM (``gemm``: :func:`ple.kernels.cpu_gemm.describe`) and one naming the geometry, when
    given."""
    head = (
        "| case | shape | tokens | ple ms | transformers ms | floor ms | speedup vs tf | ple / floor | target | met "
        "| noise |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|\n"
    )
    rows = []
    for r in records:
        t = bench_cases.Targets(r["targets"]["speedup_min"], r["targets"]["floor_max"])
        if r["status"] != "ok":
            detail = (r.get("check") or {}).get("detail", "")
            rows.append(
                f"| {r['name']} | {r['shape'] or '-'} | {r['tokens'] or '-'} | REFUSED ({r['status']}: "
                f"{detail.replace('|', '/')}) | - | - | - | - | {t.describe()} | - | - |"
            )
            continue
        m, q = r["median_ms"], r["ratios"]
        met = {True: "yes", False: "NO", None: "-"}[r["target_met"]]
        sp = "-" if q["speedup_vs_transformers"] is None else f"{q['speedup_vs_transformers']:.2f}x"
        fl = "-" if q["ple_over_floor"] is None else f"{q['ple_over_floor']:.2f}"
        spreads = list(r.get("spread", {}).values())
        noise = f"{max(spreads):.2f}" if spreads else "-"
        rows.append(
            f"| {r['name']} | {r['shape']} | {r['tokens']} | {_fmt(m['ple'])} | {_fmt(m['transformers'])} | "
            f"{_fmt(m['floor'])} | {sp} | {fl} | {t.describe()} | {met} | {noise} |"
        )
    tail = f"\nfloor: the projections' GEMM as the layer runs it here: {gemm}" if gemm is not None else ""
    if geometry is not None and geometry != bench_cases.PUBLISHED:
        note = "targets: the published geometry's; this geometry's ratios are not judged against them (met: -)"
        tail = f"\n{note}{tail}"
    tail += f"\n{geometry.describe()}\n" if geometry is not None else ("\n" if tail else "")
    return head + "\n".join(rows) + "\n" + tail


def _report(
    args, geometry: Geometry, records: list[dict[str, Any]], repeat: int, device: torch.device, load_start=None
) -> dict:
    machine = machine_info(device)
    if load_start is not None:
        machine["load_average_start"] = load_start
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "versions": versions(),
        "settings": {
            "repeat": repeat,
            "warmup": args.warmup,
            "quick": bool(args.quick),
            "device": str(device),
            "seed": args.seed,
            "geometry": geometry.to_dict(),
            "geometry_name": geometry.describe(),
            "checks": {"fp32_tol": bench_cases.FP32_TOL, "bf16_atol": bench_cases.BF16_ATOL},
        },
        "cases": records,
    }


# ---------------------------------------------------------------------------------------------- entry point


def _geometry(args) -> Geometry:
    import dataclasses

    geo = bench_cases.QUICK if args.quick else bench_cases.PUBLISHED
    if args.table_base is not None:
        if args.table_base < 2:
            raise CommandLineError(f"--table-base must be >= 2, got {args.table_base}")
        geo = dataclasses.replace(geo, table_base=args.table_base)
    if getattr(args, "synthetic_tokens", False):
        geo = dataclasses.replace(geo, token_source="synthetic")
    return geo


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or ``--list`` / ``--profile``) as ``args`` say; returns the exit status."""
    from ple.commands.report import check_destinations
    from ple.runtime import tune_host_allocator

    check_destinations([("--output", args.output), ("--plot", args.plot)], [])

    # process-wide, so ple and transformers run on the same allocator (see docs/PERFORMANCE.md)
    tune_host_allocator()
    out = sys.stdout

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    if args.list:
        if args.json:
            print(
                json.dumps({"schema": LIST_SCHEMA, "cases": [case_fields(c) for c in bench_cases.CASES]}, indent=2),
                file=out,
            )
            return 0
        for c in bench_cases.CASES:
            print(
                f"{c.name:22s} {c.kind:8s} {bench_cases.dtype_name(c.dtype):6s} {c.targets.describe():28s} "
                f"{c.description}",
                file=out,
            )
        return 0
    repeat = args.repeat if args.repeat is not None else (QUICK_REPEAT if args.quick else DEFAULT_REPEAT)
    max_repeat = args.max_repeat
    if max_repeat is None:
        max_repeat = repeat if args.quick else max(repeat, DEFAULT_MAX_REPEAT)
    # wrong values of the command line: exit status 2 with the usage (ple.commands.cli), like argparse's own
    if repeat < 1 or args.warmup < 0 or max_repeat < repeat:
        raise CommandLineError(
            f"need --repeat >= 1, --warmup >= 0 and --max-repeat >= --repeat, got {repeat}, {args.warmup} "
            f"and {max_repeat}"
        )
    try:
        selected = bench_cases.select_cases(args.profile if args.profile else args.cases)
    except ValueError as e:
        raise CommandLineError(str(e)) from None
    geometry = _geometry(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():  # the machine, not the command line: exit 1
        raise PLEError(f"--device {args.device}: CUDA is not available on this machine")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    fixture = Fixture(geometry, device, seed=args.seed, memory_budget=getattr(args, "memory_budget", None))

    if args.profile:
        from ple.commands.bench.profile import profile_case

        if len(selected) != 1:
            raise CommandLineError(
                f"--profile needs one case, {args.profile!r} matches {', '.join(c.name for c in selected)}"
            )
        return profile_case(selected[0], fixture, repeat, args.warmup, out=out, log=log, as_json=args.json)

    log(f"ple bench: {len(selected)} case(s) on {device}, repeat {repeat}, warmup {args.warmup}, {geometry.describe()}")
    est = estimate_seconds(selected, geometry, device, repeat, args.warmup, max_repeat)
    log(f"ple bench: {describe_estimate(est, selected, device)}")
    t0 = time.perf_counter()
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    records = []
    for i, c in enumerate(selected):
        log(f"ple bench: [{i + 1}/{len(selected)}] {c.name}")
        records.append(run_case(c, fixture, repeat, args.warmup, log=log, max_repeat=max_repeat))
        if i + 1 < len(selected):
            spent = time.perf_counter() - t0
            done_est = sum(est["cases"][d.name] for d in selected[: i + 1])
            pace = spent / done_est if done_est > 1.0 else 1.0  # how the estimate has held so far
            left = pace * sum(est["cases"][d.name] for d in selected[i + 1 :])
            log(
                f"ple bench: [{i + 1}/{len(selected)}] {c.name} finished; {_duration(spent)} so far, about {_duration(left)} left"
            )
    log(f"ple bench: done in {time.perf_counter() - t0:.1f}s")
    report = _report(args, geometry, records, repeat, device, load_start)
    report["settings"]["max_repeat"] = max_repeat
    report["elapsed_s"] = time.perf_counter() - t0
    # on the CPU the table says what the floor is here (the GEMM the layer runs)
    table = markdown_table(records, geometry, report["versions"]["cpu_gemm"] if device.type == "cpu" else None)
    served = fixture.table_report()
    if served is not None:
        report["settings"]["table"] = served
        rates = ", ".join(
            f"{k} {v['hit_rate']:.1%}" for k, v in served.items() if isinstance(v, dict) and v["hit_rate"] is not None
        )
        budget = argtypes.shown_size(served["memory_budget_bytes"])
        table += f"ple's table: direct tier, memory budget {budget}; cache hit rate {rates or 'n/a'}\n"
    if args.json:
        print(json.dumps(report, indent=2), file=out)
    else:
        print(table, file=out, end="")
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        log(f"ple bench: wrote {args.output}")
    if args.plot:
        from ple.commands.bench.plot import plot_report

        plot_report(report, args.plot)
        log(f"ple bench: wrote {args.plot}")
    refused = [r["name"] for r in records if r["status"] != "ok"]
    if refused:
        print(f"ple bench: refused (check failed or errored): {', '.join(refused)}", file=sys.stderr)
        return 1
    return 0
