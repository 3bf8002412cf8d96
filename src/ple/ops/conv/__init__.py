"""Dilated causal depthwise conv over a packed batch of requests, with a pool of per-request state slots.

``dilated_conv`` dispatches on the device of ``c``: CUDA tensors run the Triton kernels
(:mod:`.triton_impl`), everything else the PyTorch fast path (:mod:`.torch_impl`).
:mod:`.reference` is the literal specification, including the state convention.
"""

from __future__ import annotations

import types

import torch

from . import reference, torch_impl

__all__ = ["dilated_conv", "reference", "torch_impl"]


def dilated_conv(
    c: torch.Tensor,
    weight: torch.Tensor,
    dilation: int,
    query_start_loc: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_rejected: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """``residual + silu(conv)`` ``[T, C]`` over packed rows ``c [T, C]``; updates ``conv_state [S, C, L]``.

    See :func:`ple.ops.conv.reference.dilated_conv` for arguments and the state convention.
    """
    impl: types.ModuleType = torch_impl
    if c.is_cuda:
        from . import triton_impl

        impl = triton_impl
    return impl.dilated_conv(
        c,
        weight,
        dilation,
        query_start_loc,
        conv_state,
        state_indices,
        has_initial_state,
        num_rejected,
        residual,
        validate=validate,
    )
