"""PLE gate, CPU fast path: fp32 throughout, reductions fused, one rounding per output.

Uses ``rms(g * value) = g * rms(value)`` (the gate ``g`` is a positive scalar per stream), so the
conv input is ``value * g * rsqrt(g^2 * mean(value^2) + eps) * (1 + w_conv)`` without a second pass
over the gated value.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_gate_args

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
    """Same contract as :func:`ple.ops.gate.reference.ngram_gate`; returns ``(v, c)``, each ``[T, HC*H]``."""
    tokens, hidden_size = check_gate_args(
        key, value, hidden, norm_key_weight, norm_query_weight, norm_conv_weight, hc_count
    )
    dtype = value.dtype
    shape = (tokens, hc_count, hidden_size)
    k = key.reshape(shape).float()
    q = hidden.reshape(shape).float()
    val = value.float()
    wkq = ((1.0 + norm_key_weight.float()) * (1.0 + norm_query_weight.float())).view(hc_count, hidden_size)
    wc = (1.0 + norm_conv_weight.float()).view(hc_count, hidden_size)

    # [T, HC] reductions in fp32: mean squares (no temporaries) and the weighted key-query dot.
    ms_k = torch.linalg.vector_norm(k, dim=-1).square_().div_(hidden_size)
    ms_q = torch.linalg.vector_norm(q, dim=-1).square_().div_(hidden_size)
    dot = (k * wkq).mul_(q).sum(dim=-1)
    d = dot.mul_(torch.rsqrt(ms_k.add_(eps)).mul_(torch.rsqrt(ms_q.add_(eps)))).div_(math.sqrt(hidden_size))
    g = torch.sigmoid(d.abs().clamp_min_(1e-6).sqrt_().mul_(d.sign()))

    ms_v = torch.mean(val * val, dim=-1, keepdim=True)  # [T, 1]
    conv_scale = g * torch.rsqrt(g * g * ms_v + eps)  # [T, HC]
    v = (g.unsqueeze(-1) * val.unsqueeze(1)).to(dtype)
    c = (val.unsqueeze(1) * conv_scale.unsqueeze(-1)).mul_(wc).to(dtype)
    return v.view(tokens, hc_count * hidden_size), c.view(tokens, hc_count * hidden_size)
