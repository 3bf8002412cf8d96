"""Literal reference of the table lookup: gather rows, then dequantize."""

from __future__ import annotations

import torch

from ple.table.formats.blocks import dequantize_blocks
from ple.table.formats.catalog import check_activation_dtype, check_ids, format_info

__all__ = ["gather_dequant_reference"]


def gather_dequant_reference(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    ids: torch.Tensor,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    check: bool = True,
    format: str | None = None,
) -> torch.Tensor:
    """``emb[t] = concat_g dequant(data[ids[t, g]])``.

    Args:
        data: ``[R, D]`` table in its storage dtype.
        scale: None (plain), ``[1]`` (global) or ``[R, 1]`` (per row).
        ids: ``[T, G]`` int64 row ids in ``[0, R)``.
        dtype: activation dtype of the result.
        out: optional ``[T, G*D]`` result tensor.
        check: check the ids' range (always done here; kept for the twin signature).
        format: the table's format; needed for block formats (``data [R, row_nbytes]`` uint8, rows
            decoded to float32 as :mod:`ple.table.formats.blocks` defines, then rounded once to ``dtype``).

    Returns:
        ``[T, G*D]`` in ``dtype``: ``row.to(dtype) * scale.to(dtype)``, or ``row.to(dtype)`` when plain.
    """
    check_activation_dtype(dtype)
    check_ids(ids, data.shape[0])
    T, G = ids.shape
    ids = ids.to(data.device)
    if format is not None and format_info(format).blocked:
        D = format_info(format).head_dim_of(data.shape[1])
        vals = dequantize_blocks(data[ids.reshape(-1)], format, scale)  # [T*G, D] float32
        emb = vals.to(dtype).reshape(T, G * D)
        if out is None:
            return emb
        out.copy_(emb)
        return out
    rows = data[ids]  # [T, G, D]
    if scale is None:
        emb = rows.to(dtype)
    elif scale.dim() == 2:
        emb = rows.to(dtype) * scale[ids].to(dtype)  # scale[ids]: [T, G, 1]
    else:
        emb = rows.to(dtype) * scale.reshape(1).to(dtype)
    emb = emb.reshape(T, G * data.shape[1])
    if out is None:
        return emb
    out.copy_(emb)
    return out
