"""Triton gather + dequantize kernel of the table lookup (CUDA; CPU under ``TRITON_INTERPRET=1``).

One program copies a ``[BLOCK_N, BLOCK_D]`` tile: ``BLOCK_N`` gathered rows, ``BLOCK_D`` columns.
Row addresses are int64 (the published table has 320 million rows). fp8 bytes are decoded with
integer arithmetic and bf16 results rounded to nearest-even by hand, so the kernel returns the
reference's bits on every GPU and under the interpreter (whose own float -> bf16 cast truncates).
The table may live in device memory or in pinned host memory (read over the bus, zero copy).
"""

from __future__ import annotations

import torch

from ...errors import InvalidArgumentError, UsageError
from ..formats import check_activation_dtype, check_ids

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
        pid_n = tl.program_id(0).to(tl.int64)
        pid_d = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        n_mask = n < n_out_rows
        row = tl.load(ids_ptr + n, mask=n_mask, other=0).to(tl.int64)
        # Out-of-range ids (only reachable with check=False) read nothing and give zero rows.
        valid = n_mask & (row >= 0) & (row < n_table_rows)
        row = tl.where(valid, row, 0)
        col_mask = cols < D
        mask = valid[:, None] & col_mask[None, :]
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


def _launch_shape(D: int) -> tuple[int, int]:
    """Hand-tuned tile: BLOCK_D a power of two dividing D when one >= 16 exists (160 -> 32)."""
    block_d = 128
    while block_d >= 16 and D % block_d:
        block_d //= 2
    if block_d < 16:
        block_d = min(128, triton.next_power_of_2(D))
    block_n = max(1, 2048 // block_d)
    return block_n, block_d


def gather_dequant_triton(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    ids: torch.Tensor,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
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
    R, D = data.shape
    device = ids.device
    if out is None:
        out = torch.empty(T, G * D, dtype=dtype, device=device)
    elif tuple(out.shape) != (T, G * D) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise InvalidArgumentError(
            f"out must be a contiguous [{T}, {G * D}] {dtype} tensor on {device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
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
