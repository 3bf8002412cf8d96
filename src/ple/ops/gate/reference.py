"""Literal reference of the PLE gate, in the operation order of transformers' ``Qwen4ExpTextPLELayer``.

Every intermediate is rounded to the activation dtype exactly where transformers rounds it, so in
bf16 this function reproduces transformers' gated value and conv input bit for bit.
"""

from __future__ import annotations

import math

import torch

from ple.ops.gate.checks import check_gate_args
from ple.ops.norm.reference import grouped_rms_norm
from ple.ops.records import GateWeights

__all__ = ["ngram_gate"]


def ngram_gate(
    key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor, gate: GateWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate the shared value by how well each stream's activations match its key.

    Args:
        key: ``[T, HC*H]`` key projection (before ``norm_key``).
        value: ``[T, H]`` value projection, shared by all streams.
        hidden: ``[T, HC*H]`` the layer input (the query).
        gate: the gate's weights (:class:`ple.ops.GateWeights`): ``norm_key``, ``norm_query``,
            ``norm_conv`` the ``[HC*H]`` grouped RMS norm weights, ``eps`` their epsilon, ``hc_count``
            the hyper-connection streams ``HC`` (the fp32 factors are not read here).

    Returns:
        ``(v, c)``, both ``[T, HC*H]`` in the activation dtype: ``v`` the gated value (stream-major),
        ``c = norm_conv(v)`` the conv input.
    """
    _, hidden_size = check_gate_args(key, value, hidden, gate)
    norm_key_weight, norm_query_weight, norm_conv_weight = gate.norm_key, gate.norm_query, gate.norm_conv
    eps, hc_count = gate.eps, gate.hc_count
    key_normed = grouped_rms_norm(key, norm_key_weight, hidden_size, eps).unflatten(-1, (hc_count, hidden_size))
    query_normed = grouped_rms_norm(hidden, norm_query_weight, hidden_size, eps).unflatten(-1, (hc_count, hidden_size))
    match = (key_normed * query_normed).sum(dim=-1, keepdim=True) / math.sqrt(hidden_size)
    match = match.abs().clamp_min(1e-6).sqrt() * match.sign()
    gated_value = torch.sigmoid(match) * value.unsqueeze(-2)
    conv_input = grouped_rms_norm(gated_value.flatten(-2), norm_conv_weight, hidden_size, eps)
    return gated_value.flatten(-2), conv_input
