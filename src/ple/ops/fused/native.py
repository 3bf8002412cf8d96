"""The fused step on the CPU in one pass per token row: the C kernel of :mod:`ple._native`.

Gate, mask, conv taps (from the request's earlier rows or, before its chunk, straight from its state
slot), SiLU, residual and the state write-back run row by row with fp32 arithmetic, so each input
is read from memory once and the output written once (the PyTorch path makes about six passes).
Rounding points are those of the PyTorch fast path. Work is split into token ranges of requests
run by ``torch.get_num_threads()`` threads; results do not depend on the split.
"""

from __future__ import annotations

import torch

from ... import _native
from ...errors import InvalidArgumentError
from ..conv._checks import check_conv_args
from ..gate._checks import check_gate_args
from ._compose import check_token_mask

__all__ = ["gate_conv", "unsupported_reason"]

_DTYPES = {torch.bfloat16: 1, torch.float32: 0}
_MAX_TAPS = 64  # MAX_TAPS in ple_cpu.c


def unsupported_reason(key, value, hidden, conv_state, conv_weight) -> str | None:
    """Why these tensors cannot take the C kernel (None when they can)."""
    if conv_weight.dim() == 2 and conv_weight.shape[1] > _MAX_TAPS:
        return f"{conv_weight.shape[1]} conv taps (the kernel takes at most {_MAX_TAPS})"
    if value.device.type != "cpu":
        return f"tensors are on {value.device}, the kernel runs on the CPU"
    if value.dtype not in _DTYPES:
        return f"activation dtype {value.dtype} (the kernel computes bfloat16 and float32)"
    if conv_state.dtype != value.dtype:
        return f"state pool dtype {conv_state.dtype} differs from the activation dtype {value.dtype}"
    if not conv_state.is_contiguous():
        return "the state pool is not contiguous"
    for name, t in (("key", key), ("value", value), ("hidden", hidden)):
        if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            return f"{name} rows are not contiguous (stride {tuple(t.stride())})"
    return None


def gate_conv(
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor,
    norm_key_weight: torch.Tensor,
    norm_query_weight: torch.Tensor,
    norm_conv_weight: torch.Tensor,
    eps: float,
    hc_count: int,
    conv_weight: torch.Tensor,
    dilation: int,
    query_start_loc: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_rejected: torch.Tensor | None = None,
    *,
    token_mask: torch.Tensor | None = None,
    add_hidden: bool = True,
    return_conv_input: bool = False,
    validate: bool = True,
    threads: int | None = None,
):
    """Same contract as :func:`ple.ops.fused.reference.gate_conv`; ``threads`` defaults to torch's.

    ``validate=False`` skips the index checks: the offsets and history bounds are still checked in
    the kernel (memory safety), but two requests sharing a slot give undefined results.

    Raises :class:`ple._native.NativeUnavailable` when the kernel cannot be built, and ``ValueError``
    for tensors it does not take (see :func:`unsupported_reason`).
    """
    tokens, hidden_size = check_gate_args(
        key, value, hidden, norm_key_weight, norm_query_weight, norm_conv_weight, hc_count
    )
    channels = hc_count * hidden_size
    geo = check_conv_args(
        value.new_empty(1).expand(tokens, channels),
        conv_weight,
        dilation,
        query_start_loc,
        conv_state,
        state_indices,
        has_initial_state,
        num_rejected,
        None,
        validate,
    )
    reason = unsupported_reason(key, value, hidden, conv_state, conv_weight)
    if reason is not None:
        raise InvalidArgumentError(f"gate_conv (C kernel): {reason}")
    check_token_mask(token_mask, tokens)
    lib = _native.library()

    f32 = torch.float32
    wkq = ((1.0 + norm_key_weight.to(f32)) * (1.0 + norm_query_weight.to(f32))).contiguous()
    wc = (1.0 + norm_conv_weight.to(f32)).contiguous()
    conv_w = conv_weight.to(f32).t().contiguous()  # [K, C]
    starts = query_start_loc.to(torch.int64).contiguous()
    slots = state_indices.to(torch.int64).contiguous()
    resumes = has_initial_state & (slots >= 0)
    history_end = torch.full_like(slots, geo.state_len)
    if num_rejected is not None:
        history_end -= num_rejected.to(torch.int64) * resumes
    resumes_u8 = resumes.to(torch.uint8).contiguous()
    mask = None if token_mask is None else (token_mask != 0).to(torch.uint8).contiguous()

    out = torch.empty(tokens, channels, dtype=value.dtype)
    c = torch.empty(tokens, channels, dtype=value.dtype)
    nthreads = torch.get_num_threads() if threads is None else int(threads)
    unit_tokens = max(32, -(-tokens // (4 * max(1, nthreads))))

    def ptr(t):
        return None if t is None else t.data_ptr()

    rc = lib.ple_gate_conv(
        _DTYPES[value.dtype],
        tokens,
        hidden_size,
        hc_count,
        geo.taps,
        dilation,
        geo.state_len,
        geo.num_slots,
        geo.num_requests,
        float(eps),
        ptr(key),
        key.stride(0),
        ptr(value),
        value.stride(0),
        ptr(hidden),
        hidden.stride(0),
        ptr(wkq),
        ptr(wc),
        ptr(conv_w),
        ptr(starts),
        ptr(slots),
        ptr(resumes_u8),
        ptr(history_end),
        ptr(mask),
        ptr(conv_state),
        int(bool(add_hidden)),
        ptr(out),
        ptr(c),
        int(bool(return_conv_input)),
        unit_tokens,
        nthreads,
    )
    if rc != 0:
        if rc >= 1000:
            r = rc - 1000
            raise InvalidArgumentError(
                f"gate_conv: request {r} resumes from slot {int(slots[r])} with its history ending at column "
                f"{int(history_end[r])}, outside [W={geo.window}, L={geo.state_len}] (num_rejected too large)"
            )
        if rc == -2:
            raise MemoryError("gate_conv: the C kernel could not allocate its scratch buffers")
        raise InvalidArgumentError(f"gate_conv: the C kernel refused the arguments (code {rc}); run with validate=True")
    return (out, c) if return_conv_input else out
