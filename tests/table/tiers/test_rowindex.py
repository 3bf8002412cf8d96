"""RowIndex (row id -> cache slot in numpy arrays) against a dict, and the direct tier's cache within its budget."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest
import torch

from ple.errors import InvalidArgumentError
from ple.table import DirectTable, MemoryTable
from ple.table.tiers.direct import SLOT_OVERHEAD
from ple.table.tiers.rowindex import RowIndex
from tests.table._helpers import assert_same, make_table, random_ids, write_file


def _check(index: RowIndex, oracle: dict[int, int], probe: np.ndarray) -> None:
    want = np.array([oracle.get(int(r), -1) for r in probe], dtype=np.int64)
    assert np.array_equal(index.get(probe), want)
    assert len(index) == len(oracle)
    assert np.array_equal(index.rows(), np.array(sorted(oracle), dtype=np.int64))


@pytest.mark.parametrize("capacity", [1, 7, 1000, 50_000])
def test_random_puts_and_deletes_agree_with_a_dict(capacity):
    g = np.random.default_rng(capacity)
    index, oracle = RowIndex(capacity), {}
    free = list(range(capacity))
    universe = 4 * capacity + 10  # rows collide in the table, and are often deleted and put again
    for step in range(60):
        if free and (step % 3 != 2 or not oracle):
            cand = g.choice(universe, size=min(len(free), 1 + int(g.integers(0, capacity))), replace=False)
            cand = np.array([r for r in cand.tolist() if r not in oracle], dtype=np.int64)
            slots = np.array([free.pop() for _ in range(cand.size)], dtype=np.int64)
            index.put(cand, slots)
            oracle.update(zip(cand.tolist(), slots.tolist()))
        else:
            held = np.array(sorted(oracle), dtype=np.int64)
            gone = g.choice(held, size=1 + int(g.integers(0, held.size)), replace=False)
            index.delete(np.concatenate([gone, [universe + 5]]))  # a row it never held is ignored
            for r in gone.tolist():
                free.append(oracle.pop(r))
        _check(index, oracle, np.arange(universe + 20))
    assert index.nbytes <= 48 * max(capacity, 8)


def test_deletion_marks_are_reused_and_cleared_by_a_rebuild():
    index = RowIndex(100)
    size = index._keys.size
    for round in range(50):  # far more deletions than the table has positions
        rows = np.arange(round * 100, round * 100 + 100)
        index.put(rows, np.arange(100))
        assert np.array_equal(index.get(rows), np.arange(100))
        index.delete(rows)
        assert len(index) == 0 and (index.get(rows) == -1).all()
        assert index._deleted <= size  # rebuilt before the marks fill the table
    assert index._keys.size == size


def test_refusals():
    index = RowIndex(2)
    with pytest.raises(InvalidArgumentError, match="exceed"):
        index.put(np.array([1, 2, 3]), np.array([0, 1, 0]))
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        index.get(np.array([-1]))
    with pytest.raises(InvalidArgumentError, match="2 rows but 1 slots"):
        index.put(np.array([1, 2]), np.array([0]))
    with pytest.raises(InvalidArgumentError):
        RowIndex(-1)
    index.put(np.array([0, 2**40]), np.array([1, 0]))  # row 0 and a row past 2^32
    assert 0 in index and 2**40 in index and 1 not in index
    assert index.get(np.array([2**40, 0, 5])).tolist() == [0, 1, -1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_index_writes_nothing_until_rows_come():
    index = RowIndex(20_000_000)  # 805 MB of arrays (12 bytes a position, 2^26 positions)
    assert index.nbytes == 12 << 26 <= 48 * 20_000_000
    before = _rss_bytes()
    index = RowIndex(20_000_000)
    assert _rss_bytes() - before < 64 << 20  # allocated zeroed, not written: a DirectTable opens at once
    index.put(np.arange(1000) * 7919, np.arange(1000))
    assert np.array_equal(index.get(np.arange(1000) * 7919), np.arange(1000))


def test_a_full_direct_cache_stays_within_its_memory_budget(tmp_path):
    """Every allocation of a DirectTable filled to its last slot (rows, index, bookkeeping; tracemalloc
    counts numpy's and Python's alike) fits ``memory_budget``; a dict index (120 bytes a row) did not."""
    rows, fmt = 60_000, "q4_0"
    data, scale = make_table(fmt, rows, 160)
    path = write_file(tmp_path / "t.pletable", fmt, data, scale, shard_rows=16384)
    mem = MemoryTable(data, scale, fmt)
    budget = 40_000 * (90 + SLOT_OVERHEAD)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t = DirectTable(path, memory_budget=budget)
        assert t.cache_slots == 40_000
        assert t.pin(np.arange(5000, 45_000)) == 40_000  # every slot
        ids = random_ids(rows, 64, 16, seed=4)
        got = t.lookup(ids, torch.bfloat16)  # misses: the pinned slots stay, nothing more is cached
        held = tracemalloc.get_traced_memory()[0] - base - got.numel() * got.element_size()
    finally:
        tracemalloc.stop()
    try:
        assert_same(got, mem.lookup(ids, torch.bfloat16))
        assert t.reads > 0 and t.hits > 0
        assert held <= budget, held
        before = t.reads
        assert_same(
            t.lookup(torch.arange(5000, 6000).view(-1, 8), torch.float32),
            mem.lookup(torch.arange(5000, 6000).view(-1, 8), torch.float32),
        )
        assert t.reads == before  # pinned rows served from memory
    finally:
        t.close()
