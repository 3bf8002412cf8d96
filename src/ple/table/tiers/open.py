"""One opener of a table file as a tier (:func:`open_table`), with the one set of tier defaults.

Every place that serves a table file from a tier by name opens it here: ``from_pretrained``
(``table_tier=``, ``table_cache_rows=``, ``memory_budget=``: the parameters below carry the same
names and meanings), ``ple eval --tier``, ``ple demo --tier``, ``ple train --tier`` (and its
``--ranks`` sharding) and ``ple bench --memory-budget``. So the same options give the same tier
objects everywhere.

The tiers, by name:

- ``"mmap"``: :class:`~ple.table.MmapTable`, rows read from the page cache on demand;
- ``"cached"``: :class:`~ple.table.CachedTable`, the hottest ``table_cache_rows`` rows (default
  :data:`DEFAULT_CACHE_ROWS`) kept in memory on ``device``, in front of the map;
- ``"memory"``: :class:`~ple.table.MemoryTable`, the whole table read into memory on ``device``
  (``from_pretrained`` reads it from the checkpoint instead: no table file);
- ``"direct"``: :class:`~ple.table.DirectTable`, rows read with direct reads, bypassing the page
  cache, ``memory_budget`` bytes of rows (default :data:`DEFAULT_MEMORY_BUDGET`) kept in memory;
- ``"sharded"``: :class:`~ple.table.ShardedTable` over a ``torch.distributed`` group, each rank
  keeping its own rows (:func:`ple.table.tiers.sharded.load_sharded`; ``group``, ``method``, ``ids``).

The tier defaults are the module constants below, and nowhere else.
"""

from __future__ import annotations

import os

import torch

from ple.errors import ArgumentTypeError, InvalidArgumentError
from ple.table.base import Table
from ple.table.tiers.cache import CachedTable
from ple.table.tiers.direct import DirectTable
from ple.table.tiers.memory import MemoryTable
from ple.table.tiers.mmap import MmapTable
from ple.table.tiers.sharded import load_sharded

__all__ = [
    "DEFAULT_CACHE_ROWS",
    "DEFAULT_MEMORY_BUDGET",
    "DEFAULT_TIER",
    "FILE_TIERS",
    "MODEL_TIERS",
    "TIERS",
    "check_tier_options",
    "open_table",
]

TIERS = ("mmap", "cached", "memory", "direct", "sharded")
"""Every tier :func:`open_table` opens, by name."""
MODEL_TIERS = ("mmap", "cached", "memory", "direct")
"""The tiers a whole model is loaded with by name (``from_pretrained(table_tier=)``, ``ple demo
--tier``); ``"sharded"`` needs a process group, so ``ple train --ranks`` shards after loading."""
FILE_TIERS = ("mmap", "cached", "direct")
"""The tiers that serve a table file's rows from the file (``ple eval --tier``, ``ple train --tier``;
``table_format`` copies are served from these)."""
DEFAULT_TIER = "mmap"
"""The tier when none is named."""
DEFAULT_CACHE_ROWS = 1 << 20
"""Rows a ``"cached"`` table keeps in memory by default (160 MB of fp8 rows at the published width)."""
DEFAULT_MEMORY_BUDGET = 64 << 20
"""Bytes of rows a ``"direct"`` table keeps in memory by default (64 MiB; its read buffers come on top)."""


