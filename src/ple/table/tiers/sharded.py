"""Row-sharded PLE tables across ``torch.distributed`` ranks.

Each rank of a process group holds a contiguous slice ``[row_start, row_stop)`` of the full
``[total_rows, head_dim]`` table (any tier: memory, accelerator, memory map) and a
:class:`ShardedTable` answers ``lookup(ids [T, G], dtype) -> [T, G*head_dim]`` for the whole
table, bit-exact with a single-process lookup, by combining what each rank owns with collectives.

What the ranks look up (``ids``, fixed at construction):

- ``"replicated"`` (tensor parallelism): every rank passes the same ``ids``.
- ``"per_rank"`` (data or sequence parallelism): each rank passes its own ``ids``, any number of
  tokens including none (a rank with nothing to look up still calls), and gets its own rows.

How the rows are combined (``method``):

- ``"allreduce"`` (the default with replicated ids): every rank writes the rows it owns into a zeroed buffer and the
  buffers are summed by an integer collective on their *bit patterns* (int32 views): exactly one
  rank contributes non-zero bits at any position, so the sum is a bitwise OR and reproduces the
  owner's bits whatever the dtype, the reduction order or the backend's float arithmetic (a float
  sum would turn -0.0 into +0.0 and depends on how NaN payloads and subnormals are treated). With
  replicated ids the buffer is ``[T, G*head_dim]`` and the collective an ``all_reduce``. With
  per-rank ids the ranks first all-gather their ids, padded to the largest rank's count, each
  fills the rows it owns for every rank's ids, and a ``reduce_scatter`` leaves each rank its own
  slot (the engines' all-gather + all-reduce + keep-your-slot, without moving the slots nobody keeps).
- ``"alltoall"`` (the default with per-rank ids): each rank sends every id to the rank that owns it
  (``all_to_all_single``), the owners look the ids up and send the rows back as bytes. Same result
  for both ids modes.

Collective contract: every rank of the group calls :meth:`ShardedTable.lookup` (and
:meth:`~ShardedTable.start_prefetch`) the same number of times in the same order, with the same
``dtype``; with replicated ids also with the same ``ids``. Before any data moves, every lookup
exchanges one small header (lookup number, token and head counts, dtype, whether the ids are in
range, per-owner counts): when the ranks disagree on anything they must share, every rank raises
the same error naming the ranks and values, instead of one process aborting inside the collective
library and the others waiting (the exchange is :func:`ple.common.collective.exchange_records`).
``verify_ids=True`` also compares a digest of replicated ids.
Collectives run on the ids' device (NCCL for CUDA ids, gloo for CPU ids); every lookup reads the
header back to the host (one synchronization on an accelerator).

Construction is itself collective: the ranks exchange a fixed-size fingerprint (total rows,
head_dim, format, layout hash, global scale, method, ids mode, row range) and, when they disagree
or their ranges overlap or leave gaps, every rank raises :class:`ShardGeometryError` naming the
ranks and values, instead of some ranks proceeding into collectives that would never match (ranks
whose fingerprints differ in length, i.e. run other ple versions, raise
:class:`ple.common.collective.RankMismatchError`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ple.common.collective import collective_device, differing, exchange_records, hash60, rank_list
from ple.errors import InvalidArgumentError, PLEError, UsageError
from ple.table.base import StoredTable, Table, require_stored
from ple.table.files.table_file import TableFileError, hash_layout, read_table_header
from ple.table.formats.catalog import ACTIVATION_DTYPES, FORMATS, check_ids, table_device
from ple.table.lookup.prefetch import PrefetchHandle
from ple.table.tiers.memory import MemoryTable
from ple.table.tiers.mmap import MmapTable

__all__ = [
    "METHODS",
    "DEFAULT_METHODS",
    "IDS_MODES",
    "ShardedLookupError",
    "ShardGeometryError",
    "ShardedPrefetch",
    "ShardedTable",
    "load_sharded",
    "shard_rows",
]

METHODS: tuple[str, ...] = ("allreduce", "alltoall")
"""Ways of combining the ranks' rows (see the module docstring)."""

IDS_MODES: tuple[str, ...] = ("replicated", "per_rank")
"""Whether every rank looks up the same ids or its own (see the module docstring)."""

DEFAULT_METHODS: dict[str, str] = {"replicated": "allreduce", "per_rank": "alltoall"}
"""The method :class:`ShardedTable` uses unless told otherwise, per ids mode: the faster where measured
(gloo on CPUs, docs/DISTRIBUTED.md)."""


class ShardGeometryError(PLEError, ValueError):
    """The ranks of a :class:`ShardedTable` disagree on the table, or their row ranges do not tile it.

    Raised on every rank, with the same list of problems (``problems``), each naming ranks and values.
    """

    def __init__(self, problems: Sequence[str], rank: int, world_size: int) -> None:
        self.problems = list(problems)
        self.rank = rank
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"ShardedTable: the {world_size} ranks of the process group disagree on the sharded table "
            f"(raised on every rank; this is rank {rank}):\n{lines}"
        )


