"""The PLE gate: per-stream key/query match gates the shared value; returns the gated value and the conv input.

``ngram_gate`` dispatches on the device of ``value``: CUDA tensors run the Triton kernel
(:mod:`.triton_impl`), everything else the PyTorch fast path (:mod:`.torch_impl`).
:mod:`.reference` mirrors transformers' operation order and rounding literally.
"""

from __future__ import annotations

import types

import torch

from . import reference, torch_impl

__all__ = ["ngram_gate", "reference", "torch_impl"]


def ngram_gate(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key_weight: torch.Tensor,
    norm_query_weight: torch.Tensor,
    norm_conv_weight: torch.Tensor,
    eps: float,
    hc_count: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated value ``v`` and conv input ``c = norm_conv(v)``, both ``[T, HC*H]``, from ``key [T, HC*H]``,
    ``value [T, H]`` and the layer input ``hidden [T, HC*H]``.

    See :func:`ple.ops.gate.reference.ngram_gate` for the exact definition.
    """
    impl: types.ModuleType = torch_impl
    if value.is_cuda:
        from . import triton_impl

        impl = triton_impl
    return impl.ngram_gate(key, value, hidden, norm_key_weight, norm_query_weight, norm_conv_weight, eps, hc_count)
