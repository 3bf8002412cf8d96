"""Table lookup throughput: in memory vs memory-mapped (page-cached and cold), with and without
prefetch overlapping a simulated projection GEMM.

    python benchmarks/table_bench.py [--rows 4000000] [--tokens 256] [--out out/table_bench.json]

Builds a dense fp8 table file (random rows, global scale) in a temporary folder, then runs the
registered cases side by side. "cold" evicts the file from the page cache before every batch with
``posix_fadvise(DONTNEED)`` (the mapping is dropped first: mapped pages are not evicted). The
GEMM is ``[T, E] @ [E, HC*H]``, the published key projection (2560 -> 10240). Each case checks its
rows against the reference lookup; ratios are only reported for cases that passed. Prints a
markdown table and writes JSON (machine, versions, medians).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ple.commands.bench.runner import machine_info, versions
from ple.table import MemoryTable, MmapTable
from ple.table.files.writer import TableFileWriter
from ple.table.lookup import gather_dequant_reference

HEAD_DIM, HEADS, E, HCH = 160, 16, 2560, 10240


def build_file(path: Path, rows: int, shard_rows: int = 1 << 20) -> None:
    g = torch.Generator().manual_seed(0)
    with TableFileWriter(path, rows, HEAD_DIM, "fp8", shard_rows, "bench", force=True) as w:
        w.set_global_scale(torch.tensor([0.01]))
        for k in range(-(-rows // shard_rows)):
            n = min(rows, (k + 1) * shard_rows) - k * shard_rows
            b = torch.randint(0, 0x7E, (n, HEAD_DIM), generator=g, dtype=torch.uint8)  # finite, positive fp8
            w.write_shard(k, b.view(torch.float8_e4m3fn))


def drop_page_cache(path: Path) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


class Ctx:
    def __init__(self, args, path: Path):
        self.args = args
        self.path = path
        g = torch.Generator().manual_seed(1)
        self.batches = [
            torch.randint(0, args.rows, (args.tokens, HEADS), generator=g, dtype=torch.int64)
            for _ in range(args.batches)
        ]
        self.emb = torch.randn(args.tokens, E, dtype=torch.bfloat16)
        self.w_key = torch.randn(E, HCH, dtype=torch.bfloat16) / E**0.5
        self._mem = None

    def memory_table(self) -> MemoryTable:
        if self._mem is None:
            t = MmapTable.open(self.path)
            self._mem = MemoryTable(t.data.clone(), t.scale.clone())
            t.close()
        return self._mem

    def gemm(self) -> None:
        torch.mm(self.emb, self.w_key)


def _check(table, ids, dtype, ref_table) -> bool:
    return torch.equal(table.lookup(ids, dtype), gather_dequant_reference(ref_table.data, ref_table.scale, ids, dtype))


def run_lookup(ctx: Ctx, kind: str, overlap: str) -> dict:
    """kind: memory | cached | cold; overlap: none (lookup only) | serial (lookup then GEMM) |
    prefetch (next batch's lookup prefetched while the GEMM runs)."""
    dtype = torch.bfloat16
    cold = kind == "cold"
    times = []
    ok = True
    ref = ctx.memory_table()

    def open_table():
        if kind == "memory":
            return ref
        if warm is not None:
            return warm
        if cold:
            gc.collect()
            drop_page_cache(ctx.path)
        return MmapTable.open(ctx.path)

    warm = None
    if kind == "cached":  # page in (and map) the rows the batches touch; measure on that mapping
        warm = MmapTable.open(ctx.path)
        for ids in ctx.batches:
            warm.lookup(ids, dtype)
    batches = ctx.batches
    if overlap == "prefetch":
        table = open_table()
        t0 = time.perf_counter()
        h = table.start_prefetch(batches[0], dtype)
        for i in range(len(batches)):
            tb = time.perf_counter()
            rows = h.wait(batches[i])
            nxt = table.start_prefetch(batches[i + 1], dtype) if i + 1 < len(batches) else None
            ctx.gemm()
            if i == 0:
                ok = ok and torch.equal(rows, gather_dequant_reference(ref.data, ref.scale, batches[0], dtype))
            h.release()
            h = nxt
            times.append(time.perf_counter() - tb)
        total = time.perf_counter() - t0
        if table is not ref:
            table.close()
    else:
        total = 0.0
        for i, ids in enumerate(batches):
            table = open_table() if (cold or i == 0) else table
            tb = time.perf_counter()
            rows = table.lookup(ids, dtype)
            if overlap == "serial":
                ctx.gemm()
            dt = time.perf_counter() - tb
            times.append(dt)
            total += dt
            if i == 0:
                ok = ok and torch.equal(rows, gather_dequant_reference(ref.data, ref.scale, ids, dtype))
            if cold and table is not ref:
                table.close()
                del table
        if not cold and table is not ref:
            table.close()
    n_rows = len(batches) * batches[0].numel()
    return {
        "median_batch_ms": statistics.median(times) * 1e3,
        "min_batch_ms": min(times) * 1e3,
        "total_s": total,
        "rows_per_s": n_rows / total,
        "MB_per_s": n_rows * HEAD_DIM / total / 1e6,
        "correct": bool(ok),
    }


def run_gemm(ctx: Ctx) -> dict:
    ctx.gemm()
    times = []
    for _ in ctx.batches:
        t = time.perf_counter()
        ctx.gemm()
        times.append(time.perf_counter() - t)
    return {
        "median_batch_ms": statistics.median(times) * 1e3,
        "min_batch_ms": min(times) * 1e3,
        "total_s": sum(times),
        "correct": True,
    }


CASES = {
    "gemm_only": lambda c: run_gemm(c),
    "memory": lambda c: run_lookup(c, "memory", "none"),
    "mmap_cached": lambda c: run_lookup(c, "cached", "none"),
    "mmap_cold": lambda c: run_lookup(c, "cold", "none"),
    "memory+gemm serial": lambda c: run_lookup(c, "memory", "serial"),
    "memory+gemm prefetch": lambda c: run_lookup(c, "memory", "prefetch"),
    "mmap_cached+gemm serial": lambda c: run_lookup(c, "cached", "serial"),
    "mmap_cached+gemm prefetch": lambda c: run_lookup(c, "cached", "prefetch"),
    "mmap_cold+gemm serial": lambda c: run_lookup(c, "cold", "serial"),
    "mmap_cold+gemm prefetch": lambda c: run_lookup(c, "cold", "prefetch"),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4_000_000, help="table rows (x 160 bytes of fp8)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per batch (x 16 heads)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--dir", default=None, help="folder for the table file (default: a temporary one)")
    p.add_argument("--out", default="out/table_bench.json")
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]  # the numbers are only as quiet as the machine
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; known: {list(CASES)}")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "bench.ple"
        t0 = time.perf_counter()
        build_file(path, args.rows)
        build_s = time.perf_counter() - t0
        ctx = Ctx(args, path)
        results = {}
        for name in names:
            results[name] = CASES[name](ctx)
            print(f"  {name}: {results[name]['median_batch_ms']:.2f} ms/batch", file=sys.stderr)
        cold_works = drop_page_cache(path)
    base = results.get("memory+gemm serial")
    lines = [
        f"table {args.rows} x {HEAD_DIM} fp8 ({args.rows * HEAD_DIM / 1e9:.2f} GB, built in {build_s:.1f} s); "
        f"batch {args.tokens} tokens x {HEADS} heads; GEMM [{args.tokens}, {E}] @ [{E}, {HCH}] bf16; "
        f"torch threads {torch.get_num_threads()}; load average before {load_before:.1f}, after {os.getloadavg()[0]:.1f}",
        "",
        "| case | median ms/batch | min ms/batch | rows/s | MB/s | vs memory+gemm serial | correct |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for name, r in results.items():
        ratio = ""
        if base and r["correct"] and base["correct"] and name != "memory+gemm serial" and "gemm" in name:
            ratio = f"{r['median_batch_ms'] / base['median_batch_ms']:.2f}x"
        rows_s = f"{r['rows_per_s']:.3g}" if "rows_per_s" in r else ""
        mb_s = f"{r['MB_per_s']:.0f}" if "MB_per_s" in r else ""
        lines.append(
            f"| {name} | {r['median_batch_ms']:.2f} | {r['min_batch_ms']:.2f} | {rows_s} | {mb_s} | {ratio} "
            f"| {'yes' if r['correct'] else 'NO'} |"
        )
    print("\n".join(lines))
    report = {
        "config": {**vars(args), "head_dim": HEAD_DIM, "heads": HEADS, "cold_eviction": cold_works},
        "build_s": build_s,
        "results": results,
    }
    write_report(args.out, report, load_before)
    return 0 if all(r["correct"] for r in results.values()) else 1


def write_report(out: str | Path, report: dict, load_before: float) -> None:
    """Write ``report`` as JSON with the machine (ple bench's description, plus the load average before
    and after the run) and the versions."""
    machine = {**machine_info(), "load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "versions": versions(), **report}, indent=2))
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
