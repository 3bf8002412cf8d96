"""Named adapters: several adapters served over one base table at once, chosen per sequence.

A layer serves its table (``layer.table``: the base, or the base with the model's *default* adapter on
top, an :class:`~ple.table.tiers.adapted.AdaptedTable`) to every sequence that names no adapter. Named
adapters (:class:`NamedAdapters`, held by the layer's :class:`~ple.table.base.TableRef` as
``ref.adapters``) sit over the base alone, never over the default: a sequence that names adapter ``k``
reads adapter ``k``'s row where ``k`` holds one and the base's elsewhere, bit for bit what a model
serving ``k`` as its default reads.

The engine call's :class:`~ple.runtime.Batch` says which sequence reads which
(``adapter_indices [R]`` int64, ``-1`` for the default); the lookup operator reads the table as
always, then :meth:`NamedAdapters.apply` puts the named adapters' rows (and the base's rows under
the default adapter's) in place for the sequences that name one. An index is a number the adapter
keeps while it is loaded (the smallest free one at load); names and indices are the same on every
layer of a model (:mod:`ple.train.serve` loads and removes them).

Loading, removing and serving may run on different threads: the set of adapters is replaced, never
changed in place, so a lookup sees the set as it was when it started; an adapter's rows are read
under its overlay's lock. Live requests pin their adapter (:meth:`NamedAdapters.pin`): removing an
adapter a request still names is refused.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import weakref
from collections.abc import Hashable

import numpy as np
import torch

from ple.errors import InvalidArgumentError, UsageError
from ple.kernels import native as _native
from ple.table.base import Table
from ple.table.forks import track
from ple.table.tiers.adapted import AdaptedTable, RowOverlay

__all__ = ["ADAPTER_CHANGES", "DEFAULT_ADAPTER", "NamedAdapter", "NamedAdapters", "adapter_index", "served_adapters"]

ADAPTER_CHANGES = threading.RLock()
"""Held while named adapters are loaded or removed, and while a request chooses one (so that an adapter
cannot go between a request's choice and its pin). Lookups never take it."""


class _Changes:
    """:data:`ADAPTER_CHANGES` across ``fork()`` (:mod:`ple.table.forks`): a fork waits for a load or
    removal being installed. Tracked at import, before any overlay: taken first, as the code takes it."""

    def _fork_locks(self) -> list:
        return [ADAPTER_CHANGES]

    def _after_fork_in_child(self) -> None:
        pass


_CHANGES_AT_FORK = _Changes()
track(_CHANGES_AT_FORK)

DEFAULT_ADAPTER = -1
"""The adapter index of a sequence that names none: the layer's table as it is (its default adapter, if any)."""


@dataclasses.dataclass(frozen=True)
class NamedAdapter:
    """One named adapter of a layer: its ``name``, ``index`` (what batches carry) and rows (``overlay``,
    whose ``serial`` no other adapter loaded in the process has)."""

    name: str
    index: int
    overlay: RowOverlay


class NamedAdapters:
    """The named adapters of one layer, over ``base`` (see the module docstring)."""

    def __init__(self, base: Table) -> None:
        self.base = base
        self._by_index: dict[int, NamedAdapter] = {}  # replaced on every change, never mutated
        self._lock = threading.Lock()
        self._pins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> {request: index}
        track(self)  # a fork waits for a change of the set or of the pins in progress

    def _fork_locks(self) -> list:
        return [self._lock]

    def _after_fork_in_child(self) -> None:
        pass

    # ------------------------------------------------------------------ the set
    def __len__(self) -> int:
        return len(self._by_index)

    def __repr__(self) -> str:
        names = ", ".join(f"{a.index}:{a.name}" for a in self.entries())
        return f"NamedAdapters({names})"

    def entries(self) -> list[NamedAdapter]:
        """The adapters in index order."""
        held = self._by_index
        return [held[i] for i in sorted(held)]

    def get(self, index: int) -> NamedAdapter | None:
        return self._by_index.get(index)

    def find(self, name: str) -> NamedAdapter | None:
        for a in self._by_index.values():
            if a.name == name:
                return a
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of the adapters' rows held in memory (spilled rows not counted)."""
        return sum(a.overlay.nbytes for a in self._by_index.values())

    def add(self, adapter: NamedAdapter) -> None:
        """Serve ``adapter`` (its name and index free here)."""
        with self._lock:
            if adapter.index in self._by_index or self.find(adapter.name) is not None:
                raise UsageError(f"adapter {adapter.name!r} (index {adapter.index}) is already served here")
            self._by_index = {**self._by_index, adapter.index: adapter}

    def remove(self, name: str) -> NamedAdapter:
        """Stop serving adapter ``name`` and return it (its rows stay open: the caller closes them)."""
        with self._lock:
            found = self.find(name)
            if found is None:
                raise InvalidArgumentError(f"no adapter named {name!r} is served (served: {self.names()})")
            self._by_index = {i: a for i, a in self._by_index.items() if i != found.index}
            return found

    def names(self) -> list[str]:
        return [a.name for a in self.entries()]

    # ------------------------------------------------------------------ live requests
    def pin(self, owner: object, request: Hashable, index: int) -> None:
        """Record that ``owner``'s live request ``request`` reads adapter ``index``."""
        with self._lock:
            self._pins.setdefault(owner, {})[request] = index

    def unpin(self, owner: object, request: Hashable) -> None:
        with self._lock:
            held = self._pins.get(owner)
            if held is not None:
                held.pop(request, None)

    def requests_of(self, index: int) -> list[Hashable]:
        """The live requests (of every owner) that read adapter ``index``."""
        with self._lock:
            return [r for held in self._pins.values() for r, i in held.items() if i == index]

    # ------------------------------------------------------------------ reads
    def apply(
        self, table: Table, ids: torch.Tensor, rows: torch.Tensor, chosen: np.ndarray, starts: np.ndarray
    ) -> None:
        """Put the named adapters' rows in place: ``rows [T, G*D]`` were read for ``ids [T, G]`` from
        ``table`` (the layer's table: this set's base, or an :class:`AdaptedTable` over it); ``chosen
        [R]`` (each sequence's adapter index, -1: the default, left as read) and ``starts [R+1]`` (its
        tokens) as :func:`ple.table.base.adapter_choice` gives them, checked."""
        held = self._by_index
        named = np.unique(chosen[chosen >= 0]).tolist()
        for k in named:
            if k not in held:
                raise InvalidArgumentError(
                    f"adapter index {k} is not served by this layer (served: "
                    f"{', '.join(f'{a.index}:{a.name}' for a in self.entries()) or 'none'})"
                )
        over = table.base if isinstance(table, AdaptedTable) else table
        if over is not self.base:
            raise UsageError(
                f"the named adapters were loaded over {self.base!r}, but the layer now serves {over!r}: load them "
                "again over the new table"
            )
        tokens, groups = ids.shape
        if not tokens or not named:
            return
        # each id's adapter (its token's request's), the ids and the rows flat: [T*G] and [T*G, D]
        per_id = np.repeat(chosen, np.diff(starts) * groups)
        flat = (ids if ids.device.type == "cpu" else ids.cpu()).reshape(-1).numpy()
        out = rows.view(tokens * groups, rows.shape[1] // groups)
        if isinstance(table, AdaptedTable) and len(table.overlay):
            # ids of a named adapter's tokens read the base where the default adapter holds a row
            mine = np.flatnonzero(per_id >= 0)
            where, _ = table.overlay.get(torch.from_numpy(flat[mine]))
            if where.numel():
                at = mine[where.numpy()]
                base_rows = self.base.lookup(torch.from_numpy(flat[at]).view(-1, 1).to(ids.device), rows.dtype)
                self._put(out, at, base_rows)
        if self._native_rows(named, held, flat, per_id, out):
            return
        places, values = [], []
        for k in named:
            mine = np.flatnonzero(per_id == k)
            where, got = held[k].overlay.get(torch.from_numpy(flat[mine]))
            if where.numel():
                places.append(mine[where.numpy()])
                values.append(got)
        if places:
            self._put(out, np.concatenate(places), torch.cat(values) if len(values) > 1 else values[0])

    @staticmethod
    def _native_rows(named: list[int], held: dict, flat: np.ndarray, per_id: np.ndarray, out: torch.Tensor) -> bool:
        """The named rows put in place by one C call (``ple_overlay_rows``: every id searched in its
        adapter's ids, its row copied), when ``out`` is a contiguous host tensor and every adapter holds
        all its rows in memory in ``out``'s dtype; False (nothing written) otherwise."""
        if out.device.type != "cpu" or not out.is_contiguous() or not _native.available():
            return False
        overlays = [held[k].overlay for k in named]
        if any(o.dtype != out.dtype for o in overlays):
            return False
        count = max(named) + 1
        locks = [o.lock for o in sorted(overlays, key=lambda o: o.serial)]  # one order for every reader
        for lock in locks:
            lock.acquire()
        try:
            views = [o.held_in_memory() for o in overlays]
            if any(v is None for v in views):
                return False
            keys, counts, slots, rows, capacity = (
                (ctypes.c_void_p * count)(),
                np.zeros(count, np.int64),
                (ctypes.c_void_p * count)(),
                (ctypes.c_void_p * count)(),
                np.zeros(count, np.int64),
            )
            for k, (ids, at, mem) in zip(named, views):
                keys[k], slots[k], rows[k] = ids.data_ptr(), at.data_ptr(), mem.data_ptr()
                counts[k], capacity[k] = ids.numel(), mem.shape[0]
            want = np.ascontiguousarray(flat, dtype=np.int64)
            which = np.ascontiguousarray(per_id, dtype=np.int64)
            got = _native.library().ple_overlay_rows(
                want.size, want.ctypes.data, which.ctypes.data, count, keys, counts.ctypes.data, slots, rows,
                capacity.ctypes.data, out.shape[1] * out.element_size(), out.data_ptr(),
            )  # fmt: skip
        finally:
            for lock in reversed(locks):
                lock.release()
        if got < 0:
            raise InvalidArgumentError(f"named adapters: the C row copy refused its arguments (code {got})")
        return True

    @staticmethod
    def _put(out: torch.Tensor, places: np.ndarray, values: torch.Tensor) -> None:
        """``out[places] = values`` (``out [T*G, D]``, ``places`` distinct)."""
        dev = out.device
        out.index_copy_(0, torch.from_numpy(places).to(dev), values.to(device=dev, dtype=out.dtype))


def served_adapters(refs) -> dict[str, int]:
    """``{name: index}`` of the named adapters any of ``refs`` (:class:`~ple.table.base.TableRef`) serves,
    in index order."""
    out: dict[str, int] = {}
    for ref in refs:
        held = ref.adapters
        for a in held.entries() if held is not None else ():
            out[a.name] = a.index
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def adapter_index(refs, name: str) -> int:
    """The index of named adapter ``name`` on every one of ``refs`` (the layers' table references): what
    a batch's ``adapter_indices`` carries. :class:`InvalidArgumentError` naming the served adapters when
    one of them does not serve it."""
    refs = list(refs)
    found: set[int] = set()
    for ref in refs:
        held = ref.adapters
        entry = held.find(name) if held is not None and isinstance(name, str) else None
        if entry is None:
            served = ", ".join(served_adapters(refs)) or "none"
            raise InvalidArgumentError(f"unknown adapter {name!r} (served: {served})")
        found.add(entry.index)
    if len(found) != 1:
        raise InvalidArgumentError(f"adapter {name!r} has different indices on the layers: {sorted(found)}")
    return found.pop()
