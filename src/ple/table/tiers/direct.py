"""``DirectTable``: a table file read row by row with direct reads, bypassing the page cache.

A memory map (:class:`~ple.table.MmapTable`) reads a row by faulting its page in: one read at a time
per thread, at the page cache's mercy (a neighbour's memory pressure evicts the table and decode
slows down by the cold read time). This tier instead, for each lookup:

1. deduplicates and sorts the step's row ids (``np.unique``);
2. serves the rows its own cache holds (a bounded LRU of rows in memory within ``memory_budget``; rows
   given to :meth:`DirectTable.pin` stay there for good);
3. reads the others with up to ``queue_depth`` reads in flight (32 by default), by one of three readers
   (``reader=``; ``reader_kind`` says which runs), each a single call per lookup:

   - ``"uring"`` (the default where it starts): the calling thread keeps the reads in flight through
     an ``io_uring`` (``_native/ple_direct.c``, raw system calls, Linux 5.6+), a few submitted at a
     time, refilled as they complete, the rows copied out without the GIL; no other thread wakes up.
     Concurrent lookups each take a ring of their own from the reader's idle rings. About half the
     CPU time per read of the pool, at the same rate (docs/PERFORMANCE.md);
   - ``"native"``: a pool of ``queue_depth`` POSIX threads (the same C file), each taking the next of
     the sorted reads as it finishes one (``pread``), woken per lookup;
   - ``"threads"``: Python threads doing the same, at a higher cost per read (without the C kernels).

   Where io_uring cannot start (a kernel before 5.6, a seccomp filter, ``kernel.io_uring_disabled``)
   the default takes the native pool and warns once with the reason; ``PLE_URING=0`` turns io_uring
   off on purpose (no warning). A reader asked for by name that cannot start raises the reason
   (:class:`UringUnavailable`, :class:`~ple.kernels.native.NativeUnavailable`). Reads open the file
   with ``O_DIRECT`` where the file system allows it, into 4 KiB-aligned buffers, whole aligned
   blocks around each row (neighbouring rows in one block share a read);
   elsewhere (tmpfs, some network file systems) plain reads, each followed by
   ``posix_fadvise(DONTNEED)`` on the range it read, so no cached pages stay behind. ``direct``
   says which (``"odirect"`` or ``"dontneed"``);
4. gathers and dequantizes from the compact block of rows it read, with the same kernel every tier
   uses, so outputs equal the in-memory table's bit for bit.

Rows are read generically: ``row_nbytes`` bytes at ``data_offset + row * row_nbytes``, whatever the
format. The file keeps per-row scales apart from the rows (after all rows, 4 bytes each), so a row
of a per-row-scale format costs a second read for its scale's block: the scale reads are issued
together with the row reads, in the same batch, and one 4 KiB block of scales serves 1,024
neighbouring rows. A global scale is read once at open.

Resident memory: the cache (its slots plus a bookkeeping allowance of :data:`SLOT_OVERHEAD` bytes
per slot, all within ``memory_budget``), one aligned buffer per read in flight (as wide as the
widest read of a lookup: a block or two for scattered rows, at most 128 KiB; more for rows over 64
KiB; the io_uring reader has such buffers per lookup in progress) and a lookup's own rows while it
runs. Nothing is mapped and the page cache is neither used
nor filled.

Like a memory map, the file must not be changed in place: every lookup compares its size and
modification time with those at open first.

Threads and processes: lookups from several threads run together. The cache's index, slots and
recency stamps are changed under one lock, held for the bookkeeping and the copy of the hits only,
never across a read; a row two lookups missed at once is admitted once (the second finds it held).
The reader serves the calls of several threads together (each io_uring call on a ring of its own;
the native pool takes its next read from the oldest call that has reads left). In a child forked
after the table was opened the parent's reader threads do not exist and its rings are neither
inherited nor used: the child starts its own reader on its first read (see :mod:`.forks`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import mmap
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from ple.errors import InvalidArgumentError, UsageError
from ple.kernels import native as _native
from ple.table.base import Table
from ple.table.files.table_file import TableFileError, open_table
from ple.table.forks import track
from ple.table.formats.catalog import format_info
from ple.table.lookup import gather_dequant
from ple.table.tiers.rowindex import RowIndex

__all__ = ["DirectTable", "SLOT_OVERHEAD", "BLOCK", "URING_SWITCH", "UringUnavailable"]

BLOCK = 4096
"""Alignment of direct reads (offsets, lengths and buffers)."""

SLOT_OVERHEAD = 96
"""Bytes counted per cache slot on top of the row and its scale: its share of the row index (at most
48, see :mod:`ple.table.tiers.rowindex`), its place in the free-slot stack (8), its row id and its recency
stamp (16)."""

_PINNED = np.iinfo(np.int64).max
"""The recency stamp of a pinned slot (never evicted)."""

_BUFFER = 1 << 17  # bytes of each worker's aligned buffer: reads land there, then are copied out together


def _aligned_buffer(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)  # anonymous maps are page aligned


class _Job:
    """Pieces of ``width`` bytes at sorted file offsets, to copy into ``dest [n, width]`` (uint8):
    the aligned spans that cover them (``spans [k, 2]``: offset, length; neighbours in one block
    share a span), each piece's span and offset in it, and each span's first piece."""

    def __init__(self, offsets: np.ndarray, width: int, dest: np.ndarray) -> None:
        self.width, self.dest = width, dest
        self.spans, self.span_of, self.at = _spans(offsets, width, BLOCK)
        self.first = np.searchsorted(self.span_of, np.arange(self.spans.shape[0] + 1))
        self.slot = int(self.spans[:, 1].max()) if self.spans.size else BLOCK


class _Reader:
    """Issues sorted block reads from ``depth`` Python worker threads, each with its own aligned
    buffer (the reader when the native one is not used). Calls from several threads share the
    workers; a forked child starts workers of its own on its first read."""

    kind = "threads"

    def __init__(self, fd: int, depth: int, drop_cache: bool, size: int, path: Path) -> None:
        self.fd = fd
        self.size = size
        self.depth = depth
        self.drop_cache = drop_cache
        self.path = path
        self._guard = threading.Lock()  # the pool (started again after a fork) and the count of reads
        self._reads = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._start()
        track(self)

    @property
    def reads(self) -> int:
        return self._reads

    def _start(self) -> None:
        self._local = threading.local()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="ple-direct")
        # start every worker now (the pool starts threads lazily, which would cost the first lookup)
        gate = threading.Barrier(self.depth + 1)
        started = [pool.submit(gate.wait) for _ in range(self.depth)]
        gate.wait()
        for f in started:
            f.result()
        self._pool = pool

    def _fork_locks(self) -> list[threading.Lock]:
        return [self._guard]

    def _after_fork_in_child(self) -> None:
        self._pool = None  # the parent's workers: none of them runs here

    def _buffer(self, need: int) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < need:
            buf = self._local.buf = _aligned_buffer(max(need, _BUFFER))
        return buf

    def _work(self, job: _Job, lo: int, hi: int) -> None:
        """Read spans ``[lo, hi)`` of ``job``, a buffer's worth at a time, and copy their pieces out."""
        slot = job.slot
        per = max(1, _BUFFER // slot)
        buf = self._buffer(per * slot)
        view = memoryview(buf)
        arr = np.frombuffer(buf, dtype=np.uint8)
        spans = job.spans[lo:hi].tolist()
        fd, size, drop, path = self.fd, self.size, self.drop_cache, self.path
        cols = np.arange(job.width)
        for k in range(0, len(spans), per):
            group = spans[k : k + per]
            for j, (off, n) in enumerate(group):
                got = os.preadv(fd, [view[j * slot : j * slot + n]], off)
                if got < min(n, size - off):  # an aligned read may run past the end of the file
                    raise TableFileError(
                        f"{path}: reading {n} bytes at byte {off}: short read, {got} bytes (was the file truncated?)"
                    )
                if drop:
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
            a, b = job.first[lo + k], job.first[lo + k + len(group)]
            src = (job.span_of[a:b] - (lo + k)) * slot + job.at[a:b]
            job.dest[a:b] = arr[src[:, None] + cols]

    def read(self, pieces: list[tuple[np.ndarray, int, np.ndarray]]) -> None:
        """Read every ``(offsets, width, dest)`` on the workers: each takes the next group of spans
        as it finishes its last (a shared queue, so no worker waits on a slow share while others idle)."""
        groups = []
        reads = 0
        for offsets, width, dest in pieces:
            job = _Job(offsets, width, dest)
            n = job.spans.shape[0]
            reads += n
            size = max(1, min(_BUFFER // job.slot, n // (4 * self.depth)))
            groups += [(job, lo, min(n, lo + size)) for lo in range(0, n, size)]
        with self._guard:
            if self._closed:
                raise UsageError(f"table file {self.path} was closed")
            if self._pool is None:  # a forked child: workers of its own
                self._start()
            pool = self._pool
            assert pool is not None
            self._reads += reads
        if not groups:
            return
        queue = iter(groups)  # next() on a list iterator is atomic: each group goes to one worker

        def drain() -> None:
            for job, lo, hi in queue:
                self._work(job, lo, hi)

        futures = [pool.submit(drain) for _ in range(min(self.depth, len(groups)))]
        for f in futures:
            f.result()

    def close(self, wait: bool = True) -> None:
        with self._guard:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait)


_warned_threads = False


def _native_reader_available() -> bool:
    """Whether the native reader loads; warns once, with the reason, when it was wanted but does
    not (``PLE_NATIVE=0`` turns it off without a warning)."""
    global _warned_threads
    try:
        _native.library()
        return True
    except _native.NativeUnavailable as e:
        off = os.environ.get("PLE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")
        if not off and not _warned_threads:
            _warned_threads = True
            warnings.warn(
                f"ple: DirectTable reads with Python threads (a fraction of the device's rate): {e}",
                RuntimeWarning,
                stacklevel=3,
            )
        return False


_URING_FAILURES = {-2: "setting up an io_uring ring (or its buffers) for a read", -3: "io_uring_enter"}
"""``ple_read_error.got`` of an io_uring call that failed without a read (``ple_direct.c``)."""


class _ReadError(ctypes.Structure):
    _fields_ = [
        ("err", ctypes.c_int32),
        ("offset", ctypes.c_int64),
        ("length", ctypes.c_int64),
        ("got", ctypes.c_int64),
    ]


class _NativeReader:
    """The C reader of ``_native/ple_direct.c``: ``depth`` POSIX threads issue the reads (one
    ``pread`` each, in flight together) and copy the rows out, without the GIL; one call per lookup,
    calls from several threads served together. A forked child starts threads of its own on its
    first read (the parent's reader is left untouched there: its threads belong to the parent)."""

    kind = "native"

    def __init__(self, fd: int, depth: int, drop_cache: bool, size: int, path: Path) -> None:
        self._lib = _native.library()  # NativeUnavailable with the reason
        self._read_fn, self._free_fn = self._functions()
        self.path = path
        self.depth = depth
        self._args = (fd, depth, BLOCK, int(drop_cache), size)
        self._guard = threading.Lock()  # the handle, its users and the count of reads
        self._users = 0
        self._closed = False
        self._reads = 0
        self._handle: ctypes.c_void_p | None = self._new_handle()
        track(self)

    def _functions(self) -> tuple:
        return self._lib.ple_reader_read, self._lib.ple_reader_free

    def _new_handle(self) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        err = self._lib.ple_reader_new(*self._args, ctypes.byref(handle))
        if err:
            raise OSError(err, f"starting {self.depth} reader threads for {self.path}: {os.strerror(err)}")
        return handle

    @property
    def reads(self) -> int:
        return self._reads

    def _fork_locks(self) -> list[threading.Lock]:
        return [self._guard]

    def _after_fork_in_child(self) -> None:
        # the parent's reader (its threads, its locks) is neither used nor freed here: a new one on first use
        self._handle = None
        self._users = 0

    def read(self, pieces: list[tuple[np.ndarray, int, np.ndarray]]) -> None:
        """Read every ``(offsets, width, dest)``: ``width`` bytes at each of the sorted ``offsets``
        (int64), into the rows of ``dest [n, width]`` (uint8, C-contiguous). The pieces' offsets
        taken together must be sorted (rows, then their scales, which follow the rows in the file)."""
        parts = [(o, w, d) for o, w, d in pieces if o.size]
        if not parts:
            return
        offsets = np.ascontiguousarray(np.concatenate([o for o, _, _ in parts]), dtype=np.int64)
        lengths = np.concatenate([np.full(o.size, w, dtype=np.int64) for o, w, _ in parts])
        dests = np.concatenate([d.ctypes.data + w * np.arange(o.size, dtype=np.uint64) for o, w, d in parts])
        error = _ReadError()
        with self._guard:
            if self._closed:
                raise UsageError(f"table file {self.path} was closed")
            if self._handle is None:  # a forked child: threads of its own
                self._handle = self._new_handle()
            handle = self._handle
            self._users += 1
        got = -1
        try:
            got = self._read_fn(
                handle,
                offsets.size,
                offsets.ctypes.data,
                lengths.ctypes.data,
                dests.ctypes.data,
                _BUFFER,
                ctypes.byref(error),
            )
        finally:
            with self._guard:
                self._users -= 1
                if got > 0:
                    self._reads += got
                last = self._closed and self._users == 0 and self._handle is handle
                if last:
                    self._handle = None
            if last:
                self._free_fn(handle)  # closed while this read ran
        if got < 0:
            if error.got in _URING_FAILURES:  # no read: the io_uring itself failed
                raise TableFileError(
                    f"{self.path}: {_URING_FAILURES[error.got]} failed: {os.strerror(error.err)} (errno {error.err})"
                )
            where = f"{self.path}: reading {error.length} bytes at byte {error.offset}"
            if error.err:
                raise TableFileError(f"{where} failed: {os.strerror(error.err)} (errno {error.err})")
            raise TableFileError(f"{where}: short read, {error.got} bytes (was the file truncated?)")

    def close(self, wait: bool = True) -> None:
        with self._guard:
            self._closed = True
            handle = self._handle if self._users == 0 else None  # else the last read in flight frees it
            if handle is not None:
                self._handle = None
        if handle is not None:
            self._free_fn(handle)


URING_SWITCH = "PLE_URING"
"""The environment switch that turns the io_uring reader off (``PLE_URING=0``): ``reader=None`` then
takes the thread pool without a warning, and ``reader="uring"`` raises :class:`UringUnavailable`
(what a machine without io_uring does; the tests use it to check that path)."""

URING_MAX_DEPTH = 4096
"""The io_uring reader's largest ``queue_depth`` (``PLE_URING_MAX_DEPTH`` of ``ple_direct.c``)."""

_URING_SETUP_FLAGS = 0
"""``IORING_SETUP_*`` flags of the io_uring reader's rings."""

_URING_HINTS = {
    errno.EPERM: "io_uring is forbidden here: a seccomp filter (containers' default profiles) or the sysctl "
    "kernel.io_uring_disabled",
    errno.ENOSYS: "the kernel has no io_uring, or ple was built without <linux/io_uring.h>",
    errno.EINVAL: "the kernel's io_uring has no IORING_OP_READ (Linux 5.6 or later)",
    errno.ENOMEM: "the locked-memory limit (ulimit -l) of kernels before 5.12, or out of memory",
}


class UringUnavailable(_native.NativeUnavailable):
    """The io_uring reader cannot start here (turned off, no io_uring, forbidden, or it cannot read the
    file): the message says which."""


def _uring_off() -> bool:
    return os.environ.get(URING_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


class _UringReader(_NativeReader):
    """The io_uring reader of ``_native/ple_direct.c``: the calling thread puts up to ``depth`` reads in
    flight through a ring (one system call submits them and waits for the first completion, and each
    later one reaps what completed and refills), copies the rows out without the GIL; no other thread
    wakes up. Calls from several threads run together, each on a ring of its own (taken from the
    reader's idle rings, a new one when all are in use). A forked child sets up rings of its own on its
    first read (the parent's are neither inherited nor used there)."""

    kind = "uring"

    def __init__(self, fd: int, depth: int, drop_cache: bool, size: int, path: Path) -> None:
        if _uring_off():
            raise UringUnavailable(f"the io_uring reader is turned off ({URING_SWITCH}=0)")
        if depth > URING_MAX_DEPTH:
            raise InvalidArgumentError(
                f"queue_depth {depth} is more reads in flight than the io_uring reader keeps: at most {URING_MAX_DEPTH}"
            )
        super().__init__(fd, depth, drop_cache, size, path)

    def _functions(self) -> tuple:
        return self._lib.ple_uring_read, self._lib.ple_uring_free

    def _new_handle(self) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        err = self._lib.ple_uring_new(*self._args, _URING_SETUP_FLAGS, ctypes.byref(handle))
        if err:
            hint = _URING_HINTS.get(err)
            raise UringUnavailable(
                f"io_uring cannot read {self.path} here: {os.strerror(err)} (errno {err})"
                + (f"; {hint}" if hint else "")
            )
        return handle


_warned_uring = False


def _default_reader(fd: int, depth: int, drop_cache: bool, size: int, path: Path) -> _Reader | _NativeReader:
    """The reader ``reader=None`` takes: io_uring, else the native thread pool, else Python threads. A
    step down warns once with the reason, unless it was turned off on purpose (``PLE_URING=0``,
    ``PLE_NATIVE=0``)."""
    global _warned_uring
    if not _native_reader_available():
        return _Reader(fd, depth, drop_cache, size, path)
    if not _uring_off():
        try:
            return _UringReader(fd, depth, drop_cache, size, path)
        except UringUnavailable as e:
            if not _warned_uring:
                _warned_uring = True
                warnings.warn(
                    f"ple: DirectTable reads with its thread pool instead of io_uring: {e}",
                    RuntimeWarning,
                    stacklevel=4,
                )
    return _NativeReader(fd, depth, drop_cache, size, path)


def _spans(offsets: np.ndarray, width: int, align: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Aligned read spans covering ``width`` bytes at each of the sorted ``offsets``: pieces that
    start in the same aligned block share one span. Returns ``spans [k, 2]`` (offset, length), and
    per piece its span index and its offset within that span."""
    start = offsets - offsets % align
    end = offsets + width
    end = end + (-end) % align
    if not offsets.size:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    starts, first, span_of = np.unique(start, return_index=True, return_inverse=True)
    ends = np.maximum.reduceat(end, first)
    return np.stack([starts, ends - starts], axis=1), span_of.reshape(-1), offsets - starts[span_of.reshape(-1)]


class DirectTable(Table):
    """A table served from its file with direct reads and a bounded row cache (CPU; ids on an
    accelerator get their rows copied there). See the module docstring.

    Args:
        path: a complete table file (validated like :meth:`MmapTable.open`, per-row scales checked).
        expected_layout_hash: refuse a file built for another layout (hash or fields dict).
        memory_budget: bytes of rows this table may keep in memory, its row cache (0: none); slots
            are ``row_nbytes + 4 + SLOT_OVERHEAD`` bytes each. The read buffers (``queue_depth`` x
            128 KiB) come on top.
        queue_depth: reads in flight (>= 1; 32 by default): the pools' worker threads, the io_uring
            reader's reads per lookup (at most :data:`URING_MAX_DEPTH`).
        direct: ``None`` (O_DIRECT where possible), ``True`` (O_DIRECT or an error), ``False``
            (plain reads dropped from the page cache after each).
        reader: who issues the reads: ``"uring"`` (the io_uring reader of ``_native/ple_direct.c``,
            or :class:`UringUnavailable` with the reason: turned off by ``PLE_URING=0``, refused by
            the kernel, or no C kernels), ``"native"`` (the C thread pool, or
            :class:`~ple.kernels.native.NativeUnavailable` with the reason), ``"threads"`` (Python threads
            calling ``os.preadv``: about half the device's rate on a 2-core machine), or ``None``:
            io_uring where it starts, else the native pool, else threads, each step down with a
            warning that gives the reason (once; ``PLE_URING=0`` and ``PLE_NATIVE=0`` turn them off
            on purpose, without one). ``reader_kind`` says which one runs.
    """

    _unpicklable = "reads its file through reader threads"

    def __init__(
        self,
        path: str | os.PathLike,
        expected_layout_hash: str | dict | None = None,
        *,
        memory_budget: int = 0,
        queue_depth: int = 32,
        direct: bool | None = None,
        reader: str | None = None,
    ) -> None:
        for name, v, lo in (("memory_budget", memory_budget, 0), ("queue_depth", queue_depth, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {v!r}")
        if reader not in (None, "uring", "native", "threads"):
            raise InvalidArgumentError(f"reader must be 'uring', 'native', 'threads' or None, got {reader!r}")
        path = Path(path)
        fd, header, st = open_table(path, expected_layout_hash)
        super().__init__(header["format"], header["rows"], header["head_dim"])
        self.path = path
        self.header = header
        self._fd = fd
        self._stat = (st.st_size, st.st_mtime_ns)
        self._row_nbytes = int(header["row_nbytes"])
        self._data_offset = int(header["data_offset"])
        info = format_info(self.format)
        self._storage = info.storage_dtype
        if self._row_nbytes % self._storage.itemsize:
            raise TableFileError(f"{path}: row_nbytes {self._row_nbytes} is not a whole number of {self._storage}")
        kind = header["scale"]["kind"]
        self._scale_kind = kind
        self._scale_offset = int(header["scale"]["offset"])
        self._global_scale: torch.Tensor | None = None
        if kind == "global":
            raw = os.pread(fd, 4, self._scale_offset)
            self._global_scale = torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # what validation read leaves no trace
        self._rfd, self.direct = self._open_reader(path, fd, direct)
        make = {None: _default_reader, "uring": _UringReader, "native": _NativeReader, "threads": _Reader}[reader]
        try:
            self._reader: _Reader | _NativeReader = make(
                self._rfd, queue_depth, self.direct == "dontneed", st.st_size, path
            )
        except BaseException:
            if self._rfd != fd:
                os.close(self._rfd)
            os.close(fd)
            self._fd = -1
            raise
        self.reader_kind = self._reader.kind
        self.queue_depth = queue_depth
        self.memory_budget = memory_budget
        self._slot_bytes = self._row_nbytes + (4 if kind == "row" else 0) + SLOT_OVERHEAD
        slots = min(memory_budget // self._slot_bytes, self.rows)
        self._cache_rows = np.zeros((slots, self._row_nbytes), dtype=np.uint8)
        self._cache_scales = np.zeros(slots if kind == "row" else 0, dtype=np.float32)
        self._cache_used = np.full(slots, -1, dtype=np.int64)  # recency stamp; -1 free, _PINNED pinned
        self._row_of_slot = np.zeros(slots, dtype=np.int64)
        self._slot_of = RowIndex(slots)  # row id -> slot, numpy arrays (a dict costs 120 bytes a row)
        self._free = np.empty(slots, dtype=np.int64)  # free slots: _free[:_nfree] recycled, then [_fresh, slots)
        self._nfree = 0
        self._fresh = 0
        self._pinned = 0
        self._clock = 0
        self._admissions = 0  # calls of _to_cache that admitted rows: a miss seen before none is still a miss
        self._lock = threading.Lock()  # the cache: index, slots, recency, free list; hits and misses
        self.hits = 0
        self.misses = 0

    def _fork_locks(self) -> list[threading.Lock]:
        return [*super()._fork_locks(), self._lock]

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        expected_layout_hash: str | dict | None = None,
        *,
        memory_budget: int = 0,
        queue_depth: int = 32,
        direct: bool | None = None,
        reader: str | None = None,
    ) -> DirectTable:
        """Open a complete table file for direct reads, as :meth:`MmapTable.open` maps one (the same
        validation); the arguments are the constructor's (see the class docstring)."""
        return cls(
            path,
            expected_layout_hash,
            memory_budget=memory_budget,
            queue_depth=queue_depth,
            direct=direct,
            reader=reader,
        )

    @staticmethod
    def _open_reader(path: Path, fd: int, direct: bool | None) -> tuple[int, str]:
        if direct is not False and hasattr(os, "O_DIRECT"):
            try:
                rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:
                rfd = -1
            if rfd >= 0:
                probe = _aligned_buffer(BLOCK)
                try:
                    os.preadv(rfd, [probe], 0)
                    a, b = os.fstat(rfd), os.fstat(fd)
                    if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                        return rfd, "odirect"
                except OSError:
                    pass
                finally:
                    probe.close()
                os.close(rfd)
        if direct is True:
            raise TableFileError(f"{path}: its file system does not allow O_DIRECT reads (use direct=None or False)")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: only the pages read are cached, then dropped
        return fd, "dontneed"

    # ------------------------------------------------------------------ Table
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Bytes this table holds in memory: its cache (rows, scales and bookkeeping) and buffers."""
        return self._cache_rows.shape[0] * self._slot_bytes + self.queue_depth * _BUFFER

    @property
    def global_scale(self) -> torch.Tensor | None:
        return self._global_scale

    @property
    def cache_slots(self) -> int:
        return int(self._cache_rows.shape[0])

    @property
    def pinned_rows(self) -> int:
        """Rows held in the cache for good (:meth:`pin`)."""
        return self._pinned

    def check_file(self) -> None:
        """Raise :class:`TableFileError` if the file was changed in place since it was opened."""
        if self._fd < 0:
            raise UsageError(f"table file {self.path} was closed")
        st = os.fstat(self._fd)
        if (st.st_size, st.st_mtime_ns) != self._stat:
            raise TableFileError(
                f"{self.path} was changed in place while open (now {st.st_size} bytes, {self._stat[0]} at open): "
                "replace table files by renaming a new file over the old one, then open it again"
            )

    def read_rows(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stored rows ``[n, row_nbytes / itemsize]`` (storage dtype) and their scales (``[n, 1]``
        float32 per-row, ``[1]`` global, or None) of the sorted distinct ``rows`` (int64), from the
        cache or the file."""
        self.check_file()
        n = rows.size
        out = np.empty((n, self._row_nbytes), dtype=np.uint8)
        per_row = self._scale_kind == "row"
        scales = np.empty(n, dtype=np.float32) if per_row else None
        miss, seen = self._from_cache(rows, out, scales)
        if miss.size:
            every = miss.size == n  # nothing from the cache: the reads land in ``out`` itself
            mrows = rows if every else rows[miss]
            mout = out if every else np.empty((miss.size, self._row_nbytes), dtype=np.uint8)
            pieces = [(self._data_offset + mrows * self._row_nbytes, self._row_nbytes, mout)]
            mscale = None
            if per_row:
                mscale_bytes = np.empty((miss.size, 4), dtype=np.uint8)
                pieces.append((self._scale_offset + 4 * mrows, 4, mscale_bytes))
            self._reader.read(pieces)
            if not every:
                out[miss] = mout
            if per_row:
                mscale = mscale_bytes.view("<f4").reshape(-1).astype(np.float32)
                assert scales is not None
                scales[miss] = mscale
            self._to_cache(mrows, mout, mscale, seen=seen)
        data = torch.from_numpy(out).view(self._storage)
        if per_row:
            assert scales is not None
            return data, torch.from_numpy(scales).view(-1, 1)
        return data, self._global_scale

    def _from_cache(self, rows: np.ndarray, out: np.ndarray, scales: np.ndarray | None) -> tuple[np.ndarray, int]:
        """Fill what the cache holds; return the indices (into ``rows``) it does not, and the count of
        admissions then (see :meth:`_to_cache`).

        Under the cache's lock: the slots' rows are copied out before another lookup can evict them."""
        if not self._cache_rows.shape[0]:
            with self._lock:
                self.misses += rows.size
            return np.arange(rows.size), 0
        with self._lock:
            self._clock += 1
            slots = self._slot_of.get(rows)
            hit = slots >= 0
            hs = slots[hit]
            out[hit] = self._cache_rows[hs]
            if scales is not None:
                scales[hit] = self._cache_scales[hs]
            stamp = self._cache_used[hs]
            self._cache_used[hs] = np.where(stamp == _PINNED, stamp, self._clock)
            n_hit = int(hs.size)
            self.hits += n_hit
            self.misses += rows.size - n_hit
            seen = self._admissions
        return np.nonzero(~hit)[0], seen

    def _to_cache(
        self, rows: np.ndarray, data: np.ndarray, scales: np.ndarray | None, pin: bool = False, seen: int = -1
    ) -> None:
        """Admit ``rows`` (distinct ids) with their stored bytes ``data [n, row_nbytes]`` and scales.

        Rows the cache already holds are left where they are (another lookup read them meanwhile: the
        same bytes); with ``pin`` they are pinned there. Each row has at most one slot. ``seen``: the
        count of admissions when the rows were found missing (:meth:`_from_cache`); with no admission
        since, they are still missing and are not looked up again."""
        cap = self._cache_rows.shape[0]
        if not cap or not rows.size:
            return
        with self._lock:
            slot_of = self._slot_of
            if pin or seen != self._admissions:
                held = slot_of.get(rows)
                if pin:
                    hs = held[held >= 0]
                    loose = hs[self._cache_used[hs] != _PINNED]
                    self._cache_used[loose] = _PINNED
                    self._pinned += int(loose.size)
                new = np.nonzero(held < 0)[0]
            else:
                new = np.arange(rows.size)
            n = new.size if pin else min(new.size, cap - self._pinned)
            if n <= 0:
                return
            if self._free_slots() < n:
                self._evict(n - self._free_slots())
            n = min(n, self._free_slots())
            new = new[:n]
            slots = self._take_slots(n)
            self._cache_rows[slots] = data[new]
            if scales is not None:
                self._cache_scales[slots] = scales[new]
            self._cache_used[slots] = _PINNED if pin else self._clock
            self._row_of_slot[slots] = rows[new]
            slot_of.put(rows[new], slots)
            self._admissions += 1
            if pin:
                self._pinned += n

    def _evict(self, need: int) -> None:
        """Free the ``need`` least recently used unpinned slots, or 1/16 of the cache, whichever is more
        (the caller holds the lock)."""
        used = self._cache_used
        held = np.nonzero((used >= 0) & (used != _PINNED))[0]
        k = min(max(need, used.size // 16), held.size)
        if k <= 0:
            return
        victims = held[np.argpartition(used[held], k - 1)[:k]]
        self._slot_of.delete(self._row_of_slot[victims])
        used[victims] = -1
        self._give_slots(victims)

    def _free_slots(self) -> int:
        return self._nfree + self._cache_rows.shape[0] - self._fresh

    def _take_slots(self, n: int) -> np.ndarray:
        """``n`` free slots (recycled ones first, then never used ones; the caller holds the lock)."""
        k = min(n, self._nfree)
        took = self._free[self._nfree - k : self._nfree].copy()
        self._nfree -= k
        fresh = np.arange(self._fresh, self._fresh + n - k, dtype=np.int64)
        self._fresh += n - k
        return np.concatenate([took, fresh])

    def _give_slots(self, slots: np.ndarray) -> None:
        self._free[self._nfree : self._nfree + slots.size] = slots
        self._nfree += slots.size

    def pin(self, rows: torch.Tensor | np.ndarray) -> int:
        """Keep ``rows`` (row ids, any shape; the hottest first) in memory for good, as many as the
        cache holds; returns how many are pinned now. Use the rows a warmup stream reads most (see
        :meth:`hot_rows`)."""
        r = np.asarray(rows.cpu().numpy() if isinstance(rows, torch.Tensor) else rows, dtype=np.int64).reshape(-1)
        if r.size and (r.min() < 0 or r.max() >= self.rows):
            raise InvalidArgumentError(f"pinned rows must lie in [0, {self.rows})")
        _, first = np.unique(r, return_index=True)
        r = r[np.sort(first)]
        with self._lock:
            held = self._slot_of.get(r)
            loose = (held < 0) | (self._cache_used[np.maximum(held, 0)] != _PINNED)  # not pinned yet
            r = r[loose][: max(0, self.cache_slots - self._pinned)]
        if r.size:
            order = np.argsort(r)
            data, scale = self.read_rows(r[order])  # may admit them unpinned; pinned where they are below
            raw = data.view(torch.uint8).numpy()
            sc = scale.reshape(-1).numpy() if scale is not None and self._scale_kind == "row" else None
            self._to_cache(r[order], raw, sc, pin=True)
        return self._pinned

    @staticmethod
    def hot_rows(ids: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` rows read most often by ``ids`` (any shape), hottest first: what to :meth:`pin`."""
        rows, counts = torch.unique(ids.reshape(-1), return_counts=True)
        k = min(int(count), rows.numel())
        return rows[torch.topk(counts, k).indices] if k else rows[:0]

    def _lookup_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        flat = ids.reshape(-1).cpu().numpy()
        rows, inverse = np.unique(flat, return_inverse=True)
        data, scale = self.read_rows(rows)
        local = torch.from_numpy(inverse.reshape(ids.shape).astype(np.int64))
        dev = out.device
        if dev.type == "cpu":
            gather_dequant(data, scale, local, out.dtype, out=out, check=False, format=self.format)
        else:
            res = gather_dequant(data, scale, local, out.dtype, check=False, format=self.format)
            out.copy_(res.to(dev))

    @property
    def layout_hash(self) -> str:
        return self.header["layout_hash"]

    @property
    def reads(self) -> int:
        """Reads issued to the file since open (rows and scale blocks; neighbours in one block count once)."""
        return self._reader.reads

    def close(self) -> None:
        """Stop prefetching and the readers; close the file."""
        super().close()
        if self._fd >= 0:
            self._reader.close()
            if self._rfd != self._fd:
                os.close(self._rfd)
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            self._fd = -1
            reader = getattr(self, "_reader", None)
            if reader is not None:
                reader.close(wait=False)
            rfd = getattr(self, "_rfd", fd)
            if rfd != fd:
                os.close(rfd)
            os.close(fd)
