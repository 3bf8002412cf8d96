"""Table lookup: gather rows by id and dequantize.

``gather_dequant`` is the dispatcher; its twins share one signature:

- :func:`gather_dequant_reference` — literal advanced indexing + ``row.to(dtype) * scale.to(dtype)``;
- :func:`gather_dequant_torch` — one ``index_select`` + one dequantization pass (CPU);
- :func:`gather_dequant_triton` — one gather+dequantize kernel (CUDA).
"""

from __future__ import annotations

import torch

from ...errors import InvalidArgumentError
from ..formats import format_info
from .reference import gather_dequant_reference
from .torch_impl import dequantize_rows_into, gather_dequant_torch

__all__ = ["gather_dequant", "gather_dequant_reference", "gather_dequant_torch", "dequantize_rows_into"]


def gather_dequant(data, scale, ids, dtype, *, out=None, check=True, format=None) -> torch.Tensor:
    """``[T, G*D]`` rows ``data[ids]`` dequantized to ``dtype``, on the ids' device.

    Picks the implementation from the ids' device: CUDA -> Triton kernel (``data`` on that device
    or in pinned host memory), CPU -> torch fast path (``data`` on the CPU; block formats through
    the C kernel where it builds). Results are bit-exact with :func:`gather_dequant_reference`.
    ``format`` names the table's format (needed for block formats, whose ``data`` is bytes).
    """
    blocked = format is not None and format_info(format).blocked
    if ids.device.type == "cuda":
        if data.device != ids.device and not (data.device.type == "cpu" and data.is_pinned()):
            raise InvalidArgumentError(
                f"ids on {ids.device} need the table data on that device or in pinned host memory, "
                f"got data on {data.device}"
            )
        from .triton_impl import gather_dequant_triton

        return gather_dequant_triton(data, scale, ids, dtype, out=out, check=check, format=format)
    if data.device.type != "cpu":
        raise InvalidArgumentError(f"ids on {ids.device} need the table data on the CPU, got data on {data.device}")
    if blocked:
        from .native import gather_dequant_blocks_native, native_available

        if native_available():
            assert format is not None
            return gather_dequant_blocks_native(data, scale, ids, dtype, format=format, out=out, check=check)
    return gather_dequant_torch(data, scale, ids, dtype, out=out, check=check, format=format)
