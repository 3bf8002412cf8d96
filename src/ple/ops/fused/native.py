"""The fused step on the CPU in one pass per token row: the C kernel of :mod:`ple.kernels.native`.

Gate, mask, conv taps (from the request's earlier rows or, before its chunk, straight from its state
slot), SiLU, residual and the state write-back run row by row with fp32 arithmetic, so each input
is read from memory once and the output written once (the PyTorch path makes about six passes).
Rounding points are those of the PyTorch fast path. Work is split into token ranges of requests
run by up to ``torch.get_num_threads()`` threads (PyTorch's own OpenMP threads where the library shares
its OpenMP runtime, see :func:`ple.kernels.native.team`; one per 2^13 row elements then, per 2^18 with threads
started per call); results do not depend on the split.

The two stages run the same kernel: :func:`gate_stage` is the gate over rows without state (its
output is the rounded residual), :func:`conv_stage` reads given conv inputs and residual rows
instead of the gate's, so ``conv_stage(*gate_stage(...))`` is bit for bit :func:`gate_conv`.
"""

from __future__ import annotations

import torch

from ple.errors import InvalidArgumentError
from ple.kernels import native as _native
from ple.ops.conv.checks import check_conv_args
from ple.ops.fused.composed import check_stage_inputs, check_token_mask
from ple.ops.gate.checks import check_gate_args
from ple.ops.records import ConvWeights, GateWeights, StepMeta
from ple.ops.state import check_ring, engine_view

__all__ = ["MAX_TAPS", "conv_stage", "gate_conv", "gate_stage", "launch", "raise_for_code", "unsupported_reason"]

_DTYPES = {torch.bfloat16: 1, torch.float32: 0}
MAX_TAPS = 64  # MAX_TAPS in ple_cpu.c: conv taps per channel the kernel takes


def unsupported_reason(value: torch.Tensor, conv_state: torch.Tensor, taps: int, *rows: torch.Tensor) -> str | None:
    """Why these tensors cannot take the C kernel (None when they can). ``rows``: activations whose
    rows the kernel reads (each must have unit column stride)."""
    if taps > MAX_TAPS:
        return f"{taps} conv taps (the kernel takes at most {MAX_TAPS})"
    if value.device.type != "cpu":
        return f"tensors are on {value.device}, the kernel runs on the CPU"
    if value.dtype not in _DTYPES:
        return f"activation dtype {value.dtype} (the kernel computes bfloat16 and float32)"
    if conv_state.dtype != value.dtype:
        return f"state pool dtype {conv_state.dtype} differs from the activation dtype {value.dtype}"
    if not conv_state.is_contiguous():
        return "the state pool is not contiguous"
    for t in (value, *rows):
        if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            return f"rows are not contiguous (stride {tuple(t.stride())})"
    return None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_MIN_THREAD_ELEMENTS = {"openmp": 1 << 13, "pthreads": 1 << 18}
"""Row elements (tokens x channels) per thread before another thread joins: below, starting it costs
more than it saves. PyTorch's OpenMP threads are already running (a few microseconds to join: a decode
step of 2 requests at the published geometry runs on two); a thread started per call costs tens of
microseconds (8 requests run on one, 64 on two)."""


