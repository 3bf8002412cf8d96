"""``Batch``: the packed metadata of one engine step, built and validated in one place."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..errors import PLEError

__all__ = ["Batch", "BatchError", "PREFILL", "DECODE", "VERIFY"]

PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"
_KINDS = (PREFILL, DECODE, VERIFY)


class BatchError(PLEError, ValueError):
    """Inconsistent step metadata; the message names the request and the value."""


@dataclasses.dataclass
class Batch:
    """One step of a serving engine for one PLE layer: R requests packed into T tokens.

    Attributes:
        query_start_loc: ``[R+1]`` int64 token offsets (``0 ... T``).
        slot_indices: ``[R]`` int64 state slot per request; ``-1`` is a null row (skipped: no conv,
            no state read or write; its output is ``hidden + v``).
        kinds: per request ``"prefill"`` (any length, first chunk or continuation), ``"decode"``
            (one token) or ``"verify"`` (speculative verification, ``1 .. 1+num_spec`` tokens).
        has_initial_state: ``[R]`` bool; False = the request's history starts with this chunk.
        ngram_context: ``[R, N-1]`` int64, each request's last N-1 tokens before this chunk.
        num_rejected: ``[R]`` int64, tokens of the request's previous (verify) step that were not
            accepted: ``previous verify length - accepted count``; 0 otherwise.
        conv_state: ``[slots, HC*H, (K-1)*N + num_spec]`` the state pool this step reads and writes.
        num_spec: speculative tokens per verify row (the pool's extra columns).
    """

    query_start_loc: torch.Tensor
    slot_indices: torch.Tensor
    kinds: tuple[str, ...]
    has_initial_state: torch.Tensor
    ngram_context: torch.Tensor
    num_rejected: torch.Tensor
    conv_state: torch.Tensor
    num_spec: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.kinds)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

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
    ) -> Batch:
        """Build and validate a batch.

        ``num_accepted[r]`` (with ``prev_query_lens[r]``, the length of that request's previous
        verify step) says how many tokens of the previous step were accepted; ``None`` entries mean
        the previous step was not speculative. ``num_rejected`` may be given directly instead.
        ``conv_window`` = (K-1)*N lets the builder check the pool width.
        """
        r = len(query_lens)
        device = conv_state.device if device is None else torch.device(device)
        kinds = tuple(kinds) if kinds is not None else tuple(DECODE if n == 1 else PREFILL for n in query_lens)
        if len(kinds) != r or len(slot_indices) != r:
            raise BatchError(f"{r} query lengths but {len(slot_indices)} slot indices and {len(kinds)} kinds")
        if conv_state.dim() != 3:
            raise BatchError(f"conv_state must be [slots, channels, window], got shape {tuple(conv_state.shape)}")
        slots_total, _, width = conv_state.shape
        if conv_window is not None and width != conv_window + num_spec:
            raise BatchError(
                f"conv_state window is {width} columns, expected (K-1)*N + num_spec = {conv_window} + {num_spec}"
            )
        seen: dict[int, int] = {}
        for i, (n, s, k) in enumerate(zip(query_lens, slot_indices, kinds)):
            if k not in _KINDS:
                raise BatchError(f"request {i}: kind {k!r} is not one of {_KINDS}")
            if not isinstance(n, int) or n < 0:
                raise BatchError(f"request {i}: query length {n!r} must be a non-negative int")
            if k == DECODE and n != 1:
                raise BatchError(f"request {i}: a decode row has exactly 1 token, got {n}")
            if k == VERIFY and not 1 <= n <= 1 + num_spec:
                raise BatchError(f"request {i}: a verify row has 1..1+num_spec = 1..{1 + num_spec} tokens, got {n}")
            if k == PREFILL and n < 1:
                raise BatchError(f"request {i}: an empty prefill chunk")
            if not isinstance(s, int) or not -1 <= s < slots_total:
                raise BatchError(f"request {i}: slot index {s!r} outside [-1, {slots_total}) (-1 = null row)")
            if s >= 0:
                if s in seen:
                    raise BatchError(f"slot {s} is used by requests {seen[s]} and {i} in one batch")
                seen[s] = i
        if has_initial_state is None:
            has_initial_state = [k != PREFILL for k in kinds]
        if len(has_initial_state) != r:
            raise BatchError(f"has_initial_state has {len(has_initial_state)} entries for {r} requests")
        if num_rejected is None:
            num_rejected = [0] * r
            if num_accepted is not None:
                if prev_query_lens is None or len(num_accepted) != r or len(prev_query_lens) != r:
                    raise BatchError("num_accepted needs prev_query_lens, both with one entry per request")
                for i, (a, q) in enumerate(zip(num_accepted, prev_query_lens)):
                    if a is None:
                        continue
                    if q is None or not 1 <= a <= q:
                        raise BatchError(f"request {i}: accepted count {a} outside 1..previous verify length {q}")
                    num_rejected[i] = q - a
        if len(num_rejected) != r:
            raise BatchError(f"num_rejected has {len(num_rejected)} entries for {r} requests")
        for i, nr in enumerate(num_rejected):
            if not 0 <= nr <= num_spec:
                raise BatchError(f"request {i}: {nr} rejected tokens, allowed 0..num_spec={num_spec}")
            if nr and not has_initial_state[i]:
                raise BatchError(f"request {i}: rejected tokens on a request without initial state")
        if ngram_context.dim() != 2 or ngram_context.shape[0] != r:
            raise BatchError(f"ngram_context must be [R={r}, N-1], got shape {tuple(ngram_context.shape)}")
        qsl = torch.zeros(r + 1, dtype=torch.int64)
        if r:
            qsl[1:] = torch.tensor(list(query_lens), dtype=torch.int64).cumsum(0)
        return cls(
            query_start_loc=qsl.to(device),
            slot_indices=torch.tensor(list(slot_indices), dtype=torch.int64, device=device),
            kinds=kinds,
            has_initial_state=torch.tensor(list(has_initial_state), dtype=torch.bool, device=device),
            ngram_context=ngram_context.to(device=device, dtype=torch.int64),
            num_rejected=torch.tensor(list(num_rejected), dtype=torch.int64, device=device),
            conv_state=conv_state,
            num_spec=num_spec,
        )
