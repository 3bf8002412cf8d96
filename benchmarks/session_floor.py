"""``ple.Session`` steps against the floor (the two projections alone), side by side, published geometry.

    python benchmarks/session_floor.py [--dtype bf16|fp32] [--requests 64] [--steps 4] [--prefill 2048]
                                  [--repeat 5] [--threads N] [--table-base 300000] [--json PATH]

Builds a PLE layer at the published geometry (H 2560, HC 4, E 2560, 16 heads of 160, K 4; random
weights, a table of ``--table-base``), checks that ``Session.step`` gives exactly the outputs of the
engine call on prebuilt batches (the same steps from the same state), then times in rotating order,
each after an untimed reset of the state: the floor (the two projections as the layer computes them,
``PLELayer.projections`` of ``[T, 2560]`` with ``[12800, 2560]``: see ``ple.kernels.cpu_gemm``), ``F.linear`` of the
same shapes (for reference: on a CPU where the layer packs its bf16 weights for small steps, the GEMM most
code runs), the engine call ``layer(hidden, ids, batch)`` with prebuilt batches, once on a state pool in the engine
layout ``[slots, HC*H, L]`` (each step moves every channel's whole window of each request) and once on a ring
pool (``PLELayer.new_ring_pool``: one new row per request), the session's engine call ``begin``/``run``/``end``
(packed hidden, ring pools), and
``Session.step`` (per-request inputs and outputs), for ``--steps`` decode steps of ``--requests`` requests and for one prompt of
``--prefill`` tokens. Prints medians (ms) and ratios to the floor; ``ple bench`` runs the same steps
with the check against transformers (``session-*`` cases), which costs far more time on a CPU.

``--without-gemm`` replaces ``F.linear`` and the packed GEMM by their cached results (computed once per
shape): what remains is everything the layer and the session do besides the projections.

The traffic floor (``traffic`` column) is a plain copy of as many bytes as the step must read and write
(``ple.commands.bench.cases.step_traffic``, from the shapes and dtypes: tokens and contexts, the row ids written and read,
the table rows read and the gathered rows written, the projections' outputs read, the hidden rows read,
the state taps read and the new state column written, the outputs written): ``dst.copy_(src)`` of half
that many bytes (a copy reads and writes as much), both buffers warm, as the step's operands are.

``--cpu-time`` (with ``--threads 1``) reads this thread's CPU time instead of the wall clock, so time
spent descheduled on a machine shared with other work is not counted.

``--parts`` also times the parts of a ``begin``/``run``/``end`` decode step and prompt inside them (``begin``, the ids,
gather and fused kernels, the GEMM, the rest of the engine call, ``end``), and the traffic floor (warm
copies, timed after the steps): the fused kernel and the work beside the GEMM are also given as
multiples of it.

``--bookkeeping`` times ``Session.step`` around a layer that returns its input (no computation): the
session's own per-step and per-request work (checks, packing the batch, splitting the outputs, the
contexts and lengths), for 1 and ``--requests`` decode requests; the per-request cost is the slope.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ple import PLEConfig, PLELayer, Session, tune_host_allocator
from ple.commands.bench.cases import step_traffic, traffic_copy
from ple.commands.bench.runner import versions
from ple.kernels import cpu_gemm
from ple.ops.state import engine_to_ring
from ple.runtime import Batch
from ple.table import MemoryTable


def published(table_base: int) -> PLEConfig:
    return PLEConfig(
        hidden_size=2560,
        hc_count=4,
        ple_embed_dim=2560,
        ngram_size=3,
        heads_per_ngram=8,
        vocab_size=248320,
        eos_token_id=248044,
        ngram_vocab_size_base=table_base,
        make_ngram_vocab_size_divisible_by=128,
        ple_layer_ids=(2,),
    )


def build_layer(cfg: PLEConfig, dtype: torch.dtype) -> PLELayer:
    g = torch.Generator().manual_seed(0)
    layer = PLELayer(cfg, 0, dtype=dtype)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = p.shape[-1] ** -0.5 if "proj" in name else 0.3
            p.copy_((scale * torch.randn(p.shape, generator=g)).to(dtype))
    if hasattr(layer, "refresh_weights"):
        layer.refresh_weights()
    lay = layer.layout
    block = torch.randn(65537, lay.head_dim, generator=g).to(dtype)
    # allocated as a checkpoint loader allocates a table (its rows on 2 MiB pages where Linux allows)
    table = MemoryTable.empty(lay.padded_rows, lay.head_dim, "bf16" if dtype == torch.bfloat16 else "fp32")
    for a in range(0, lay.padded_rows, block.shape[0]):
        n = min(block.shape[0], lay.padded_rows - a)
        table.data[a : a + n].copy_(block[:n])
    layer.set_table(table)
    return layer


def _kv_weight(layer: PLELayer) -> torch.Tensor:
    w = getattr(layer, "kv_weight", None)
    return w if w is not None else torch.cat([layer.key_proj.detach(), layer.value_proj.detach()])


def without_gemm() -> None:
    """Make ``F.linear`` and the packed GEMM (``ple.kernels.cpu_gemm.linear``) return a cached result per
    (shapes, dtype): the GEMM costs nothing."""
    real, real_packed = F.linear, cpu_gemm.linear
    cache: dict = {}

    def cached(x, w, b=None):
        key = (tuple(x.shape), tuple(w.shape), x.dtype)
        if key not in cache:
            cache[key] = real(x, w, b)
        return cache[key]

    def cached_packed(x, w, packed):
        key = ("packed", tuple(x.shape), tuple(w.shape), x.dtype)
        if key not in cache:
            cache[key] = real_packed(x, w, packed)
        return cache[key]

    torch.nn.functional.linear = cached
    cpu_gemm.linear = cached_packed


CLOCK = time.perf_counter
"""What ``interleaved`` reads: wall time, or (``--cpu-time``) this thread's CPU time."""


