"""The PLE layer's elementwise and short-conv operations, each with a reference, a PyTorch and a Triton twin.

- :func:`grouped_rms_norm`: grouped RMS norm (``ple.ops.norm``).
- :func:`ngram_gate`: key/query gate of the shared value and the conv input (``ple.ops.gate``).
- :func:`dilated_conv`: dilated causal depthwise conv over a packed batch with state slots (``ple.ops.conv``).
- :func:`gate_conv`: gate, conv, SiLU and residual in one call, what the layer runs (``ple.ops.fused``;
  on the CPU a fused C kernel, see ``ple.kernels.native``); :func:`gate_stage` and :func:`conv_stage` are
  its two halves (``conv_stage(*gate_stage(...))`` is ``gate_conv`` bit for bit).
- :class:`GateWeights`, :class:`ConvWeights`, :class:`StepMeta`: the records the fused step takes.

Each is a ``torch.ops.ple`` operator (registered once, :mod:`ple.ops.library`; its kernels: Triton for
CUDA tensors, the PyTorch fast path or, for the fused step on bf16/fp32 CPU tensors, the C kernel
otherwise), usable in ``torch.compile``, ``torch.export`` and CUDA graphs; these functions call them
with the records.
"""

from __future__ import annotations

from ple.ops.library import conv_stage, dilated_conv, gate_conv, gate_stage, grouped_rms_norm, ngram_gate
from ple.ops.records import ConvWeights, GateWeights, StepMeta

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
