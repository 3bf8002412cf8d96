"""The layer's whole post-projection step in one call: gate, mask, dilated conv, SiLU, residual.

``gate_conv`` dispatches on the device and dtype: CUDA tensors run the Triton gate and conv kernels;
bf16/fp32 CPU tensors with a contiguous state pool of the activation dtype run the fused C kernel
(:mod:`.native`, compiled on first use, see :mod:`ple._native`); everything else runs the PyTorch
fast paths of the gate and the conv. :mod:`.reference` composes the literal reference ops.
"""

from __future__ import annotations

import torch

from ... import _native
from . import native, reference, torch_impl

__all__ = ["gate_conv", "native", "reference", "torch_impl"]


def gate_conv(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key_weight: torch.Tensor,
    norm_query_weight: torch.Tensor,
    norm_conv_weight: torch.Tensor,
    eps: float,
    hc_count: int,
    conv_weight: torch.Tensor,
    dilation: int,
    query_start_loc: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_rejected: torch.Tensor | None = None,
    *,
    token_mask: torch.Tensor | None = None,
    add_hidden: bool = True,
    return_conv_input: bool = False,
    validate: bool = True,
):
    """``[hidden +] v + silu(conv(c))`` ``[T, HC*H]`` for a packed batch; updates ``conv_state`` in place.

    See :func:`ple.ops.fused.reference.gate_conv` for the arguments.
    """
    args = (
        key,
        value,
        hidden,
        norm_key_weight,
        norm_query_weight,
        norm_conv_weight,
        eps,
        hc_count,
        conv_weight,
        dilation,
        query_start_loc,
        conv_state,
        state_indices,
        has_initial_state,
        num_rejected,
    )
    kwargs = dict(token_mask=token_mask, add_hidden=add_hidden, return_conv_input=return_conv_input, validate=validate)
    if value.is_cuda:
        from . import triton_impl

        return triton_impl.gate_conv(*args, **kwargs)
    if native.unsupported_reason(key, value, hidden, conv_state, conv_weight) is None and _native.available():
        return native.gate_conv(*args, **kwargs)
    return torch_impl.gate_conv(*args, **kwargs)
