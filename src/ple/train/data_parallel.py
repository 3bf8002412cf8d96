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
shape, step count, trained rows, optimizer (a hash of its class and hyperparameters) and gradient rows,
56 bytes a table, and one word saying whether this rank asks for a full check), then each rank's rows
and values as bytes (per table ``k`` gradient rows of ``8 + 4 * head_dim`` bytes, each rank's buffer
padded to the largest). A rank receives ``(world - 1) * (8 + record + largest buffer)`` bytes
(:attr:`Exchange.received`); at T = 512 real-text tokens on the published layer about 7,000 rows,
4.6 MB.

What decides an update is compared before any row moves, and ranks that disagree raise
:class:`~ple.common.collective.RankMismatchError` on every rank, naming each field that differs and
which ranks hold which value:

- at every step, from the record: the layer, shape, step count, number of trained rows (a rank that
  resumed from another checkpoint, a rank that stepped alone) and the optimizer's class and
  hyperparameters (another learning rate, Adagrad on one rank and SparseAdam on the others; the
  message shows each rank's, gathered only then);
- at a full check (:data:`CHECK_FIELDS`): the base table's format and header checksum (a rank serving
  another copy of the table: fp8 where the others serve fp32), a digest (sha256) of the trained rows'
  ids and fp32 values (a rank that loaded another adapter, or the bf16 copy of it) and one of the
  optimizer's per-row states. It runs when any rank asks for it (:attr:`TableStep.check`): the
  optimizers ask at their first step of a table, after their ``load_state_dict`` and whenever the
  table's trained rows or base table changed other than by their own steps (an adapter loaded, rows
  written, another table set). Its cost: one more all-gather of 32 bytes per table, and reading the
  trained rows and the optimizer's states once to hash them (``8 + 4 * head_dim`` bytes a row, and
  ``4 * head_dim`` bytes a state of ``head_dim`` values: none at a first step from the base table; 100,000 trained rows
  of 160 values with SparseAdam's states, 190 MB, take about 0.6 s on 2 cores); never at the other
  steps. A base table not read from a table
  file is compared by its format only.

``fused=True`` (the update inside the backward) cannot wait for the other ranks' gradients: a
fused optimizer on a table under data parallelism is refused (:func:`refuse_fused`).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ple.common.collective import RankMismatchError, collective_device, differing, exchange_records, hash60
from ple.errors import InvalidArgumentError, UsageError
from ple.table.formats.catalog import FORMATS
from ple.train.identity import base_identity

__all__ = [
    "group_of",
    "check_setting",
    "mean_gradients",
    "refuse_fused",
    "Exchange",
    "TableStep",
    "table_marker",
    "RECORD_FIELDS",
    "CHECK_FIELDS",
]

RECORD_FIELDS = ("PLE layer", "table rows", "head_dim", "optimizer steps", "trained rows", "optimizer")
"""The fields of a table's record every rank must share at every step (then the count of its gradient
rows; the record ends with the word asking for a full check)."""

CHECK_FIELDS = ("base table format", "base table header checksum", "trained rows' values", "optimizer states")
"""The fields of a table every rank must share at a full check (see the module docstring)."""


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


@dataclass
class TableStep:
    """One table's part of a step, as a rank's optimizer gives it to :func:`mean_gradients`."""

    target: Any
    """The table's :class:`~ple.train.attach.TableTarget`."""
    steps: int
    """The optimizer's step count of the table before this step."""
    rows: torch.Tensor
    """``[k]`` sorted distinct: this rank's gradient rows."""
    values: torch.Tensor
    """``[k, head_dim]`` fp32: their gradient."""
    optimizer: str
    """The optimizer's class and hyperparameters for the table, e.g. ``"SparseAdam(lr=0.05, ...)"``."""
    check: bool
    """This rank asks for a full check (its first step of the table, after a load)."""
    states: Callable[[], tuple[torch.Tensor, torch.Tensor] | None]
    """The optimizer's per-row states of the table ``(ids [n] sorted, values [n, width])``, or None."""

    @property
    def trained(self) -> int:
        return sum(len(o) for o in self.target.overlays())


def table_marker(target: Any) -> tuple:
    """What a table is now: its overlay (and the overlay's version, counting its changes) and its base
    table, held weakly; equal to an earlier marker only when neither was replaced nor the rows changed."""
    return tuple((weakref.ref(p.overlay), p.overlay.version, weakref.ref(p.base)) for p in target.parts())


