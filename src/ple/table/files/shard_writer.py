"""Writing one shard of a table file in order, in parts, at the disk's speed.

A :class:`ShardWriter` (made by :meth:`ple.table.files.table_file.TableFileWriter.shard_writer`) hashes each
part's bytes as they come (blake2b-128: the shard's checksum covers its row bytes, then its per-row
scale bytes) and writes them at their place: the whole pages inside the shard with ``O_DIRECT`` from
a staging buffer of 8 MiB (no copy into the page cache, no dirty pages to write back: about a sixth
of the cycles of a write through the page cache), the part of a page it shares with the shard before
or after it through the page cache. Several shards are written at once, each by its own thread.

:func:`matching_shards` hashes shards as they lie in a file again: a resumed conversion keeps only
the finished shards of its temporary file whose bytes still give the checksums recorded as they were
written.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ple.errors import InvalidArgumentError
from ple.table.formats.catalog import check_scale_values

__all__ = ["DIGEST_SIZE", "ShardWriter", "matching_shards", "open_direct", "pwrite_all"]

DIGEST_SIZE = 16
"""Bytes of each checksum (blake2b with this digest size)."""


def pwrite_all(fd: int, buf, offset: int) -> None:
    """Every byte of ``buf`` at ``offset`` of ``fd`` (``pwrite`` may write less than asked)."""
    view = memoryview(buf).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


_PAGE = 4096
_STAGE_BYTES = 8 << 20


def open_direct(path: Path, ident: os.stat_result | None) -> int:
    """A second descriptor of the temporary file for ``O_DIRECT`` writes, or -1 where the file system
    has none (the rows are then written through the page cache)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or ident is None:
        return -1
    try:
        fd = os.open(path, os.O_WRONLY | flag | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return -1
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (ident.st_dev, ident.st_ino):
        os.close(fd)
        return -1
    return fd


class ShardWriter:
    """Shard ``k``'s rows ``[start, stop)`` of the writer ``w`` (a
    :class:`~ple.table.files.table_file.TableFileWriter`), written in order in parts (see the module
    docstring); :meth:`finish` records the checksum."""

    def __init__(self, w: Any, k: int, start: int, stop: int) -> None:
        self.w, self.k, self.start, self.stop, self.at = w, k, start, stop, start
        self._hash = None if w.sparse else hashlib.blake2b(digest_size=DIGEST_SIZE)
        self._scales: list[np.ndarray] = []
        self._off = w.row_place(start)  # the next row byte's place in the file
        self._stage: mmap.mmap | None = None
        self._fill = 0  # bytes staged
        self._stage_at = 0  # where the staged bytes go (a page boundary)

    def _put(self, data: memoryview) -> None:
        w = self.w
        if not w.direct:
            w.pwrite(data, self._off)
            self._off += len(data)
            return
        if self._stage is None:  # up to the first page boundary through the page cache
            head = min(len(data), -self._off % _PAGE)
            if head:
                w.pwrite(data[:head], self._off)
                self._off += head
                data = data[head:]
            if not len(data):
                return
            self._stage, self._stage_at = mmap.mmap(-1, _STAGE_BYTES), self._off
        while len(data):
            take = min(len(data), _STAGE_BYTES - self._fill)
            self._stage[self._fill : self._fill + take] = data[:take]
            self._fill += take
            self._off += take
            data = data[take:]
            if self._fill == _STAGE_BYTES:
                self._flush(_STAGE_BYTES)

    def _flush(self, n: int) -> None:
        """The first ``n`` staged bytes (whole pages) to their place, with ``O_DIRECT``."""
        assert self._stage is not None
        with memoryview(self._stage) as view:
            self.w.pwrite(view[:n], self._stage_at, direct=True)
            self._stage.move(0, n, self._fill - n)
        self._fill -= n
        self._stage_at += n

    def write(self, rows: np.ndarray, scale: np.ndarray | None = None) -> None:
        """The next ``m`` rows' stored bytes (``[m * row_nbytes]`` uint8, any shape) and, for per-row
        formats, their scales (``m`` float32 values, checked positive and finite)."""
        w, rn = self.w, self.w.row_nbytes
        rows = np.ascontiguousarray(rows)
        m, extra = divmod(rows.nbytes, rn)
        if extra or self.at + m > self.stop:
            raise InvalidArgumentError(
                f"shard {self.k}: {rows.nbytes} bytes after row {self.at} do not fit rows [{self.start}, {self.stop})"
            )
        per_row = w.scale_kind == "row"
        if per_row:
            if scale is None or scale.nbytes != 4 * m:
                raise InvalidArgumentError(f"shard {self.k}: format {w.format!r} needs {m} per-row scales")
            values = torch.from_numpy(np.frombuffer(scale, dtype="<f4"))
            check_scale_values(values, f"shard {self.k} (rows [{self.start}, {self.stop}))", first_row=self.at)
        self._put(rows.data.cast("B"))
        if self._hash is not None:
            self._hash.update(rows.data)
        if per_row:
            assert scale is not None
            w.pwrite(scale, w.scale_place(self.at))
            self._scales.append(np.frombuffer(scale, dtype=np.uint8))
        self.at += m

    def finish(self) -> None:
        """Every row written: record the shard's checksum (rows, then per-row scales)."""
        if self.at != self.stop:
            raise InvalidArgumentError(
                f"shard {self.k} (rows [{self.start}, {self.stop})): {self.at - self.start} rows were written"
            )
        if self._stage is not None:  # the staged whole pages, then the rest through the page cache
            whole = self._fill - self._fill % _PAGE
            if whole:
                self._flush(whole)
            with memoryview(self._stage) as view:
                self.w.pwrite(view[: self._fill], self._stage_at)
            self._stage.close()
            self._stage = None
        if self._hash is not None:
            for b in self._scales:
                self._hash.update(b.data)
            self.w.record_checksum(self.k, self._hash.hexdigest())


_READ_BYTES = 16 << 20


def _file_digest(fd: int, places: list[tuple[int, int]]) -> str | None:
    """blake2b-128 of the bytes at ``places`` (``(offset, nbytes)``, in order) of ``fd``; None when the
    file ends first."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    buf = bytearray(min(_READ_BYTES, max((n for _, n in places), default=0)) or 1)
    view = memoryview(buf)
    for offset, n in places:
        while n > 0:
            got = os.preadv(fd, [view[: min(n, _READ_BYTES)]], offset)
            if got <= 0:
                return None
            h.update(view[:got])
            offset, n = offset + got, n - got
    return h.hexdigest()


def matching_shards(w: Any, fd: int, sums: dict[int, str]) -> set[int]:
    """The shards ``k`` of ``sums`` (``{k: checksum}``) whose bytes in ``fd``, the temporary file of
    the writer ``w`` (a :class:`~ple.table.files.table_file.TableFileWriter`), give their checksum (rows, then
    per-row scales); shards are read and hashed side by side, two a thread (``torch.get_num_threads()``,
    as ``ple verify`` does: one is read while the other is hashed; the hash releases the GIL).

    It reads every byte of those shards once: what continuing a conversion costs before it writes
    anything. For the published table converted to q4_0 (28.8 GB when finished) that is at most the
    finished part of those bytes, read as ``ple verify`` reads a file: about 46 s for all of them on
    the disk of docs/PERFORMANCE.md (631 MB/s with two cores; its sequential reads 1-2.2 GB/s),
    against 5.6 minutes to convert them."""

    def check(k: int) -> bool:
        a, b = w.shard_range(k)
        places = [(w.row_place(a), (b - a) * w.row_nbytes)]
        places += [(w.scale_place(a), 4 * (b - a))] if w.scale_kind == "row" else []
        return _file_digest(fd, places) == sums[k]

    order = sorted(sums)
    if not order:
        return set()
    lanes = min(2 * torch.get_num_threads(), len(order))
    with ThreadPoolExecutor(lanes, thread_name_prefix="ple-resume-check") as pool:
        return {k for k, ok in zip(order, pool.map(check, order)) if ok}
