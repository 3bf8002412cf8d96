"""Block formats: rows stored as whole blocks of a few bytes, each block its values and scale.

Every GGML type here keeps GGML's block layout byte for byte (a row of a GGUF tensor is a row of a
table file), 32 values a block:

| format   | bytes | block layout (little-endian)                                   | value j of the block            |
|----------|-------|----------------------------------------------------------------|---------------------------------|
| q8_0     | 34    | d fp16, q int8[32]                                             | ``q[j] * d``                    |
| q5_1     | 24    | d fp16, m fp16, qh u32, qs u8[16]                              | ``d * q5 + m``                  |
| q5_0     | 22    | d fp16, qh u32, qs u8[16]                                      | ``d * (q5 - 16)``               |
| q4_1     | 20    | d fp16, m fp16, qs u8[16]                                      | ``d * q4 + m``                  |
| q4_0     | 18    | d fp16, qs u8[16]                                              | ``d * (q4 - 8)``                |
| iq4_nl   | 18    | d fp16, qs u8[16]                                              | ``d * IQ4NL[q4]``               |
| mxfp4    | 17    | e u8 (E8M0), qs u8[16]                                         | ``2^(e-128) * MXFP4[q4]``       |

where ``q4 = qs[j] & 15`` for ``j < 16`` and ``qs[j-16] >> 4`` after, and ``q5 = q4 | (bit j of qh) << 4``.
``IQ4NL`` is GGML's non-linear grid (-127 ... 113) and ``MXFP4`` twice the E2M1 values (0, 1, 2, 3, 4,
6, 8, 12 and their negatives), GGML's conventions. Arithmetic is float32, one rounding per operation
in this order (no fused multiply-add), exactly what the ``gguf`` package's ``dequantize`` computes.

``nvfp4`` is NVFP4 as inference engines store it: blocks of 16 E2M1 values with one E4M3 scale each,
and one float32 scale for the whole table. A row of ``D`` values is ``D/2`` bytes of values (value
``2i`` in the low nibble of byte ``i``, ``2i+1`` in its high nibble), then ``D/16`` E4M3 scale bytes:
90 bytes for 160 values. Value ``i`` is ``(E2M1[code] * scale[i // 16]) * global`` in float32.

A lookup returns these float32 values rounded once to the activation dtype.

Quantizers (numpy, float32, offline; :mod:`ple.table.formats.encode` runs the same in C, byte for byte):
q8_0, q5_1, q5_0, q4_1, q4_0 and mxfp4 compute what GGML's C reference loops compute on x86-64, and
what the ``gguf`` package's ``quantize`` computes, bit for bit, but for two kinds of blocks where
the package differs from GGML: the minimum and maximum of q4_1 and q5_1 are the first of equal
values, as GGML's loop finds them (where the extreme is a zero present with both signs, numpy's
reductions, which the package uses, pick one by their vector lanes; the decoded values are the
same), and a q4_0 or q5_0 block of zeros has the scale -0 whatever its first zero's sign (GGML's
loop takes only a magnitude strictly above 0; the package takes the first value). A code that is
not finite (``1 / d`` overflows float32 for a block of values all below about 5e-38) is 0, as
GGML's ``(int8_t)`` cast gives it on x86-64 and the package's cast does. iq4_nl follows GGML's
``quantize_iq4_nl``, what llama-quantize writes (no imatrix: a scale search over 15 candidates,
then every value to its nearest grid point; ``quantize_row_iq4_nl_ref`` searches none); nvfp4 takes
a per-block scale ``amax / 6 / global`` rounded to E4M3 (nearest, ties to even, at most 448) and
every value to the nearest E2M1 value (ties to even).

A block whose fp16 scale (or q4_1 / q5_1 minimum) would be infinite is refused
(:class:`ScaleOverflowError`, naming the row, the block's first column and its value of largest
magnitude): GGML writes such a block with an infinite scale, which decodes to inf and NaN. q8_0
holds magnitudes up to about 8.3e6, iq4_nl 6.8e6 to 8.3e6 (its scale search may map the largest
value to another grid point than 127), q5_0 1.0e6, q4_0 5.2e5; q4_1 and q5_1 values down to -65504
and a block's range up to about 9.8e5 and 2.0e6. mxfp4 (an E8M0 scale) and nvfp4 (a global float32
scale) never overflow.
"""

