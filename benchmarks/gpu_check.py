"""Check and time ple's device kernels (n-gram ids, table gather, gate, conv) at serving sizes, and
the layer's engine call as serving engines run it.

Run by ``benchmarks/gpu_check.sh`` on a CUDA machine; ``--device cpu --tiny`` runs every code path on
the CPU (torch fast paths, tiny shapes) to check the script itself.

The engine checks (``engine``) build a layer at the published geometry (bf16, a reduced table on the
GPU) and a decode batch of 64 requests, then: (1) run the engine call ``layer(hidden, ids, batch)``
with a prebuilt batch under ``torch.cuda.set_sync_debug_mode("error")``: any host synchronization
fails the check; (2) capture one decode step in a CUDA graph, replay it on new inputs and compare
outputs and the state pool with the eager call bit for bit, and time replay against eager.

For each kernel and size: a correctness check first (ids and gathered rows exactly, gate and conv
within the bf16 tolerance of the torch twin, conv states exactly); a kernel whose check fails is
reported and not timed. Then the median time of ``--repeat`` calls (CUDA events; the L2 cache is
flushed before every call), the bytes the kernel must move at least, and the fraction of the
peak memory bandwidth that represents (``PLE_PEAK_BW`` / ``--peak-bw``, default 4.8e12 B/s,
H200; H100 SXM is 3.35e12). Gate and conv are also given per token.

Writes ``gpu_kernels.json`` and ``gpu_kernels.md`` to ``--out``; exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SCHEMA = "ple-gpu-check/1"
BF16_TOL = 1.6e-2  # |fast - torch twin| <= BF16_TOL * (1 + |twin|), both rounding once from fp32


@dataclasses.dataclass(frozen=True)
class Sizes:
    ids: tuple[tuple[int, int, torch.dtype], ...]  # (requests, tokens per request, token dtype)
    table_rows: int
    head_dim: int
    num_heads: int
    gather_tokens: tuple[int, ...]
    formats: tuple[str, ...]
    hidden_size: int
    hc_count: int
    gate_tokens: tuple[int, ...]
    conv: tuple[tuple[str, int, int], ...]  # (label, requests, tokens per request)
    engine_table_base: int = 300_000  # ngram_vocab_size_base of the engine checks' table
    engine_requests: int = 64


FULL = Sizes(
    ids=((64, 1024, torch.int64), (64, 1024, torch.int32), (256, 4096, torch.int64)),
    table_rows=16_000_000,
    head_dim=160,
    num_heads=16,
    gather_tokens=(64, 2048, 65536),
    formats=("bf16", "fp8", "fp8_row"),
    hidden_size=2560,
    hc_count=4,
    gate_tokens=(64, 2048, 16384),
    conv=(("decode", 64, 1), ("prefill", 8, 512), ("prefill", 1, 8192)),
)
TINY = Sizes(
    ids=((3, 17, torch.int64), (2, 9, torch.int32)),
    table_rows=1009,
    head_dim=5,
    num_heads=16,
    gather_tokens=(1, 33),
    formats=("bf16", "fp8", "fp8_row"),
    hidden_size=6,
    hc_count=4,
    gate_tokens=(1, 7),
    conv=(("decode", 5, 1), ("prefill", 3, 11)),
    engine_table_base=1000,
    engine_requests=3,
)


# ---------------------------------------------------------------------------------------------- timing


class Timer:
    """Median seconds of a callable: CUDA events on a GPU (L2 flushed before each call), else wall time."""

    def __init__(self, device: torch.device, repeat: int, warmup: int, flush_bytes: int = 256 << 20):
        self.device, self.repeat, self.warmup = device, repeat, warmup
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(flush_bytes // 4, dtype=torch.float32, device=device) if self.cuda else None

    def __call__(self, fn: Callable[[], Any], reset: Callable[[], None] | None = None) -> float:
        samples = []
        for i in range(self.warmup + self.repeat):
            if reset is not None:
                reset()
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                dt = start.elapsed_time(end) * 1e-3
            else:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
            if i >= self.warmup:
                samples.append(dt)
        return statistics.median(samples)


@dataclasses.dataclass
class Record:
    kernel: str
    shape: str
    dtype: str
    impl: str
    passed: bool
    detail: str
    tokens: int
    bytes_moved: int
    median_us: float | None = None
    us_per_token: float | None = None
    achieved_bytes_per_s: float | None = None
    fraction_of_peak_bw: float | None = None


def _timed_record(rec: Record, timer: Timer, fn, peak: float, reset=None) -> Record:
    if not rec.passed:
        return rec
    t = timer(fn, reset)
    rec.median_us = t * 1e6
    rec.us_per_token = rec.median_us / max(1, rec.tokens)
    rec.achieved_bytes_per_s = rec.bytes_moved / t if t > 0 else None
    rec.fraction_of_peak_bw = None if rec.achieved_bytes_per_s is None else rec.achieved_bytes_per_s / peak
    return rec


def _impl_name(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch (cpu)"


def _close(fast: torch.Tensor, twin: torch.Tensor, tol: float) -> tuple[bool, str]:
    if fast.shape != twin.shape:
        return False, f"shape {tuple(fast.shape)} vs {tuple(twin.shape)}"
    f, t = fast.double(), twin.double()
    if not bool(torch.isfinite(f).all()):
        return False, f"{int((~torch.isfinite(f)).sum())} non-finite values"
    err = (f - t).abs()
    bound = tol * (1 + t.abs())
    bad = int((err > bound).sum())
    return bad == 0, f"max err {float(err.max()) if err.numel() else 0.0:.3g}, {bad} elements over tolerance"


# ---------------------------------------------------------------------------------------------- kernels


def _layout(num_heads: int):
    from ple.config import PLEConfig

    hpn = num_heads // 2
    cfg = PLEConfig(
        hidden_size=2560,
        ple_embed_dim=160 * num_heads,
        eos_token_id=248044,
        vocab_size=248320,
        heads_per_ngram=hpn,
        ngram_size=3,
        ngram_vocab_size_base=300_000,
        ple_layer_ids=(2,),
    )
    return cfg, cfg.layout(0)


def check_ids(sizes: Sizes, device: torch.device, timer: Timer, peak: float) -> list[Record]:
    from ple.ngram import fresh_context, ngram_ids, torch_impl

    cfg, layout = _layout(sizes.num_heads)
    g = torch.Generator().manual_seed(1)
    out = []
    for r, s, tok_dtype in sizes.ids:
        t = r * s
        tokens = torch.randint(0, cfg.vocab_size, (t,), generator=g)
        tokens[torch.rand(t, generator=g) < 0.01] = cfg.eos_token_id
        qsl = torch.arange(0, t + 1, s, dtype=torch.int64)
        ctx = fresh_context(r, layout, cfg.eos_token_id)
        want = torch_impl.ngram_ids(tokens, qsl, ctx, layout, cfg.eos_token_id)
        d_tok, d_qsl, d_ctx = tokens.to(device, tok_dtype), qsl.to(device), ctx.to(device)
        got = ngram_ids(d_tok, d_qsl, d_ctx, layout, cfg.eos_token_id, check=False).cpu()
        ok = torch.equal(got, want)
        nbytes = t * d_tok.element_size() + qsl.numel() * 8 + ctx.numel() * 8 + t * layout.num_heads * 8
        rec = Record(
            "ngram_ids",
            f"{r}x{s}",
            str(tok_dtype).replace("torch.", ""),
            _impl_name(device),
            ok,
            "ids equal" if ok else f"{int((got != want).sum())} ids differ",
            t,
            nbytes,
        )
        fn = functools.partial(ngram_ids, d_tok, d_qsl, d_ctx, layout, cfg.eos_token_id, check=False)
        out.append(_timed_record(rec, timer, fn, peak))
    return out


def _make_table(fmt: str, rows: int, head_dim: int, device: torch.device, g: torch.Generator):
    """A table in ``fmt`` on ``device``, rows tiled from one random block (fast to build at GBs)."""
    from ple.table import quantize_rows
    from ple.table.formats.quantize import quantize_global

    block_rows = min(rows, 65537)
    block = torch.randn(block_rows, head_dim, generator=g)
    if fmt in ("bf16", "fp16", "fp32"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[fmt]
        src, scale = block.to(dtype), None
    elif fmt == "fp8":
        src, scale = quantize_global(block, "fp8")
    else:
        src, scale = quantize_rows(block, fmt)
    data = torch.empty(rows, head_dim, dtype=src.dtype, device=device)
    full_scale = None
    if scale is not None and scale.dim() == 2:
        full_scale = torch.empty(rows, 1, dtype=scale.dtype, device=device)
    src_d = src.to(device)
    scale_d = None if scale is None else scale.to(device)
    for start in range(0, rows, block_rows):
        m = min(block_rows, rows - start)
        data[start : start + m].copy_(src_d[:m])
        if full_scale is not None:
            full_scale[start : start + m].copy_(scale_d[:m])
    return data, (full_scale if full_scale is not None else scale_d)


def check_gather(sizes: Sizes, device: torch.device, timer: Timer, peak: float) -> list[Record]:
    from ple.table.lookup import gather_dequant, gather_dequant_reference

    g = torch.Generator().manual_seed(2)
    out = []
    for fmt in sizes.formats:
        data, scale = _make_table(fmt, sizes.table_rows, sizes.head_dim, device, g)
        for t in sizes.gather_tokens:
            ids = torch.randint(0, sizes.table_rows, (t, sizes.num_heads), generator=g).to(device)
            got = gather_dequant(data, scale, ids, torch.bfloat16, check=False)
            want = gather_dequant_reference(data, scale, ids, torch.bfloat16)
            ok = torch.equal(got, want)
            n = t * sizes.num_heads
            nbytes = n * 8 + n * sizes.head_dim * data.element_size() + n * sizes.head_dim * 2
            if scale is not None and scale.dim() == 2:
                nbytes += n * scale.element_size()
            rec = Record(
                "gather",
                f"{t}x{sizes.num_heads}x{sizes.head_dim} of {sizes.table_rows} rows",
                f"{fmt}->bf16",
                _impl_name(device),
                ok,
                "rows equal" if ok else f"{int((got != want).sum())} values differ",
                t,
                nbytes,
            )
            fn = functools.partial(
                gather_dequant, data, scale, ids, torch.bfloat16, out=torch.empty_like(got), check=False
            )
            out.append(_timed_record(rec, timer, fn, peak))
        del data, scale
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def check_gate(sizes: Sizes, device: torch.device, timer: Timer, peak: float) -> list[Record]:
    from ple.ops import GateWeights, ngram_gate
    from ple.ops.gate import torch_impl as gate_torch

    h, hc = sizes.hidden_size, sizes.hc_count
    c = h * hc
    g = torch.Generator().manual_seed(3)
    w = [(0.3 * torch.randn(c, generator=g)).to(device, torch.bfloat16) for _ in range(3)]
    out = []
    for t in sizes.gate_tokens:
        key = torch.randn(t, c, generator=g).to(device, torch.bfloat16)
        value = torch.randn(t, h, generator=g).to(device, torch.bfloat16)
        hidden = torch.randn(t, c, generator=g).to(device, torch.bfloat16)
        args = (key, value, hidden, GateWeights.build(*w, 1e-6, hc))
        v, cc = ngram_gate(*args)
        v2, c2 = gate_torch.ngram_gate(*args)
        ok_v, dv = _close(v, v2, BF16_TOL)
        ok_c, dc = _close(cc, c2, BF16_TOL)
        nbytes = (2 * t * c + t * h) * 2 + 3 * c * 2 + 2 * t * c * 2
        rec = Record("gate", f"{t}x{hc}x{h}", "bf16", _impl_name(device), ok_v and ok_c, f"v: {dv}; c: {dc}", t, nbytes)
        out.append(_timed_record(rec, timer, functools.partial(ngram_gate, *args), peak))
    return out


def check_conv(sizes: Sizes, device: torch.device, timer: Timer, peak: float) -> list[Record]:
    from ple.ops import ConvWeights, StepMeta, dilated_conv
    from ple.ops.conv import torch_impl as conv_torch

    c = sizes.hidden_size * sizes.hc_count
    k, dil = 4, 3
    window = (k - 1) * dil
    g = torch.Generator().manual_seed(4)
    weight = (0.5 * torch.randn(c, k, generator=g)).to(device, torch.bfloat16)
    out = []
    for label, r, n in sizes.conv:
        t = r * n
        x = torch.randn(t, c, generator=g).to(device, torch.bfloat16)
        res = torch.randn(t, c, generator=g).to(device, torch.bfloat16)
        qsl = torch.arange(0, t + 1, n, dtype=torch.int64, device=device)
        slots = torch.arange(r, dtype=torch.int64, device=device)
        init = torch.full((r,), label == "decode", dtype=torch.bool, device=device)
        pool0 = torch.randn(r, c, window, generator=g).to(device, torch.bfloat16)
        pool_a, pool_b = pool0.clone(), pool0.clone()
        conv = ConvWeights.build(weight, dil)
        got = dilated_conv(x, conv, StepMeta(qsl, pool_a, slots, init), res)
        want = conv_torch.dilated_conv(x, conv, StepMeta(qsl, pool_b, slots, init), res)
        ok_o, do = _close(got, want, BF16_TOL)
        ok_s = torch.equal(pool_a, pool_b)
        nbytes = 3 * t * c * 2 + 2 * r * c * window * 2 + c * k * 2
        rec = Record(
            "conv",
            f"{label} {r}x{n}",
            "bf16",
            _impl_name(device),
            ok_o and ok_s,
            f"out: {do}; states {'equal' if ok_s else 'DIFFER'}",
            t,
            nbytes,
        )
        pool = pool0.clone()
        fn = functools.partial(dilated_conv, x, conv, StepMeta(qsl, pool, slots, init), res, validate=False)
        out.append(_timed_record(rec, timer, fn, peak, reset=functools.partial(pool.copy_, pool0)))
    return out


def _engine_layer(sizes: Sizes, device: torch.device):
    """A bf16 PLE layer at the sizes' geometry with random weights and a random table on ``device``."""
    from ple.config import PLEConfig
    from ple.layer import PLELayer
    from ple.table import MemoryTable

    hpn = sizes.num_heads // 2
    cfg = PLEConfig(
        hidden_size=sizes.hidden_size,
        hc_count=sizes.hc_count,
        ple_embed_dim=sizes.head_dim * sizes.num_heads,
        ngram_size=3,
        heads_per_ngram=hpn,
        vocab_size=248320,
        eos_token_id=248044,
        ngram_vocab_size_base=sizes.engine_table_base,
        ple_layer_ids=(2,),
    )
    g = torch.Generator().manual_seed(5)
    layer = PLELayer(cfg, 0, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 1 / p.shape[-1] ** 0.5 if "proj" in name else 0.3
            p.copy_((scale * torch.randn(p.shape, generator=g)).to(device, torch.bfloat16))
    layer.refresh_weights()
    lay = layer.layout
    data, _ = _make_table("bf16", lay.padded_rows, lay.head_dim, device, g)
    layer.set_table(MemoryTable(data))
    return layer


def check_engine(sizes: Sizes, device: torch.device, timer: Timer, peak: float) -> list[Record]:
    """The engine call with a prebuilt batch: no host synchronization; a decode step in a CUDA graph."""
    from ple.runtime import Batch

    layer = _engine_layer(sizes, device)
    cfg = layer.config
    r, c = sizes.engine_requests, cfg.hc_hidden_size
    g = torch.Generator().manual_seed(6)
    pool = layer.new_state_pool(r)
    ctx = torch.randint(0, cfg.vocab_size, (r, cfg.ngram_size - 1), generator=g)
    history = 16
    warm = Batch.build([history] * r, list(range(r)), ctx, pool, device=device)
    with torch.no_grad():
        layer(
            torch.randn(r * history, c, generator=g).to(device, torch.bfloat16),
            torch.randint(0, cfg.vocab_size, (r * history,), generator=g).to(device),
            warm,
        )
    batch = Batch.build([1] * r, list(range(r)), ctx, pool, has_initial_state=[True] * r, device=device)
    hidden = torch.randn(r, c, generator=g).to(device, torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (r,), generator=g).to(device)
    snapshot = pool.clone()
    cuda = device.type == "cuda"
    impl = "eager ops (triton)" if cuda else "eager ops (cpu dry run)"
    out: list[Record] = []
    shape = f"decode {r}x1, H {cfg.hidden_size} HC {cfg.hc_count} E {cfg.ple_embed_dim}"

    def step():
        with torch.no_grad():
            return layer(hidden, ids, batch)

    step()  # compiles the Triton kernels
    pool.copy_(snapshot)
    # 1. no host synchronization in the hot path
    detail = "n/a on the CPU (ran the same call)"
    passed = True
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            detail = "no synchronizing call under set_sync_debug_mode('error')"
        except RuntimeError as e:
            passed, detail = False, f"synchronized: {str(e).splitlines()[0][:200]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        step()
    pool.copy_(snapshot)
    out.append(Record("engine: no host sync", shape, "bf16", impl, passed, detail, r, 0))

    # 2. a decode step captured in a CUDA graph, replayed on new inputs, equal to eager
    graph = None
    static_out = None
    if cuda:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
                pool.copy_(snapshot)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()
        pool.copy_(snapshot)
    ok, diffs = True, []
    for k in range(3):
        hidden.copy_(torch.randn(r, c, generator=g).to(device, torch.bfloat16))
        ids.copy_(torch.randint(0, cfg.vocab_size, (r,), generator=g).to(device))
        pool.copy_(snapshot)
        if graph is not None:
            graph.replay()
            got, got_pool = static_out.clone(), pool.clone()
        else:
            got, got_pool = step(), pool.clone()
        pool.copy_(snapshot)
        want = step()
        same = torch.equal(got, want) and torch.equal(got_pool, pool)
        ok &= same
        if not same:
            diffs.append(k)
    detail = (
        ("replays equal eager (outputs and state pool, 3 inputs)" if ok else f"replays {diffs} differ from eager")
        if cuda
        else "n/a on the CPU (eager twice)"
    )
    rec = Record("engine: CUDA graph decode step", shape, "bf16", "cuda graph" if cuda else impl, ok, detail, r, 0)
    if ok:
        replay = graph.replay if graph is not None else step
        rec.median_us = timer(replay, reset=lambda: pool.copy_(snapshot)) * 1e6
        rec.us_per_token = rec.median_us / r
        eager_us = timer(step, reset=lambda: pool.copy_(snapshot)) * 1e6
        rec.detail += f"; replay {rec.median_us:.1f} us vs eager {eager_us:.1f} us"
    out.append(rec)
    return out


# ---------------------------------------------------------------------------------------------- report


def markdown(records: list[Record], peak: float) -> str:
    lines = [
        f"Peak bandwidth assumed: {peak:.3g} B/s. Bytes = the minimum the kernel must read and write.",
        "",
        "| kernel | shape | dtype | impl | check | median us | us/token | GB/s | % of peak |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in records:
        if not r.passed:
            lines.append(f"| {r.kernel} | {r.shape} | {r.dtype} | {r.impl} | FAILED: {r.detail} | - | - | - | - |")
            continue
        gbs = "-" if not r.achieved_bytes_per_s else f"{r.achieved_bytes_per_s / 1e9:.0f}"
        frac = "-" if not r.fraction_of_peak_bw else f"{100 * r.fraction_of_peak_bw:.1f}"
        med = "-" if r.median_us is None else f"{r.median_us:.1f}"
        per = "-" if r.us_per_token is None else f"{r.us_per_token:.4f}"
        check = "ok" if r.bytes_moved else f"ok: {r.detail}"
        lines.append(f"| {r.kernel} | {r.shape} | {r.dtype} | {r.impl} | {check} | {med} | {per} | {gbs} | {frac} |")
    return "\n".join(lines) + "\n"


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def summary(out_dir: Path, device: str, step_rows: list[str]) -> str:
    """One table of everything the check ran: the script's steps (rows given), every kernel and engine
    record of ``gpu_kernels.json``, every case of ``bench_<device>.json``."""
    rows = list(step_rows)
    kernels = _load(out_dir / "gpu_kernels.json") or {}
    for r in kernels.get("records", []):
        what = f"{r['kernel']} {r['shape']} {r['dtype']}"
        if not r["passed"]:
            rows.append(f"| {what} | FAILED | - | {r['detail']} |")
            continue
        t = "-" if r["median_us"] is None else f"{r['median_us']:.1f} us"
        frac = r.get("fraction_of_peak_bw")
        rows.append(f"| {what} | ok | {t} | {f'{100 * frac:.1f} % of peak bandwidth' if frac else r['detail']} |")
    for k, v in kernels.get("errors", {}).items():
        rows.append(f"| {k} | ERROR | - | {v} |")
    bench = _load(out_dir / f"bench_{device}.json") or {}
    for c in bench.get("cases", []):
        if c["status"] != "ok":
            rows.append(f"| bench {c['name']} | REFUSED | - | {(c.get('check') or {}).get('detail', '')} |")
            continue
        m, q = c["median_ms"], c["ratios"]
        parts = [f"transformers {m['transformers']:.3g} ms"]
        if q["speedup_vs_transformers"]:
            parts.append(f"{q['speedup_vs_transformers']:.2f}x vs transformers")
        if q["ple_over_floor"]:
            parts.append(f"{q['ple_over_floor']:.2f} x floor")
        met = {True: "target met", False: "target NOT met", None: "no target"}[c["target_met"]]
        rows.append(f"| bench {c['name']} ({c['shape']}) | ok, {met} | {m['ple']:.3g} ms | {', '.join(parts)} |")
    if bench:
        rows.append(f"| {bench['settings'].get('geometry_name', '')} | | | |")
    return "\n".join(["| check | result | time | detail |", "|---|---|---|---|", *rows]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT") or "out", help="output folder (default $OUT or ./out)")
    p.add_argument(
        "--peak-bw",
        type=float,
        default=float(os.environ.get("PLE_PEAK_BW", "4.8e12")),
        help="peak memory bandwidth in B/s (default $PLE_PEAK_BW or 4.8e12)",
    )
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (for a CPU smoke run of this script)")
    p.add_argument("--table-rows", type=int, default=None, help="rows of the gather benchmark's table")
    p.add_argument("--only", default=None, help="comma-separated subset of: ids,gather,gate,conv,engine")
    p.add_argument(
        "--summary",
        action="store_true",
        help="print the one summary table of a finished check in --out (step rows on stdin) and exit",
    )
    args = p.parse_args(argv)
    if args.summary:
        print(summary(Path(args.out), args.device, [ln for ln in sys.stdin.read().splitlines() if ln.strip()]), end="")
        return 0

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: --device {args.device} but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda})",
            file=sys.stderr,
        )
        return 2
    sizes = TINY if args.tiny else FULL
    if args.table_rows is not None:
        sizes = dataclasses.replace(sizes, table_rows=args.table_rows)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    timer = Timer(device, args.repeat, args.warmup)
    steps = {"ids": check_ids, "gather": check_gather, "gate": check_gate, "conv": check_conv, "engine": check_engine}
    only = list(steps) if args.only is None else [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in steps]
    if unknown:
        print(f"gpu_check: unknown --only entries {unknown}; known: {list(steps)}", file=sys.stderr)
        return 2

    records: list[Record] = []
    errors: dict[str, str] = {}
    for name in only:
        t0 = time.perf_counter()
        try:
            recs = steps[name](sizes, device, timer, args.peak_bw)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            print(f"gpu_check: {name} raised; continuing with the other kernels", file=sys.stderr)
            continue
        records.extend(recs)
        print(f"gpu_check: {name}: {len(recs)} sizes in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    info: dict[str, Any] = {"device": str(device), "platform": platform.platform(), "cores": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(accelerator=props.name, accelerator_memory_bytes=props.total_memory)
    vers = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        vers["triton"] = triton.__version__
    except ImportError:
        vers["triton"] = None
    import ple

    vers["ple"] = ple.__version__
    report = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        "versions": vers,
        "settings": {
            "peak_bw": args.peak_bw,
            "repeat": args.repeat,
            "warmup": args.warmup,
            "tiny": args.tiny,
            "sizes": {k: str(v) for k, v in dataclasses.asdict(sizes).items()},
        },
        "records": [dataclasses.asdict(r) for r in records],
        "errors": errors,
    }
    (out_dir / "gpu_kernels.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(records, args.peak_bw)
    if errors:
        md += "\nErrors:\n" + "\n".join(f"- {k}: {v}" for k, v in errors.items()) + "\n"
    (out_dir / "gpu_kernels.md").write_text(md)
    print(md)
    failed = [f"{r.kernel} {r.shape} {r.dtype}" for r in records if not r.passed]
    if failed or errors:
        print(f"gpu_check: FAILED checks: {failed}; errors: {list(errors)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
