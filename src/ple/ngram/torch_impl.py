"""Vectorized n-gram ids: no Python loop over tokens or requests.

The packed batch is laid out as one "extended" sequence where each request's context precedes its
tokens; every shift is then a plain offset into that sequence, and the EOS cut is carried shift by
shift (N is small), with no cumulative scan over the history.
"""

from __future__ import annotations

import torch

from ple.ngram.tensors import with_layout


def _extended(
    input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ext [T + R*(N-1)]`` (context then tokens, per request) and each token's position in it."""
    device = input_ids.device
    t_total = input_ids.shape[0]
    r_total, k = ngram_context.shape
    qsl = query_start_loc.to(device=device, dtype=torch.int64)
    lengths = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(r_total, device=device), lengths, output_size=t_total)
    tok_pos = torch.arange(t_total, device=device) + (req + 1) * k
    ext = torch.empty(t_total + r_total * k, dtype=torch.int64, device=device)
    ext[tok_pos] = input_ids.to(torch.int64)
    if k:
        ctx_pos = (qsl[:-1] + torch.arange(r_total, device=device) * k).unsqueeze(1) + torch.arange(k, device=device)
        ext[ctx_pos.reshape(-1)] = ngram_context.to(device=device, dtype=torch.int64).reshape(-1)
    return ext, tok_pos


def ngram_windows(
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    ngram_size: int,
    eos_token_id: int,
) -> torch.Tensor:
    """``[T, N]`` int64: per token ``y_0..y_{N-1}`` (itself, then its predecessors as the hash sees
    them: EOS at or before the most recent earlier EOS)."""
    ext, pos = _extended(input_ids, query_start_loc, ngram_context)
    out = torch.empty(pos.shape[0], ngram_size, dtype=torch.int64, device=input_ids.device)
    out[:, 0] = ext[pos]
    alive = torch.ones(pos.shape[0], dtype=torch.bool, device=input_ids.device)
    for s in range(1, ngram_size):
        # y_s survives only if no EOS lies strictly between t-s and t
        if s >= 2:
            alive &= out[:, s - 1] != eos_token_id
        out[:, s] = torch.where(alive, ext[pos - s], eos_token_id)
    return out


def ids_from_tensors(
    input_ids, query_start_loc, ngram_context, multipliers, head_sizes, head_offsets, heads_per_ngram, eos_token_id
) -> torch.Tensor:
    """The ids ``[T, G]`` int64 (the contract of :func:`ple.ngram.reference.ngram_ids`) with the layout
    given as its tensors (see :func:`ple.ngram.tensors.layout_tensors`)."""
    hpn = heads_per_ngram
    mult, sizes, offs = multipliers, head_sizes, head_offsets
    y = ngram_windows(input_ids, query_start_loc, ngram_context, mult.shape[0], eos_token_id)
    out = torch.empty(y.shape[0], sizes.shape[0], dtype=torch.int64, device=input_ids.device)
    h = y[:, 0] * mult[0]
    for s in range(1, mult.shape[0]):
        h = h ^ (y[:, s] * mult[s])
        g0 = (s - 1) * hpn
        torch.remainder(h.unsqueeze(1), sizes[g0 : g0 + hpn], out=out[:, g0 : g0 + hpn])
    out += offs
    return out


ngram_ids = with_layout(ids_from_tensors)


def next_ngram_context(
    input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
) -> torch.Tensor:
    """``[R, N-1]`` int64: the last N-1 tokens of (context ++ chunk) for every request."""
    r_total, k = ngram_context.shape
    if k == 0 or r_total == 0:
        return ngram_context.to(torch.int64).clone()
    ext, _ = _extended(input_ids, query_start_loc, ngram_context)
    qsl = query_start_loc.to(device=input_ids.device, dtype=torch.int64)
    end = qsl[1:] + (torch.arange(r_total, device=input_ids.device) + 1) * k
    idx = end.unsqueeze(1) - k + torch.arange(k, device=input_ids.device)
    return ext[idx]
