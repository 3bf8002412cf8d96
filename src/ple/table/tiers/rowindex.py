"""``RowIndex``: row id -> cache slot for row caches of tens of millions of slots, in two numpy arrays.

A Python dict of int keys costs about 120 bytes an entry at 23 million entries (its tables plus a
key and a value int object): more than the 90-byte q4_0 row it indexes, past what a memory budget
counts for bookkeeping, and every lookup walks it in a Python loop. This index is an open-addressing
hash table with linear probing: keys ``int64 [P]`` (row + 1; 0 empty, -1 deleted) and slots
(``int32 [P]`` below 2^31 slots), ``P`` the power of two at least twice the capacity (so at most
48 bytes a slot, and at most half full with live keys). The arrays are allocated zeroed: construction
writes nothing, and a page becomes resident when a key lands in it (hashed positions touch most pages
once a few percent of the capacity is used). Each call takes a batch of rows and runs numpy passes
over it, one a probe step, over the rows still unresolved.

A deleted key leaves a mark that probes walk past and inserts reuse; when marks and live keys would
fill three quarters of the table, it is rebuilt from the live keys (rare: the direct tier evicts a
sixteenth of its slots at a time).

Not thread-safe: the owner serializes calls (:class:`~ple.table.DirectTable` holds its cache lock).
"""

from __future__ import annotations

import numpy as np

from ple.errors import InvalidArgumentError

__all__ = ["RowIndex"]

_EMPTY = 0
_DELETED = -1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: Fibonacci hashing


class RowIndex:
    """Maps distinct row ids (int64 >= 0) to slots (ints in ``[0, capacity)``); holds at most
    ``capacity`` rows."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgumentError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        bits = max(4, (2 * capacity - 1).bit_length())
        self._shift = np.uint64(64 - bits)
        self._mask = (1 << bits) - 1
        self._keys = np.zeros(1 << bits, dtype=np.int64)
        self._slots = np.zeros(1 << bits, dtype=np.int32 if capacity <= 2**31 else np.int64)
        self._live = 0
        self._deleted = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the two arrays (resident as they are touched)."""
        return self._keys.nbytes + self._slots.nbytes

    def __len__(self) -> int:
        return self._live

    def _home(self, keys: np.ndarray) -> np.ndarray:
        """Each key's first probe position: the top bits of ``key * 2^64 / phi``."""
        h = keys.astype(np.uint64)
        with np.errstate(over="ignore"):
            h *= _GOLDEN
        h >>= self._shift
        return h.view(np.int64)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Table positions of ``keys [n]`` (row + 1), -1 where absent."""
        table = self._keys
        found = np.full(keys.size, -1, dtype=np.int64)
        todo = np.arange(keys.size)
        pos = self._home(keys)
        while todo.size:
            k = table[pos]
            hit = k == keys
            found[todo[hit]] = pos[hit]
            go = ~hit & (k != _EMPTY)
            todo, pos, keys = todo[go], (pos[go] + 1) & self._mask, keys[go]
        return found

    @staticmethod
    def _keys_of(rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and rows.min() < 0:
            raise InvalidArgumentError(f"row ids must be >= 0, got {int(rows.min())}")
        return rows + 1

    def get(self, rows: np.ndarray) -> np.ndarray:
        """The slots of ``rows [n]`` (int64 ``[n]``), -1 where a row is not indexed."""
        at = self._find(self._keys_of(rows))
        out = np.full(at.size, -1, dtype=np.int64)
        held = at >= 0
        out[held] = self._slots[at[held]]
        return out

    def __contains__(self, row: int) -> bool:
        return bool(self.get(np.array([row]))[0] >= 0)

    def put(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Index ``rows [n]`` (distinct, none of them indexed now) at ``slots [n]``."""
        keys = self._keys_of(rows)
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if keys.size != slots.size:
            raise InvalidArgumentError(f"{keys.size} rows but {slots.size} slots")
        if not keys.size:
            return
        if self._live + keys.size > self.capacity:
            raise InvalidArgumentError(f"{self._live} + {keys.size} rows exceed the index's capacity {self.capacity}")
        if (self._live + self._deleted + keys.size) * 4 > 3 * self._keys.size:
            self._rebuild()
        table, n, reused = self._keys, keys.size, 0
        pos = self._home(keys)
        while keys.size:
            k = table[pos]
            free = np.nonzero(k <= 0)[0]
            # keys asking for the same free position: all are written, one stays (the keys are
            # distinct, so reading back tells which); the others probe on
            table[pos[free]] = keys[free]
            win = free[table[pos[free]] == keys[free]]
            reused += int(np.count_nonzero(k[win] == _DELETED))
            self._slots[pos[win]] = slots[win]
            go = np.ones(keys.size, dtype=bool)
            go[win] = False
            keys, slots, pos = keys[go], slots[go], (pos[go] + 1) & self._mask
        self._live += n
        self._deleted -= reused

    def delete(self, rows: np.ndarray) -> None:
        """Drop ``rows [n]`` from the index (rows it does not hold are ignored)."""
        at = self._find(self._keys_of(rows))
        at = np.unique(at[at >= 0])
        self._keys[at] = _DELETED
        self._live -= at.size
        self._deleted += at.size

    def rows(self) -> np.ndarray:
        """The indexed rows, sorted."""
        return np.sort(self._keys[self._keys > 0]) - 1

    def _rebuild(self) -> None:
        """Rehash the live keys into a table without deletion marks."""
        live = self._keys > 0
        keys, slots = self._keys[live], self._slots[live].astype(np.int64)
        self._keys[:] = _EMPTY
        self._live = self._deleted = 0
        self.put(keys - 1, slots)
