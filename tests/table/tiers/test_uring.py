"""The direct tier's io_uring reader (``reader="uring"``): the memory table's rows for every format, from
many threads, after fork, with short files and failed reads named, and the choice of reader said aloud.

Tests that read through io_uring skip, with the reason the kernel gave, where io_uring cannot start (an
old kernel, a seccomp filter); the refusal itself is tested everywhere: ``PLE_URING=0`` turns the
reader off, and rings set up with a flag no kernel knows make the kernel refuse them.
"""

from __future__ import annotations

import concurrent.futures
import errno
import gc
import os
import re
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from ple.errors import PLEError, UsageError
from ple.kernels import native as _native
from ple.kernels.native import NativeUnavailable
from ple.table import FORMATS, MemoryTable, TableFileError
from ple.table.formats.catalog import BLOCK_FORMATS
from ple.table.lookup import gather_dequant_reference
from ple.table.tiers import readers as readers_module
from ple.table.tiers.direct import DirectTable
from ple.table.tiers.readers import URING_SWITCH, UringReader, UringUnavailable
from tests.table._helpers import assert_same, make_table, random_ids, run_forked, uring_unavailable, write_file

ROWS = 5000
BAD_FLAG = 1 << 30  # an IORING_SETUP_* flag no kernel has: io_uring_setup answers EINVAL


WHY_NOT = uring_unavailable()
needs_uring = pytest.mark.skipif(WHY_NOT is not None, reason=f"io_uring unavailable here: {WHY_NOT}")


def _table_file(tmp_path, fmt, rows=ROWS, hd=40):
    hd = 160 if fmt in BLOCK_FORMATS else hd  # whole blocks a row; 40 fp8 bytes / 160 fp32 bytes straddle blocks
    data, scale = make_table(fmt, rows, hd, seed=11)
    path = write_file(tmp_path / f"t-{fmt}.pletable", fmt, data, scale, shard_rows=1024)
    return path, MemoryTable(data, scale, fmt), (data, scale)


