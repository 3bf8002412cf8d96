"""The direct tier's readers: row reads with ``O_DIRECT`` into aligned buffers, bypassing the page cache.

Three readers, one contract (``read(offsets, width, align) -> bytes`` for many rows at once, from any
number of threads): io_uring rings in C (:class:`UringReader`, one ring per call in progress), a C
pool of ``pread`` threads (:class:`NativeReader`), and a Python pool (:class:`Reader`) where the C
kernels are off. :func:`default_reader` picks the first that works here; ``PLE_URING=0`` turns
io_uring off.
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

from ple.errors import InvalidArgumentError, UsageError
from ple.kernels import native as _native
from ple.table.files.table_file import TableFileError
from ple.table.forks import track

BLOCK = 4096
"""Alignment of direct reads (offsets, lengths and buffers)."""


BUFFER = 1 << 17  # bytes of each worker's aligned buffer: reads land there, then are copied out together


def aligned_buffer(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)  # anonymous maps are page aligned


class Job:
    """Pieces of ``width`` bytes at sorted file offsets, to copy into ``dest [n, width]`` (uint8):
    the aligned spans that cover them (``spans [k, 2]``: offset, length; neighbours in one block
    share a span), each piece's span and offset in it, and each span's first piece."""

    def __init__(self, offsets: np.ndarray, width: int, dest: np.ndarray) -> None:
        self.width, self.dest = width, dest
        self.spans, self.span_of, self.at = spans(offsets, width, BLOCK)
        self.first = np.searchsorted(self.span_of, np.arange(self.spans.shape[0] + 1))
        self.slot = int(self.spans[:, 1].max()) if self.spans.size else BLOCK


class Reader:
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
            buf = self._local.buf = aligned_buffer(max(need, BUFFER))
        return buf

    def _work(self, job: Job, lo: int, hi: int) -> None:
        """Read spans ``[lo, hi)`` of ``job``, a buffer's worth at a time, and copy their pieces out."""
        slot = job.slot
        per = max(1, BUFFER // slot)
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
            job = Job(offsets, width, dest)
            n = job.spans.shape[0]
            reads += n
            size = max(1, min(BUFFER // job.slot, n // (4 * self.depth)))
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


def native_reader_available() -> bool:
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


URING_FAILURES = {-2: "setting up an io_uring ring (or its buffers) for a read", -3: "io_uring_enter"}
"""``ple_read_error.got`` of an io_uring call that failed without a read (``ple_direct.c``)."""


class ReadError(ctypes.Structure):
    _fields_ = [
        ("err", ctypes.c_int32),
        ("offset", ctypes.c_int64),
        ("length", ctypes.c_int64),
        ("got", ctypes.c_int64),
    ]


class NativeReader:
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
        error = ReadError()
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
                BUFFER,
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
            if error.got in URING_FAILURES:  # no read: the io_uring itself failed
                raise TableFileError(
                    f"{self.path}: {URING_FAILURES[error.got]} failed: {os.strerror(error.err)} (errno {error.err})"
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


URING_SETUP_FLAGS = 0
"""``IORING_SETUP_*`` flags of the io_uring reader's rings."""


URING_HINTS = {
    errno.EPERM: "io_uring is forbidden here: a seccomp filter (containers' default profiles) or the sysctl "
    "kernel.io_uring_disabled",
    errno.ENOSYS: "the kernel has no io_uring, or ple was built without <linux/io_uring.h>",
    errno.EINVAL: "the kernel's io_uring has no IORING_OP_READ (Linux 5.6 or later)",
    errno.ENOMEM: "the locked-memory limit (ulimit -l) of kernels before 5.12, or out of memory",
}


class UringUnavailable(_native.NativeUnavailable):
    """The io_uring reader cannot start here (turned off, no io_uring, forbidden, or it cannot read the
    file): the message says which."""


def uring_off() -> bool:
    return os.environ.get(URING_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


class UringReader(NativeReader):
    """The io_uring reader of ``_native/ple_direct.c``: the calling thread puts up to ``depth`` reads in
    flight through a ring (one system call submits them and waits for the first completion, and each
    later one reaps what completed and refills), copies the rows out without the GIL; no other thread
    wakes up. Calls from several threads run together, each on a ring of its own (taken from the
    reader's idle rings, a new one when all are in use). A forked child sets up rings of its own on its
    first read (the parent's are neither inherited nor used there)."""

    kind = "uring"

    def __init__(self, fd: int, depth: int, drop_cache: bool, size: int, path: Path) -> None:
        if uring_off():
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
        err = self._lib.ple_uring_new(*self._args, URING_SETUP_FLAGS, ctypes.byref(handle))
        if err:
            hint = URING_HINTS.get(err)
            raise UringUnavailable(
                f"io_uring cannot read {self.path} here: {os.strerror(err)} (errno {err})"
                + (f"; {hint}" if hint else "")
            )
        return handle


_warned_uring = False


def default_reader(fd: int, depth: int, drop_cache: bool, size: int, path: Path) -> Reader | NativeReader:
    """The reader ``reader=None`` takes: io_uring, else the native thread pool, else Python threads. A
    step down warns once with the reason, unless it was turned off on purpose (``PLE_URING=0``,
    ``PLE_NATIVE=0``)."""
    global _warned_uring
    if not native_reader_available():
        return Reader(fd, depth, drop_cache, size, path)
    if not uring_off():
        try:
            return UringReader(fd, depth, drop_cache, size, path)
        except UringUnavailable as e:
            if not _warned_uring:
                _warned_uring = True
                warnings.warn(
                    f"ple: DirectTable reads with its thread pool instead of io_uring: {e}",
                    RuntimeWarning,
                    stacklevel=4,
                )
    return NativeReader(fd, depth, drop_cache, size, path)


def spans(offsets: np.ndarray, width: int, align: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
