"""N-gram ids as a Triton kernel: one program per block of tokens, int64 arithmetic throughout.

Each token finds its request by a binary search over ``query_start_loc``, reads itself and its
``N-1`` predecessors (from the packed chunk, or from its request's ``ngram_context`` row when the
predecessor lies before the chunk), applies the EOS cut, and writes one ``[G]`` row of ids. No
intermediate tensor is materialized; the output tile ``[BLOCK_T, G]`` is stored in one piece.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ple.errors import InvalidArgumentError
from ple.ngram.tensors import with_layout

__all__ = ["ngram_ids", "next_ngram_context"]

_BLOCK_T = 128
_BLOCK_R = 64


def _search_steps(num_requests: int) -> int:
    """Binary-search steps that narrow ``[0, num_requests)`` to one request: ``ceil(log2(R+1))``."""
    return max(1, int(num_requests).bit_length())


@triton.jit
def _find_request(qsl_ptr, stride_q, tok, num_requests, SEARCH_STEPS: tl.constexpr):
    """For each token index in ``tok``, the request ``r`` with ``qsl[r] <= tok < qsl[r+1]``.

    Largest ``r`` in ``[0, R)`` with ``qsl[r] <= tok``: empty requests share their start with the
    next one, so the largest such ``r`` is the non-empty request that holds the token.
    """
    lo = tl.zeros_like(tok)
    hi = tl.zeros_like(tok) + num_requests
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        # mid < hi <= R whenever hi - lo >= 2; once hi - lo == 1, mid == lo and nothing moves
        start = tl.load(qsl_ptr + mid * stride_q).to(tl.int64)
        go_right = start <= tok
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _ngram_ids_kernel(
    x_ptr,
    qsl_ptr,
    ctx_ptr,
    mult_ptr,
    sizes_ptr,
    offs_ptr,
    out_ptr,
    num_tokens,
    num_requests,
    eos_token_id,
    stride_x,
    stride_q,
    stride_cr,
    stride_cc,
    N: tl.constexpr,
    HEADS_PER_NGRAM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    G: tl.constexpr = (N - 1) * HEADS_PER_NGRAM
    K: tl.constexpr = N - 1
    pid = tl.program_id(0).to(tl.int64)
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tok_mask = tok < num_tokens
    eos = tl.full([BLOCK_T], eos_token_id, tl.int64)

    req = _find_request(qsl_ptr, stride_q, tok, num_requests, SEARCH_STEPS)
    start = tl.load(qsl_ptr + req * stride_q, mask=tok_mask, other=0).to(tl.int64)

    col = tl.arange(0, BLOCK_G)
    col_mask = col < G
    order_of_col = col // HEADS_PER_NGRAM  # 0 for bigram heads, 1 for trigram heads, ...

    y0 = tl.load(x_ptr + tok * stride_x, mask=tok_mask, other=0).to(tl.int64)
    h = y0 * tl.load(mult_ptr).to(tl.int64)
    h_cols = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int64)
    alive = tok_mask
    prev = y0
    for s in tl.static_range(1, N):
        if s >= 2:
            # y_s survives only if no EOS lies strictly between t-s and t
            alive = alive & (prev != eos)
        pos = tok - s
        in_chunk = pos >= start
        from_x = tl.load(x_ptr + pos * stride_x, mask=tok_mask & in_chunk, other=0).to(tl.int64)
        ctx_col = K + pos - start  # in [0, K) whenever pos < start
        ctx_ptrs = ctx_ptr + req * stride_cr + ctx_col * stride_cc
        from_ctx = tl.load(ctx_ptrs, mask=tok_mask & (pos < start), other=0).to(tl.int64)
        prev = tl.where(in_chunk, from_x, from_ctx)
        y = tl.where(alive, prev, eos)
        h = h ^ (y * tl.load(mult_ptr + s).to(tl.int64))
        h_cols = tl.where((order_of_col == s - 1)[None, :], h[:, None], h_cols)

    sizes = tl.load(sizes_ptr + col, mask=col_mask, other=1).to(tl.int64)
    offs = tl.load(offs_ptr + col, mask=col_mask, other=0).to(tl.int64)
    # Triton's integer % truncates toward zero (C semantics); shift negatives into [0, P)
    rem = h_cols % sizes[None, :]
    rem = tl.where(rem < 0, rem + sizes[None, :], rem)
    out_offs = tok[:, None] * G + col[None, :]
    tl.store(out_ptr + out_offs, offs[None, :] + rem, mask=tok_mask[:, None] & col_mask[None, :])


@triton.jit
def _next_context_kernel(
    x_ptr,
    qsl_ptr,
    ctx_ptr,
    out_ptr,
    num_requests,
    stride_x,
    stride_q,
    stride_cr,
    stride_cc,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    req = pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    req_mask = req < num_requests
    start = tl.load(qsl_ptr + req * stride_q, mask=req_mask, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + (req + 1) * stride_q, mask=req_mask, other=0).to(tl.int64)
    k = tl.arange(0, BLOCK_K).to(tl.int64)
    mask = req_mask[:, None] & (k < K)[None, :]
    # history = context ++ chunk; its last K entries sit at chunk positions end-K+k
    pos = end[:, None] - K + k[None, :]
    in_chunk = pos >= start[:, None]
    from_x = tl.load(x_ptr + pos * stride_x, mask=mask & in_chunk, other=0).to(tl.int64)
    ctx_col = K + pos - start[:, None]
    ctx_ptrs = ctx_ptr + req[:, None] * stride_cr + ctx_col * stride_cc
    from_ctx = tl.load(ctx_ptrs, mask=mask & (pos < start[:, None]), other=0).to(tl.int64)
    tl.store(out_ptr + req[:, None] * K + k[None, :], tl.where(in_chunk, from_x, from_ctx), mask=mask)


def _check_shapes(input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor) -> None:
    if input_ids.dim() != 1:
        raise InvalidArgumentError(f"input_ids must be 1-D [T], got shape {tuple(input_ids.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise InvalidArgumentError(f"query_start_loc must be 1-D [R+1], got shape {tuple(query_start_loc.shape)}")
    if ngram_context.dim() != 2 or ngram_context.shape[0] != query_start_loc.numel() - 1:
        raise InvalidArgumentError(
            f"ngram_context must be [R, N-1] with R={query_start_loc.numel() - 1}, got {tuple(ngram_context.shape)}"
        )


def ids_from_tensors(
    input_ids, query_start_loc, ngram_context, multipliers, head_sizes, head_offsets, heads_per_ngram, eos_token_id
) -> torch.Tensor:
    """The ids ``[T, G]`` int64 (the contract of :func:`ple.ngram.reference.ngram_ids`) with the layout
    given as its tensors (on the ids' device). Inputs are not validated beyond their shapes (the
    checked entry point is :func:`ple.ngram.ngram_ids`)."""
    multipliers, head_sizes, head_offsets = multipliers.contiguous(), head_sizes.contiguous(), head_offsets.contiguous()
    _check_shapes(input_ids, query_start_loc, ngram_context)
    n = multipliers.shape[0]
    hpn = heads_per_ngram
    g = head_sizes.shape[0]
    if ngram_context.shape[1] != n - 1:
        raise InvalidArgumentError(f"ngram_context must be [R, N-1] with N-1={n - 1}, got {tuple(ngram_context.shape)}")
    t_total = input_ids.shape[0]
    num_requests = query_start_loc.numel() - 1
    device = input_ids.device
    out = torch.empty(t_total, g, dtype=torch.int64, device=device)
    if t_total == 0:
        return out
    grid = (triton.cdiv(t_total, _BLOCK_T),)
    _ngram_ids_kernel[grid](
        input_ids,
        query_start_loc,
        ngram_context,
        multipliers,
        head_sizes,
        head_offsets,
        out,
        t_total,
        num_requests,
        int(eos_token_id),
        input_ids.stride(0),
        query_start_loc.stride(0),
        ngram_context.stride(0),
        ngram_context.stride(1),
        N=n,
        HEADS_PER_NGRAM=hpn,
        BLOCK_T=_BLOCK_T,
        BLOCK_G=triton.next_power_of_2(g),
        SEARCH_STEPS=_search_steps(num_requests),
        num_warps=4,
    )
    return out


ngram_ids = with_layout(ids_from_tensors)


def next_ngram_context(
    input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
) -> torch.Tensor:
    """``[R, N-1]`` int64: the last N-1 tokens of (context ++ chunk) for every request, raw."""
    _check_shapes(input_ids, query_start_loc, ngram_context)
    r_total, k = ngram_context.shape
    out = torch.empty(r_total, k, dtype=torch.int64, device=ngram_context.device)
    if r_total == 0 or k == 0:
        return out
    grid = (triton.cdiv(r_total, _BLOCK_R),)
    _next_context_kernel[grid](
        input_ids,
        query_start_loc,
        ngram_context,
        out,
        r_total,
        input_ids.stride(0),
        query_start_loc.stride(0),
        ngram_context.stride(0),
        ngram_context.stride(1),
        K=k,
        BLOCK_R=_BLOCK_R,
        BLOCK_K=triton.next_power_of_2(k),
        num_warps=1,
    )
    return out
