"""Grouped RMS norm, CPU fast path: one fp32 pass for the mean square, one fused scale, one rounding."""

from __future__ import annotations

import torch

from ple.ops.norm.checks import check_norm_args

__all__ = ["grouped_rms_norm"]


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """Same contract as :func:`ple.ops.norm.reference.grouped_rms_norm`; ``[T, C] -> [T, C]`` in ``x.dtype``."""
    check_norm_args(x, weight, group_size)
    lead = x.shape[:-1]
    channels = x.shape[-1]
    x32 = x.reshape(-1, channels // group_size, group_size).float()
    # [N, G, 1] inverse RMS: the mean square reduces in fp32 like the reference.
    inv_rms = torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True).add_(eps))
    scale = (1.0 + weight.float()).view(channels // group_size, group_size)
    return (x32 * inv_rms).mul_(scale).to(x.dtype).view(*lead, channels)
