"""Grouped RMS norm as a Triton kernel: one program per (row, group), fp32 math, one rounding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple.ops.norm.checks import check_norm_args

__all__ = ["grouped_rms_norm"]

_MAX_BLOCK = 4096


@triton.jit
def _grouped_rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_xn,
    stride_xc,
    stride_on,
    group_size,
    eps,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xn
    out_row = out_ptr + row * stride_on
    base = group * group_size
    if NUM_CHUNKS == 1:
        mask = offs < group_size
        cols = base + offs
        x = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / group_size + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (x * inv_rms * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(NUM_CHUNKS):
            mask = i * BLOCK + offs < group_size
            cols = base + i * BLOCK + offs
            x = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        inv_rms = tl.rsqrt(tl.sum(acc, axis=0) / group_size + eps)
        for i in tl.static_range(NUM_CHUNKS):
            mask = i * BLOCK + offs < group_size
            cols = base + i * BLOCK + offs
            x = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols, (x * inv_rms * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=mask)


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """Same contract as :func:`ple.ops.norm.reference.grouped_rms_norm`; ``[T, C] -> [T, C]`` in ``x.dtype``."""
    check_norm_args(x, weight, group_size)
    lead = x.shape[:-1]
    channels = x.shape[-1]
    x2 = x.reshape(-1, channels)
    rows = x2.shape[0]
    out = torch.empty((rows, channels), dtype=x.dtype, device=x.device)
    if rows == 0 or channels == 0:
        return out.view(*lead, channels)
    weight = weight.contiguous()
    block = min(triton.next_power_of_2(group_size), _MAX_BLOCK)
    num_chunks = triton.cdiv(group_size, block)
    grid = (rows, channels // group_size)
    _grouped_rms_norm_kernel[grid](
        x2,
        weight,
        out,
        x2.stride(0),
        x2.stride(1),
        out.stride(0),
        group_size,
        float(eps),
        BLOCK=block,
        NUM_CHUNKS=num_chunks,
        num_warps=4 if block <= 1024 else 8,
    )
    return out.view(*lead, channels)
