"""Training a PLE table where it lives: a step's cost, peak memory beside a dense gradient and Adam,
rows touched per million real-text tokens and the adapter's size.

    python benchmarks/train_bench.py [--part step rss rows spill] [--tokens 512] [--steps 20]
        [--dir /tmp] [--format fp8] [--million 1] [--spill-steps 200] [--spill-budget 0.25]
        [--out train_bench.json]

One PLE layer at the published geometry (H 2560, HC 4, E 2560, N 3, 16 heads of 160, K 4; fp32
weights and activations, random weights) over a table file of the published size (320,001,536 rows x
160: fp8 47.7 GiB, q4_0 26.8 GiB). The file is a *sparse* table file (``TableFileWriter(sparse=True)``:
every row a hole, read as zeros; no disk space used); a dense file of that size takes about as long
to write as this machine's disk allows and is not needed for what is measured here (the rows' values
do not change a step's work; the memory measured is the process's, not the page cache's). Tokens are
real text (:mod:`ple.data.realtext`).

- ``step`` (side by side, medians of ``--repeats``): the projections alone (``key_proj`` and
  ``value_proj`` over the looked-up rows ``[T, E]``: forward, the weights' gradients and the rows'
  gradient), the layer's training step with the table frozen (``forward_padded`` + backward), and
  with the table trained (the same + the row-sparse gradient + a ``SparseAdam`` step; and fused into
  the backward). Ratios: trained-table step / projections (goal 1.3x), trained / frozen table.
- ``rss`` (in a child process of its own, so its peak RSS is its own): ``--steps`` steps of table-only
  fine-tuning (SparseAdam) over the direct tier (64 MiB of row cache), each of ``--tokens`` new
  real-text tokens; peak RSS (``VmHWM``) before and after, the overlay's and the optimizer's bytes, an
  adapter saved; beside the bytes a dense fp32 gradient and Adam's two states would take for the
  whole table.
- ``spill``: SparseAdam over real text with the trained rows and states in memory up to a budget
  smaller than the rows touched: the recently used ones kept (least recently used leave) against the
  first ones made, side by side (:func:`part_spill`).
- ``rows``: distinct table rows that ``--million`` million real-text tokens read (requests of 512
  tokens, the published layer's hashing; the built-in text holds 484,404 tokens: beyond them the
  count is extrapolated from the last two measures), and the adapter file that training on them
  makes (ids and fp32 rows; bf16 rows: ``rss`` saves one of that size).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ple.commands.bench.runner import machine_info, versions
from ple.config import PLEConfig
from ple.layer import PLELayer
from ple.table import DirectTable, MmapTable
from ple.table.files.table_file import hash_layout
from ple.table.files.writer import TableFileWriter

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "examples" / "published-config.json"


def config() -> PLEConfig:
    return PLEConfig.from_dict(json.loads(PUBLISHED.read_text()))


def sparse_table(path: Path, cfg: PLEConfig, fmt: str) -> Path:
    """A sparse table file of the published layer's geometry (every row a hole; global scales 1)."""
    lay = cfg.layout(0)
    if path.exists():
        return path
    layout = hash_layout(cfg.layout_fields(0))
    with TableFileWriter(path, lay.padded_rows, lay.head_dim, fmt, lay.shard_rows, layout, sparse=True) as w:
        if fmt in ("fp8", "nvfp4"):
            w.set_global_scale(torch.tensor([1.0]))
    return path


def layer_over(table, cfg: PLEConfig, seed: int = 0) -> PLELayer:
    layer = PLELayer(cfg, 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            fan = p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name or "conv" in name else fan**-0.5))
    layer.refresh_weights()
    layer.set_table(table)
    return layer


def text_batches(cfg: PLEConfig, count: int, tokens: int, skip: int = 0) -> list[torch.Tensor]:
    from ple.data.realtext import requests

    reqs = requests(count, tokens, cfg.eos_token_id, skip=skip)
    return [torch.from_numpy(r).view(1, -1) for r in reqs]