from __future__ import annotations

import numpy as np
import torch

from ple.errors import InvalidArgumentError
from ple.table.formats.catalog import BLOCK_FORMATS, format_info

__all__ = [
    "ScaleOverflowError",
    "IQ4NL_VALUES",
    "MXFP4_VALUES",
    "E2M1_VALUES",
    "dequantize_blocks",
    "quantize_blocks",
    "nvfp4_global_scale",
    "code_values",
]

IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""GGML's IQ4_NL grid, indexed by the 4-bit code."""

MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
"""Twice the E2M1 value of each 4-bit code (GGML's convention for MXFP4; the scale is halved)."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The E2M1 value of each 4-bit code (sign in bit 3)."""


def code_values(format: str) -> tuple[float, ...]:
    """The value of each 4-bit code before the block scale: what the kernels' lookup tables hold."""
    return {
        "q4_0": tuple(float(c - 8) for c in range(16)),
        "q4_1": tuple(float(c) for c in range(16)),
        "iq4_nl": tuple(float(v) for v in IQ4NL_VALUES),
        "mxfp4": tuple(float(v) for v in MXFP4_VALUES),
        "nvfp4": E2M1_VALUES,
    }[format]


def _check_format(format: str) -> None:
    if format not in BLOCK_FORMATS:
        raise InvalidArgumentError(f"{format!r} is not a block format: expected one of {list(BLOCK_FORMATS)}")


