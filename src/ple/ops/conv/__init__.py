"""Dilated causal depthwise conv over a packed batch of requests, with a pool of per-request state slots.

Twins with one signature ``dilated_conv(c, conv, step, residual=None, *, validate=True)`` (the records
:class:`ple.ops.ConvWeights` and :class:`ple.ops.StepMeta`), their arguments checked once
(:mod:`.checks`): :mod:`.reference` is the literal specification, including the state convention;
:mod:`.torch_impl` the CPU fast path; :mod:`.triton_impl` the CUDA kernels. They are the kernels of
the operator ``torch.ops.ple.dilated_conv`` (:mod:`ple.ops.library`), which :func:`ple.ops.dilated_conv` calls.
"""

from __future__ import annotations

from ple.ops.conv import reference, torch_impl

__all__ = ["reference", "torch_impl"]
