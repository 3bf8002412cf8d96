"""``MmapTable``: a table served from a read-only memory map of a table file (:mod:`ple.table.file`).

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
resets the time), and reads that bypass the lookup (``data`` read directly, e.g. by a
:class:`~ple.table.CachedTable` filling its cache).
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import UsageError
from .base import StoredTable
from .file import TableFileError, open_table, shard_bounds
from .formats import format_info

__all__ = ["MmapTable"]

# numpy dtype used to map each storage dtype (torch views the bytes as the real dtype).
_NP_STORAGE = {
    torch.bfloat16: np.int16,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float8_e4m3fn: np.uint8,
    torch.int8: np.int8,
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
        self, path: str | os.PathLike, expected_layout_hash: str | dict | None = None, *, random_access: bool = True
    ) -> None:
        path = Path(path)
        fd, header, st = open_table(path, expected_layout_hash)
        try:
            super().__init__(header["format"], header["rows"], header["head_dim"])
            self.path = path
            self.header = header
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
        raw = _view(buf, _NP_STORAGE[info.storage_dtype], header["data_offset"], (self.rows, self.head_dim))
        self._data: torch.Tensor | None = raw if raw.dtype == info.storage_dtype else raw.view(info.storage_dtype)
        kind = header["scale"]["kind"]
        self._scale: torch.Tensor | None
        if kind == "global":
            self._scale = _view(buf, np.float32, header["scale"]["offset"], (1,)).clone()
        elif kind == "row":
            self._scale = _view(buf, np.float32, header["scale"]["offset"], (self.rows, 1))
        else:
            self._scale = None

    @classmethod
    def open(
        cls, path: str | os.PathLike, expected_layout_hash: str | dict | None = None, *, random_access: bool = True
    ) -> MmapTable:
        """Map a complete table file, after the one validation every reader makes (see
        :func:`ple.table.read_table_header`): refuses ``.partial`` files, incomplete or damaged
        headers, inconsistent geometry, a wrong file size, a global scale that is not a positive
        finite number, and (when ``expected_layout_hash`` is given, as a hash or a fields dict) a
        file built for another layout. Row checksums are not computed here (see
        :func:`ple.table.verify_table_file`).

        ``random_access`` advises the kernel that reads are scattered (``MADV_RANDOM``): a page
        fault then reads one page instead of a read-ahead window (a 160-byte row would otherwise
        pull in up to 128 KiB). Pass False for sequential scans of the whole table."""
        return cls(path, expected_layout_hash, random_access=random_access)

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