# ---------------------------------------------------------------------------------------------- decode


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` little-endian fp16 bytes -> ``[..., 1]`` float32 (exact)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """``[..., 16]`` bytes -> ``[..., 32]`` GGML codes: low nibbles are values 0..15, high ones 16..31."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """``[..., 4]`` bytes of a little-endian u32 -> ``[..., 32]`` its bits (bit j at j), as uint8."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    bits = (qh.unsqueeze(-1) >> shifts) & 1  # [..., 4, 8]: byte k bit b is bit 8k+b
    return bits.reshape(*qh.shape[:-1], 32)


def _lut(format: str, device: torch.device) -> torch.Tensor:
    return torch.tensor(code_values(format), dtype=torch.float32, device=device)


def dequantize_blocks(
    rows: torch.Tensor, format: str, global_scale: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Stored rows ``[N, row_nbytes]`` uint8 of a block format -> their values ``[N, head_dim]`` float32.

    ``global_scale`` is the table's float32 scale (nvfp4 only). Exactly the values of the module
    docstring, on the rows' device (any device torch runs on).
    """
    _check_format(format)
    info = format_info(format)
    if rows.dtype != torch.uint8 or rows.dim() != 2:
        raise InvalidArgumentError(f"{format} rows must be a 2-D uint8 tensor, got {rows.dtype} {tuple(rows.shape)}")
    N, W = rows.shape
    D = info.head_dim_of(W)
    dev = rows.device
    if format == "nvfp4":
        if global_scale is None:
            raise InvalidArgumentError("nvfp4 rows need the table's global scale")
        g = torch.as_tensor(global_scale, dtype=torch.float32).reshape(1).to(dev)
        packed, sbytes = rows[:, : D // 2], rows[:, D // 2 :]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(N, D // 16, 16)
        scales = sbytes.contiguous().view(torch.float8_e4m3fn).to(torch.float32).unsqueeze(-1)
        vals = _lut("nvfp4", dev)[codes.long()] * scales
        return (vals * g).reshape(N, D)
    blocks = rows.reshape(N, D // 32, info.block_nbytes)
    if format == "q8_0":
        d = _f16(blocks[..., 0:2])
        q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
        return (q * d).reshape(N, D)
    if format == "mxfp4":
        e = blocks[..., 0:1].to(torch.int32)
        bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
        d = bits.view(torch.float32)
        codes = _nibbles32(blocks[..., 1:])
        return (d * _lut("mxfp4", dev)[codes.long()]).reshape(N, D)
    d = _f16(blocks[..., 0:2])
    if format in ("q4_0", "iq4_nl"):
        codes = _nibbles32(blocks[..., 2:])
        return (d * _lut(format, dev)[codes.long()]).reshape(N, D)
    if format == "q4_1":
        m = _f16(blocks[..., 2:4])
        q = _nibbles32(blocks[..., 4:]).to(torch.float32)
        return (d * q + m).reshape(N, D)
    if format == "q5_0":
        q = (_nibbles32(blocks[..., 6:]) | (_high_bits(blocks[..., 2:6]) << 4)).to(torch.float32)
        return (d * (q - 16.0)).reshape(N, D)
    # q5_1
    m = _f16(blocks[..., 2:4])
    q = (_nibbles32(blocks[..., 8:]) | (_high_bits(blocks[..., 4:8]) << 4)).to(torch.float32)
    return (d * q + m).reshape(N, D)


# ---------------------------------------------------------------------------------------------- encode

_F32 = np.float32


def _pack32(codes: np.ndarray) -> np.ndarray:
    """``[B, 32]`` 4-bit codes -> ``[B, 16]`` bytes, GGML order (value j low nibble, j+16 high)."""
    c = codes.astype(np.uint8)
    return (c[:, :16] & 15) | ((c[:, 16:] & 15) << 4)


def _qh(codes: np.ndarray) -> np.ndarray:
    """``[B, 32]`` 5-bit codes -> ``[B, 4]`` bytes of the u32 holding bit 4 of value j at bit j."""
    bit = ((codes.astype(np.uint32) >> 4) & 1) << np.arange(32, dtype=np.uint32)
    return bit.sum(axis=1, dtype=np.uint32).astype("<u4").view(np.uint8).reshape(-1, 4)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """``[B, 1]`` float32 -> ``[B, 2]`` bytes of the nearest fp16 (ties to even; too large: infinity,
    which :func:`quantize_blocks` then refuses)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16).astype("<f2").view(np.uint8).reshape(-1, 2)


def _inverse(d: np.ndarray) -> np.ndarray:
    """``1 / d`` in float32, 0 where ``d`` is 0 (infinite where ``d`` is subnormal and its inverse overflows)."""
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(d == 0, _F32(0), _F32(1) / d).astype(_F32)


def _signed_max(x: np.ndarray) -> np.ndarray:
    """``[B, 1]``: the value of largest magnitude of each block (the first of equals), sign kept; +0
    for a block of zeros of either sign (GGML's loop starts from ``max = 0.0f`` and takes only a
    strictly larger magnitude, so a q4_0 block of zeros whose first is -0.0 has the scale -0)."""
    big = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    return np.where(big == 0, _F32(0), big).astype(_F32)


def _finite_codes(q: np.ndarray, top: int) -> np.ndarray:
    """Codes clipped to ``[0, top]``; a non-finite one (``1 / d`` overflows for a block of values all
    below about 5e-38: infinite, or NaN for a zero) is 0, as GGML's ``(int8_t)`` cast of it gives on
    x86-64 (and the ``gguf`` package's cast)."""
    return np.where(np.isfinite(q), np.clip(q, 0, top), _F32(0)).astype(_F32)


def _q8_0(x: np.ndarray) -> np.ndarray:
    d = (np.abs(x).max(axis=1, keepdims=True) / _F32(127)).astype(_F32)
    v = x * _inverse(d)
    a = np.abs(v)
    whole = np.floor(a)
    q = np.sign(v) * (whole + (a - whole >= _F32(0.5)))  # half away from zero, exactly
    return np.concatenate([_f16_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1)


def _q_sym(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 4/5-bit codes: ``d = max / -levels``, code ``trunc(x / d + levels + 0.5)``."""
    d = (_signed_max(x) / _F32(-levels)).astype(_F32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.trunc(x * _inverse(d) + _F32(levels + 0.5)).astype(_F32)
    return d, _finite_codes(q, 2 * levels - 1)


def _q_affine(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Affine 4/5-bit codes: ``d = (max - min) / top``, code ``trunc((x - min) / d + 0.5)``; the min and
    max are the first of equal values (``argmin`` / ``argmax``), as GGML's reference loop finds them."""
    lo = np.take_along_axis(x, x.argmin(axis=1)[:, None], axis=1)
    hi = np.take_along_axis(x, x.argmax(axis=1)[:, None], axis=1)
    d = ((hi - lo) / _F32(top)).astype(_F32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.trunc((x - lo) * _inverse(d) + _F32(0.5)).astype(_F32)
    return d, lo, _finite_codes(q, top)


def _mxfp4(x: np.ndarray) -> np.ndarray:
    amax = np.abs(x).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) + _F32(125), _F32(0)).astype(np.uint8)
    e32 = e.astype(np.uint32)
    half = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - np.uint32(1)) << np.uint32(23)).view(_F32)
    grid = np.asarray(MXFP4_VALUES, dtype=_F32)
    err = np.abs(half[:, :, None] * grid[None, None, :] - x[:, :, None])  # [B, 32, 16]
    codes = err.argmin(axis=2)
    return np.concatenate([e, _pack32(codes)], axis=1)


def _nearest_iq4(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the grid point nearest each value (GGML's ``best_index_int8``: the upper one unless the
    lower is strictly nearer, so a value halfway between two goes up)."""
    hi = np.clip(np.searchsorted(grid, v, side="right"), 1, len(grid) - 1)
    lower, upper = grid[hi - 1], grid[hi]
    idx = np.where(v - lower < upper - v, hi - 1, hi)
    return np.where(v <= grid[0], 0, np.where(v >= grid[-1], len(grid) - 1, idx))


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    grid = np.asarray(IQ4NL_VALUES, dtype=_F32)
    B = x.shape[0]
    w = x * x
    amax = np.abs(x).max(axis=1)
    big = _signed_max(x)[:, 0]
    live = amax >= _F32(1e-15)
    safe_big = np.where(live, big, _F32(1))

    def sums(inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = grid[_nearest_iq4(inv[:, None] * x, grid)]
        sqx = np.zeros(B, _F32)
        sq2 = np.zeros(B, _F32)
        for j in range(32):  # sequential sums, as the reference loop
            wq = w[:, j] * q[:, j]
            sqx = (sqx + wq * x[:, j]).astype(_F32)
            sq2 = (sq2 + wq * q[:, j]).astype(_F32)
        return sqx, sq2

    d0 = (-safe_big / grid[0]).astype(_F32)
    sqx, sq2 = sums((_F32(1) / d0).astype(_F32))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = (sqx / sq2).astype(_F32)
    best = (d * sqx).astype(_F32)
    for step in range(-7, 8):
        inv = ((_F32(step) + grid[0]) / safe_big).astype(_F32)
        sqx, sq2 = sums(inv)
        # a block past float32's range (refused later, naming it) overflows to inf here, on purpose
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            better = (sq2 > 0) & (sqx * sqx > best * sq2)
            d = np.where(better, (sqx / sq2).astype(_F32), d)
            best = np.where(better, (d * sqx).astype(_F32), best)
    d = np.where(live, d, _F32(0)).astype(_F32)
    codes = _nearest_iq4(_inverse(d)[:, None] * x, grid)
    return np.concatenate([_f16_bytes(d[:, None]), _pack32(codes)], axis=1)


def _e2m1_codes(v: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code of each value (ties to even), sign in bit 3."""
    a = np.abs(v)
    mag = (
        (a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    ).astype(np.uint8)
    return mag | (np.signbit(v).astype(np.uint8) << 3)


def nvfp4_global_scale(amax: float) -> float:
    """The global scale an nvfp4 table of largest magnitude ``amax`` gets: ``amax / (6 * 448)``
    (the largest block scale is then the largest E4M3 value), 1 for an all-zero table."""
    if not np.isfinite(amax) or amax < 0:
        raise InvalidArgumentError(f"an nvfp4 table needs a finite largest magnitude, got {amax}")
    g = float(np.float32(amax) / np.float32(6 * 448))
    return g if g > 0 else 1.0


def _nvfp4(x: np.ndarray, global_scale: float) -> np.ndarray:
    N, D = x.shape
    blocks = x.reshape(N, D // 16, 16)
    g = _F32(global_scale)
    want = (np.abs(blocks).max(axis=2) / _F32(6) / g).astype(_F32)
    sc = torch.from_numpy(np.minimum(want, _F32(448))).to(torch.float8_e4m3fn)
    s_bytes = sc.view(torch.uint8).numpy()
    s_val = sc.to(torch.float32).numpy()
    step = (s_val * g).astype(_F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(step[:, :, None] > 0, blocks / step[:, :, None], _F32(0)).astype(_F32)
    codes = _e2m1_codes(v).reshape(N, D)
    packed = (codes[:, 0::2] & 15) | ((codes[:, 1::2] & 15) << 4)
    return np.concatenate([packed, s_bytes], axis=1)


class ScaleOverflowError(InvalidArgumentError):
    """A block's fp16 scale (or minimum) would be infinite; ``row``, ``column`` (the block's first) and
    ``value`` (its value of largest magnitude) say where."""

    def __init__(self, format: str, row: int, column: int, value: float, what: str = "row") -> None:
        self.format, self.row, self.column, self.value = format, row, column, value
        super().__init__(
            f"cannot quantize {what} {row} to {format}: its block of columns [{column}, {column + 32}) holds "
            f"{value:.7g}, too large for the block's fp16 scale (largest finite 65504; see ple.table.formats.blocks "
            f"for what each format holds): scale the table down, or choose fp8, int8, nvfp4 or mxfp4"
        )


def overflowing_block(rows: np.ndarray, format: str) -> tuple[int, int] | None:
    """``(row, block)`` of the first block of stored rows ``[N, row_nbytes]`` whose fp16 scale or
    minimum is not finite, None when every one is (and for formats without an fp16 scale)."""
    info = format_info(format)
    fields = info.fp16_fields  # byte offsets of the fp16 scale (and minimum) in each block
    if not fields or rows.shape[0] == 0:
        return None
    blocks = rows.reshape(rows.shape[0], -1, info.block_nbytes)
    bad = np.zeros(blocks.shape[:2], dtype=bool)
    for at in fields:
        bad |= (blocks[:, :, at + 1] & 0x7C) == 0x7C  # the high byte's exponent bits all set
    if not bad.any():
        return None
    r, b = (int(v) for v in np.argwhere(bad)[0])
    return r, b


def quantize_blocks(x: np.ndarray | torch.Tensor, format: str, global_scale: float | None = None) -> np.ndarray:
    """Rows ``x [N, head_dim]`` (any float dtype; computed in float32) -> stored rows ``[N, row_nbytes]``
    uint8 of a block format. ``global_scale`` is needed for nvfp4 (see :func:`nvfp4_global_scale`).

    Non-finite values are refused by name, and so is a block whose fp16 scale or minimum would be
    infinite (:class:`ScaleOverflowError`)."""
    _check_format(format)
    info = format_info(format)
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.ascontiguousarray(x, dtype=_F32)
    if x.ndim != 2:
        raise InvalidArgumentError(f"expected rows [N, head_dim] to quantize, got shape {x.shape}")
    N, D = x.shape
    W = info.width(D)
    if N == 0:
        return np.zeros((0, W), np.uint8)
    finite = np.isfinite(x)
    if not finite.all():
        r, c = (int(v) for v in np.argwhere(~finite)[0])
        raise InvalidArgumentError(f"cannot quantize a non-finite value {x[r, c]} at row {r}, column {c}")
    if format == "nvfp4":
        if global_scale is None:
            raise InvalidArgumentError("quantizing to nvfp4 needs the table's global scale (nvfp4_global_scale)")
        return _nvfp4(x, global_scale)
    b = x.reshape(N * D // 32, 32)
    if format == "q8_0":
        out = _q8_0(b)
    elif format == "mxfp4":
        out = _mxfp4(b)
    elif format == "iq4_nl":
        out = _iq4_nl(b)
    elif format == "q4_0":
        d, q = _q_sym(b, 8)
        out = np.concatenate([_f16_bytes(d), _pack32(q)], axis=1)
    elif format == "q5_0":
        d, q = _q_sym(b, 16)
        out = np.concatenate([_f16_bytes(d), _qh(q), _pack32(q)], axis=1)
    elif format == "q4_1":
        d, lo, q = _q_affine(b, 15)
        out = np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack32(q)], axis=1)
    else:  # q5_1
        d, lo, q = _q_affine(b, 31)
        out = np.concatenate([_f16_bytes(d), _f16_bytes(lo), _qh(q), _pack32(q)], axis=1)
    out = np.ascontiguousarray(out.reshape(N, W))
    bad = overflowing_block(out, format)
    if bad is not None:
        r, blk = bad
        block = x[r, 32 * blk : 32 * blk + 32]
        raise ScaleOverflowError(format, r, 32 * blk, float(block[np.abs(block).argmax()]))
    return out
