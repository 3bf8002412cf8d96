"""PLE gate as one Triton kernel: one program per token, all streams, fp32 math, one rounding per output."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ple.ops.gate.checks import check_gate_args
from ple.ops.records import GateWeights

__all__ = ["ngram_gate"]

_MAX_BLOCK = 4096


@triton.jit
def _gate_kernel(
    key_ptr,
    value_ptr,
    hidden_ptr,
    wk_ptr,
    wq_ptr,
    wc_ptr,
    v_ptr,
    c_ptr,
    stride_kt,
    stride_kc,
    stride_vt,
    stride_vc,
    stride_ht,
    stride_hc,
    stride_ot,
    H,
    eps,
    inv_sqrt_h,
    HC: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    key_row = key_ptr + t * stride_kt
    hidden_row = hidden_ptr + t * stride_ht
    value_row = value_ptr + t * stride_vt
    v_row = v_ptr + t * stride_ot
    c_row = c_ptr + t * stride_ot

    acc_v = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i in tl.static_range(NUM_CHUNKS):
        cols = (i * BLOCK_H + offs).to(tl.int64)
        mask = cols < H
        val = tl.load(value_row + cols * stride_vc, mask=mask, other=0.0).to(tl.float32)
        acc_v += val * val
    ms_v = tl.sum(acc_v, axis=0) / H

    for s in tl.static_range(HC):
        acc_kk = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc_qq = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc_kq = tl.zeros([BLOCK_H], dtype=tl.float32)
        for i in tl.static_range(NUM_CHUNKS):
            cols = (i * BLOCK_H + offs).to(tl.int64)
            mask = cols < H
            ch = s * H + cols
            k = tl.load(key_row + ch * stride_kc, mask=mask, other=0.0).to(tl.float32)
            q = tl.load(hidden_row + ch * stride_hc, mask=mask, other=0.0).to(tl.float32)
            wk = tl.load(wk_ptr + ch, mask=mask, other=0.0).to(tl.float32)
            wq = tl.load(wq_ptr + ch, mask=mask, other=0.0).to(tl.float32)
            acc_kk += k * k
            acc_qq += q * q
            acc_kq += (k * (1.0 + wk)) * (q * (1.0 + wq))
        inv_k = tl.rsqrt(tl.sum(acc_kk, axis=0) / H + eps)
        inv_q = tl.rsqrt(tl.sum(acc_qq, axis=0) / H + eps)
        d = tl.sum(acc_kq, axis=0) * inv_k * inv_q * inv_sqrt_h
        mag = tl.sqrt(tl.maximum(tl.abs(d), 1e-6))
        signed = tl.where(d > 0, mag, tl.where(d < 0, -mag, 0.0))
        g = tl.sigmoid(signed)
        conv_scale = g * tl.rsqrt(g * g * ms_v + eps)
        for i in tl.static_range(NUM_CHUNKS):
            cols = (i * BLOCK_H + offs).to(tl.int64)
            mask = cols < H
            ch = s * H + cols
            val = tl.load(value_row + cols * stride_vc, mask=mask, other=0.0).to(tl.float32)
            wc = tl.load(wc_ptr + ch, mask=mask, other=0.0).to(tl.float32)
            tl.store(v_row + ch, (g * val).to(v_ptr.dtype.element_ty), mask=mask)
            tl.store(c_row + ch, (val * conv_scale * (1.0 + wc)).to(c_ptr.dtype.element_ty), mask=mask)


def ngram_gate(
    key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor, gate: GateWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton twin of :func:`ple.ops.gate.reference.ngram_gate` (CUDA tensors): ``(v, c)``, each ``[T, HC*H]``."""
    tokens, hidden_size = check_gate_args(key, value, hidden, gate)
    width = gate.hc_count * hidden_size
    v = torch.empty((tokens, width), dtype=value.dtype, device=value.device)
    c = torch.empty((tokens, width), dtype=value.dtype, device=value.device)
    if tokens == 0 or hidden_size == 0:
        return v, c
    block = min(triton.next_power_of_2(hidden_size), _MAX_BLOCK)
    _gate_kernel[(tokens,)](
        key,
        value,
        hidden,
        gate.norm_key.contiguous(),
        gate.norm_query.contiguous(),
        gate.norm_conv.contiguous(),
        v,
        c,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        hidden.stride(0),
        hidden.stride(1),
        v.stride(0),
        hidden_size,
        float(gate.eps),
        1.0 / math.sqrt(hidden_size),
        HC=gate.hc_count,
        BLOCK_H=block,
        NUM_CHUNKS=triton.cdiv(hidden_size, block),
        num_warps=4 if block <= 1024 else 8,
    )
    return v, c
