"""The PLE gate: per-stream key/query match gates the shared value; returns the gated value and the conv input.

Twins with one signature ``ngram_gate(key, value, hidden, gate)`` (the record
:class:`ple.ops.GateWeights`), their arguments checked once (:mod:`.checks`): :mod:`.reference`
mirrors transformers' operation order and rounding literally; :mod:`.torch_impl` is the CPU fast
path; :mod:`.triton_impl` the CUDA kernel. They are the kernels of the operator
``torch.ops.ple.ngram_gate`` (:mod:`ple.ops.library`), which :func:`ple.ops.ngram_gate` calls.
"""

from __future__ import annotations

from ple.ops.gate import reference, torch_impl

__all__ = ["reference", "torch_impl"]
