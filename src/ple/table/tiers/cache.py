"""Row cache: :class:`CachedTable` keeps the most frequently read rows of a slower table in memory.

A token stream reads its rows with a heavy head: on Zipf-like text the hottest 1% of the rows a
stream touches serve about a third of its lookups. A memory-mapped table pays a page fault per cold
row, and the OS page cache keeps whole 4 KiB pages (25 rows of 160 bytes), so scattered hot rows pin
25 times their size. A row-level cache keeps exactly the hot rows.

How a lookup runs (``ids [T, G]``, ``N = T*G`` row reads):

1. the distinct ids ``[U]`` are found once (sorted: the index search then walks the index in order
   and a memory map is read in file order);
2. hits: ``searchsorted`` of those ids in the cache's sorted id index ``[C]`` (no dense id -> slot
   map: the published table has 320 million rows);
3. misses are gathered from the backing table's storage (each distinct row once), hits from the
   cache; the stored rows (and per-row scales) are spread back to the ``N`` positions and
   dequantized once, so the result is bit-exact with ``backing.lookup(ids, dtype)``.

Admission is LFU with decay. Every lookup's ids are counted (raw ids are buffered and folded into
exact per-id counts; at most ``max_tracked`` ids keep a count, the lowest counts are dropped, ties
by id). Every ``refresh_every`` lookups, or on :meth:`CachedTable.refresh`, the history becomes
``history * decay + counts since the last refresh`` and the cache is rebuilt to hold the
``capacity_rows`` ids of highest history (ties broken by the smaller id): the same id stream gives the
same cache. :meth:`CachedTable.warm` counts a known stream and refreshes.

A backing table that can tell whether its file changed in place (an :class:`~ple.table.MmapTable`:
``check_file``) is asked before every lookup, prefetch and refresh, hits included, so a table file
truncated or overwritten under the cache raises :class:`~ple.table.TableFileError` as the memory map
itself would, instead of serving stale cached rows or touching pages cut off by a truncation.

Concurrency: the cache is an immutable ``(ids, rows, scales)`` triple replaced whole by a refresh
(copy-on-write), so a lookup or prefetch reading the old triple is never disturbed; counting and
statistics are guarded by a lock, refreshes are serialized. A fork waits for a refresh or a count in
progress (see :mod:`.forks`), so a forked child finds both whole.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import NamedTuple

import torch

from ple.errors import InvalidArgumentError
from ple.table.base import StoredTable, require_stored
from ple.table.formats.catalog import format_info, table_device
from ple.table.lookup import dequantize_rows_into
from ple.table.lookup.torch_impl import gather_rows

__all__ = ["CachedTable"]

POLICIES = ("lfu", "static")

_PENDING_LIMIT = 1 << 20  # raw ids buffered before they are folded into per-id counts (8 MiB)


class _State(NamedTuple):
    """One immutable cache generation: ``ids [C]`` int64 sorted, ``data [C, D]`` stored rows,
    ``scale [C, 1]`` fp32 (per-row formats) or None; all on the cache device."""

    ids: torch.Tensor
    data: torch.Tensor
    scale: torch.Tensor | None


def _empty_counts() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float64)


def _top(counts: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest counts; ties go to the earlier position (the smaller id, as
    the ids beside the counts are sorted)."""
    return torch.sort(counts, descending=True, stable=True).indices[:k]


def _merge(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], limit: int):
    """Sum two ``(ids sorted unique [n], counts [n] float64)`` count sets; keep the ``limit`` highest.

    Each id gets at most two terms, so the sums do not depend on any summation order.
    """
    ids = torch.cat([a[0], b[0]])
    counts = torch.cat([a[1], b[1]])
    if ids.numel() == 0:
        return _empty_counts()
    uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
    total = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inv, counts)
    if uniq.numel() > limit:
        keep = _top(total, limit).sort().values
        uniq, total = uniq[keep], total[keep]
    return uniq, total


def _fold(counts: tuple[torch.Tensor, torch.Tensor], raw: list[torch.Tensor], limit: int):
    """Add raw id occurrences (each counts 1) to a count set."""
    if not raw:
        return counts
    ids, n = torch.unique(torch.cat(raw), sorted=True, return_counts=True)
    return _merge(counts, (ids, n.to(torch.float64)), limit)


