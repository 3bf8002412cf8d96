"""N-gram semantics: which table rows each token reads, and the per-request context contract.

``ngram_ids`` is the checked entry point (validates everything, then dispatches on device:
CUDA -> Triton kernel, CPU -> the C kernel of :mod:`.native` when it can be built, otherwise the
vectorized torch path). ``reference`` holds the literal definition the fast paths are tested against.

The unchecked computation is also the operator ``torch.ops.ple.ngram_ids(input_ids,
query_start_loc, ngram_context, multipliers, head_sizes, head_offsets, heads_per_ngram,
eos_token_id)`` (the layout as its tensors, see :func:`layout_tensors`), with a fake implementation,
so compiled and exported programs hold it as one node.
"""

from __future__ import annotations

import torch

from .. import _native
from ..errors import PLEError
from ..layout import Layout
from . import native, reference, torch_impl
from .torch_impl import layout_tensors

__all__ = [
    "ngram_ids",
    "next_ngram_context",
    "fresh_context",
    "check_ngram_inputs",
    "check_token_range",
    "layout_tensors",
    "NgramInputError",
]

_INT_DTYPES = (torch.int32, torch.int64)


class NgramInputError(PLEError, ValueError):
    """Bad inputs to the n-gram id computation; the message says what and where."""


def fresh_context(num_requests: int, layout: Layout, eos_token_id: int, device=None) -> torch.Tensor:
    """``[R, N-1]`` int64 context of requests with no history (all EOS)."""
    return torch.full((num_requests, layout.ngram_size - 1), eos_token_id, dtype=torch.int64, device=device)


