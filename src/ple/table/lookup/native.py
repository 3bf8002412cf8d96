"""CPU lookup of block-format rows through the C kernel of ``_native/ple_quant.c``: one pass over
the ids, each row's blocks decoded straight into the output (no gathered copy), rows spread over
``torch.get_num_threads()`` threads. Bit-exact with :func:`gather_dequant_reference`."""

from __future__ import annotations

import torch

from ple.errors import InvalidArgumentError
from ple.kernels import native as _native
from ple.table.formats.catalog import check_activation_dtype, check_ids, format_info

__all__ = ["gather_dequant_blocks_native", "native_available"]

_FORMAT_CODE = {"q8_0": 0, "q5_1": 1, "q5_0": 2, "q4_1": 3, "q4_0": 4, "iq4_nl": 5, "mxfp4": 6, "nvfp4": 7}
_OUT_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def native_available() -> bool:
    """Whether the C kernel can run here (see :func:`ple.kernels.native.available`)."""
    return _native.available()


def gather_dequant_blocks_native(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    ids: torch.Tensor,
    dtype: torch.dtype,
    *,
    format: str,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """``data [R, row_nbytes]`` uint8 rows of a block format (CPU), ``ids [T, G]`` int64 (CPU) ->
    ``[T, G*head_dim]`` in ``dtype``. ``scale`` is nvfp4's global scale ``[1]`` (None otherwise).
    Raises :class:`~ple.table.IdOutOfRangeError` for ids outside the table, checked or not."""
    check_activation_dtype(dtype)
    info = format_info(format)
    if not info.blocked or data.dtype != torch.uint8 or data.dim() != 2 or data.device.type != "cpu":
        raise InvalidArgumentError(f"the native block lookup takes CPU uint8 rows of a block format, got {format!r}")
    # what the kernel reads as int64 [T, G] on the CPU is checked whatever ``check`` says (shapes
    # and dtypes only); ``check`` adds the id range, which the kernel also refuses (status -1)
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.device.type != "cpu":
        raise InvalidArgumentError(
            f"ids must be int64 [T, G] on the CPU, got {ids.dtype} {tuple(ids.shape)} on {ids.device}"
        )
    if check:
        check_ids(ids, data.shape[0])
    T, G = ids.shape
    D = info.head_dim_of(data.shape[1])
    if out is None:
        out = torch.empty(T, G * D, dtype=dtype)
    elif tuple(out.shape) != (T, G * D) or out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
        raise InvalidArgumentError(
            f"out must be a contiguous [{T}, {G * D}] {dtype} CPU tensor, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    flat = ids.reshape(-1).contiguous()
    if flat.numel() == 0:
        return out
    if data.stride(1) != 1 or data.stride(0) != data.shape[1]:
        data = data.contiguous()
    g = float(scale.reshape(-1)[0]) if (scale is not None and format == "nvfp4") else 1.0
    if format == "nvfp4" and scale is None:
        raise InvalidArgumentError("nvfp4 rows need the table's global scale")
    rc = _native.library().ple_quant_lookup(
        _FORMAT_CODE[format],
        data.data_ptr(),
        data.shape[0],
        data.shape[1],
        D,
        flat.data_ptr(),
        flat.numel(),
        g,
        _OUT_KIND[dtype],
        out.data_ptr(),
        _native.threads_for(flat.numel(), 256, started_per_call=True),
    )
    if rc == -1:
        check_ids(ids, data.shape[0])  # names the id
    if rc != 0:
        raise InvalidArgumentError(f"the native block lookup failed (status {rc})")
    return out
