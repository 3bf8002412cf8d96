"""``MmapTable``: a table served from a read-only memory map of a table file (:mod:`ple.table.file`)."""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UsageError
from .base import StoredTable
from .file import open_table_file, pread_file, shard_bounds
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


def _memmap(path: Path, np_dtype, offset: int, shape: tuple[int, ...], random_access: bool) -> torch.Tensor:
    arr = np.memmap(path, dtype=np_dtype, mode="r", offset=offset, shape=shape)
    mm = getattr(arr, "_mmap", None)
    if random_access and mm is not None and hasattr(mmap, "MADV_RANDOM"):
        # Lookups touch scattered rows: without this the kernel reads ahead around every fault,
        # multiplying I/O and resident memory for no benefit.
        mm.madvise(mmap.MADV_RANDOM)
    with warnings.catch_warnings():
        # torch warns that the array is not writable: the mapping is read-only on purpose.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class MmapTable(StoredTable):
    """A table backed by a read-only memory map of a table file (CPU).

    Lookups gather only the addressed rows (the OS pages them in on demand); for ids on an
    accelerator the stored rows are copied there and dequantized there. ``data`` is read-only:
    writing into it faults.
    """

    def __init__(self, path: Path, header: dict[str, Any], random_access: bool = True) -> None:
        super().__init__(header["format"], header["rows"], header["head_dim"])
        self.path = path
        self.header = header
        info = format_info(self.format)
        np_dtype = _NP_STORAGE[info.storage_dtype]
        raw = _memmap(path, np_dtype, header["data_offset"], (self.rows, self.head_dim), random_access)
        self._data: torch.Tensor | None = raw if raw.dtype == info.storage_dtype else raw.view(info.storage_dtype)
        kind = header["scale"]["kind"]
        self._scale: torch.Tensor | None
        if kind == "global":
            b = pread_file(path, header["scale"]["offset"], 4)
            self._scale = torch.frombuffer(bytearray(b), dtype=torch.float32).clone()
        elif kind == "row":
            self._scale = _memmap(path, np.float32, header["scale"]["offset"], (self.rows, 1), random_access)
        else:
            self._scale = None

    @classmethod
    def open(
        cls, path: str | os.PathLike, expected_layout_hash: str | dict | None = None, *, random_access: bool = True
    ) -> MmapTable:
        """Map a complete table file. Refuses ``.partial`` files, incomplete headers, a wrong file
        size, and (when ``expected_layout_hash`` is given, as a hash or a fields dict) a file built
        for another layout. Checksums are not computed here (see :func:`verify_table_file`).

        ``random_access`` advises the kernel that reads are scattered (``MADV_RANDOM``): a page
        fault then reads one page instead of a read-ahead window (a 160-byte row would otherwise
        pull in up to 128 KiB). Pass False for sequential scans of the whole table."""
        path = Path(path)
        return cls(path, open_table_file(path, expected_layout_hash), random_access)

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

    def close(self) -> None:
        """Stop prefetching and drop the maps (unmapped once no returned view is referenced)."""
        super().close()
        self._data = None
        self._scale = None

    @property
    def layout_hash(self) -> str:
        return self.header["layout_hash"]

    @property
    def sparse(self) -> bool:
        return bool(self.header.get("sparse"))

    def shard_range(self, k: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of shard ``k`` of the file's shard geometry."""
        return shard_bounds(k, self.header["shard_rows"], self.rows)
