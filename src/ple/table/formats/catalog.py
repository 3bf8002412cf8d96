"""Storage formats of a PLE table and the tensor checks shared by every tier.

A table is ``data [rows, head_dim]`` in a storage dtype plus, for quantized formats, a float
scale: one global value (``[1]``) or one value per row (``[rows, 1]``).

| format     | storage dtype         | scale        |
|------------|-----------------------|--------------|
| "bf16"     | torch.bfloat16        | none         |
| "fp16"     | torch.float16         | none         |
| "fp32"     | torch.float32         | none         |
| "fp8"      | torch.float8_e4m3fn   | global, [1]  |
| "fp8_row"  | torch.float8_e4m3fn   | per row, [rows, 1] |
| "int8_row" | torch.int8            | per row, [rows, 1] |
| "q8_0"     | torch.uint8 (blocks)  | none (in the blocks) |
| "q5_1"     | torch.uint8 (blocks)  | none (in the blocks) |
| "q5_0"     | torch.uint8 (blocks)  | none (in the blocks) |
| "q4_1"     | torch.uint8 (blocks)  | none (in the blocks) |
| "q4_0"     | torch.uint8 (blocks)  | none (in the blocks) |
| "iq4_nl"   | torch.uint8 (blocks)  | none (in the blocks) |
| "mxfp4"    | torch.uint8 (blocks)  | none (in the blocks) |
| "nvfp4"    | torch.uint8 (blocks)  | global, [1] (and E4M3 ones in the rows) |

Block formats (:mod:`ple.table.formats.blocks`) store a row of ``head_dim`` values as
``head_dim / block`` whole blocks, so ``data`` is ``[rows, row_nbytes]`` bytes, each row's values
and block scales together (one read fetches a row); ``head_dim`` must be a multiple of the block.

Dequantization is ``row.to(dtype) * scale.to(dtype)`` in the activation dtype,
``row.to(dtype)`` for plain formats. Every scale is a positive finite number (a zero, negative,
NaN or infinite scale would serve zeros, flipped signs or NaN rows): :func:`check_scale_values`
is the one check, made wherever scales enter a table (construction, table files, conversion,
checkpoint loading).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ple.errors import InvalidArgumentError, PLEError

__all__ = [
    "FORMATS",
    "ACTIVATION_DTYPES",
    "FormatInfo",
    "BLOCK_FORMATS",
    "format_info",
    "infer_format",
    "check_table_tensors",
    "check_scale_values",
    "check_ids",
    "table_device",
    "IdOutOfRangeError",
]


@dataclasses.dataclass(frozen=True)
class FormatInfo:
    """What a format name means: storage dtype and scale kind ("none", "global" or "row")."""

    name: str
    storage_dtype: torch.dtype
    scale_kind: str
    block: int = 1
    """Values per block (1 for the element formats)."""
    block_nbytes: int = 0
    """Bytes per block (values and block scales); the element size for element formats."""

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def blocked(self) -> bool:
        """Whether rows are stored as blocks of several values (a GGML-style block format)."""
        return self.block > 1

    def check_head_dim(self, head_dim: int) -> None:
        """Refuse a row width that is not a whole number of blocks."""
        if self.blocked and head_dim % self.block:
            raise InvalidArgumentError(
                f"format {self.name!r} stores rows as blocks of {self.block} values: head_dim {head_dim} "
                f"is not a multiple of {self.block}"
            )

    def width(self, head_dim: int) -> int:
        """Columns of the stored ``data [rows, width]`` for rows of ``head_dim`` values."""
        self.check_head_dim(head_dim)
        return head_dim // self.block * self.block_nbytes if self.blocked else head_dim

    def row_nbytes(self, head_dim: int) -> int:
        """Bytes of one stored row of ``head_dim`` values (block scales included)."""
        return self.width(head_dim) * self.itemsize

    def head_dim_of(self, width: int) -> int:
        """``head_dim`` of stored rows ``width`` columns wide."""
        if not self.blocked:
            return width
        if width % self.block_nbytes:
            raise InvalidArgumentError(
                f"format {self.name!r} rows are whole blocks of {self.block_nbytes} bytes: a row of {width} bytes is not"
            )
        return width // self.block_nbytes * self.block


_INFOS = {
    "bf16": FormatInfo("bf16", torch.bfloat16, "none"),
    "fp16": FormatInfo("fp16", torch.float16, "none"),
    "fp32": FormatInfo("fp32", torch.float32, "none"),
    "fp8": FormatInfo("fp8", torch.float8_e4m3fn, "global"),
    "fp8_row": FormatInfo("fp8_row", torch.float8_e4m3fn, "row"),
    "int8_row": FormatInfo("int8_row", torch.int8, "row"),
    # GGML block layouts (bit-compatible with GGUF files): 32 values a block.
    "q8_0": FormatInfo("q8_0", torch.uint8, "none", 32, 34),
    "q5_1": FormatInfo("q5_1", torch.uint8, "none", 32, 24),
    "q5_0": FormatInfo("q5_0", torch.uint8, "none", 32, 22),
    "q4_1": FormatInfo("q4_1", torch.uint8, "none", 32, 20),
    "q4_0": FormatInfo("q4_0", torch.uint8, "none", 32, 18),
    "iq4_nl": FormatInfo("iq4_nl", torch.uint8, "none", 32, 18),
    "mxfp4": FormatInfo("mxfp4", torch.uint8, "none", 32, 17),
    # NVFP4 as engines store it: 16 E2M1 values a block with one E4M3 scale, one fp32 scale a table.
    "nvfp4": FormatInfo("nvfp4", torch.uint8, "global", 16, 9),
}
for _k, _v in list(_INFOS.items()):
    if not _v.blocked:
        _INFOS[_k] = dataclasses.replace(_v, block_nbytes=_v.itemsize)

BLOCK_FORMATS: tuple[str, ...] = tuple(k for k, v in _INFOS.items() if v.blocked)
"""The block formats (rows stored as whole blocks of bytes)."""

FORMATS: tuple[str, ...] = tuple(_INFOS)
"""Every table format name."""

ACTIVATION_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes a lookup may return."""

