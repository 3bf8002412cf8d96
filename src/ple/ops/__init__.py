"""The PLE layer's elementwise and short-conv operations, each with a reference, a PyTorch and a Triton twin.

- :func:`grouped_rms_norm`: grouped RMS norm (``ple.ops.norm``).
- :func:`ngram_gate`: key/query gate of the shared value and the conv input (``ple.ops.gate``).
- :func:`dilated_conv`: dilated causal depthwise conv over a packed batch with state slots (``ple.ops.conv``).
- :func:`gate_conv`: gate, conv, SiLU and residual in one call, what the layer runs (``ple.ops.fused``;
  on the CPU a fused C kernel, see ``ple._native``); :func:`gate_stage` and :func:`conv_stage` are
  its two halves (``conv_stage(*gate_stage(...))`` is ``gate_conv`` bit for bit).
- :class:`GateWeights`, :class:`ConvWeights`, :class:`StepMeta`: the records the fused step takes.

Each dispatcher runs Triton for CUDA tensors and the PyTorch fast path otherwise (the fused step:
the C kernel for bf16/fp32 CPU tensors). The fused step is also registered as ``torch.ops.ple``
operators (:mod:`ple.ops.library`) for ``torch.compile``, ``torch.export`` and CUDA graphs.
"""

from __future__ import annotations

from . import library  # noqa: F401  (registers the torch.ops.ple operators)
from .conv import dilated_conv
from .fused import conv_stage, gate_conv, gate_stage
from .gate import ngram_gate
from .norm import grouped_rms_norm
from .records import ConvWeights, GateWeights, StepMeta

__all__ = [
    "ConvWeights",
    "GateWeights",
    "StepMeta",
    "conv_stage",
    "dilated_conv",
    "gate_conv",
    "gate_stage",
    "grouped_rms_norm",
    "ngram_gate",
]
