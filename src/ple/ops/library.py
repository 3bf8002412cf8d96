"""The fused step as ``torch.library`` operators: ``torch.ops.ple.gate_conv``, ``gate_stage``, ``conv_stage``.

Registered with the low-level API (``Library.define`` + ``impl`` per device + a fake implementation),
which dispatches in a few microseconds (``torch.library.custom_op`` costs 15-25 us a call, too much
for a decode step). Each has a CPU kernel (the C kernel where it applies, else the PyTorch path) and
a CUDA kernel (Triton), declares what it mutates (the state pool, the ring offsets), and returns
fresh tensors only, so ``torch.compile(fullgraph=True)`` and ``torch.export`` trace through them and
CUDA graphs can capture them. No autograd: they serve the inference-only engine call.

Every call checks what shapes, dtypes and devices alone tell (:func:`check_gate_operator`,
:func:`check_conv_operator`: no device memory is read, so nothing synchronizes) and refuses
arguments that disagree with each other with a ple error, because an engine may call the operators
directly. Index values (offsets, slots, rejected columns) are checked by the C kernel on the CPU and
by the callers' validation (:meth:`ple.runtime.Batch.build`, ``validate=True``) elsewhere. The
fake implementations check nothing: while tracing, sizes may be symbolic (the compiled program's
calls run the checks).
"""

from __future__ import annotations

import contextlib

import torch

from .. import _native
from ..errors import ArgumentTypeError, InvalidArgumentError
from .conv.checks import check_conv_args
from .fused import native, torch_impl
from .gate.checks import check_gate_args
from .records import ConvWeights, GateWeights, StepMeta

__all__ = ["check_conv_operator", "check_gate_operator", "conv_stage", "gate_conv", "gate_stage", "named_range"]

_NO_RANGE = contextlib.nullcontext()


def named_range(name: str):
    """A named range for profilers (``torch.profiler.record_function``) while a profiler runs; a
    shared no-op otherwise (about a microsecond) and inside code that ``torch.compile`` traces."""
    if torch.compiler.is_compiling() or not getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return _NO_RANGE
    return torch.profiler.record_function(name)


_lib = torch.library.Library("ple", "FRAGMENT")

_GATE = (
    "Tensor norm_key, Tensor norm_query, Tensor norm_conv, Tensor key_query, Tensor conv_scale, float eps, int hc_count"
)
_CONV = "Tensor conv_weight, Tensor conv_taps, int dilation"
_STEP = (
    "Tensor query_start_loc, Tensor(a!) conv_state, Tensor state_indices, Tensor has_initial_state, "
    "Tensor num_rejected, Tensor(b!) state_offsets, bool ring"
)
_lib.define(
    f"gate_conv(Tensor key, Tensor value, Tensor hidden, {_GATE}, {_CONV}, {_STEP}, Tensor? token_mask, "
    "bool add_hidden, bool all_conv_inputs) -> (Tensor, Tensor)"
)
_lib.define(
    f"gate_stage(Tensor key, Tensor value, Tensor hidden, {_GATE}, Tensor? token_mask, bool add_hidden) -> (Tensor, Tensor)"
)
_lib.define(f"conv_stage(Tensor c, Tensor residual, {_CONV}, {_STEP}) -> Tensor")


# ---------------------------------------------------------------------------------------------- checks


_F32 = torch.float32
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _gate_ok(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, devices: bool) -> bool:
    """Whether the gate's arguments agree (the fast pass of :func:`check_gate_operator`: a few
    attribute reads per tensor)."""
    vs = value.shape
    if len(vs) != 2 or type(hc) is not int or hc < 1 or not eps >= 0:
        return False
    tc, cc = (vs[0], hc * vs[1]), (hc * vs[1],)
    dt = value.dtype
    if dt not in _ACT_DTYPES or key.dtype != dt or hidden.dtype != dt or key.shape != tc or hidden.shape != tc:
        return False
    if nk.shape != cc or nq.shape != cc or nc.shape != cc:
        return False
    if not (nk.is_floating_point() and nq.is_floating_point() and nc.is_floating_point()):
        return False
    if kq.shape != cc or cs.shape != cc or kq.dtype != _F32 or cs.dtype != _F32:
        return False
    if not (kq.is_contiguous() and cs.is_contiguous()):
        return False
    if token_mask is not None and token_mask.shape != (vs[0],):
        return False
    if devices:
        d = value.device
        named = (
            (key, hidden, nk, nq, nc, kq, cs) if token_mask is None else (key, hidden, nk, nq, nc, kq, cs, token_mask)
        )
        return all(t.device == d for t in named)
    return True


