"""Checks the ranks of a process group make together, so that ranks that disagree fail together.

The mechanism: every rank all-gathers one small int64 record (:func:`exchange_records`) and gets every
rank's record, the same list on every rank; a verdict computed from that list alone is therefore the
same on every rank, and when it is an error, every rank raises it. Run before any collective whose
shapes depend on what the records describe, this turns a disagreement into the same clear error on
every rank, instead of one rank aborting inside the collective library and the others waiting for it.
Users: the agreement checks of :mod:`ple.parallel` (:func:`ple.parallel.agree`) and
:class:`ple.table.ShardedTable` (its construction fingerprint and the header of every lookup).

Helpers for the records and the messages: :func:`hash60` (a value as 60 bits, to fit an int64),
:func:`differing` and :func:`rank_list` (which ranks hold which value), :func:`collective_device`
(where an exchange runs).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ple.errors import InvalidArgumentError, PLEError

__all__ = ["RankMismatchError", "collective_device", "differing", "exchange_records", "hash60", "rank_list"]

V = TypeVar("V", bound=Hashable)

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class RankMismatchError(PLEError, ValueError):
    """The ranks of a group disagree on something they must share (configuration, mode, geometry, the
    step's batch, the layout of an exchanged record); raised on every rank, before any data
    collective, with the same list of fields."""

    def __init__(self, message: str, fields: list[str]) -> None:
        super().__init__(message)
        self.fields = fields


def hash60(data: str | bytes) -> int:
    """60 bits that identify ``data``, as a non-negative int (fits an int64 record): the first 15 hex
    digits of its sha256, or, for a string that already is a sha256 hex digest (64 lowercase hex
    digits, e.g. a layout hash), its own first 15, so the value reads as the digest's prefix."""
    if isinstance(data, str):
        if _SHA256_HEX.fullmatch(data):
            return int(data[:15], 16)
        data = data.encode()
    return int(hashlib.sha256(data).hexdigest()[:15], 16)


def rank_list(ranks: Iterable[int]) -> str:
    """``"rank 3"`` or ``"ranks 0, 2"``."""
    rs = list(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


def differing(values: Sequence[V] | Mapping[int, V], render: Callable[[V], str] = str) -> str | None:
    """None when every rank's value is the same; otherwise the ranks grouped by value, in order of
    first appearance: ``"ranks 0, 2: 'a'; rank 1: 'b'"``. ``values``: rank ``r``'s value at ``[r]``,
    or a mapping from ranks to values (to compare some of the ranks)."""
    groups: dict[V, list[int]] = {}
    for r, v in values.items() if isinstance(values, Mapping) else enumerate(values):
        groups.setdefault(v, []).append(r)
    if len(groups) < 2:
        return None
    return "; ".join(f"{rank_list(rs)}: {render(v)}" for v, rs in groups.items())


def collective_device(group: Any = None, device: torch.device | str | None = None) -> torch.device:
    """Where an exchange over ``group`` runs: ``device`` when given, else what the group's backend
    serves: CPU with gloo (or gloo beside NCCL), the current CUDA device when NCCL is its only
    backend (call ``torch.cuda.set_device`` first). The same on every rank of a uniform job."""
    if device is not None:
        return torch.device(device)
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange_records(
    record: Sequence[int] | torch.Tensor,
    *,
    what: str,
    group: Any = None,
    device: torch.device | str | None = None,
    same_length: bool = False,
) -> list[tuple[int, ...]]:
    """Every rank's int64 ``record``, in rank order: the same list on every rank of ``group``.

    A collective: every rank of ``group`` calls it, in the same order as its other collectives.
    ``record``: ints, or a 1-D int64 tensor (the exchange then runs on the tensor's device, and
    values computed there need no host synchronization before it; the result is read back once).
    ``device``: where a record of ints is exchanged (default :func:`collective_device`).

    Records of different lengths cannot be gathered (the collective library aborts or hangs), so
    the ranks first gather the lengths and, when they differ, every rank raises
    :class:`RankMismatchError` naming ``what`` and each rank's length. ``same_length=True`` skips
    that exchange for records whose length every rank already shares (fixed by the code and the
    group's size, or by an earlier check).
    """
    if isinstance(record, torch.Tensor):
        if record.dim() != 1 or record.dtype != torch.int64:
            raise InvalidArgumentError(
                f"{what}: a record must be a 1-D int64 tensor, got {record.dtype} {tuple(record.shape)}"
            )
        if device is not None and torch.device(device) != record.device:
            raise InvalidArgumentError(f"{what}: the record is on {record.device}, not on device={device}")
        mine = record
    else:
        mine = torch.tensor([int(v) for v in record], dtype=torch.int64, device=collective_device(group, device))
    world = dist.get_world_size(group)
    if not same_length:
        length = torch.tensor([mine.numel()], dtype=torch.int64, device=mine.device)
        lengths = [torch.empty_like(length) for _ in range(world)]
        dist.all_gather(lengths, length, group=group)
        counts = torch.cat(lengths).tolist()
        spread = differing(counts, lambda n: f"{n} words")
        if spread is not None:
            me = dist.get_rank(group)
            raise RankMismatchError(
                f"{what}: the {world} ranks exchange records of different lengths ({spread}): different ple "
                f"versions or code paths? (raised on every rank before any data collective; this is rank {me})",
                ["record length"],
            )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [tuple(row) for row in torch.stack(gathered).cpu().tolist()]
