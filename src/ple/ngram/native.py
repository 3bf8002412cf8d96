"""N-gram ids on the CPU with the C kernel of :mod:`ple.kernels.native`: one pass over the tokens, threads
over token ranges, and the per-head modulo as a multiplication by a precomputed 128-bit reciprocal
(exact for every 64-bit hash) instead of a hardware division."""

from __future__ import annotations

import torch

from ple.errors import InvalidArgumentError
from ple.kernels import native as _native
from ple.ngram.tensors import with_layout

__all__ = ["ids_from_tensors", "ngram_ids"]


def ids_from_tensors(
    input_ids, query_start_loc, ngram_context, mult, sizes, offs, heads_per_ngram, eos_token_id, *, threads=None
) -> torch.Tensor:
    """The ids ``[T, G]`` int64 on the CPU (the contract of :func:`ple.ngram.reference.ngram_ids`, inputs
    already checked) with the layout given as its int64 CPU tensors (``mult``: the multipliers ``[N]``;
    ``sizes``, ``offs``: the head sizes and offsets ``[G]``). Raises :class:`ple.kernels.native.NativeUnavailable` when the kernel cannot
    be built."""
    if input_ids.device.type != "cpu":
        raise InvalidArgumentError(
            f"ngram_ids (C kernel): input_ids is on {input_ids.device}, the kernel runs on the CPU"
        )
    lib = _native.library()
    tokens, starts, context = _i64(input_ids), _i64(query_start_loc), _i64(ngram_context)
    mult, sizes, offs = _i64(mult), _i64(sizes), _i64(offs)
    order = mult.shape[0]
    out = torch.empty(tokens.shape[0], sizes.shape[0], dtype=torch.int64)
    nthreads = torch.get_num_threads() if threads is None else int(threads)
    rc = lib.ple_ngram_ids(
        tokens.data_ptr(),
        tokens.shape[0],
        starts.data_ptr(),
        starts.shape[0] - 1,
        context.data_ptr(),
        order,
        heads_per_ngram,
        mult.data_ptr(),
        sizes.data_ptr(),
        offs.data_ptr(),
        int(eos_token_id),
        out.data_ptr(),
        nthreads,
    )
    if rc == -3:
        raise InvalidArgumentError(
            f"ngram_ids (C kernel): query_start_loc is not 0 .. T={tokens.shape[0]} non-decreasing "
            "(the checked entry point ple.ngram.ngram_ids says where)"
        )
    if rc == -2:
        raise MemoryError("ngram_ids: the C kernel could not allocate its head table")
    if rc != 0:
        raise InvalidArgumentError(
            f"ngram_ids (C kernel): unsupported layout (ngram_size={order}, "
            f"heads_per_ngram={heads_per_ngram}; the kernel takes ngram_size 2..64)"
        )
    return out


def _i64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous int64 (itself when it is: the usual case, without two tensor calls)."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


ngram_ids = with_layout(ids_from_tensors)
