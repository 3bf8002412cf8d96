"""Adapted tables: a few rows of a table replaced by rows of their own, the base left untouched.

Training a table changes the rows a corpus reads and no others, so what training produces is kept
apart from the table it started from:

- :class:`RowOverlay`: rows by id (``[n, head_dim]`` in fp32 or bf16), kept in a
  :class:`~ple.table.tiers.rowstore.SlotStore` (the recently used ones in memory up to a budget, the
  others in an unnamed spill file) behind a :class:`~ple.table.tiers.rowstore.RowMap`; guarded by a lock, so a lookup (or a
  prefetch's worker) never reads a row half-written by an optimizer step.
- :class:`AdaptedTable`: a table of any tier and format (``base``) with an overlay on top. A lookup
  returns the base's rows, except that the rows the overlay holds read ``overlay_row.to(dtype)``:
  bit-exact with the base's lookup on every other row. The base is read, never written, so one
  table file serves any number of adapted tables (one per adapter) and the plain model at once.

A table sharded across ranks is adapted under the sharding: each rank adapts its own rows
(``ShardedTable(local_table=AdaptedTable(local_base, overlay))``), and the sharded lookup serves
every rank's trained rows to every rank; an :class:`AdaptedTable` over a
:class:`~ple.table.ShardedTable` is refused.

The layer's engine call and ``torch.compile`` reach an adapted table as they reach any table,
through ``torch.ops.ple.table_lookup`` and the opaque ``TableRef``; swapping one adapter for another
(``layer.table = AdaptedTable(base, other)``) switches what compiled programs read without
recompiling.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator

import torch

from ple.errors import InvalidArgumentError, UsageError
from ple.table.base import Table
from ple.table.tiers.rowstore import RowMap, SlotStore
from ple.table.tiers.sharded import ShardedTable

__all__ = ["AdaptedTable", "RowOverlay", "OVERLAY_DTYPES"]

OVERLAY_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes an overlay keeps its rows in (training keeps fp32)."""

_SERIALS = itertools.count(1)


