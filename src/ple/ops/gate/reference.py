"""Literal reference of the PLE gate, in the operation order of transformers' ``Qwen4ExpTextPLELayer``.

Every intermediate is rounded to the activation dtype exactly where transformers rounds it, so in
bf16 this function reproduces transformers' gated value and conv input bit for bit.
"""

from __future__ import annotations

import math

import torch

from ..norm.reference import grouped_rms_norm
from .checks import check_gate_args

__all__ = ["ngram_gate"]


def ngram_gate(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key_weight: torch.Tensor,
    norm_query_weight: torch.Tensor,
    norm_conv_weight: torch.Tensor,
    eps: float,
    hc_count: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate the shared value by how well each stream's activations match its key.

    Args:
        key: ``[T, HC*H]`` key projection (before ``norm_key``).
        value: ``[T, H]`` value projection, shared by all streams.
        hidden: ``[T, HC*H]`` the layer input (the query).
        norm_key_weight, norm_query_weight, norm_conv_weight: ``[HC*H]`` grouped RMS norm weights.
        eps: epsilon of the three norms.
        hc_count: number of hyper-connection streams ``HC``.

    Returns:
        ``(v, c)``, both ``[T, HC*H]`` in the activation dtype: ``v`` the gated value (stream-major),
        ``c = norm_conv(v)`` the conv input.
    """
    _, hidden_size = check_gate_args(key, value, hidden, norm_key_weight, norm_query_weight, norm_conv_weight, hc_count)
    key_normed = grouped_rms_norm(key, norm_key_weight, hidden_size, eps).unflatten(-1, (hc_count, hidden_size))
    query_normed = grouped_rms_norm(hidden, norm_query_weight, hidden_size, eps).unflatten(-1, (hc_count, hidden_size))
    gate = (key_normed * query_normed).sum(dim=-1, keepdim=True) / math.sqrt(hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated_value = torch.sigmoid(gate) * value.unsqueeze(-2)
    conv_input = grouped_rms_norm(gated_value.flatten(-2), norm_conv_weight, hidden_size, eps)
    return gated_value.flatten(-2), conv_input