def check_tier_options(
    table_tier: str,
    *,
    table_cache_rows: int | None = None,
    memory_budget: int | None = None,
    tiers: tuple[str, ...] = TIERS,
    **sharding: object,
) -> None:
    """Refuse a tier not in ``tiers`` and an option given for a tier it is not for, before anything
    is opened: ``table_cache_rows`` (an int >= 1) is for ``"cached"``, ``memory_budget`` (an int >= 0,
    bytes) for ``"direct"``, the ``sharding`` options (``group``, ``method``, ``ids``; None: not
    given) for ``"sharded"``. Raises :class:`~ple.errors.InvalidArgumentError` naming the bad value
    (:class:`~ple.errors.ArgumentTypeError` for a number that is no int)."""
    if not isinstance(table_tier, str) or table_tier not in tiers:
        raise InvalidArgumentError(f"table_tier must be one of {list(tiers)}, got {table_tier!r}")
    for name, value, tier, least, unit, hint in (
        ("memory_budget", memory_budget, "direct", 0, "bytes", ""),
        (
            "table_cache_rows",
            table_cache_rows,
            "cached",
            1,
            "rows kept in memory",
            "; for no cache use table_tier='mmap'",
        ),
    ):
        if value is None:
            continue
        if table_tier != tier:
            raise InvalidArgumentError(f"{name} is for table_tier={tier!r}, got table_tier={table_tier!r}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(f"{name} must be an int ({unit}), got {value!r}")
        if value < least:
            raise InvalidArgumentError(f"{name} must be >= {least}, got {value}{hint}")
    for option, given in sharding.items():
        if given is not None and table_tier != "sharded":
            raise InvalidArgumentError(f"{option} is for table_tier='sharded', got table_tier={table_tier!r}")


def open_table(
    path: str | os.PathLike | MmapTable,
    table_tier: str = DEFAULT_TIER,
    *,
    table_cache_rows: int | None = None,
    memory_budget: int | None = None,
    expected_layout_hash: str | dict | None = None,
    device: torch.device | str | None = None,
    group=None,
    method: str | None = None,
    ids: str | None = None,
) -> Table:
    """A table file served from ``table_tier`` (one of :data:`TIERS`; see the module docstring).

    Args:
        path: a complete table file, or one already open (an :class:`~ple.table.MmapTable`, e.g. the
            one a table folder checked: ``PreparedTable.table``), which this call then owns: it is
            returned, wrapped (``"cached"``) or closed, and closed on an error. A tier that opens the
            file again (``"direct"``, ``"sharded"``) refuses a path that no longer names that file.
        table_tier: the tier's name (default :data:`DEFAULT_TIER`).
        table_cache_rows: ``"cached"`` only: rows kept in memory, an int >= 1 (default
            :data:`DEFAULT_CACHE_ROWS`; at most the table's rows are kept).
        memory_budget: ``"direct"`` only: bytes of rows kept in memory, an int >= 0 (default
            :data:`DEFAULT_MEMORY_BUDGET`).
        expected_layout_hash: refuse a file made for another layout (a hash or a fields dict, as
            :meth:`MmapTable.open`); for a path only (an open table was checked when it was opened).
        device: where the rows a tier holds in memory live: the ``"cached"`` tier's rows (default:
            the map's, the CPU), the ``"memory"`` tier's table (default: the CPU), the ``"sharded"``
            tier's rows (default: none, the rank's rows stay mapped). ``"mmap"`` and ``"direct"`` hold
            none: their lookups return rows on the ids' device.
        group, method, ids: ``"sharded"`` only: :func:`~ple.table.tiers.sharded.load_sharded`'s process
            group, exchange method and ids mode (None: its defaults).

    Raises:
        InvalidArgumentError: an unknown tier, an option of another tier, a bad count or budget
            (:func:`check_tier_options`), a replaced file.
        TableFileError: the file is incomplete, damaged or made for another layout.
    """
    check_tier_options(
        table_tier,
        table_cache_rows=table_cache_rows,
        memory_budget=memory_budget,
        group=group,
        method=method,
        ids=ids,
    )
    if not isinstance(path, MmapTable):
        if table_tier in ("direct", "sharded"):
            return _reopen(path, expected_layout_hash, table_tier, memory_budget, device, group, method, ids)
        return _serve(MmapTable.open(path, expected_layout_hash), table_tier, table_cache_rows, device)
    if expected_layout_hash is not None:
        path.close()
        raise InvalidArgumentError(
            f"expected_layout_hash is for a path: the open table {path.path} was checked when it was opened"
        )
    if table_tier not in ("direct", "sharded"):
        return _serve(path, table_tier, table_cache_rows, device)
    try:
        table = _reopen(path.path, path.layout_hash, table_tier, memory_budget, device, group, method, ids)
        if not path.same_file(path.path):  # the file served is the file the caller opened
            table.close()
            raise InvalidArgumentError(f"{path.path} was replaced while it was opened: open it again")
    finally:
        path.close()
    return table


def _reopen(
    path: str | os.PathLike,
    layout: str | dict | None,
    tier: str,
    memory_budget: int | None,
    device: torch.device | str | None,
    group,
    method: str | None,
    ids: str | None,
) -> Table:
    """The tiers that open the file themselves: ``"direct"`` and ``"sharded"``."""
    if tier == "direct":
        return DirectTable(
            path, layout, memory_budget=DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
        )
    if ids is None:
        return load_sharded(path, group, method, expected_layout_hash=layout, device=device)
    return load_sharded(path, group, method, expected_layout_hash=layout, device=device, ids=ids)


def _serve(mapped: MmapTable, tier: str, cache_rows: int | None, device: torch.device | str | None) -> Table:
    """The tiers built over the map: ``"mmap"`` (the map itself), ``"cached"``, ``"memory"`` (a copy;
    the map closed). ``mapped`` is closed on an error."""
    try:
        if tier == "cached":
            return CachedTable(mapped, DEFAULT_CACHE_ROWS if cache_rows is None else cache_rows, device=device)
        if tier == "memory":
            where = "cpu" if device is None else device
            scale = mapped.scale
            copy = MemoryTable(
                mapped.data.to(where, copy=True), None if scale is None else scale.to(where, copy=True), mapped.format
            )
            mapped.close()
            return copy
        return mapped
    except BaseException:
        mapped.close()
        raise