def check_ngram_inputs(
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    layout: Layout,
    eos_token_id: int,
) -> None:
    """Raise :class:`NgramInputError` naming the first problem (request, position, value)."""
    for name, t in (("input_ids", input_ids), ("query_start_loc", query_start_loc), ("ngram_context", ngram_context)):
        if not isinstance(t, torch.Tensor):
            raise NgramInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _INT_DTYPES:
            raise NgramInputError(f"{name} must be int32 or int64, got {t.dtype}")
    if input_ids.dim() != 1:
        raise NgramInputError(f"input_ids must be 1-D [T], got shape {tuple(input_ids.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise NgramInputError(f"query_start_loc must be 1-D [R+1], got shape {tuple(query_start_loc.shape)}")
    t_total = input_ids.shape[0]
    r_total = query_start_loc.numel() - 1
    k = layout.ngram_size - 1
    if tuple(ngram_context.shape) != (r_total, k):
        raise NgramInputError(
            f"ngram_context must have shape [R, N-1] = [{r_total}, {k}], got {tuple(ngram_context.shape)}"
        )
    if not 0 <= eos_token_id < layout.vocab_size:
        raise NgramInputError(f"eos_token_id={eos_token_id} is outside [0, vocab_size={layout.vocab_size})")
    qsl = query_start_loc.detach().to("cpu", torch.int64)
    if int(qsl[0]) != 0:
        raise NgramInputError(f"query_start_loc must start at 0, got {int(qsl[0])}")
    diffs = qsl[1:] - qsl[:-1]
    bad = torch.nonzero(diffs < 0)
    if bad.numel():
        r_bad = int(bad[0])
        raise NgramInputError(
            f"query_start_loc decreases at request {r_bad}: {int(qsl[r_bad])} -> {int(qsl[r_bad + 1])}"
        )
    if int(qsl[-1]) != t_total:
        raise NgramInputError(f"query_start_loc must end at T={t_total} (len(input_ids)), got {int(qsl[-1])}")
    ids = input_ids.detach()
    bad_tok = _out_of_range(ids, layout.vocab_size)
    if bad_tok.numel():
        pos = int(bad_tok[0])
        req = int(torch.searchsorted(qsl[1:], torch.tensor(pos), right=True))
        raise NgramInputError(
            f"token id {int(ids[pos])} at position {pos} (request {req}, offset {pos - int(qsl[req])}) "
            f"is outside [0, vocab_size={layout.vocab_size})"
        )
    ctx = ngram_context.detach()
    bad_ctx = _out_of_range(ctx, layout.vocab_size)
    if bad_ctx.numel():
        r, j = (int(v) for v in bad_ctx[0])
        raise NgramInputError(
            f"ngram_context[{r}, {j}] = {int(ctx[r, j])} (request {r}) is outside [0, vocab_size={layout.vocab_size})"
        )
    devices = {input_ids.device, query_start_loc.device, ngram_context.device}
    if len(devices) > 1 and input_ids.device.type == "cuda":
        raise NgramInputError(f"input_ids, query_start_loc and ngram_context must share a device, got {devices}")


def check_token_range(input_ids: torch.Tensor, ngram_context: torch.Tensor, vocab_size: int) -> None:
    """Raise :class:`NgramInputError` for a token or context value outside ``[0, vocab_size)`` (one
    min/max pass each on the calling thread; on an accelerator that reads device data)."""
    bad = _out_of_range(input_ids.detach(), vocab_size)
    if bad.numel():
        pos = int(bad[0])
        raise NgramInputError(
            f"token id {int(input_ids[pos])} at position {pos} is outside [0, vocab_size={vocab_size})"
        )
    bad = _out_of_range(ngram_context.detach(), vocab_size)
    if bad.numel():
        r, j = (int(v) for v in bad[0])
        raise NgramInputError(
            f"ngram_context[{r}, {j}] = {int(ngram_context[r, j])} (request {r}) is outside [0, vocab_size={vocab_size})"
        )


def _out_of_range(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Indices of values outside ``[0, vocab_size)`` (one min/max pass when there are none).

    On the CPU the pass runs in numpy, on the calling thread: a torch reduction would wake torch's
    OpenMP workers, which then spin for a while on the cores the id kernel is about to use."""
    if t.numel() == 0:
        return torch.zeros(0, t.dim(), dtype=torch.int64)
    if t.device.type == "cpu":
        a = t.numpy()
        lo, hi = a.min(), a.max()
    else:
        lo, hi = torch.aminmax(t)
    if int(lo) >= 0 and int(hi) < vocab_size:
        return torch.zeros(0, t.dim(), dtype=torch.int64)
    return torch.nonzero((t < 0) | (t >= vocab_size))


def ngram_ids(
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    layout: Layout,
    eos_token_id: int,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Row ids ``[T, G]`` int64 of a packed batch.

    Args:
        input_ids: ``[T]`` int32/int64 tokens, requests packed back to back.
        query_start_loc: ``[R+1]`` cumulative offsets, ``0 ... T``.
        ngram_context: ``[R, N-1]`` each request's last N-1 tokens before this chunk
            (:func:`fresh_context` for a new request).
        layout: the layer's :class:`~ple.layout.Layout` (``PLEConfig.layout(i)``).
        eos_token_id: the id that cuts n-gram history.
        check: validate inputs first (default). ``False`` skips the checks for hot loops whose
            inputs were validated upstream.
    """
    if check:
        check_ngram_inputs(input_ids, query_start_loc, ngram_context, layout, eos_token_id)
    if input_ids.is_cuda:
        from . import triton_impl

        return triton_impl.ngram_ids(input_ids, query_start_loc, ngram_context, layout, eos_token_id)
    if input_ids.device.type == "cpu" and _native.available():
        return native.ngram_ids(input_ids, query_start_loc, ngram_context, layout, eos_token_id)
    return torch_impl.ngram_ids(input_ids, query_start_loc, ngram_context, layout, eos_token_id)


def next_ngram_context(
    input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
) -> torch.Tensor:
    """``[R, N-1]`` int64: each request's context after this chunk (its last N-1 tokens, raw)."""
    return torch_impl.next_ngram_context(input_ids, query_start_loc, ngram_context)


_ = reference  # re-exported as ple.ngram.reference

# ---------------------------------------------------------------------------------------------- operator

_lib = torch.library.Library("ple", "FRAGMENT")
_lib.define(
    "ngram_ids(Tensor input_ids, Tensor query_start_loc, Tensor ngram_context, Tensor multipliers, "
    "Tensor head_sizes, Tensor head_offsets, int heads_per_ngram, int eos_token_id) -> Tensor"
)


def _ids_cpu(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos):
    if _native.available():
        return native.ids_from_tensors(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos)
    return torch_impl.ids_from_tensors(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos)


def _ids_cuda(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos):
    from . import triton_impl

    return triton_impl.ids_from_tensors(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos)


def _ids_fake(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos):
    return input_ids.new_empty((input_ids.shape[0], sizes.shape[0]), dtype=torch.int64)


_lib.impl("ngram_ids", _ids_cpu, "CPU")
_lib.impl("ngram_ids", _ids_cuda, "CUDA")
torch.library.register_fake("ple::ngram_ids", _ids_fake, lib=_lib)