def _unit_tokens(tokens: int, nthreads: int) -> int:
    return max(32, -(-tokens // (4 * max(1, nthreads))))


def launch(tokens: int, channels: int, threads: int, team: str) -> tuple[int, int]:
    """``(tokens per work unit, threads)`` of a kernel call over ``[tokens, channels]`` rows when
    ``threads`` (``torch.get_num_threads()``) may run and the kernels' threads are ``team``
    (:func:`ple.kernels.native.team`): what :func:`gate_conv` passes when its ``threads`` is None."""
    nthreads = max(1, min(threads, tokens * channels // _MIN_THREAD_ELEMENTS[team]))
    return _unit_tokens(tokens, nthreads), nthreads


def raise_for_code(rc: int, step: StepMeta, window: int, state_len: int) -> None:
    """Raise the error the kernel's non-zero return code ``rc`` stands for."""
    if rc >= 1000:
        r = rc - 1000
        rej = 0 if step.num_rejected is None else int(step.num_rejected[r])
        raise InvalidArgumentError(
            f"gate_conv: request {r} resumes from slot {int(step.state_indices[r])} with its history ending at column "
            f"{state_len - rej}, outside [W={window}, L={state_len}] (num_rejected too large)"
        )
    if rc == -2:
        raise MemoryError("gate_conv: the C kernel could not allocate its scratch buffers")
    raise InvalidArgumentError(f"gate_conv: the C kernel refused the arguments (code {rc}); run with validate=True")


def run(
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    hidden: torch.Tensor | None,
    gate: GateWeights | None,
    conv: ConvWeights,
    step: StepMeta,
    token_mask: torch.Tensor | None,
    add_hidden: bool,
    c_in: torch.Tensor | None,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    c_out: torch.Tensor | None,
    c_all: bool,
    threads: int | None = None,
) -> None:
    """The kernel call without checks (the caller checked shapes, dtypes and what the kernel takes).

    Index tensors of ``step`` must be contiguous int64 (``has_initial_state`` bool), ``c_in``
    contiguous; ``token_mask`` contiguous bool. Raises on a history outside the slot.
    """
    lib = _native.library()
    pool = step.conv_state
    taps = conv.taps.shape[0]
    if step.state_offsets is not None:
        num_slots, state_len, _ = pool.shape
    else:
        num_slots, _, state_len = pool.shape
    ref = value if value is not None else c_in
    assert ref is not None
    tokens = out.shape[0]
    if c_in is None:
        assert key is not None and value is not None and hidden is not None and gate is not None
        hidden_size = value.shape[1]
        hc = gate.hc_count
        eps = gate.eps
        wkq, wc = gate.key_query, gate.conv_scale
        strides = (key.stride(0), value.stride(0), hidden.stride(0))
    else:
        hidden_size, hc, eps, wkq, wc = c_in.shape[1], 1, 0.0, None, None
        strides = (0, 0, 0)
    if threads is None:
        unit, nthreads = launch(tokens, out.shape[1], torch.get_num_threads(), _native.team())
    else:
        nthreads = int(threads)
        unit = _unit_tokens(tokens, nthreads)
    rc = lib.ple_gate_conv(
        _DTYPES[ref.dtype],
        tokens,
        hidden_size,
        hc,
        taps,
        conv.dilation,
        state_len,
        num_slots,
        step.query_start_loc.shape[0] - 1,
        float(eps),
        _ptr(key),
        strides[0],
        _ptr(value),
        strides[1],
        _ptr(hidden),
        strides[2],
        _ptr(wkq),
        _ptr(wc),
        _ptr(conv.taps),
        _ptr(step.query_start_loc),
        _ptr(step.state_indices),
        _ptr(step.has_initial_state),
        _ptr(step.num_rejected),
        _ptr(token_mask),
        _ptr(pool),
        _ptr(step.state_offsets),
        int(bool(add_hidden)),
        _ptr(c_in),
        _ptr(residual),
        0 if residual is None else residual.stride(0),
        _ptr(out),
        _ptr(c_out),
        int(bool(c_all)),
        unit,
        nthreads,
    )
    if rc != 0:
        raise_for_code(rc, step, conv.window, state_len)


def kernel_step(step: StepMeta) -> StepMeta:
    """The step with the index tensors as the kernel reads them (contiguous int64, bool)."""
    i64 = torch.int64
    nr = step.num_rejected
    qsl, slots, has_init = step.query_start_loc, step.state_indices, step.has_initial_state
    if (
        qsl.dtype == i64
        and slots.dtype == i64
        and (nr is None or nr.dtype == i64)
        and qsl.is_contiguous()
        and slots.is_contiguous()
        and has_init.is_contiguous()
        and (nr is None or nr.is_contiguous())
    ):
        return step  # as built by a Batch: nothing to convert
    return StepMeta(
        step.query_start_loc.to(i64).contiguous(),
        step.conv_state,
        step.state_indices.to(i64).contiguous(),
        step.has_initial_state.contiguous(),
        None if nr is None else nr.to(i64).contiguous(),
        step.state_offsets,
    )


def _kernel_mask(token_mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if token_mask is None else (token_mask != 0).contiguous()


def _check_native(value, conv_state, conv: ConvWeights, *rows) -> None:
    reason = unsupported_reason(value, conv_state, conv.taps.shape[0], *rows)
    if reason is not None:
        raise InvalidArgumentError(f"gate_conv (C kernel): {reason}")


def _check_step(c_like: torch.Tensor, conv: ConvWeights, step: StepMeta, residual, validate: bool):
    check_ring(step)
    return check_conv_args(c_like, conv, engine_view(step), residual, validate)


def gate_conv(
    key, value, hidden, gate, conv, step, *, token_mask=None, add_hidden=True, return_conv_input=False, validate=True,
    threads=None,
):  # fmt: skip
    """Same contract as :func:`ple.ops.fused.reference.gate_conv`; ``threads`` defaults to torch's.

    ``validate=False`` skips the index checks: the offsets and history bounds are still checked in
    the kernel (memory safety), but two requests sharing a slot give undefined results. Also takes
    the ring state layout (``step.state_offsets``).

    Raises :class:`ple.kernels.native.NativeUnavailable` when the kernel cannot be built, and ``ValueError``
    for tensors it does not take (see :func:`unsupported_reason`).
    """
    tokens, hidden_size = check_gate_args(key, value, hidden, gate)
    channels = gate.hc_count * hidden_size
    _check_step(value.new_empty(1).expand(tokens, channels), conv, step, None, validate)
    _check_native(value, step.conv_state, conv, key, hidden)
    check_token_mask(token_mask, tokens)
    out = torch.empty(tokens, channels, dtype=value.dtype)
    c = torch.empty(tokens, channels, dtype=value.dtype)
    run(
        key,
        value,
        hidden,
        gate,
        conv,
        kernel_step(step),
        _kernel_mask(token_mask),
        add_hidden,
        None,
        None,
        out,
        c,
        return_conv_input,
        threads,
    )
    return (out, c) if return_conv_input else out


def gate_stage(
    key, value, hidden, gate, *, token_mask=None, add_hidden=True, threads=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ple.ops.fused.reference.gate_stage`: ``(residual, c)``, each ``[T, HC*H]``."""
    tokens, hidden_size = check_gate_args(key, value, hidden, gate)
    check_token_mask(token_mask, tokens)
    if value.dtype not in _DTYPES or value.device.type != "cpu":
        raise InvalidArgumentError(f"gate_stage (C kernel): {value.dtype} on {value.device} is not taken")
    _check_native(value, value.new_empty(1, 1, 1), _NO_CONV, key, hidden)
    return gate_stage_unchecked(key, value, hidden, gate, _kernel_mask(token_mask), add_hidden, threads)


def gate_stage_unchecked(key, value, hidden, gate, token_mask, add_hidden, threads=None):
    """:func:`gate_stage` without checks (``token_mask`` contiguous bool or None)."""
    tokens, channels = hidden.shape
    residual = torch.empty(tokens, channels, dtype=value.dtype)
    c = torch.empty(tokens, channels, dtype=value.dtype)
    # One request over all rows, without a slot: the kernel's output is the rounded residual.
    i64 = torch.int64
    rows = StepMeta(
        torch.tensor([0, tokens], dtype=i64),
        value.new_empty(0, channels, 0),
        torch.tensor([-1], dtype=i64),
        torch.zeros(1, dtype=torch.bool),
    )
    run(key, value, hidden, gate, _NO_CONV, rows, token_mask, add_hidden, None, None, residual, c, True, threads)
    return residual, c


def conv_stage(c, residual, conv, step, *, validate=True, threads=None) -> torch.Tensor:
    """Same contract as :func:`ple.ops.fused.reference.conv_stage`: ``residual + silu(conv(c))`` ``[T, C]``."""
    check_stage_inputs(c, residual)
    _check_step(c, conv, step, residual, validate)
    _check_native(c, step.conv_state, conv, residual)
    out = torch.empty_like(c, memory_format=torch.contiguous_format)
    run(
        None,
        None,
        None,
        None,
        conv,
        kernel_step(step),
        None,
        False,
        c.contiguous(),
        residual,
        out,
        None,
        False,
        threads,
    )
    return out


# A conv that is never run (rows without a slot): what the gate stage passes to the kernel.
_NO_CONV = ConvWeights(torch.zeros(1, 1), 1, torch.zeros(1, 1))