def rss_peak_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def cpu_isa() -> str:
    flags = set(machine_info().get("cpu_flags", []) or [])
    if "amx_tile" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else "other"


# ---------------------------------------------------------------------------------------------- step
def part_step(args, path: Path) -> dict:
    import ple.train as pt

    cfg = config()
    batches = text_batches(cfg, args.repeats + 2, args.tokens)
    hidden = [
        torch.randn(1, args.tokens, cfg.hc_hidden_size, generator=torch.Generator().manual_seed(i))
        for i in range(len(batches))
    ]

    def timed(fn) -> list[tuple[float, float]]:
        """``(wall, cpu)`` seconds of each run (the process's CPU time: with one thread, what the step
        computed, whatever else ran on the machine)."""
        out = []
        for i in range(len(batches)):
            t, c = time.perf_counter(), time.process_time()
            fn(i)
            out.append((time.perf_counter() - t, time.process_time() - c))
        return out[2:]  # the first two warm up

    # the projections alone, over the rows the lookup gives
    layer = layer_over(MmapTable.open(path), cfg)
    emb_rows = [
        layer.table.lookup(torch.zeros(args.tokens, cfg.layout(0).num_heads, dtype=torch.int64), torch.float32) + 0.01
        for _ in range(1)
    ]
    wk = layer.key_proj.detach().clone().requires_grad_(True)
    wv = layer.value_proj.detach().clone().requires_grad_(True)

    def proj(i):
        emb = emb_rows[0].clone().requires_grad_(True)
        k, v = F.linear(emb, wk), F.linear(emb, wv)
        (k.sum() + v.sum()).backward()
        wk.grad = wv.grad = None

    def step(layer, opt, written=True):
        def run(i):
            PLELayer.written_backward = written
            try:
                out = layer.forward_padded(hidden[i], batches[i])
                out.sum().backward()
            finally:
                PLELayer.written_backward = True
            if opt is not None:
                opt.step()
            for p in layer.parameters():
                p.grad = None

        return run

    cases = {}
    cases["projections"] = proj
    frozen = layer_over(MmapTable.open(path), cfg)
    cases["layer, table frozen"] = step(frozen, None)
    trained = layer_over(MmapTable.open(path), cfg)
    opt = pt.SparseAdam(pt.trainable(trained), lr=1e-3)
    cases["layer, table trained (SparseAdam)"] = step(trained, opt)
    fused_layer = layer_over(MmapTable.open(path), cfg)
    fused = pt.SparseAdam(pt.trainable(fused_layer), lr=1e-3, fused=True)
    cases["layer, table trained (fused)"] = step(fused_layer, fused)
    ref_layer = layer_over(MmapTable.open(path), cfg)
    ref_opt = pt.SparseAdam(pt.trainable(ref_layer), lr=1e-3)
    cases["layer, table trained (SparseAdam), autograd of the reference gate and conv"] = step(
        ref_layer, ref_opt, False
    )
    st = path.stat()
    kind = "dense" if st.st_blocks * 512 >= st.st_size * 0.99 else "sparse"
    out: dict = {"tokens": args.tokens, "threads": {}, "table": f"{kind} {frozen.table.format} table file"}
    before = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            # side by side: each case's runs interleaved round by round
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
            for _ in range(args.rounds):
                for name, fn in cases.items():
                    times[name] += timed(fn)
            results = {
                name: {
                    "median_ms": 1e3 * statistics.median(w for w, _ in ts),
                    "median_cpu_ms": 1e3 * statistics.median(c for _, c in ts),
                    "runs": len(ts),
                }
                for name, ts in times.items()
            }
            for key, over in (("median_ms", ""), ("median_cpu_ms", "_cpu")):
                base = results["projections"][key]
                froz = results["layer, table frozen"][key]
                for name in results:
                    results[name]["over_projections" + over] = results[name][key] / base
                    results[name]["over_frozen" + over] = results[name][key] / froz
            out["threads"][str(threads)] = results
    finally:
        torch.set_num_threads(before)
    out["rows_trained"] = len(trained.table.overlay)
    return out


