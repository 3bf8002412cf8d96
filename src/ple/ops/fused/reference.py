"""Literal reference of the fused step: :func:`ple.ops.gate.reference.ngram_gate`, the token mask, then
:func:`ple.ops.conv.reference.dilated_conv` with the residual ``hidden + v`` (or ``v``)."""

from __future__ import annotations

import torch

from ..conv import reference as conv_reference
from ..gate import reference as gate_reference
from ._compose import compose

__all__ = ["gate_conv"]


def gate_conv(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key_weight: torch.Tensor,
    norm_query_weight: torch.Tensor,
    norm_conv_weight: torch.Tensor,
    eps: float,
    hc_count: int,
    conv_weight: torch.Tensor,
    dilation: int,
    query_start_loc: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_rejected: torch.Tensor | None = None,
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
        norm_key_weight, norm_query_weight, norm_conv_weight, eps, hc_count: as for
            :func:`ple.ops.gate.reference.ngram_gate`.
        conv_weight ``[C, K]``, dilation, query_start_loc ``[R+1]``, conv_state ``[S, C, L]``,
            state_indices ``[R]``, has_initial_state ``[R]``, num_rejected ``[R]``: as for
            :func:`ple.ops.conv.reference.dilated_conv` (``conv_state`` is updated in place).
        token_mask: ``[T]`` bool/0-1; False zeroes the token's gated value and conv input.
        add_hidden: add ``hidden`` to the output (the layer's residual); False returns ``v + conv``.
        return_conv_input: also return the conv inputs ``c [T, HC*H]``.
        validate: check index values (see ``dilated_conv``).

    Returns:
        ``out [T, HC*H]`` in the activation dtype, or ``(out, c)``.
    """
    return compose(
        gate_reference.ngram_gate,
        conv_reference.dilated_conv,
        key,
        value,
        hidden,
        norm_key_weight,
        norm_query_weight,
        norm_conv_weight,
        eps,
        hc_count,
        conv_weight,
        dilation,
        query_start_loc,
        conv_state,
        state_indices,
        has_initial_state,
        num_rejected,
        token_mask=token_mask,
        add_hidden=add_hidden,
        return_conv_input=return_conv_input,
        validate=validate,
    )