def _word_views(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Views of contiguous ``[N, D]`` row tensors as the widest integer word that tiles every row of
    all of them (bit-exact copies, several times faster than 1- or 2-byte elements)."""
    raw = [t.view(torch.uint8) for t in tensors]
    width = raw[0].shape[1]
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if width % size == 0 and all(t.data_ptr() % size == 0 for t in raw):
            return [t.view(word) for t in raw]
    return raw


class CachedTable(StoredTable):
    """A bounded in-memory cache of the hottest rows in front of a slower table.

    Args:
        backing: the table that holds every row (typically an :class:`~ple.table.MmapTable`); it must
            expose its rows (``data``/``scale``), which the cache reads for misses and admissions.
        capacity_rows: most rows held (at most ``backing.rows``); 0 caches nothing.
        policy: "lfu" (lookups are counted; the cache is rebuilt every ``refresh_every`` lookups) or
            "static" (lookups are not counted; the cache changes only on :meth:`warm`/:meth:`refresh`).
        refresh_every: lookups between automatic refreshes under "lfu"; None refreshes only on request.
        decay: factor in ``(0, 1]`` applied to the access history at each refresh (1 = plain LFU).
        max_tracked: most ids that keep an access count (default ``max(4 * capacity_rows, 65536)``).
        device: where the cached rows live (default ``backing.device``).

    The table has the backing table's ``format``, ``rows`` and ``head_dim``; lookups (and prefetches)
    are bit-exact with ``backing.lookup``. ``data`` and ``scale`` are the backing table's (the full
    table; the training-style :meth:`ple.layer.PLELayer.forward_padded` embeds plain tables from them
    directly). The rows are copied when admitted: after changing the backing table's rows call
    :meth:`clear`. ``close()`` closes the backing table too.

    Statistics: ``hits`` and ``misses`` count row reads (``T*G`` per lookup), ``fetched_rows`` the
    distinct rows read from the backing table for misses, ``hit_rate`` = hits / (hits + misses);
    :meth:`reset_stats` zeroes them (not the access counts).
    """

    _unpicklable = "holds a cache of rows, its statistics and locks in front of another table"

    def __init__(
        self,
        backing: StoredTable,
        capacity_rows: int,
        *,
        policy: str = "lfu",
        refresh_every: int | None = 64,
        decay: float = 0.5,
        max_tracked: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        require_stored(backing, "CachedTable (misses and admissions)")
        if isinstance(capacity_rows, bool) or not isinstance(capacity_rows, int) or capacity_rows < 0:
            raise InvalidArgumentError(f"capacity_rows must be an integer >= 0, got {capacity_rows!r}")
        if policy not in POLICIES:
            raise InvalidArgumentError(f"unknown cache policy {policy!r}: expected one of {list(POLICIES)}")
        if refresh_every is not None and (
            isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or refresh_every < 1
        ):
            raise InvalidArgumentError(f"refresh_every must be an integer >= 1 or None, got {refresh_every!r}")
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0.0 < decay <= 1.0:
            raise InvalidArgumentError(f"decay must be a number in (0, 1], got {decay!r}")
        super().__init__(backing.format, backing.rows, backing.head_dim)
        self.backing = backing
        self.capacity_rows = min(capacity_rows, backing.rows)
        if max_tracked is None:
            max_tracked = max(4 * self.capacity_rows, 1 << 16)
        if isinstance(max_tracked, bool) or not isinstance(max_tracked, int) or max_tracked < self.capacity_rows:
            raise InvalidArgumentError(
                f"max_tracked must be an integer >= capacity_rows ({self.capacity_rows}), got {max_tracked!r}"
            )
        self.policy = policy
        self.refresh_every = refresh_every
        self.decay = float(decay)
        self.max_tracked = max_tracked
        self._cache_device = table_device(device) if device is not None else backing.device
        self._scale_kind = format_info(self.format).scale_kind
        self._lock = threading.Lock()  # counts, pending ids, statistics
        self._refresh_lock = threading.Lock()  # taken before _lock where both are
        self._state = self._empty_state()
        self._pending: list[torch.Tensor] = []
        self._pending_n = 0
        self._current = _empty_counts()  # counts since the last refresh
        self._history = _empty_counts()  # decayed counts as of the last refresh
        self._since_refresh = 0
        self.refreshes = 0
        self.reset_stats()

    def _fork_locks(self) -> list[threading.Lock]:
        return [*super()._fork_locks(), self._refresh_lock, self._lock]

    # ------------------------------------------------------------------ Table interface
    @property
    def data(self) -> torch.Tensor:
        """The backing table's rows ``[rows, head_dim]`` (the full table, not the cached rows)."""
        return self.backing.data

    @property
    def scale(self) -> torch.Tensor | None:
        """The backing table's scale (None, ``[1]`` or ``[rows, 1]``)."""
        return self.backing.scale

    @property
    def device(self) -> torch.device:
        """Where the cached rows live."""
        return self._cache_device

    @property
    def nbytes(self) -> int:
        """Bytes of the backing table (see :attr:`cache_nbytes` for the cache)."""
        return self.backing.nbytes

    def _gathers_on_device(self, device: torch.device) -> bool:
        # Lookups read the index and count misses on the host (a synchronization): prefetches run
        # on the worker thread, whatever the devices.
        return False

    def __repr__(self) -> str:
        return (
            f"CachedTable(format={self.format!r}, rows={self.rows}, head_dim={self.head_dim}, "
            f"cached={self.cached_rows}/{self.capacity_rows} rows on {self.device}, policy={self.policy!r}, "
            f"backing={type(self.backing).__name__})"
        )

    def close(self) -> None:
        """Stop prefetching, drop the cached rows and close the backing table."""
        super().close()
        with self._refresh_lock:
            self._state = self._empty_state()
        self.backing.close()

    # ------------------------------------------------------------------ statistics
    @property
    def hits(self) -> int:
        """Row reads served from the cache since the last :meth:`reset_stats`."""
        return self._hits

    @property
    def misses(self) -> int:
        """Row reads served from the backing table since the last :meth:`reset_stats`."""
        return self._misses

    @property
    def fetched_rows(self) -> int:
        """Distinct rows read from the backing table for misses (summed over lookups)."""
        return self._fetched

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before any lookup."""
        n = self._hits + self._misses
        return self._hits / n if n else 0.0

    def reset_stats(self) -> None:
        """Zero ``hits``, ``misses`` and ``fetched_rows`` (the access counts are kept)."""
        with self._lock:
            self._hits = 0
            self._misses = 0
            self._fetched = 0

    @property
    def cached_rows(self) -> int:
        """Rows held now (at most ``capacity_rows``)."""
        return int(self._state.ids.numel())

    @property
    def cached_ids(self) -> torch.Tensor:
        """``[cached_rows]`` int64, sorted: the ids held now (a CPU copy)."""
        return self._state.ids.to("cpu", copy=True)

    @property
    def cache_nbytes(self) -> int:
        """Bytes of the cached rows, their scales and their id index."""
        s = self._state
        n = s.ids.numel() * s.ids.element_size() + s.data.numel() * s.data.element_size()
        return n + (0 if s.scale is None else s.scale.numel() * s.scale.element_size())

    def check_file(self) -> None:
        """The backing table's ``check_file`` when it has one (a table file changed in place since it
        was opened raises :class:`~ple.table.TableFileError`); nothing otherwise."""
        check = getattr(self.backing, "check_file", None)
        if check is not None:
            check()

    # ------------------------------------------------------------------ admission
    def warm(self, ids: torch.Tensor | Iterable[torch.Tensor]) -> int:
        """Count the ids of a known stream (a tensor of any shape, or an iterable of them) as
        accesses, then :meth:`refresh`. Returns the number of rows newly admitted."""
        chunks = [ids] if isinstance(ids, torch.Tensor) else list(ids)
        for c in chunks:
            if not isinstance(c, torch.Tensor) or c.dtype != torch.int64:
                raise InvalidArgumentError(
                    f"warm() takes int64 id tensors, got {getattr(c, 'dtype', type(c).__name__)}"
                )
            flat = c.reshape(-1)
            if flat.numel() and (bool((flat < 0).any()) or bool((flat >= self.rows).any())):
                bad = flat[(flat < 0) | (flat >= self.rows)][0]
                raise InvalidArgumentError(
                    f"warm(): row id {int(bad)} is out of range: the table has rows [0, {self.rows})"
                )
            with self._lock:
                self._count_locked(flat)
        return self.refresh()

    def refresh(self) -> int:
        """Fold the accesses counted since the last refresh into the decayed history and rebuild the
        cache from the ``capacity_rows`` most accessed ids. Returns the number of rows newly admitted."""
        self.check_file()
        with self._refresh_lock:
            with self._lock:
                pending, self._pending, self._pending_n = self._pending, [], 0
                current, self._current = self._current, _empty_counts()
                self._since_refresh = 0
            current = _fold(current, pending, self.max_tracked)
            hist_ids, hist_counts = self._history
            self._history = _merge((hist_ids, hist_counts * self.decay), current, self.max_tracked)
            ids, counts = self._history
            hot = ids
            if ids.numel() > self.capacity_rows:
                hot = ids[_top(counts, self.capacity_rows).sort().values]
            self.refreshes += 1
            old = self._state
            if hot.numel() == old.ids.numel() and torch.equal(hot, old.ids.cpu()):
                return 0
            state, admitted = self._build(hot, old)
            self._state = state
            return admitted

    def clear(self) -> None:
        """Drop the cached rows and every access count (e.g. after the backing rows changed)."""
        with self._refresh_lock:
            with self._lock:
                self._pending, self._pending_n = [], 0
                self._current = _empty_counts()
                self._since_refresh = 0
            self._history = _empty_counts()
            self._state = self._empty_state()

    def _count_locked(self, flat: torch.Tensor) -> None:
        """Buffer raw ids as accesses (caller holds ``_lock``); fold them when the buffer is full."""
        self._pending.append(flat.to("cpu", copy=True))
        self._pending_n += flat.numel()
        if self._pending_n >= _PENDING_LIMIT:
            self._current = _fold(self._current, self._pending, self.max_tracked)
            self._pending, self._pending_n = [], 0

    def _empty_state(self) -> _State:
        dev = self._cache_device
        data = torch.empty(0, format_info(self.format).width(self.head_dim), dtype=self.storage_dtype, device=dev)
        scale = torch.empty(0, 1, dtype=torch.float32, device=dev) if self._scale_kind == "row" else None
        return _State(torch.empty(0, dtype=torch.int64, device=dev), data, scale)

    def _build(self, hot: torch.Tensor, old: _State) -> tuple[_State, int]:
        """A new generation holding ``hot [C]`` (sorted CPU ids): rows already cached are copied from
        ``old``, the others read from the backing table."""
        dev = self._cache_device
        C = hot.numel()
        ids = hot.to(dev)
        data = torch.empty(C, format_info(self.format).width(self.head_dim), dtype=self.storage_dtype, device=dev)
        scale = torch.empty(C, 1, dtype=torch.float32, device=dev) if self._scale_kind == "row" else None
        if old.ids.numel():
            pos = torch.searchsorted(old.ids, ids).clamp_(max=old.ids.numel() - 1)
            kept = old.ids.index_select(0, pos) == ids
        else:
            pos = kept = torch.zeros(C, dtype=torch.bool, device=dev)
        new_slots = (~kept).nonzero().squeeze(1)
        if C and new_slots.numel() < C:
            kept_slots = kept.nonzero().squeeze(1)
            dst, src = _word_views(data, old.data)
            dst.index_copy_(0, kept_slots, src.index_select(0, pos.index_select(0, kept_slots)))
            if scale is not None and old.scale is not None:
                scale.index_copy_(0, kept_slots, old.scale.index_select(0, pos.index_select(0, kept_slots)))
        if new_slots.numel():
            bdata, bscale = self.backing.data, self.backing.scale
            new_ids = ids.index_select(0, new_slots).to(bdata.device)
            fetched = gather_rows(bdata, new_ids).to(dev)
            dst, src = _word_views(data, fetched)
            dst.index_copy_(0, new_slots, src)
            if scale is not None and bscale is not None:
                scale.index_copy_(0, new_slots, bscale.index_select(0, new_ids.to(bscale.device)).to(dev))
        return _State(ids, data, scale), int(new_slots.numel())

    # ------------------------------------------------------------------ lookup
    def _lookup_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        self.check_file()  # before counting or serving: cached rows of a changed file are stale too
        flat = ids.reshape(-1).contiguous()
        n = flat.numel()
        due = False
        if self.policy == "lfu" and n:
            with self._lock:
                self._count_locked(flat)
                self._since_refresh += 1
                if self.refresh_every is not None and self._since_refresh >= self.refresh_every:
                    self._since_refresh = 0
                    due = True
        if n:
            self._serve(flat, out.view(n, self.head_dim))
        if due:
            self.refresh()

    def _serve(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        """``out [N, D]`` = dequantized rows of ``flat [N]`` (already checked ids).

        The distinct ids ``[U]`` (sorted: the index search walks the index in order, a memory map is
        read in file order) are resolved once; their stored rows ``[U, D]`` come from the cache (hits)
        or the backing table (misses), are spread back to the ``N`` positions, then dequantized.
        """
        state = self._state  # one generation for the whole lookup (a refresh swaps in a new one)
        n = flat.numel()
        dev, cdev = out.device, state.ids.device
        bdata, bscale = self.backing.data, self.backing.scale
        per_row = self._scale_kind == "row"
        # per-row formats carry [rows, 1] scales in the backing table and in every cache generation
        row_scale = bscale if per_row else None
        if per_row:
            assert bscale is not None and state.scale is not None
        if state.ids.is_cuda:
            stream = torch.cuda.current_stream(cdev)
            for t in state:
                if t is not None:
                    t.record_stream(stream)  # a refresh may free this generation while these reads run
        uniq, inv = torch.unique(flat.to(cdev), sorted=True, return_inverse=True)
        U, C = uniq.numel(), state.ids.numel()
        hit_u = None
        if C:
            pos = torch.searchsorted(state.ids, uniq).clamp_(max=C - 1)
            hit_u = state.ids.index_select(0, pos) == uniq
            n_hit_u = int(hit_u.sum())
            if n_hit_u == 0:
                hit_u = None
        if hit_u is None:  # every distinct id misses
            rows_u = gather_rows(bdata, uniq.to(bdata.device)).to(cdev)
            srows_u = row_scale.index_select(0, uniq.to(row_scale.device)).to(cdev) if row_scale is not None else None
            hits = 0
        else:
            # Every distinct id reads its slot (a miss reads a neighbour's, overwritten below).
            rows_u = gather_rows(state.data, pos)
            srows_u = state.scale.index_select(0, pos) if state.scale is not None and per_row else None
            hits = int(hit_u.index_select(0, inv).sum()) if n_hit_u < U else n
            if n_hit_u < U:
                miss = (~hit_u).nonzero().squeeze(1)
                miss_ids = uniq.index_select(0, miss)
                got = gather_rows(bdata, miss_ids.to(bdata.device)).to(cdev)
                dst, src = _word_views(rows_u, got)
                dst.index_copy_(0, miss, src)
                if srows_u is not None and row_scale is not None:
                    srows_u.index_copy_(0, miss, row_scale.index_select(0, miss_ids.to(row_scale.device)).to(cdev))
        fetched = U if hit_u is None else U - n_hit_u
        inv = inv.to(dev)
        rows_u = rows_u.to(dev)
        if self._scale_kind == "none" and out.dtype == bdata.dtype:
            gather_rows(rows_u, inv, out=out)
        else:
            rows = gather_rows(rows_u, inv)  # [N, D] stored rows
            scale_rows: torch.Tensor | None = None
            if srows_u is not None:
                scale_rows = srows_u.to(dev).index_select(0, inv)
            elif bscale is not None:
                scale_rows = bscale.to(dev)
            dequantize_rows_into(rows, scale_rows, out, format=self.format)
        with self._lock:
            self._hits += hits
            self._misses += n - hits
            self._fetched += fetched
