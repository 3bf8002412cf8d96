"""The PLE layer's elementwise and short-conv operations, each with a reference, a PyTorch and a Triton twin.

- :func:`grouped_rms_norm`: grouped RMS norm (``ple.ops.norm``).
- :func:`ngram_gate`: key/query gate of the shared value and the conv input (``ple.ops.gate``).
- :func:`dilated_conv`: dilated causal depthwise conv over a packed batch with state slots (``ple.ops.conv``).

Each dispatcher runs Triton for CUDA tensors and the PyTorch fast path otherwise.
"""

from __future__ import annotations

from .conv import dilated_conv
from .gate import ngram_gate
from .norm import grouped_rms_norm

__all__ = ["dilated_conv", "grouped_rms_norm", "ngram_gate"]
