"""Named benchmark cases: each builds its inputs once and hands the runner callables to time.

A case compares three things on the same rows:

- ``ple``: :class:`ple.layer.PLELayer` called the way an engine calls it (a packed
  :class:`ple.runtime.Batch` and a state pool), or :func:`ple.ngram.ngram_ids` for ``ids``; the
  ``session-*`` cases run the same steps through the public :class:`ple.Session` (per-request
  inputs and outputs, contexts and states kept by the session);
- ``transformers``: ``Qwen4ExpTextPLELayer`` run as transformers runs it (padded
  ``[B, S, HC*H]`` tensors, ``hidden + module(hidden, ids, cache)``, its ``DynamicCache`` for decode);
- ``floor``: the two projections alone (``[T, E]`` with ``[HC*H + H, E]`` in the same dtype, the GEMM
  the layer runs: ``F.linear``, or on a CPU where :mod:`ple.kernels.cpu_gemm` packs bf16 weights, the packed
  GEMM for steps of up to its ``max_rows()`` rows), the arithmetic no implementation of the layer can avoid.

Before anything is timed the runner calls ``check(ple(), transformers())``: fp32 outputs must agree
within ``1e-4 * (1 + max|out|)``; bf16 outputs are judged against transformers run in fp32 on the same
(bf16-representable) weights and inputs: ple's error must be at most twice transformers' bf16 error
plus 1e-3. ``ids`` are compared exactly.

Geometry: the published one (H 2560, HC 4, E 2560, N 3, 8 heads per order, K 4, vocab 248320,
eos 248044) with a reduced table (``ngram_vocab_size_base`` 300,000: 16 heads of ~300k rows, 4.8 M
rows x 160; 3.1 GB in fp32, 1.5 GB in bf16), or the tiny :data:`QUICK` one for smoke runs.

Tokens: real text by default (:mod:`ple.data.realtext`: Qwen's BPE over Python's documentation; each
case's streams are consecutive pieces of it, the piece chosen by the case's salt), or uniform
random tokens with a fraction ``eos_rate`` of EOS (``token_source="synthetic"``, ``ple bench
--synthetic-tokens``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ple import ngram as ple_ngram
from ple.commands.bench.checks import BF16_ATOL, FP32_TOL, CheckResult, compare_outputs, dtype_name
from ple.commands.bench.fixture import (
    PUBLISHED,
    QUICK,
    Case,
    Fixture,
    Geometry,
    Prepared,
    Targets,
)
from ple.errors import InvalidArgumentError

__all__ = [
    "CASES",
    "Case",
    "BF16_ATOL",
    "CheckResult",
    "FP32_TOL",
    "compare_outputs",
    "Fixture",
    "Geometry",
    "Prepared",
    "PUBLISHED",
    "QUICK",
    "Targets",
    "gemm_tokens",
    "dtype_name",
    "select_cases",
    "step_traffic",
    "traffic_copy",
]


# ---------------------------------------------------------------------------------------------- geometry


# ---------------------------------------------------------------------------------------------- results


# ---------------------------------------------------------------------------------------------- fixture


# ---------------------------------------------------------------------------------------------- builders


def _build_ids(fx: Fixture) -> Prepared:
    geo = fx.geometry
    r, s = geo.ids_shape
    tokens = fx.tokens((r, s), salt=1)
    flat = tokens.reshape(-1)
    qsl = torch.arange(0, r * s + 1, s, dtype=torch.int64, device=fx.device)
    layout = fx.ple_config.layout(0)
    ctx = ple_ngram.fresh_context(r, layout, geo.eos_token_id, device=fx.device)
    emb = fx.ngram_module()

    def ple():
        return ple_ngram.ngram_ids(flat, qsl, ctx, layout, geo.eos_token_id)

    def ple_unchecked():
        return ple_ngram.ngram_ids(flat, qsl, ctx, layout, geo.eos_token_id, check=False)

    def transformers():
        with torch.no_grad():
            return emb(tokens, None)

    def check(p, t):
        t = t.reshape(-1, geo.config.num_heads)
        if p.shape != t.shape or p.dtype != t.dtype:
            return CheckResult(False, f"ple ids {tuple(p.shape)} {p.dtype}, transformers {tuple(t.shape)} {t.dtype}")
        diff = int((p != t).sum())
        return CheckResult(diff == 0, "ids equal" if diff == 0 else f"{diff} ids differ", {"ids_differing": diff})

    return Prepared(
        shape=f"{r}x{s}",
        tokens=r * s,
        ple=ple,
        transformers=transformers,
        check=check,
        aux={"ple_ids_unchecked": ple_unchecked},
        notes="transformers: Qwen4ExpTextNGramEmbedding.forward with its embedding replaced by an identity "
        "(returns the ids); ple: the checked entry point ple.ngram.ngram_ids (aux: check=False)",
    )


def _prefill_references(fx: Fixture, mod, hidden: torch.Tensor, tokens: torch.Tensor):
    """transformers' module on fresh prompts ``hidden [R, S, HC*H]``, ``tokens [R, S]`` in the case's
    dtype, and the fp32 module on the same inputs (the reference both are judged against)."""

    def transformers():
        with torch.no_grad():
            return hidden + mod(hidden, tokens, None)

    def reference():
        m32 = fx.module(torch.float32)
        h32 = hidden.float()
        with torch.no_grad():
            return h32 + m32(h32, tokens, None)

    return transformers, reference


def _decode_references(fx: Fixture, hf, hist_h, hist_t, step_h: torch.Tensor, step_t: torch.Tensor):
    """Decode steps ``step_h [steps, R, HC*H]``, ``step_t [steps, R]`` through transformers' module
    (``hf``, an ``_HFRequests`` after the history ``hist_h``/``hist_t``), and through the fp32 module
    from the same history (the reference)."""
    steps = step_t.shape[0]

    def transformers():
        with torch.no_grad():
            return [hf(step_h[s][:, None], step_t[s][:, None]) for s in range(steps)]

    def reference():
        hf32 = _HFRequests(fx, fx.module(torch.float32), hist_h.float(), hist_t)
        with torch.no_grad():
            return [hf32(step_h[s][:, None].float(), step_t[s][:, None]) for s in range(steps)]

    return transformers, reference


def _prefill_prepared(fx: Fixture, mod, hidden, tokens, dtype, ple, layer, notes: str, reset=None) -> Prepared:
    """A prefill case of ``tokens [r, s]``: ple's callable beside transformers' on the same inputs."""
    r, s = tokens.shape
    transformers, reference = _prefill_references(fx, mod, hidden, tokens)
    return Prepared(
        shape=f"{r}x{s}",
        tokens=r * s,
        ple=ple,
        transformers=transformers,
        check=lambda p, t: compare_outputs(p, t, dtype, reference),
        floor=fx.floor([r * s], dtype),
        reset=reset,
        layer=layer,
        notes=notes,
    )


def _prefill_builder(which: str, dtype: torch.dtype) -> Callable[[Fixture], Prepared]:
    def build(fx: Fixture) -> Prepared:
        from ple.runtime import Batch

        geo = fx.geometry
        r, s = geo.prefill_long if which == "long" else geo.prefill_batch
        c = geo.config.hc_hidden_size
        layer, mod = fx.layer(dtype), fx.module(dtype)
        tokens = fx.tokens((r, s), salt=10 + r)
        hidden = fx.hidden((r, s, c), dtype, salt=20 + r)
        flat_h, flat_t = hidden.reshape(r * s, c), tokens.reshape(-1)
        pool = layer.new_state_pool(r)
        ctx = ple_ngram.fresh_context(r, layer.layout, geo.eos_token_id)
        batch = Batch.build([s] * r, list(range(r)), ctx, pool, conv_window=layer.config.conv_window)

        def ple():
            with torch.no_grad():
                return layer(flat_h, flat_t, batch)

        notes = "ple: one packed batch of fresh requests; transformers: hidden + module(hidden [B, S, HC*H], ids, None)"
        return _prefill_prepared(fx, mod, hidden, tokens, dtype, ple, layer, notes)

    return build


def _restore_hf_cache(cache, layer_idx: int, snapshot: dict[int, torch.Tensor]) -> None:
    lay = cache.layers[layer_idx]
    for i, t in snapshot.items():
        lay.conv_states[i].copy_(t)


def _snapshot_hf_cache(cache, layer_idx: int) -> dict[int, torch.Tensor]:
    lay = cache.layers[layer_idx]
    return {i: lay.conv_states[i].clone() for i in (1, 2)}


class _HFRequests:
    """transformers' module with one ``DynamicCache`` holding a batch of requests' history."""

    def __init__(self, fx: Fixture, mod: nn.Module, hist_hidden: torch.Tensor, hist_tokens: torch.Tensor):
        self.fx, self.mod = fx, mod
        self.cache = fx.new_cache()
        with torch.no_grad():
            mod(hist_hidden, hist_tokens, self.cache)
        self.snapshot = _snapshot_hf_cache(self.cache, fx.layer_idx)

    def reset(self) -> None:
        _restore_hf_cache(self.cache, self.fx.layer_idx, self.snapshot)

    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return hidden + self.mod(hidden, tokens, self.cache)


def _warm_ple(fx: Fixture, layer, hist_hidden: torch.Tensor, hist_tokens: torch.Tensor):
    """Run every request's history through ``layer``: returns (state pool, ngram contexts [R, N-1])."""
    from ple.runtime import Batch

    geo = fx.geometry
    r, p = hist_tokens.shape
    pool = layer.new_state_pool(r)
    ctx = ple_ngram.fresh_context(r, layer.layout, geo.eos_token_id, device=fx.device)
    batch = Batch.build([p] * r, list(range(r)), ctx, pool, conv_window=layer.config.conv_window)
    flat_t = hist_tokens.reshape(-1)
    with torch.no_grad():
        layer(hist_hidden.reshape(r * p, -1), flat_t, batch)
    return pool, ple_ngram.next_ngram_context(flat_t, batch.query_start_loc, ctx)


