"""Prefetch handles: results, misuse errors, buffer reuse rule, and a threaded stress test."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ple.table import MemoryTable, MmapTable, PrefetchError
from ple.table.lookup import gather_dequant_reference
from tests.table._helpers import DTYPES, ELEMENT, make_table, random_ids, write_file


@pytest.fixture(params=["memory", "mmap"])
def tier(request, tmp_path):
    def build(fmt, rows, D, seed=0):
        data, scale = make_table(fmt, rows, D, seed=seed)
        if request.param == "memory":
            return MemoryTable(data, scale), data, scale
        path = write_file(tmp_path / f"{fmt}.ple", fmt, data, scale, max(1, rows // 3))
        return MmapTable.open(path), data, scale

    return build


@pytest.mark.parametrize("fmt", ELEMENT)
def test_prefetch_matches_lookup(tier, fmt):
    table, data, scale = tier(fmt, 211, 7, seed=3)
    for dtype in DTYPES:
        ids = random_ids(211, 33, 4, seed=5)
        h = table.start_prefetch(ids, dtype)
        assert h.ids is ids and h.dtype == dtype
        rows = h.wait(ids)
        assert h.done()
        assert torch.equal(rows, gather_dequant_reference(data, scale, ids, dtype))
        assert torch.equal(rows, table.lookup(ids, dtype))
        h.release()
    table.close()


def test_misuse_raises():
    table = MemoryTable(*make_table("fp8", 50, 4))
    ids = random_ids(50, 6, 2)
    other = ids.clone()
    h = table.start_prefetch(ids, torch.bfloat16)
    with pytest.raises(PrefetchError, match=rf"#{h.seq} was started for another ids tensor"):
        h.wait(other)
    h.wait(ids)
    with pytest.raises(PrefetchError, match="already waited"):
        h.wait()
    h.release()
    h.release()  # idempotent
    h2 = table.start_prefetch(ids, torch.bfloat16)
    assert h2.seq > h.seq
    h2.release()
    with pytest.raises(PrefetchError, match="released"):
        h2.wait()
    h3 = table.start_prefetch(ids, torch.bfloat16)
    ids[0, 0] = (ids[0, 0] + 1) % 50  # the batch changed after the prefetch started
    with pytest.raises(PrefetchError, match="modified in place"):
        h3.wait(ids)
    h3.release()
    h4 = table.start_prefetch(ids, torch.bfloat16)
    table.close()  # pending prefetches finish; a later prefetch starts a new worker
    assert torch.equal(h4.wait(ids), table.lookup(ids, torch.bfloat16))
    h5 = table.start_prefetch(ids, torch.bfloat16)
    assert h5.seq > h4.seq and torch.equal(h5.wait(ids), table.lookup(ids, torch.bfloat16))
    table.close()


def test_prefetch_reads_a_snapshot_of_the_ids():
    data, scale = make_table("int8_row", 64, 5)
    table = MemoryTable(data, scale)
    ids = random_ids(64, 8, 3)
    want = gather_dequant_reference(data, scale, ids, torch.float32)
    h = table.start_prefetch(ids, torch.float32)
    ids.fill_(0)  # reusing the ids buffer for the next batch does not change this prefetch
    assert torch.equal(h.wait(), want)
    h.release()


def test_buffer_reuse_rule():
    table = MemoryTable(*make_table("bf16", 40, 4))
    ids = random_ids(40, 5, 2)
    h1 = table.start_prefetch(ids, torch.float32)
    h2 = table.start_prefetch(ids, torch.float32)
    r1, r2 = h1.wait(), h2.wait()
    assert r1.data_ptr() != r2.data_ptr()  # two buffers in flight
    keep = r1.clone()
    h3 = table.start_prefetch(random_ids(40, 5, 2, seed=9), torch.float32)  # h1, h2 unreleased
    r3 = h3.wait()
    assert r3.data_ptr() not in (r1.data_ptr(), r2.data_ptr())
    assert torch.equal(r1, keep)  # never overwritten while unreleased
    h1.release()
    h4 = table.start_prefetch(ids, torch.float32)
    assert h4.wait().data_ptr() == r1.data_ptr()  # released buffers are reused
    for h in (h2, h3, h4):
        h.release()
    table.close()


def test_worker_error_surfaces_at_wait():
    table = MemoryTable(*make_table("fp16", 10, 4))
    ids = torch.tensor([[1, 2]])
    h = table.start_prefetch(ids, torch.float32, check=False)
    assert torch.equal(h.wait(), table.lookup(ids, torch.float32))
    h.release()
    bad = torch.tensor([[1, 99]])
    h = table.start_prefetch(bad, torch.float32, check=False)
    with pytest.raises(IndexError):
        h.wait()
    with pytest.raises(PrefetchError):
        h.wait()


@pytest.mark.parametrize("kind", ["memory", "mmap"])
def test_stress_overlapping_prefetches(kind, tmp_path):
    """Threads interleave prefetches (waited in random order, some released late) with synchronous
    lookups on the same table: every result equals the synchronous lookup of its own ids."""
    rows, D = 5003, 24
    data, scale = make_table("fp8_row", rows, D, seed=7)
    if kind == "memory":
        table = MemoryTable(data, scale)
    else:
        table = MmapTable.open(write_file(tmp_path / "t.ple", "fp8_row", data, scale, 1000))
    errors: list[str] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        pending = []
        for step in range(60):
            T = rng.choice([1, 2, 63, 129, 300])
            ids = random_ids(rows, T, 16, seed=tid * 1000 + step)
            dtype = rng.choice(DTYPES)
            pending.append((table.start_prefetch(ids, dtype), ids, dtype))
            if rng.random() < 0.5:
                sync_ids = random_ids(rows, T, 16, seed=-tid * 1000 - step)
                got = table.lookup(sync_ids, dtype)
                if not torch.equal(got, gather_dequant_reference(data, scale, sync_ids, dtype)):
                    errors.append(f"thread {tid} step {step}: synchronous lookup differs")
            while pending and (len(pending) > 3 or rng.random() < 0.4):
                h, hid, hdt = pending.pop(rng.randrange(len(pending)))
                rows_ = h.wait(hid)
                want = table.lookup(hid, hdt)
                if not torch.equal(rows_, want):
                    errors.append(f"thread {tid} step {step}: prefetch #{h.seq} differs")
                h.release()
        for h, hid, hdt in pending:
            if not torch.equal(h.wait(hid), table.lookup(hid, hdt)):
                errors.append(f"thread {tid}: late prefetch #{h.seq} differs")
            h.release()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    table.close()
    assert errors == []
