"""Tables opened before ``fork()`` serve lookups in the child (PyTorch's DataLoader workers, a
``multiprocessing`` pool with the ``fork`` start method).

The child has one thread: a :class:`~ple.table.DirectTable`'s reader threads (native or Python) and
every table's prefetch worker are not there, and waiting on them hung the child's first lookup. Each
test runs the child's work under a deadline: a child that hangs is killed and the test fails. The
children call ``torch.set_num_threads(1)`` first, as DataLoader workers do (PyTorch's own OpenMP
threads cannot run in a child forked after its parent used them either).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
import traceback

import numpy as np
import pytest
import torch

from ple.table import CachedTable, DirectTable, MemoryTable, MmapTable, PrefetchError
from ple.table.lookup import gather_dequant_reference
from tests.table._helpers import (
    FORK_DEADLINE_S,
    check_direct_cache,
    make_table,
    random_ids,
    uring_unavailable,
    write_file,
)
from tests.table._helpers import run_forked as _run_forked

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")

ROWS, HD = 2000, 64
DEADLINE_S = FORK_DEADLINE_S


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    data, scale = make_table("fp8_row", ROWS, HD, seed=3)
    path = write_file(tmp_path_factory.mktemp("fork") / "t.pletable", "fp8_row", data, scale, shard_rows=512)
    return path, data, scale


def _tiers(path, data, scale) -> dict:
    slot = HD + 4 + 96  # a row, its scale and the bookkeeping: see DirectTable's memory_budget
    return {
        "memory": MemoryTable(data, scale, "fp8_row"),
        "mmap": MmapTable.open(path),
        "cached": CachedTable(MmapTable.open(path), 100, refresh_every=2),
        "direct-native": DirectTable(path, queue_depth=4, reader="native"),
        "direct-native-cache": DirectTable(path, memory_budget=150 * slot, queue_depth=4, reader="native"),
        "direct-threads": DirectTable(path, queue_depth=4, reader="threads"),
        **(
            {}
            if uring_unavailable()
            else {
                "direct-uring": DirectTable(path, queue_depth=4, reader="uring"),
                "direct-uring-cache": DirectTable(path, memory_budget=150 * slot, queue_depth=4, reader="uring"),
            }
        ),
        "direct-threads-cache": DirectTable(path, memory_budget=150 * slot, queue_depth=4, reader="threads"),
    }


def _lookups(tables: dict, seed: int) -> dict:
    """Per tier: ``(ids, rows)`` of two lookups and one prefetch (which starts the prefetch worker)."""
    out = {}
    for name, t in tables.items():
        got = []
        for k in range(3):
            ids = random_ids(ROWS, 16, 6, seed=seed + k)
            if k == 2:
                with t.start_prefetch(ids, torch.bfloat16) as h:
                    got.append((ids, h.wait(ids).clone()))
            else:
                got.append((ids, t.lookup(ids, torch.bfloat16)))
        out[name] = got
    return out


def _assert_reference(results: dict, data, scale) -> None:
    for name, got in results.items():
        for ids, rows in got:
            want = gather_dequant_reference(data, scale, ids, torch.bfloat16)
            assert torch.equal(rows.view(torch.int16), want.view(torch.int16)), f"{name}: rows differ in the child"


def test_every_tier_serves_lookups_and_prefetches_in_a_forked_child(table_file, tmp_path):
    path, data, scale = table_file
    tables = _tiers(path, data, scale)
    try:
        _lookups(tables, seed=0)  # the parent's readers and prefetch workers have run
        results = _run_forked(lambda: _lookups(tables, seed=10), tmp_path / "child.pkl")
        _assert_reference(results, data, scale)
        _assert_reference(_lookups(tables, seed=20), data, scale)  # the parent's own threads still serve it
        for t in tables.values():
            if isinstance(t, DirectTable):
                check_direct_cache(t)
    finally:
        for t in tables.values():
            t.close()


def test_a_child_of_a_child_serves_lookups_too(table_file, tmp_path):
    path, data, scale = table_file
    t = DirectTable(path, memory_budget=1 << 16, queue_depth=4)
    try:
        t.lookup(random_ids(ROWS, 4, 6), torch.float32)

        def child():
            t.lookup(random_ids(ROWS, 4, 6, seed=5), torch.float32)  # the child's own readers
            return _run_forked(lambda: _lookups({"direct": t}, seed=30), tmp_path / "grandchild.pkl")

        _assert_reference(_run_forked(child, tmp_path / "child.pkl"), data, scale)
    finally:
        t.close()


_SHARED: dict = {}  # the tables a multiprocessing child inherits


def _mp_child(conn) -> None:  # pragma: no cover - runs in the child
    try:
        torch.set_num_threads(1)
        result = ("ok", _lookups(_SHARED, seed=40))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("err", traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(result))  # plain pickle: tensors copied, not shared through descriptors
    finally:
        conn.close()


def test_multiprocessing_fork_workers_serve_lookups(table_file):
    """What a DataLoader worker does: a ``fork`` context process looking up inherited tables."""
    path, data, scale = table_file
    tables = _tiers(path, data, scale)
    _SHARED.update(tables)
    ctx = multiprocessing.get_context("fork")
    try:
        _lookups(tables, seed=0)
        results = []
        for _ in range(2):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_mp_child, args=(send,))
            p.start()
            send.close()
            if not recv.poll(DEADLINE_S):
                p.kill()
                p.join()
                pytest.fail(f"a fork worker did not answer within {DEADLINE_S} s (hung)")
            results.append(pickle.loads(recv.recv_bytes()))
            p.join(DEADLINE_S)
        for status, value in results:
            assert status == "ok", value
            _assert_reference(value, data, scale)
    finally:
        _SHARED.clear()
        for t in tables.values():
            t.close()


class _Gated(MemoryTable):
    """A memory table whose lookups wait for ``gate`` (to hold a prefetch in flight across a fork)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _lookup_into(self, ids, out):
        self.entered.set()
        assert self.gate.wait(DEADLINE_S)
        super()._lookup_into(ids, out)


