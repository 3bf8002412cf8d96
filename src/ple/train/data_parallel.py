"""Training a replicated table with data parallelism: every rank applies the ranks' mean gradient.

Under ``DistributedDataParallel`` (``torchrun``, ``accelerate launch``, transformers' ``Trainer`` with
several processes) every rank holds the whole table and runs its own batch. DDP averages the
gradients of the module's parameters; a table's gradient handle is not one of them, so the row-sparse
optimizers of :mod:`ple.train.optim` average it themselves: at each ``step()``, for the tables of a
process group, the ranks exchange their row-sparse gradients (:func:`mean_gradients`: the rows read
and their values, never a table-sized tensor), and every rank sums the ranks' values row by row in
rank order and divides by the number of ranks. Every rank computes the same bits, so the trained rows
(and the optimizer's states) stay identical on every rank, and equal, within fp32 rounding, those of
one process running the ranks' batches together with the loss averaged over them (what DDP's mean
of gradients is the gradient of).

Which group (:func:`group_of`, from ``ple.train.trainable(model, data_parallel=...)``):

- ``"auto"`` (the default): the default process group when one is initialised with more than one
  rank at the step (so a model made trainable before ``Trainer`` or ``accelerate`` starts the group
  is covered), else none;
- a ``ProcessGroup``: that group (DDP over a subgroup);
- ``False``: none: each process trains its own rows (independent runs that share a process group).

A table sharded across ranks (:class:`~ple.table.ShardedTable`) is never averaged here: its ranks
exchange what they own (:mod:`ple.train.sharded`).

The exchange, per step and process group, for all its tables at once, three all-gathers: each rank's
record (:func:`ple.common.collective.exchange_records`: its length, then the record: per table its layer,
shape, step count, trained rows and gradient rows, 48 bytes a table), then each rank's rows and values
as bytes (per table ``k`` gradient rows of ``8 + 4 * head_dim`` bytes, each rank's buffer padded to
the largest). A rank receives ``(world - 1) * (8 + record + largest buffer)`` bytes
(:attr:`Exchange.received`); at T = 512 real-text tokens on the published layer about 7,000 rows,
4.6 MB.
The records are checked first: ranks whose tables disagree (another layer, shape, step count or
number of trained rows: a rank that resumed from another checkpoint, a rank that stepped alone)
raise :class:`~ple.common.collective.RankMismatchError` on every rank, before any row moves.

``fused=True`` (the update inside the backward) cannot wait for the other ranks' gradients: a
fused optimizer on a table under data parallelism is refused (:func:`refuse_fused`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ple.common.collective import RankMismatchError, collective_device, differing, exchange_records
from ple.errors import InvalidArgumentError, UsageError

__all__ = ["group_of", "check_setting", "mean_gradients", "refuse_fused", "Exchange", "RECORD_FIELDS"]

RECORD_FIELDS = ("PLE layer", "table rows", "head_dim", "optimizer steps", "trained rows")
"""The fields of a table's record every rank must share (then the count of its gradient rows)."""


def check_setting(value: Any) -> Any:
    """``value`` if it is a valid ``data_parallel=`` setting ("auto", False, a ProcessGroup), else
    :class:`InvalidArgumentError`."""
    if value == "auto" or value is False:
        return value
    if dist.is_available() and isinstance(value, dist.ProcessGroup):
        return value
    raise InvalidArgumentError(
        f"data_parallel must be 'auto' (the default process group when initialised with more than one rank), "
        f"a torch.distributed ProcessGroup or False (each process trains its own rows), got {value!r}"
    )


def group_of(target: Any) -> Any:
    """The process group whose ranks' gradients the table of ``target`` (a
    :class:`~ple.train.attach.TableTarget`) averages, or None (see the module docstring)."""
    from ple.table import ShardedTable

    setting = target.data_parallel
    if setting is False or isinstance(target.layer.table, ShardedTable):
        return None
    if not (dist.is_available() and dist.is_initialized()):
        if setting == "auto":
            return None
        raise UsageError(
            f"PLE layer {target.ple_layer_index}'s table was made trainable with data_parallel=<a process group>, "
            "but torch.distributed is not initialised in this process"
        )
    group = dist.group.WORLD if setting == "auto" else setting
    return group if dist.get_world_size(group) > 1 else None


