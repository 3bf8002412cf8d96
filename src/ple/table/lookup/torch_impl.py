"""CPU fast path of the table lookup: one ``index_select`` and one dequantization pass."""

from __future__ import annotations

import torch

from ple.errors import InvalidArgumentError
from ple.kernels import native as _native
from ple.table.formats.blocks import dequantize_blocks
from ple.table.formats.catalog import check_activation_dtype, check_ids, format_info

__all__ = ["gather_dequant_torch", "dequantize_rows_into", "gather_rows"]


def _result(out: torch.Tensor | None, T: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(T, width, dtype=dtype, device=device)
    if tuple(out.shape) != (T, width) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise InvalidArgumentError(
            f"out must be a contiguous [{T}, {width}] {dtype} tensor on {device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device} (contiguous={out.is_contiguous()})"
        )
    return out


_WORDS = (torch.int64, torch.int32, torch.int16)
_ROWS_PER_THREAD = 256
"""Rows per thread of the C gathers (a decode step of 64 requests, about 1,000 rows, runs on two)."""


def gather_rows(data: torch.Tensor, flat_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``data.index_select(0, flat_ids)`` for ``data [R, D]``, copying each row as machine words.

    index_select copies element by element; for 1- and 2-byte dtypes that is an order of magnitude
    slower than moving the same bytes as int64 words. Rows are viewed as the widest integer type
    that tiles them (bit-exact), falling back to a plain index_select for odd layouts. On the CPU with
    the C kernels the rows are copied by ``ple_gather_rows`` (rows read ahead while one is copied; on
    PyTorch's OpenMP threads, see :func:`ple.kernels.native.threads_for`).
    """
    got = _gather_rows_native(data, flat_ids, out)
    if got is not None:
        return got
    esize = data.element_size()
    if data.dim() == 2 and data.shape[1] > 0 and data.stride(1) == 1:
        row_bytes = data.shape[1] * esize
        for word in _WORDS:
            wsize = word.itemsize
            if wsize <= esize or row_bytes % wsize or (data.stride(0) * esize) % wsize or data.data_ptr() % wsize:
                continue
            words = data.view(word)
            if out is None:
                return words.index_select(0, flat_ids).view(data.dtype)
            if out.is_contiguous():
                torch.index_select(words, 0, flat_ids, out=out.view(word))
                return out
            break
    if out is None:
        return data.index_select(0, flat_ids)
    return torch.index_select(data, 0, flat_ids, out=out)


def _host_contiguous(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous()


def _native_gather_takes(data: torch.Tensor, flat_ids: torch.Tensor) -> bool:
    """Whether the C gathers take these rows: host rows ``data [R, D]`` with unit stride along ``D``
    and a non-empty contiguous int64 ``flat_ids [N]`` on the host, with the C kernels built."""
    return (
        flat_ids.dim() == 1
        and flat_ids.shape[0] > 0
        and flat_ids.dtype == torch.int64
        and _host_contiguous(flat_ids)
        and data.device.type == "cpu"
        and data.dim() == 2
        and data.shape[1] > 0
        and data.stride(1) == 1
        and _native.available()
    )


def _gather_rows_native(data: torch.Tensor, flat_ids: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`gather_rows` through the C gather, or None where it does not apply (or an id is out of
    range: index_select then raises as it would)."""
    n = flat_ids.shape[0] if flat_ids.dim() == 1 else -1
    if not _native_gather_takes(data, flat_ids) or (
        out is not None
        and (out.dtype != data.dtype or tuple(out.shape) != (n, data.shape[1]) or not _host_contiguous(out))
    ):
        return None
    if out is None:
        out = torch.empty(n, data.shape[1], dtype=data.dtype)
    esize = data.element_size()
    rc = _native.library().ple_gather_rows(
        data.data_ptr(),
        data.shape[0],
        data.stride(0) * esize,
        data.shape[1] * esize,
        flat_ids.data_ptr(),
        n,
        out.data_ptr(),
        _native.threads_for(n, _ROWS_PER_THREAD),
    )
    return out if rc == 0 else None


def _gather_fp8_native(data: torch.Tensor, scale: torch.Tensor | None, flat: torch.Tensor, out: torch.Tensor) -> bool:
    """float8 rows gathered and dequantized by ``ple_gather_lut`` into ``out`` (contiguous ``[N, D]``):
    the byte lookup table and the scale multiplications of :func:`dequantize_rows_into`, in one pass over
    the rows. False (nothing written) where it does not apply or an id is out of range."""
    n = flat.shape[0]
    if not _native_gather_takes(data, flat) or not _host_contiguous(out):
        return False
    dtype = out.dtype
    lut = _fp8_values(dtype, out.device)
    per_row = scale is not None and scale.numel() != 1
    if scale is not None and not per_row:
        lut = lut * scale.reshape(1).to(dtype)
    lut = lut.contiguous()
    rc = _native.library().ple_gather_lut(
        data.data_ptr(),
        data.shape[0],
        data.stride(0),
        data.shape[1],
        flat.data_ptr(),
        n,
        lut.data_ptr(),
        lut.element_size(),
        out.data_ptr(),
        _native.threads_for(n, _ROWS_PER_THREAD),
    )
    if rc != 0:
        return False
    if per_row:
        assert scale is not None
        out.mul_(scale.index_select(0, flat).to(dtype))  # every e4m3 value is exact in dtype: one rounding
    return True


def dequantize_rows_into(
    rows: torch.Tensor, scale_rows: torch.Tensor | None, out: torch.Tensor, format: str | None = None
) -> torch.Tensor:
    """``out = rows.to(out.dtype) * scale_rows.to(out.dtype)``, bit-exact with the reference.

    Args:
        rows: ``[N, D]`` gathered rows in the storage dtype (``[N, row_nbytes]`` uint8 for a block format).
        scale_rows: None, ``[1]`` (global) or ``[N, 1]`` (the gathered per-row scales).
        out: ``[N, D]`` contiguous result in the activation dtype, on the rows' device.
        format: the table's format; needed for block formats (decoded by :mod:`ple.table.formats.blocks`).
    """
    dtype = out.dtype
    if format is not None and format_info(format).blocked:
        out.copy_(dequantize_blocks(rows, format, scale_rows))
        return out
    if rows.dtype == torch.float8_e4m3fn:
        # torch converts float8 element by element; a 256-entry table of the dequantized value of
        # every byte, applied with one index_select, is several times faster and exactly equal:
        # with a global scale dequantization is a function of the byte alone.
        per_row = scale_rows is not None and scale_rows.numel() != 1
        lut = _fp8_values(dtype, out.device)
        if scale_rows is not None and not per_row:
            lut = lut * scale_rows.reshape(1).to(dtype)
        codes = rows.view(torch.uint8).reshape(-1).to(torch.int32)
        torch.index_select(lut, 0, codes, out=out.view(-1))
        if scale_rows is not None and per_row:
            out.mul_(scale_rows.to(dtype))  # every e4m3 value is exact in dtype: one rounding, here
        return out
    if scale_rows is None:
        out.copy_(rows)
        return out
    # int8 * dtype promotes to dtype; the int8 -> dtype conversion is exact.
    torch.mul(rows, scale_rows.to(dtype), out=out)
    return out


_FP8_VALUES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _fp8_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256]``: the value of every float8 e4m3fn byte in ``dtype`` (exact; 0x7F/0xFF are NaN)."""
    key = (dtype, device)
    lut = _FP8_VALUES.get(key)
    if lut is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        lut = codes.view(torch.float8_e4m3fn).to(dtype).to(device)
        _FP8_VALUES[key] = lut
    return lut


def gather_dequant_torch(data, scale, ids, dtype, *, out=None, check=True, format=None) -> torch.Tensor:
    """Twin of :func:`gather_dequant_reference` computed where ``data`` lives.

    ``data [R, D]``, ``scale`` None / ``[1]`` / ``[R, 1]``, ``ids [T, G]`` int64 -> ``[T, G*D]`` in
    ``dtype``. ``check=False`` skips the range check (index_select still refuses bad ids). Block
    formats (``format``) gather their stored bytes and decode them.
    """
    check_activation_dtype(dtype)
    if check:
        check_ids(ids, data.shape[0])
    T, G = ids.shape
    info = None if format is None else format_info(format)
    blocked = info is not None and info.blocked
    D = info.head_dim_of(data.shape[1]) if info is not None and blocked else data.shape[1]
    res = _result(out, T, G * D, dtype, data.device)
    flat = ids.reshape(-1).to(data.device)
    res2 = res.view(T * G, D)
    if blocked:
        assert format is not None
        res2.copy_(dequantize_blocks(gather_rows(data, flat), format, scale))
        return res
    if scale is None and data.dtype == dtype:
        gather_rows(data, flat, out=res2)
        return res
    if data.dtype == torch.float8_e4m3fn and _gather_fp8_native(data, scale, flat, res2):
        return res
    rows = gather_rows(data, flat)  # [T*G, D] storage dtype
    if scale is None:
        scale_rows = None
    elif scale.dim() == 2:
        scale_rows = scale.index_select(0, flat)  # [T*G, 1]
    else:
        scale_rows = scale.reshape(1)
    dequantize_rows_into(rows, scale_rows, res2)
    return res