def _decode_inputs(fx: Fixture, dtype: torch.dtype):
    """A decode case's inputs: ``(geometry, requests, steps, layer, module, history tokens [r, p],
    history hidden [r, p, c], step tokens [steps, r], step hidden [steps, r, c])``."""
    geo = fx.geometry
    r, steps, p, c = geo.decode_requests, geo.decode_steps, geo.history, geo.config.hc_hidden_size
    layer, mod = fx.layer(dtype), fx.module(dtype)
    hist_t = fx.tokens((r, p), salt=30)
    hist_h = fx.hidden((r, p, c), dtype, salt=31)
    step_t = fx.tokens((steps, r), salt=32)
    step_h = fx.hidden((steps, r, c), dtype, salt=33)
    return geo, r, steps, layer, mod, hist_t, hist_h, step_t, step_h


def _decode_prepared(fx: Fixture, hf, inputs, dtype, ple, join, reset, fields: dict) -> Prepared:
    """A decode case: ple's callable (its outputs joined by ``join`` into one tensor a step) beside
    transformers' on ``inputs`` = (history hidden [r, p, c], history tokens [r, p], step hidden
    [steps, r, c], step tokens [steps, r])."""
    hist_h, hist_t, step_h, step_t = inputs
    steps, r = step_t.shape
    transformers, reference = _decode_references(fx, hf, hist_h, hist_t, step_h, step_t)
    return Prepared(
        shape=f"{r}x1 x{steps} steps",
        tokens=r * steps,
        ple=ple,
        transformers=transformers,
        check=lambda a, b: compare_outputs(join(a), b, dtype, reference),
        floor=fx.floor([r] * steps, dtype),
        reset=reset,
        **fields,
    )


