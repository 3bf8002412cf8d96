"""The fused step through the Triton kernels (CUDA tensors) of the gate and the conv (two passes)."""

from __future__ import annotations

from ..conv import triton_impl as conv_impl
from ..gate import triton_impl as gate_impl
from ._compose import compose

__all__ = ["gate_conv"]


def gate_conv(*args, **kwargs):
    """Same contract as :func:`ple.ops.fused.reference.gate_conv`."""
    return compose(gate_impl.ngram_gate, conv_impl.dilated_conv, *args, **kwargs)
