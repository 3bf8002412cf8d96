"""The layer's whole post-projection step: gate, mask, dilated conv, SiLU, residual.

``gate_conv`` runs it in one call; ``gate_stage`` and ``conv_stage`` run it in two (the gate on any
rows, the conv over a whole packed batch), and ``conv_stage(*gate_stage(...))`` equals ``gate_conv``
bit for bit on every path. Each dispatches on the device and dtype: CUDA tensors run the Triton gate
and conv kernels; bf16/fp32 CPU tensors with a contiguous state pool of the activation dtype run the
fused C kernel (:mod:`.native`, compiled on first use, see :mod:`ple._native`); everything else runs
the PyTorch fast paths of the gate and the conv. :mod:`.reference` composes the literal reference ops.
The weights and the step come as records (:class:`ple.ops.GateWeights`, :class:`ple.ops.ConvWeights`,
:class:`ple.ops.StepMeta`).
"""

from __future__ import annotations

import types

import torch

from ... import _native
from ..records import ConvWeights, GateWeights, StepMeta
from . import native, reference, torch_impl

__all__ = ["conv_stage", "gate_conv", "gate_stage", "native", "reference", "torch_impl"]


def _backend(ref: torch.Tensor, pool: torch.Tensor | None, taps: int, *rows: torch.Tensor) -> types.ModuleType:
    if ref.is_cuda:
        from . import triton_impl

        return triton_impl
    state = pool if pool is not None else ref.new_empty(1, 1, 1)
    if native.unsupported_reason(ref, state, taps, *rows) is None and _native.available():
        return native
    return torch_impl


def gate_conv(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    gate: GateWeights,
    conv: ConvWeights,
    step: StepMeta,
    *,
    token_mask: torch.Tensor | None = None,
    add_hidden: bool = True,
    return_conv_input: bool = False,
    validate: bool = True,
):
    """``[hidden +] v + silu(conv(c))`` ``[T, HC*H]`` for a packed batch; updates the state pool in place.

    See :func:`ple.ops.fused.reference.gate_conv` for the arguments.
    """
    impl = _backend(value, step.conv_state, conv.weight.shape[1], key, hidden)
    return impl.gate_conv(
        key,
        value,
        hidden,
        gate,
        conv,
        step,
        token_mask=token_mask,
        add_hidden=add_hidden,
        return_conv_input=return_conv_input,
        validate=validate,
    )


def gate_stage(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    gate: GateWeights,
    *,
    token_mask: torch.Tensor | None = None,
    add_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual, c)`` ``[T, HC*H]`` of any rows; see :func:`ple.ops.fused.reference.gate_stage`."""
    impl = _backend(value, None, 1, key, hidden)
    return impl.gate_stage(key, value, hidden, gate, token_mask=token_mask, add_hidden=add_hidden)


def conv_stage(
    c: torch.Tensor,
    residual: torch.Tensor,
    conv: ConvWeights,
    step: StepMeta,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """``residual + silu(conv(c))`` ``[T, HC*H]`` over a packed batch; see :func:`ple.ops.fused.reference.conv_stage`."""
    impl = _backend(c, step.conv_state, conv.weight.shape[1], residual)
    return impl.conv_stage(c, residual, conv, step, validate=validate)
