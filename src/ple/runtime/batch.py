"""``Batch``: the packed metadata of one engine step, built and validated in one place."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

import torch
import torch.utils._pytree as pytree

from ple.errors import PLEError
from ple.ngram import first_out_of_range
from ple.ops.records import StepMeta

__all__ = ["Batch", "BatchError", "PREFILL", "DECODE", "VERIFY"]

PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"
_KINDS = (PREFILL, DECODE, VERIFY)
_INT_DTYPES = (torch.int32, torch.int64)


class BatchError(PLEError, ValueError):
    """Inconsistent step metadata; the message names the request and the value."""


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool (what counts, offsets and slots must be)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclasses.dataclass
class Batch:
    """One step of a serving engine for one PLE layer: R requests packed into T tokens.

    Attributes:
        query_start_loc: ``[R+1]`` int64 token offsets (``0 ... T``).
        slot_indices: ``[R]`` int64 state slot per request; ``-1`` is a null row (skipped: no conv,
            no state read or write; its output is ``hidden + v``).
        kinds: per request ``"prefill"`` (any length, first chunk or continuation), ``"decode"``
            (one token) or ``"verify"`` (speculative verification, ``1 .. 1+num_spec`` tokens).
            Host-side only: compiled code never reads it.
        has_initial_state: ``[R]`` bool; False = the request's history starts with this chunk.
        ngram_context: ``[R, N-1]`` int64, each request's last N-1 tokens before this chunk.
        num_rejected: ``[R]`` int64, tokens of the request's previous (verify) step that were not
            accepted: ``previous verify length - accepted count``; 0 otherwise.
        conv_state: the state pool this step reads and writes: ``[slots, HC*H, (K-1)*N + num_spec]``
            (the engine layout), or ``[slots, (K-1)*N + num_spec, HC*H]`` with ``state_offsets``
            (the ring layout of :mod:`ple.ops.state`).
        num_spec: speculative tokens per verify row (the pool's extra columns).
        state_offsets: ``[slots]`` int64 ring offsets (updated in place), or None (engine layout).
        token_count: T as a host integer (set by :meth:`build`; None when unknown). Host-side only.
        adapter_indices: ``[R]`` int64, the named adapter each request reads (its index, see
            :mod:`ple.table.tiers.named`; ``-1``: the layer's table as it is, with its default adapter
            if any), or None: every request reads the default.

    A batch made by :meth:`build` is validated; the layer's engine call then checks only shapes
    and dtypes. Made directly from tensors, a batch is trusted as it is.
    """

    query_start_loc: torch.Tensor
    slot_indices: torch.Tensor
    kinds: tuple[str, ...]
    has_initial_state: torch.Tensor
    ngram_context: torch.Tensor
    num_rejected: torch.Tensor
    conv_state: torch.Tensor
    num_spec: int = 0
    state_offsets: torch.Tensor | None = None
    token_count: int | None = None
    adapter_indices: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return len(self.kinds) if self.kinds else int(self.query_start_loc.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        """T (a host integer; read from the offsets, a device synchronization, when not known)."""
        return self.token_count if self.token_count is not None else int(self.query_start_loc[-1])

    def step_meta(self) -> StepMeta:
        """The record the fused step takes (:class:`ple.ops.StepMeta`), no copies."""
        return StepMeta(
            self.query_start_loc,
            self.conv_state,
            self.slot_indices,
            self.has_initial_state,
            self.num_rejected,
            self.state_offsets,
        )

    def check_for(self, hidden: torch.Tensor, channels: int, context: int) -> None:
        """Shapes, dtypes and devices against a step's ``hidden [T, channels]`` (no device values read)."""
        r = self.query_start_loc.shape[0] - 1
        tokens = hidden.shape[0]
        if self.token_count is not None and self.token_count != tokens:
            raise BatchError(f"batch covers {self.token_count} tokens, hidden has {tokens}")
        for name, t, shape in (
            ("slot_indices", self.slot_indices, (r,)),
            ("has_initial_state", self.has_initial_state, (r,)),
            ("num_rejected", self.num_rejected, (r,)),
            ("ngram_context", self.ngram_context, (r, context)),
        ):
            if tuple(t.shape) != shape:
                raise BatchError(f"{name} has shape {tuple(t.shape)}, expected {shape} for R={r} requests")
        for name, t in (
            ("query_start_loc", self.query_start_loc),
            ("slot_indices", self.slot_indices),
            ("num_rejected", self.num_rejected),
            ("ngram_context", self.ngram_context),
        ):
            if t.dtype not in _INT_DTYPES:
                raise BatchError(f"{name} must be int32/int64, got {t.dtype}")
        ai = self.adapter_indices
        if ai is not None and (tuple(ai.shape) != (r,) or ai.dtype != torch.int64):
            raise BatchError(f"adapter_indices must be int64 [R={r}], got {ai.dtype} {tuple(ai.shape)}")
        if self.has_initial_state.dtype != torch.bool:
            raise BatchError(f"has_initial_state must be bool, got {self.has_initial_state.dtype}")
        pool = self.conv_state
        c_dim = -1 if pool.dim() != 3 else pool.shape[1] if self.state_offsets is None else pool.shape[2]
        if c_dim != channels:
            raise BatchError(f"conv_state has shape {tuple(pool.shape)}, expected {channels} channels")
        for name, t in (("conv_state", pool), ("query_start_loc", self.query_start_loc)):
            if t.device != hidden.device:
                raise BatchError(f"{name} is on {t.device}, hidden on {hidden.device}")

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        slot_indices: Sequence[int],
        ngram_context: torch.Tensor,
        conv_state: torch.Tensor,
        *,
        kinds: Sequence[str] | None = None,
        has_initial_state: Sequence[bool] | None = None,
        num_accepted: Sequence[int | None] | None = None,
        prev_query_lens: Sequence[int | None] | None = None,
        num_rejected: Sequence[int] | None = None,
        num_spec: int = 0,
        conv_window: int | None = None,
        device: torch.device | str | None = None,
        state_offsets: torch.Tensor | None = None,
        vocab_size: int | None = None,
        adapter_indices: Sequence[int] | None = None,
    ) -> Batch:
        """Build and validate a batch.

        ``num_accepted[r]`` (with ``prev_query_lens[r]``, the length of that request's previous
        verify step) says how many tokens of the previous step were accepted; ``None`` entries mean
        the previous step was not speculative. ``num_rejected`` may be given directly instead.
        ``conv_window`` = (K-1)*N lets the builder check the pool width; ``vocab_size`` the context
        values. Counts, slots and lengths must be integers (not bools), flags bools, contexts an
        integer tensor: nothing is converted silently. ``adapter_indices``: per request the index of
        the named adapter it reads, -1 for the default (see :attr:`adapter_indices`).
        """
        if not isinstance(num_spec, numbers.Integral) or isinstance(num_spec, bool) or num_spec < 0:
            raise BatchError(f"num_spec must be a non-negative int, got {num_spec!r}")
        r = len(query_lens)
        device = conv_state.device if device is None else torch.device(device)
        kinds = tuple(kinds) if kinds is not None else tuple(DECODE if n == 1 else PREFILL for n in query_lens)
        if len(kinds) != r or len(slot_indices) != r:
            raise BatchError(f"{r} query lengths but {len(slot_indices)} slot indices and {len(kinds)} kinds")
        if not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3:
            raise BatchError(f"conv_state must be [slots, channels, window], got shape {tuple(conv_state.shape)}")
        slots_total = conv_state.shape[0]
        width = conv_state.shape[2] if state_offsets is None else conv_state.shape[1]
        if conv_window is not None and width != conv_window + num_spec:
            raise BatchError(
                f"conv_state window is {width} columns, expected (K-1)*N + num_spec = {conv_window} + {num_spec}"
            )
        if state_offsets is not None and (
            state_offsets.dtype != torch.int64 or tuple(state_offsets.shape) != (slots_total,)
        ):
            raise BatchError(f"state_offsets must be int64 [slots]=({slots_total},), got {tuple(state_offsets.shape)}")
        seen: dict[int, int] = {}
        for i, (n, s, k) in enumerate(zip(query_lens, slot_indices, kinds)):
            if k not in _KINDS:
                raise BatchError(f"request {i}: kind {k!r} is not one of {_KINDS}")
            if not is_int(n) or n < 0:
                raise BatchError(f"request {i}: query length {n!r} must be a non-negative int")
            if k == DECODE and n != 1:
                raise BatchError(f"request {i}: a decode row has exactly 1 token, got {n}")
            if k == VERIFY and not 1 <= n <= 1 + num_spec:
                raise BatchError(f"request {i}: a verify row has 1..1+num_spec = 1..{1 + num_spec} tokens, got {n}")
            if k == PREFILL and n < 1:
                raise BatchError(f"request {i}: an empty prefill chunk")
            if not is_int(s) or not -1 <= s < slots_total:
                raise BatchError(f"request {i}: slot index {s!r} outside [-1, {slots_total}) (-1 = null row)")
            if s >= 0:
                if s in seen:
                    raise BatchError(f"slot {s} is used by requests {seen[s]} and {i} in one batch")
                seen[int(s)] = i
        if has_initial_state is None:
            has_initial_state = [k != PREFILL for k in kinds]
        if len(has_initial_state) != r:
            raise BatchError(f"has_initial_state has {len(has_initial_state)} entries for {r} requests")
        for i, h in enumerate(has_initial_state):
            if not isinstance(h, bool):
                raise BatchError(f"request {i}: has_initial_state {h!r} must be a bool")
        if num_rejected is None:
            num_rejected = [0] * r
            if num_accepted is not None:
                if prev_query_lens is None or len(num_accepted) != r or len(prev_query_lens) != r:
                    raise BatchError("num_accepted needs prev_query_lens, both with one entry per request")
                for i, (a, q) in enumerate(zip(num_accepted, prev_query_lens)):
                    if a is None:
                        continue
                    if not is_int(a) or not is_int(q) or not 1 <= a <= q:
                        raise BatchError(f"request {i}: accepted count {a!r} outside 1..previous verify length {q!r}")
                    num_rejected[i] = q - a
        if len(num_rejected) != r:
            raise BatchError(f"num_rejected has {len(num_rejected)} entries for {r} requests")
        for i, nr in enumerate(num_rejected):
            if not is_int(nr):
                raise BatchError(f"request {i}: num_rejected {nr!r} must be an int")
            if not 0 <= nr <= num_spec:
                raise BatchError(f"request {i}: {nr} rejected tokens, allowed 0..num_spec={num_spec}")
            if nr and not has_initial_state[i]:
                raise BatchError(f"request {i}: rejected tokens on a request without initial state")
        if not isinstance(ngram_context, torch.Tensor) or ngram_context.dim() != 2 or ngram_context.shape[0] != r:
            raise BatchError(
                f"ngram_context must be [R={r}, N-1], got shape {tuple(getattr(ngram_context, 'shape', ()))}"
            )
        if ngram_context.dtype not in _INT_DTYPES:
            raise BatchError(f"ngram_context must be an int32/int64 tensor, got {ngram_context.dtype}")
        if vocab_size is not None and (at := first_out_of_range(ngram_context, vocab_size)) is not None:
            bad = int(ngram_context.reshape(-1)[at])
            raise BatchError(f"ngram_context holds token {bad}, outside [0, vocab_size={vocab_size})")
        if adapter_indices is not None:
            if len(adapter_indices) != r:
                raise BatchError(f"adapter_indices has {len(adapter_indices)} entries for {r} requests")
            for i, a in enumerate(adapter_indices):
                if not is_int(a) or a < -1:
                    raise BatchError(f"request {i}: adapter index {a!r} must be an int >= -1 (-1: the default)")
        lens = [int(n) for n in query_lens]
        offsets = [0, *_cumsum(lens)]
        return cls(
            query_start_loc=torch.tensor(offsets, dtype=torch.int64, device=device),
            slot_indices=torch.tensor([int(s) for s in slot_indices], dtype=torch.int64, device=device),
            kinds=kinds,
            has_initial_state=torch.tensor(list(has_initial_state), dtype=torch.bool, device=device),
            ngram_context=ngram_context.to(device=device, dtype=torch.int64),
            num_rejected=torch.tensor([int(n) for n in num_rejected], dtype=torch.int64, device=device),
            conv_state=conv_state,
            num_spec=int(num_spec),
            state_offsets=state_offsets,
            token_count=offsets[-1],
            adapter_indices=None
            if adapter_indices is None
            else torch.tensor([int(a) for a in adapter_indices], dtype=torch.int64, device=device),
        )


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


# torch.export: the tensors are the leaves; `kinds` and `token_count` are host-side only and not part
# of the traced program (a dataclass registration would bake `kinds`, and so R, into its input spec).
_LEAVES = (
    "query_start_loc",
    "slot_indices",
    "has_initial_state",
    "ngram_context",
    "num_rejected",
    "conv_state",
    "state_offsets",
    "adapter_indices",
)


def _flatten(b: Batch):
    return [getattr(b, f) for f in _LEAVES], b.num_spec


def _flatten_with_keys(b: Batch):
    return [(pytree.GetAttrKey(f), getattr(b, f)) for f in _LEAVES], b.num_spec


def _unflatten(leaves, num_spec) -> Batch:
    fields = dict(zip(_LEAVES, leaves))
    return Batch(kinds=(), num_spec=num_spec, **fields)


pytree.register_pytree_node(
    Batch,
    _flatten,
    _unflatten,
    serialized_type_name="ple.runtime.batch.Batch",
    flatten_with_keys_fn=_flatten_with_keys,
)
