"""Literal reference of the table lookup: gather rows, then dequantize."""

from __future__ import annotations

import torch

from ..formats import check_activation_dtype, check_ids

__all__ = ["gather_dequant_reference"]


def gather_dequant_reference(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    ids: torch.Tensor,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """``emb[t] = concat_g dequant(data[ids[t, g]])``.

    Args:
        data: ``[R, D]`` table in its storage dtype.
        scale: None (plain), ``[1]`` (global) or ``[R, 1]`` (per row).
        ids: ``[T, G]`` int64 row ids in ``[0, R)``.
        dtype: activation dtype of the result.
        out: optional ``[T, G*D]`` result tensor.
        check: check the ids' range (always done here; kept for the twin signature).

    Returns:
        ``[T, G*D]`` in ``dtype``: ``row.to(dtype) * scale.to(dtype)``, or ``row.to(dtype)`` when plain.
    """
    check_activation_dtype(dtype)
    check_ids(ids, data.shape[0])
    T, G = ids.shape
    ids = ids.to(data.device)
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