# ---------------------------------------------------------------------------------------------- rss
def part_rss_child(args, path: Path) -> dict:
    import ple.train as pt

    cfg = config()
    lay = cfg.layout(0)
    batches = text_batches(cfg, args.steps, args.tokens)
    table = DirectTable(path, memory_budget=64 << 20)
    layer = layer_over(table, cfg)
    layer.requires_grad_(False)  # the table alone trains: what is measured is its memory
    handles = pt.trainable(layer, spill_dir=args.dir)
    opt = pt.SparseAdam(handles, lr=1e-3)
    start_kb = rss_peak_kb()
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    for ids in batches:
        hidden = torch.randn(1, args.tokens, cfg.hc_hidden_size, generator=g)
        layer.forward_padded(hidden, ids).sum().backward()
        opt.step()
    seconds = time.perf_counter() - t0
    overlay = layer.table.overlay
    adapter = Path(args.dir) / "train-bench-adapter.safetensors"
    pt.save_adapter(adapter, layer)
    mem, spilled = opt.state_nbytes()
    values = lay.padded_rows * lay.head_dim
    doc = {
        "steps": args.steps,
        "tokens_per_step": args.tokens,
        "seconds_per_step": seconds / args.steps,
        "table_file_bytes": path.stat().st_size,
        "table_file_allocated_bytes": path.stat().st_blocks * 512,  # a sparse file's holes take none
        "table_format": table.format,
        "table_rows": lay.padded_rows,
        "rows_trained": len(overlay),
        "overlay_bytes": overlay.nbytes,
        "optimizer_state_bytes": mem,
        "optimizer_spilled_bytes": spilled,
        "peak_rss_before_bytes": start_kb * 1024,
        "peak_rss_bytes": rss_peak_kb() * 1024,
        "adapter_bytes": adapter.stat().st_size,
        "dense_fp32_gradient_bytes": values * 4,
        "dense_adam_states_bytes": values * 8,
        "dense_fp32_table_bytes": values * 4,
        "machine_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    }
    adapter.unlink()
    table.close()
    return doc


def part_rss(args, path: Path) -> dict:
    cmd = [sys.executable, __file__, "--child-rss", "--tokens", str(args.tokens), "--steps", str(args.steps),
           "--dir", args.dir, "--format", args.format, "--table", str(path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    if done.returncode != 0:
        raise RuntimeError(f"the rss child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- spill
@contextlib.contextmanager
def _recency(flag: bool):
    """Stores made within the block keep the recently used records in memory (True) or the first
    ones made (False): the default of ``SlotStore(recency=)`` set for the block."""
    from ple.table.tiers.rowstore import SlotStore

    defaults = SlotStore.__init__.__kwdefaults__
    before = defaults["recency"]
    defaults["recency"] = flag
    try:
        yield
    finally:
        defaults["recency"] = before


def part_spill(args, path: Path) -> dict:
    """SparseAdam over real text with the trained rows and states in memory up to a budget smaller
    than the rows the run touches (``--spill-budget`` of them): the recently used records in memory
    (least recently used leave first) against the first ones made (``recency=False``, the previous
    policy), two runs side by side step by step on the same gradients. A step: the table's lookup of
    the step's ids (what the forward reads, trained rows from the overlay) and the optimizer's step
    on a sparse gradient of the rows read (random values; the backward is not what is measured)."""
    import ple.train as pt
    from ple.ngram import ngram_ids

    cfg = config()
    lay = cfg.layout(0)
    batches = text_batches(cfg, args.spill_steps, args.tokens)
    ids = []
    for b in batches:
        flat = b.reshape(-1)
        qsl = torch.tensor([0, flat.numel()])
        ctx = torch.full((1, cfg.ngram_size - 1), cfg.eos_token_id, dtype=torch.int64)
        ids.append(ngram_ids(flat, qsl, ctx, lay, cfg.eos_token_id))
    touched = int(torch.unique(torch.cat([i.reshape(-1) for i in ids])).numel())
    budget_rows = int(args.spill_budget * touched)
    hd = lay.head_dim
    runs = {}
    for recency in (True, False):
        with _recency(recency):
            layer = layer_over(MmapTable.open(path), cfg)
            layer.requires_grad_(False)
            handles = pt.trainable(layer, memory_budget=budget_rows * 4 * hd, spill_dir=args.dir)
            opt = pt.SparseAdam(handles, lr=1e-3, memory_budget=budget_rows * 8 * hd, spill_dir=args.dir)
        runs[recency] = {"layer": layer, "handle": handles[0], "opt": opt, "times": []}
    g = torch.Generator().manual_seed(0)
    for step_ids in ids:
        rows = torch.unique(step_ids.reshape(-1))
        grad = torch.randn(rows.numel(), hd, generator=g)
        for recency, run in runs.items():
            with _recency(recency):
                t = time.perf_counter()
                run["layer"].table.lookup(step_ids, torch.float32)
                run["handle"].grad = torch.sparse_coo_tensor(
                    rows.view(1, -1), grad, tuple(run["handle"].shape), is_coalesced=True, check_invariants=False
                )
                run["opt"].step()
                run["times"].append(time.perf_counter() - t)
    out: dict = {"steps": len(ids), "tokens_per_step": args.tokens, "rows_touched": touched,
                 "rows_in_memory": budget_rows, "budget_share": args.spill_budget}  # fmt: skip
    ov = {}
    for recency, run in runs.items():
        overlay = run["layer"].table.overlay
        states = run["opt"].row_state(run["handle"]).store
        reads, writes = overlay.spill_traffic
        name = "recent rows in memory" if recency else "first rows in memory"
        out[name] = {
            "median_step_ms": 1e3 * statistics.median(run["times"][2:]),
            "total_s": sum(run["times"]),
            "records_read_from_spill": reads + states.file_reads,
            "records_written_to_spill": writes + states.file_writes,
            "rows_spilled": overlay.spilled_rows,
        }
        ov[recency] = overlay.get(overlay.ids())[1]
    out["same_rows"] = bool(torch.equal(ov[True], ov[False]))  # where a record lives never changes it
    return out


# ---------------------------------------------------------------------------------------------- rows
def part_rows(args) -> dict:
    """Distinct rows read by the first N real-text tokens, N up to the whole built-in text (484,404
    tokens), and the count at ``--million`` million tokens extrapolated from the last two measures
    (a power law: distinct rows grow more slowly than tokens)."""
    from ple.data.realtext import QWEN_ENDOFTEXT, token_documents
    from ple.ngram import ngram_ids

    cfg = config()
    lay = cfg.layout(0)
    length = 512
    target = args.million * 1e6
    docs = [np.append(d, QWEN_ENDOFTEXT) for d in token_documents(int(target))]
    stream = np.concatenate(docs)
    stream = stream[: stream.size - stream.size % length]
    stream = np.where(stream == QWEN_ENDOFTEXT, cfg.eos_token_id, stream)
    reqs = torch.from_numpy(stream).view(-1, length)
    seen = torch.empty(0, dtype=torch.int64)
    step = 64
    marks = sorted({max(step * length, reqs.numel() >> k) for k in (3, 2, 1, 0)})
    points = []
    t0 = time.perf_counter()
    for a in range(0, reqs.shape[0], step):
        chunk = reqs[a : a + step]
        b = chunk.shape[0]
        qsl = torch.arange(0, b * length + 1, length, dtype=torch.int64)
        ctx = torch.full((b, cfg.ngram_size - 1), cfg.eos_token_id, dtype=torch.int64)
        ids = ngram_ids(chunk.reshape(-1), qsl, ctx, lay, cfg.eos_token_id)
        seen = torch.unique(torch.cat([seen, ids.reshape(-1)]))
        done = (a + b) * length
        while marks and done >= marks[0]:
            points.append((done, seen.numel()))
            marks.pop(0)
    (t1, r1), (t2, r2) = points[-2] if len(points) > 1 else points[-1], points[-1]
    slope = float(np.log(r2 / r1) / np.log(t2 / t1)) if t2 > t1 else 1.0
    extrapolated = target > t2 + length  # a request's worth short of the target is a measure of it
    rows = int(r2 * (target / t2) ** slope) if extrapolated else r2
    target = target if extrapolated else t2
    header = 4096  # the safetensors header (under 1 KiB for one layer; rounded up)
    return {
        "request_tokens": length,
        "measured": [{"tokens": t, "distinct_rows": r, "share_of_table": r / lay.padded_rows} for t, r in points],
        "growth_exponent": slope,
        "tokens": int(target),
        "distinct_rows": rows,
        "extrapolated": extrapolated,
        "share_of_table": rows / lay.padded_rows,
        "adapter_fp32_bytes": rows * (8 + 4 * lay.head_dim) + header,
        "adapter_bf16_bytes": rows * (8 + 2 * lay.head_dim) + header,
        "sparse_adam_state_bytes": rows * 8 * lay.head_dim,
        "seconds": time.perf_counter() - t0,
    }


def report(res: dict) -> str:
    lines = [
        f"machine: {res['machine'].get('cpu_model')} ({res['isa']}), {res['machine'].get('cores')} cores, torch threads {res['machine'].get('torch_threads')}"
    ]
    if "step" in res:
        s = res["step"]
        for threads, cases in s["threads"].items():
            lines += ["", f"step, T = {s['tokens']} tokens, fp32, published geometry, {s.get('table', 'sparse fp8 table file')} (mmap), "
                      f"{threads} torch thread(s)",
                      "| case | median ms | / projections | / frozen table | CPU ms | / projections | / frozen |",
                      "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
            for name, c in cases.items():
                lines.append(f"| {name} | {c['median_ms']:.1f} | {c['over_projections']:.2f}x | {c['over_frozen']:.2f}x "
                             f"| {c['median_cpu_ms']:.1f} | {c['over_projections_cpu']:.2f}x | {c['over_frozen_cpu']:.2f}x |")  # fmt: skip
    if "rss" in res:
        r = res["rss"]
        gb = 1e9
        dense = "dense" if r.get("table_file_allocated_bytes", 0) >= r["table_file_bytes"] * 0.99 else "sparse"
        lines += ["", f"fine-tune over a {r['table_file_bytes'] / gb:.1f} GB {dense} {r.get('table_format', '')} table file "
                  "(direct tier, 64 MiB cache), "
                  f"{r['steps']} steps x {r['tokens_per_step']} tokens, table only, SparseAdam:",  # fmt: skip
                  f"  rows trained {r['rows_trained']:,}; overlay {r['overlay_bytes'] / 1e6:.1f} MB, states {r['optimizer_state_bytes'] / 1e6:.1f} MB",
                  f"  peak RSS {r['peak_rss_bytes'] / 1e6:,.0f} MB (before training {r['peak_rss_before_bytes'] / 1e6:,.0f} MB); machine {r['machine_memory_bytes'] / gb:.1f} GB",
                  f"  dense: gradient {r['dense_fp32_gradient_bytes'] / gb:,.1f} GB + Adam {r['dense_adam_states_bytes'] / gb:,.1f} GB "
                  f"(+ fp32 table {r['dense_fp32_table_bytes'] / gb:,.1f} GB)",  # fmt: skip
                  f"  adapter {r['adapter_bytes'] / 1e6:.1f} MB; {r['seconds_per_step']:.2f} s a step"]  # fmt: skip
    if "spill" in res:
        sp = res["spill"]
        lines += ["", f"spill: SparseAdam, {sp['steps']} steps x {sp['tokens_per_step']} real-text tokens, {sp['rows_touched']:,} rows "
                  f"touched, {sp['rows_in_memory']:,} in memory ({100 * sp['budget_share']:.0f} %); same rows both ways: {sp['same_rows']}",
                  "| policy | median step ms | records read from spill | written to spill |", "|---|---:|---:|---:|"]  # fmt: skip
        for name in ("recent rows in memory", "first rows in memory"):
            c = sp[name]
            lines.append(
                f"| {name} | {c['median_step_ms']:.1f} | {c['records_read_from_spill']:,} | {c['records_written_to_spill']:,} |"
            )
    if "rows" in res:
        w = res["rows"]
        lines += ["", "real text, requests of 512 tokens: distinct rows read"]
        lines += [
            f"  {m['tokens']:>9,} tokens: {m['distinct_rows']:>11,} rows ({100 * m['share_of_table']:.2f} %)"
            for m in w["measured"]
        ]
        what = f"extrapolated (rows ~ tokens^{w['growth_exponent']:.2f})" if w["extrapolated"] else "measured"
        lines += [f"  {w['tokens']:>9,} tokens: {w['distinct_rows']:>11,} rows ({100 * w['share_of_table']:.2f} %), {what}; "
                  f"adapter {w['adapter_fp32_bytes'] / 1e9:.2f} GB fp32, {w['adapter_bf16_bytes'] / 1e9:.2f} GB bf16; "
                  f"SparseAdam states {w['sparse_adam_state_bytes'] / 1e9:.2f} GB"]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--part", nargs="+", choices=["step", "rss", "rows", "spill"], default=["step", "rss", "rows", "spill"]
    )
    ap.add_argument("--tokens", type=int, default=512, help="tokens a step (one request)")
    ap.add_argument("--steps", type=int, default=20, help="rss: fine-tuning steps")
    ap.add_argument("--repeats", type=int, default=3, help="step: timed runs a round")
    ap.add_argument("--rounds", type=int, default=3, help="step: rounds, the cases interleaved")
    ap.add_argument(
        "--threads", type=int, nargs="+", default=[1, torch.get_num_threads()], help="step: torch threads, in turn"
    )
    ap.add_argument("--million", type=float, default=1.0, help="rows: millions of real-text tokens")
    ap.add_argument("--spill-steps", type=int, default=200, help="spill: steps of --tokens real-text tokens")
    ap.add_argument("--spill-budget", type=float, default=0.25, help="spill: share of the touched rows in memory")
    ap.add_argument("--format", default="fp8", choices=["fp8", "q4_0", "bf16"])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the sparse table file goes")
    ap.add_argument(
        "--table-file",
        help="an existing table file of the published layer's geometry to train over (a dense one, as "
        "dense_bench.py --keep writes) instead of a sparse file; never removed",
    )
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--child-rss", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--table", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_rss:
        print(json.dumps(part_rss_child(args, Path(args.table))))
        return 0
    cfg = config()
    given = args.table_file is not None
    path = Path(args.table_file) if given else Path(args.dir) / f"train-bench-{args.format}-{os.getpid()}.pletable"
    if given and not path.is_file():
        ap.error(f"--table-file {path}: no such file")
    res: dict = {"machine": machine_info(), "isa": cpu_isa(), "versions": versions()}
    try:
        if {"step", "rss", "spill"} & set(args.part) and not given:
            sparse_table(path, cfg, args.format)
        for part, fn in (("rows", lambda: part_rows(args)), ("step", lambda: part_step(args, path)),
                         ("rss", lambda: part_rss(args, path)), ("spill", lambda: part_spill(args, path))):  # fmt: skip
            if part in args.part:
                res[part] = fn()
                if args.out:  # what is measured so far, in case a later part fails
                    Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        if not given:
            path.unlink(missing_ok=True)
    print(report(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
