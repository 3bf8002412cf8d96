"""The fused step as ``torch.library`` operators: ``torch.ops.ple.gate_conv``, ``gate_stage``, ``conv_stage``.

Registered with the low-level API (``Library.define`` + ``impl`` per device + a fake implementation),
which dispatches in a few microseconds (``torch.library.custom_op`` costs 15-25 us a call, too much
for a decode step). Each has a CPU kernel (the C kernel where it applies, else the PyTorch path) and
a CUDA kernel (Triton), declares what it mutates (the state pool, the ring offsets), and returns
fresh tensors only, so ``torch.compile(fullgraph=True)`` and ``torch.export`` trace through them and
CUDA graphs can capture them. No autograd: they serve the inference-only engine call.

The operators run unchecked: callers validate once (:meth:`ple.runtime.Batch.build`, the records'
``build``) and the wrappers here only unpack the records. Index tensors are int64, flags bool.
"""

from __future__ import annotations

import contextlib

import torch

from .. import _native
from .fused import native, torch_impl
from .records import ConvWeights, GateWeights, StepMeta

__all__ = ["conv_stage", "gate_conv", "gate_stage", "named_range"]

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


def _gate(nk, nq, nc, kq, cs, eps, hc) -> GateWeights:
    return GateWeights(nk, nq, nc, eps, hc, kq, cs)


def _step(qsl, pool, slots, has_init, rejected, offsets, ring) -> StepMeta:
    return StepMeta(qsl, pool, slots, has_init, rejected, offsets if ring else None)


def _native_ok(ref: torch.Tensor, pool: torch.Tensor, taps: int, *rows: torch.Tensor) -> bool:
    return native.unsupported_reason(ref, pool, taps, *rows) is None and _native.available()


def _gate_conv_cpu(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, cw, taps, dil, *rest):
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
    gate = _gate(nk, nq, nc, kq, cs, eps, hc)
    if _native_ok(value, value.new_empty(1, 1, 1), 1, key, hidden):
        mask = None if token_mask is None else (token_mask != 0).contiguous()
        return native.gate_stage_unchecked(key, value, hidden, gate, mask, add_hidden)
    r, c = torch_impl.gate_stage(key, value, hidden, gate, token_mask=token_mask, add_hidden=add_hidden)
    return r, c


def _gate_stage_cuda(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, add_hidden):
    from .fused import triton_impl

    gate = _gate(nk, nq, nc, kq, cs, eps, hc)
    return triton_impl.gate_stage(key, value, hidden, gate, token_mask=token_mask, add_hidden=add_hidden)


def _gate_stage_fake(key, value, hidden, *rest):
    return hidden.new_empty(hidden.shape), hidden.new_empty(hidden.shape)


def _conv_stage_cpu(c, residual, cw, taps, dil, *rest):
    step, conv = native.kernel_step(_step(*rest)), ConvWeights(cw, dil, taps)
    if _native_ok(c, step.conv_state, taps.shape[0], residual):
        out = torch.empty_like(c, memory_format=torch.contiguous_format)
        native.run(None, None, None, None, conv, step, None, False, c.contiguous(), residual, out, None, False)
        return out
    return torch_impl.conv_stage(c, residual, conv, step, validate=False)


def _conv_stage_cuda(c, residual, cw, taps, dil, *rest):
    from .fused import triton_impl

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
    ``all_conv_inputs``, else only each request's last ``L`` rows are defined). Unchecked."""
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
    """``torch.ops.ple.gate_stage`` on a record: ``(residual, c)``. Unchecked."""
    return torch.ops.ple.gate_stage(key, value, hidden, *_gate_args(gate), token_mask, add_hidden)


def conv_stage(c: torch.Tensor, residual: torch.Tensor, conv: ConvWeights, step: StepMeta) -> torch.Tensor:
    """``torch.ops.ple.conv_stage`` on records: ``residual + silu(conv(c))``. Unchecked."""
    return torch.ops.ple.conv_stage(c, residual, conv.weight, conv.taps, conv.dilation, *_step_args(step))
