"""Gate, then mask, then conv: the composition shared by the reference, PyTorch and Triton twins."""

from __future__ import annotations

import torch

from ...errors import InvalidArgumentError
from ..records import ConvWeights, GateWeights, StepMeta
from ..state import via_engine_layout


def gate_stage(gate_fn, key, value, hidden, gate: GateWeights, *, token_mask=None, add_hidden=True):
    """``(residual, c)``: the gated value (masked) plus ``hidden`` when ``add_hidden``, and the conv input."""
    check_token_mask(token_mask, value.shape[0])
    v, c = gate_fn(key, value, hidden, gate.norm_key, gate.norm_query, gate.norm_conv, gate.eps, gate.hc_count)
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
        return conv_fn(
            c,
            conv.weight,
            conv.dilation,
            s.query_start_loc,
            s.conv_state,
            s.state_indices,
            s.has_initial_state,
            s.num_rejected,
            residual=residual,
            validate=validate,
        )

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
