"""Dilated conv over a packed batch, CPU fast path: no padding to ``[R, max_len]``, no ``nn.Conv1d``.

All reads of the state pool happen in one row gather of the batch's slots (fresh rows zeroed).
Decode batches (one row per request) take their ``K-1`` history taps straight from that copy.
Other batches work on ``ext [R*W + T, C]`` = every request's window, then all rows, with a
precomputed source row per (tap, token); tokens are processed in blocks whose fp32 accumulator stays
in cache (blocks deep inside a request read their taps as plain shifted views). The new states are
assembled from the same slot copy and the chunks' last rows and written with one ``index_copy_``
after every read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ple.ops.conv.checks import check_conv_args
from ple.ops.records import ConvWeights, StepMeta

__all__ = ["dilated_conv"]

# fp32 elements of one block's accumulator ([B, C]): 4 MiB, within L2 on current server cores.
_BLOCK_ELEMENTS = 1 << 20


def dilated_conv(
    c: torch.Tensor, conv: ConvWeights, step: StepMeta, residual: torch.Tensor | None = None, *, validate: bool = True
) -> torch.Tensor:
    """Same contract as :func:`ple.ops.conv.reference.dilated_conv`; returns ``[T, C]`` in ``c.dtype``."""
    geo = check_conv_args(c, conv, step, residual, validate)
    weight, dilation, query_start_loc, conv_state = conv.weight, conv.dilation, step.query_start_loc, step.conv_state
    state_indices, has_initial_state, num_rejected = step.state_indices, step.has_initial_state, step.num_rejected
    num_requests, state_len, channels = geo.num_requests, geo.state_len, geo.channels
    starts = query_start_loc.long()
    lengths = starts[1:] - starts[:-1]
    slots = state_indices.long()
    active = slots >= 0
    resumes = has_initial_state.bool() & active
    rejected = torch.zeros_like(slots) if num_rejected is None else num_rejected.long() * resumes
    history_end = state_len - rejected  # [R] column of the slot where the accepted history ends

    # The only read of the pool: whole slot rows, [R, C, L]; zero for rows that do not resume.
    pool = conv_state.reshape(geo.num_slots, channels * state_len) if conv_state.is_contiguous() else None
    if pool is not None:
        old = pool.index_select(0, slots.clamp(min=0)).view(num_requests, channels, state_len)
    else:
        old = conv_state[slots.clamp(min=0)]
    fresh = ~resumes
    if bool(fresh.any()):
        old[fresh] = 0
    w = weight.float()
    out = torch.empty_like(c)
    all_active = bool(active.all())

    decode = geo.tokens == num_requests and bool(torch.all(lengths == 1))
    if decode:
        acc = _decode_conv(c, w, dilation, old, history_end)
        F.silu(acc, inplace=True)
        if residual is not None:
            acc += residual
        out.copy_(acc)
    else:
        _blocked_conv(c, w, dilation, geo, starts, lengths, old, history_end, residual, out)
    if not all_active:
        token_active = active if decode else torch.repeat_interleave(active, lengths, output_size=geo.tokens)
        dead = ~token_active
        out[dead] = residual[dead] if residual is not None else 0

    if state_len > 0 and bool(active.any()):
        if decode and not bool(rejected.any()):
            new_states = torch.cat([old[:, :, 1:], c.unsqueeze(2).to(old.dtype)], dim=2)
        else:
            new_states = _new_states(c, old, starts, lengths, resumes, history_end)
        if not all_active:
            rows = torch.nonzero(active).flatten()
            slots, new_states = slots[rows], new_states[rows]
        if pool is not None:
            pool.index_copy_(0, slots, new_states.reshape(slots.shape[0], channels * state_len))
        else:
            conv_state.index_copy_(0, slots, new_states)
    return out


def _decode_conv(
    c: torch.Tensor, w: torch.Tensor, dilation: int, old: torch.Tensor, history_end: torch.Tensor
) -> torch.Tensor:
    """One row per request: taps ``0..K-2`` come from the slot, tap ``K-1`` is the row itself. ``[R, C]`` fp32."""
    taps = w.shape[1]
    acc = torch.mul(c, w[:, taps - 1])
    if taps > 1:
        state_len = old.shape[2]
        uniform = bool((history_end == state_len).all())  # no rollback in the batch: fixed tap columns
        if not uniform:
            back = (taps - 1 - torch.arange(taps - 1, device=c.device)) * dilation  # [K-1] distance of tap k
            cols = history_end.unsqueeze(1) - back  # [R, K-1]
            history = torch.gather(old, 2, cols.unsqueeze(1).expand(-1, old.shape[1], -1))  # [R, C, K-1]
        for k in range(taps - 1):
            tap = old[:, :, state_len - (taps - 1 - k) * dilation] if uniform else history[:, :, k]
            acc.addcmul_(tap.float(), w[:, k])
    return acc


def _blocked_conv(c, w, dilation, geo, starts, lengths, old, history_end, residual, out) -> None:
    """Any mix of row counts; writes ``residual + silu(conv)`` into ``out`` block by block.

    A block whose taps all lie inside their own chunks reads them as shifted views of one fp32 copy
    of its rows; other blocks (the first ``W`` rows of a chunk) gather each tap from the chunk rows
    or, before the chunk's start, from the request's window.
    """
    device = c.device
    num_requests, window, tokens, taps, channels = geo.num_requests, geo.window, geo.tokens, geo.taps, geo.channels
    if tokens == 0:
        return
    token_request = torch.repeat_interleave(torch.arange(num_requests, device=device), lengths, output_size=tokens)
    positions = torch.arange(tokens, device=device)
    local = positions - starts[token_request]  # position inside its chunk
    windows = c.new_empty(0, channels)  # read only when a tap reaches before the chunk, i.e. window > 0
    if window > 0:
        cols = (history_end - window).unsqueeze(1) + torch.arange(window, device=device)  # [R, W]
        windows = torch.gather(old, 2, cols.unsqueeze(1).expand(-1, channels, -1))  # [R, C, W]
        windows = windows.transpose(1, 2).reshape(num_requests * window, channels)  # token-major
    deep = (local >= window).to(torch.int64)
    deep_prefix = torch.cat([deep.new_zeros(1), deep.cumsum(0)]).tolist()
    block = max(1, min(tokens, _BLOCK_ELEMENTS // max(channels, 1)))
    acc_buf = torch.empty(block, channels, dtype=torch.float32, device=device)
    rows_buf = torch.empty(block + window, channels, dtype=torch.float32, device=device)
    wk = [w[:, k] for k in range(taps)]
    for a in range(0, tokens, block):
        b = min(tokens, a + block)
        n = b - a
        acc = acc_buf[:n]
        deep_block = deep_prefix[b] - deep_prefix[a] == n
        if deep_block:  # every tap of the block lies in its own chunk: one fp32 copy, taps are views
            xf = rows_buf[: n + window]
            xf.copy_(c[a - window : b])
        for k in range(taps):
            back = (taps - 1 - k) * dilation
            if deep_block:
                rows = xf[window - back : window - back + n]
            else:
                rows = rows_buf[:n]
                rows.copy_(c.index_select(0, (positions[a:b] - back).clamp_(min=0)))
                before = local[a:b] < back
                if back and bool(before.any()):
                    idx = torch.nonzero(before).flatten()
                    t = a + idx
                    rows[idx] = windows.index_select(0, token_request[t] * window + window + local[t] - back).to(
                        rows.dtype
                    )
            if k == 0:
                torch.mul(rows, wk[0], out=acc)
            else:
                acc.addcmul_(rows, wk[k])
        F.silu(acc, inplace=True)
        if residual is not None:
            acc += residual[a:b]
        out[a:b].copy_(acc)


def _new_states(
    c: torch.Tensor,
    old: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    resumes: torch.Tensor,
    history_end: torch.Tensor,
) -> torch.Tensor:
    """Last ``L`` columns of (kept slot columns ++ new rows), zero-padded on the left; ``[R, C, L]``."""
    device = c.device
    num_requests, channels, state_len = old.shape
    j = torch.arange(state_len, device=device)
    kept = torch.where(resumes, history_end, state_len)  # fresh requests keep L zero columns (zeroed in `old`)
    # Column j is element kept + n - L + j of (kept ++ rows): a chunk row when that is >= kept, i.e. j >= L - n.
    from_rows = j >= (state_len - lengths).unsqueeze(1)  # [R, L]
    src = (kept + lengths - state_len).unsqueeze(1) + j  # [R, L] column of `old` otherwise
    new = torch.gather(old, 2, src.clamp(0, state_len - 1).unsqueeze(1).expand(-1, channels, -1))  # [R, C, L]
    before_history = (src < 0) & ~from_rows  # only when more rows were rejected than added
    if bool(before_history.any()):
        new.masked_fill_(before_history.unsqueeze(1), 0)
    if c.shape[0] > 0 and bool(from_rows.any()):
        req, col = torch.nonzero(from_rows, as_tuple=True)
        row = starts[req] + lengths[req] - state_len + col
        new[req, :, col] = c[row].to(old.dtype)
    return new
