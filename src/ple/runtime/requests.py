"""What a :class:`~ple.runtime.session.Session` keeps per request and per step, and its prefix states.

:class:`Request` is a live request (its slot, a pending speculative chunk, its prefix states; its
length and flags live in the session's :class:`~ple.runtime.slots.SlotArrays`); :class:`SessionStep`
one packed step between ``begin`` and ``end``; :class:`PrefixState` a request's state after some
tokens, enough to resume it exactly. :class:`PrefixKeeping` is the part of the session that takes
prefix states: at every multiple of ``prefix_every``, at positions a caller names, and on demand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable
from operator import attrgetter, methodcaller
from typing import Any

import numpy as np
import torch

from ple.errors import InvalidArgumentError, PLEError
from ple.ngram import next_ngram_context
from ple.ops.state import ring_window
from ple.runtime.batch import Batch, is_int
from ple.runtime.slots import SlotArrays, SlotField
from ple.table.tiers.adapted import AdaptedTable
from ple.table.tiers.named import DEFAULT_ADAPTER, adapter_index

__all__ = [
    "PrefixKeeping",
    "PrefixState",
    "Request",
    "SessionError",
    "SessionStep",
    "adapter_of",
    "check_resumable",
    "packed_rows",
]


class SessionError(PLEError, ValueError):
    """A request id, chunk or acceptance the session cannot take; nothing was changed."""


@dataclasses.dataclass(frozen=True)
class PrefixState:
    """A request's state after ``length`` tokens: enough to resume it exactly.

    ``conv_window`` the last conv inputs (zeros before the start): ``[HC*H, (K-1)*N]`` for a session
    of one layer, ``[layers, HC*H, (K-1)*N]`` for several; ``ngram_context [N-1]`` int64 (the last N-1
    tokens, EOS-filled). ``adapter``: what the request read its table rows through (the conv window
    depends on them): None for the base table, ``(name, serial)`` for a named adapter and ``("", serial)``
    for the model's default adapter (``serial``: that loaded adapter's, unique in the process); a
    request resumed from the state must read through the same.
    """

    conv_window: torch.Tensor
    ngram_context: torch.Tensor
    length: int
    adapter: tuple[str, int] | None = None


@dataclasses.dataclass
class Pending:
    """A speculative chunk waiting for :meth:`Session.accept`."""

    tokens: torch.Tensor
    prev_context: torch.Tensor
    prev_length: int
    prev_window: torch.Tensor | None  # only kept when prefix states may fall inside the chunk
    conv_input: torch.Tensor | None  # [layers, n, C]


class Request:
    """A live request: its slot, a pending speculative chunk, prefix states; its length, whether its
    slot holds state and how many of its last columns were rejected live in the session's
    :class:`~ple.runtime.slots.SlotArrays` (read and written here as attributes)."""

    __slots__ = ("slot", "pending", "prefix_states", "wanted", "adapter", "adapter_key", "_arrays")

    def __init__(
        self, slot: int, arrays: SlotArrays, adapter: int = DEFAULT_ADAPTER, adapter_key: tuple[str, int] | None = None
    ):
        self.slot = slot
        self.adapter = adapter  # the named adapter's index, or DEFAULT_ADAPTER
        self.adapter_key = adapter_key  # what its prefix states record (PrefixState.adapter)
        self.pending: Pending | None = None
        self.prefix_states: dict[int, PrefixState] = {}
        self.wanted: set[int] = set()  # positions the caller named
        self._arrays = arrays
        arrays.length[slot] = 0
        arrays.has_state[slot] = False
        arrays.rejected[slot] = 0

    length = SlotField(int)
    has_state = SlotField(bool)
    rejected = SlotField(int)


@dataclasses.dataclass
class SessionStep:
    """One packed step between :meth:`Session.begin` and :meth:`Session.end`.

    Attributes:
        request_ids: the requests in packing order.
        lens: their token counts; ``query_start_loc`` / ``tokens`` / ``batch`` as the layers see them.
        num_tokens: T.
    """

    request_ids: list[Hashable]
    lens: list[int]
    tokens: torch.Tensor
    batch: Batch
    num_tokens: int
    speculative: frozenset
    prefix_rows: dict[Hashable, int]  # request -> index, for requests whose chunk holds wanted positions
    prev_windows: dict[Hashable, torch.Tensor]
    conv_inputs: list[torch.Tensor | None]
    done: list[bool]
    ended: bool = False
    lookups: list | None = None  # per layer, a prefetch handle started at begin() (lookahead)
    slots: np.ndarray | None = None  # the requests' slots, int64 [R]
    slot_tensor: torch.Tensor | None = None  # the same in a host tensor

    def split(self, packed: torch.Tensor) -> dict[Hashable, torch.Tensor]:
        """``{request: rows}`` views of a packed ``[T, ...]`` tensor."""
        return dict(zip(self.request_ids, packed.split(self.lens)))


def positive_int(name: str, v, minimum: int) -> int:
    if not is_int(v) or v < minimum:
        raise SessionError(f"{name} must be an int >= {minimum}, got {v!r}")
    return int(v)


class PrefixKeeping:
    """The session's prefix states (a mixin of :class:`~ple.runtime.session.Session`, whose attributes
    it reads: the layers, pools, slot arrays, ``prefix_every`` and the open step)."""

    # set by Session.__init__
    layers: Any
    prefix_every: int | None
    _channels: int
    _window: int
    _width: int
    _dtype: torch.dtype
    _pools: Any
    _ring: bool
    _offsets: Any
    _arrays: SlotArrays
    _open: SessionStep | None

    def _get(self, request_id: Hashable) -> Request:
        raise NotImplementedError

    def keep_prefix_at(self, request_id: Hashable, positions: Iterable[int]) -> None:
        """Also keep a :class:`PrefixState` when the request's kept history reaches each of ``positions``
        (token counts, e.g. an engine's block boundaries); the current length is taken at once.

        While the request is in an open step (between :meth:`begin` and :meth:`end`) only positions
        after its chunk are taken: the others are refused (its state is then half updated)."""
        req = self._get(request_id)
        if req.pending is not None:
            raise SessionError(f"request {request_id!r} has a speculative chunk awaiting accept()")
        if isinstance(positions, (str, bytes)) or not isinstance(positions, Iterable):
            raise SessionError(
                f"request {request_id!r}: positions must be a collection of ints (e.g. [{positions!r}]), "
                f"got {positions!r}"
            )
        wanted = list(positions)
        first = req.length
        open_end = self._open_chunk_end(request_id, req)
        for p in wanted:
            if not is_int(p) or p < first:
                raise SessionError(
                    f"request {request_id!r}: prefix position {p!r} must be an int >= its length {req.length}"
                )
            if open_end is not None and p <= open_end:
                raise SessionError(
                    f"request {request_id!r}: prefix position {p} is inside its chunk of the open step "
                    f"(positions {req.length}..{open_end}); name it before begin() or after end()"
                )
        for p in wanted:
            if p == req.length:
                if p > 0:
                    req.prefix_states[p] = self._state_now(req)
            else:
                req.wanted.add(int(p))

    # ------------------------------------------------------------------ state views
    def _window_of(self, req: Request) -> torch.Tensor:
        """The conv windows of the request's kept history, ``[layers, C, W]`` (a copy)."""
        if not req.has_state:
            return torch.zeros(len(self.layers), self._channels, self._window, dtype=self._dtype)
        end = self._width - req.rejected
        out = []
        for k, pool in enumerate(self._pools):
            if self._ring:
                out.append(ring_window(pool, self._offsets[k], req.slot, end - self._window, end))
            else:
                out.append(pool[req.slot, :, end - self._window : end].clone())
        return torch.stack(out).cpu()

    def _state(self, req: Request, windows: torch.Tensor, ctx: torch.Tensor, length: int) -> PrefixState:
        w = windows[0] if len(self.layers) == 1 else windows
        return PrefixState(w.contiguous(), ctx, length, req.adapter_key)

    def _state_now(self, req: Request) -> PrefixState:
        return self._state(req, self._window_of(req), self._arrays.contexts[req.slot].clone(), req.length)

    def _open_chunk_end(self, request_id: Hashable, req: Request) -> int | None:
        """The request's length after its chunk in the open step, or None when it is not in one."""
        step = self._open
        if step is None or step.ended:
            return None
        for rid, n in zip(step.request_ids, step.lens):
            if rid == request_id:
                return req.length + n
        return None

    def prefix_state(self, request_id: Hashable) -> PrefixState:
        """The request's current state (after its kept history). Refused for a request in the open
        step (between :meth:`begin` and :meth:`end`, its state is half updated)."""
        req = self._get(request_id)
        if req.pending is not None:
            raise SessionError(f"request {request_id!r} has a speculative chunk awaiting accept()")
        if self._open_chunk_end(request_id, req) is not None:
            raise SessionError(f"request {request_id!r} is in the open step: call end() before prefix_state()")
        return self._state_now(req)

    def prefix_states(self, request_id: Hashable) -> dict[int, PrefixState]:
        """``{position: PrefixState}`` at every multiple of ``prefix_every`` and every position named
        with :meth:`keep_prefix_at`, reached so far."""
        return dict(self._get(request_id).prefix_states)

    def _maybe_keep(self, req: Request, st: PrefixState) -> None:
        b = self.prefix_every
        if st.length > 0 and ((b and st.length % b == 0) or st.length in req.wanted):
            req.prefix_states[st.length] = st
            req.wanted.discard(st.length)

    def _positions_in(self, req: Request, start: int, n: int) -> list[int]:
        """Positions in ``(start, start + n]`` where the request keeps a prefix state."""
        b = self.prefix_every
        found: set[int] = set()
        if b:
            found.update(range((start // b + 1) * b, start + n + 1, b))
        found.update(p for p in req.wanted if start < p <= start + n)
        return sorted(found)

    def _states_inside(
        self,
        req: Request,
        start: int,
        n: int,
        prev_window: torch.Tensor,
        prev_ctx: torch.Tensor,
        tokens: torch.Tensor,
        c: torch.Tensor,
    ) -> None:
        """Keep prefix states at wanted positions in ``(start, start + n]``; ``c [layers, n, C]``."""
        for pos in self._positions_in(req, start, n):
            k = pos - start
            hist = torch.cat([prev_window, c[:, :k].transpose(1, 2).to(prev_window.dtype)], dim=2)
            window = hist[:, :, hist.shape[2] - self._window :].clone()
            ctx = next_ngram_context(tokens[:k], torch.tensor([0, k]), prev_ctx.view(1, -1))[0]
            req.prefix_states[pos] = self._state(req, window, ctx, pos)
            req.wanted.discard(pos)


# ---------------------------------------------------------------------------------------------- adapters
def adapter_of(layers, name: str | None) -> tuple[int, tuple[str, int] | None]:
    """``(index, key)`` of the adapter ``name`` (None: the default) a request of ``layers`` reads: its
    index in batches (-1 for the default) and what its prefix states record (:attr:`PrefixState.adapter`)."""
    refs = [layer.table_ref for layer in layers]
    if name is None:
        table = refs[0].table  # an adapted table: the model's default adapter
        return DEFAULT_ADAPTER, ("", table.overlay.serial) if isinstance(table, AdaptedTable) else None
    try:
        index = adapter_index(refs, name)
    except InvalidArgumentError as e:
        raise SessionError(str(e)) from None
    return index, (name, refs[0].adapters.get(index).overlay.serial)


def _describe(key: tuple[str, int] | None) -> str:
    if key is None:
        return "the base table"
    return "the model's default adapter" if key[0] == "" else f"adapter {key[0]!r}"


def check_resumable(request_id: Hashable, state: PrefixState, key: tuple[str, int] | None) -> None:
    """Refuse to resume ``state`` in a request that reads through ``key`` when it was taken through another."""
    if state.adapter != key:
        raise SessionError(
            f"request {request_id!r}: the prefix state was taken reading {_describe(state.adapter)}, this request "
            f"reads {_describe(key)} (an adapter loaded again is another): its conv state depends on the rows read"
        )


# ---------------------------------------------------------------------------------------------- packing
_dtype_of = attrgetter("dtype")
_base_of, _data_ptr = attrgetter("_base"), methodcaller("data_ptr")
_is_contiguous = methodcaller("is_contiguous")


def packed_rows(hs: list[torch.Tensor], total: int, width: int) -> torch.Tensor:
    """``torch.cat(hs)`` ``[total, width]``; when the rows already lie one after another in one tensor
    (views an engine cut from its packed hidden, in order), a view of them instead of a copy."""
    if len(hs) == 1:
        return hs[0]
    base = hs[0]._base
    # identities, not the tensors: a set of tensors would hash each one through a Python method
    if base is not None and set(map(id, map(_base_of, hs))) == {id(base)} and set(map(_dtype_of, hs)) == {base.dtype}:
        if set(map(_is_contiguous, hs)) == {True}:
            ptrs = list(map(_data_ptr, hs))
            row = width * hs[0].element_size()
            first = ptrs[0]
            if total == len(hs):  # one row each: consecutive rows
                at = list(range(first, first + row * total, row))
            else:
                at = [first + row * k for k in _starts(hs)]
            if ptrs == at:
                return torch.as_strided(base, (total, width), (width, 1), hs[0].storage_offset())
    return torch.cat(hs)


def _starts(hs: list[torch.Tensor]) -> list[int]:
    """Each tensor's first row in the packed order."""
    out, total = [], 0
    for h in hs:
        out.append(total)
        total += h.shape[0]
    return out