def _decode_builder(dtype: torch.dtype) -> Callable[[Fixture], Prepared]:
    def build(fx: Fixture) -> Prepared:
        from ple.runtime import Batch

        geo, r, steps, layer, mod, hist_t, hist_h, step_t, step_h = _decode_inputs(fx, dtype)
        window = layer.config.conv_window

        pool, ctx0 = _warm_ple(fx, layer, hist_h, hist_t)
        pool_snapshot = pool.clone()
        one = torch.arange(r + 1, device=fx.device)

        def build_batches():
            out, ctx = [], ctx0
            for s in range(steps):
                out.append(Batch.build([1] * r, list(range(r)), ctx, pool, conv_window=window))
                ctx = ple_ngram.next_ngram_context(step_t[s], one, ctx)
            return out

        batches = build_batches()
        hf = _HFRequests(fx, mod, hist_h, hist_t)

        def reset():
            pool.copy_(pool_snapshot)
            hf.reset()

        def ple():
            with torch.no_grad():
                return [layer(step_h[s], step_t[s], batches[s]) for s in range(steps)]

        fields = dict(
            aux={"ple_step_metadata": build_batches},
            layer=layer,
            notes=f"{r} requests with {geo.history} tokens of history each, then {steps} steps of one token; times are per "
            f"{steps} steps. ple: decode Batch rows + state pool (metadata built outside the timed region; "
            "aux ple_step_metadata = Batch.build + next_ngram_context for all steps); transformers: its module "
            f"with DynamicCache(config) of batch {r}",
        )
        return _decode_prepared(fx, hf, (hist_h, hist_t, step_h, step_t), dtype, ple, lambda outs: outs, reset, fields)

    return build