class RowOverlay:
    """Rows ``[head_dim]`` by row id in ``[0, rows)``, in ``dtype`` (see the module docstring).

    Args:
        rows: the table's row count (ids are checked against it).
        head_dim: the width of a row.
        dtype: ``torch.float32`` (training) or ``torch.bfloat16``.
        memory_budget: bytes of rows kept in memory (None: all), the recently used ones; the rest
            spill to an unnamed file in ``spill_dir`` (default: the system's temporary folder).
    """

    def __init__(
        self,
        rows: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        *,
        memory_budget: int | None = None,
        spill_dir=None,
    ) -> None:
        if dtype not in OVERLAY_DTYPES:
            raise InvalidArgumentError(f"an overlay keeps rows in float32 or bfloat16, got {dtype}")
        for name, v in (("rows", rows), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        self.rows = rows
        self.head_dim = head_dim
        self.dtype = dtype
        self._map = RowMap()
        self._store = SlotStore(
            head_dim, dtype, memory_budget=memory_budget, spill_dir=spill_dir, what="trained rows of a table"
        )
        self.lock = threading.RLock()
        self.version = 0
        """Counts the changes (a training run's steps, a load): what a saved file was made from."""
        self.serial = next(_SERIALS)
        """A number no other overlay made in this process has (what a prefix state records of its adapter);
        overlays made later have larger ones (a reader holding several locks takes them in this order)."""

    def __len__(self) -> int:
        return len(self._map)

    def __repr__(self) -> str:
        return (
            f"RowOverlay({len(self)} of {self.rows} rows x {self.head_dim}, {self.dtype}, "
            f"{self._store.spilled_slots} spilled)"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of rows held in memory (spilled rows not counted)."""
        return self._store.memory_nbytes + 16 * len(self)

    @property
    def spilled_rows(self) -> int:
        return self._store.spilled_slots

    @property
    def spill_traffic(self) -> tuple[int, int]:
        """Rows ``(read from, written to)`` the spill file so far."""
        return self._store.file_reads, self._store.file_writes

    def ids(self) -> torch.Tensor:
        """``[n]`` int64: the row ids held, sorted."""
        with self.lock:
            return self._map.keys.clone()

    # ------------------------------------------------------------------ reads
    def overwrite(self, flat_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Replace the rows ``out [k, head_dim]`` of the held ids among ``flat_ids [k]`` (CPU int64) by
        the overlay's rows cast to ``out.dtype``."""
        with self.lock:
            where, slots = self._map.find(flat_ids)
            if where.numel():
                out[where] = self._store.read(slots).to(out.dtype)

    def get(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(where [h], rows [h, head_dim])``: the positions of ``ids [k]`` held, and their rows."""
        with self.lock:
            where, slots = self._map.find(ids)
            return where, self._store.read(slots)

    def held_in_memory(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(ids [n], slots [n], rows [capacity, head_dim])``: the sorted ids held, their slots and the
        rows by slot, when every row is in memory (no budget), else None. For a reader that searches
        the ids itself (:meth:`ple.table.tiers.named.NamedAdapters.apply`); call under :attr:`lock`."""
        rows = self._store.memory_rows()
        return None if rows is None else (self._map.keys, self._map.slots, rows)

    def range(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [m], rows [m, head_dim])``: the held rows with ids in ``[start, stop)``, in id order."""
        with self.lock:
            keys = self._map.keys
            a = int(torch.searchsorted(keys, start)) if keys.numel() else 0
            b = int(torch.searchsorted(keys, stop)) if keys.numel() else 0
            return keys[a:b].clone(), self._store.read(self._map.slots[a:b])

    def chunks(self, size: int = 1 << 16) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(ids [m], rows [m, head_dim])`` in id order, ``size`` rows at a time (for saving).

        Each chunk is read under :attr:`lock`, which is never held across a ``yield`` (a consumer
        that stops or fails midway leaves no lock behind); a caller that wants every chunk from one
        version of the rows holds :attr:`lock` across the iteration itself. Rows added after the
        first chunk are not included; a :meth:`close` in between raises :class:`UsageError`."""
        with self.lock:
            held, keys, slots = self._map, self._map.keys, self._map.slots
        for a in range(0, keys.numel(), size):
            with self.lock:
                if self._map is not held:
                    raise UsageError("the overlay was closed while its rows were being read")
                rows = self._store.read(slots[a : a + size])
            yield keys[a : a + size].clone(), rows

    # ------------------------------------------------------------------ writes
    def slots_for(self, ids: torch.Tensor, init: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The slots of ``ids [k]`` (sorted, distinct, in range), adding the missing ones first with
        ``init(missing_ids [m]) -> [m, head_dim]`` as their rows. Call under :attr:`lock`."""
        slots = self._map.slots_of(ids)
        missing = (slots < 0).nonzero().squeeze(1)
        if missing.numel():
            new_ids = ids[missing]
            values = init(new_ids)
            if tuple(values.shape) != (new_ids.numel(), self.head_dim):
                raise InvalidArgumentError(
                    f"initial rows must be [{new_ids.numel()}, {self.head_dim}], got {tuple(values.shape)}"
                )
            new_slots = self._store.append(values)
            self._map.add(new_ids, new_slots)
            slots[missing] = new_slots
        return slots

    def presize(self, k: int) -> None:
        """Hold memory for ``k`` more rows at once (an adapter file's rows, about to be put): no copies
        while they are added, no room left unused."""
        with self.lock:
            self._store.presize(self._store.count + k)

    def reserve(self, k: int) -> None:
        """Make room for ``k`` more rows (the spill file's space, where rows spill), so that adding up to
        ``k`` rows and writing them cannot fail on a full disk: :class:`~ple.table.tiers.rowstore.SpillFileError`
        is raised here, before anything changes. Call under :attr:`lock`."""
        self._store.reserve(self._store.count + k)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """``[k, head_dim]``: the rows in ``slots`` (from :meth:`slots_for`). Call under :attr:`lock`."""
        return self._store.read(slots)

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the rows in ``slots`` (distinct). Call under :attr:`lock`."""
        self._store.write(slots, values)

    def put(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Set the rows of ``ids [k]`` (distinct, any order, in range) to ``values [k, head_dim]``."""
        ids = ids.reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.rows):
            raise InvalidArgumentError(
                f"overlay row ids must lie in [0, {self.rows}), got {int(ids.min())}..{int(ids.max())}"
            )
        if tuple(values.shape) != (ids.numel(), self.head_dim):
            raise InvalidArgumentError(f"rows must be [{ids.numel()}, {self.head_dim}], got {tuple(values.shape)}")
        order = torch.argsort(ids)
        ids, values = ids[order], values[order]
        if ids.numel() > 1 and bool((ids[1:] == ids[:-1]).any()):
            raise InvalidArgumentError("overlay row ids must be distinct")
        with self.lock:
            slots = self.slots_for(ids, lambda new: values.new_zeros(new.numel(), self.head_dim))
            self._store.write(slots, values)
            self.version += 1

    def close(self) -> None:
        """Drop the rows (and the spill file)."""
        with self.lock:
            self._map = RowMap()
            self._store.close()


class AdaptedTable(Table):
    """``base`` (a table of any tier and format) with the rows of ``overlay`` on top (see the module
    docstring). Format, rows and head_dim are the base's; ``backing`` is the base (what a layer reads
    a layout hash from). ``close()`` stops this table's prefetch worker and leaves the base open:
    removing an adapter is ``layer.table = adapted.base``.

    Args:
        base: the table underneath (not a :class:`~ple.table.ShardedTable`: adapt each rank's local
            table instead).
        overlay: a :class:`RowOverlay` of the base's geometry (default: a new empty fp32 one).
    """

    _unpicklable = "holds rows of its own that may live in an unnamed spill file (save them as an adapter file)"

    def __init__(self, base: Table, overlay: RowOverlay | None = None) -> None:
        if not isinstance(base, Table):
            raise InvalidArgumentError(f"base must be a ple Table, got {type(base).__name__}")
        if isinstance(base, ShardedTable):
            raise InvalidArgumentError(
                "an AdaptedTable over a ShardedTable is not served by the ranks that own the rows: adapt each "
                "rank's local table (ShardedTable(local_table=AdaptedTable(...)))"
            )
        if overlay is None:
            overlay = RowOverlay(base.rows, base.head_dim)
        if not isinstance(overlay, RowOverlay):
            raise InvalidArgumentError(f"overlay must be a RowOverlay, got {type(overlay).__name__}")
        if (overlay.rows, overlay.head_dim) != (base.rows, base.head_dim):
            raise InvalidArgumentError(
                f"the overlay is for [{overlay.rows}, {overlay.head_dim}] rows, the base table is "
                f"[{base.rows}, {base.head_dim}]"
            )
        super().__init__(base.format, base.rows, base.head_dim)
        self.base = base
        self.overlay = overlay

    @property
    def backing(self) -> Table:
        return self.base

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + self.overlay.nbytes

    def __repr__(self) -> str:
        return f"AdaptedTable({self.base!r}, {self.overlay!r})"

    def check_file(self) -> None:
        """The base's file check (see :meth:`ple.table.MmapTable.check_file`), where it has one."""
        check = getattr(self.base, "check_file", None)
        if check is not None:
            check()

    def _gathers_on_device(self, device: torch.device) -> bool:
        return False  # the overlay's rows are on the host

    def _lookup_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        self.base._lookup_into(ids, out)
        if len(self.overlay) == 0:
            return
        flat = ids.reshape(-1)
        rows = out.view(-1, self.head_dim)
        if flat.device.type == "cpu":
            self.overlay.overwrite(flat, rows)
            return
        where, values = self.overlay.get(flat.cpu())
        if where.numel():
            rows[where.to(rows.device)] = values.to(device=rows.device, dtype=rows.dtype)
