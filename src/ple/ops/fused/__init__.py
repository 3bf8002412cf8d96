"""The layer's whole post-projection step: gate, mask, dilated conv, SiLU, residual.

``gate_conv`` runs it in one call; ``gate_stage`` and ``conv_stage`` run it in two (the gate on any
rows, the conv over a whole packed batch), and ``conv_stage(*gate_stage(...))`` equals ``gate_conv``
bit for bit on every kernel. Their kernels: :mod:`.reference` composes the literal reference ops (the
definition); :mod:`.composed` the PyTorch fast paths (CPU) or the Triton kernels (CUDA) of the gate
and the conv; :mod:`.native` is the fused C kernel (bf16/fp32 CPU tensors with a contiguous state
pool of the activation dtype, see :mod:`ple.kernels.native`). Which one runs is the ``torch.ops.ple``
operators' choice, registered once in :mod:`ple.ops.library`; :func:`ple.ops.gate_conv` and its
halves call them with the records (:class:`ple.ops.GateWeights`, :class:`ple.ops.ConvWeights`,
:class:`ple.ops.StepMeta`).
"""

from __future__ import annotations

from ple.ops.fused import composed, native, reference

__all__ = ["composed", "native", "reference"]