def _problems(records: list[tuple[int, ...]], names: tuple[str, ...], per: int, spread: Callable) -> list[str]:
    """``"table t's <name>: <which ranks hold what>"`` for each field ``names[f]`` of each table ``t`` (the
    record's words ``t * per + f``) that differs over the ranks; ``spread(name, t, values)`` renders one."""
    out = []
    for t in range(len(records[0]) // per):
        for f, name in enumerate(names):
            text = spread(name, t, [r[t * per + f] for r in records])
            if text is not None:
                out.append(f"table {t}'s {name}: {text}")
    return out


def _refuse(world: int, me: int, problems: list[str]) -> None:
    if problems:
        raise RankMismatchError(
            f"the {world} data-parallel ranks' tables disagree before this step ({'; '.join(problems)}; this is rank "
            f"{me}): every rank must serve the same table file, use the same optimizer and hyperparameters, start "
            "from the same trained rows and optimizer state (load the same adapter or checkpoint on every rank) "
            "and call step() at the same steps",
            [p.split(":")[0] for p in problems],
        )


def _digest(pairs) -> int:
    """60 bits of the sha256 of ``(ids [n] int64, values [n, w])`` pairs, values as fp32."""
    h = hashlib.sha256()
    for ids, values in pairs:
        for part in (ids.to(torch.int64), values.to(torch.float32)):
            h.update(part.contiguous().view(torch.uint8).numpy())
    return hash60(h.hexdigest())


def _check_words(item: TableStep) -> list[int]:
    """``[format, header checksum, trained rows digest, states digest]`` of a table (see CHECK_FIELDS)."""
    parts = item.target.parts()
    base = parts[0].base
    identity = base_identity(base)
    checksum = int(identity["header_checksum"][:15], 16) if identity is not None else -1
    rows = _digest((ids + p.start, values) for p in parts for ids, values in p.overlay.chunks())
    states = item.states()
    return [FORMATS.index(base.format), checksum, rows, _digest([states] if states is not None else [])]


_RENDER: dict[str, Callable[[int], str]] = {
    "base table format": lambda v: FORMATS[v],
    "base table header checksum": lambda v: "none (not a table file)" if v < 0 else f"{v:015x}...",
    "trained rows' values": lambda v: f"digest {v:015x}",
    "optimizer states": lambda v: f"digest {v:015x}",
}


def _full_check(group: Any, items: list[TableStep], world: int, me: int) -> int:
    """Compare :data:`CHECK_FIELDS` of every table over the ranks (a collective); raise on every rank
    when they differ. Returns the bytes received."""
    record = [w for item in items for w in _check_words(item)]
    records = exchange_records(record, what="the data-parallel check of the tables", group=group, same_length=True)
    _refuse(world, me, _problems(records, CHECK_FIELDS, len(CHECK_FIELDS), lambda n, _t, v: differing(v, _RENDER[n])))
    return (world - 1) * 8 * len(record)


def mean_gradients(group: Any, items: list[TableStep]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Exchange]:
    """The ranks' mean gradient of each table of ``items`` (in the same order on every rank); returns
    ``(rows [U] sorted distinct, values [U, head_dim])`` per table (the same bits on every rank) and what
    was exchanged. A collective over ``group``: every rank calls it at each step. Ranks that disagree on
    what decides the update are refused first (see the module docstring)."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    record: list[int] = []
    for item in items:
        shape = item.target.layer.table
        assert shape is not None
        record += [item.target.ple_layer_index, shape.rows, shape.head_dim, item.steps, item.trained]
        record += [hash60(item.optimizer), item.rows.numel()]
    record.append(int(any(item.check for item in items)))
    records = exchange_records(record, what="the data-parallel exchange of the tables' gradients", group=group)
    per = len(RECORD_FIELDS) + 1
    described: list[Any] = []

    def spread(name: str, t: int, values: list[int]) -> str | None:
        text = differing(values)
        if text is None or name != "optimizer":
            return text
        if not described:  # the same verdict on every rank: they all gather each rank's description
            described.extend([None] * world)
            dist.all_gather_object(described, [item.optimizer for item in items], group=group)
        return differing([d[t] for d in described])

    _refuse(world, me, _problems([r[:-1] for r in records], RECORD_FIELDS, per, spread))
    received = (world - 1) * (8 + 8 * len(record))
    if any(r[-1] for r in records):
        received += _full_check(group, items, world, me)
    counts = [[r[t * per + per - 1] for t in range(len(items))] for r in records]
    widths = [item.values.shape[1] for item in items]
    row_nbytes = [8 + 4 * w for w in widths]
    totals = [sum(c * b for c, b in zip(cs, row_nbytes, strict=True)) for cs in counts]
    most = max(totals)
    out = Exchange(received=received + (world - 1) * most, sent_rows=sum(counts[me]))
    if most == 0:
        empty = [(torch.empty(0, dtype=torch.int64), torch.empty(0, w)) for w in widths]
        return empty, out
    device = collective_device(group)
    mine = torch.zeros(most, dtype=torch.uint8)
    at = 0
    for item in items:
        for part in (item.rows.to(torch.int64).contiguous(), item.values.to(torch.float32).contiguous()):
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