def interleaved(fns: dict, reset: dict, repeat: int) -> dict[str, list[float]]:
    """Seconds per call, in rotating order, each call after its untimed reset."""
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeat + 1):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            reset[n]()
            t0 = CLOCK()
            fns[n]()
            dt = CLOCK() - t0
            if i:
                out[n].append(dt)
    return out


_LABELS = {"engine": "engine [S, C, L]", "ring": "engine ring", "phases": "begin/run/end", "session": "session"}


def paired_ratios(samples: dict[str, list[float]]) -> dict[str, float]:
    """Per call kind, the median over rounds of (its time / the floor's time in the same round): a slow
    drift of the machine's speed moves both samples of a round alike, so this is steadier than the ratio
    of the medians."""
    floor = samples["floor"]
    return {k: statistics.median(x / f for x, f in zip(samples[k], floor)) for k in _LABELS}


def prefilled_session(layer: PLELayer, requests: int, g: torch.Generator) -> Session:
    """A session of ``requests`` requests, each after a random 16-token prompt (decode steps then resume)."""
    cfg = layer.config
    c, dtype = cfg.hc_hidden_size, layer.dtype
    session = Session(layer, requests)
    for r in range(requests):
        session.add(r)
    session.step(
        {
            r: (torch.randn(16, c, generator=g).to(dtype), torch.randint(0, cfg.vocab_size, (16,), generator=g))
            for r in range(requests)
        }
    )
    return session