def _conv_ok(c_like, cw, taps, dil, qsl, pool, slots, has_init, rejected, offsets, ring, devices: bool) -> bool:
    """Whether the conv's and step's arguments agree (the fast pass of :func:`check_conv_operator`)."""
    if c_like.dim() != 2 or cw.dim() != 2 or pool.dim() != 3 or qsl.dim() != 1:
        return False
    c = c_like.shape[1]
    c_out, k = cw.shape
    if c_out != c or k < 1 or type(dil) is not int or dil < 1 or not cw.is_floating_point():
        return False
    if taps.shape != (k, c) or taps.dtype != _F32 or not taps.is_contiguous():
        return False
    s, a, b = pool.shape
    channels, state_len = (b, a) if ring else (a, b)
    if channels != c or state_len < (k - 1) * dil or not pool.is_floating_point():
        return False
    rr = (qsl.shape[0] - 1,)
    if rr[0] < 0 or qsl.dtype not in _INDEX_DTYPES or slots.dtype not in _INDEX_DTYPES:
        return False
    if slots.shape != rr or has_init.shape != rr or rejected.shape != rr or has_init.dtype != torch.bool:
        return False
    if rejected.dtype not in _INDEX_DTYPES:
        return False
    if ring and (offsets.shape != (s,) or offsets.dtype != torch.int64):
        return False
    if devices:
        d = c_like.device
        named = (
            (cw, taps, qsl, pool, slots, has_init, rejected, offsets)
            if ring
            else (cw, taps, qsl, pool, slots, has_init, rejected)
        )
        return all(t.device == d for t in named)
    return True


