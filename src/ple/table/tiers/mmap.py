"""``MmapTable``: a table served from a read-only memory map of a table file (:mod:`ple.table.files.table_file`).

A mapped file must not be changed in place while it is mapped. Replacing it the way ple writes
table files (a new file renamed over the old name, e.g. ``ple convert --force``) is safe: the map
keeps serving the file it opened, unchanged, until it is closed. Writing into the mapped file
itself (``cp new.pletable old.pletable``, ``truncate``) is not: the rows a lookup reads change under
it, and pages cut off by a truncation kill the process with SIGBUS when touched (the OS gives no
way to turn that into an error). What is detected: every lookup of the table (and every prefetch)
first compares the file's size and modification time with those at open (one ``fstat``, about a
microsecond) and raises :class:`TableFileError` when they differ, before touching a row;
:meth:`MmapTable.check_file` makes the same check on demand. What is not: a change during a lookup,
one that keeps both the size and the modification time (the clock's granularity, or a writer that
resets the time), and reads that bypass the lookup (``data`` read directly; a map from
:meth:`MmapTable.map_rows` is checked when it is made, not when it is read). A
:class:`~ple.table.CachedTable` in front of the map makes the same check before each of its lookups
and refreshes.
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from ple.errors import InvalidArgumentError, UsageError
from ple.table.base import StoredTable
from ple.table.files.table_file import TableFileError, open_table, shard_bounds
from ple.table.formats.catalog import format_info

__all__ = ["MmapTable"]

# numpy dtype used to map each storage dtype (torch views the bytes as the real dtype).
_NP_STORAGE = {
    torch.bfloat16: np.int16,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float8_e4m3fn: np.uint8,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
}


def _view(buf: mmap.mmap, np_dtype, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    arr = np.frombuffer(buf, dtype=np_dtype, count=n, offset=offset).reshape(shape)
    with warnings.catch_warnings():
        # torch warns that the array is not writable: the mapping is read-only on purpose.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class MmapTable(StoredTable):
    """A table backed by a read-only memory map of a table file (CPU).

    Lookups gather only the addressed rows (the OS pages them in on demand); for ids on an
    accelerator the stored rows are copied there and dequantized there. ``data`` is read-only:
    writing into it faults. See the module docstring for what changing the file while it is
    mapped does, and what is detected.

    Build one with :meth:`open`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        expected_layout_hash: str | dict | None = None,
        *,
        random_access: bool = True,
        scale_rows: tuple[int, int] | None = None,
    ) -> None:
        path = Path(path)
        fd, header, st = open_table(path, expected_layout_hash, scale_rows=scale_rows)
        try:
            super().__init__(header["format"], header["rows"], header["head_dim"])
            self.path = path
            self.header = header
            self._open_args = (os.path.abspath(path), expected_layout_hash, random_access, scale_rows)
            self._fd = fd
            self._stat = (st.st_size, st.st_mtime_ns)
            buf = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
            if random_access and hasattr(mmap, "MADV_RANDOM"):
                # Lookups touch scattered rows: without this the kernel reads ahead around every fault,
                # multiplying I/O and resident memory for no benefit.
                buf.madvise(mmap.MADV_RANDOM)
        except BaseException:
            os.close(fd)
            raise
        info = format_info(self.format)
        raw = _view(buf, _NP_STORAGE[info.storage_dtype], header["data_offset"], (self.rows, info.width(self.head_dim)))
        self._data: torch.Tensor | None = raw if raw.dtype == info.storage_dtype else raw.view(info.storage_dtype)
        kind = header["scale"]["kind"]
        self._scale: torch.Tensor | None
        if kind == "global":
            self._scale = _view(buf, np.float32, header["scale"]["offset"], (1,)).clone()
        elif kind == "row":
            self._scale = _view(buf, np.float32, header["scale"]["offset"], (self.rows, 1))
        else:
            self._scale = None

    def __reduce__(self):
        # pickled as its file (torch.save of a layer, multiprocessing): the copy maps it again by its
        # absolute path, with the same checks, and refuses a file whose header (its geometry, layout and
        # per-shard checksums) differs; the rows themselves are never copied into the pickle
        self.check_file()  # a closed table, or a file changed in place, is refused here
        return (_reopen, (*self._open_args, self.header, self.prefetch_depth))

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        expected_layout_hash: str | dict | None = None,
        *,
        random_access: bool = True,
        scale_rows: tuple[int, int] | None = None,
    ) -> MmapTable:
        """Map a complete table file, after the one validation every reader makes (see
        :func:`ple.table.read_table_header`): refuses ``.partial`` files, incomplete or damaged
        headers, inconsistent geometry, a wrong file size, a global or per-row scale that is not a
        positive finite number, and (when ``expected_layout_hash`` is given, as a hash or a fields
        dict) a file built for another layout. Per-row scales are read once, with ``pread`` in
        8 MiB chunks (4 bytes per row: about 40 ms per 32 million rows from the page cache on a
        2-core EPYC, so about 0.4 s for the published 320 million rows); rows are not read, and
        row checksums are not computed here (see :func:`ple.table.verify_table_file`).

        ``random_access`` advises the kernel that reads are scattered (``MADV_RANDOM``): a page
        fault then reads one page instead of a read-ahead window (a 160-byte row would otherwise
        pull in up to 128 KiB). Pass False for sequential scans of the whole table.

        ``scale_rows=(first, end)``: check the per-row scales of those rows only, for a process that
        serves no others (a rank's shard, :func:`ple.table.tiers.sharded.load_sharded`); rows outside the range
        are served unchecked."""
        return cls(path, expected_layout_hash, random_access=random_access, scale_rows=scale_rows)

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            raise UsageError(f"table file {self.path} was closed")
        return self._data

    @property
    def scale(self) -> torch.Tensor | None:
        return self._scale

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def check_file(self) -> None:
        """Raise :class:`TableFileError` if the mapped file was changed in place since it was opened
        (its size or modification time differ); every lookup makes this check first."""
        if self._fd < 0:
            raise UsageError(f"table file {self.path} was closed")
        st = os.fstat(self._fd)
        if (st.st_size, st.st_mtime_ns) != self._stat:
            size = self._stat[0]
            raise TableFileError(
                f"{self.path} was changed in place while mapped (now {st.st_size} bytes, {size} at open, "
                "modification time changed): its rows can no longer be trusted; replace table files by "
                "renaming a new file over the old one (what ple convert --force does), then open it again"
            )

    def map_rows(
        self, start: int = 0, stop: int | None = None, *, scales: bool = False, copy_on_write: bool = False
    ) -> torch.Tensor:
        """A new map of rows ``[start, stop)`` of the file this table holds: ``[n, head_dim]`` in the
        storage dtype, or with ``scales=True`` their per-row scales ``[n, 1]`` (float32; per-row
        formats only).

        The map is made from the table's own descriptor after :meth:`check_file`, so it shows the
        very file the table serves, even when its name now leads to another file (one renamed over
        it). Nothing is read until touched. The tensor has a storage of its own and keeps its map
        alive: it outlives :meth:`close`. Read-only (writing faults), or with ``copy_on_write``
        writable, writes going to private pages of this process, never to the file."""
        self.check_file()
        stop = self.rows if stop is None else stop
        for v in (start, stop):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidArgumentError(f"start and stop must be integers, got {start!r}, {stop!r}")
        if not 0 <= start <= stop <= self.rows:
            raise InvalidArgumentError(f"rows [{start}, {stop}) are not within the table's {self.rows} rows")
        n = stop - start
        if scales:
            if self.header["scale"]["kind"] != "row":
                raise UsageError(f"a {self.format!r} table has no per-row scales to map")
            dtype, width, offset = torch.float32, 1, self.header["scale"]["offset"] + 4 * start
        else:
            dtype, width = self.storage_dtype, format_info(self.format).width(self.head_dim)
            offset = self.header["data_offset"] + start * self.header["row_nbytes"]
        if n == 0:
            return torch.empty((0, width), dtype=dtype)
        np_dtype = np.float32 if scales else _NP_STORAGE[dtype]
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        nbytes = n * width * dtype.itemsize
        access = mmap.ACCESS_COPY if copy_on_write else mmap.ACCESS_READ
        buf = mmap.mmap(self._fd, offset - base + nbytes, access=access, offset=base)
        arr = np.frombuffer(buf, dtype=np_dtype, count=n * width, offset=offset - base).reshape(n, width)
        with warnings.catch_warnings():
            # torch warns that a read-only array is not writable: read-only on purpose.
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
        return t if t.dtype == dtype else t.view(dtype)

    def same_file(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` now names the very file this table maps (same device and inode)."""
        if self._fd < 0:
            raise UsageError(f"table file {self.path} was closed")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self._fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _lookup_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        self.check_file()
        super()._lookup_into(ids, out)

    def close(self) -> None:
        """Stop prefetching and drop the maps (unmapped once no returned view is referenced)."""
        super().close()
        self._data = None
        self._scale = None
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            self._fd = -1
            os.close(fd)

    @property
    def layout_hash(self) -> str:
        return self.header["layout_hash"]

    @property
    def sparse(self) -> bool:
        return bool(self.header.get("sparse"))

    def shard_range(self, k: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of shard ``k`` of the file's shard geometry."""
        return shard_bounds(k, self.header["shard_rows"], self.rows)


def _reopen(
    path: str,
    expected_layout_hash: str | dict | None,
    random_access: bool,
    scale_rows: tuple[int, int] | None,
    header: dict | None = None,
    prefetch_depth: int | None = None,
) -> MmapTable:
    """An unpickled :class:`MmapTable`: its file mapped again (see :meth:`MmapTable.__reduce__`)."""
    table = MmapTable(path, expected_layout_hash, random_access=random_access, scale_rows=scale_rows)
    if header is not None and table.header != header:
        table.close()
        raise TableFileError(
            f"{path} is not the table file that was pickled: its header (geometry, layout or checksums) differs; "
            "attach the table you mean after loading (layer.table = MmapTable.open(path))"
        )
    if prefetch_depth is not None:
        table.prefetch_depth = prefetch_depth
    return table
