"""N-gram semantics: which table rows each token reads, and the per-request context contract.

The computation is the operator ``torch.ops.ple.ngram_ids(input_ids, query_start_loc,
ngram_context, multipliers, head_sizes, head_offsets, heads_per_ngram, eos_token_id, vocab_size=-1)``
(the layout as its tensors, see :func:`layout_tensors`), registered once here
(:data:`ple.kernels.registry.OPERATORS`): its reference is :func:`.reference.ids_from_tensors` (the literal
definition), its kernels the C kernel of :mod:`.native` on the CPU where it builds (else the
vectorized :mod:`.torch_impl`) and :mod:`.triton_impl` on CUDA, and a fake implementation, so
compiled and exported programs hold it as one node. ``ngram_ids`` is the checked entry point: it
validates everything, then runs the operator's function for the ids' device. Every call checks shapes, dtypes and devices
(:func:`check_ids_operator`) and, given ``vocab_size``, the range of tokens in host memory, so an
eager and a compiled call refuse the same inputs; tokens on an accelerator are not read (no
synchronization) and a token outside the vocabulary is hashed like any other there.
"""

from __future__ import annotations

import numpy as np
import torch

from ple.errors import PLEError
from ple.kernels import native as _native
from ple.kernels.registry import Kernel, register
from ple.layout import Layout
from ple.ngram import native, reference, torch_impl
from ple.ngram.tensors import layout_tensors