_PLAIN_BY_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def format_info(format: str) -> FormatInfo:
    """The :class:`FormatInfo` of a format name; unknown names raise ``ValueError``."""
    try:
        return _INFOS[format]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unknown table format {format!r}: expected one of {list(FORMATS)}") from None


def infer_format(data: torch.Tensor, scale: torch.Tensor | None) -> str:
    """Format name of ``data [rows, head_dim]`` with ``scale`` (None, ``[1]`` or ``[rows, 1]``).

    A 2-D scale is per-row; a scale with one element and at most one dimension is global.
    """
    if scale is None:
        if data.dtype in _PLAIN_BY_DTYPE:
            return _PLAIN_BY_DTYPE[data.dtype]
        raise InvalidArgumentError(
            f"table data of dtype {data.dtype} needs a scale: plain tables are one of {list(_PLAIN_BY_DTYPE)}"
        )
    per_row = scale.dim() == 2
    if data.dtype == torch.uint8 and not per_row:
        return "nvfp4"  # the one block format with a global scale
    if data.dtype == torch.float8_e4m3fn:
        return "fp8_row" if per_row else "fp8"
    if data.dtype == torch.int8 and per_row:
        return "int8_row"
    raise InvalidArgumentError(
        f"no table format stores data of dtype {data.dtype} with a scale of shape {tuple(scale.shape)}: "
        f"expected float8_e4m3fn with [1] or [rows, 1], or int8 with [rows, 1]"
    )


def check_table_tensors(data: torch.Tensor, scale: torch.Tensor | None, format: str | None = None) -> str:
    """Validate a table's tensors; return its format name (inferred when ``format`` is None).

    ``data`` must be ``[rows, head_dim]`` of the format's storage dtype; a global scale has one
    element, a per-row scale is ``[rows, 1]``; scales are floating point.
    """
    if not isinstance(data, torch.Tensor) or data.dim() != 2:
        shape = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
        raise InvalidArgumentError(f"table data must be a 2-D tensor [rows, head_dim], got {shape}")
    if scale is not None and not scale.is_floating_point():
        raise InvalidArgumentError(f"table scale must be a floating point tensor, got dtype {scale.dtype}")
    if format is None and data.dtype == torch.uint8 and scale is None:
        raise InvalidArgumentError(
            f"uint8 table data is one of the block formats {list(BLOCK_FORMATS)}: name it (format=)"
        )
    fmt = infer_format(data, scale) if format is None else format
    info = format_info(fmt)
    if info.blocked:
        info.head_dim_of(data.shape[1])
    if data.dtype != info.storage_dtype:
        raise InvalidArgumentError(f"format {fmt!r} stores {info.storage_dtype}, but the data is {data.dtype}")
    if info.scale_kind == "none" and scale is not None:
        raise InvalidArgumentError(f"format {fmt!r} has no scale, but a scale of shape {tuple(scale.shape)} was given")
    if info.scale_kind == "global" and (scale is None or scale.numel() != 1 or scale.dim() > 1):
        got = None if scale is None else tuple(scale.shape)
        raise InvalidArgumentError(f"format {fmt!r} needs one global scale of shape [1], got {got}")
    if info.scale_kind == "row" and (scale is None or tuple(scale.shape) != (data.shape[0], 1)):
        got = None if scale is None else tuple(scale.shape)
        raise InvalidArgumentError(f"format {fmt!r} needs a per-row scale of shape [{data.shape[0]}, 1], got {got}")
    return fmt