def decode_case(layer: PLELayer, requests: int, steps: int, repeat: int) -> dict:
    cfg = layer.config
    c, dtype = cfg.hc_hidden_size, layer.dtype
    g = torch.Generator().manual_seed(1)
    session = prefilled_session(layer, requests, g)
    saved = {r: session.prefix_state(r) for r in range(requests)}
    step_h = torch.randn(steps, requests, c, generator=g).to(dtype)
    step_t = torch.randint(0, cfg.vocab_size, (steps, requests), generator=g)
    inputs = [{r: (step_h[s, r : r + 1], step_t[s, r : r + 1]) for r in range(requests)} for s in range(steps)]
    # the engine call on prebuilt batches from the same state
    pool0 = layer.new_state_pool(requests)
    for r in range(requests):
        pool0[r] = saved[r].conv_window.to(dtype)
    pool = pool0.clone()
    ring0, offsets0 = engine_to_ring(pool0)  # the same columns, in the ring layout
    ring, offsets = ring0.clone(), offsets0.clone()
    ctx = torch.stack([saved[r].ngram_context for r in range(requests)])
    batches, ring_batches = [], []
    for s in range(steps):
        for out, p, off in ((batches, pool, None), (ring_batches, ring, offsets)):
            out.append(
                Batch.build(
                    [1] * requests,
                    list(range(requests)),
                    ctx,
                    p,
                    has_initial_state=[True] * requests,
                    state_offsets=off,
                )
            )
        ctx = torch.cat([ctx[:, 1:], step_t[s].view(-1, 1)], dim=1)

    def reset_session():
        for r in range(requests):
            session.finish(r)
            session.add(r, from_state=saved[r])

    def run_session():  # Session.step alone: its outputs are joined for the check below, untimed
        return [session.step(inputs[s]) for s in range(steps)]

    def run_engine():
        return [layer(step_h[s], step_t[s], batches[s]) for s in range(steps)]

    def run_ring():
        return [layer(step_h[s], step_t[s], ring_batches[s]) for s in range(steps)]

    def reset_ring():
        ring.copy_(ring0)
        offsets.copy_(offsets0)

    chunks = [{r: step_t[s, r : r + 1] for r in range(requests)} for s in range(steps)]

    def run_phases():
        outs = []
        for s in range(steps):
            st = session.begin(chunks[s])
            outs.append(session.run(st, 0, step_h[s]))
            session.end(st)
        return outs

    reset_session()
    pool.copy_(pool0)
    reset_ring()
    a, b, d = [torch.cat(list(out.values())) for out in run_session()], run_engine(), run_ring()
    reset_session()
    c = run_phases()
    same = all(torch.equal(x, y) and torch.equal(x, z) and torch.equal(x, e) for x, y, z, e in zip(a, b, c, d))
    w = _kv_weight(layer)
    x = torch.randn(requests, cfg.ple_embed_dim, generator=g).to(dtype)
    read, written = step_traffic(layer, requests, requests, cfg.ple_conv_kernel_size - 1)
    copy = traffic_copy(read + written)
    fns = {
        "floor": lambda: [layer.projections(x) for _ in range(steps)],
        "linear": lambda: [F.linear(x, w) for _ in range(steps)],
        "engine": run_engine,
        "ring": run_ring,
        "session": run_session,
        "phases": run_phases,
        "traffic": lambda: [copy() for _ in range(steps)],
    }
    reset = {
        "floor": lambda: None,
        "linear": lambda: None,
        "engine": lambda: pool.copy_(pool0),
        "ring": reset_ring,
        "session": reset_session,
        "phases": reset_session,
        "traffic": lambda: None,
    }
    with torch.no_grad():
        samples = interleaved(fns, reset, repeat)
    return {
        "case": f"decode {requests}x1 x{steps} steps",
        "session_equals_engine": same,
        "samples": samples,
        "traffic_bytes": (read + written) * steps,
    }


def prefill_case(layer: PLELayer, tokens: int, repeat: int) -> dict:
    cfg = layer.config
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(tokens, cfg.hc_hidden_size, generator=g).to(layer.dtype)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=g)
    session = Session(layer, 1)
    pool = layer.new_state_pool(1)
    batch = Batch.build([tokens], [0], torch.full((1, 2), cfg.eos_token_id), pool)
    ring, offsets = layer.new_ring_pool(1)
    ring_batch = Batch.build([tokens], [0], torch.full((1, 2), cfg.eos_token_id), ring, state_offsets=offsets)

    def reset_ring():
        ring.zero_()
        offsets.zero_()

    def reset_session():
        for r in list(session.request_ids):
            session.finish(r)
        session.add(0)

    def run_phases():
        st = session.begin({0: ids})
        out = session.run(st, 0, hidden)
        session.end(st)
        return out

    reset_session()
    want = layer(hidden, ids, batch)
    same = torch.equal(session.step({0: (hidden, ids)})[0], want)
    reset_session()
    same &= torch.equal(run_phases(), want)
    reset_ring()
    same &= torch.equal(layer(hidden, ids, ring_batch), want)
    w = _kv_weight(layer)
    x = torch.randn(tokens, cfg.ple_embed_dim, generator=g).to(layer.dtype)
    read, written = step_traffic(layer, tokens, 1, 0)
    copy = traffic_copy(read + written)
    fns = {
        "floor": lambda: layer.projections(x),
        "linear": lambda: F.linear(x, w),
        "engine": lambda: layer(hidden, ids, batch),
        "ring": lambda: layer(hidden, ids, ring_batch),
        "session": lambda: session.step({0: (hidden, ids)}),
        "phases": run_phases,
        "traffic": copy,
    }
    reset = {
        "floor": lambda: None,
        "linear": lambda: None,
        "engine": lambda: pool.zero_(),
        "ring": reset_ring,
        "session": reset_session,
        "phases": reset_session,
        "traffic": lambda: None,
    }
    with torch.no_grad():
        samples = interleaved(fns, reset, repeat)
    return {
        "case": f"prefill 1x{tokens}",
        "session_equals_engine": same,
        "samples": samples,
        "traffic_bytes": read + written,
    }


