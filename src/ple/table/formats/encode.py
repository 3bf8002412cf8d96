"""Table conversion kernels: source rows encoded into another format with their errors, and stored rows
checked for values that are not finite.

:func:`encode_rows` takes rows as a table stores them (plain, fp8 with a global or a per-row scale,
int8 with per-row scales, nvfp4 bytes with the table's scale), decodes them to float32 exactly as
:func:`dequantized` does, refuses a value that is not finite, and encodes them into a per-row format
("fp8_row", "int8_row": what :func:`ple.table.formats.quantize.quantize_rows` gives) or a block format (what
:func:`ple.table.formats.blocks.quantize_blocks` gives, a block whose fp16 scale would overflow refused), with
the error statistics of :class:`ple.table.formats.quantize.RowStats` on request. :func:`rows_amax` is the
largest magnitude of the decoded rows (an nvfp4 table's global scale comes from it).
:func:`first_nonfinite` finds the first stored value that is NaN or infinite: plain and fp8 values by
their bits, a GGML block by its fp16 scale (and minimum; mxfp4 by its decoded values), nvfp4 by its
E4M3 block scales.

They run in C (``ple_encode.c``; a call's rows split over ``threads`` threads), or, where the C
kernels are unavailable (``PLE_NATIVE=0``, no compiler), through the numpy and torch references:
the same bytes and the same failures either way (the tests compare them); the statistics agree to
rounding (their sums are added in another order).
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import torch

from ple.errors import InvalidArgumentError
from ple.kernels import native as _native
from ple.table.formats.blocks import ScaleOverflowError, dequantize_blocks, quantize_blocks
from ple.table.formats.catalog import format_info
from ple.table.formats.quantize import RowStats, dequantize, quantize_rows

__all__ = ["Encoded", "RowFailure", "dequantized", "encode_rows", "first_nonfinite", "rows_amax", "native_encoder"]

_SOURCE_KINDS = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.int8: 5,
    torch.uint8: 6,  # nvfp4 rows: codes, then E4M3 block scales
}
_TARGETS = {
    "q8_0": 0,
    "q5_1": 1,
    "q5_0": 2,
    "q4_1": 3,
    "q4_0": 4,
    "iq4_nl": 5,
    "mxfp4": 6,
    "nvfp4": 7,
    "fp8_row": 8,
    "int8_row": 9,
}
_GGML_KINDS = {fmt: 10 + code for fmt, code in _TARGETS.items() if code <= 6}
# bits that make a NaN (and, for e5m2, an infinity) of each fp8 storage dtype, sign excluded
_FP8_SPECIAL = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}


class RowFailure(InvalidArgumentError):
    """A row that cannot be encoded: ``kind`` is ``"nonfinite"`` (a decoded source value is NaN or
    infinite) or ``"overflow"`` (a block's fp16 scale or minimum would be infinite); ``row`` (of the
    rows given), ``column`` (the value's, or the block's first) and ``value`` (the value, or the
    block's value of largest magnitude) say where."""

    def __init__(self, kind: str, row: int, column: int, value: float, format: str) -> None:
        self.kind, self.row, self.column, self.value, self.format = kind, row, column, value, format
        if kind == "overflow":
            msg = str(ScaleOverflowError(format, row, column, value))
        else:
            msg = f"cannot quantize a non-finite value {value} at row {row}, column {column}"
        super().__init__(msg)


@dataclasses.dataclass
class Encoded:
    """Rows encoded by :func:`encode_rows`: ``data [n, row_nbytes]`` uint8, ``scale [n]`` float32 (the
    per-row formats; None otherwise) and ``stats`` (when asked for)."""

    data: np.ndarray
    scale: np.ndarray | None
    stats: RowStats | None


def native_encoder() -> ctypes.CDLL | None:
    """The C library when its kernels can run here, else None (the references run)."""
    return _native.library() if _native.available() else None


def dequantized(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Source rows ``[n, width]`` as float32 values ``[n, head_dim]``: ``rows.float() * scale`` (a global
    ``[1]`` or per-row ``[n, 1]`` scale; none for plain rows); uint8 rows are nvfp4, ``scale`` the
    table's global scale (the reference :func:`encode_rows` decodes as)."""
    if rows.dtype == torch.uint8:
        return dequantize_blocks(rows, "nvfp4", scale)
    return dequantize(rows, None if scale is None else scale.float(), torch.float32)


def _source(rows: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(contiguous CPU rows, source kind, head_dim)``."""
    kind = _SOURCE_KINDS.get(rows.dtype)
    if kind is None or rows.dim() != 2:
        raise InvalidArgumentError(f"cannot convert source rows of dtype {rows.dtype} and shape {tuple(rows.shape)}")
    src = rows.detach()
    if src.device.type != "cpu":
        src = src.cpu()
    src = src.contiguous()
    D = format_info("nvfp4").head_dim_of(src.shape[1]) if kind == 6 else src.shape[1]
    return src, kind, D


def _source_scale(kind: int, scale: torch.Tensor | None) -> tuple[int, torch.Tensor | None, float]:
    """``(scale kind: 0 none, 1 global, 2 per row, float32 scale tensor, nvfp4 global)``."""
    if scale is None:
        return 0, None, 0.0
    s = scale.detach().to("cpu", torch.float32).contiguous()
    if kind == 6:
        return 0, None, float(s.reshape(-1)[0])
    return (2 if s.dim() == 2 else 1), s.reshape(-1), 0.0


def _call(lib, src, kind, D, scale, target, to_global, out, out_bytes, out_scale, stats, threads, fmt):
    sk, s, src_global = _source_scale(kind, scale)
    fail = (ctypes.c_int64 * 2)()
    value = ctypes.c_float()
    n = src.shape[0]
    ptrs = [None if a is None else a.ctypes.data for a in stats] if stats is not None else [None] * 3
    rc = lib.ple_encode_rows(
        kind,
        src.data_ptr() if n else None,
        src.shape[1] * src.element_size(),
        n,
        D,
        sk,
        None if s is None else s.data_ptr(),
        src_global,
        target,
        to_global,
        None if out is None else out.ctypes.data,
        out_bytes,
        None if out_scale is None else out_scale.ctypes.data,
        *ptrs,
        max(1, int(threads)),
        fail,
        ctypes.byref(value),
    )
    if rc in (1, 2):
        raise RowFailure("nonfinite" if rc == 1 else "overflow", int(fail[0]), int(fail[1]), float(value.value), fmt)
    if rc == -2:
        raise MemoryError("ple_encode_rows: out of memory")
    if rc != 0:
        raise InvalidArgumentError(f"ple_encode_rows refused rows {src.dtype} {tuple(src.shape)} to {fmt} (code {rc})")


def _first_nonfinite_value(x: torch.Tensor) -> tuple[int, int] | None:
    bad = ~torch.isfinite(x)
    if not bool(bad.any()):
        return None
    r, c = (int(v) for v in bad.nonzero()[0])
    return r, c


def encode_rows(
    rows: torch.Tensor,
    scale: torch.Tensor | None,
    to: str,
    global_scale: float | None = None,
    *,
    stats: bool = False,
    threads: int = 1,
    native: bool | None = None,
) -> Encoded:
    """Source rows ``[n, width]`` (see :func:`dequantized`) -> ``to`` ("fp8_row", "int8_row" or a block
    format; nvfp4 needs the table's ``global_scale``).

    Raises :class:`RowFailure` for the first row (lowest index) holding a decoded value that is not
    finite or a block whose fp16 scale would overflow. ``native``: True insists on the C kernels,
    False runs the references, None (default) the C kernels where they run."""
    if to not in _TARGETS:
        raise InvalidArgumentError(f"cannot encode into {to!r}: one of {list(_TARGETS)}")
    if to == "nvfp4" and global_scale is None:
        raise InvalidArgumentError("encoding nvfp4 rows needs the table's global scale")
    src, kind, D = _source(rows)
    info = format_info(to)
    info.check_head_dim(D)
    n = src.shape[0]
    lib = _native.library() if native else native_encoder() if native is None else None
    if lib is None:
        return _encode_reference(src, scale, to, global_scale, stats)
    rn = info.row_nbytes(D)
    out = np.empty((n, rn), dtype=np.uint8)
    out_scale = np.empty(n, dtype=np.float32) if not info.blocked else None
    sums = [np.empty(n, dtype=np.float64) for _ in range(3)] if stats else None
    g = 0.0 if global_scale is None else float(np.float32(global_scale))
    _call(lib, src, kind, D, scale, _TARGETS[to], g, out, rn, out_scale, sums, threads, to)
    row_stats = None
    if sums is not None:
        row_stats = RowStats(*(torch.from_numpy(a) for a in sums))
    return Encoded(out, out_scale, row_stats)


def _encode_reference(src, scale, to, global_scale, stats) -> Encoded:
    x = dequantized(src, scale)
    bad = _first_nonfinite_value(x)
    if bad is not None:
        raise RowFailure("nonfinite", bad[0], bad[1], float(x[bad]), to)
    if format_info(to).blocked:
        try:
            data = quantize_blocks(x, to, global_scale)
        except ScaleOverflowError as e:
            raise RowFailure("overflow", e.row, e.column, e.value, to) from None
        out_scale = None
        approx = dequantize_blocks(torch.from_numpy(data), to, global_scale) if stats else None
    else:
        q, sc = quantize_rows(x, to)
        data = q.contiguous().view(torch.uint8).numpy()
        out_scale = sc.reshape(-1).numpy()
        approx = dequantize(q, sc, torch.float32) if stats else None
    return Encoded(data, out_scale, RowStats.of(x, approx) if approx is not None else None)


def rows_amax(rows: torch.Tensor, scale: torch.Tensor | None, *, threads: int = 1, native: bool | None = None) -> float:
    """The largest magnitude of the decoded rows (0 for no rows); :class:`RowFailure` for a decoded
    value that is not finite."""
    src, kind, D = _source(rows)
    if src.shape[0] == 0:
        return 0.0
    lib = _native.library() if native else native_encoder() if native is None else None
    if lib is None:
        x = dequantized(src, scale)
        bad = _first_nonfinite_value(x)
        if bad is not None:
            raise RowFailure("nonfinite", bad[0], bad[1], float(x[bad]), "fp32")
        return float(x.abs().max())
    per_row = np.empty(src.shape[0], dtype=np.float32)
    _call(lib, src, kind, D, scale, -1, 0.0, None, 0, per_row, None, threads, "fp32")
    return float(per_row.max())


def first_nonfinite(
    rows: torch.Tensor, format: str | None = None, *, native: bool | None = None
) -> tuple[int, int] | None:
    """``(row, column)`` of the first value of stored rows ``[n, width]`` that is NaN or infinite, None
    when every value is finite. ``format``: "nvfp4" or a GGML block format for uint8 rows (the column
    is then the bad block's first; mxfp4: the value's), else the rows' dtype decides (integer rows are
    always finite; fp8 rows are judged by their bits, so a NaN byte is found whatever torch supports
    for the dtype)."""
    if rows.dim() != 2:
        raise InvalidArgumentError(f"expected stored rows [n, width], got shape {tuple(rows.shape)}")
    if format in _GGML_KINDS or format == "nvfp4":
        kind = _GGML_KINDS.get(format, 6)
        D = format_info(format).head_dim_of(rows.shape[1])
    elif rows.dtype in _SOURCE_KINDS and rows.dtype != torch.uint8:
        kind, D = _SOURCE_KINDS[rows.dtype], rows.shape[1]
    else:
        return None  # integer rows
    if rows.shape[0] == 0 or D == 0:
        return None
    src = rows.detach().cpu().contiguous()
    lib = _native.library() if native else native_encoder() if native is None else None
    if lib is None:
        return _first_nonfinite_reference(src, format)
    col = ctypes.c_int64(0)
    i = lib.ple_first_nonfinite(
        kind, src.data_ptr(), src.shape[1] * src.element_size(), src.shape[0], D, ctypes.byref(col)
    )
    if i == -2:
        raise InvalidArgumentError(f"ple_first_nonfinite refused rows {src.dtype} {tuple(src.shape)} ({format})")
    return None if i < 0 else (int(i), int(col.value))


def _first_nonfinite_reference(rows: torch.Tensor, format: str | None) -> tuple[int, int] | None:
    if format in _GGML_KINDS or format == "nvfp4":
        if format == "nvfp4":  # the E4M3 block scales after the codes
            D = format_info("nvfp4").head_dim_of(rows.shape[1])
            bad = (rows[:, D // 2 :] & 0x7F) == 0x7F
            hit = bad.nonzero()
            return None if not hit.numel() else (int(hit[0, 0]), 16 * int(hit[0, 1]))
        with np.errstate(over="ignore"):
            x = dequantize_blocks(rows, format)
        return _first_nonfinite_value(x)
    special = _FP8_SPECIAL.get(rows.dtype)
    if special is not None:
        bits = rows.view(torch.uint8)
        bad = (bits & special) == special
    elif rows.is_floating_point():
        bad = ~torch.isfinite(rows)
    else:
        return None
    hit = bad.nonzero()
    return None if not hit.numel() else (int(hit[0, 0]), int(hit[0, 1]))
