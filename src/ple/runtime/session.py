"""``Session``: per-request streaming state for users who drive PLE layers themselves.

The session owns everything that changes per request: a slot of each layer's conv state pool, the
n-gram context, the history length, a pending speculative chunk, and prefix states. One session
serves every PLE layer of a model: requests, slots, contexts and lengths are shared, each layer has
its own state pool. Each step is one packed batch, whatever the mix of first chunks, continuations,
decode tokens and speculative chunks:

- one layer: :meth:`Session.step` (``{request: (hidden, tokens)}`` in, ``{request: new hidden}`` out);
- several layers, as a model runs them: :meth:`Session.begin` (tokens), then :meth:`Session.run`
  once per layer (packed hidden in, packed new hidden out), then :meth:`Session.end`.

On the CPU with the C kernel (bf16/fp32) the pools are kept token-major as rings
(:mod:`ple.ops.state`): a step writes only its new columns. :attr:`Session.conv_state` and
:meth:`Session.conv_states` give the engine layout ``[slots, HC*H, (K-1)*N + num_spec]`` (exact copies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping
from operator import attrgetter, itemgetter, methodcaller
from typing import Any

import numpy as np
import torch

from ple.kernels import native as _native
from ple.ngram import first_out_of_range, next_ngram_context, ngram_ids
from ple.ops.library import named_range
from ple.ops.state import ring_to_engine
from ple.runtime.batch import DECODE, PREFILL, VERIFY, Batch, is_int
from ple.runtime.requests import (
    Pending,
    PrefixKeeping,
    PrefixState,
    Request,
    SessionError,
    SessionStep,
    adapter_of,
    check_resumable,
    packed_rows,
    positive_int,
)
from ple.runtime.slots import SlotArrays
from ple.table.tiers.named import ADAPTER_CHANGES

__all__ = ["Session", "SessionStep", "PrefixState", "SessionError"]


_TOKEN_DTYPES = frozenset((torch.int64, torch.int32))
_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
# per-request fields read in bulk (map with these runs without a Python frame per request)
_shape, _dtype = attrgetter("shape"), attrgetter("dtype")
_slot, _pending, _wanted = (attrgetter(f) for f in ("slot", "pending", "wanted"))
_first, _second = itemgetter(0), itemgetter(1)


class Session(PrefixKeeping):
    """Streams requests through the PLE layers of one model.

    Args:
        layers: one :class:`ple.PLELayer`, or the model's PLE layers in order (one config, one dtype
            and device); the session allocates a state pool per layer.
        max_requests: slots in each pool (live requests at once); :meth:`grow` adds more.
        num_spec: the most speculative tokens per verify chunk (a chunk holds 1 + num_spec).
        prefix_every: keep a :class:`PrefixState` at every multiple of this many tokens of each
            request's (kept) history, positions inside prefill chunks included. Other positions
            (an engine's block boundaries) are named with :meth:`keep_prefix_at`.
        state_layout: ``"ring"`` (token-major rings, only where the C kernel runs), ``"engine"``
            (``[slots, HC*H, L]``), or ``"auto"``: rings where the C kernel runs.
        lookahead: start every layer's table lookup of a step in :meth:`begin` (all tokens, verify
            chunks' drafted tokens included, are known there), so the reads of a table on disk
            overlap with whatever the model computes before each PLE layer; see also :meth:`prefetch`.
    """

    def __init__(
        self,
        layers,
        max_requests: int,
        num_spec: int = 0,
        prefix_every: int | None = None,
        *,
        state_layout: str = "auto",
        lookahead: bool = False,
    ):
        max_requests = positive_int("max_requests", max_requests, 1)
        num_spec = positive_int("num_spec", num_spec, 0)
        if prefix_every is not None:
            prefix_every = positive_int("prefix_every", prefix_every, 1)
        group = (layers,) if isinstance(layers, torch.nn.Module) else tuple(layers)
        if not group or not all(hasattr(x, "config") and hasattr(x, "key_proj") for x in group):
            raise SessionError(f"layers must be a PLELayer or a non-empty sequence of them, got {layers!r}")
        first = group[0]

        def shape_of(x) -> tuple:
            c = x.config
            return (
                c.hc_hidden_size,
                c.conv_window,
                c.ngram_size,
                c.eos_token_id,
                c.vocab_size,
                x.dtype,
                x.key_proj.device,
            )

        for k, x in enumerate(group[1:], 1):
            if shape_of(x) != shape_of(first):
                raise SessionError(
                    f"layer {k} differs from layer 0 in (channels, conv window, n-gram size, eos, vocab, dtype, "
                    f"device): {shape_of(x)} vs {shape_of(first)}; the layers of one session share them"
                )
        self.layers = group
        self.layer = first
        self.max_requests = max_requests
        self.num_spec = num_spec
        self.prefix_every = prefix_every
        cfg = first.config
        self._channels = cfg.hc_hidden_size
        self._window = cfg.conv_window
        self._width = cfg.conv_window + num_spec
        self._eos = cfg.eos_token_id
        self._vocab = cfg.vocab_size
        self._ctx_len = cfg.ngram_size - 1
        self._dtype = first.dtype
        self._device = first.key_proj.device
        self._on_cpu = self._device.type == "cpu"
        # the C kernel reads and writes ring pools; other paths keep the engine layout
        native = self._device.type == "cpu" and self._dtype in (torch.bfloat16, torch.float32) and _native.available()
        if state_layout not in ("auto", "ring", "engine"):
            raise SessionError(f"state_layout must be 'auto', 'ring' or 'engine', got {state_layout!r}")
        if state_layout == "ring" and not native:
            raise SessionError(
                "state_layout='ring' needs the C kernel (bf16/fp32 CPU layers with the kernels built); use 'auto'"
            )
        self._ring = native and state_layout != "engine"
        self._pools = [self._new_pool(max_requests) for _ in group]
        self._offsets = [torch.zeros(max_requests, dtype=torch.int64, device=self._device) for _ in group]
        self._decode_starts: dict[int, torch.Tensor] = {}  # query_start_loc of n one-token requests (read only)
        self._free = list(range(max_requests - 1, -1, -1))
        self._arrays = SlotArrays(max_requests, self._ctx_len, self._eos)
        self._pending_count = 0  # requests with a speculative chunk awaiting accept()
        self._requests: dict[Hashable, Request] = {}
        self._open: SessionStep | None = None
        self.lookahead = bool(lookahead)
        self._ahead: list | None = None  # (ids, handle) per layer, from prefetch()
        self._named_live = 0  # live requests that read a named adapter

    def _new_pool(self, slots: int) -> torch.Tensor:
        shape = (slots, self._width, self._channels) if self._ring else (slots, self._channels, self._width)
        try:
            return torch.zeros(shape, dtype=self._dtype, device=self._device)
        except (RuntimeError, MemoryError) as e:
            if not _out_of_memory(e):
                raise
            nbytes = slots * self._width * self._channels * self._dtype.itemsize
            raise SessionError(
                f"{slots:,} slots of conv state ({nbytes / 2**30:,.1f} GiB per layer, {self._dtype}) cannot be "
                f"allocated on {self._device}: ask for fewer requests (max_requests)"
            ) from None

    # ------------------------------------------------------------------ requests
    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._requests)

    @property
    def conv_state(self) -> torch.Tensor:
        """The first layer's pool in the engine layout ``[slots, HC*H, (K-1)*N + num_spec]`` (a copy
        when the session keeps rings)."""
        return self.conv_states(0)

    def conv_states(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s pool (index into :attr:`layers`) in the engine layout (a copy for rings)."""
        if self._ring:
            return ring_to_engine(self._pools[layer], self._offsets[layer])
        return self._pools[layer]

    def _get(self, request_id) -> Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise SessionError(f"unknown request {request_id!r}") from None

    def _check_idle(self, what: str) -> None:
        if self._open is not None and not self._open.ended:
            raise SessionError(f"{what} during a step: call end() first")

    def add(self, request_id: Hashable, from_state: PrefixState | None = None, *, adapter: str | None = None) -> None:
        """Start a request, fresh or resuming from a :class:`PrefixState`.

        ``adapter``: the name of the named adapter the request reads its table rows through
        (``ple.train.load_adapter(model, path, name=...)``; unknown names are refused here), or None
        for the layers' tables as they are (the model's default adapter, if any). A prefix state
        resumes only under the adapter it was taken under. Until :meth:`finish`, the adapter cannot
        be removed."""
        self._check_idle("add()")
        try:
            active = request_id in self._requests
        except TypeError:
            raise SessionError(f"request id {request_id!r} is not hashable") from None
        if active:
            raise SessionError(f"request {request_id!r} is already active")
        if not self._free:
            raise SessionError(f"all {self.max_requests} slots are in use (max_requests); finish a request first")
        with ADAPTER_CHANGES:  # the adapter stays loaded from here: pinned before the lock is released
            index, key = adapter_of(self.layers, adapter)
            if from_state is not None:
                window, ctx = self._check_state(from_state)
                check_resumable(request_id, from_state, key)
            slot = self._free.pop()
            req = Request(slot, self._arrays, index, key)
            if index >= 0:
                for layer in self.layers:
                    layer.table_ref.adapters.pin(self, request_id, index)
                self._named_live += 1
        self._arrays.contexts[slot] = self._eos
        if from_state is not None:
            for k in range(len(self.layers)):
                self._write_window(k, slot, window[k])
            self._arrays.contexts[slot] = ctx
            req.length = from_state.length
            req.has_state = True
            self._maybe_keep(req, from_state)
        self._requests[request_id] = req

    def _check_state(self, st: PrefixState) -> tuple[torch.Tensor, torch.Tensor]:
        """The state's windows as ``[layers, C, W]`` and its context, after checking everything."""
        if not isinstance(st, PrefixState):
            raise SessionError(f"from_state must be a PrefixState, got {type(st).__name__}")
        if not is_int(st.length) or st.length < 0:
            raise SessionError(f"prefix state length {st.length!r} must be a non-negative int")
        w = st.conv_window
        layers = len(self.layers)
        want = (self._channels, self._window) if layers == 1 else (layers, self._channels, self._window)
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != want or not w.is_floating_point():
            raise SessionError(
                f"prefix state conv_window is {getattr(w, 'dtype', type(w).__name__)} "
                f"{tuple(getattr(w, 'shape', ()))}; this session needs a floating tensor of shape {want}"
            )
        if not bool(torch.isfinite(w).all()):
            raise SessionError("prefix state conv_window holds NaN or infinite values")
        c = st.ngram_context
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != (self._ctx_len,):
            raise SessionError(
                f"prefix state ngram_context has shape {tuple(getattr(c, 'shape', ()))}; needs ({self._ctx_len},)"
            )
        if c.dtype not in (torch.int32, torch.int64):
            raise SessionError(f"prefix state ngram_context must hold integer tokens, got {c.dtype}")
        if first_out_of_range(c, self._vocab) is not None:
            raise SessionError(f"prefix state ngram_context {c.tolist()} has tokens outside [0, {self._vocab})")
        return w.reshape(layers, self._channels, self._window), c.to(torch.int64).cpu()

    def _write_window(self, k: int, slot: int, window: torch.Tensor) -> None:
        pool = self._pools[k]
        w = window.to(device=pool.device, dtype=pool.dtype)
        with torch.no_grad():
            pool[slot].zero_()
            if self._ring:
                pool[slot, self._width - self._window :] = w.t()
                self._offsets[k][slot] = 0
            else:
                pool[slot, :, self._width - self._window :] = w

    def finish(self, request_id: Hashable) -> None:
        """End a request and free its slot (its prefix states go with it: take them first)."""
        self._check_idle("finish()")
        req = self._get(request_id)
        del self._requests[request_id]
        if req.pending is not None:
            self._pending_count -= 1
        if req.adapter >= 0:
            self._named_live -= 1
            for layer in self.layers:
                if layer.table_ref.adapters is not None:
                    layer.table_ref.adapters.unpin(self, request_id)
        self._free.append(req.slot)

    def grow(self, max_requests: int) -> None:
        """Make room for ``max_requests`` requests (at least the current number); live requests keep
        their slots and states."""
        self._check_idle("grow()")
        max_requests = positive_int("max_requests", max_requests, self.max_requests)
        extra = max_requests - self.max_requests
        if extra == 0:
            return
        with torch.no_grad():
            try:
                pools = [torch.cat([p, self._new_pool(extra)]) for p in self._pools]
            except (RuntimeError, MemoryError) as e:  # the old pools stay as they were
                if not _out_of_memory(e):
                    raise
                raise SessionError(
                    f"growing to {max_requests:,} slots: the conv state cannot be allocated on {self._device}"
                ) from None
            self._pools = pools
            self._offsets = [torch.cat([o, o.new_zeros(extra)]) for o in self._offsets]
            self._arrays.grow(extra)
        self._free = list(range(max_requests - 1, self.max_requests - 1, -1)) + self._free
        self.max_requests = max_requests

    # ------------------------------------------------------------------ stepping
    def begin(
        self,
        tokens: Mapping[Any, torch.Tensor],
        speculative: Iterable[Hashable] = (),
    ) -> SessionStep:
        """Start one packed step: ``{request: tokens [n]}`` (any mix of first chunks, continuations,
        single decode tokens and, for ids in ``speculative``, verify chunks of ``1 .. 1+num_spec``
        tokens). Then :meth:`run` each layer once with the packed hidden ``[T, HC*H]`` (requests in
        the order of ``tokens``), then :meth:`end`. Everything is checked here; nothing changes
        until the first :meth:`run`."""
        return self._begin_step(tokens, speculative, None)

    def _begin_step(self, tokens: Mapping[Any, torch.Tensor], speculative, lens: list[int] | None) -> SessionStep:
        """:meth:`begin`; ``lens``: the chunks' lengths when the caller checked that each is 1-D."""
        self._check_idle("begin()")
        with named_range("ple.session.prepare"):
            step = self._begin(tokens, _request_set("speculative", speculative), lens)
        if self.lookahead or self._ahead is not None:
            self._start_lookups(step)
        return step

    def _start_lookups(self, step: SessionStep) -> None:
        """Start each layer's lookup of ``step`` (adopting reads :meth:`prefetch` started for the same ids)."""
        ahead, self._ahead = self._ahead, None
        handles: list = []
        try:
            for k, layer in enumerate(self.layers if step.request_ids else ()):
                handle = None
                if ahead is not None and ahead[k] is not None:
                    ids = layer.ngram_ids(step.tokens, step.batch)
                    prev_ids, prev = ahead[k]
                    ahead[k] = None
                    if prev_ids.shape == ids.shape and torch.equal(prev_ids, ids):
                        handle = prev
                        handle.bind(layer, step.tokens, step.batch.query_start_loc, step.batch.ngram_context)
                    else:
                        prev.release()
                handles.append(handle if handle is not None else layer.start_prefetch(step.tokens, step.batch))
        finally:
            for pair in ahead or ():
                if pair is not None:
                    pair[1].release()
        step.lookups = handles or None

    def prefetch(self, tokens: Mapping[Any, torch.Tensor]) -> None:
        """Start the table reads of the next step now, while the open one computes: ``{request:
        tokens [n]}`` as the next :meth:`begin` will get them (the next prefill chunk, say). A request
        of the open step continues after that step's chunk; one in a speculative chunk cannot be
        foreseen (its acceptance is unknown) and is refused. The next :meth:`begin` uses each layer's
        reads if its ids are the same, else drops them and reads again."""
        step = self._open
        ctx_rows, chunks = [], []
        for rid, t in tokens.items():
            req = self._requests.get(rid)
            if req is None:
                raise SessionError(f"unknown request {rid!r}")
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] < 1:
                raise SessionError(f"request {rid!r}: tokens must be a non-empty 1-D tensor")
            ctx = self._arrays.contexts[req.slot]
            if step is not None and rid in step.request_ids:
                if rid in step.speculative:
                    raise SessionError(f"request {rid!r} is in a speculative chunk: its next context is unknown")
                i = step.request_ids.index(rid)
                a = sum(step.lens[:i])
                ctx = torch.cat([self._arrays.contexts[req.slot], step.tokens[a : a + step.lens[i]].cpu()])
                ctx = ctx[ctx.numel() - self._ctx_len :]
            ctx_rows.append(ctx)
            chunks.append(t.to(torch.int64).cpu())
        if not chunks:
            return
        self.drop_prefetch()
        packed = torch.cat(chunks)
        qsl = torch.tensor([0, *_accumulate([c.numel() for c in chunks])], dtype=torch.int64)
        context = torch.stack(ctx_rows)
        dev = self._device
        ahead = []
        for layer in self.layers:
            ids = ngram_ids(packed.to(dev), qsl.to(dev), context.to(dev), layer.layout, self._eos)
            ahead.append((ids, layer.table.start_prefetch(ids, self._dtype)))
        self._ahead = ahead

    def drop_prefetch(self) -> None:
        """Drop the reads :meth:`prefetch` started (if the next step will be another)."""
        ahead, self._ahead = self._ahead, None
        for pair in ahead or ():
            if pair is not None:
                pair[1].release()

    def _check_chunks(self, tokens: Mapping[Any, torch.Tensor], spec: frozenset) -> None:
        """Request by request, what :meth:`_begin` checks in bulk: raises the first problem by name."""
        requests = self._requests
        for rid in spec:
            if rid not in requests:
                raise SessionError(f"unknown request {rid!r}")
            if rid not in tokens:
                raise SessionError(f"request {rid!r} is marked speculative but has no chunk")
        max_spec = 1 + self.num_spec
        for rid, t in tokens.items():
            req = requests.get(rid)
            if req is None:
                raise SessionError(f"unknown request {rid!r}")
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] < 1:
                raise SessionError(
                    f"request {rid!r}: tokens must be a non-empty 1-D tensor, got {tuple(getattr(t, 'shape', ()))}"
                )
            if t.dtype not in (torch.int64, torch.int32):
                raise SessionError(f"request {rid!r}: tokens must be int32/int64 token ids, got {t.dtype}")
            if t.device.type not in ("cpu", self._device.type):
                raise SessionError(f"request {rid!r}: tokens are on {t.device}; give them on the CPU or {self._device}")
            if req.pending is not None:
                raise SessionError(f"request {rid!r}: call accept() for its speculative chunk before the next step")
            if rid in spec and t.shape[0] > max_spec:
                raise SessionError(
                    f"request {rid!r}: a speculative chunk holds at most 1 + num_spec = {max_spec} tokens, "
                    f"got {t.shape[0]}"
                )

    def _begin(self, tokens: Mapping[Any, torch.Tensor], spec: frozenset, known_lens: list[int] | None) -> SessionStep:
        # Everything per request in bulk (comprehensions, no branch per request); when anything is off,
        # _check_chunks goes request by request and names the problem.
        requests = self._requests
        order = list(tokens)
        toks = list(tokens.values())
        count = len(order)
        packed = None
        try:
            reqs = list(map(requests.__getitem__, order))
            if known_lens is None:
                lens = [n for (n,) in map(_shape, toks)]  # ValueError unless every chunk is 1-D
            else:
                lens = known_lens
            ok = (
                (not count or min(lens) >= 1)
                and set(map(_dtype, toks)) <= _TOKEN_DTYPES
                and (not self._pending_count or set(map(_pending, reqs)) <= {None})
                and spec.issubset(tokens)
            )
            if ok and spec:
                max_spec = 1 + self.num_spec
                ok = all(lens[i] <= max_spec for i, rid in enumerate(order) if rid in spec)
            if ok and count:
                packed = torch.cat(toks)  # tokens on mixed devices raise here
                ok = packed.device.type in ("cpu", self._device.type)
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError):
            ok = False
        if not ok:
            self._check_chunks(tokens, spec)
            reqs = [requests[rid] for rid in order]
            lens = [int(t.shape[0]) for t in toks]
            packed = torch.cat(toks) if count else None
        # the requests' counters and contexts, gathered from the per-slot arrays at once
        arrays = self._arrays
        slots = np.fromiter(map(_slot, reqs), dtype=np.int64, count=count)
        total = sum(lens)
        decode_only = total == count
        prefix_rows: dict[Hashable, int] = {}
        if self.prefix_every or any(map(_wanted, reqs)):
            for i, req in enumerate(reqs):
                if self._positions_in(req, req.length, lens[i]):
                    prefix_rows[order[i]] = i
        if packed is None:
            packed = torch.zeros(0, dtype=torch.int64)
        elif packed.dtype != torch.int64:
            packed = packed.to(torch.int64)
        host = packed if packed.device.type == "cpu" else packed.cpu()
        slot_t = torch.from_numpy(slots)
        if decode_only and count:  # one token per request: one pass reads all (and checks the tokens)
            bad, contexts, has_t, rejected_t, all_have = arrays.read_decode(host, slot_t, self._vocab)
            if bad is not None:
                self._token_outside(order, lens, host, bad)
            if all_have and not spec:
                kinds = (DECODE,) * count
            else:
                kinds = tuple(
                    VERIFY if rid in spec else (DECODE if h else PREFILL) for rid, h in zip(order, has_t.tolist())
                )
        else:
            has_init = arrays.has_state[slots]
            kinds = tuple(
                VERIFY if rid in spec else (DECODE if n == 1 and h else PREFILL)
                for rid, n, h in zip(order, lens, has_init.tolist())
            )
            if (pos := first_out_of_range(host.numpy(), self._vocab)) is not None:
                self._token_outside(order, lens, host, pos)
            has_t = torch.from_numpy(has_init)
            rejected_t = torch.from_numpy(arrays.rejected[slots])
            contexts = arrays.contexts.index_select(0, slot_t)
        if decode_only:
            qsl = self._decode_starts.get(count)
            if qsl is None:  # the kernels only read it: one tensor per batch size, kept
                qsl = self._decode_starts[count] = torch.arange(count + 1, dtype=torch.int64)
        else:
            qsl = torch.tensor([0, *_accumulate(lens)], dtype=torch.int64)
        dev = self._device
        to = _on_host if dev.type == "cpu" else methodcaller("to", dev)
        batch = Batch(
            query_start_loc=to(qsl),
            slot_indices=to(slot_t),
            kinds=tuple(kinds),
            has_initial_state=to(has_t),
            ngram_context=to(contexts),
            num_rejected=to(rejected_t),
            conv_state=self._pools[0],
            num_spec=self.num_spec,
            state_offsets=self._offsets[0] if self._ring else None,
            token_count=total,
            adapter_indices=to(torch.tensor([r.adapter for r in reqs], dtype=torch.int64))
            if self._named_live and count
            else None,
        )
        step = SessionStep(
            request_ids=order,
            lens=lens,
            tokens=to(packed),
            batch=batch,
            num_tokens=total,
            speculative=spec,
            prefix_rows=prefix_rows,
            prev_windows={rid: self._window_of(requests[rid]) for rid in prefix_rows},
            conv_inputs=[None] * len(self.layers),
            done=[False] * len(self.layers),
            slots=slots,
            slot_tensor=slot_t,
        )
        self._open = step
        return step

    def _token_outside(self, order: list, lens: list[int], packed: torch.Tensor, pos: int):
        """Raise for the token at ``pos`` of the packed step, naming its request and offset."""
        r = int(np.searchsorted(np.cumsum(lens), pos, side="right"))
        raise SessionError(
            f"request {order[r]!r}: token {int(packed[pos])} at offset {pos - sum(lens[:r])} is outside "
            f"[0, vocab_size={self._vocab})"
        )

    def run(self, step: SessionStep, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Run layer ``layer`` (index into :attr:`layers`) of an open step: ``hidden [T, HC*H]`` packed
        in the step's request order; returns the new hidden ``[T, HC*H]``. Each layer runs once."""
        if not isinstance(step, SessionStep) or step is not self._open or step.ended:
            raise SessionError("run() needs the open step of this session (from begin(), before end())")
        if (type(layer) is not int and not is_int(layer)) or not 0 <= layer < len(self.layers):
            raise SessionError(f"layer {layer!r} outside [0, {len(self.layers)})")
        if step.done[layer]:
            raise SessionError(f"layer {layer} already ran in this step")
        want = (step.num_tokens, self._channels)
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != want:
            raise SessionError(f"hidden must be [T, HC*H] = {list(want)}, got {tuple(getattr(hidden, 'shape', ()))}")
        if hidden.dtype != self._dtype:
            raise SessionError(f"hidden is {hidden.dtype}; the layers compute in {self._dtype}")
        if not step.request_ids:
            step.done[layer] = True
            return hidden.new_empty(hidden.shape)
        batch = step.batch
        if layer:
            batch = dataclasses.replace(
                batch, conv_state=self._pools[layer], state_offsets=self._offsets[layer] if self._ring else None
            )
        need_c = bool(step.prefix_rows)
        prefetched = None
        if step.lookups is not None:
            prefetched, step.lookups[layer] = step.lookups[layer], None
        # through the module call (hooks run), without the checks: every operand but hidden is the
        # session's own, and hidden was checked above
        result = self.layers[layer](
            hidden, step.tokens, batch, return_conv_input=need_c, prefetched=prefetched, _checked=False
        )
        step.done[layer] = True
        if need_c:
            out, c = result
            step.conv_inputs[layer] = c
            return out
        return result

    def end(self, step: SessionStep) -> None:
        """Finish an open step after every layer ran: contexts, lengths and prefix states advance."""
        if not isinstance(step, SessionStep) or step is not self._open or step.ended:
            raise SessionError("end() needs the open step of this session (from begin())")
        if not all(step.done):
            missing = [k for k, d in enumerate(step.done) if not d]
            raise SessionError(f"layers {missing} have not run in this step")
        with named_range("ple.session.update"):
            self._end(step)
        step.ended = True
        self._open = None

    def _end(self, step: SessionStep) -> None:
        if not step.request_ids:
            return
        arrays, slots = self._arrays, step.slots
        assert slots is not None and step.slot_tensor is not None
        if step.num_tokens == len(step.lens) and not step.speculative and not step.prefix_rows:
            # a step of decode tokens: each context shifts in its token, lengths advance
            host = step.tokens if self._on_cpu else step.tokens.cpu()  # a CPU session's step keeps them there
            arrays.advance_decode(host, step.slot_tensor)
            return
        batch = step.batch
        old_ctx = batch.ngram_context.cpu()
        slot_t = batch.slot_indices.cpu()
        tokens = step.tokens.cpu()
        if step.num_tokens == len(step.lens):  # one token per request: shift in each token
            new_ctx = torch.cat([old_ctx[:, 1:], tokens.view(-1, 1)], dim=1) if self._ctx_len else old_ctx
        else:
            new_ctx = next_ngram_context(tokens, batch.query_start_loc.cpu(), old_ctx)
        self._arrays.contexts.index_copy_(0, slot_t, new_ctx)
        starts = None
        if step.prefix_rows or step.speculative:
            starts = [0, *_accumulate(step.lens)]
        conv = None
        if step.prefix_rows:
            conv = [c.cpu() for c in step.conv_inputs if c is not None]
        requests = self._requests
        if not step.speculative and not step.prefix_rows:  # the common step: lengths advance, nothing else
            arrays.has_state[slots] = True
            arrays.rejected[slots] = 0
            arrays.length[slots] += 1 if step.num_tokens == len(step.lens) else np.array(step.lens, dtype=np.int64)
            return
        for i, rid in enumerate(step.request_ids):
            req = requests[rid]
            n = step.lens[i]
            req.has_state = True
            req.rejected = 0
            if rid in step.speculative or rid in step.prefix_rows:
                assert starts is not None
                a, e = starts[i], starts[i + 1]
                rows = None if conv is None or rid not in step.prefix_rows else torch.stack([c[a:e] for c in conv])
                if rid in step.speculative:
                    # until accept(), the slot holds all n tokens; accept() sets how many are rolled back
                    self._pending_count += 1
                    req.pending = Pending(
                        tokens=tokens[a:e].clone(),
                        prev_context=old_ctx[i].clone(),
                        prev_length=req.length,
                        prev_window=step.prev_windows.get(rid),
                        conv_input=rows,
                    )
                else:
                    assert rows is not None
                    self._states_inside(req, req.length, n, step.prev_windows[rid], old_ctx[i], tokens[a:e], rows)
            req.length += n

    def step(
        self,
        inputs: Mapping[Any, tuple[torch.Tensor, torch.Tensor]],
        speculative: Iterable[Hashable] = (),
    ) -> dict[Hashable, torch.Tensor]:
        """Run one packed batch through a session of one layer.

        Args:
            inputs: ``{request_id: (hidden [n, HC*H], tokens [n])}``; any mix of first chunks,
                continuations and single decode tokens.
            speculative: request ids whose chunk is a speculative verify chunk (``1 .. 1+num_spec``
                tokens); call :meth:`accept` for each before its next step.

        Returns:
            ``{request_id: new hidden [n, HC*H]}``.
        """
        if len(self.layers) != 1:
            raise SessionError(f"this session serves {len(self.layers)} layers: use begin(), run() per layer, end()")
        width = self._channels
        # in bulk (see _begin); request by request only to name a problem
        try:
            pairs = list(inputs.values())
            ok = set(map(type, pairs)) <= {tuple} and set(map(len, pairs)) <= {2}
            if ok:
                hs = list(map(_first, pairs))
                ts = list(map(_second, pairs))
                ok = set(map(type, hs)) <= _TENSOR_TYPES and set(map(type, ts)) <= _TENSOR_TYPES
            if ok:
                hshapes = list(map(_shape, hs))
                tshapes = list(map(_shape, ts))
                if set(tshapes) <= {(1,)} and set(hshapes) <= {(1, width)}:  # decode tokens: two passes
                    lens = [1] * len(ts)
                else:
                    ok = (
                        set(map(len, tshapes)) <= {1}
                        and set(map(len, hshapes)) <= {2}
                        and list(map(_first, hshapes)) == list(map(_first, tshapes))
                        and set(map(_second, hshapes)) <= {width}
                    )
                    lens = list(map(_first, tshapes))
        except (AttributeError, TypeError, IndexError):
            ok = False
        if not ok:
            hs, ts = self._check_pairs(inputs)
            lens = [int(t.shape[0]) for t in ts]
        tokens = dict(zip(inputs.keys(), ts))
        step = self._begin_step(tokens, speculative, lens)
        try:
            if not step.request_ids:
                self.run(step, 0, torch.zeros(0, width, dtype=self._dtype, device=self._device))
                self.end(step)
                return {}
            out = self.run(step, 0, packed_rows(hs, step.num_tokens, width))
        except BaseException:
            if not step.done[0]:
                self._open = None  # nothing changed: the step is dropped
            raise
        self.end(step)
        return step.split(out)

    def _check_pairs(self, inputs: Mapping[Any, tuple[torch.Tensor, torch.Tensor]]):
        """Request by request, what :meth:`step` checks in bulk: raises the first problem by name;
        returns ``(hidden list, tokens list)``."""
        width = self._channels
        hs, ts = [], []
        for rid, pair in inputs.items():
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise SessionError(f"request {rid!r}: expected (hidden, tokens), got {type(pair).__name__}")
            hidden, t = pair
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise SessionError(
                    f"request {rid!r}: tokens must be a 1-D tensor [n], got {tuple(getattr(t, 'shape', ()))}"
                )
            n = t.shape[0]
            if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != (n, width):
                raise SessionError(
                    f"request {rid!r}: hidden must be [{n}, {width}], got {tuple(getattr(hidden, 'shape', ()))}"
                )
            hs.append(hidden)
            ts.append(t)
        return hs, ts

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
        if not is_int(kept) or not 1 <= kept <= n:
            raise SessionError(f"request {request_id!r}: kept={kept!r} outside 1..{n} (the chunk's length)")
        if p.prev_window is not None and p.conv_input is not None:
            self._states_inside(req, p.prev_length, kept, p.prev_window, p.prev_context, p.tokens, p.conv_input)
        ctx = next_ngram_context(p.tokens[:kept], torch.tensor([0, kept]), p.prev_context.view(1, -1))[0]
        self._arrays.contexts[req.slot] = ctx
        req.length = p.prev_length + kept
        req.rejected = n - kept
        req.pending = None
        self._pending_count -= 1


def _on_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself: the step's tensors were made on the CPU, where a CPU session keeps them."""
    return t


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocator's refusal (host or device), not another failure."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "alloc" in str(e)


def _request_set(name: str, ids) -> frozenset:
    """``ids`` (a collection of request ids) as a set; a string, a single id or unhashable ids are
    refused (a string would read as its characters)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise SessionError(f"{name} must be a collection of request ids (e.g. {{'a'}}), got {ids!r}")
    try:
        return frozenset(ids)
    except TypeError:
        raise SessionError(f"{name} holds a request id that is not hashable: {ids!r}") from None


def _accumulate(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out
