"""Rows kept by id for a few of a table's rows: the store under adapters and row-sparse optimizers.

Training touches a small part of a table (real text: 0.46 % of the published table's rows per 200,000
tokens), so what training keeps per row (the trained value, an optimizer's moments) is kept for those
rows only, addressed by row id:

- :class:`RowMap`: the distinct row ids held, sorted (``keys [n]`` int64), and each one's slot
  (``slots [n]`` int64). Finding ``k`` ids is one ``searchsorted`` (``O(k log n)``); adding ``k``
  new ids merges two sorted arrays (``O(n + k log n)``, no sort of the whole). There is no dense
  id -> slot array: the published table has 320 million rows.
- :class:`SlotStore`: records of ``width`` values of one dtype by slot ``0 .. count-1``, slots
  given out in order. Up to ``memory_budget`` bytes of records live in memory (frames of one
  tensor, grown by doubling up to the budget): the records used most recently (least recently used
  ones leave first: real text reuses a few rows often, so they stay); the others live in a spill
  file in ``spill_dir``, mapped whole (slot ``s`` at record ``s``). The spill file has no name
  (``O_TMPFILE``, or a name removed as soon as it is opened): a process that dies leaves nothing
  behind, and what must outlive the process is saved on purpose (``ple.train``'s adapter files).

The spill file's space is allocated (``posix_fallocate``) before any record is written through
its map, so a full disk or a file size limit raises :class:`SpillFileError` (naming the folder and
what to do) instead of killing the process with ``SIGBUS``. Once records can leave memory
(more slots than frames), the file always has room for every slot: a call that adds slots
(:meth:`SlotStore.append`, :meth:`SlotStore.reserve`) grows it first, before anything changes, and
no other call ever grows it. A store fails whole or not at all.

Across ``fork()`` (:mod:`ple.table.forks`) the spill file is shared by both processes, so after a
fork neither writes it again: the first write of each process (the parent's and every child's)
copies the records to a file of its own first. Each process then trains its own copy, and reads
before that first write see the records of the fork. The cost: one copy of the records in use per
fork and process that writes after it (a training loop whose DataLoader forks workers each epoch
copies its spill files once per epoch), and their disk space until the other processes end.

Neither is thread-safe by itself; their owners lock (:class:`ple.table.tiers.adapted.RowOverlay`).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from ple.errors import InvalidArgumentError, PLEError
from ple.table import forks

__all__ = ["RowMap", "SlotStore", "SpillFileError", "SPILL_CHUNK", "unnamed_file"]


class SpillFileError(PLEError, OSError):
    """A spill file could not be made, grown or copied (the disk full, a file size limit): the
    message names the folder and what to do; the store is as it was before the call."""


SPILL_CHUNK = 1 << 14
"""A spill file grows by whole multiples of this many slots (doubling, mapped again as it grows)."""

_EMPTY = torch.empty(0, dtype=torch.int64)
_SMALL_FIND = 8192
"""Lookups of at most this many ids search in numpy (PyTorch's per-call cost dominates there)."""


class RowMap:
    """Sorted distinct row ids and the slot of each (see the module docstring)."""

    def __init__(self) -> None:
        self.keys = _EMPTY
        self.slots = _EMPTY

    def __len__(self) -> int:
        return self.keys.numel()

    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For ``ids [k]`` int64 (any order, repeats allowed): ``(where [h], slots [h])``, the positions
        of ``ids`` that are held and their slots."""
        n = self.keys.numel()
        if n == 0 or ids.numel() == 0:
            return _EMPTY, _EMPTY
        ids = ids.contiguous()
        if ids.numel() <= _SMALL_FIND and ids.device.type == "cpu" and ids.dtype == torch.int64:
            # a few ids (a decode step's): the same search in numpy, a few microseconds instead of tens
            keys, want = self.keys.numpy(), ids.numpy()
            at = np.searchsorted(keys, want)
            np.minimum(at, n - 1, out=at)
            hit = np.flatnonzero(keys[at] == want)
            return torch.from_numpy(hit), torch.from_numpy(self.slots.numpy()[at[hit]])
        pos = torch.searchsorted(self.keys, ids).clamp_(max=n - 1)
        where = (self.keys[pos] == ids).nonzero().squeeze(1)
        return where, self.slots[pos[where]]

    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """``[k]`` int64: the slot of each of ``ids [k]``, -1 where an id is not held."""
        out = torch.full((ids.numel(),), -1, dtype=torch.int64)
        where, slots = self.find(ids)
        out[where] = slots
        return out

    def add(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Hold ``ids [k]`` (sorted, distinct, none held yet) at ``slots [k]``."""
        k = ids.numel()
        if k == 0:
            return
        n = self.keys.numel()
        if n == 0:
            self.keys, self.slots = ids.clone(), slots.clone()
            return
        # merge two sorted arrays: a new key's place is its place among the old keys plus the new keys
        # before it; the old keys fill the other places in order
        new_at = torch.searchsorted(self.keys, ids) + torch.arange(k)
        old = torch.ones(n + k, dtype=torch.bool)
        old[new_at] = False
        keys = torch.empty(n + k, dtype=torch.int64)
        held = torch.empty(n + k, dtype=torch.int64)
        keys.masked_scatter_(old, self.keys)
        keys[new_at] = ids
        held.masked_scatter_(old, self.slots)
        held[new_at] = slots
        self.keys, self.slots = keys, held


class SlotStore:
    """Records ``[width]`` in ``dtype`` by slot, the recently used ones in memory up to
    ``memory_budget`` bytes and the others in a spill file (see the module docstring).

    Args:
        width: values per record (a row's ``head_dim``; an optimizer's states side by side).
        dtype: the records' dtype.
        memory_budget: bytes of records kept in memory; None: all of them.
        spill_dir: the folder of the spill file (default: the system's temporary folder); the file is
            made only when a record must leave memory.
        recency: keep the records used last in memory (True), or the first ones made (False: records
            made once memory is full go to the spill file and stay there; for comparison).
        what: what the records are, for messages ("trained rows", "optimizer states").

    With a budget, memory holds ``memory_budget // record bytes`` frames. A call (:meth:`read`,
    :meth:`write`, :meth:`append`) uses its slots: a slot in a frame is served there; one that is not
    is given a frame, a free one or else the frame used longest ago (least recently used, by call;
    the frames this call uses are never taken), whose record is written back to the spill file when
    it changed since it was read from there; what does not fit (a call of more slots than frames) is
    read and written in the spill file directly. The spill file holds slot ``s`` at record ``s``.
    The records read back are the bytes written: where a record lives never changes its value.
    ``file_reads`` / ``file_writes`` count the records moved from / to the spill file.
    """

    def __init__(
        self,
        width: int,
        dtype: torch.dtype = torch.float32,
        *,
        memory_budget: int | None = None,
        spill_dir: str | os.PathLike | None = None,
        recency: bool = True,
        what: str = "records",
    ) -> None:
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise InvalidArgumentError(f"width must be an int >= 1, got {width!r}")
        if memory_budget is not None and (
            isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 0
        ):
            raise InvalidArgumentError(f"memory_budget must be an int >= 0 (bytes) or None, got {memory_budget!r}")
        self.width = width
        self.dtype = dtype
        self.record_nbytes = width * dtype.itemsize
        self.memory_slots: int | None = None if memory_budget is None else memory_budget // self.record_nbytes
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.recency = bool(recency)
        self.what = what
        self.count = 0
        self.file_reads = 0
        self.file_writes = 0
        self._mem = torch.empty(0, width, dtype=dtype)  # the frames (without a budget: slot s in frame s)
        self._frames = 0  # frames in use
        self._frame_of = torch.empty(0, dtype=torch.int64)  # per slot: its frame, or -1 (with a budget)
        self._slot_at = torch.empty(0, dtype=torch.int64)  # per frame: its slot
        self._used = torch.empty(0, dtype=torch.int64)  # per frame: the call that used it last
        self._dirty = torch.empty(0, dtype=torch.bool)  # per frame: changed since read from the file
        self._tick = 0
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._file = torch.empty(0, width, dtype=dtype)  # the spill file's records, mapped
        self._file_lock = threading.Lock()  # held while the spill file is written, grown or copied
        self._shared = False  # the spill file is shared with a process forked since: copy before writing

    # ------------------------------------------------------------------ sizes
    @property
    def memory_nbytes(self) -> int:
        """Bytes of records held in memory (the allocated frames)."""
        return self._mem.numel() * self.dtype.itemsize

    @property
    def spilled_slots(self) -> int:
        """Slots whose record is in the spill file only (not in a frame)."""
        return self.count - (self.count if self.memory_slots is None else self._frames)

    # ------------------------------------------------------------------ growth
    def _grow(self, t: torch.Tensor, n: int, fill) -> torch.Tensor:
        if t.shape[0] >= n:
            return t
        cap = max(n, 2 * t.shape[0], 64)
        grown = torch.full((cap, *t.shape[1:]), fill, dtype=t.dtype)
        grown[: t.shape[0]] = t
        return grown

    def _grow_frames(self, n: int) -> None:
        have = self._mem.shape[0]
        if n <= have:
            return
        cap = max(n, 2 * have, 64)
        if self.memory_slots is not None:
            cap = min(cap, self.memory_slots)
            self._slot_at = self._grow(self._slot_at, cap, -1)
            self._used = self._grow(self._used, cap, 0)
            self._dirty = self._grow(self._dirty, cap, False)
        grown = torch.empty(cap, self.width, dtype=self.dtype)
        grown[:have] = self._mem
        self._mem = grown

    def memory_rows(self) -> torch.Tensor | None:
        """``[capacity, width]``: every record by slot, when all are held in memory (no budget), else
        None. The tensor is replaced when the store grows: read it under the owner's lock."""
        return self._mem if self.memory_slots is None else None

    def presize(self, n: int) -> None:
        """Hold room in memory for ``n`` records at once (a store about to take that many), so that
        appending them copies nothing and leaves no unused room; with a memory budget, nothing."""
        if self.memory_slots is None:
            self._grow_frames(n)

    def reserve(self, n: int) -> None:
        """Make sure slots ``0 .. n-1`` can live in the spill file when they must leave memory: with a
        budget of fewer than ``n`` frames, the file is grown (its space allocated) to ``n`` records at
        least. Raises :class:`SpillFileError` and changes nothing when the disk has no room."""
        if self.memory_slots is not None and n > self.memory_slots and (n > self._file.shape[0] or self._shared):
            with self._file_lock:
                self._writable(n)

    def _writable(self, n: int) -> torch.Tensor:
        """The spill file as ``[capacity, width]`` records, ``capacity >= n``, for writing: this
        process's own (copied first after a fork), made on first use, grown by doubling (in whole
        :data:`SPILL_CHUNK` slots; the size needed alone when the doubled one finds no room) and
        mapped again. Call under ``_file_lock``."""
        if self._shared:
            self._own_copy()
        have = self._file.shape[0]
        if n <= have:
            return self._file
        if self._fd < 0:
            try:
                self._fd = unnamed_file(self.spill_dir)
            except OSError as e:
                raise self._no_room(e, "make the spill file") from None
            forks.track(self)
        chunks = -(-max(n, SPILL_CHUNK) // SPILL_CHUNK) * SPILL_CHUNK
        doubled = -(-max(n, 2 * have, SPILL_CHUNK) // SPILL_CHUNK) * SPILL_CHUNK
        for cap in (doubled, chunks) if doubled > chunks else (doubled,):
            try:
                _allocate(self._fd, have * self.record_nbytes, cap * self.record_nbytes)
                break
            except OSError as e:
                if cap == chunks or e.errno not in _NO_ROOM:
                    raise self._no_room(e, f"grow the spill file to {cap * self.record_nbytes} bytes") from None
        m = mmap.mmap(self._fd, cap * self.record_nbytes)
        self._drop_map()
        self._map = m
        self._file = torch.frombuffer(m, dtype=self.dtype).view(cap, self.width)
        return self._file

    def _own_copy(self) -> None:
        """After a fork: copy the shared spill file's records to a new file of this process's own."""
        cap = self._file.shape[0]
        used = min(self.count, cap)
        try:
            fd = unnamed_file(self.spill_dir)
        except OSError as e:
            raise self._no_room(e, "copy the spill file after fork()") from None
        try:
            _allocate(fd, 0, cap * self.record_nbytes)
            m = mmap.mmap(fd, cap * self.record_nbytes) if cap else None
            copy = torch.frombuffer(m, dtype=self.dtype).view(cap, self.width) if m is not None else self._file
            copy[:used] = self._file[:used]
        except OSError as e:
            os.close(fd)
            raise self._no_room(e, "copy the spill file after fork()") from None
        except BaseException:
            os.close(fd)
            raise
        self._drop_map()
        os.close(self._fd)
        self._fd, self._map, self._file = fd, m, copy
        self._shared = False

    def _no_room(self, e: OSError, doing: str) -> SpillFileError:
        folder = self.spill_dir if self.spill_dir is not None else Path(tempfile.gettempdir())
        what = f"spilling {self.what} ({self.count} held) to {folder}: could not {doing}: {e.strerror or e}"
        if e.errno in _NO_ROOM:
            what += (
                "; free space there, pass spill_dir= a folder on a disk with room (ple.train.trainable, the "
                "optimizer), or a larger memory_budget= to keep more of them in memory"
            )
        return SpillFileError(e.errno or errno.EIO, what, os.fspath(folder))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_file_lock"]  # a lock is not copied: the copy gets its own
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._file_lock = threading.Lock()

    # ------------------------------------------------------------------ fork (ple.table.forks)
    def _fork_locks(self) -> list[threading.Lock]:
        return [self._file_lock]

    def _after_fork_in_child(self) -> None:
        self._shared = self._fd >= 0

    def _after_fork_in_parent(self) -> None:
        self._shared = self._fd >= 0

    def _drop_map(self) -> None:
        self._file = torch.empty(0, self.width, dtype=self.dtype)
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still maps it: unmapped with the view
                self._map.close()
            self._map = None

    def append(self, values: torch.Tensor) -> torch.Tensor:
        """Store ``values [k, width]`` in ``k`` new slots; returns them (``[k]`` int64, consecutive)."""
        k = values.shape[0]
        start = self.count
        self.count = start + k
        slots = torch.arange(start, start + k, dtype=torch.int64)
        try:
            self.reserve(start + k)
        except BaseException:
            self.count = start
            raise
        if self.memory_slots is None:
            self._grow_frames(self.count)
            self._frames = self.count
        else:
            self._frame_of = self._grow(self._frame_of, self.count, -1)
        self.write(slots, values)
        return slots

    # ------------------------------------------------------------------ frames
    def _place(self, slots: torch.Tensor, load: bool) -> torch.Tensor:
        """The frame of each of ``slots [k]`` (distinct), giving frames to those without one (see the
        class docstring), their records read from the spill file when ``load``; -1 where none fits."""
        if self._shared:  # evictions below write the file: this process's own copy first, before any change
            with self._file_lock:
                self._writable(0)
        self._tick += 1
        tick = self._tick
        frames = self._frame_of.index_select(0, slots)
        hit = frames >= 0
        if self.recency:
            self._used[frames[hit]] = tick
        missing = (~hit).nonzero().squeeze(1)
        if missing.numel() == 0:
            return frames
        assert self.memory_slots is not None
        free = min(self.memory_slots - self._frames, missing.numel())
        given = torch.arange(self._frames, self._frames + free, dtype=torch.int64)
        if free:
            self._grow_frames(self._frames + free)
            self._frames += free
            self._used[given] = tick  # not to be taken again below
        more = missing.numel() - free
        if more and self.recency and self._frames:
            older = self._used[: self._frames] < tick  # frames this call does not use
            take = min(more, int(older.sum()))
            if take:
                ages = torch.where(older, self._used[: self._frames], tick)
                victims = torch.topk(ages, take, largest=False, sorted=False).indices
                self._evict(victims)
                given = torch.cat([given, victims])
        if given.numel() == 0:
            return frames
        placed = missing[: given.numel()]
        new_slots = slots[placed]
        if load:
            self._mem[given] = self._file_read(new_slots)
        self._frame_of[new_slots] = given
        self._slot_at[given] = new_slots
        self._used[given] = tick
        self._dirty[given] = False
        frames[placed] = given
        return frames

    def _evict(self, victims: torch.Tensor) -> None:
        """Write the changed records of frames ``victims`` back to the spill file; their slots lose them."""
        slots = self._slot_at[victims]
        dirty = self._dirty[victims]
        if bool(dirty.any()):
            self._file_write(slots[dirty], self._mem[victims[dirty]])
        self._frame_of[slots] = -1

    # ------------------------------------------------------------------ the spill file
    def _file_read(self, slots: torch.Tensor) -> torch.Tensor:
        if slots.numel() == 0:
            return torch.empty(0, self.width, dtype=self.dtype)
        n = int(slots.max()) + 1
        if n > self._file.shape[0]:  # never after reserve(): every slot has its record's room
            with self._file_lock:
                self._writable(n)
        self.file_reads += slots.numel()
        return self._file.index_select(0, slots)

    def _file_write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        if slots.numel():
            with self._file_lock:
                self._writable(int(slots.max()) + 1).index_copy_(0, slots, values)
            self.file_writes += slots.numel()

    # ------------------------------------------------------------------ access
    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """``[k, width]``: the records of ``slots [k]`` (repeats allowed; a copy)."""
        if self.memory_slots is None:
            return self._mem.index_select(0, slots)
        if slots.numel() > 1:
            distinct, inverse = torch.unique(slots, return_inverse=True)
            if distinct.numel() < slots.numel():
                return self.read(distinct).index_select(0, inverse)
        frames = self._place(slots, load=True)
        inside = frames >= 0
        if bool(inside.all()):
            return self._mem.index_select(0, frames)
        out = torch.empty(slots.numel(), self.width, dtype=self.dtype)
        at = inside.nonzero().squeeze(1)
        out[at] = self._mem.index_select(0, frames[at])
        outside = (~inside).nonzero().squeeze(1)
        out[outside] = self._file_read(slots[outside])
        return out

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the records of ``slots [k]`` (distinct) with ``values [k, width]``."""
        values = values.to(self.dtype)
        if self.memory_slots is None:
            self._mem.index_copy_(0, slots, values)
            return
        frames = self._place(slots, load=False)
        inside = frames >= 0
        if bool(inside.all()):
            self._mem.index_copy_(0, frames, values)
            self._dirty[frames] = True
            return
        at = inside.nonzero().squeeze(1)
        self._mem.index_copy_(0, frames[at], values[at])
        self._dirty[frames[at]] = True
        outside = (~inside).nonzero().squeeze(1)
        self._file_write(slots[outside], values[outside])

    def close(self) -> None:
        """Drop the records and the spill file (nothing is written anywhere)."""
        self._mem = torch.empty(0, self.width, dtype=self.dtype)
        self._frame_of = self._slot_at = self._used = torch.empty(0, dtype=torch.int64)
        self._dirty = torch.empty(0, dtype=torch.bool)
        self._frames = 0
        self._drop_map()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._shared = False
        self.count = 0

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


_NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)


def _allocate(fd: int, start: int, stop: int) -> None:
    """Give bytes ``[start, stop)`` of the file ``fd`` their disk space (the file grows to ``stop``), so
    writes through a map of them cannot fail; on failure the file is cut back to ``start`` bytes."""
    if stop <= start:
        return
    try:
        try:
            os.posix_fallocate(fd, start, stop - start)
            return
        except AttributeError:  # pragma: no cover - no posix_fallocate here
            pass
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
        zeros = bytes(1 << 20)  # a file system that cannot allocate: write the zeros
        at = start
        while at < stop:
            at += os.pwrite(fd, zeros[: stop - at], at)
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


def unnamed_file(folder: str | os.PathLike | None) -> int:
    """A read-write file descriptor of a new file in ``folder`` that no name leads to (removed at once)."""
    folder = Path(tempfile.gettempdir()) if folder is None else Path(folder)
    if not folder.is_dir():
        raise InvalidArgumentError(f"spill_dir {folder} is not a folder")
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            return os.open(folder, flags | tmpfile, 0o600)
        except OSError:
            pass  # a file system without unnamed files: a named one, removed at once
    fd, name = tempfile.mkstemp(prefix=".ple-spill-", dir=folder)
    os.unlink(name)
    return fd