__all__ = [
    "ngram_ids",
    "next_ngram_context",
    "fresh_context",
    "check_ngram_inputs",
    "check_token_range",
    "first_out_of_range",
    "check_ids_operator",
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
    if torch.compiler.is_compiling():
        return  # values are not read while tracing: the compiled call's operator checks the tokens' range
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
    pos = first_out_of_range(ids, layout.vocab_size)
    if pos is not None:
        req = int(torch.searchsorted(qsl[1:], torch.tensor(pos), right=True))
        raise NgramInputError(
            f"token id {int(ids[pos])} at position {pos} (request {req}, offset {pos - int(qsl[req])}) "
            f"is outside [0, vocab_size={layout.vocab_size})"
        )
    ctx = ngram_context.detach()
    at = first_out_of_range(ctx, layout.vocab_size)
    if at is not None:
        r, j = divmod(at, k)
        raise NgramInputError(
            f"ngram_context[{r}, {j}] = {int(ctx[r, j])} (request {r}) is outside [0, vocab_size={layout.vocab_size})"
        )
    devices = {input_ids.device, query_start_loc.device, ngram_context.device}
    if len(devices) > 1 and input_ids.device.type == "cuda":
        raise NgramInputError(f"input_ids, query_start_loc and ngram_context must share a device, got {devices}")


def check_token_range(input_ids: torch.Tensor, ngram_context: torch.Tensor, vocab_size: int) -> None:
    """Raise :class:`NgramInputError` for a token or context value outside ``[0, vocab_size)`` (one
    min/max pass each on the calling thread; on an accelerator that reads device data)."""
    pos = first_out_of_range(input_ids, vocab_size)
    if pos is not None:
        raise NgramInputError(
            f"token id {int(input_ids[pos])} at position {pos} is outside [0, vocab_size={vocab_size})"
        )
    at = first_out_of_range(ngram_context, vocab_size)
    if at is not None:
        r, j = divmod(at, ngram_context.shape[1])
        raise NgramInputError(
            f"ngram_context[{r}, {j}] = {int(ngram_context[r, j])} (request {r}) is outside [0, vocab_size={vocab_size})"
        )


def first_out_of_range(tokens: torch.Tensor | np.ndarray, vocab_size: int | None) -> int | None:
    """The flat index of the first value of ``tokens`` (any shape) outside ``[0, vocab_size)`` (with
    ``vocab_size`` None: the first negative one), or None when every value is in range. The one check
    of a token range in ple: a single min/max pass when all are in range (the usual case), a second
    one to find the culprit otherwise."""
    top = (1 << 63) - 1 if vocab_size is None else vocab_size
    if isinstance(tokens, np.ndarray):
        a = tokens.reshape(-1)
        if a.size <= 16:  # a few tokens: a list pass costs less than two numpy reductions
            flat = a.tolist()
            if not flat or (min(flat) >= 0 and max(flat) < top):
                return None
        elif int(a.min()) >= 0 and int(a.max()) < top:
            return None
        return int(np.flatnonzero((a < 0) | (a >= top))[0])
    if _in_range(tokens, top):
        return None
    t = tokens.detach().reshape(-1)
    return int(torch.nonzero((t < 0) | (t >= top))[0, 0])


def _in_range(t: torch.Tensor, vocab_size: int) -> bool:
    """Whether every value of ``t`` lies in ``[0, vocab_size)``: one min/max pass, nothing allocated
    on the way for a few values.

    On the CPU the pass runs on the calling thread: a torch reduction over a large tensor would wake
    torch's OpenMP workers, which then spin for a while on the cores the id kernel is about to use, so
    large tensors go through numpy (small ones through a list, or torch below its parallel grain)."""
    n = t.numel()
    if n == 0:
        return True
    t = t.detach()
    if t.device.type != "cpu":
        lo, hi = torch.aminmax(t)
    elif n <= 32:  # a decode step's few tokens: a Python list is the cheapest pass
        flat = t.reshape(-1).tolist()
        lo, hi = min(flat), max(flat)
    elif n < 32768:  # below torch's parallel grain: one thread, no OpenMP wake-up
        lo, hi = torch.aminmax(t)
    else:
        a = t.numpy()
        lo, hi = a.min(), a.max()
    return int(lo) >= 0 and int(hi) < vocab_size


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
            inputs were validated upstream. While ``torch.compile`` traces, only shapes, dtypes and
            the EOS id are checked there; the compiled program's operator call checks the tokens'
            range (on the CPU; tokens on an accelerator are not read), and the offsets are taken as
            given (:meth:`ple.PLELayer.forward_padded` builds them).
    """
    if check:
        check_ngram_inputs(input_ids, query_start_loc, ngram_context, layout, eos_token_id)
    if torch.compiler.is_compiling():  # the operator as one node; each call checks its tokens' range
        mult, sizes, offs = layout_tensors.__wrapped__(layout, input_ids.device)  # constants, not the cache
        vocab = layout.vocab_size if check else -1
        return torch.ops.ple.ngram_ids(
            input_ids, query_start_loc, ngram_context, mult, sizes, offs, layout.heads_per_ngram, eos_token_id, vocab
        )
    mult, sizes, offs = layout_tensors(layout, input_ids.device)
    run = _OPERATOR.on(input_ids.device)
    return run(input_ids, query_start_loc, ngram_context, mult, sizes, offs, layout.heads_per_ngram, eos_token_id)


def next_ngram_context(
    input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
) -> torch.Tensor:
    """``[R, N-1]`` int64: each request's context after this chunk (its last N-1 tokens, raw)."""
    return torch_impl.next_ngram_context(input_ids, query_start_loc, ngram_context)


# ---------------------------------------------------------------------------------------------- operator


def _ids_args_ok(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos, devices: bool) -> bool:
    """The fast pass of :func:`check_ids_operator` (a few attribute reads per tensor)."""
    if input_ids.dim() != 1 or query_start_loc.dim() != 1 or mult.dim() != 1 or type(hpn) is not int:
        return False
    n = mult.shape[0]
    if not 2 <= n <= 64 or hpn < 1 or eos < 0:
        return False
    heads = ((n - 1) * hpn,)
    if sizes.shape != heads or offs.shape != heads or ngram_context.shape != (query_start_loc.shape[0] - 1, n - 1):
        return False
    i64 = torch.int64
    if mult.dtype != i64 or sizes.dtype != i64 or offs.dtype != i64:
        return False
    if input_ids.dtype not in _INT_DTYPES or query_start_loc.dtype not in _INT_DTYPES:
        return False
    if ngram_context.dtype not in _INT_DTYPES:
        return False
    if devices:
        d = input_ids.device
        return all(t.device == d for t in (query_start_loc, ngram_context, mult, sizes, offs))
    return True


def check_ids_operator(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos, devices=True) -> None:
    """What ``torch.ops.ple.ngram_ids`` checks on every call, from shapes, dtypes and devices alone
    (nothing is read from device memory): raises :class:`NgramInputError` naming the argument.

    ``input_ids [T]``, ``query_start_loc [R+1]`` and ``ngram_context [R, N-1]`` int32/int64;
    ``multipliers [N]`` (``2 <= N <= 64``), ``head_sizes`` and ``head_offsets`` ``[(N-1)*heads_per_ngram]``
    int64; all on one device (``devices=False`` skips that: the dispatcher ran the CPU kernel, every
    tensor is on the CPU)."""
    if _ids_args_ok(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos, devices):
        return
    named = (
        ("input_ids", input_ids, 1),
        ("query_start_loc", query_start_loc, 1),
        ("ngram_context", ngram_context, 2),
        ("multipliers", mult, 1),
        ("head_sizes", sizes, 1),
        ("head_offsets", offs, 1),
    )
    device = input_ids.device
    for i, (name, t, dim) in enumerate(named):
        if t.dim() != dim:
            raise NgramInputError(f"ngram_ids: {name} must be {dim}-D, got shape {tuple(t.shape)}")
        if t.dtype not in (_INT_DTYPES if i < 3 else (torch.int64,)):
            want = "int32 or int64" if i < 3 else "int64 (see ple.ngram.layout_tensors)"
            raise NgramInputError(f"ngram_ids: {name} must be {want}, got {t.dtype}")
        if t.device != device:
            raise NgramInputError(f"ngram_ids: {name} is on {t.device}, input_ids on {device}; expected one device")
    n = mult.shape[0]
    if not 2 <= n <= 64:
        raise NgramInputError(f"ngram_ids: multipliers has {n} entries, expected ngram_size N in 2..64")
    if isinstance(hpn, bool) or not isinstance(hpn, int) or hpn < 1:
        raise NgramInputError(f"ngram_ids: heads_per_ngram={hpn!r}, expected a positive int")
    heads = (n - 1) * hpn
    for name, t in (("head_sizes", sizes), ("head_offsets", offs)):
        if t.shape[0] != heads:
            raise NgramInputError(
                f"ngram_ids: {name} has {t.shape[0]} entries, expected (N-1)*heads_per_ngram = {heads} "
                f"(N={n} from multipliers, heads_per_ngram={hpn})"
            )
    requests = query_start_loc.shape[0] - 1
    if requests < 0:
        raise NgramInputError("ngram_ids: query_start_loc is empty, expected [R+1] offsets starting at 0")
    if tuple(ngram_context.shape) != (requests, n - 1):
        raise NgramInputError(
            f"ngram_ids: ngram_context.shape={tuple(ngram_context.shape)}, expected [R, N-1] = ({requests}, {n - 1}) "
            f"(R from query_start_loc, N from multipliers)"
        )
    if eos < 0:
        raise NgramInputError(f"ngram_ids: eos_token_id={eos} is negative")
    raise NgramInputError(  # pragma: no cover - the checks above name every case of the fast pass
        f"ngram_ids: the arguments disagree (input_ids {tuple(input_ids.shape)}, multipliers {tuple(mult.shape)})"
    )


def _check_host_tokens(input_ids, ngram_context, vocab_size: int) -> None:
    """Token values against ``vocab_size`` (>= 0) when they are in host memory (no synchronization).

    On an accelerator the values are not read, eagerly or compiled: a token outside the vocabulary
    is hashed like any other (its rows are defined, not meaningful)."""
    if vocab_size >= 0 and input_ids.device.type == "cpu":
        check_token_range(input_ids, ngram_context, vocab_size)


def _check_ids(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos, vocab_size=-1, devices=True):
    check_ids_operator(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos, devices)
    _check_host_tokens(input_ids, ngram_context, vocab_size)


def _triton_ids(*args):
    from ple.ngram import triton_impl

    return triton_impl.ids_from_tensors(*args[:8])


def _ids_fake(input_ids, query_start_loc, ngram_context, mult, sizes, offs, hpn, eos, vocab_size=-1):
    # no checks while tracing: sizes may be symbolic (the real call checks them)
    return input_ids.new_empty((input_ids.shape[0], sizes.shape[0]), dtype=torch.int64)


_OPERATOR = register(
    "ngram_ids(Tensor input_ids, Tensor query_start_loc, Tensor ngram_context, Tensor multipliers, "
    "Tensor head_sizes, Tensor head_offsets, int heads_per_ngram, int eos_token_id, int vocab_size=-1) -> Tensor",
    reference=lambda *args: reference.ids_from_tensors(*args[:8]),
    kernels=(
        Kernel("native", "cpu", lambda *args: native.ids_from_tensors(*args[:8]), takes=lambda *a: _native.available()),
        Kernel("torch", "cpu", lambda *args: torch_impl.ids_from_tensors(*args[:8])),
        Kernel("triton", "cuda", _triton_ids, needs="triton"),
    ),
    fake=_ids_fake,
    check=_check_ids,
)