def _ring_descriptors() -> int:
    """This process's open io_uring descriptors."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[io_uring]"
        except OSError:
            pass
    return n


@needs_uring
@pytest.mark.parametrize("fmt", FORMATS)
def test_uring_lookups_equal_the_memory_table(tmp_path, fmt):
    path, mem, _ = _table_file(tmp_path, fmt)
    for direct, depth, budget in ((None, 32, 0), (False, 3, 0), (None, 1, 64 << 10)):
        t = DirectTable(path, memory_budget=budget, queue_depth=depth, direct=direct, reader="uring")
        try:
            assert t.reader_kind == "uring"
            assert t.direct == ("dontneed" if direct is False else t.direct)
            for seed in range(3):
                ids = random_ids(ROWS, 37, 6, seed=seed)
                ids[:5] = ids[5:10]  # rows repeated within the step
                ids[-1, -1] = ROWS - 1  # the last row: its aligned block runs past the end of the file
                ids[0, 0] = 0
                for dtype in (torch.bfloat16, torch.float32):
                    assert_same(t.lookup(ids, dtype), mem.lookup(ids, dtype), f"{fmt} {direct} {depth} {seed}")
            assert t.reads > 0
        finally:
            t.close()


@needs_uring
def test_uring_is_the_default_and_reads_rows_wider_than_a_buffer(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no step down, no warning
        path, mem, _ = _table_file(tmp_path, "bf16", rows=12, hd=70_000)  # 140,000-byte rows: 35 blocks each
        t = DirectTable(path, queue_depth=4)
    try:
        assert t.reader_kind == "uring"
        ids = torch.tensor([[11, 0, 5], [5, 6, 7], [1, 2, 3]])  # neighbours merge into spans past 128 KiB
        assert_same(t.lookup(ids, torch.float32), mem.lookup(ids, torch.float32))
    finally:
        t.close()


@needs_uring
def test_uring_lookups_from_many_threads_each_get_their_rows(tmp_path):
    path, mem, _ = _table_file(tmp_path, "fp8_row", rows=20_000)
    t = DirectTable(path, queue_depth=8, reader="uring")
    start = threading.Barrier(8)

    def work(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        start.wait()
        out = []
        for i in range(12):
            ids = random_ids(20_000, 64 if i % 2 else 4, 8, seed=1000 * k + i)  # big and small calls interleaved
            out.append((ids, t.lookup(ids, torch.bfloat16)))
        return out

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(work, range(8)))
        for got in results:
            for ids, rows in got:
                assert_same(rows, mem.lookup(ids, torch.bfloat16))
    finally:
        t.close()


@needs_uring
def test_closing_while_lookups_run_finishes_them_then_refuses(tmp_path):
    path, mem, _ = _table_file(tmp_path, "q4_0", rows=20_000)
    t = DirectTable(path, queue_depth=4, direct=False, reader="uring")  # plain reads: one fadvise each, slower
    outcomes: list[str] = []
    running = threading.Event()

    def work(k: int) -> None:
        for i in range(200):
            ids = random_ids(20_000, 256, 8, seed=50 * k + i)
            try:
                rows = t.lookup(ids, torch.float32)
            except UsageError as e:
                assert "closed" in str(e)
                outcomes.append("refused")
                return
            running.set()
            assert_same(rows, mem.lookup(ids, torch.float32))
        outcomes.append("finished")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    assert running.wait(30)
    t.close()  # while the others read: their calls in progress end, the next ones are refused
    for th in threads:
        th.join(60)
        assert not th.is_alive()
    assert len(outcomes) == 3 and "refused" in outcomes


@needs_uring
def test_a_forked_child_sets_up_rings_of_its_own(tmp_path):
    gc.collect()  # tables earlier tests left unreferenced close their rings now
    before = _ring_descriptors()  # rings of tables still open elsewhere in this process
    path, mem, (data, scale) = _table_file(tmp_path, "fp8_row")
    t = DirectTable(path, memory_budget=64 << 10, queue_depth=4, reader="uring")
    try:
        ids0 = random_ids(ROWS, 16, 6, seed=1)
        assert_same(t.lookup(ids0, torch.float32), mem.lookup(ids0, torch.float32))
        assert _ring_descriptors() >= before + 1

        def child():
            inherited = _ring_descriptors()  # the parent's rings are closed in the child at the fork
            got = []
            for seed in (2, 3):
                ids = random_ids(ROWS, 16, 6, seed=seed)
                got.append((ids, t.lookup(ids, torch.float32)))
            grandchild = run_forked(
                lambda: [(ids, t.lookup(ids, torch.float32)) for ids in [random_ids(ROWS, 8, 6, seed=4)]],
                tmp_path / "grandchild.pkl",
            )
            return inherited, _ring_descriptors(), t.reader_kind, got + grandchild

        inherited, own, kind, got = run_forked(child, tmp_path / "child.pkl")
        assert inherited == 0 and own >= 1 and kind == "uring"
        for ids, rows in got:
            assert torch.equal(rows, gather_dequant_reference(data, scale, ids, torch.float32))
        ids = random_ids(ROWS, 16, 6, seed=5)  # the parent's rings still serve it
        assert_same(t.lookup(ids, torch.float32), mem.lookup(ids, torch.float32))
    finally:
        t.close()
    assert _ring_descriptors() == before  # closing the table freed its rings


@needs_uring
def test_short_files_and_failed_reads_are_named(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(256)) * 40)  # 10,240 bytes
    fd = os.open(path, os.O_RDONLY)
    try:
        # told the file is longer than it is: the read past its end comes back short
        r = UringReader(fd, 4, False, 20_000, path)
        try:
            dest = np.zeros((2, 16), dtype=np.uint8)
            r.read([(np.array([100, 5000], dtype=np.int64), 16, dest)])
            assert dest[0].tolist() == list(range(100, 116))
            assert dest[1].tolist() == [(5000 + i) % 256 for i in range(16)]
            with pytest.raises(
                TableFileError, match=r"short\.bin: reading 4096 bytes at byte 12288: short read, 0 bytes"
            ):
                r.read([(np.array([100, 12300], dtype=np.int64), 16, dest)])
            with pytest.raises(
                TableFileError, match=r"short\.bin: reading 8192 bytes at byte 8192: short read, 2048 bytes"
            ):
                r.read([(np.array([9000], dtype=np.int64), 4000, np.zeros((1, 4000), dtype=np.uint8))])
            with pytest.raises(
                TableFileError, match=r"short\.bin: reading 16 bytes at byte 50 failed: Invalid argument"
            ):
                r.read([(np.array([100, 50], dtype=np.int64), 16, dest)])  # not sorted
            assert r.reads == 2  # the reads of the call that worked
        finally:
            r.close()
        # told the truth: the file's last bytes, in a block the file ends inside
        right = UringReader(fd, 4, False, 10_240, path)
        try:
            right.read([(np.array([10_224], dtype=np.int64), 16, dest[:1])])
            assert dest[0].tolist() == [(10_224 + i) % 256 for i in range(16)]
        finally:
            right.close()
        with pytest.raises(UsageError, match="closed"):
            r.read([(np.array([0], dtype=np.int64), 4, np.zeros((1, 4), dtype=np.uint8))])
    finally:
        os.close(fd)
    # a file io_uring cannot read (a directory: EISDIR, as EIO would be): refused at the start, named
    dfd = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(UringUnavailable, match=r"io_uring cannot read .* Is a directory \(errno 21\)"):
            UringReader(dfd, 2, False, 8192, tmp_path)
    finally:
        os.close(dfd)


@needs_uring
def test_a_file_changed_after_open_is_refused(tmp_path):
    path, mem, _ = _table_file(tmp_path, "int8_row")
    t = DirectTable(path, reader="uring")
    try:
        ids = random_ids(ROWS, 4, 4)
        assert_same(t.lookup(ids, torch.float32), mem.lookup(ids, torch.float32))
        time.sleep(0.01)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 4096)
        with pytest.raises(TableFileError, match="changed in place"):
            t.lookup(ids, torch.float32)
    finally:
        t.close()


def test_forcing_an_unavailable_uring_raises_and_the_default_steps_down_aloud(tmp_path, monkeypatch):
    path, mem, _ = _table_file(tmp_path, "fp8")
    ids = random_ids(ROWS, 8, 4, seed=1)
    if not _native.available():
        with pytest.raises(NativeUnavailable):
            DirectTable(path, reader="uring")
        pytest.skip("no C kernels here: the io_uring reader cannot exist (the refusal above is what remains)")
    monkeypatch.delenv(URING_SWITCH, raising=False)
    # turned off on purpose: forcing it raises, naming the switch; the default takes the pool silently
    monkeypatch.setenv(URING_SWITCH, "0")
    with pytest.raises(UringUnavailable, match=r"turned off \(PLE_URING=0\)") as e:
        DirectTable(path, reader="uring")
    assert isinstance(e.value, PLEError) and isinstance(e.value, NativeUnavailable)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = DirectTable(path)
    try:
        assert t.reader_kind == "native"
        assert_same(t.lookup(ids, torch.bfloat16), mem.lookup(ids, torch.bfloat16))
    finally:
        t.close()
    monkeypatch.delenv(URING_SWITCH)
    # refused by the kernel (here: rings with a flag it does not know, as a seccomp filter would refuse
    # them with EPERM): forcing it raises the kernel's reason; the default steps down with a warning, once
    monkeypatch.setattr(readers_module, "URING_SETUP_FLAGS", BAD_FLAG)
    monkeypatch.setattr(readers_module, "_warned_uring", False)
    with pytest.raises(UringUnavailable, match=r"io_uring cannot read .*t-fp8\.pletable here: .*\(errno \d+\)"):
        DirectTable(path, reader="uring")
    for k in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = DirectTable(path)
        try:
            assert t.reader_kind == "native"
            assert_same(t.lookup(ids, torch.bfloat16), mem.lookup(ids, torch.bfloat16))
        finally:
            t.close()
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        if k == 0:
            assert len(said) == 1 and said[0].startswith(
                "ple: DirectTable reads with its thread pool instead of io_uring"
            )
        else:
            assert said == []
    # the pool and the Python threads stay available by name
    for reader in ("native", "threads"):
        t = DirectTable(path, reader=reader)
        try:
            assert t.reader_kind == reader
        finally:
            t.close()
    # without the C kernels, forcing io_uring names that
    monkeypatch.setenv("PLE_NATIVE", "0")
    with pytest.raises(NativeUnavailable, match="PLE_NATIVE=0"):
        DirectTable(path, reader="uring")


def test_kernel_refusals_carry_a_hint(monkeypatch, tmp_path):
    """The errno values a blocked io_uring gives are explained (EPERM: seccomp or the sysctl)."""
    if not _native.available():
        pytest.skip("no C kernels here")
    path, _, _ = _table_file(tmp_path, "fp8")
    lib = _native.library()
    monkeypatch.delenv(URING_SWITCH, raising=False)

    class Refusing:
        def __init__(self, err: int) -> None:
            self.err = err

        def __getattr__(self, name):
            if name == "ple_uring_new":
                return lambda *a: self.err
            return getattr(lib, name)

    for err, hint in ((errno.EPERM, "seccomp"), (errno.ENOSYS, "no io_uring"), (errno.ENOMEM, "ulimit -l")):
        monkeypatch.setattr(readers_module._native, "library", lambda err=err: Refusing(err))
        with pytest.raises(UringUnavailable, match=f"\\(errno {err}\\); .*{hint}"):
            DirectTable(path, reader="uring")


@needs_uring
def test_queue_depth_beyond_the_rings_is_refused(tmp_path):
    from ple.errors import InvalidArgumentError
    from ple.table.tiers.readers import URING_MAX_DEPTH

    path, mem, _ = _table_file(tmp_path, "fp8")
    with pytest.raises(InvalidArgumentError, match=f"queue_depth {URING_MAX_DEPTH + 1} .* at most {URING_MAX_DEPTH}"):
        DirectTable(path, queue_depth=URING_MAX_DEPTH + 1, reader="uring")
    t = DirectTable(path, queue_depth=URING_MAX_DEPTH, reader="uring")  # the largest: a ring of 4,096 entries
    try:
        ids = random_ids(ROWS, 64, 8, seed=9)
        assert_same(t.lookup(ids, torch.float32), mem.lookup(ids, torch.float32))
    finally:
        t.close()


@needs_uring
def test_a_child_that_cannot_set_up_its_ring_says_why(tmp_path):
    """In a forked child the reader sets up a ring of its own on first use; one the system refuses
    (here: no descriptor left, EMFILE) raises the reason instead of reading or hanging."""
    import resource

    path, mem, _ = _table_file(tmp_path, "fp8")
    t = DirectTable(path, queue_depth=4, reader="uring")
    ids = random_ids(ROWS, 8, 4, seed=2)
    try:
        assert_same(t.lookup(ids, torch.float32), mem.lookup(ids, torch.float32))

        def child():
            probe = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor
            os.close(probe)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (probe, hard))
            try:
                t.lookup(ids, torch.float32)
            except UringUnavailable as e:
                return str(e)
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            return "read"

        said = run_forked(child, tmp_path / "child.pkl")
        assert re.search(r"io_uring cannot read .*t-fp8\.pletable here: Too many open files \(errno \d+\)", said), said
        assert_same(t.lookup(ids, torch.float32), mem.lookup(ids, torch.float32))  # the parent reads on
    finally:
        t.close()
