"""The PLE layer's elementwise and short-conv operations, each with a reference, a PyTorch and a Triton twin.

- :func:`grouped_rms_norm`: grouped RMS norm (``ple.ops.norm``).
- :func:`ngram_gate`: key/query gate of the shared value and the conv input (``ple.ops.gate``).
- :func:`dilated_conv`: dilated causal depthwise conv over a packed batch with state slots (``ple.ops.conv``).
- :func:`gate_conv`: gate, conv, SiLU and residual in one call, what the layer runs (``ple.ops.fused``;
  on the CPU a fused C kernel, see ``ple._native``).

Each dispatcher runs Triton for CUDA tensors and the PyTorch fast path otherwise (``gate_conv``: the
fused C kernel for bf16/fp32 CPU tensors).
"""

from __future__ import annotations

from .conv import dilated_conv
from .fused import gate_conv
from .gate import ngram_gate
from .norm import grouped_rms_norm

__all__ = ["dilated_conv", "gate_conv", "grouped_rms_norm", "ngram_gate"]