def _mixed_builder(dtype: torch.dtype) -> Callable[[Fixture], Prepared]:
    def build(fx: Fixture) -> Prepared:
        from ple.runtime import DECODE, PREFILL, Batch

        geo = fx.geometry
        rd, (rp, chunk), p, c = geo.mixed_decode, geo.mixed_prefill, geo.history, geo.config.hc_hidden_size
        r = rd + rp
        layer, mod = fx.layer(dtype), fx.module(dtype)
        hist_t = fx.tokens((r, p), salt=40)
        hist_h = fx.hidden((r, p, c), dtype, salt=41)
        dec_t = fx.tokens((rd,), salt=42)
        dec_h = fx.hidden((rd, c), dtype, salt=43)
        pre_t = fx.tokens((rp, chunk), salt=44)
        pre_h = fx.hidden((rp, chunk, c), dtype, salt=45)

        pool, ctx = _warm_ple(fx, layer, hist_h, hist_t)
        pool_snapshot = pool.clone()
        batch = Batch.build(
            [1] * rd + [chunk] * rp,
            list(range(r)),
            ctx,
            pool,
            kinds=[DECODE] * rd + [PREFILL] * rp,
            has_initial_state=[True] * r,
            conv_window=layer.config.conv_window,
        )
        flat_h = torch.cat([dec_h, pre_h.reshape(rp * chunk, c)])
        flat_t = torch.cat([dec_t, pre_t.reshape(-1)])
        hf_dec = _HFRequests(fx, mod, hist_h[:rd], hist_t[:rd])
        hf_pre = _HFRequests(fx, mod, hist_h[rd:], hist_t[rd:])

        def reset():
            pool.copy_(pool_snapshot)
            hf_dec.reset()
            hf_pre.reset()

        def ple():
            with torch.no_grad():
                return layer(flat_h, flat_t, batch)

        def transformers():
            with torch.no_grad():
                return [hf_dec(dec_h[:, None], dec_t[:, None]), hf_pre(pre_h, pre_t)]

        def reference():
            m32 = fx.module(torch.float32)
            d32 = _HFRequests(fx, m32, hist_h[:rd].float(), hist_t[:rd])
            p32 = _HFRequests(fx, m32, hist_h[rd:].float(), hist_t[rd:])
            with torch.no_grad():
                return [d32(dec_h[:, None].float(), dec_t[:, None]), p32(pre_h.float(), pre_t)]

        return Prepared(
            shape=f"{rd}x1 + {rp}x{chunk}",
            tokens=rd + rp * chunk,
            ple=ple,
            transformers=transformers,
            check=lambda a, b: compare_outputs(a, b, dtype, reference),
            floor=fx.floor([rd + rp * chunk], dtype),
            reset=reset,
            layer=layer,
            notes=f"all {r} requests have {p} tokens of history; one step: {rd} decode rows + {rp} continuation "
            f"chunks of {chunk}. ple: one packed batch. transformers runs it as it must be run: two calls, the "
            f"decode rows with their cache (batch {rd}) and the chunks with theirs (batch {rp}). Padding all "
            f"rows to {chunk} in one call is not an option: transformers replaces padded ids with EOS (cutting "
            "the decode rows' n-gram history) and zero-pads the conv input between the cached window and the "
            "new token, so the decode rows' outputs would be wrong (and it would compute 64x256 rows).",
        )

    return build


