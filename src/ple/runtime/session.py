"""``Session``: per-request streaming state for users who drive a :class:`PLELayer` themselves.

The session owns everything that changes per request: a slot of the conv state pool, the n-gram
context, the history length, a pending speculative chunk, and prefix states. Each
:meth:`Session.step` is one packed batch, whatever the mix of first chunks, continuations, decode
tokens and speculative chunks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping

import torch

from ..errors import PLEError
from ..ngram import next_ngram_context
from .batch import DECODE, PREFILL, VERIFY, Batch

__all__ = ["Session", "PrefixState", "SessionError"]


class SessionError(PLEError, ValueError):
    """A request id, chunk or acceptance the session cannot take; nothing was changed."""


@dataclasses.dataclass(frozen=True)
class PrefixState:
    """A request's state after ``length`` tokens: enough to resume it exactly.

    ``conv_window [HC*H, (K-1)*N]`` (the last conv inputs, zeros before the start),
    ``ngram_context [N-1]`` int64 (the last N-1 tokens, EOS-filled).
    """

    conv_window: torch.Tensor
    ngram_context: torch.Tensor
    length: int


@dataclasses.dataclass
class _Pending:
    """A speculative chunk waiting for :meth:`Session.accept`."""

    tokens: torch.Tensor
    prev_context: torch.Tensor
    prev_length: int
    prev_window: torch.Tensor | None  # only kept when prefix states may fall inside the chunk
    conv_input: torch.Tensor | None


@dataclasses.dataclass
class _Request:
    slot: int
    context: torch.Tensor  # [N-1]
    length: int = 0
    has_state: bool = False
    rejected: int = 0
    pending: _Pending | None = None
    prefix_states: dict[int, PrefixState] = dataclasses.field(default_factory=dict)


class Session:
    """Streams requests through one :class:`ple.PLELayer`.

    Args:
        layer: the layer (weights + table); the session allocates the state pool beside it.
        max_requests: slots in the pool (live requests at once).
        num_spec: the most speculative tokens per verify chunk (a chunk holds 1 + num_spec).
        prefix_every: keep a :class:`PrefixState` at every multiple of this many tokens of each
            request's (kept) history, positions inside prefill chunks included.
    """

    def __init__(self, layer, max_requests: int, num_spec: int = 0, prefix_every: int | None = None):
        if max_requests < 1:
            raise SessionError(f"max_requests must be >= 1, got {max_requests}")
        if num_spec < 0:
            raise SessionError(f"num_spec must be >= 0, got {num_spec}")
        if prefix_every is not None and prefix_every < 1:
            raise SessionError(f"prefix_every must be >= 1 or None, got {prefix_every}")
        self.layer = layer
        self.max_requests = max_requests
        self.num_spec = num_spec
        self.prefix_every = prefix_every
        cfg = layer.config
        self._window = cfg.conv_window
        self._eos = cfg.eos_token_id
        self._ctx_len = cfg.ngram_size - 1
        self.conv_state = layer.new_state_pool(max_requests, num_spec)
        self._free = list(range(max_requests - 1, -1, -1))
        self._requests: dict[Hashable, _Request] = {}

    # ------------------------------------------------------------------ requests
    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._requests)

    def _get(self, request_id) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise SessionError(f"unknown request {request_id!r}") from None

    def add(self, request_id: Hashable, from_state: PrefixState | None = None) -> None:
        """Start a request, fresh or resuming from a :class:`PrefixState`."""
        if request_id in self._requests:
            raise SessionError(f"request {request_id!r} is already active")
        if not self._free:
            raise SessionError(f"all {self.max_requests} slots are in use (max_requests); finish a request first")
        ctx = torch.full((self._ctx_len,), self._eos, dtype=torch.int64)
        if from_state is not None:
            ck = from_state
            want = (self.conv_state.shape[1], self._window)
            if tuple(ck.conv_window.shape) != want or tuple(ck.ngram_context.shape) != (self._ctx_len,):
                raise SessionError(
                    f"prefix state has conv_window {tuple(ck.conv_window.shape)} and ngram_context "
                    f"{tuple(ck.ngram_context.shape)}; this layer needs {want} and ({self._ctx_len},)"
                )
        slot = self._free.pop()
        req = _Request(slot=slot, context=ctx)
        if from_state is not None:
            width = self.conv_state.shape[2]
            self.conv_state[slot].zero_()
            self.conv_state[slot, :, width - self._window :] = from_state.conv_window.to(self.conv_state)
            req.context = from_state.ngram_context.to(torch.int64).clone()
            req.length = from_state.length
            req.has_state = True
            self._maybe_keep(req, from_state)
        self._requests[request_id] = req

    def finish(self, request_id: Hashable) -> None:
        """End a request and free its slot (its prefix states go with it: take them first)."""
        req = self._get(request_id)
        del self._requests[request_id]
        self._free.append(req.slot)

    # ------------------------------------------------------------------ state views
    def _window_of(self, req: _Request) -> torch.Tensor:
        """``[C, W]``: the conv window of the request's kept history (a copy)."""
        if not req.has_state:
            return torch.zeros(self.conv_state.shape[1], self._window, dtype=self.conv_state.dtype)
        width = self.conv_state.shape[2]
        end = width - req.rejected
        return self.conv_state[req.slot, :, end - self._window : end].clone()

    def prefix_state(self, request_id: Hashable) -> PrefixState:
        """The request's current state (after its kept history)."""
        req = self._get(request_id)
        if req.pending is not None:
            raise SessionError(f"request {request_id!r} has a speculative chunk awaiting accept()")
        return PrefixState(self._window_of(req), req.context.clone(), req.length)

    def prefix_states(self, request_id: Hashable) -> dict[int, PrefixState]:
        """``{position: PrefixState}`` at every multiple of ``prefix_every`` reached so far."""
        return dict(self._get(request_id).prefix_states)

    def _maybe_keep(self, req: _Request, ck: PrefixState) -> None:
        b = self.prefix_every
        if b and ck.length > 0 and ck.length % b == 0:
            req.prefix_states[ck.length] = ck

    def _states_inside(
        self,
        req_len: int,
        n: int,
        prev_window: torch.Tensor,
        prev_ctx: torch.Tensor,
        tokens: torch.Tensor,
        c: torch.Tensor,
    ) -> list[PrefixState]:
        """Prefix states at multiples of ``prefix_every`` in ``(req_len, req_len + n]``."""
        b = self.prefix_every
        out = []
        first = (req_len // b + 1) * b
        for pos in range(first, req_len + n + 1, b):
            k = pos - req_len
            hist = torch.cat([prev_window, c[:k].t().to(prev_window.dtype)], dim=1)
            window = hist[:, hist.shape[1] - self._window :].clone()
            ctx = next_ngram_context(tokens[:k], torch.tensor([0, k]), prev_ctx.view(1, -1))[0]
            out.append(PrefixState(window, ctx, pos))
        return out

    # ------------------------------------------------------------------ stepping
    def step(
        self,
        inputs: Mapping[Hashable, tuple[torch.Tensor, torch.Tensor]],
        speculative: Iterable[Hashable] = (),
    ) -> dict[Hashable, torch.Tensor]:
        """Run one packed batch.

        Args:
            inputs: ``{request_id: (hidden [n, HC*H], tokens [n])}``; any mix of first chunks,
                continuations and single decode tokens.
            speculative: request ids whose chunk is a speculative verify chunk (``1 .. 1+num_spec``
                tokens); call :meth:`accept` for each before its next step.

        Returns:
            ``{request_id: new hidden [n, HC*H]}``.
        """
        spec = set(speculative)
        cfg = self.layer.config
        unknown = [r for r in list(inputs) + list(spec) if r not in self._requests]
        if unknown:
            raise SessionError(f"unknown request {unknown[0]!r}")
        extra = spec - set(inputs)
        if extra:
            raise SessionError(f"request {next(iter(extra))!r} is marked speculative but has no chunk")
        order = list(inputs)
        lens, slots, kinds, has_init, rejected, ctxs, hs, toks = [], [], [], [], [], [], [], []
        for rid in order:
            req = self._requests[rid]
            hidden, tokens = inputs[rid]
            n = int(tokens.shape[0]) if tokens.dim() == 1 else -1
            if n < 1:
                raise SessionError(f"request {rid!r}: tokens must be a non-empty 1-D tensor, got {tuple(tokens.shape)}")
            if tuple(hidden.shape) != (n, cfg.hc_hidden_size):
                raise SessionError(
                    f"request {rid!r}: hidden must be [{n}, {cfg.hc_hidden_size}], got {tuple(hidden.shape)}"
                )
            if req.pending is not None:
                raise SessionError(f"request {rid!r}: call accept() for its speculative chunk before the next step")
            if rid in spec and n > 1 + self.num_spec:
                raise SessionError(
                    f"request {rid!r}: a speculative chunk holds at most 1 + num_spec = {1 + self.num_spec} tokens, got {n}"
                )
            lens.append(n)
            slots.append(req.slot)
            kinds.append(VERIFY if rid in spec else (DECODE if n == 1 and req.has_state else PREFILL))
            has_init.append(req.has_state)
            rejected.append(req.rejected)
            ctxs.append(req.context)
            hs.append(hidden)
            toks.append(tokens.to(torch.int64))
        batch = Batch.build(
            lens,
            slots,
            torch.stack(ctxs) if ctxs else torch.zeros(0, self._ctx_len, dtype=torch.int64),
            self.conv_state,
            kinds=kinds,
            has_initial_state=has_init,
            num_rejected=rejected,
            num_spec=self.num_spec,
            conv_window=self._window,
        )
        if not order:
            return {}
        tokens_all = torch.cat(toks)
        hidden_all = torch.cat(hs)
        # windows before this step, for prefix states that fall inside a chunk
        b = self.prefix_every
        prev_windows = {}
        for rid, n in zip(order, lens):
            req = self._requests[rid]
            if b and (req.length // b != (req.length + n) // b):
                prev_windows[rid] = self._window_of(req)
        out, conv_in = self.layer(hidden_all, tokens_all, batch, return_conv_input=True)
        new_ctx = next_ngram_context(tokens_all, batch.query_start_loc.cpu(), batch.ngram_context.cpu())
        results = {}
        for i, rid in enumerate(order):
            req = self._requests[rid]
            a, e = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
            results[rid] = out[a:e]
            req.has_state = True
            req.rejected = 0
            if rid in spec:
                req.pending = _Pending(
                    tokens=toks[i],
                    prev_context=req.context,
                    prev_length=req.length,
                    prev_window=prev_windows.get(rid),
                    conv_input=conv_in[a:e].detach() if rid in prev_windows else None,
                )
                # until accept(), the slot holds all n tokens; accept() sets how many are rolled back
                req.length += e - a
                req.context = new_ctx[i].clone()
                continue
            if rid in prev_windows:
                for ck in self._states_inside(
                    req.length, e - a, prev_windows[rid], req.context, toks[i], conv_in[a:e].detach()
                ):
                    req.prefix_states[ck.length] = ck
            req.length += e - a
            req.context = new_ctx[i].clone()
        return results

    def accept(self, request_id: Hashable, kept: int) -> None:
        """Keep the first ``kept`` tokens (``1 <= kept <= n``) of the request's speculative chunk.

        Rejected tokens leave no trace: the n-gram context, the conv window and the length are
        those of the kept history.
        """
        req = self._get(request_id)
        p = req.pending
        if p is None:
            raise SessionError(f"request {request_id!r} has no speculative chunk to accept")
        n = int(p.tokens.shape[0])
        if isinstance(kept, bool) or not isinstance(kept, int) or not 1 <= kept <= n:
            raise SessionError(f"request {request_id!r}: kept={kept!r} outside 1..{n} (the chunk's length)")
        if p.prev_window is not None and self.prefix_every:
            for ck in self._states_inside(p.prev_length, kept, p.prev_window, p.prev_context, p.tokens, p.conv_input):
                req.prefix_states[ck.length] = ck
        req.context = next_ngram_context(p.tokens[:kept], torch.tensor([0, kept]), p.prev_context.view(1, -1))[0]
        req.length = p.prev_length + kept
        req.rejected = n - kept
        req.pending = None
