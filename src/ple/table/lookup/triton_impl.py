"""Triton gather + dequantize kernel of the table lookup (CUDA; CPU under ``TRITON_INTERPRET=1``).

One program copies a ``[BLOCK_N, BLOCK_D]`` tile: ``BLOCK_N`` gathered rows, ``BLOCK_D`` columns.
Row addresses are int64 (the published table has 320 million rows). fp8 bytes are decoded with
integer arithmetic and bf16 results rounded to nearest-even by hand, so the kernel returns the
reference's bits on every GPU and under the interpreter (whose own float -> bf16 cast truncates).
The table may live in device memory or in pinned host memory (read over the bus, zero copy).
"""

from __future__ import annotations

import torch

from ple.errors import InvalidArgumentError, UsageError
from ple.table.formats.blocks import code_values
from ple.table.formats.catalog import check_activation_dtype, check_ids, format_info

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional dependency
    triton = None
    tl = None

__all__ = ["gather_dequant_triton", "HAS_TRITON"]

HAS_TRITON = triton is not None

_OUT_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_SCALE_KIND_NONE, _SCALE_KIND_GLOBAL, _SCALE_KIND_ROW = 0, 1, 2

if HAS_TRITON:

    @triton.jit
    def _round_bf16(y):
        """fp32 -> the nearest bf16 value (ties to even), still held in fp32; NaN kept."""
        bits = y.to(tl.uint32, bitcast=True)
        lsb = (bits >> 16) & 1
        rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
        return tl.where(y != y, y, rounded.to(tl.float32, bitcast=True))

    @triton.jit
    def _round_to_out(y, OUT_KIND: tl.constexpr):
        if OUT_KIND == 1:
            y = y.to(tl.float16).to(tl.float32)
        elif OUT_KIND == 2:
            y = _round_bf16(y)
        return y

    @triton.jit
    def _decode_e4m3(b):
        """float8 e4m3fn bytes (any int type) -> fp32, exactly."""
        b = b.to(tl.int32) & 0xFF
        e = (b >> 3) & 15
        m = b & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        subnormal = m.to(tl.float32) * 0.001953125  # m * 2^-9
        mag = tl.where(e == 0, subnormal, normal)
        val = tl.where((b & 128) != 0, -mag, mag)
        return tl.where((b & 127) == 127, float("nan"), val)

    @triton.jit
    def _row_tile(ids_ptr, n_out_rows, n_table_rows, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """This program's tile: output rows ``n`` [BLOCK_N] (int64) and columns ``cols`` [BLOCK_D], the
        table row each output row reads (out-of-range ids, only reachable with check=False, read row 0
        and are masked off: they give zero rows), and the masks."""
        pid_n = tl.program_id(0).to(tl.int64)
        pid_d = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        n_mask = n < n_out_rows
        row = tl.load(ids_ptr + n, mask=n_mask, other=0).to(tl.int64)
        valid = n_mask & (row >= 0) & (row < n_table_rows)
        row = tl.where(valid, row, 0)
        col_mask = cols < D
        mask = valid[:, None] & col_mask[None, :]
        return n, cols, n_mask, row, valid, col_mask, mask

    @triton.jit
    def _gather_dequant_kernel(
        ids_ptr,
        data_ptr,
        scale_ptr,
        out_ptr,
        n_out_rows,
        n_table_rows,
        D,
        stride_row,
        stride_col,
        stride_scale,
        IS_FP8: tl.constexpr,
        SCALE_KIND: tl.constexpr,
        OUT_KIND: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        n, cols, n_mask, row, valid, col_mask, mask = _row_tile(ids_ptr, n_out_rows, n_table_rows, D, BLOCK_N, BLOCK_D)
        x = tl.load(data_ptr + row[:, None] * stride_row + cols[None, :] * stride_col, mask=mask, other=0)
        if IS_FP8:
            y = _decode_e4m3(x)
        else:
            y = x.to(tl.float32)
        if SCALE_KIND == 1:
            s = _round_to_out(tl.load(scale_ptr).to(tl.float32), OUT_KIND)
            y = y * s
        elif SCALE_KIND == 2:
            s = tl.load(scale_ptr + row * stride_scale, mask=valid, other=0).to(tl.float32)
            y = y * _round_to_out(s, OUT_KIND)[:, None]
        y = _round_to_out(y, OUT_KIND)
        y = tl.where(mask, y, 0.0)
        store_mask = n_mask[:, None] & col_mask[None, :]
        tl.store(out_ptr + n[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=store_mask)

    @triton.jit
    def _half_at(ptr):
        """Two little-endian bytes at ``ptr`` (any shape of pointers) -> their fp16 value as fp32."""
        lo = tl.load(ptr).to(tl.int32)
        hi = tl.load(ptr + 1).to(tl.int32)
        bits = (lo | (hi << 8)).to(tl.int16)
        return bits.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _gather_blocks_kernel(
        ids_ptr,
        data_ptr,
        lut_ptr,
        scale_ptr,
        out_ptr,
        n_out_rows,
        n_table_rows,
        D,
        row_nbytes,
        FMT: tl.constexpr,
        BLOCK_NBYTES: tl.constexpr,
        OUT_KIND: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # FMT: the format's kernel_code (ple.table.formats.catalog): 0 q8_0, 1 q5_1, 2 q5_0, 3 q4_1, 4 q4_0,
        # 5 iq4_nl, 6 mxfp4, 7 nvfp4
        n, cols, n_mask, row, valid, col_mask, mask = _row_tile(ids_ptr, n_out_rows, n_table_rows, D, BLOCK_N, BLOCK_D)
        base = data_ptr + row[:, None] * row_nbytes
        if FMT == 7:
            byte = tl.load(base + (cols // 2)[None, :], mask=mask, other=0).to(tl.int32)
            code = (byte >> ((cols % 2) * 4)[None, :]) & 15
            sbyte = tl.load(base + (D // 2 + cols // 16)[None, :], mask=mask, other=0)
            s = _decode_e4m3(sbyte)
            y = tl.load(lut_ptr + code, mask=mask, other=0.0) * s
            y = y * tl.load(scale_ptr).to(tl.float32)
        else:
            j = cols % 32
            blk = base + ((cols // 32) * BLOCK_NBYTES)[None, :]
            if FMT == 0:
                d = _half_at(blk)
                q = tl.load(blk + 2 + j[None, :], mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                y = q * d
            elif FMT == 6:
                e = tl.load(blk, mask=mask, other=0).to(tl.int32)
                dbits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
                d = dbits.to(tl.float32, bitcast=True)
                byte = tl.load(blk + 1 + (j % 16)[None, :], mask=mask, other=0).to(tl.int32)
                code = (byte >> ((j // 16) * 4)[None, :]) & 15
                y = d * tl.load(lut_ptr + code, mask=mask, other=0.0)
            else:
                d = _half_at(blk)
                if FMT == 1:
                    qs_off = 8
                elif FMT == 2:
                    qs_off = 6
                elif FMT == 3:
                    qs_off = 4
                else:
                    qs_off = 2
                byte = tl.load(blk + qs_off + (j % 16)[None, :], mask=mask, other=0).to(tl.int32)
                code = (byte >> ((j // 16) * 4)[None, :]) & 15
                if FMT == 1 or FMT == 2:
                    if FMT == 1:
                        qh_off = 4
                    else:
                        qh_off = 2
                    hb = tl.load(blk + qh_off + (j // 8)[None, :], mask=mask, other=0).to(tl.int32)
                    code = code | (((hb >> (j % 8)[None, :]) & 1) << 4)
                if FMT == 1 or FMT == 3:
                    m = _half_at(blk + 2)
                    y = d * code.to(tl.float32)
                    y = y + m
                elif FMT == 2:
                    y = d * (code.to(tl.float32) - 16.0)
                else:
                    y = d * tl.load(lut_ptr + code, mask=mask, other=0.0)
        y = _round_to_out(y, OUT_KIND)
        y = tl.where(mask, y, 0.0)
        store_mask = n_mask[:, None] & col_mask[None, :]
        tl.store(out_ptr + n[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=store_mask)


def _launch_shape(D: int) -> tuple[int, int]:
    """Hand-tuned tile: BLOCK_D a power of two dividing D when one >= 16 exists (160 -> 32)."""
    block_d = 128
    while block_d >= 16 and D % block_d:
        block_d //= 2
    if block_d < 16:
        block_d = min(128, triton.next_power_of_2(D))
    block_n = max(1, 2048 // block_d)
    return block_n, block_d


def _output(out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``out`` checked to be a contiguous ``[rows, cols]`` tensor of ``dtype`` on ``device``, or a new one."""
    if out is None:
        return torch.empty(rows, cols, dtype=dtype, device=device)
    if tuple(out.shape) != (rows, cols) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise InvalidArgumentError(
            f"out must be a contiguous [{rows}, {cols}] {dtype} tensor on {device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    return out


def gather_dequant_triton(data, scale, ids, dtype, *, out=None, check=True, format=None) -> torch.Tensor:
    """Twin of :func:`gather_dequant_reference` as one Triton kernel.

    ``data [R, D]`` (device memory, or pinned host memory read over the bus), ``scale`` None /
    ``[1]`` / ``[R, 1]``, ``ids [T, G]`` int64 on the device -> ``[T, G*D]`` in ``dtype`` on the ids'
    device. ``check=True`` checks the ids' range first (a host synchronization on a GPU); with
    ``check=False`` out-of-range ids give zero rows.
    """
    if not HAS_TRITON:
        raise UsageError("gather_dequant_triton needs the triton package, which is not installed")
    check_activation_dtype(dtype)
    if check:
        check_ids(ids, data.shape[0])
    T, G = ids.shape
    if format is not None and format_info(format).blocked:
        return _gather_blocks(data, scale, ids, dtype, format, out)
    R, D = data.shape
    device = ids.device
    out = _output(out, T, G * D, dtype, device)
    n = T * G
    if n == 0 or D == 0:
        return out
    flat = ids.reshape(-1).contiguous()
    is_fp8 = data.dtype == torch.float8_e4m3fn
    data_arg = data.view(torch.uint8) if is_fp8 else data
    if scale is None:
        scale_kind, scale_arg, stride_scale = _SCALE_KIND_NONE, data_arg, 0
    elif scale.dim() == 2:
        scale_kind, scale_arg, stride_scale = _SCALE_KIND_ROW, scale, scale.stride(0)
    else:
        scale_kind, scale_arg, stride_scale = _SCALE_KIND_GLOBAL, scale.reshape(1), 0
    block_n, block_d = _launch_shape(D)
    grid = (triton.cdiv(n, block_n), triton.cdiv(D, block_d))
    _gather_dequant_kernel[grid](
        flat,
        data_arg,
        scale_arg,
        out,
        n,
        R,
        D,
        data.stride(0),
        data.stride(1),
        stride_scale,
        IS_FP8=is_fp8,
        SCALE_KIND=scale_kind,
        OUT_KIND=_OUT_KIND[dtype],
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return out


_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _lut(format: str, device: torch.device) -> torch.Tensor:
    key = (format, device)
    if key not in _LUTS:
        values = code_values(format) if format in ("q4_0", "iq4_nl", "mxfp4", "nvfp4") else (0.0,) * 16
        _LUTS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _LUTS[key]


def _gather_blocks(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    ids: torch.Tensor,
    dtype: torch.dtype,
    format: str,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The block-format kernel: ``data [R, row_nbytes]`` uint8 (contiguous rows), ``scale`` nvfp4's
    global ``[1]``. The launch turns fused multiply-add off, so the float32 steps round as the
    reference's do."""
    info = format_info(format)
    T, G = ids.shape
    R, W = data.shape
    D = info.head_dim_of(W)
    device = ids.device
    out = _output(out, T, G * D, dtype, device)
    n = T * G
    if n == 0:
        return out
    if data.stride(1) != 1 or data.stride(0) != W:
        raise InvalidArgumentError("block-format rows must be contiguous for the Triton lookup")
    if format == "nvfp4":
        if scale is None:
            raise InvalidArgumentError("nvfp4 rows need the table's global scale")
        scale_arg = scale.reshape(1).to(device=device, dtype=torch.float32)
    else:
        scale_arg = _lut(format, device)
    flat = ids.reshape(-1).contiguous()
    block_d = 32
    block_n = 64
    grid = (triton.cdiv(n, block_n), triton.cdiv(D, block_d))
    _gather_blocks_kernel[grid](
        flat,
        data,
        _lut(format, device),
        scale_arg,
        out,
        n,
        R,
        D,
        W,
        FMT=info.kernel_code,
        BLOCK_NBYTES=info.block_nbytes,
        OUT_KIND=_OUT_KIND[dtype],
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        enable_fp_fusion=False,
    )
    return out
