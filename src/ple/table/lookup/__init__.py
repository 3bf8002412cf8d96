"""Table lookup of stored rows: gather rows by id and dequantize.

The operator ``torch.ops.ple.gather_dequant(data, scale, ids, dtype, out, check, format)`` writes
``[T, G*D]`` rows into ``out``; it is registered once here (:data:`ple.kernels.registry.OPERATORS`), its
kernels sharing one signature ``(data, scale, ids, dtype, *, out=None, check=True, format=None)``:

- :func:`gather_dequant_reference` — literal advanced indexing + ``row.to(dtype) * scale.to(dtype)``
  (the reference);
- :func:`gather_dequant_torch` — one ``index_select`` + one dequantization pass (CPU);
- :func:`~.native.gather_dequant_blocks_native` — the C kernel for block formats (CPU, where it builds);
- :func:`~.triton_impl.gather_dequant_triton` — one gather+dequantize kernel (CUDA; ``data`` on that
  device or in pinned host memory).

:func:`gather_dequant` runs the operator's function for the ids' device (what the stored tiers call).
"""

from __future__ import annotations

import torch

from ple.errors import InvalidArgumentError
from ple.kernels import native as _native
from ple.kernels.registry import Kernel, register
from ple.table.formats.catalog import check_activation_dtype, format_info
from ple.table.lookup import native
from ple.table.lookup.reference import gather_dequant_reference
from ple.table.lookup.torch_impl import dequantize_rows_into, gather_dequant_torch

__all__ = ["gather_dequant", "gather_dequant_reference", "gather_dequant_torch", "dequantize_rows_into"]


def gather_dequant(data, scale, ids, dtype, *, out=None, check=True, format=None) -> torch.Tensor:
    """``[T, G*D]`` rows ``data[ids]`` dequantized to ``dtype``, on the ids' device, written into
    ``out`` when given. Bit-exact with :func:`gather_dequant_reference`. ``data [R, D]`` (block
    formats: ``[R, row_nbytes]`` uint8, ``format`` names the table's format), ``scale`` None / ``[1]``
    / ``[R, 1]``, ``ids [T, G]`` int64; ``check=False`` skips the range check of the ids."""
    run = _OPERATOR.on(ids.device)
    if out is None:
        out = _result(data, ids, dtype, format)
    run(data, scale, ids, dtype, out, check, format)
    return out


def _result(data: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype, format: str | None) -> torch.Tensor:
    check_activation_dtype(dtype)
    if ids.dim() != 2 or data.dim() != 2:
        raise InvalidArgumentError(
            f"lookup: ids must be [T, G] and data [R, D], got {tuple(ids.shape)} and {tuple(data.shape)}"
        )
    width = data.shape[1] if format is None else format_info(format).head_dim_of(data.shape[1])
    return torch.empty(ids.shape[0], ids.shape[1] * width, dtype=dtype, device=ids.device)


def _check(data, scale, ids, dtype, out, check, format, devices=True) -> None:
    """The table data where the ids' device reads it (the same device, or pinned host memory for an
    accelerator), its scale beside it, ``out`` on the ids' device, and a scale that fits the data's
    rows. Devices are checked on every device (Python callers reach the CPU kernel with tensors
    anywhere; the dispatcher's meta tensors are refused by the fake, see :mod:`ple.kernels.registry`)."""
    dev = ids.device
    if data.device != dev and not (dev.type != "cpu" and data.device.type == "cpu" and data.is_pinned()):
        where = "that device or in pinned host memory" if dev.type != "cpu" else "the CPU"
        raise InvalidArgumentError(f"lookup: ids on {dev} need the table data on {where}, got data on {data.device}")
    if scale is not None and scale.device != data.device:
        raise InvalidArgumentError(
            f"lookup: the scale is on {scale.device}, the table data on {data.device}: expected both on one"
        )
    if out.device != dev:
        raise InvalidArgumentError(
            f"lookup: out is on {out.device}, the ids on {dev}: rows are written on the ids' device"
        )
    if scale is not None and scale.shape != (1,) and scale.shape != (data.shape[0], 1):
        raise InvalidArgumentError(
            f"lookup: scale.shape={tuple(scale.shape)} does not fit data of {data.shape[0]} rows: "
            f"expected (1,) or ({data.shape[0]}, 1), or no scale"
        )


def _kernel(twin):
    """A kernel on the operator's arguments: ``twin`` with its keyword options, writing ``out``."""

    def gather(data, scale, ids, dtype, out, check, format) -> None:
        twin(data, scale, ids, dtype, out=out, check=check, format=format)

    return gather


def _blocks_native(data, scale, ids, dtype, out, check, format) -> None:
    native.gather_dequant_blocks_native(data, scale, ids, dtype, format=format, out=out, check=check)


def _takes_blocks(data, scale, ids, dtype, out, check, format) -> bool:
    return format is not None and format_info(format).blocked and _native.available()


def _triton(data, scale, ids, dtype, *, out, check, format):
    from ple.table.lookup.triton_impl import gather_dequant_triton

    return gather_dequant_triton(data, scale, ids, dtype, out=out, check=check, format=format)


_OPERATOR = register(
    "gather_dequant(Tensor data, Tensor? scale, Tensor ids, ScalarType dtype, Tensor(a!) out, bool check, "
    "str? format) -> ()",
    reference=_kernel(gather_dequant_reference),
    kernels=(
        Kernel("native", "cpu", _blocks_native, takes=_takes_blocks),
        Kernel("torch", "cpu", _kernel(gather_dequant_torch)),
        Kernel("triton", "cuda", _kernel(_triton), needs="triton"),
    ),
    fake=lambda *args: None,
    check=_check,
)
