"""DirectTable: rows read with pread (O_DIRECT or dropped from the page cache), bit-equal to memory."""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
import warnings

import numpy as np
import pytest
import torch

from ple.errors import InvalidArgumentError, UsageError
from ple.kernels.native import NativeUnavailable
from ple.table import FORMATS, MemoryTable, TableFileError
from ple.table.base import TableRef, lookup_through
from ple.table.formats.catalog import BLOCK_FORMATS
from ple.table.tiers import direct as direct_module
from ple.table.tiers.direct import SLOT_OVERHEAD, DirectTable, _NativeReader, _spans
from tests.table._helpers import assert_same, make_table, random_ids, write_file

ROWS, HD = 5000, 40  # 40-byte fp8 rows and 160-byte fp32 rows straddle 4 KiB blocks


def _table_file(tmp_path, fmt, rows=ROWS, hd=HD):
    data, scale = make_table(fmt, rows, hd)
    path = write_file(tmp_path / f"t-{fmt}.pletable", fmt, data, scale, shard_rows=1024)
    return path, MemoryTable(data, scale, fmt)


def _resident_pages(path, offset: int, length: int) -> int:
    """Pages of ``[offset, offset + length)`` of the file in the page cache (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        base = offset - offset % mmap.PAGESIZE
        n = offset + length - base
        m = mmap.mmap(fd, n, prot=mmap.PROT_READ, offset=base)
        try:
            pages = -(-n // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            view = np.frombuffer(m, dtype=np.uint8)
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
            if libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(n), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            del view
            return sum(v & 1 for v in vec)
        finally:
            m.close()
    finally:
        os.close(fd)


def _drop_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("memory_budget", [0, 64 * 1024])
@pytest.mark.parametrize("reader", ["native", "threads"])
def test_lookups_equal_the_memory_table(tmp_path, fmt, memory_budget, reader):
    # block formats need whole blocks a row (32 values; nvfp4 16): 160 values, the published width
    path, mem = _table_file(tmp_path, fmt, hd=160 if fmt in BLOCK_FORMATS else HD)
    t = DirectTable(path, memory_budget=memory_budget, queue_depth=32, reader=reader)
    try:
        assert t.reader_kind == reader
        for seed in range(3):  # repeated lookups: cache hits and misses mixed
            ids = random_ids(ROWS, 37, 6, seed=seed)
            ids[:5] = ids[5:10]  # duplicate rows within the step
            ids[-1, -1] = ROWS - 1  # the last row: its aligned block runs to the end of the rows
            for dtype in (torch.bfloat16, torch.float32):
                assert_same(t.lookup(ids, dtype), mem.lookup(ids, dtype), f"{fmt} {dtype} seed {seed}")
        assert t.reads > 0
        if memory_budget:
            assert t.hits > 0
    finally:
        t.close()


@pytest.mark.parametrize("depth", [1, 3, 64])
@pytest.mark.parametrize("reader", ["native", "threads"])
def test_queue_depths_and_plain_reads_agree(tmp_path, depth, reader):
    path, mem = _table_file(tmp_path, "int8_row")
    ids = random_ids(ROWS, 64, 8, seed=5)
    for direct in (None, False):
        t = DirectTable(path, queue_depth=depth, direct=direct, reader=reader)
        try:
            assert t.direct == ("dontneed" if direct is False else t.direct)
            assert_same(t.lookup(ids, torch.bfloat16), mem.lookup(ids, torch.bfloat16))
        finally:
            t.close()


@pytest.mark.parametrize("reader", ["native", "threads"])
def test_reads_leave_no_pages_in_the_page_cache(tmp_path, reader):
    path, mem = _table_file(tmp_path, "fp8_row", rows=20000)
    header_end = 4096
    for direct in (None, False):
        _drop_cache(path)
        size = os.path.getsize(path)
        assert _resident_pages(path, 0, size) == 0, "the precondition: nothing of the file cached"
        t = DirectTable(path, direct=direct, reader=reader)
        try:
            ids = random_ids(20000, 256, 8, seed=2)
            assert_same(t.lookup(ids, torch.float32), mem.lookup(ids, torch.float32))
            # rows and scales were read, none of them stayed cached (the header may be)
            assert _resident_pages(path, header_end, size - header_end) == 0, t.direct
        finally:
            t.close()
    # the check can fail: a buffered read of the same file does leave pages behind
    with open(path, "rb") as f:
        f.read()
    assert _resident_pages(path, header_end, os.path.getsize(path) - header_end) > 0


def test_cache_stays_within_its_budget_and_pins_hot_rows(tmp_path):
    path, mem = _table_file(tmp_path, "fp8_row")
    budget = 100 * (HD + 4 + SLOT_OVERHEAD) + 7
    t = DirectTable(path, memory_budget=budget)
    try:
        assert t.cache_slots == 100
        assert t.cache_slots * (HD + 4 + SLOT_OVERHEAD) <= budget
        warm = random_ids(ROWS, 500, 4, seed=3)
        hot = DirectTable.hot_rows(warm, 40)
        counts = torch.bincount(warm.reshape(-1), minlength=ROWS)
        assert counts[hot].min() >= counts.sort(descending=True).values[39]  # the 40 most read
        assert t.pin(hot) == 40
        for seed in range(4):  # many misses: the LRU part turns over, the pinned rows stay
            ids = random_ids(ROWS, 64, 8, seed=10 + seed)
            assert_same(t.lookup(ids, torch.bfloat16), mem.lookup(ids, torch.bfloat16))
        assert len(t._slot_of) <= 100
        before = t.reads
        ids = hot.view(-1, 1).repeat(1, 2)
        assert_same(t.lookup(ids, torch.bfloat16), mem.lookup(ids, torch.bfloat16))
        assert t.reads == before  # every pinned row served from memory
    finally:
        t.close()


def test_operator_and_prefetch(tmp_path):
    path, mem = _table_file(tmp_path, "fp8")
    t = DirectTable(path)
    try:
        ids = random_ids(ROWS, 16, 4, seed=7)
        want = mem.lookup(ids, torch.bfloat16)
        assert_same(lookup_through(ids, TableRef(t), HD, torch.bfloat16), want)
        with t.start_prefetch(ids, torch.bfloat16) as h:
            assert_same(h.wait(ids), want)
    finally:
        t.close()


def test_changed_file_and_bad_arguments(tmp_path):
    path, _ = _table_file(tmp_path, "bf16")
    with pytest.raises(InvalidArgumentError, match="queue_depth"):
        DirectTable(path, queue_depth=0)
    with pytest.raises(InvalidArgumentError, match="memory_budget"):
        DirectTable(path, memory_budget=-1)
    t = DirectTable(path)
    try:
        with open(path, "ab") as f:
            f.write(b"x")
        with pytest.raises(TableFileError, match="changed in place"):
            t.lookup(random_ids(ROWS, 2, 2), torch.float32)
    finally:
        t.close()


def test_spans_cover_every_piece_aligned():
    offsets = np.array([4096 + 40 * r for r in (0, 1, 101, 102, 5000, 90000)], dtype=np.int64)
    spans, span_of, at = _spans(offsets, 40, 4096)
    assert (spans[:, 0] % 4096 == 0).all() and (spans[:, 1] % 4096 == 0).all()
    for j, off in enumerate(offsets):
        s0, n = spans[span_of[j]]
        assert s0 + at[j] == off and at[j] + 40 <= n
    # rows 0, 1, 101 and 102 start in one block (row 102 runs into the next): one read of two blocks
    assert spans.tolist() == [[4096, 8192], [200704, 4096], [3600384, 4096]]


def test_native_reader_rows_wider_than_its_buffer_and_concurrent_lookups(tmp_path):
    # 140,000-byte rows: each needs a read wider than a worker's 128 KiB buffer
    path, mem = _table_file(tmp_path, "bf16", rows=12, hd=70_000)
    t = DirectTable(path, queue_depth=4, reader="native")
    try:
        ids = torch.tensor([[11, 0, 5], [5, 6, 7]])
        assert_same(t.lookup(ids, torch.float32), mem.lookup(ids, torch.float32))
    finally:
        t.close()
    # lookups from several threads at once share one reader: each gets its own rows
    path, mem = _table_file(tmp_path, "fp8_row")
    t = DirectTable(path, queue_depth=8, reader="native")
    try:
        batches = [random_ids(ROWS, 32, 8, seed=100 + k) for k in range(8)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda ids: t.lookup(ids, torch.bfloat16), batches))
        for ids, out in zip(batches, outs):
            assert_same(out, mem.lookup(ids, torch.bfloat16))
    finally:
        t.close()


def test_native_reader_errors_name_the_file_and_offset(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    fd = os.open(path, os.O_RDONLY)
    try:
        # told the file is longer than it is: the read past its end comes back short
        r = _NativeReader(fd, 4, False, 20_000, path)
        try:
            dest = np.zeros((2, 16), dtype=np.uint8)
            r.read([(np.array([100, 5000], dtype=np.int64), 16, dest)])
            assert dest[0].tolist() == list(range(100, 116)) and dest[1].tolist() == [
                (5000 + i) % 256 for i in range(16)
            ]
            with pytest.raises(
                TableFileError, match=r"short\.bin: reading 4096 bytes at byte 12288: short read, 0 bytes"
            ):
                r.read([(np.array([100, 12300], dtype=np.int64), 16, dest)])
            with pytest.raises(
                TableFileError, match=r"short\.bin: reading 16 bytes at byte 50 failed: Invalid argument"
            ):
                r.read([(np.array([100, 50], dtype=np.int64), 16, dest)])  # not sorted
            assert r.reads == 2  # the reads of the call that worked
        finally:
            r.close()
    finally:
        os.close(fd)
    # a read the system refuses (EISDIR, as EIO would be): its errno, the file and the offset
    dfd = os.open(tmp_path, os.O_RDONLY)
    try:
        r = _NativeReader(dfd, 2, False, 8192, tmp_path)
        try:
            with pytest.raises(TableFileError, match=r"reading 4096 bytes at byte 4096 failed: Is a directory"):
                r.read([(np.array([4100], dtype=np.int64), 4, np.zeros((1, 4), dtype=np.uint8))])
        finally:
            r.close()
        with pytest.raises(UsageError, match="closed"):
            r.read([(np.array([0], dtype=np.int64), 4, np.zeros((1, 4), dtype=np.uint8))])
    finally:
        os.close(dfd)


def test_reader_choice_without_the_native_kernels(tmp_path, monkeypatch):
    path, mem = _table_file(tmp_path, "fp8")
    with pytest.raises(InvalidArgumentError, match="reader must be 'uring', 'native', 'threads' or None, got 'aio'"):
        DirectTable(path, reader="aio")
    monkeypatch.setenv("PLE_NATIVE", "0")
    with pytest.raises(NativeUnavailable, match="PLE_NATIVE=0"):
        DirectTable(path, reader="native")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # turned off on purpose: no warning
        t = DirectTable(path)
    try:
        assert t.reader_kind == "threads"  # the Python threads, and the table says so
        ids = random_ids(ROWS, 8, 4, seed=1)
        assert_same(t.lookup(ids, torch.bfloat16), mem.lookup(ids, torch.bfloat16))
    finally:
        t.close()
    # wanted but not built (no compiler, say): the Python threads, with a warning that says why, once
    monkeypatch.delenv("PLE_NATIVE")
    monkeypatch.setattr(direct_module, "_warned_threads", False)

    def unavailable():
        raise NativeUnavailable("no C compiler: 'cc' is not on PATH")

    monkeypatch.setattr(direct_module._native, "library", unavailable)
    for k in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = DirectTable(path)
        t.close()
        assert t.reader_kind == "threads"
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert said == (
            []
            if k
            else [
                "ple: DirectTable reads with Python threads (a fraction of the device's "
                "rate): no C compiler: 'cc' is not on PATH"
            ]
        )
