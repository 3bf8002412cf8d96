"""Argument checks shared by the dilated conv implementations (written once, for every twin)."""

from __future__ import annotations

import dataclasses

import torch

from ple.errors import ArgumentTypeError, InvalidArgumentError
from ple.ops.records import ConvWeights, StepMeta

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    tokens: int  # T
    channels: int  # C
    taps: int  # K
    window: int  # W = (K - 1) * dilation
    state_len: int  # L
    num_slots: int  # S
    num_requests: int  # R


def _fail(msg: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"dilated_conv: {msg}")


def check_conv_args(
    c: torch.Tensor, conv: ConvWeights, step: StepMeta, residual: torch.Tensor | None, validate: bool
) -> ConvGeometry:
    """Check shapes, dtypes and devices always; check index values when ``validate`` (a host sync on CUDA).

    ``step`` in the engine layout (``conv_state [S, C, L]``; a ring pool is viewed so by the caller)."""
    weight, dilation = conv.weight, conv.dilation
    query_start_loc, conv_state, state_indices = step.query_start_loc, step.conv_state, step.state_indices
    has_initial_state, num_rejected = step.has_initial_state, step.num_rejected
    if step.state_offsets is not None:
        raise _fail("the step's pool is a ring ([S, L, C] with state_offsets); expected [S, C, L] (see conv_stage)")
    if c.dim() != 2:
        raise _fail(f"c.shape={tuple(c.shape)}, expected [T, C]")
    if c.dtype not in _ACT_DTYPES:
        raise ArgumentTypeError(f"dilated_conv: c.dtype={c.dtype}, expected one of float16, bfloat16, float32")
    tokens, channels = c.shape
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise _fail(f"weight.shape={tuple(weight.shape)}, expected [C, K] with C={channels} and K >= 1")
    if not weight.is_floating_point():
        raise ArgumentTypeError(f"dilated_conv: weight.dtype={weight.dtype}, expected a floating dtype")
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        raise _fail(f"dilation={dilation!r}, expected a positive int")
    taps = weight.shape[1]
    window = (taps - 1) * dilation
    if conv_state.dim() != 3 or conv_state.shape[1] != channels:
        raise _fail(f"conv_state.shape={tuple(conv_state.shape)}, expected [S, C, L] with C={channels}")
    if not conv_state.is_floating_point():
        raise ArgumentTypeError(f"dilated_conv: conv_state.dtype={conv_state.dtype}, expected a floating dtype")
    num_slots, _, state_len = conv_state.shape
    if state_len < window:
        raise _fail(f"conv_state.shape[-1]={state_len} is shorter than the window W=(K-1)*dilation={window}")
    if query_start_loc.dim() != 1 or query_start_loc.numel() < 1:
        raise _fail(f"query_start_loc.shape={tuple(query_start_loc.shape)}, expected [R+1]")
    if query_start_loc.dtype not in _INDEX_DTYPES:
        raise ArgumentTypeError(f"dilated_conv: query_start_loc.dtype={query_start_loc.dtype}, expected int32 or int64")
    num_requests = query_start_loc.numel() - 1
    if tuple(state_indices.shape) != (num_requests,) or state_indices.dtype not in _INDEX_DTYPES:
        raise _fail(
            f"state_indices has shape {tuple(state_indices.shape)} and dtype {state_indices.dtype}, "
            f"expected [R]=({num_requests},) int32/int64"
        )
    if tuple(has_initial_state.shape) != (num_requests,) or has_initial_state.dtype != torch.bool:
        raise _fail(
            f"has_initial_state has shape {tuple(has_initial_state.shape)} and dtype {has_initial_state.dtype}, "
            f"expected [R]=({num_requests},) bool"
        )
    if num_rejected is not None and (
        tuple(num_rejected.shape) != (num_requests,) or num_rejected.dtype not in _INDEX_DTYPES
    ):
        raise _fail(
            f"num_rejected has shape {tuple(num_rejected.shape)} and dtype {num_rejected.dtype}, "
            f"expected [R]=({num_requests},) int32/int64"
        )
    if residual is not None and (tuple(residual.shape) != (tokens, channels) or residual.dtype != c.dtype):
        raise _fail(
            f"residual has shape {tuple(residual.shape)} and dtype {residual.dtype}, "
            f"expected [T, C]=({tokens}, {channels}) {c.dtype} like c"
        )
    named = [
        ("weight", weight),
        ("query_start_loc", query_start_loc),
        ("conv_state", conv_state),
        ("state_indices", state_indices),
        ("has_initial_state", has_initial_state),
        ("num_rejected", num_rejected),
        ("residual", residual),
    ]
    for name, t in named:
        if t is not None and t.device != c.device:
            raise _fail(f"{name} is on {t.device}, c on {c.device}; expected one device")
    geometry = ConvGeometry(tokens, channels, taps, window, state_len, num_slots, num_requests)
    if validate:
        _check_values(geometry, query_start_loc, state_indices, has_initial_state, num_rejected)
    return geometry


def _check_values(
    g: ConvGeometry,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_rejected: torch.Tensor | None,
) -> None:
    qsl = query_start_loc.to("cpu", torch.int64)
    slots = state_indices.to("cpu", torch.int64)
    if qsl[0] != 0:
        raise _fail(f"query_start_loc[0]={int(qsl[0])}, expected 0")
    decreasing = torch.nonzero(qsl[1:] < qsl[:-1]).flatten()
    if decreasing.numel():
        r = int(decreasing[0])
        raise _fail(
            f"request {r}: query_start_loc[{r + 1}]={int(qsl[r + 1])} < query_start_loc[{r}]={int(qsl[r])}, "
            "expected non-decreasing offsets"
        )
    if qsl[-1] != g.tokens:
        raise _fail(f"query_start_loc[-1]={int(qsl[-1])}, expected T={g.tokens} (the number of rows of c)")
    out_of_range = torch.nonzero((slots < -1) | (slots >= g.num_slots)).flatten()
    if out_of_range.numel():
        r = int(out_of_range[0])
        raise _fail(
            f"request {r}: state_indices[{r}]={int(slots[r])}, expected -1 (null) or a slot in [0, {g.num_slots})"
        )
    active = torch.nonzero(slots >= 0).flatten()
    sorted_slots, order = torch.sort(slots[active], stable=True)
    repeated = torch.nonzero(sorted_slots[1:] == sorted_slots[:-1]).flatten()
    if repeated.numel():
        i = int(repeated[0])
        first, second = int(active[order[i]]), int(active[order[i + 1]])
        raise _fail(
            f"requests {first} and {second} both use state slot {int(sorted_slots[i])}; expected distinct slots"
        )
    if num_rejected is not None:
        limit = g.state_len - g.window
        nr = num_rejected.to("cpu", torch.int64)
        # Only rows that resume from their slot read num_rejected; others may carry anything.
        used = (slots >= 0) & has_initial_state.to("cpu")
        bad = torch.nonzero(used & ((nr < 0) | (nr > limit))).flatten()
        if bad.numel():
            r = int(bad[0])
            raise _fail(
                f"request {r}: num_rejected[{r}]={int(nr[r])}, expected 0 <= num_rejected <= L-W={limit} "
                f"(L={g.state_len}, W={g.window})"
            )
