"""The session's per-slot arrays: each live request's n-gram context, length, whether its slot holds
state, and how many of its last columns were rejected, one array each, indexed by slot.

A step reads and advances them for all its requests at once, without a Python object per request;
a step of decode tokens does both in one C call each where the kernels are built
(:meth:`SlotArrays.read_decode`, :meth:`SlotArrays.advance_decode`), with numpy otherwise (the same
values: tested both ways).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ple.kernels import native as _native

__all__ = ["SlotArrays", "SlotField"]


class SlotArrays:
    """Per-slot state of the live requests.

    Attributes:
        contexts: ``[slots, N-1]`` int64 tensor, each slot's last ``N-1`` tokens (EOS-padded).
        length: ``[slots]`` int64, tokens seen.
        has_state: ``[slots]`` bool, whether the slot's conv state holds history.
        rejected: ``[slots]`` int64, trailing state columns a speculative chunk left rejected.
    """

    __slots__ = ("contexts", "length", "has_state", "rejected", "_eos", "_lib", "_ptrs")

    def __init__(self, slots: int, ctx_len: int, eos: int, native: bool = True):
        self._eos = eos
        self.contexts = torch.full((slots, ctx_len), eos, dtype=torch.int64)
        self.length = np.zeros(slots, dtype=np.int64)
        self.has_state = np.zeros(slots, dtype=np.bool_)
        self.rejected = np.zeros(slots, dtype=np.int64)
        self._lib = _native.library() if native and _native.available() else None
        self._ptrs: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._point()

    def _point(self) -> None:
        self._ptrs = (
            self.contexts.data_ptr(),
            self.length.ctypes.data,
            self.has_state.ctypes.data,
            self.rejected.ctypes.data,
        )

    @property
    def native(self) -> bool:
        """Whether the decode reads and advances run in C."""
        return self._lib is not None

    def grow(self, extra: int) -> None:
        """``extra`` more slots (fresh: EOS contexts, zero counters); the existing ones keep their values."""
        fill = torch.full((extra, self.contexts.shape[1]), self._eos, dtype=torch.int64)
        self.contexts = torch.cat([self.contexts, fill])
        self.length = np.concatenate([self.length, np.zeros(extra, dtype=np.int64)])
        self.has_state = np.concatenate([self.has_state, np.zeros(extra, dtype=np.bool_)])
        self.rejected = np.concatenate([self.rejected, np.zeros(extra, dtype=np.int64)])
        self._point()

    def read_decode(
        self, tokens: torch.Tensor, slots: torch.Tensor, vocab_size: int
    ) -> tuple[int | None, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """What a step of one token per request reads, in one pass.

        Args:
            tokens: ``[n]`` contiguous int64 host tensor, request ``i``'s token.
            slots: ``[n]`` contiguous int64 host tensor of distinct live slots.
            vocab_size: the tokens' range ``[0, vocab_size)``.

        Returns:
            ``(bad, contexts [n, N-1], has_state [n] bool, rejected [n] int64, all_have_state)``;
            ``bad`` is the index of the first token outside the range, else None.
        """
        if self._lib is not None:
            n = slots.shape[0]
            ctx_len = self.contexts.shape[1]
            ctx = torch.empty((n, ctx_len), dtype=torch.int64)
            has = torch.empty(n, dtype=torch.bool)
            rej = torch.empty(n, dtype=torch.int64)
            all_has = ctypes.c_int32(0)
            p_ctx, _, p_has, p_rej = self._ptrs
            bad = self._lib.ple_slots_read(
                tokens.data_ptr(), slots.data_ptr(), n, vocab_size, p_ctx, ctx_len, p_has, p_rej,
                ctx.data_ptr(), has.data_ptr(), rej.data_ptr(), ctypes.byref(all_has),
            )  # fmt: skip
            return (None if bad < 0 else int(bad)), ctx, has, rej, bool(all_has.value)
        a = tokens.numpy()
        bad_at = np.flatnonzero((a < 0) | (a >= vocab_size))
        at = slots.numpy()
        h = self.has_state[at]
        ctx, rej = self.contexts.index_select(0, slots), torch.from_numpy(self.rejected[at])
        return (int(bad_at[0]) if bad_at.size else None), ctx, torch.from_numpy(h), rej, bool(h.all())

    def advance_decode(self, tokens: torch.Tensor, slots: torch.Tensor) -> None:
        """After a step of one token per request (``tokens [n]`` contiguous int64 host tensor,
        ``slots [n]`` as :meth:`read_decode` took them): each context shifts in its token, each slot
        holds state, none rejected, each length grows by one."""
        n = slots.shape[0]
        if self._lib is not None:
            p_ctx, p_len, p_has, p_rej = self._ptrs
            self._lib.ple_slots_advance(
                tokens.data_ptr(), slots.data_ptr(), n, p_ctx, self.contexts.shape[1], p_has, p_rej, p_len
            )
            return
        at = slots.numpy()
        ctx = self.contexts.numpy()
        if ctx.shape[1]:
            ctx[at, :-1] = ctx[at, 1:]
            ctx[at, -1] = tokens.numpy()
        self.has_state[at] = True
        self.rejected[at] = 0
        self.length[at] += 1


class SlotField:
    """A request's counter kept in :class:`SlotArrays` under the same name, read as ``cast``; the
    owner keeps its slot in ``slot`` and the arrays in ``_arrays``."""

    def __init__(self, cast: Callable[[Any], Any]):
        self.cast = cast
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, req: Any, owner: type | None = None) -> Any:
        if req is None:
            return self
        return self.cast(getattr(req._arrays, self.name)[req.slot])

    def __set__(self, req: Any, value: Any) -> None:
        getattr(req._arrays, self.name)[req.slot] = value