def test_a_prefetch_running_at_the_fork_is_refused_in_the_child(table_file, tmp_path):
    """The parent's worker was still gathering at the fork: in the child nothing will write its rows,
    so waiting for them raises at once (and a new prefetch in the child works)."""
    _, data, scale = table_file
    t = _Gated(data, scale, "fp8_row")
    ids = random_ids(ROWS, 4, 6)
    h = t.start_prefetch(ids, torch.float32)
    assert t.entered.wait(DEADLINE_S)

    def child():
        assert h.done()  # waiting would not block: it raises
        with pytest.raises(PrefetchError, match="started before fork"):
            h.wait(ids)
        h.release()
        t.gate.set()
        with t.start_prefetch(ids, torch.float32) as again:
            return again.wait(ids).clone()

    try:
        rows = _run_forked(child, tmp_path / "child.pkl")
        assert torch.equal(rows, gather_dequant_reference(data, scale, ids, torch.float32))
        t.gate.set()
        assert torch.equal(h.wait(ids), rows)  # the parent's own prefetch finishes as usual
        h.release()
    finally:
        t.gate.set()
        t.close()


def test_forks_while_other_threads_look_up(table_file, tmp_path):
    """Forks taken while four threads look rows up through row caches that admit and evict: every
    child finds the caches' bookkeeping whole (the fork waits for the bookkeeping in progress) and
    serves the reference's rows."""
    path, data, scale = table_file
    slot = HD + 4 + 96
    tables = {
        "direct": DirectTable(path, memory_budget=60 * slot, queue_depth=4),
        "cached": CachedTable(MmapTable.open(path), 60, refresh_every=1),
    }
    stop = threading.Event()
    failures: list[BaseException] = []

    def hammer(k: int) -> None:
        try:
            i = 0
            while not stop.is_set():
                ids = random_ids(ROWS, 8, 6, seed=1000 * k + i) % 200  # 200 rows through 60 slots
                for t in tables.values():
                    t.lookup(ids, torch.float32)
                i += 1
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            failures.append(e)

    def child():
        direct = tables["direct"]
        check_direct_cache(direct)
        return _lookups(tables, seed=50)

    workers = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for w in workers:
        w.start()
    try:
        for n in range(4):
            time.sleep(0.05)
            _assert_reference(_run_forked(child, tmp_path / f"child{n}.pkl"), data, scale)
    finally:
        stop.set()
        for w in workers:
            w.join(DEADLINE_S)
        for t in tables.values():
            t.close()
    assert not failures, failures[0]
    assert int(np.count_nonzero(tables["direct"]._cache_used >= 0)) > 0
