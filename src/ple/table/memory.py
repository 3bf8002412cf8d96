"""In-memory tiers: ``MemoryTable`` (CPU or accelerator tensor) and ``PinnedHostTable``."""

from __future__ import annotations

import torch

from ..errors import InvalidArgumentError, UsageError
from .base import StoredTable
from .formats import check_scale_values, check_table_tensors, format_info

__all__ = ["MemoryTable", "PinnedHostTable"]


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
    shape = {"none": None, "global": (1,), "row": (rows, 1)}[info.scale_kind]
    # Scales start as NaN: a scale the loader forgot to fill shows up as NaN rows, never as
    # plausible numbers.
    scale = None
    if shape is not None:
        scale = torch.full(shape, float("nan"), dtype=torch.float32, device=device, pin_memory=pin_memory)
    return data, scale


class _TensorTable(StoredTable):
    """A table held in one tensor (and its scale), the common part of the in-memory tiers."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None, format: str) -> None:
        super().__init__(format, data.shape[0], format_info(format).head_dim_of(data.shape[1]))
        self._data = data
        self._scale = scale

    @property
    def data(self) -> torch.Tensor:
        return self._data

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
        e.g. ``t.data[a:b].copy_(shard)`` and ``t.scale.copy_(weight_scale)``."""
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