class ShardedLookupError(InvalidArgumentError):
    """The ranks of a :class:`ShardedTable` disagree on a lookup (lookup number, dtype, token or head
    counts, ids out of range). Raised on every rank before any row moves, with the same text."""


# ---------------------------------------------------------------------- row ranges
def shard_rows(total_rows: int, world_size: int, rank: int, *, align: int = 1) -> tuple[int, int]:
    """Balanced contiguous row range ``[start, stop)`` of ``rank`` among ``world_size`` ranks.

    Rows are split in blocks of ``align`` rows (e.g. a checkpoint's ``shard_rows``, so each rank
    reads whole checkpoint shards); the first ``blocks % world_size`` ranks get one block more.
    Ranks past the end get an empty range. Ranges of ranks ``0..world_size-1`` tile
    ``[0, total_rows)`` in rank order.
    """
    for name, v, lo in (("total_rows", total_rows, 0), ("world_size", world_size, 1), ("align", align, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise InvalidArgumentError(f"shard_rows: {name} must be an integer >= {lo}, got {v!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"shard_rows: rank must be an integer in [0, world_size={world_size}), got {rank!r}")
    blocks = -(-total_rows // align)
    base, extra = divmod(blocks, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return min(start * align, total_rows), min(stop * align, total_rows)


# ---------------------------------------------------------------------- fingerprints
# Fixed-size int64 record exchanged at construction; -1 marks "absent / invalid".
_FIELDS = (
    "total_rows",
    "head_dim",
    "format",
    "layout_hash",
    "global_scale",
    "method",
    "ids_mode",
    "row_start",
    "row_stop",
    "local_rows",
    "local_errors",
)
_HASH_HEX = 15  # layout hashes are compared on their first 60 bits (hash60: a digest's own prefix)


@dataclasses.dataclass(frozen=True)
class _Fingerprint:
    total_rows: int
    head_dim: int
    format: int
    layout_hash: int
    global_scale: int
    method: int
    ids_mode: int
    row_start: int
    row_stop: int
    local_rows: int
    local_errors: int

    def as_list(self) -> list[int]:
        return [getattr(self, f) for f in _FIELDS]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> _Fingerprint:
        return cls(*(int(v) for v in values))


def _nonneg_int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else -1


def _local_fingerprint(local_table, total_rows, row_start, row_stop, method, layout_hash, ids_mode):
    """``(fingerprint, problems)`` of this rank. Never raises: invalid arguments become -1 fields
    and local problems, reported collectively so every rank fails together."""
    problems: list[str] = []
    head_dim = fmt = scale_bits = local_rows = -1
    if not isinstance(local_table, Table):
        problems.append(f"local_table must be a ple.table.Table, got {type(local_table).__name__}")
    else:
        try:
            head_dim, fmt, local_rows = local_table.head_dim, FORMATS.index(local_table.format), local_table.rows
            scale = local_table.global_scale  # any tier, rows held here or not (a DirectTable's are not)
            if scale is not None:
                scale_bits = int(scale.detach().reshape(1).float().cpu().view(torch.int32)[0])
        except Exception as e:  # a table that cannot describe itself
            problems.append(f"local_table could not be inspected: {type(e).__name__}: {e}")
    if method not in METHODS:
        problems.append(f"method {method!r} is unknown; expected one of {list(METHODS)}")
    if ids_mode not in IDS_MODES:
        problems.append(f"ids {ids_mode!r} is unknown; expected one of {list(IDS_MODES)}")
    for name, v in (("row_start", row_start), ("row_stop", row_stop), ("total_rows", total_rows)):
        if _nonneg_int(v) < 0:
            problems.append(f"{name} must be a non-negative integer, got {v!r}")
    hbits = -1
    if layout_hash is not None:
        if isinstance(layout_hash, str) and layout_hash:
            hbits = hash60(layout_hash)
        else:
            problems.append(f"layout_hash must be a non-empty str or a dict, got {layout_hash!r}")
    fp = _Fingerprint(
        total_rows=_nonneg_int(total_rows),
        head_dim=head_dim,
        format=fmt,
        layout_hash=hbits,
        global_scale=scale_bits,
        method=METHODS.index(method) if method in METHODS else -1,
        ids_mode=IDS_MODES.index(ids_mode) if ids_mode in IDS_MODES else -1,
        row_start=_nonneg_int(row_start),
        row_stop=_nonneg_int(row_stop),
        local_rows=local_rows,
        local_errors=len(problems),
    )
    return fp, problems


def _render(field: str, v: int) -> str:
    if field == "format":
        return repr(FORMATS[v]) if 0 <= v < len(FORMATS) else "no usable table"
    if field == "method":
        return repr(METHODS[v]) if 0 <= v < len(METHODS) else "an unknown method"
    if field == "ids_mode":
        return repr(IDS_MODES[v]) if 0 <= v < len(IDS_MODES) else "an unknown ids mode"
    if field == "layout_hash":
        return "none given" if v < 0 else f"{v:0{_HASH_HEX}x}..."
    if field == "global_scale":
        return "none" if v == -1 else repr(float(torch.tensor([v], dtype=torch.int32).view(torch.float32)[0]))
    return "invalid" if v < 0 else str(v)


def _check_fingerprints(fps: Sequence[_Fingerprint]) -> list[str]:
    """Problems with the ranks' fingerprints; empty when they describe one table tiled by the ranges."""
    problems: list[str] = []
    failed = [r for r, fp in enumerate(fps) if fp.local_errors]
    if failed:
        problems.append(f"{rank_list(failed)} could not describe their shard (invalid arguments, listed on that rank)")
    live = [(r, fp) for r, fp in enumerate(fps) if not fp.local_errors]
    for field in ("total_rows", "head_dim", "format", "layout_hash", "global_scale", "method", "ids_mode"):
        parts = differing({r: getattr(fp, field) for r, fp in live}, functools.partial(_render, field))
        if parts is not None:
            problems.append(f"{field} differs across ranks ({parts})")
    if failed:
        return problems  # the ranges cannot be judged with a rank missing
    total = fps[0].total_rows
    ranges_ok = all(fp.total_rows == total for fp in fps) and total >= 0
    owned: list[tuple[int, int, int]] = []
    for r, fp in enumerate(fps):
        a, b = fp.row_start, fp.row_stop
        if a < 0 or b < a or (total >= 0 and b > total):
            problems.append(
                f"rank {r}: row range [{_render('row_start', a)}, {_render('row_stop', b)}) is not a range within "
                f"[0, total_rows={_render('total_rows', fp.total_rows)})"
            )
            ranges_ok = False
            continue
        if fp.local_rows >= 0 and fp.local_rows != b - a:
            problems.append(
                f"rank {r}: its local table has {fp.local_rows} rows but its row range [{a}, {b}) has {b - a}"
            )
        if b > a:
            owned.append((a, b, r))
    if not ranges_ok:
        return problems
    owned.sort()
    cursor = 0
    prev: tuple[int, int, int] | None = None  # the range reaching furthest so far
    for a, b, r in owned:
        if a > cursor:
            after = "the start of the table" if prev is None else f"rank {prev[2]}'s [{prev[0]}, {prev[1]})"
            problems.append(
                f"rows [{cursor}, {a}) are owned by no rank (a gap between {after} and rank {r}'s [{a}, {b}))"
            )
        elif a < cursor and prev is not None:
            problems.append(
                f"rank {prev[2]}'s rows [{prev[0]}, {prev[1]}) and rank {r}'s rows [{a}, {b}) overlap on "
                f"[{a}, {min(cursor, b)})"
            )
        if b > cursor:
            cursor, prev = b, (a, b, r)
    if cursor < total:
        where = "no rank owns any row" if prev is None else f"after rank {prev[2]}'s [{prev[0]}, {prev[1]})"
        problems.append(f"rows [{cursor}, {total}) are owned by no rank ({where})")
    return problems


# ---------------------------------------------------------------------- helpers
def _exchange_fingerprints(group, mine: _Fingerprint, device: torch.device | None) -> list[_Fingerprint]:
    """Every rank's fingerprint (the same list on every rank: every rank reaches the same verdict)."""
    records = exchange_records(mine.as_list(), what="ShardedTable: construction", group=group, device=device)
    return [_Fingerprint.from_list(r) for r in records]


def _fail_with_peers(group, problem: str) -> NoReturn:
    """Take part in the construction exchange with a failed fingerprint, then raise: the peers
    reach the same exchange and raise too, instead of waiting for this rank forever."""
    failed = _Fingerprint.from_list([-1] * (len(_FIELDS) - 1) + [1])  # every field invalid, one local error
    fps = _exchange_fingerprints(group, failed, None)
    rank = dist.get_rank(group)
    raise ShardGeometryError([f"rank {rank} (this rank): {problem}"] + _check_fingerprints(fps), rank, len(fps))


def _bit_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as int32 (uint8 when their count is not a multiple of 4): an
    integer SUM over these is a bitwise OR when at most one rank has non-zero bits per position."""
    flat = t.reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    return flat.view(torch.int32) if nbytes % 4 == 0 else flat.view(torch.uint8)


def _dtype_code(dtype: torch.dtype) -> int:
    return ACTIVATION_DTYPES.index(dtype)


@dataclasses.dataclass(frozen=True)
class _Header:
    """What one rank says about a lookup before any row moves (exchanged as int64; -1 = invalid)."""

    number: int  # how many lookups this rank made on the table before this one
    table: int  # which table of the group (tables are built collectively, so in one order everywhere)
    tokens: int
    heads: int
    dtype: int  # index into ACTIVATION_DTYPES
    bad: int  # 1 when an id lies outside the table
    digest: int  # of replicated ids, with verify_ids
    stale: int  # 1 when this rank's table file was changed in place (or closed): its rows cannot be served
    counts: tuple[int, ...]  # alltoall: ids this rank sends to each rank

    @classmethod
    def from_list(cls, v: Sequence[int]) -> _Header:
        n, k, t, g, d, b, h, s = (int(x) for x in v[:8])
        return cls(n, k, t, g, d, b, h, s, tuple(int(x) for x in v[8:]))


def _lookup_problem(ids: Any, dtype: Any) -> str | None:
    """Why ``(ids, dtype)`` cannot be looked up on this rank (None when they can)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.int64:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        return f"row ids must be a 2-D int64 tensor [T, G], got {shape} {getattr(ids, 'dtype', '')}".rstrip()
    if dtype not in ACTIVATION_DTYPES:
        return f"lookup dtype must be one of {list(ACTIVATION_DTYPES)}, got {dtype}"
    return None


def _digest(flat: torch.Tensor) -> torch.Tensor:
    """An order-sensitive int64 digest of ids (wrapping arithmetic): equal ids give equal digests."""
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    weights = torch.arange(1, 2 * flat.numel() + 1, 2, dtype=torch.int64, device=flat.device)
    return ((flat * _GOLDEN + 1) * weights).sum()


_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2**64 / phi as a signed int64


@dataclasses.dataclass
class _Pending:
    """One lookup in flight: its result buffer, the last collective's handle, and the step after it."""

    out: torch.Tensor
    work: Any = None
    finish: Any = None

    def complete(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return self.out


_SERIALS: dict[Any, Iterator[int]] = {}
"""Per process group: how many ShardedTables it has built (construction is collective, so every rank
numbers its tables alike)."""


# ---------------------------------------------------------------------- prefetch handle
class ShardedPrefetch(PrefetchHandle):
    """Handle of one started sharded lookup (the rules of :class:`ple.table.lookup.prefetch.PrefetchHandle`):
    ``wait(ids)`` returns the ``[T, G*head_dim]`` rows once the collective finished.

    The collective was issued when the prefetch started (on the calling thread, so collectives
    keep program order across ranks); ``wait`` blocks until it completes.
    """

    def __init__(self, seq: int, ids: torch.Tensor, dtype: torch.dtype, pending: _Pending) -> None:
        super().__init__(seq, ids, dtype)
        self._pending = pending

    def done(self) -> bool:
        """Whether the collective finished (``wait`` would not block on communication)."""
        p = self._pending
        return p.work is None or p.work.is_completed()

    def _collect(self) -> torch.Tensor:
        return self._pending.complete()

    def _drop(self) -> None:
        # wait for the collective, so no buffer is freed while it is written
        if self._pending.work is not None:
            self._pending.work.wait()


# ---------------------------------------------------------------------- the table
class ShardedTable(Table):
    """A ``[total_rows, head_dim]`` table whose rows are split across the ranks of a process group.

    Args:
        local_table: this rank's rows ``[row_stop - row_start, head_dim]``, any tier and format.
        row_start, row_stop: the full-table rows this rank owns (see :func:`shard_rows`).
        total_rows: rows of the full table (``R_pad``).
        group: process group (default: the default group).
        method: "allreduce" or "alltoall" (see the module docstring); default :data:`DEFAULT_METHODS` of ``ids``.
        ids: "replicated" (every rank looks up the same ids) or "per_rank" (each its own).
        layout_hash: hash (str) or fields (dict, see :func:`ple.table.files.table_file.hash_layout`) of the layout the
            table was built for; compared across ranks. Defaults to a memory-mapped local table's hash.
        device: device of the construction-time exchange (default: CPU, or the current CUDA device
            when the group's only backend is NCCL: call ``torch.cuda.set_device`` first).
        verify_ids: with replicated ids, also compare a digest of the ids on every lookup (a pass
            over the ids; for debugging setups that should replicate them).

    Construction is a collective over ``group`` (see :class:`ShardGeometryError`). Lookups are
    collectives too: see the module docstring for the calling contract. The full table's rows
    exist nowhere, so a ``ShardedTable`` is a :class:`~ple.table.Table` (lookups) but not a
    :class:`~ple.table.StoredTable`; this rank's rows are ``local_table``'s.
    """

    _unpicklable = "serves its rows through a process group"

    def __init__(
        self,
        local_table: Table,
        row_start: int,
        row_stop: int,
        total_rows: int,
        group=None,
        method: str | None = None,
        *,
        ids: str = "replicated",
        layout_hash: str | dict | None = None,
        device: torch.device | str | None = None,
        verify_ids: bool = False,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("ShardedTable needs an initialized torch.distributed process group")
        method = DEFAULT_METHODS.get(ids, DEFAULT_METHODS["replicated"]) if method is None else method
        if layout_hash is None:
            layout_hash = getattr(local_table, "layout_hash", None)
        if isinstance(layout_hash, dict):
            layout_hash = hash_layout(layout_hash)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        mine, local_problems = _local_fingerprint(
            local_table, total_rows, row_start, row_stop, method, layout_hash, ids
        )
        self._exchange_device = collective_device(group, device)
        fps = _exchange_fingerprints(group, mine, self._exchange_device)
        problems = [f"rank {self.rank} (this rank): {p}" for p in local_problems] + _check_fingerprints(fps)
        if problems:
            raise ShardGeometryError(problems, self.rank, self.world_size)

        super().__init__(local_table.format, total_rows, local_table.head_dim)
        self.local_table = local_table
        self.row_start = int(row_start)
        self.row_stop = int(row_stop)
        self.method = method
        self.ids = ids
        self.layout_hash = layout_hash
        self.verify_ids = bool(verify_ids)
        self.ranges: list[tuple[int, int]] = [(fp.row_start, fp.row_stop) for fp in fps]
        owned = sorted((a, r) for r, (a, b) in enumerate(self.ranges) if b > a)
        self._owner_starts = torch.tensor([a for a, _ in owned], dtype=torch.int64)
        self._owner_ranks = torch.tensor([r for _, r in owned], dtype=torch.int64)
        self._owner_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._seq = itertools.count()
        self._lookups = itertools.count()
        self._serial = next(_SERIALS.setdefault(group, itertools.count()))

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_full(
        cls,
        table: Table,
        group=None,
        method: str | None = None,
        *,
        row_range: tuple[int, int] | None = None,
        align: int = 1,
        device: torch.device | str | None = None,
        copy: bool = True,
        ids: str = "replicated",
        layout_hash: str | dict | None = None,
        verify_ids: bool = False,
    ) -> ShardedTable:
        """Shard a full table that every rank can read (a :class:`MemoryTable`, a memory map, ...).

        Each rank keeps rows ``row_range`` (default :func:`shard_rows` with ``align``) as a
        :class:`MemoryTable`, copied (``copy=True``, so the full table can be dropped) and moved to
        ``device`` when given; ``copy=False`` keeps a view of the full table's storage.
        """
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        try:
            a, b = row_range if row_range is not None else shard_rows(table.rows, world, rank, align=align)
            local = _slice_table(table, a, b, device, copy)
        except Exception as e:
            _fail_with_peers(group, f"could not build its shard: {type(e).__name__}: {e}")
        if layout_hash is None:
            layout_hash = getattr(table, "layout_hash", None)
        return cls(local, a, b, table.rows, group, method, ids=ids, layout_hash=layout_hash, verify_ids=verify_ids)

    # ------------------------------------------------------------------ Table interface
    @property
    def device(self) -> torch.device:
        """Where this rank's rows are stored."""
        return self.local_table.device

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's rows plus scales."""
        return self.local_table.nbytes

    def __repr__(self) -> str:
        return (
            f"ShardedTable(format={self.format!r}, rows={self.rows}, head_dim={self.head_dim}, rank={self.rank}/"
            f"{self.world_size}, local_rows=[{self.row_start}, {self.row_stop}), method={self.method!r}, "
            f"ids={self.ids!r}, "
            f"local={type(self.local_table).__name__} on {self.device})"
        )

    @property
    def global_scale(self) -> torch.Tensor | None:
        return self.local_table.global_scale

    def _gathers_on_device(self, device: torch.device) -> bool:
        return self.local_table._gathers_on_device(device)

    def _lookup_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(self._start(ids, out.dtype, False).complete())

    def close(self) -> None:
        super().close()
        self.local_table.close()

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype, *, check: bool = True) -> torch.Tensor:
        """Rows of the full table for ``ids [T, G]``: ``[T, G*head_dim]`` in ``dtype`` on the ids' device
        (this rank's own ids' rows; with replicated ids the same on every rank).

        A collective: see the module docstring for the calling contract. ``check`` verifies ids lie
        in ``[0, rows)``. A bad id, invalid arguments or a disagreement on any rank raise on every rank
        (:class:`ShardedLookupError`; the rank with the bad id raises
        :class:`~ple.table.IdOutOfRangeError` naming it) before any row moves.
        """
        return self._start(ids, dtype, check).complete()

    def start_prefetch(self, ids: torch.Tensor, dtype: torch.dtype, *, check: bool = True) -> ShardedPrefetch:
        """Start ``lookup(ids, dtype)``: the header, the local gather and the collectives are issued now,
        on this thread (so collective order matches across ranks); the last collective runs in the
        background and ``handle.wait()`` returns the rows. A collective, like :meth:`lookup`."""
        pending = self._start(ids, dtype, check)
        return ShardedPrefetch(next(self._seq), ids, dtype, pending)

    # ------------------------------------------------------------------ lookup internals
    def _start(self, ids: torch.Tensor, dtype: torch.dtype, check: bool) -> _Pending:
        number = next(self._lookups)
        problem = _lookup_problem(ids, dtype)
        dev = ids.device if problem is None else self._exchange_device
        W = self.world_size
        file_error = self._file_error()
        fields: list[torch.Tensor | int] = [number, self._serial, -1, -1, -1, 0, 0, int(file_error is not None)]
        counts = torch.zeros(W, dtype=torch.int64, device=dev)
        owner = order = flat_ok = None
        if problem is None:
            flat = ids.reshape(-1)
            bad = (flat < 0) | (flat >= self.rows)
            fields[2:5] = [ids.shape[0], ids.shape[1], _dtype_code(dtype)]
            if check and flat.numel():
                fields[5] = bad.any().to(torch.int64)
            if self.verify_ids and self.ids == "replicated":
                fields[6] = _digest(flat)
            if self.method == "alltoall":
                starts, ranks = self._owner_tables(dev)
                flat_ok = flat.masked_fill(bad, 0)  # only reached unchecked (check=False) or never sent
                owner = ranks[torch.searchsorted(starts, flat_ok, right=True) - 1]
                order = torch.argsort(owner, stable=True)
                counts = torch.bincount(owner, minlength=W)
        mine = torch.cat([torch.stack([torch.as_tensor(f, dtype=torch.int64, device=dev) for f in fields]), counts])
        # 8 + W words on every rank of the group: no exchange of lengths
        records = exchange_records(mine, what="ShardedTable: lookup header", group=self.group, same_length=True)
        headers = [_Header.from_list(r) for r in records]
        self._check_headers(headers, number, problem, ids, file_error)  # raises on every rank alike
        if self.method == "alltoall":
            assert flat_ok is not None and order is not None
            recv = [h.counts[self.rank] for h in headers]
            return self._start_alltoall(flat_ok[order], ids.shape, dtype, order, counts.tolist(), recv)
        if self.ids == "replicated":
            return self._start_allreduce(ids, dtype)
        return self._start_reduce_scatter(ids, dtype, [h.tokens for h in headers])

    def _file_error(self) -> PLEError | None:
        """Why this rank's local table, when it serves rows from a file (``check_file``), cannot serve
        them now (the file changed in place, or the table was closed); None otherwise."""
        check = getattr(self.local_table, "check_file", None)
        if check is None:
            return None
        try:
            check()
        except (TableFileError, UsageError) as e:
            return e
        return None

    def _check_headers(
        self, headers: list[_Header], number: int, problem: str | None, ids, file_error: PLEError | None = None
    ) -> None:
        """Raise the same error on every rank when the ranks' headers disagree (identical decisions
        everywhere, since every rank sees every header)."""
        me, W = self.rank, self.world_size
        rows: list[str] = []
        invalid = [r for r, h in enumerate(headers) if h.dtype < 0]
        if invalid:
            rows.append(
                f"{rank_list(invalid)} passed invalid arguments" + (f" (this rank: {problem})" if problem else "")
            )
        if len({(h.table, h.number) for h in headers}) > 1:
            desc = "; ".join(f"rank {r}: table {h.table}, lookup {h.number}" for r, h in enumerate(headers))
            rows.append(
                f"ranks are at different lookups ({desc}; tables numbered in the order the group built them): every "
                "rank must call lookup/start_prefetch on the same tables, the same number of times, in the same order"
            )
        valid = [(r, h) for r, h in enumerate(headers) if h.dtype >= 0]
        if len({h.dtype for _, h in valid}) > 1:
            desc = "; ".join(f"rank {r}: {ACTIVATION_DTYPES[h.dtype]}" for r, h in valid)
            rows.append(f"ranks asked for different lookup dtypes ({desc})")
        if len({h.heads for _, h in valid}) > 1:
            desc = "; ".join(f"rank {r}: {h.heads}" for r, h in valid)
            rows.append(f"ranks passed ids with different numbers of heads G ({desc})")
        if self.ids == "replicated":
            tokens_differ = len({h.tokens for _, h in valid}) > 1
            if tokens_differ and self.method == "allreduce":
                desc = "; ".join(f"rank {r}: {h.tokens}" for r, h in valid)
                rows.append(
                    f"ranks looked up different numbers of tokens ({desc}) but this table's ids are 'replicated' "
                    "(use ids='per_rank' for data-parallel batches)"
                )
            elif self.verify_ids and (tokens_differ or len({h.digest for _, h in valid}) > 1):
                desc = "; ".join(f"rank {r}: {h.tokens} tokens, ids digest {h.digest}" for r, h in valid)
                rows.append(f"ranks looked up different ids although this table's ids are 'replicated' ({desc})")
        bad = [r for r, h in valid if h.bad]
        if bad:
            rows.append(f"{rank_list(bad)} looked up row ids outside [0, {self.rows})")
        stale = [r for r, h in enumerate(headers) if h.stale]
        if stale:
            rows.append(
                f"{rank_list(stale)} cannot serve rows: the local table file was changed in place (or the table "
                "closed) since it was opened"
            )
        if not rows:
            return
        if file_error is not None:
            raise file_error  # names the file
        if me in bad and not invalid:
            check_ids(ids, self.rows)  # raises with the id and its position
        text = "; ".join(rows)
        raise ShardedLookupError(
            f"ShardedTable: {text} (raised on every rank of {W} before any row moved; this is rank {me})"
        )

    def _fill_owned(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[n, head_dim]``: the rows of ``flat`` ids this rank owns, zeros elsewhere (ids outside the
        table, e.g. padding -1, are owned by nobody)."""
        D = self.head_dim
        a, b = self.row_start, self.row_stop
        n = flat.numel()
        if b == a or n == 0:
            return torch.zeros(n, D, dtype=dtype, device=flat.device)
        owned = (flat >= a) & (flat < b)
        if flat.device.type == "cpu":
            # Host: gather only the owned rows (half the dequantization work at two ranks) and place
            # them in a zeroed buffer.
            pos = owned.nonzero().squeeze(1)
            out = torch.zeros(n, D, dtype=dtype)
            if pos.numel():
                out.index_copy_(0, pos, self.local_table.lookup((flat[pos] - a).view(-1, 1), dtype, check=False))
            return out
        # Accelerator: no host synchronization to compact the ids; rows owned elsewhere read local
        # row 0 and are zeroed.
        out = self.local_table.lookup(torch.where(owned, flat - a, 0).view(-1, 1), dtype, check=False)
        return out.view(n, D).masked_fill_(~owned.unsqueeze(1), 0)

    def _start_allreduce(self, ids: torch.Tensor, dtype: torch.dtype) -> _Pending:
        T, G = ids.shape
        out = self._fill_owned(ids.reshape(-1), dtype).view(T, G * self.head_dim)
        if out.numel() == 0:  # every rank has the same T (checked): none calls
            return _Pending(out)
        work = dist.all_reduce(_bit_view(out), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Pending(out, work)

    def _start_reduce_scatter(self, ids: torch.Tensor, dtype: torch.dtype, tokens: list[int]) -> _Pending:
        """Per-rank ids: all-gather every rank's ids (padded to the largest count, rounded up to 4 so
        each slot's bytes view as int32), fill the owned rows of all of them, reduce-scatter the bits
        so each rank receives its own slot."""
        T, G = ids.shape
        D, W, dev = self.head_dim, self.world_size, ids.device
        pad = -(-max(tokens) // 4) * 4
        if pad == 0:  # no rank has a token (every rank sees the same counts): none calls
            return _Pending(torch.empty(0, G * D, dtype=dtype, device=dev))
        mine = torch.full((pad * G,), -1, dtype=torch.int64, device=dev)
        mine[: T * G] = ids.reshape(-1)
        every = torch.empty(W, pad * G, dtype=torch.int64, device=dev)
        dist.all_gather(list(every.unbind(0)), mine, group=self.group)
        rows = self._fill_owned(every.view(-1), dtype).view(W, pad * G * D)
        slot = torch.empty(pad * G * D, dtype=dtype, device=dev)
        work = dist.reduce_scatter(
            _bit_view(slot),
            [_bit_view(r) for r in rows.unbind(0)],
            op=dist.ReduceOp.SUM,
            group=self.group,
            async_op=True,
        )
        return _Pending(slot[: T * G * D].view(T, G * D), work)

    def _owner_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._owner_cache.get(device)
        if cached is None:
            cached = (self._owner_starts.to(device), self._owner_ranks.to(device))
            self._owner_cache[device] = cached
        return cached

    def _start_alltoall(
        self,
        sorted_ids: torch.Tensor,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        order: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
    ) -> _Pending:
        """``sorted_ids``: this rank's ids in owner order (``order``); ``*_splits``: ids per rank."""
        T, G = shape
        D, dev = self.head_dim, sorted_ids.device
        recv_ids = torch.empty(sum(recv_splits), dtype=torch.int64, device=dev)
        dist.all_to_all_single(recv_ids, sorted_ids, recv_splits, send_splits, group=self.group)
        if recv_ids.numel():
            rows = self.local_table.lookup((recv_ids - self.row_start).view(-1, 1), dtype, check=False)
        else:
            rows = torch.empty(0, D, dtype=dtype, device=dev)
        back = torch.empty(T * G, D, dtype=dtype, device=dev)
        # Rows travel as bytes: a plain copy, for every dtype and backend.
        work = dist.all_to_all_single(
            back.view(torch.uint8),
            rows.contiguous().view(torch.uint8),
            send_splits,
            recv_splits,
            group=self.group,
            async_op=True,
        )
        out = torch.empty(T, G * D, dtype=dtype, device=dev)
        # where each position's row lands in ``back`` (a gather is cheaper than a scatter)
        inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=dev))

        def finish() -> None:
            torch.index_select(back, 0, inverse, out=out.view(T * G, D))

        return _Pending(out, work, finish)


# ---------------------------------------------------------------------- building local shards
def _slice_table(table: Table, a: int, b: int, device, copy: bool) -> MemoryTable:
    table = require_stored(table, "sharding a full table")
    if not 0 <= a <= b <= table.rows:
        raise InvalidArgumentError(f"row range [{a}, {b}) is not within the table's [0, {table.rows})")
    data, scale = table.data[a:b], table.scale
    if scale is not None and scale.dim() == 2:
        scale = scale[a:b]
    if device is not None:
        data = data.to(device, copy=copy)
        scale = None if scale is None else scale.to(device, copy=copy)
    elif copy:
        data = data.clone()
        scale = None if scale is None else scale.clone()
    return MemoryTable(data, scale, table.format)


class _MappedRows(StoredTable):
    """Rows ``[a, b)`` of a memory-mapped table file as one rank's local table: views of the file's
    map (nothing copied; a lookup reads only the pages it touches), checked like the full
    :class:`MmapTable`'s: a :class:`ShardedTable` compares the file's size and modification time
    with those at open (:meth:`check_file`) on every rank in the header of every lookup, before any
    row moves, so all ranks fail together. The rows themselves are read without a second check: one
    that failed on one rank alone, after the header, would leave the others waiting in the next
    collective (a change during a lookup goes undetected, as for :class:`MmapTable`). Closing it
    closes the file."""

    _unpicklable = "maps one rank's rows of a table file"

    def __init__(self, full: MmapTable, a: int, b: int) -> None:
        super().__init__(full.format, b - a, full.head_dim)
        self.path = full.path
        self.header = full.header
        self._full = full
        scale = full.scale
        self._rows: torch.Tensor | None = full.data[a:b]
        self._scale = scale[a:b] if scale is not None and scale.dim() == 2 else scale

    @property
    def data(self) -> torch.Tensor:
        if self._rows is None:
            raise UsageError(f"table file {self.path} was closed")
        return self._rows

    @property
    def scale(self) -> torch.Tensor | None:
        return self._scale

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def layout_hash(self) -> str:
        return self._full.layout_hash

    def check_file(self) -> None:
        """Raise :class:`~ple.table.TableFileError` if the file was changed in place since it was
        opened (see :meth:`MmapTable.check_file`)."""
        self._full.check_file()

    def close(self) -> None:
        super().close()
        self._rows = self._scale = None
        self._full.close()


def load_sharded(
    path: str | os.PathLike,
    group=None,
    method: str | None = None,
    *,
    expected_layout_hash: str | dict | None = None,
    row_range: tuple[int, int] | None = None,
    align: int = 1,
    device: torch.device | str | None = None,
    ids: str = "replicated",
    verify_ids: bool = False,
) -> ShardedTable:
    """Open a table file (:mod:`ple.table.files.table_file`) and shard it: each rank keeps only its rows.

    Each rank checks the per-row scales of its own rows only (``MmapTable.open(scale_rows=)``).
    ``device=None`` keeps the rows memory-mapped (only this rank's pages are ever read) and checked
    as an :class:`MmapTable` checks its file: a lookup raises :class:`~ple.table.TableFileError` on
    the rank whose file was changed in place since it was opened (and :class:`ShardedLookupError`
    on the others), before any row moves. A device (``"cpu"``, ``"cuda:3"``) reads the rows into
    memory there and closes the file. The file's layout hash is part of the
    fingerprint the ranks compare, so ranks that opened different files fail together.
    Row range: ``row_range``, or :func:`shard_rows` over the file's rows with ``align`` (default:
    the file's own shard rows are not imposed; pass ``align=header['shard_rows']`` to keep them).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    try:
        rows = read_table_header(path)["rows"]
        a, b = row_range if row_range is not None else shard_rows(rows, world, rank, align=align)
        if not 0 <= a <= b <= rows:
            raise InvalidArgumentError(f"row range [{a}, {b}) is not within the table's [0, {rows})")
        # each rank checks the per-row scales of its own rows only
        full = MmapTable.open(path, expected_layout_hash, scale_rows=(a, b))
        local: Table
        if device is None:
            local = _MappedRows(full, a, b)
        else:
            local = _slice_table(full, a, b, table_device(device), copy=True)
            full.close()
    except Exception as e:
        _fail_with_peers(group, f"could not open its shard of {os.fspath(path)!r}: {type(e).__name__}: {e}")
    return ShardedTable(
        local, a, b, full.rows, group, method, ids=ids, layout_hash=full.layout_hash, verify_ids=verify_ids
    )