def step_traffic(layer, tokens: int, requests: int, history_taps: int) -> tuple[int, int]:
    """(bytes read, bytes written) by the work beside the GEMM of one step of ``tokens`` tokens over
    ``requests`` requests, each token reading ``history_taps`` conv taps from the state (decode: K-1;
    a fresh prefill: 0), from the shapes and dtypes."""
    cfg, lay = layer.config, layer.layout
    act = layer.dtype.itemsize
    tab = layer.table.storage_dtype.itemsize
    c, h, g, e = cfg.hc_hidden_size, cfg.hidden_size, lay.num_heads, lay.embed_dim
    ctx = requests * (cfg.ngram_size - 1) * 8
    read = (
        tokens * 8  # tokens
        + ctx  # contexts
        + tokens * g * 8  # row ids
        + tokens * g * lay.head_dim * tab  # table rows
        + tokens * (c + h) * act  # the projections' outputs
        + tokens * c * act  # hidden
        + tokens * history_taps * c * act  # state taps
    )
    state_cols = min(tokens, requests * cfg.conv_window) if history_taps else min(tokens, cfg.conv_window)
    written = (
        tokens * g * 8  # row ids
        + tokens * e * act  # gathered rows (the GEMM's input)
        + tokens * c * act  # outputs
        + state_cols * c * act  # new state columns
        + ctx  # contexts
    )
    return read, written


