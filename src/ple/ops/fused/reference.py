"""Literal reference of the fused step: :func:`ple.ops.gate.reference.ngram_gate`, the token mask, then
:func:`ple.ops.conv.reference.dilated_conv` with the residual ``hidden + v`` (or ``v``)."""

from __future__ import annotations

import torch

from ple.ops.conv import reference as conv_reference
from ple.ops.fused import composed
from ple.ops.gate import reference as gate_reference
from ple.ops.records import ConvWeights, GateWeights, StepMeta

__all__ = ["conv_stage", "gate_conv", "gate_stage"]


def gate_conv(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    gate: GateWeights,
    conv: ConvWeights,
    step: StepMeta,
    *,
    token_mask: torch.Tensor | None = None,
    add_hidden: bool = True,
    return_conv_input: bool = False,
    validate: bool = True,
):
    """Everything the layer computes after its projections, for a packed batch.

    Args:
        key: ``[T, HC*H]`` key projection; value: ``[T, H]`` value projection; hidden: ``[T, HC*H]``
            the layer input (activation dtype for all three; row-strided views are fine).
        gate: the gate's weights (:class:`ple.ops.GateWeights`).
        conv: the conv's weights (:class:`ple.ops.ConvWeights`).
        step: the packed step and its state pool (:class:`ple.ops.StepMeta`, as
            :func:`ple.ops.conv.reference.dilated_conv` reads them); the pool is updated in place.
        token_mask: ``[T]`` bool/0-1; False zeroes the token's gated value and conv input.
        add_hidden: add ``hidden`` to the output (the layer's residual); False returns ``v + conv``.
        return_conv_input: also return the conv inputs ``c [T, HC*H]``.
        validate: check index values (see ``dilated_conv``).

    Returns:
        ``out [T, HC*H]`` in the activation dtype, or ``(out, c)``. Equal to
        ``conv_stage(*gate_stage(...))``.
    """
    return composed.compose(
        gate_reference.ngram_gate,
        conv_reference.dilated_conv,
        key,
        value,
        hidden,
        gate,
        conv,
        step,
        token_mask=token_mask,
        add_hidden=add_hidden,
        return_conv_input=return_conv_input,
        validate=validate,
    )


def gate_stage(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    gate: GateWeights,
    *,
    token_mask: torch.Tensor | None = None,
    add_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first stage of :func:`gate_conv`, row by row (any subset of a batch's rows).

    Returns:
        ``(residual, c)``, each ``[T, HC*H]`` in the activation dtype: ``residual = hidden + v`` (``v``
        when ``add_hidden`` is False; masked tokens' ``v`` zeroed), rounded as :func:`gate_conv` rounds
        it, and ``c`` the conv input.
    """
    return composed.gate_stage(
        gate_reference.ngram_gate, key, value, hidden, gate, token_mask=token_mask, add_hidden=add_hidden
    )


def conv_stage(
    c: torch.Tensor,
    residual: torch.Tensor,
    conv: ConvWeights,
    step: StepMeta,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """The second stage of :func:`gate_conv` over a whole packed batch: ``residual + silu(conv(c))``
    ``[T, HC*H]``; updates the state pool exactly as :func:`gate_conv` does. Rows of ``residual`` that
    the caller does not need may hold anything (only their own output rows read them)."""
    return composed.conv_stage(conv_reference.dilated_conv, c, residual, conv, step, validate=validate)
