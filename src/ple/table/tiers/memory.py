"""In-memory tiers: ``MemoryTable`` (CPU or accelerator tensor) and ``PinnedHostTable``."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

from ple.errors import InvalidArgumentError, UsageError
from ple.table.base import StoredTable, Table
from ple.table.formats.catalog import check_scale_values, check_table_tensors, format_info

__all__ = ["MemoryTable", "PinnedHostTable", "advise_huge_pages"]


def _normalize_scale(data: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor | None:
    """The scale as the table keeps it: float32 on the data's device, each value checked after the cast."""
    if scale is None:
        return None
    check_scale_values(scale, f"{fmt!r} table")
    if format_info(fmt).scale_kind == "global":
        scale = scale.reshape(1)
    return scale.to(device=data.device, dtype=torch.float32)


def _empty_tensors(rows: int, head_dim: int, format: str, device, pin_memory: bool = False):
    info = format_info(format)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise InvalidArgumentError(f"rows must be an integer >= 1, got {rows!r}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise InvalidArgumentError(f"head_dim must be an integer >= 1, got {head_dim!r}")
    data = torch.empty(rows, info.width(head_dim), dtype=info.storage_dtype, device=device, pin_memory=pin_memory)
    if not pin_memory:
        advise_huge_pages(data)  # before the loader's first write: the pages are then made 2 MiB
    shape = {"none": None, "global": (1,), "row": (rows, 1)}[info.scale_kind]
    # Scales start as NaN: a scale the loader forgot to fill shows up as NaN rows, never as
    # plausible numbers.
    scale = None
    if shape is not None:
        scale = torch.full(shape, float("nan"), dtype=torch.float32, device=device, pin_memory=pin_memory)
    return data, scale


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_libc = None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the host memory of ``t`` with 2 MiB pages (``madvise(MADV_HUGEPAGE)``, for
    transparent huge pages in their default ``madvise`` mode) over the whole 2 MiB pages it spans.

    A table lookup reads rows at random over gigabytes: with 4 KiB pages nearly every row costs a TLB
    miss and a page-table walk, which right after a GEMM runs from memory too (a decode step's row
    gather of 64 requests, 1,024 rows from a 1.5 GB table: 117 -> 82 us after the GEMM). Advised before
    the first write, the pages are made huge as they are touched; memory already touched is
    collapsed later by the kernel's background thread. Returns whether the kernel took the advice:
    False (nothing done) off Linux, for a tensor off the CPU or spanning no whole 2 MiB page, or where
    the kernel has no transparent huge pages. Values are unchanged either way."""
    global _libc
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"advise_huge_pages takes a tensor, got {type(t).__name__}")
    if _MADV_HUGEPAGE is None or not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + t.numel() * t.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if hi - lo < _HUGE_PAGE:
        return False
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


class _TensorTable(StoredTable):
    """A table held in one tensor (and its scale), the common part of the in-memory tiers."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None, format: str) -> None:
        super().__init__(format, data.shape[0], format_info(format).head_dim_of(data.shape[1]))
        self._data = data
        self._scale = scale

    @property
    def data(self) -> torch.Tensor:
        return self._data

    def host_rows(self, dtype: torch.dtype) -> torch.Tensor | None:
        cls = type(self)
        if cls.lookup is not Table.lookup or cls._lookup_into is not StoredTable._lookup_into:
            return None  # a subclass that looks up otherwise: its rows are what its lookup says
        data = self._data
        if self._scale is not None or data.dtype != dtype or data.device.type != "cpu" or data.stride(1) != 1:
            return None
        return data

    @property
    def scale(self) -> torch.Tensor | None:
        return self._scale


class MemoryTable(_TensorTable):
    """A table held in one tensor, on the CPU or an accelerator.

    Args:
        data: ``[rows, head_dim]`` in the format's storage dtype.
        scale: None (plain), ``[1]`` (global; a scalar is accepted) or ``[rows, 1]`` (per row).
        format: format name; inferred from ``data``/``scale`` when None, validated when given.

    The tensors are used as given (no copy), except that a scale is moved to the data's device as
    float32 (a copy when it is another dtype or elsewhere). Every scale must be a positive finite
    float32 number (one pass over the scales, at construction): a float64 scale of 1e39 is refused,
    never stored as inf.
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None = None, format: str | None = None) -> None:
        fmt = check_table_tensors(data, scale, format)
        super().__init__(data, _normalize_scale(data, scale, fmt), fmt)

    @classmethod
    def empty(cls, rows: int, head_dim: int, format: str, device: str | torch.device = "cpu") -> MemoryTable:
        """An uninitialized table whose ``data`` (and ``scale``, NaN-filled) a loader fills in place,
        e.g. ``t.data[a:b].copy_(shard)`` and ``t.scale.copy_(weight_scale)``. Host rows are advised onto
        2 MiB pages before they are written (:func:`advise_huge_pages`): lookups then miss the TLB less."""
        data, scale = _empty_tensors(rows, head_dim, format, device)
        table = cls.__new__(cls)
        _TensorTable.__init__(table, data, scale, format)  # NaN scales until filled: not checked
        return table


class PinnedHostTable(_TensorTable):
    """A table in page-locked host memory, read directly by the accelerator.

    Lookups for CUDA ids run the gather kernel on the GPU reading host rows over the bus (zero
    copy: only the addressed rows move), so the table can exceed GPU memory. Lookups for CPU ids
    gather on the host. Needs CUDA: construction raises :class:`~ple.errors.UsageError` without it.

    Args:
        data, scale, format: as :class:`MemoryTable`; tensors not already pinned are copied into
            pinned memory.
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None = None, format: str | None = None) -> None:
        _require_cuda()
        fmt = check_table_tensors(data, scale, format)
        data = data.cpu() if data.device.type != "cpu" else data
        data = data if data.is_pinned() else data.pin_memory()
        scale = _normalize_scale(data, scale, fmt)
        super().__init__(data, scale if scale is None or scale.is_pinned() else scale.pin_memory(), fmt)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # unpickled rows are pageable: pinned again (needs CUDA, as building)
        _require_cuda()
        if not self._data.is_pinned():
            self._data = self._data.pin_memory()
        if self._scale is not None and not self._scale.is_pinned():
            self._scale = self._scale.pin_memory()

    @classmethod
    def empty(cls, rows: int, head_dim: int, format: str) -> PinnedHostTable:
        """An uninitialized pinned table for a loader to fill (scales NaN-filled)."""
        _require_cuda()
        data, scale = _empty_tensors(rows, head_dim, format, "cpu", pin_memory=True)
        table = cls.__new__(cls)
        _TensorTable.__init__(table, data, scale, format)  # NaN scales until filled: not checked
        return table


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise UsageError(
            "PinnedHostTable needs CUDA (pinned host memory read by the accelerator), but "
            f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
            "use MemoryTable or MmapTable on this machine"
        )
