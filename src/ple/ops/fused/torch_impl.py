"""The fused step through the PyTorch fast paths of the gate and the conv (two passes)."""

from __future__ import annotations

from ..conv import torch_impl as conv_impl
from ..gate import torch_impl as gate_impl
from . import _compose

__all__ = ["conv_stage", "gate_conv", "gate_stage"]


def gate_conv(key, value, hidden, gate, conv, step, **kwargs):
    """Same contract as :func:`ple.ops.fused.reference.gate_conv`."""
    return _compose.compose(
        gate_impl.ngram_gate, conv_impl.dilated_conv, key, value, hidden, gate, conv, step, **kwargs
    )


def gate_stage(key, value, hidden, gate, **kwargs):
    """Same contract as :func:`ple.ops.fused.reference.gate_stage`."""
    return _compose.gate_stage(gate_impl.ngram_gate, key, value, hidden, gate, **kwargs)


def conv_stage(c, residual, conv, step, **kwargs):
    """Same contract as :func:`ple.ops.fused.reference.conv_stage`."""
    return _compose.conv_stage(conv_impl.dilated_conv, c, residual, conv, step, **kwargs)
