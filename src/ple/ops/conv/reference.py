"""Literal reference of the dilated causal depthwise conv over a packed batch with a state pool.

One request at a time, one token at a time, one tap at a time: the executable specification the
fast paths are tested against.

State convention. ``conv_state[slot]`` is ``[C, L]``: the last ``L`` conv inputs of the request's
processed history, oldest first (column ``L-1`` is the most recent), zeros before the start of the
history. ``L >= W = (K-1)*dilation``; the ``L - W`` extra columns let a speculative step be rolled
back: ``num_rejected[r] = n`` says the last ``n`` columns hold rejected tokens of the previous step.
The row then reads its window from columns ``[L-n-W, L-n)`` and afterwards the slot holds the last
``L`` columns of ``conv_state[slot, :, :L-n] ++ this step's rows``; when that is shorter than ``L``
(fewer new rows than rejected ones) it is left-padded with zeros. Those padded columns are never
read as long as a later ``num_rejected`` does not exceed the number of rows of the step it rejects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ple.ops.conv.checks import check_conv_args
from ple.ops.records import ConvWeights, StepMeta

__all__ = ["dilated_conv"]


def dilated_conv(
    c: torch.Tensor, conv: ConvWeights, step: StepMeta, residual: torch.Tensor | None = None, *, validate: bool = True
) -> torch.Tensor:
    """Causal depthwise conv with dilation over a packed batch of requests; updates ``conv_state`` in place.

    Args:
        c: ``[T, C]`` conv inputs of all requests, packed.
        conv: the taps and the dilation (:class:`ple.ops.ConvWeights`: ``weight [C, K]``, tap ``K-1``
            multiplies the current token; ``dilation`` the distance in tokens between taps,
            ``ngram_size`` in the PLE layer).
        step: the packed step (:class:`ple.ops.StepMeta`) in the engine layout:
            ``query_start_loc [R+1]`` int, token offsets of the requests in ``c`` (``0`` first, ``T``
            last); ``conv_state [S, C, L]`` state pool, ``L >= W = (K-1)*dilation``, written in place;
            ``state_indices [R]`` int, slot of each request, ``-1`` a null row (its output is
            ``residual``, zero without it, and its slot is neither read nor written);
            ``has_initial_state [R]`` bool, ``False`` starts the request fresh (zero window, whatever
            the slot holds); ``num_rejected [R]`` int or None, rejected speculative tokens at the end
            of the slot, ``0 <= n <= L-W``, read only for rows with a slot and ``has_initial_state``.
        residual: ``[T, C]`` in ``c.dtype`` or None, added to the activated conv.
        validate: check index values (offsets, slot range and uniqueness, ``num_rejected`` range).

    Returns:
        ``[T, C]`` in ``c.dtype``: ``residual + silu(conv)``, computed in fp32 and rounded once.
        All state reads happen before any state write.
    """
    geo = check_conv_args(c, conv, step, residual, validate)
    weight, dilation, query_start_loc, conv_state = conv.weight, conv.dilation, step.query_start_loc, step.conv_state
    state_indices, has_initial_state, num_rejected = step.state_indices, step.has_initial_state, step.num_rejected
    channels, taps, state_len = geo.channels, geo.taps, geo.state_len
    w = weight.float()
    starts = query_start_loc.tolist()
    out = torch.zeros(geo.tokens, channels, dtype=torch.float32, device=c.device)
    new_states = []
    for r in range(geo.num_requests):
        slot = int(state_indices[r])
        if slot < 0:
            continue
        start, end = starts[r], starts[r + 1]
        if bool(has_initial_state[r]):
            rejected = 0 if num_rejected is None else int(num_rejected[r])
            kept = conv_state[slot, :, : state_len - rejected].float()  # accepted history, most recent last
        else:
            kept = torch.zeros(channels, state_len, dtype=torch.float32, device=c.device)
        history = torch.cat([kept, c[start:end].float().t()], dim=1)  # [C, len(kept) + n]
        first = kept.shape[1]  # column of this chunk's first token in `history`
        for i in range(end - start):
            acc = torch.zeros(channels, dtype=torch.float32, device=c.device)
            for k in range(taps):
                acc += w[:, k] * history[:, first + i - (taps - 1 - k) * dilation]
            out[start + i] = F.silu(acc)
        new_state = history[:, max(history.shape[1] - state_len, 0) :]
        if new_state.shape[1] < state_len:
            new_state = F.pad(new_state, (state_len - new_state.shape[1], 0))
        new_states.append((slot, new_state))
    for slot, new_state in new_states:
        conv_state[slot] = new_state.to(conv_state.dtype)
    if residual is not None:
        out += residual.float()
    return out.to(c.dtype)
