"""Conv state pool layouts and exact conversions between them.

The engine layout ``[S, C, L]`` (what :class:`ple.runtime.Batch` and serving engines hold) keeps each
channel's last ``L`` conv inputs contiguous, oldest first; a step shifts the whole window of every
slot it touches. The ring layout ``[S, L, C]`` with offsets ``[S]`` keeps one row per column, token
major, and column ``j`` of slot ``s`` in row ``(offsets[s] + j) % L``: a step moves the offset and
writes only its new columns (a decode step: one row of ``C`` per request instead of ``C * L``).
The C kernel reads and writes both; other paths run a ring pool through the engine layout.
Conversions are plain copies, so they are exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ple.errors import InvalidArgumentError
from ple.ops.records import StepMeta

__all__ = ["check_ring", "engine_to_ring", "engine_view", "ring_to_engine", "ring_window", "via_engine_layout"]


def ring_columns(offsets: torch.Tensor, length: int) -> torch.Tensor:
    """``[S, L]`` int64: the row of each logical column of each slot."""
    j = torch.arange(length, device=offsets.device, dtype=torch.int64)
    return (offsets.to(torch.int64).unsqueeze(1) + j) % max(length, 1)


def ring_to_engine(pool: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """The engine layout ``[S', C, L]`` of a ring pool ``[S, L, C]`` (of the rows ``slots``, default all): a copy."""
    if slots is not None:
        pool, offsets = pool.index_select(0, slots), offsets.index_select(0, slots)
    s, length, c = pool.shape
    rows = ring_columns(offsets, length).unsqueeze(2).expand(s, length, c)
    return torch.gather(pool, 1, rows).transpose(1, 2).contiguous()


def engine_to_ring(engine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pool [S, L, C], offsets [S] zeros)`` holding the same columns as ``engine [S, C, L]``: a copy."""
    pool = engine.transpose(1, 2).contiguous()
    return pool, torch.zeros(engine.shape[0], dtype=torch.int64, device=engine.device)


def ring_window(pool: torch.Tensor, offsets: torch.Tensor, slot: int, start: int, stop: int) -> torch.Tensor:
    """Columns ``start .. stop-1`` of one slot of a ring pool as ``[C, stop - start]`` (a copy)."""
    length = pool.shape[1]
    base = int(offsets[slot])
    rows = (torch.arange(start, stop, dtype=torch.int64) + base) % max(length, 1)
    return pool[slot].index_select(0, rows.to(pool.device)).t().contiguous()


def check_ring(step: StepMeta) -> None:
    """Shapes of a ring step (no-op for the engine layout)."""
    off = step.state_offsets
    if off is None:
        return
    pool = step.conv_state
    if pool.dim() != 3 or tuple(off.shape) != (pool.shape[0],) or off.dtype != torch.int64 or off.device != pool.device:
        raise InvalidArgumentError(
            f"ring state: offsets must be int64 [S]=({pool.shape[0]},) on {pool.device}, got "
            f"{off.dtype} {tuple(off.shape)} on {off.device}"
        )


def engine_view(step: StepMeta) -> StepMeta:
    """The step with its pool seen in the engine layout ``[S, C, L]`` (a ring pool's columns taken in
    storage order, not from its offsets): for the checks of shapes, dtypes and index values."""
    if step.state_offsets is None:
        return step
    return dataclasses.replace(step, conv_state=step.conv_state.transpose(1, 2), state_offsets=None)


def via_engine_layout(step: StepMeta, run: Callable[[StepMeta], torch.Tensor]) -> torch.Tensor:
    """Run ``run`` on the engine layout of the step's slots of a ring pool, then write them back (offsets
    reset to 0). For paths without ring support; exact (copies only)."""
    check_ring(step)
    assert step.state_offsets is not None
    slots = step.state_indices.to(torch.int64)
    active = slots >= 0
    local = torch.where(active, torch.arange(slots.shape[0], device=slots.device), -1)
    engine = ring_to_engine(step.conv_state, step.state_offsets, slots.clamp(min=0))
    out = run(StepMeta(step.query_start_loc, engine, local, step.has_initial_state, step.num_rejected))
    rows = torch.nonzero(active).flatten()
    if rows.numel():
        targets = slots.index_select(0, rows)
        step.conv_state.index_copy_(0, targets, engine.index_select(0, rows).transpose(1, 2))
        step.state_offsets.index_fill_(0, targets, 0)
    return out
