"""Dilated conv over a packed batch, CPU fast path: no padding to ``[R, max_len]``, no ``nn.Conv1d``.

All reads of the state pool happen in one gather of the batch's slots (fresh and null rows zeroed).
Each request's window is cut from that copy and interleaved with the rows into one buffer
``[R*W + T, C]`` = window_0 ++ rows_0 ++ window_1 ++ rows_1 ++ ..., where every tap is a fixed shift:
one fused multiply-add per tap over a shifted view, then one gather of the rows. Decode batches (one
row per request) read their ``K-1`` history taps straight from the slot copy. The new states are
assembled from the same copy and the chunks' last rows and written with one ``index_copy_`` at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import ConvGeometry, check_conv_args

__all__ = ["dilated_conv"]


def dilated_conv(
    c: torch.Tensor,
    weight: torch.Tensor,
    dilation: int,
    query_start_loc: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_rejected: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Same contract as :func:`ple.ops.conv.reference.dilated_conv`; returns ``[T, C]`` in ``c.dtype``."""
    geo = check_conv_args(
        c,
        weight,
        dilation,
        query_start_loc,
        conv_state,
        state_indices,
        has_initial_state,
        num_rejected,
        residual,
        validate,
    )
    num_requests, state_len = geo.num_requests, geo.state_len
    starts = query_start_loc.long()
    lengths = starts[1:] - starts[:-1]
    slots = state_indices.long()
    active = slots >= 0
    resumes = has_initial_state & active
    rejected = torch.zeros_like(slots) if num_rejected is None else num_rejected.long() * resumes
    history_end = state_len - rejected  # [R] column of the slot where the accepted history ends

    # The only read of the pool: [R, C, L], zero for rows that do not resume (their slot may hold anything).
    # (Advanced indexing: index_select on a 3-d pool is far slower on the CPU.)
    old = conv_state[slots.clamp(min=0)]
    fresh = ~resumes
    if bool(fresh.any()):
        old[fresh] = 0
    w = weight.float()

    if geo.tokens == num_requests and bool(torch.all(lengths == 1)):
        acc = _decode_conv(c, w, dilation, old, history_end)
        token_active = active
    else:
        acc, token_request = _packed_conv(c, w, dilation, geo, starts, lengths, old, history_end)
        token_active = active[token_request]
    out = F.silu(acc, inplace=True)
    inactive = ~token_active
    if bool(inactive.any()):
        out[inactive] = 0.0
    if residual is not None:
        out += residual
    out = out.to(c.dtype)

    if state_len > 0 and bool(active.any()):
        new_states = _new_states(c, old, starts, lengths, resumes, history_end)
        if not bool(active.all()):
            rows = torch.nonzero(active).flatten()
            slots, new_states = slots[rows], new_states[rows]
        conv_state.index_copy_(0, slots, new_states)
    return out


def _decode_conv(
    c: torch.Tensor, w: torch.Tensor, dilation: int, old: torch.Tensor, history_end: torch.Tensor
) -> torch.Tensor:
    """One row per request: taps ``0..K-2`` come from the slot, tap ``K-1`` is the row itself. ``[R, C]`` fp32."""
    taps = w.shape[1]
    acc = c.float() * w[:, taps - 1]
    if taps > 1:
        back = (taps - 1 - torch.arange(taps - 1, device=c.device)) * dilation  # [K-1] distance of tap k
        cols = history_end.unsqueeze(1) - back  # [R, K-1]
        history = old[torch.arange(old.shape[0], device=c.device).unsqueeze(1), :, cols]  # [R, K-1, C]
        for k in range(taps - 1):
            acc.addcmul_(history[:, k], w[:, k])
    return acc


def _packed_conv(
    c: torch.Tensor,
    w: torch.Tensor,
    dilation: int,
    geo: ConvGeometry,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    old: torch.Tensor,
    history_end: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any mix of row counts. Returns the pre-activation conv ``[T, C]`` fp32 and each row's request ``[T]``.

    Works on ``ext [R*W + T, C]`` = window_0 ++ rows_0 ++ window_1 ++ rows_1 ++ ...: there every tap of
    every row is the same fixed shift, so each tap is one fused multiply-add over a shifted view.
    """
    device = c.device
    num_requests, window, tokens = geo.num_requests, geo.window, geo.tokens
    token_request = torch.repeat_interleave(torch.arange(num_requests, device=device), lengths, output_size=tokens)
    row_in_ext = torch.arange(tokens, device=device) + (token_request + 1) * window  # [T]
    if window > 0:
        ext = torch.empty(num_requests * window + tokens, geo.channels, dtype=torch.float32, device=device)
        ext[row_in_ext] = c.float()
        cols = (history_end - window).unsqueeze(1) + torch.arange(window, device=device)  # [R, W]
        windows = torch.gather(old, 2, cols.unsqueeze(1).expand(-1, geo.channels, -1))  # [R, C, W]
        first = (starts[:-1] + torch.arange(num_requests, device=device) * window).unsqueeze(1)  # [R, 1]
        ext[(first + torch.arange(window, device=device)).flatten()] = windows.transpose(1, 2).flatten(0, 1).float()
    else:
        ext = c.float()
    taps = geo.taps
    acc = ext * w[:, taps - 1]
    for k in range(taps - 1):
        back = (taps - 1 - k) * dilation
        acc[back:].addcmul_(ext[:-back], w[:, k])
    if window > 0:
        acc = acc[row_in_ext]
    return acc, token_request


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