def refuse_fused(target: Any) -> None:
    """Raise :class:`UsageError` when the table of ``target`` is averaged over ranks (a fused update
    would apply this rank's gradient alone)."""
    group = group_of(target)
    if group is not None:
        world = dist.get_world_size(group)
        raise UsageError(
            f"PLE layer {target.ple_layer_index}'s table is trained by {world} data-parallel ranks, and a fused "
            "optimizer (fused=True) updates it inside the backward, before the ranks' gradients can be averaged: "
            "the ranks' tables would diverge. Use fused=False (the gradients are averaged at step()), or "
            "ple.train.trainable(model, data_parallel=False) if each process is meant to train its own rows"
        )


@dataclass
class Exchange:
    """What one exchange moved, as seen by this rank: bytes received (records and rows), and the
    gradient rows it sent per table."""

    received: int = 0
    sent_rows: int = 0


def mean_gradients(
    group: Any,
    items: list[tuple[Any, int, int, torch.Tensor, torch.Tensor]],
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Exchange]:
    """The ranks' mean gradient of each table: ``items`` are ``(target, steps, trained_rows, rows [k]
    sorted distinct, values [k, head_dim] fp32)`` per table, in the same order on every rank;
    returns ``(rows [U] sorted distinct, values [U, head_dim])`` per table (the same bits on every
    rank) and what was exchanged. A collective over ``group``: every rank calls it at each step."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    record: list[int] = []
    for target, steps, trained, rows, _values in items:
        shape = target.layer.table
        assert shape is not None
        record += [target.ple_layer_index, shape.rows, shape.head_dim, steps, trained, rows.numel()]
    records = exchange_records(record, what="the data-parallel exchange of the tables' gradients", group=group)
    per = len(RECORD_FIELDS) + 1
    problems = []
    for t in range(len(items)):
        for f, name in enumerate(RECORD_FIELDS):
            spread = differing([r[t * per + f] for r in records])
            if spread is not None:
                problems.append(f"table {t}'s {name}: {spread}")
    if problems:
        raise RankMismatchError(
            f"the {world} data-parallel ranks' tables disagree before this step ({'; '.join(problems)}; this is rank "
            f"{me}): every rank must start from the same trained rows and optimizer state (load the same adapter or "
            "checkpoint on every rank) and call step() at the same steps",
            [p.split(":")[0] for p in problems],
        )
    counts = [[r[t * per + per - 1] for t in range(len(items))] for r in records]
    widths = [values.shape[1] for *_, values in items]
    row_nbytes = [8 + 4 * w for w in widths]
    totals = [sum(c * b for c, b in zip(cs, row_nbytes, strict=True)) for cs in counts]
    most = max(totals)
    out = Exchange(received=(world - 1) * (8 + 8 * len(record) + most), sent_rows=sum(counts[me]))
    if most == 0:
        empty = [(torch.empty(0, dtype=torch.int64), torch.empty(0, w)) for w in widths]
        return empty, out
    device = collective_device(group)
    mine = torch.zeros(most, dtype=torch.uint8)
    at = 0
    for _target, _s, _t, rows, values in items:
        for part in (rows.to(torch.int64).contiguous(), values.to(torch.float32).contiguous()):
            raw = part.view(torch.uint8).reshape(-1)
            mine[at : at + raw.numel()] = raw
            at += raw.numel()
    gathered = [torch.empty(most, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device), group=group)
    buffers = [g.cpu() for g in gathered]
    result = []
    offsets = [0] * world
    for t, w in enumerate(widths):
        ids, vals = [], []
        for r in range(world):
            k = counts[r][t]
            at = offsets[r]
            ids.append(buffers[r][at : at + 8 * k].view(torch.int64))
            at += 8 * k
            vals.append(buffers[r][at : at + 4 * k * w].view(torch.float32).reshape(k, w))
            offsets[r] = at + 4 * k * w
        all_ids = torch.cat(ids)
        rows, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
        summed = torch.zeros(rows.numel(), w, dtype=torch.float32).index_add_(0, inverse, torch.cat(vals))
        result.append((rows, summed.div_(world)))
    return result, out
