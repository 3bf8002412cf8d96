"""Gate, then mask, then conv: the fused step composed of a gate twin and a conv twin (two passes).

The reference (:mod:`.reference`) composes the literal reference ops; :data:`TORCH` the PyTorch fast
paths (the CPU's general kernel of the fused operators); :func:`triton` the Triton kernels (CUDA).
Each :class:`Composed` has the three functions of :mod:`.reference` with its contract.
"""

from __future__ import annotations

import functools

import torch

from ple.errors import InvalidArgumentError
from ple.ops.conv import torch_impl as conv_torch
from ple.ops.gate import torch_impl as gate_torch
from ple.ops.records import ConvWeights, GateWeights, StepMeta
from ple.ops.state import via_engine_layout


def gate_stage(gate_fn, key, value, hidden, gate: GateWeights, *, token_mask=None, add_hidden=True):
    """``(residual, c)``: the gated value (masked) plus ``hidden`` when ``add_hidden``, and the conv input."""
    check_token_mask(token_mask, value.shape[0])
    v, c = gate_fn(key, value, hidden, gate)
    if token_mask is not None:
        m = token_mask.to(v.dtype).unsqueeze(1)
        v = v * m
        c = c * m
    return (v.add_(hidden) if add_hidden else v), c


def conv_stage(conv_fn, c, residual, conv: ConvWeights, step: StepMeta, *, validate=True):
    """``residual + silu(conv(c))`` through ``conv_fn`` (a ``dilated_conv`` twin); a ring pool goes
    through the engine layout (see :func:`ple.ops.state.via_engine_layout`)."""
    check_stage_inputs(c, residual)

    def run(s: StepMeta) -> torch.Tensor:
        return conv_fn(c, conv, s, residual, validate=validate)

    return via_engine_layout(step, run) if step.state_offsets is not None else run(step)


def compose(
    gate_fn,
    conv_fn,
    key,
    value,
    hidden,
    gate: GateWeights,
    conv: ConvWeights,
    step: StepMeta,
    *,
    token_mask=None,
    add_hidden=True,
    return_conv_input=False,
    validate=True,
):
    residual, c = gate_stage(gate_fn, key, value, hidden, gate, token_mask=token_mask, add_hidden=add_hidden)
    out = conv_stage(conv_fn, c, residual, conv, step, validate=validate)
    return (out, c) if return_conv_input else out


class Composed:
    """The fused step of ``gate_fn`` (an ``ngram_gate`` twin) and ``conv_fn`` (a ``dilated_conv``
    twin): ``gate_conv``, ``gate_stage`` and ``conv_stage`` with the contracts of :mod:`.reference`."""

    def __init__(self, gate_fn, conv_fn) -> None:
        self.gate_fn, self.conv_fn = gate_fn, conv_fn

    def gate_conv(self, key, value, hidden, gate: GateWeights, conv: ConvWeights, step: StepMeta, **options):
        """See :func:`ple.ops.fused.reference.gate_conv`."""
        return compose(self.gate_fn, self.conv_fn, key, value, hidden, gate, conv, step, **options)

    def gate_stage(self, key, value, hidden, gate: GateWeights, **options):
        """See :func:`ple.ops.fused.reference.gate_stage`."""
        return gate_stage(self.gate_fn, key, value, hidden, gate, **options)

    def conv_stage(self, c, residual, conv: ConvWeights, step: StepMeta, **options):
        """See :func:`ple.ops.fused.reference.conv_stage`."""
        return conv_stage(self.conv_fn, c, residual, conv, step, **options)


TORCH = Composed(gate_torch.ngram_gate, conv_torch.dilated_conv)
"""The PyTorch fast paths of the gate and the conv, composed."""


@functools.cache
def triton() -> Composed:
    """The Triton kernels of the gate and the conv, composed (imports Triton on first use)."""
    from ple.ops.conv import triton_impl as conv_triton
    from ple.ops.gate import triton_impl as gate_triton

    return Composed(gate_triton.ngram_gate, conv_triton.dilated_conv)


def check_token_mask(token_mask, tokens: int) -> None:
    if token_mask is not None and tuple(token_mask.shape) != (tokens,):
        raise InvalidArgumentError(f"gate_conv: token_mask.shape={tuple(token_mask.shape)}, expected [T]=({tokens},)")


def check_stage_inputs(c: torch.Tensor, residual: torch.Tensor) -> None:
    if not isinstance(c, torch.Tensor) or c.dim() != 2:
        raise InvalidArgumentError(f"conv_stage: c must be a [T, C] tensor, got {getattr(c, 'shape', type(c))}")
    if not isinstance(residual, torch.Tensor) or residual.shape != c.shape or residual.dtype != c.dtype:
        raise InvalidArgumentError(
            f"conv_stage: residual must be [T, C] = {tuple(c.shape)} {c.dtype} like c, got "
            f"{tuple(getattr(residual, 'shape', ()))} {getattr(residual, 'dtype', type(residual))}"
        )