def bookkeeping_case(layer: PLELayer, requests: int, repeat: int) -> dict:
    """``Session.step`` of decode steps around a layer that returns its input: the session's own work,
    for 1 and ``requests`` requests (interleaved); per request = the slope."""
    cfg = layer.config
    c, dtype = cfg.hc_hidden_size, layer.dtype
    g = torch.Generator().manual_seed(3)
    sessions, inputs = {}, {}
    for n in (1, requests):
        s = Session(layer, n)
        for r in range(n):
            s.add(r)
        h = torch.randn(n, c, generator=g).to(dtype)
        t = torch.randint(0, cfg.vocab_size, (n,), generator=g)
        sessions[n] = s
        inputs[n] = {r: (h[r : r + 1], t[r : r + 1]) for r in range(n)}
    layer.forward = lambda hidden, *args, **kwargs: hidden  # type: ignore[method-assign]
    try:
        fns = {f"{n} requests": (lambda n=n: sessions[n].step(inputs[n])) for n in (1, requests)}
        with torch.no_grad():
            samples = interleaved(fns, {k: (lambda: None) for k in fns}, repeat)
    finally:
        del layer.forward
    med = {k: statistics.median(v) for k, v in samples.items()}
    per_request = (med[f"{requests} requests"] - med["1 requests"]) / max(1, requests - 1)
    return {"case": "bookkeeping", "samples": samples, "per_request_us": per_request * 1e6}