def check_scale_values(scale: torch.Tensor, what: str = "table scale", first_row: int = 0) -> None:
    """Refuse a scale tensor (``[1]`` global or ``[n, 1]`` per row) holding a value that is not a
    positive finite number once cast to float32 (the dtype tables store scales in: a float64 scale
    of 1e39 would become inf, one of 1e-50 zero), naming the first such value and its row
    (``first_row`` + its index).

    On an accelerator this reads one flag back to the host (a synchronization)."""
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        got = type(scale).__name__ if not isinstance(scale, torch.Tensor) else scale.dtype
        raise InvalidArgumentError(f"{what} must be a floating point tensor, got {got}")
    flat = scale.detach().reshape(-1)
    stored = flat.float()  # what a table keeps (no copy when already float32)
    bad = ~(torch.isfinite(stored) & (stored > 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        where = "" if flat.numel() == 1 and scale.dim() <= 1 else f" of row {first_row + i}"
        value, as_stored = float(flat[i]), float(stored[i])
        changed = flat.dtype != torch.float32 and value != as_stored and not math.isnan(value)
        shown = f"{value} ({as_stored} as float32)" if changed else str(value)
        raise InvalidArgumentError(f"{what}: the scale{where} is {shown}, not a positive finite number")


class IdOutOfRangeError(PLEError, IndexError):
    """A row id lies outside ``[0, rows)``; the message names the id and its (token, head)."""


def check_ids(ids: torch.Tensor, rows: int) -> None:
    """Check ``ids [T, G]`` int64 lie in ``[0, rows)``.

    Raises :class:`IdOutOfRangeError` naming the first bad id and its (token, head) position.
    On an accelerator this reads one flag back to the host (a synchronization).
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise InvalidArgumentError(f"row ids must be a 2-D tensor [T, G], got {shape}")
    if ids.dtype != torch.int64:
        raise InvalidArgumentError(f"row ids must be int64, got {ids.dtype}")
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= rows)
    if bool(bad.any()):
        t, g = (int(v) for v in bad.nonzero()[0])
        raise IdOutOfRangeError(
            f"row id {int(ids[t, g])} at (token {t}, head {g}) is out of range: the table has rows [0, {rows})"
        )


def table_device(device, what: str = "device") -> torch.device:
    """``device`` (a ``torch.device``, a name such as ``"cuda:1"``, or an index of a CUDA device) as a
    device tables can live on, here: the CPU or a CUDA device this process sees; anything else is an
    :class:`InvalidArgumentError` naming ``what`` and the value."""
    if isinstance(device, bool):
        raise InvalidArgumentError(f"{what} must be a torch device (cpu, cuda, cuda:1), got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgumentError(f"{what} must be a torch device (cpu, cuda, cuda:1), got {device!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InvalidArgumentError(f"{what} {dev} is not a device tables can live on (cpu or cuda)")
    if not torch.cuda.is_available():
        raise InvalidArgumentError(f"{what} {dev}: CUDA is not available in this process")
    if dev.index is not None and not 0 <= dev.index < torch.cuda.device_count():
        raise InvalidArgumentError(f"{what} {dev}: this process sees {torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_activation_dtype(dtype: torch.dtype) -> None:
    if dtype not in ACTIVATION_DTYPES:
        raise InvalidArgumentError(f"lookup dtype must be one of {list(ACTIVATION_DTYPES)}, got {dtype}")