def _factor_problem(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> str | None:
    if tuple(t.shape) != shape:
        return f"{name}.shape={tuple(t.shape)}, expected {shape}"
    if t.dtype != _F32:
        return f"{name}.dtype={t.dtype}, expected float32 (see ple.ops.records)"
    if t.device != device:
        return f"{name} is on {t.device}, the activations on {device}; expected one device"
    if not t.is_contiguous():
        return f"{name} is not contiguous (stride {tuple(t.stride())})"
    return None


def _described(tensors: dict) -> str:
    return ", ".join(
        f"{k} {v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"{k}={v!r}" for k, v in tensors.items()
    )


def check_gate_operator(op, key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, *, devices=True) -> None:
    """The gate's arguments of ``torch.ops.ple.gate_conv`` / ``gate_stage``, from shapes, dtypes and
    devices only: ``key, hidden [T, C]``, ``value [T, H]``, ``C = hc*H``, the norms ``[C]``, the fp32
    factors ``key_query, conv_scale [C]`` contiguous, ``token_mask [T]`` or None, ``eps >= 0``;
    raises :class:`~ple.errors.InvalidArgumentError` / :class:`~ple.errors.ArgumentTypeError`
    naming the argument. ``devices=False`` skips the device checks (the dispatcher ran the CPU
    kernel: every tensor is on the CPU)."""
    if _gate_ok(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, devices):
        return
    for name, t in (("key", key), ("value", value), ("hidden", hidden)):
        if t.dim() != 2:
            raise InvalidArgumentError(f"{op}: {name}.shape={tuple(t.shape)}, expected 2-D rows")
    try:
        check_gate_args(key, value, hidden, nk, nq, nc, hc)
    except (InvalidArgumentError, ArgumentTypeError) as e:
        raise type(e)(f"{op}: {e}") from None
    if not eps >= 0:
        raise InvalidArgumentError(f"{op}: eps={eps!r}, expected a non-negative number")
    channels = hidden.shape[1]
    for name, t in (("key_query", kq), ("conv_scale", cs)):
        problem = _factor_problem(name, t, (channels,), value.device)
        if problem:
            raise InvalidArgumentError(f"{op}: {problem}")
    if token_mask is not None:
        raise InvalidArgumentError(
            f"{op}: token_mask is {tuple(token_mask.shape)} on {token_mask.device}, expected [T]=({value.shape[0]},) "
            f"on {value.device}"
        )
    raise InvalidArgumentError(  # pragma: no cover - the checks above name every case of the fast pass
        f"{op}: the gate's arguments disagree: {_described(dict(key=key, value=value, hidden=hidden, hc_count=hc))}"
    )


def check_conv_operator(
    op, c_like, cw, taps, dil, qsl, pool, slots, has_init, rejected, offsets, ring, *, devices=True
):
    """The conv's and step's arguments of ``torch.ops.ple.gate_conv`` / ``conv_stage``, from shapes,
    dtypes and devices only. ``c_like``: any ``[T, C]`` tensor of the activations' dtype and device.
    The pool is ``[S, C, L]``, or ``[S, L, C]`` with ``ring`` (then ``offsets`` int64 ``[S]``), with
    ``L >= (K-1)*dilation``; ``taps`` the fp32 contiguous ``[K, C]`` transpose of ``conv_weight [C, K]``;
    ``query_start_loc [R+1]``, ``state_indices``, ``has_initial_state`` (bool), ``num_rejected``
    ``[R]``. ``devices=False`` as in :func:`check_gate_operator`."""
    if _conv_ok(c_like, cw, taps, dil, qsl, pool, slots, has_init, rejected, offsets, ring, devices):
        return
    if pool.dim() != 3:
        raise InvalidArgumentError(f"{op}: conv_state.shape={tuple(pool.shape)}, expected 3-D")
    view = pool.transpose(1, 2) if ring else pool
    try:
        check_conv_args(c_like, cw, dil, qsl, view, slots, has_init, rejected, None, False)
    except (InvalidArgumentError, ArgumentTypeError) as e:
        layout = " (a ring pool is [S, L, C])" if ring else ""
        raise type(e)(f"{op}: {e}{layout}") from None
    channels, k = cw.shape
    problem = _factor_problem("conv_taps", taps, (k, channels), c_like.device)
    if problem:
        raise InvalidArgumentError(f"{op}: {problem}")
    if ring:
        raise InvalidArgumentError(
            f"{op}: state_offsets is {offsets.dtype} {tuple(offsets.shape)} on {offsets.device}, expected int64 "
            f"[S]=({pool.shape[0]},) on {pool.device}"
        )
    raise InvalidArgumentError(  # pragma: no cover - the checks above name every case of the fast pass
        f"{op}: the conv's arguments disagree: {_described(dict(conv_weight=cw, conv_state=pool, dilation=dil))}"
    )


def _gate(nk, nq, nc, kq, cs, eps, hc) -> GateWeights:
    return GateWeights(nk, nq, nc, eps, hc, kq, cs)


def _step(qsl, pool, slots, has_init, rejected, offsets, ring) -> StepMeta:
    return StepMeta(qsl, pool, slots, has_init, rejected, offsets if ring else None)


def _native_ok(ref: torch.Tensor, pool: torch.Tensor, taps: int, *rows: torch.Tensor) -> bool:
    return native.unsupported_reason(ref, pool, taps, *rows) is None and _native.available()


def _check_gate_conv(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, cw, taps, dil, *rest, devices=True) -> None:
    check_gate_operator("gate_conv", key, value, hidden, nk, nq, nc, kq, cs, eps, hc, rest[7], devices=devices)
    check_conv_operator("gate_conv", hidden, cw, taps, dil, *rest[:7], devices=devices)


def _gate_conv_cpu(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, cw, taps, dil, *rest):
    _check_gate_conv(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, cw, taps, dil, *rest, devices=False)
    step = native.kernel_step(_step(*rest[:7]))
    token_mask, add_hidden, all_c = rest[7:]
    gate, conv = _gate(nk, nq, nc, kq, cs, eps, hc), ConvWeights(cw, dil, taps)
    if _native_ok(value, step.conv_state, taps.shape[0], key, hidden):
        out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        c = torch.empty_like(out)
        mask = None if token_mask is None else (token_mask != 0).contiguous()
        native.run(key, value, hidden, gate, conv, step, mask, add_hidden, None, None, out, c, all_c)
        return out, c
    return torch_impl.gate_conv(
        key,
        value,
        hidden,
        gate,
        conv,
        step,
        token_mask=token_mask,
        add_hidden=add_hidden,
        return_conv_input=True,
        validate=False,
    )


def _gate_conv_cuda(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, cw, taps, dil, *rest):
    from .fused import triton_impl

    _check_gate_conv(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, cw, taps, dil, *rest)
    step = _step(*rest[:7])
    token_mask, add_hidden, _ = rest[7:]
    return triton_impl.gate_conv(
        key,
        value,
        hidden,
        _gate(nk, nq, nc, kq, cs, eps, hc),
        ConvWeights(cw, dil, taps),
        step,
        token_mask=token_mask,
        add_hidden=add_hidden,
        return_conv_input=True,
        validate=False,
    )


def _gate_conv_fake(key, value, hidden, *rest):
    out = hidden.new_empty(hidden.shape)
    return out, hidden.new_empty(hidden.shape)


def _gate_stage_cpu(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, add_hidden):
    check_gate_operator("gate_stage", key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, devices=False)
    gate = _gate(nk, nq, nc, kq, cs, eps, hc)
    if _native_ok(value, value.new_empty(1, 1, 1), 1, key, hidden):
        mask = None if token_mask is None else (token_mask != 0).contiguous()
        return native.gate_stage_unchecked(key, value, hidden, gate, mask, add_hidden)
    r, c = torch_impl.gate_stage(key, value, hidden, gate, token_mask=token_mask, add_hidden=add_hidden)
    return r, c


def _gate_stage_cuda(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, add_hidden):
    from .fused import triton_impl

    check_gate_operator("gate_stage", key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask)
    gate = _gate(nk, nq, nc, kq, cs, eps, hc)
    return triton_impl.gate_stage(key, value, hidden, gate, token_mask=token_mask, add_hidden=add_hidden)


def _gate_stage_fake(key, value, hidden, *rest):
    return hidden.new_empty(hidden.shape), hidden.new_empty(hidden.shape)


def _check_conv_stage(c, residual, cw, taps, dil, *rest, devices=True) -> None:
    if c.dim() != 2 or residual.shape != c.shape or residual.dtype != c.dtype or c.dtype not in _ACT_DTYPES:
        raise InvalidArgumentError(
            f"conv_stage: c is {c.dtype} {tuple(c.shape)}, residual {residual.dtype} {tuple(residual.shape)}; "
            "expected both [T, C] of one activation dtype (float16, bfloat16, float32)"
        )
    if devices and residual.device != c.device:
        raise InvalidArgumentError(
            f"conv_stage: c is {c.dtype} {tuple(c.shape)} on {c.device}, residual {residual.dtype} "
            f"{tuple(residual.shape)} on {residual.device}; expected both [T, C], one dtype, one device"
        )
    check_conv_operator("conv_stage", c, cw, taps, dil, *rest, devices=devices)


def _conv_stage_cpu(c, residual, cw, taps, dil, *rest):
    _check_conv_stage(c, residual, cw, taps, dil, *rest, devices=False)
    step, conv = native.kernel_step(_step(*rest)), ConvWeights(cw, dil, taps)
    if _native_ok(c, step.conv_state, taps.shape[0], residual):
        out = torch.empty_like(c, memory_format=torch.contiguous_format)
        native.run(None, None, None, None, conv, step, None, False, c.contiguous(), residual, out, None, False)
        return out
    return torch_impl.conv_stage(c, residual, conv, step, validate=False)


def _conv_stage_cuda(c, residual, cw, taps, dil, *rest):
    from .fused import triton_impl

    _check_conv_stage(c, residual, cw, taps, dil, *rest)
    return triton_impl.conv_stage(c, residual, ConvWeights(cw, dil, taps), _step(*rest), validate=False)


def _conv_stage_fake(c, residual, *rest):
    return c.new_empty(c.shape)


for _name, _cpu, _cuda, _fake in (
    ("gate_conv", _gate_conv_cpu, _gate_conv_cuda, _gate_conv_fake),
    ("gate_stage", _gate_stage_cpu, _gate_stage_cuda, _gate_stage_fake),
    ("conv_stage", _conv_stage_cpu, _conv_stage_cuda, _conv_stage_fake),
):
    _lib.impl(_name, _cpu, "CPU")
    _lib.impl(_name, _cuda, "CUDA")
    torch.library.register_fake(f"ple::{_name}", _fake, lib=_lib)


# ---------------------------------------------------------------------------------------------- wrappers


def _step_args(step: StepMeta) -> tuple:
    rejected = step.num_rejected
    if rejected is None:
        rejected = torch.zeros_like(step.state_indices)
    ring = step.state_offsets is not None
    offsets = step.state_offsets if ring else step.state_indices.new_empty(0)
    return (step.query_start_loc, step.conv_state, step.state_indices, step.has_initial_state, rejected, offsets, ring)


def _gate_args(gate: GateWeights) -> tuple:
    return (gate.norm_key, gate.norm_query, gate.norm_conv, gate.key_query, gate.conv_scale, gate.eps, gate.hc_count)


def gate_conv(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    gate: GateWeights,
    conv: ConvWeights,
    step: StepMeta,
    token_mask: torch.Tensor | None = None,
    add_hidden: bool = True,
    all_conv_inputs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.ple.gate_conv`` on records: ``(out [T, C], c [T, C])`` (``c`` complete when
    ``all_conv_inputs``, else its rows are undefined: the C kernel writes only those its state write
    reads back). Shapes, dtypes and devices are checked, index values only by the C kernel."""
    return torch.ops.ple.gate_conv(
        key,
        value,
        hidden,
        *_gate_args(gate),
        conv.weight,
        conv.taps,
        conv.dilation,
        *_step_args(step),
        token_mask,
        add_hidden,
        all_conv_inputs,
    )


def gate_stage(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    gate: GateWeights,
    token_mask: torch.Tensor | None = None,
    add_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.ple.gate_stage`` on a record: ``(residual, c)``."""
    return torch.ops.ple.gate_stage(key, value, hidden, *_gate_args(gate), token_mask, add_hidden)


def conv_stage(c: torch.Tensor, residual: torch.Tensor, conv: ConvWeights, step: StepMeta) -> torch.Tensor:
    """``torch.ops.ple.conv_stage`` on records: ``residual + silu(conv(c))``."""
    return torch.ops.ple.conv_stage(c, residual, conv.weight, conv.taps, conv.dilation, *_step_args(step))