def traffic_copy(nbytes: int, device: torch.device | str = "cpu") -> Callable[[], Any]:
    """A plain copy of ``nbytes`` bytes in all (half read, half written)."""
    half = max(1, nbytes // 2)
    src = torch.ones(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _session_decode_builder(dtype: torch.dtype) -> Callable[[Fixture], Prepared]:
    def build(fx: Fixture) -> Prepared:
        from ple.runtime import Session

        geo, r, steps, layer, mod, hist_t, hist_h, step_t, step_h = _decode_inputs(fx, dtype)
        session = Session(layer, r)
        for i in range(r):
            session.add(i)
        session.step({i: (hist_h[i], hist_t[i]) for i in range(r)})
        saved = {i: session.prefix_state(i) for i in range(r)}
        inputs = [{i: (step_h[s][i : i + 1], step_t[s][i : i + 1]) for i in range(r)} for s in range(steps)]
        hf = _HFRequests(fx, mod, hist_h, hist_t)
        copy = traffic_copy(sum(step_traffic(layer, r, r, geo.config.ple_conv_kernel_size - 1)), fx.device)

        def reset():
            for i in range(r):
                session.finish(i)
                session.add(i, from_state=saved[i])
            hf.reset()

        def ple():  # Session.step alone: the check joins its outputs, untimed
            with torch.no_grad():
                return [session.step(inputs[s]) for s in range(steps)]

        def joined(outs: list) -> list[torch.Tensor]:
            return [torch.cat(list(out.values())) for out in outs]

        fields = dict(
            aux={"traffic": lambda: [copy() for _ in range(steps)]},
            layer=layer,
            notes=f"{r} requests with {geo.history} tokens of history each, then {steps} steps of one token through "
            "ple.Session.step ({request: (hidden, tokens)} in, {request: new hidden} out; the session packs the "
            "batch, keeps contexts and states); times are per "
            f"{steps} steps. transformers: its module with DynamicCache(config) of batch {r}. aux 'traffic': a plain "
            "copy of the bytes the work beside the GEMM must read and write (step_traffic), the traffic floor",
        )
        return _decode_prepared(fx, hf, (hist_h, hist_t, step_h, step_t), dtype, ple, joined, reset, fields)

    return build


def _session_prefill_builder(dtype: torch.dtype) -> Callable[[Fixture], Prepared]:
    def build(fx: Fixture) -> Prepared:
        from ple.runtime import Session

        geo = fx.geometry
        r, s, c = *geo.prefill_long, geo.config.hc_hidden_size
        layer, mod = fx.layer(dtype), fx.module(dtype)
        tokens = fx.tokens((r, s), salt=10 + r)
        hidden = fx.hidden((r, s, c), dtype, salt=20 + r)
        session = Session(layer, r)
        inputs = {i: (hidden[i], tokens[i]) for i in range(r)}

        def reset():
            for i in list(session.request_ids):
                session.finish(i)
            for i in range(r):
                session.add(i)

        def ple():
            with torch.no_grad():
                return list(session.step(inputs).values())

        notes = (
            "ple: fresh requests' prompts through ple.Session.step; transformers: hidden + module(hidden, ids, None)"
        )
        return _prefill_prepared(fx, mod, hidden, tokens, dtype, ple, layer, notes, reset=reset)

    return build


# The targets are the goals: what ple adds to the GEMM it cannot avoid (ple / floor, bf16, the dtype
# served). Speed-ups against transformers are reported, not targeted: they measure transformers.
_BF16, _FP32 = torch.bfloat16, torch.float32
_WHAT = {
    "long": "one long fresh prompt",
    "batch": "a batch of fresh prompts",
    "session-decode": "decode steps through ple.Session",
}
CASES: tuple[Case, ...] = tuple(
    Case(name, kind, dtype, Targets(floor_max=floor_max), builder, what)
    for name, kind, dtype, floor_max, builder, what in (
        ("ids", "ids", None, None, _build_ids, "n-gram row ids of a [R, S] token batch"),
        ("prefill-long-bf16", "prefill", _BF16, 1.3, _prefill_builder("long", _BF16), _WHAT["long"]),
        ("prefill-batch-bf16", "prefill", _BF16, 1.3, _prefill_builder("batch", _BF16), _WHAT["batch"]),
        ("prefill-long-fp32", "prefill", _FP32, None, _prefill_builder("long", _FP32), _WHAT["long"]),
        ("prefill-batch-fp32", "prefill", _FP32, None, _prefill_builder("batch", _FP32), _WHAT["batch"]),
        ("decode-bf16", "decode", _BF16, 1.3, _decode_builder(_BF16), "decode steps"),
        ("decode-fp32", "decode", _FP32, None, _decode_builder(_FP32), "decode steps"),
        ("session-decode-bf16", "decode", _BF16, 1.15, _session_decode_builder(_BF16), _WHAT["session-decode"]),
        ("session-decode-fp32", "decode", _FP32, 1.15, _session_decode_builder(_FP32), _WHAT["session-decode"]),
        (
            "session-prefill-bf16",
            "prefill",
            _BF16,
            1.1,
            _session_prefill_builder(_BF16),
            "one long prompt through ple.Session",
        ),
        ("mixed-bf16", "mixed", _BF16, None, _mixed_builder(_BF16), "decode rows and continuation chunks in one step"),
    )
)


def gemm_tokens(case: Case, geo: Geometry) -> int:
    """Rows one call of ``case`` sends through the projections' GEMM (0 for ``ids``): what its run
    time scales with, for the runner's estimate before anything is built."""
    if case.kind == "ids":
        return 0
    if case.kind == "prefill":
        r, s = geo.prefill_batch if "batch" in case.name else geo.prefill_long
        return r * s
    if case.kind == "decode":
        return geo.decode_requests * geo.decode_steps
    return geo.mixed_decode + geo.mixed_prefill[0] * geo.mixed_prefill[1]


def select_cases(spec: str | None) -> list[Case]:
    """Cases named by a comma-separated list of names, prefixes (``prefill``) or globs (``*-bf16``);
    None or ``all`` selects every case. Unknown names raise ``ValueError`` listing the known ones, and
    so does an empty list (say ``all``: an unset variable in a script must not select every case)."""
    import fnmatch

    if spec is None or spec.strip() == "all":
        return list(CASES)
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise InvalidArgumentError(
            f"--cases {spec!r} names no case (say 'all' for every case); known cases: {', '.join(c.name for c in CASES)}"
        )
    chosen: list[Case] = []
    for part in parts:
        hits = [c for c in CASES if c.name == part or c.name.startswith(part + "-") or fnmatch.fnmatch(c.name, part)]
        if not hits:
            raise InvalidArgumentError(
                f"no benchmark case matches {part!r}; known cases: {', '.join(c.name for c in CASES)}"
            )
        chosen.extend(c for c in hits if c not in chosen)
    return chosen
