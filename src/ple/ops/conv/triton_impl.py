"""Dilated conv over a packed batch as two Triton kernels.

1. ``_dilated_conv_kernel``, one program per (row, channel block): reads the row's ``K`` taps from the
   packed rows or from the request's slot, writes ``residual + silu(conv)``. It only reads the state.
2. ``_state_writeback_kernel``, one program per (request, channel block), launched after the first:
   gathers the last ``L`` columns of (kept slot columns ++ new rows) into registers, then, after a
   block-wide barrier, stores them into the slot. Every read of the batch thus precedes every write.

Addresses are computed in int64. Launch sizes are fixed (no autotuning: the second kernel writes
state in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple.ops.conv.checks import check_conv_args
from ple.ops.records import ConvWeights, StepMeta

__all__ = ["dilated_conv"]


@triton.jit
def _dilated_conv_kernel(
    c_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    res_ptr,
    token_request_ptr,
    qsl_ptr,
    slot_ptr,
    has_init_ptr,
    rejected_ptr,
    C,
    L,
    stride_ct,
    stride_cc,
    stride_wc,
    stride_wk,
    stride_ss,
    stride_sc,
    stride_sl,
    stride_ot,
    stride_rt,
    stride_rc,
    K: tl.constexpr,
    DILATION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_REJECTED: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    cmask = cols < C
    # Per-row metadata is loaded broadcast over the channel lanes so that every mask is a full vector.
    lanes = tl.zeros([BLOCK_C], dtype=tl.int64)
    r = tl.load(token_request_ptr + t + lanes).to(tl.int64)
    pos = t - tl.load(qsl_ptr + r).to(tl.int64)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    active = slot >= 0
    resumes = active & (tl.load(has_init_ptr + r) != 0)
    history_end = L + lanes
    if HAS_REJECTED:
        history_end -= tl.where(resumes, tl.load(rejected_ptr + r).to(tl.int64), 0)
    slot_base = state_ptr + tl.maximum(slot, 0) * stride_ss + cols * stride_sc

    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(K):
        back: tl.constexpr = (K - 1 - k) * DILATION
        p = pos - back
        in_chunk = p >= 0
        row = tl.where(in_chunk, t - back, 0)
        x = tl.load(c_ptr + row * stride_ct + cols * stride_cc, mask=cmask & in_chunk, other=0.0).to(tl.float32)
        col = tl.where(in_chunk, 0, history_end + p)
        x_hist = tl.load(slot_base + col * stride_sl, mask=cmask & (p < 0) & resumes, other=0.0)
        w = tl.load(w_ptr + cols * stride_wc + k * stride_wk, mask=cmask, other=0.0).to(tl.float32)
        acc += w * (x + x_hist.to(tl.float32))
    y = tl.where(active, acc * tl.sigmoid(acc), 0.0)
    if HAS_RESIDUAL:
        y += tl.load(res_ptr + t * stride_rt + cols * stride_rc, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _state_writeback_kernel(
    c_ptr,
    state_ptr,
    qsl_ptr,
    slot_ptr,
    has_init_ptr,
    rejected_ptr,
    C,
    L,
    stride_ct,
    stride_cc,
    stride_ss,
    stride_sc,
    stride_sl,
    HAS_REJECTED: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    cmask = cols < C
    j = tl.arange(0, BLOCK_L).to(tl.int64)
    jmask = j < L
    # Per-request metadata is loaded broadcast over the column lanes so that every mask is a full vector.
    lanes = tl.zeros([BLOCK_L], dtype=tl.int64)
    slot = tl.load(slot_ptr + r + lanes).to(tl.int64)
    active = slot >= 0
    resumes = active & (tl.load(has_init_ptr + r + lanes) != 0)
    start = tl.load(qsl_ptr + r + lanes).to(tl.int64)
    num_rows = tl.load(qsl_ptr + r + 1 + lanes).to(tl.int64) - start
    kept = L + lanes  # a fresh request keeps L zero columns
    if HAS_REJECTED:
        kept -= tl.where(resumes, tl.load(rejected_ptr + r + lanes).to(tl.int64), 0)
    # New column j holds element kept + num_rows - L + j of (kept slot columns ++ new rows).
    src = kept + num_rows - L + j
    from_rows = src >= kept
    from_slot = (src >= 0) & (src < kept) & resumes
    row = tl.where(from_rows, start + src - kept, 0)
    col = tl.where(from_slot, src, 0)
    slot_base = state_ptr + (tl.maximum(slot, 0) * stride_ss)[:, None]
    tile_mask = (jmask & active)[:, None] & cmask[None, :]
    x_rows = tl.load(
        c_ptr + row[:, None] * stride_ct + cols[None, :] * stride_cc,
        mask=tile_mask & from_rows[:, None],
        other=0.0,
    )
    x_slot = tl.load(
        slot_base + cols[None, :] * stride_sc + col[:, None] * stride_sl,
        mask=tile_mask & from_slot[:, None],
        other=0.0,
    )
    new = tl.where(from_rows[:, None], x_rows.to(state_ptr.dtype.element_ty), x_slot)
    # The slot is read and written by this block only: the barrier orders all its reads before its writes.
    tl.debug_barrier()
    tl.store(slot_base + cols[None, :] * stride_sc + j[:, None] * stride_sl, new, mask=tile_mask)


def dilated_conv(
    c: torch.Tensor, conv: ConvWeights, step: StepMeta, residual: torch.Tensor | None = None, *, validate: bool = True
) -> torch.Tensor:
    """The Triton twin of :func:`ple.ops.conv.reference.dilated_conv` (CUDA tensors): ``[T, C]`` in ``c.dtype``."""
    geo = check_conv_args(c, conv, step, residual, validate)
    tokens, channels, state_len = geo.tokens, geo.channels, geo.state_len
    out = torch.empty((tokens, channels), dtype=c.dtype, device=c.device)
    if channels == 0:
        return out
    weight, dilation, conv_state, num_rejected = conv.weight, conv.dilation, step.conv_state, step.num_rejected
    qsl = step.query_start_loc.contiguous()
    slots = step.state_indices.contiguous()
    has_init = step.has_initial_state.contiguous().view(torch.uint8)
    rejected = slots if num_rejected is None else num_rejected.contiguous()  # placeholder when absent
    res = out if residual is None else residual  # placeholder when absent

    if tokens > 0:
        token = torch.arange(tokens, device=c.device, dtype=qsl.dtype)
        token_request = torch.searchsorted(qsl[1:], token, right=True)
        block_c = min(triton.next_power_of_2(channels), 1024)
        _dilated_conv_kernel[(tokens, triton.cdiv(channels, block_c))](
            c,
            weight,
            conv_state,
            out,
            res,
            token_request,
            qsl,
            slots,
            has_init,
            rejected,
            channels,
            state_len,
            c.stride(0),
            c.stride(1),
            weight.stride(0),
            weight.stride(1),
            conv_state.stride(0),
            conv_state.stride(1),
            conv_state.stride(2),
            out.stride(0),
            res.stride(0),
            res.stride(1),
            K=geo.taps,
            DILATION=dilation,
            HAS_RESIDUAL=residual is not None,
            HAS_REJECTED=num_rejected is not None,
            BLOCK_C=block_c,
            num_warps=4,
        )

    if geo.num_requests > 0 and state_len > 0:
        block_l = triton.next_power_of_2(state_len)
        block_c = max(16, min(triton.next_power_of_2(channels), 4096 // block_l))
        _state_writeback_kernel[(geo.num_requests, triton.cdiv(channels, block_c))](
            c,
            conv_state,
            qsl,
            slots,
            has_init,
            rejected,
            channels,
            state_len,
            c.stride(0),
            c.stride(1),
            conv_state.stride(0),
            conv_state.stride(1),
            conv_state.stride(2),
            HAS_REJECTED=num_rejected is not None,
            BLOCK_L=block_l,
            BLOCK_C=block_c,
            num_warps=4,
        )
    return out
