"""The layout as the n-gram kernels read it: int64 tensors (cached per device), and the layout form of a kernel."""

from __future__ import annotations

import functools

import torch

from ple.layout import Layout

__all__ = ["layout_tensors", "with_layout"]


@functools.lru_cache(maxsize=32)
def layout_tensors(layout: Layout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``multipliers [N]``, ``head_sizes [G]``, ``head_offsets [G]`` as int64 tensors on ``device`` (cached)."""
    mult = torch.tensor(layout.multipliers, dtype=torch.int64, device=device)
    sizes = torch.tensor(layout.head_sizes, dtype=torch.int64, device=device)
    offs = torch.tensor(layout.head_offsets, dtype=torch.int64, device=device)
    return mult, sizes, offs


def with_layout(ids_from_tensors):
    """``ngram_ids(input_ids, query_start_loc, ngram_context, layout, eos_token_id, **options)`` of a
    kernel ``ids_from_tensors(input_ids, query_start_loc, ngram_context, multipliers, head_sizes,
    head_offsets, heads_per_ngram, eos_token_id, **options)``: the contract of
    :func:`ple.ngram.reference.ngram_ids` (inputs already checked), ``[T, G]`` int64."""

    def ngram_ids(input_ids, query_start_loc, ngram_context, layout: Layout, eos_token_id: int, **options):
        mult, sizes, offs = layout_tensors(layout, input_ids.device)
        hpn = layout.heads_per_ngram
        return ids_from_tensors(
            input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos_token_id, **options
        )

    ngram_ids.__doc__ = f"{ids_from_tensors.__module__}.ngram_ids: {with_layout.__doc__}"
    return ngram_ids