def parts_case(layer: PLELayer, requests: int, repeat: int, prefill: int = 0) -> dict:
    """Where a ``begin``/``run``/``end`` decode step of ``requests`` goes (with ``prefill``: a fresh
    request's prompt of that many tokens instead), each part timed inside the step by wrapping it (the
    rest of the engine call: its Python, records and outputs around the three C kernels and the GEMM),
    then as many warm copies of the bytes the step must move (the traffic floor, as in the decode and
    prefill cases), back to back after the steps so that no copy runs between two of them. ``repeat`` x
    4 steps after 8 untimed ones (a prompt: ``repeat`` steps after 1); seconds per part and step."""
    import ple.ngram.native as ids_native
    import ple.ops.fused.native as fused_native
    import ple.table.lookup.torch_impl as lookup_torch

    cfg = layer.config
    c, dtype = cfg.hc_hidden_size, layer.dtype
    g = torch.Generator().manual_seed(4)
    if prefill:
        session = Session(layer, 1)
        session.add(0)
        hidden = torch.randn(1, prefill, c, generator=g).to(dtype)
        chunks = [{0: torch.randint(0, cfg.vocab_size, (prefill,), generator=g)}]
        read, written = step_traffic(layer, prefill, 1, 0)
    else:
        session = prefilled_session(layer, requests, g)
        hidden = torch.randn(4, requests, c, generator=g).to(dtype)
        tokens = torch.randint(0, cfg.vocab_size, (4, requests), generator=g)
        chunks = [{r: tokens[s, r : r + 1] for r in range(requests)} for s in range(4)]
        read, written = step_traffic(layer, requests, requests, cfg.ple_conv_kernel_size - 1)
    steps = len(chunks)

    def fresh():  # a prompt's step starts a new request
        if prefill:
            session.finish(0)
            session.add(0)

    copy = traffic_copy(read + written)
    spent: dict[str, list[float]] = {}
    wrapped = [
        (fused_native, "run", "fused gate + conv kernel"),
        (lookup_torch, "_gather_rows_native", "row gather kernel"),
        (ids_native, "ids_from_tensors", "n-gram ids kernel"),
        (PLELayer, "projections", "GEMM"),
        (PLELayer, "forward", "engine call"),
        (Session, "_begin", "begin"),
        (Session, "_end", "end"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in wrapped]

    def timed(fn, label):
        def call(*a, **k):
            t0 = CLOCK()
            try:
                return fn(*a, **k)
            finally:
                spent.setdefault(label, []).append(CLOCK() - t0)

        return call

    # a session's CPU step calls the C kernels straight from the layer's NativeStep: time those calls
    native = layer._native_step
    native_fns = (
        ("_ids_fn", "n-gram ids kernel"),
        ("_gather_fn", "row gather kernel"),
        ("_fused_fn", "fused gate + conv kernel"),
    )
    with torch.no_grad():  # one untimed step binds the native step's C functions
        st = session.begin(chunks[0])
        session.run(st, 0, hidden[0])
        session.end(st)
        fresh()
    native_originals = [(name, getattr(native, name)) for name, _ in native_fns] if native is not None else []
    for (owner, name, label), (_, _, fn) in zip(wrapped, originals):
        setattr(owner, name, timed(fn, label))
    for (name, label), (_, fn) in zip(native_fns, native_originals):
        setattr(native, name, timed(fn, label))
    try:
        with torch.no_grad():
            warm = 1 if prefill else 2
            for i in range(repeat + warm):
                if i == warm:
                    spent.clear()
                for s in range(steps):
                    t0 = CLOCK()
                    st = session.begin(chunks[s])
                    session.run(st, 0, hidden[s])
                    session.end(st)
                    spent.setdefault("step", []).append(CLOCK() - t0)
                    fresh()
            for _ in range(steps * repeat + 1):  # the traffic floor: warm copies, back to back
                t0 = CLOCK()
                copy()
                spent.setdefault("traffic", []).append(CLOCK() - t0)
            del spent["traffic"][0]
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        for name, fn in native_originals:
            setattr(native, name, fn)
    med = {k: statistics.median(v) for k, v in spent.items()}
    kernels = ("fused gate + conv kernel", "row gather kernel", "n-gram ids kernel", "GEMM")
    # per step where every part ran once a step (paired: a long GEMM's noise cancels), else of the medians
    calls = spent["engine call"]
    if all(len(spent.get(k, calls)) == len(calls) for k in kernels) and len(spent["step"]) == len(calls):
        rest = [e - sum(spent[k][i] for k in kernels if k in spent) for i, e in enumerate(calls)]
        med["rest of the engine call"] = statistics.median(rest)
        med["beside the GEMM"] = statistics.median(t - gemm for t, gemm in zip(spent["step"], spent["GEMM"]))
    else:
        med["rest of the engine call"] = med["engine call"] - sum(med.get(k, 0.0) for k in kernels)
        med["beside the GEMM"] = med["step"] - med["GEMM"]
    what = f"a prompt of {prefill} tokens" if prefill else f"a decode step, {requests} requests"
    return {"case": f"parts of {what}", "median_s": med}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--table-base", type=int, default=300_000)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--without-gemm", action="store_true", help="cache the GEMM's result (time the rest alone)")
    p.add_argument("--bookkeeping", action="store_true", help="also time the session's own work per request")
    p.add_argument("--parts", action="store_true", help="also time the parts of a begin/run/end decode step and prompt")
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this thread's CPU time instead of the wall clock (needs --threads 1): on a machine shared "
        "with other work, time spent descheduled is not counted",
    )
    args = p.parse_args(argv)
    if args.cpu_time:
        if args.threads != 1:
            p.error("--cpu-time needs --threads 1 (other threads' CPU time would not be counted)")
        global CLOCK
        CLOCK = time.thread_time
    tune_host_allocator()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    layer = build_layer(published(args.table_base), dtype)
    if args.without_gemm:
        without_gemm()
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    results = []
    if args.requests > 0:
        results.append(decode_case(layer, args.requests, args.steps, args.repeat))
    if args.prefill > 0:
        results.append(prefill_case(layer, args.prefill, args.repeat))
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.lower().startswith("model name")), cpu)
    except OSError:
        pass
    kernels = versions()["cpu_kernels"]  # what ple bench records: the kernels' ISA, threads, prefetch plan
    print(
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, CPU kernels {kernels}, "
        f"{torch.get_num_threads()} threads, {args.dtype}, GEMM {versions()['cpu_gemm']}"
        f"{', GEMM cached' if args.without_gemm else ''}{', thread CPU time' if args.cpu_time else ''}, "
        f"load average {load_start} -> {os.getloadavg() if hasattr(os, 'getloadavg') else None}"
    )
    names = list(_LABELS.values())
    print(
        "| case | floor ms | F.linear ms | "
        + " | ".join(f"{n} ms" for n in names)
        + " | "
        + " | ".join(f"{n} / floor" for n in names)
        + " | traffic MB | traffic ms | "
        + " | ".join(f"{n} / traffic" for n in names)
        + " | outputs equal |"
    )
    print("|---|" + "---:|" * (4 + 3 * len(names)) + "---|")
    ok = True
    for r in results:
        med = {k: statistics.median(v) * 1e3 for k, v in r["samples"].items()}
        r["median_ms"] = med
        ok &= r["session_equals_engine"]
        print(
            f"| {r['case']} | {med['floor']:.2f} | {med['linear']:.2f} | "
            + " | ".join(f"{med[k]:.2f}" for k in _LABELS)
            + " | "
            + " | ".join(f"{med[k] / med['floor']:.3f}" for k in _LABELS)
            + f" | {r['traffic_bytes'] / 1e6:.1f} | {med['traffic']:.3f} | "
            + " | ".join(f"{med[k] / med['traffic']:.2f}" for k in _LABELS)
            + f" | {'yes' if r['session_equals_engine'] else 'NO'} |"
        )
    for r in results:
        r["paired_ratios"] = paired = paired_ratios(r["samples"])
        print(
            f"{r['case']}, median of the rounds' own ratios to the floor (each call divided by the floor call of "
            "its round): " + ", ".join(f"{_LABELS[k]} {v:.3f}" for k, v in paired.items())
        )
    if args.bookkeeping:
        b = bookkeeping_case(layer, max(2, args.requests), args.repeat)
        med = {k: statistics.median(v) * 1e6 for k, v in b["samples"].items()}
        print(
            "bookkeeping (Session.step around a layer that returns its input): "
            + ", ".join(f"{k} {v:.0f} us" for k, v in med.items())
            + f"; per request {b['per_request_us']:.2f} us"
        )
        results.append(b)
    wanted = [(args.requests, 0)] if args.requests > 0 else []
    wanted += [(1, args.prefill)] if args.prefill > 0 else []
    for requests, prompt in wanted if args.parts else ():
        parts = parts_case(layer, requests, args.repeat if prompt else max(8, args.repeat), prompt)
        print(f"{parts['case']} (ms, medians):")
        order = ("begin", "n-gram ids kernel", "row gather kernel", "GEMM", "fused gate + conv kernel")
        order += ("rest of the engine call", "end", "beside the GEMM", "step")
        print("  " + ", ".join(f"{k} {parts['median_s'][k] * 1e3:.3f}" for k in order if k in parts["median_s"]))
        m = parts["median_s"]
        over = [f"{k} {m[k] / m['traffic']:.2f} x" for k in ("fused gate + conv kernel", "beside the GEMM") if k in m]
        print(f"  against the traffic floor ({m['traffic'] * 1e3:.3f} ms, a warm copy): " + ", ".join(over))
        results.append(parts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"dtype": args.dtype, "cpu": cpu, "threads": torch.get_num_threads(), "results": results}, f, indent=2
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
