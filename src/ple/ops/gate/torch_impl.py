"""PLE gate, CPU fast path: fp32 arithmetic on token blocks that stay in cache, one rounding per output.

Uses ``rms(g * value) = g * rms(value)`` (the gate ``g`` is a positive scalar per stream), so the
conv input is ``value * g * rsqrt(g^2 * mean(value^2) + eps) * (1 + w_conv)`` without a second pass
over the gated value, and ``d = rsqrt(ms_k) rsqrt(ms_q) sum(k * q * (1 + w_k)(1 + w_q)) / sqrt(H)``
without materializing the normed key and query. Tokens are processed in blocks whose fp32
temporaries fit in the CPU cache, so each input is read from memory once and each output written once.

Each row's result does not depend on the other rows: PyTorch computes transcendental functions of a
tensor's trailing elements (beyond its last full vector) with a scalar formula that may differ from
the vector one in the last bit, so the per-stream scalars of a block are laid out in a buffer padded
to a multiple of 64 elements, where every element takes the vector path.
"""

from __future__ import annotations

import math

import torch

from ple.ops.gate.checks import check_gate_args
from ple.ops.records import GateWeights

__all__ = ["ngram_gate"]

# fp32 elements of one block's widest temporary ([B, HC*H]): 4 MiB, within L2 on current server cores.
_BLOCK_ELEMENTS = 1 << 20
_VECTOR_PAD = 64  # elements: a multiple of every CPU vector width PyTorch uses for fp32


def ngram_gate(
    key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor, gate: GateWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ple.ops.gate.reference.ngram_gate`; returns ``(v, c)``, each ``[T, HC*H]``."""
    tokens, hidden_size = check_gate_args(key, value, hidden, gate)
    norm_key_weight, norm_query_weight, norm_conv_weight = gate.norm_key, gate.norm_query, gate.norm_conv
    eps, hc_count = gate.eps, gate.hc_count
    dtype = value.dtype
    width = hc_count * hidden_size
    v = torch.empty(tokens, width, dtype=dtype, device=value.device)
    c = torch.empty(tokens, width, dtype=dtype, device=value.device)
    if tokens == 0:
        return v, c
    wkq = ((1.0 + norm_key_weight.float()) * (1.0 + norm_query_weight.float())).view(hc_count, hidden_size)
    wc = (1.0 + norm_conv_weight.float()).view(hc_count, hidden_size)
    block = max(1, min(tokens, _BLOCK_ELEMENTS // width))
    kf = torch.empty(block, hc_count, hidden_size)
    qf = torch.empty(block, hc_count, hidden_size)
    vf = torch.empty(block, hidden_size)
    scalars = torch.zeros(-(-block * hc_count // _VECTOR_PAD) * _VECTOR_PAD)
    inv_sqrt_h = 1.0 / math.sqrt(hidden_size)
    for a in range(0, tokens, block):
        b = min(tokens, a + block)
        n = b - a
        k, q, val = kf[:n], qf[:n], vf[:n]
        k.copy_(key[a:b].view(n, hc_count, hidden_size))
        q.copy_(hidden[a:b].view(n, hc_count, hidden_size))
        val.copy_(value[a:b])
        # [n, HC] reductions: mean squares and the weighted key-query dot
        ms_k = torch.linalg.vector_norm(k, dim=-1).square_().mul_(1.0 / hidden_size).add_(eps).rsqrt_()
        ms_q = torch.linalg.vector_norm(q, dim=-1).square_().mul_(1.0 / hidden_size).add_(eps).rsqrt_()
        dot = torch.linalg.vecdot(k.mul_(wkq), q)
        d = dot.mul_(ms_k).mul_(ms_q).mul_(inv_sqrt_h)
        g = _vector_path(scalars, d.abs().clamp_min_(1e-6).sqrt_().mul_(d.sign()), torch.sigmoid_)
        ms_v = torch.linalg.vector_norm(val, dim=-1, keepdim=True).square_().mul_(1.0 / hidden_size)  # [n, 1]
        conv_scale = g * _vector_path(scalars, g * g * ms_v + eps, torch.rsqrt_)  # [n, HC]
        vb = val.unsqueeze(1)
        # k's storage is free again: build the outputs there before the single rounding
        torch.mul(vb, g.unsqueeze(-1), out=k)
        v[a:b].view(n, hc_count, hidden_size).copy_(k)
        torch.mul(vb, conv_scale.unsqueeze(-1), out=q)
        c[a:b].view(n, hc_count, hidden_size).copy_(q.mul_(wc))
    return v, c


def _vector_path(buf: torch.Tensor, x: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` applied in place to a copy of ``x [n, HC]`` laid out in ``buf`` (padded with zeros to a
    multiple of :data:`_VECTOR_PAD`), so that every element takes the vector formula."""
    count = x.numel()
    used = buf[: -(-count // _VECTOR_PAD) * _VECTOR_PAD]
    used[:count].copy_(x.reshape(-1))
    used[count:].zero_()
    fn(used)
    return used[:count].view(x.shape).clone()
