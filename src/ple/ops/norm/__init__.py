"""Grouped RMS norm: ``x * rsqrt(mean(x^2 over each group) + eps) * (1 + weight)``.

``grouped_rms_norm`` dispatches on the device of ``x``: CUDA tensors run the Triton kernel
(:mod:`.triton_impl`), everything else the PyTorch fast path (:mod:`.torch_impl`).
:mod:`.reference` is the literal specification both are tested against.
"""

from __future__ import annotations

import torch

from . import reference, torch_impl

__all__ = ["grouped_rms_norm", "reference", "torch_impl"]


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """Grouped RMS norm of ``x [T, C]`` with ``weight [C]`` over groups of ``group_size``; returns ``[T, C]``.

    Computed in fp32, rounded once to ``x.dtype``. See :func:`ple.ops.norm.reference.grouped_rms_norm`.
    """
    if x.is_cuda:
        from . import triton_impl

        return triton_impl.grouped_rms_norm(x, weight, group_size, eps)
    return torch_impl.grouped_rms_norm(x, weight, group_size, eps)
