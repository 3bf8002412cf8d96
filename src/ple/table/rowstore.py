"""Rows kept by id for a few of a table's rows: the store under adapters and row-sparse optimizers.

Training touches a small part of a table (real text: 0.46 % of the published table's rows per 200,000
tokens), so what training keeps per row (the trained value, an optimizer's moments) is kept for those
rows only, addressed by row id:

- :class:`RowMap`: the distinct row ids held, sorted (``keys [n]`` int64), and each one's slot
  (``slots [n]`` int64). Finding ``k`` ids is one ``searchsorted`` (``O(k log n)``); adding ``k``
  new ids merges two sorted arrays (``O(n + k log n)``, no sort of the whole). There is no dense
  id -> slot array: the published table has 320 million rows.
- :class:`SlotStore`: records of ``width`` values of one dtype by slot ``0 .. count-1``, slots
  given out in order. The first ``memory_budget`` bytes of records live in memory (one tensor,
  grown by doubling up to the budget); records beyond it live in a spill file in ``spill_dir``,
  mapped in chunks of :data:`SPILL_CHUNK` slots. The spill file has no name (``O_TMPFILE``, or a
  name removed as soon as it is opened): a process that dies leaves nothing behind, and what must
  outlive the process is saved on purpose (``ple.train``'s adapter files).

Neither is thread-safe by itself; their owners lock (:class:`ple.table.adapted.RowOverlay`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from pathlib import Path

import torch

from ..errors import InvalidArgumentError

__all__ = ["RowMap", "SlotStore", "SPILL_CHUNK", "unnamed_file"]

SPILL_CHUNK = 1 << 14
"""Slots per mapped chunk of a spill file (a multiple of 4,096, so every chunk starts on a page)."""

_EMPTY = torch.empty(0, dtype=torch.int64)


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
        # merge two sorted arrays: each key's new place is its old place plus how many of the other
        # array's keys sort before it
        new_at = torch.searchsorted(self.keys, ids) + torch.arange(k)
        old_at = torch.arange(n) + torch.searchsorted(ids, self.keys)
        keys = torch.empty(n + k, dtype=torch.int64)
        held = torch.empty(n + k, dtype=torch.int64)
        keys[old_at] = self.keys
        keys[new_at] = ids
        held[old_at] = self.slots
        held[new_at] = slots
        self.keys, self.slots = keys, held


class SlotStore:
    """Records ``[width]`` in ``dtype`` by slot, in memory up to ``memory_budget`` bytes and in a spill
    file beyond it (see the module docstring).

    Args:
        width: values per record (a row's ``head_dim``; an optimizer's states side by side).
        dtype: the records' dtype.
        memory_budget: bytes of records kept in memory; None: all of them.
        spill_dir: the folder of the spill file (default: the system's temporary folder); the file is
            made only when the records outgrow the budget.
    """

    def __init__(
        self,
        width: int,
        dtype: torch.dtype = torch.float32,
        *,
        memory_budget: int | None = None,
        spill_dir: str | os.PathLike | None = None,
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
        self.count = 0
        self._mem = torch.empty(0, width, dtype=dtype)
        self._fd = -1
        self._maps: list[mmap.mmap] = []
        self._chunks: list[torch.Tensor] = []

    # ------------------------------------------------------------------ sizes
    @property
    def memory_nbytes(self) -> int:
        """Bytes of records held in memory (the allocated part)."""
        return self._mem.numel() * self.dtype.itemsize

    @property
    def spilled_slots(self) -> int:
        """Slots that live in the spill file."""
        return max(0, self.count - self._mem_limit())

    def _mem_limit(self) -> int:
        return self.count if self.memory_slots is None else self.memory_slots

    # ------------------------------------------------------------------ growth
    def _reserve(self, n: int) -> None:
        limit = n if self.memory_slots is None else min(n, self.memory_slots)
        have = self._mem.shape[0]
        if limit > have:
            cap = max(limit, 2 * have, 64)
            if self.memory_slots is not None:
                cap = min(cap, self.memory_slots)
            grown = torch.empty(cap, self.width, dtype=self.dtype)
            grown[: self.count] = self._mem[: self.count]
            self._mem = grown
        if self.memory_slots is not None and n > self.memory_slots:
            need = -(-(n - self.memory_slots) // SPILL_CHUNK)
            while len(self._chunks) < need:
                self._map_chunk(len(self._chunks))

    def _map_chunk(self, c: int) -> None:
        if self._fd < 0:
            self._fd = unnamed_file(self.spill_dir)
        size = SPILL_CHUNK * self.record_nbytes
        os.ftruncate(self._fd, (c + 1) * size)
        m = mmap.mmap(self._fd, size, offset=c * size)
        self._maps.append(m)
        self._chunks.append(torch.frombuffer(m, dtype=self.dtype).view(SPILL_CHUNK, self.width))

    def append(self, values: torch.Tensor) -> torch.Tensor:
        """Store ``values [k, width]`` in ``k`` new slots; returns them (``[k]`` int64, consecutive)."""
        k = values.shape[0]
        start = self.count
        self._reserve(start + k)
        self.count = start + k
        slots = torch.arange(start, start + k, dtype=torch.int64)
        self.write(slots, values)
        return slots

    # ------------------------------------------------------------------ access
    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """``[k, width]``: the records of ``slots [k]`` (a copy)."""
        m = self._mem_limit()
        if self.spilled_slots == 0 or bool((slots < m).all()):
            return self._mem.index_select(0, slots)
        out = torch.empty(slots.numel(), self.width, dtype=self.dtype)
        inside = slots < m
        at = inside.nonzero().squeeze(1)
        out[at] = self._mem.index_select(0, slots[at])
        for where, chunk, offs in self._spilled(slots, ~inside, m):
            out[where] = chunk.index_select(0, offs)
        return out

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the records of ``slots [k]`` (distinct) with ``values [k, width]``."""
        values = values.to(self.dtype)
        m = self._mem_limit()
        if self.spilled_slots == 0 or bool((slots < m).all()):
            self._mem.index_copy_(0, slots, values)
            return
        inside = slots < m
        at = inside.nonzero().squeeze(1)
        self._mem.index_copy_(0, slots[at], values[at])
        for where, chunk, offs in self._spilled(slots, ~inside, m):
            chunk.index_copy_(0, offs, values[where])

    def _spilled(self, slots: torch.Tensor, outside: torch.Tensor, m: int):
        """``(positions, chunk tensor, offsets in it)`` for the spilled ``slots``, one chunk at a time."""
        where = outside.nonzero().squeeze(1)
        rel = slots[where] - m
        chunk_of = rel // SPILL_CHUNK
        order = torch.argsort(chunk_of, stable=True)
        where, rel, chunk_of = where[order], rel[order], chunk_of[order]
        present, counts = torch.unique_consecutive(chunk_of, return_counts=True)
        start = 0
        for c, n in zip(present.tolist(), counts.tolist(), strict=True):
            yield where[start : start + n], self._chunks[c], rel[start : start + n] - c * SPILL_CHUNK
            start += n

    def close(self) -> None:
        """Drop the records and the spill file (nothing is written anywhere)."""
        self._mem = torch.empty(0, self.width, dtype=self.dtype)
        self._chunks.clear()
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view handed out still maps it: freed with the view
                m.close()
        self._maps.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.count = 0

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


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
