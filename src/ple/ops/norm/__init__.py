"""Grouped RMS norm: ``x * rsqrt(mean(x^2 over each group) + eps) * (1 + weight)``.

Twins with one signature ``grouped_rms_norm(x, weight, group_size, eps)``: :mod:`.reference` is the
literal specification, :mod:`.torch_impl` the CPU fast path, :mod:`.triton_impl` the CUDA kernel. They
are the kernels of the operator ``torch.ops.ple.grouped_rms_norm`` (:mod:`ple.ops.library`), which
:func:`ple.ops.grouped_rms_norm` calls.
"""

from __future__ import annotations

from ple.ops.norm import reference, torch_impl

__all__ = ["reference", "torch_impl"]
