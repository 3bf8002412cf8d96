"""Literal reference of the grouped RMS norm (transformers' ``Qwen4ExpTextRMSNorm`` with ``group_size``)."""

from __future__ import annotations

import torch

from ple.ops.norm.checks import check_norm_args

__all__ = ["grouped_rms_norm"]


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """RMS-normalize every group of ``group_size`` consecutive channels, then scale by ``1 + weight``.

    Args:
        x: ``[T, C]`` activations (any leading dims are accepted: ``[..., C]``).
        weight: ``[C]`` norm weight, stored as an offset from one.
        group_size: channels per group; ``C`` must be a multiple of it (``H`` in the PLE layer).
        eps: added to the mean square before the reciprocal square root.

    Returns:
        ``[T, C]`` in ``x.dtype``: ``x * rsqrt(mean(x^2 over the group) + eps) * (1 + weight)``,
        computed in fp32 and rounded once.
    """
    check_norm_args(x, weight, group_size)
    x32 = x.float()
    grouped = x32.reshape(*x32.shape[:-1], x32.shape[-1] // group_size, group_size)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    normed = normed.flatten(-2)
    out = normed * (1.0 + weight.float())
    return out.type_as(x)
