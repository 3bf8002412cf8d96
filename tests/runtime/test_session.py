"""Streaming exactness: every schedule a serving engine may produce gives the one-shot results."""

import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ple.layer import PLELayer
from ple.runtime import PrefixState, Session, SessionError
from tests.conftest import hf_config, hf_ple_layer


@functools.lru_cache(maxsize=8)
def _layer(variant: int, index: int = 0) -> PLELayer:
    geo = [
        dict(hidden_size=10, hc_count=2, ngram_size=3, heads_per_ngram=2, ple_embed_dim=12, ple_conv_kernel_size=3),
        dict(hidden_size=14, hc_count=3, ngram_size=2, heads_per_ngram=3, ple_embed_dim=9, ple_conv_kernel_size=4),
        dict(hidden_size=6, hc_count=4, ngram_size=4, heads_per_ngram=1, ple_embed_dim=6, ple_conv_kernel_size=2),
    ][variant]
    hf = hf_config(vocab_size=40, eos_token_id=3, ple_layer_ids=[1, 2], **geo)
    return PLELayer.from_transformers(hf_ple_layer(hf, index, seed=variant + 10 * index))


def _oneshot(layer: PLELayer, hidden: torch.Tensor, tokens: torch.Tensor):
    """(new hidden [S, C], conv inputs [S, C]) of one fresh request over its whole history."""
    with torch.no_grad():
        out, c = layer.forward_padded(hidden[None], tokens[None], return_conv_input=True)
    return hidden + out[0], c[0]


def _expected_window(layer, c_hist: torch.Tensor, pos: int) -> torch.Tensor:
    w = layer.config.conv_window
    padded = torch.cat([torch.zeros(w, c_hist.shape[1]), c_hist[:pos]])
    return padded[-w:].t()


def _expected_checkpoint(layer, c_hist: torch.Tensor, tokens: torch.Tensor, pos: int) -> PrefixState:
    cfg = layer.config
    ctx = torch.cat([torch.full((cfg.ngram_size - 1,), cfg.eos_token_id), tokens[:pos]])
    return PrefixState(_expected_window(layer, c_hist, pos), ctx[len(ctx) - (cfg.ngram_size - 1) :], pos)


def _assert_checkpoint(got: PrefixState, want: PrefixState, what: str):
    assert got.length == want.length, what
    assert torch.equal(got.ngram_context, want.ngram_context), what
    torch.testing.assert_close(got.conv_window, want.conv_window, rtol=1e-5, atol=1e-6, msg=what)


class _Draws:
    """Every decision of a schedule drawn from a hypothesis strategy, so that a failing schedule
    shrinks: fewer rounds and requests, shorter chunks, plain tokens, nothing optional happening."""

    def __init__(self, data):
        self.data = data

    def int(self, lo: int, hi: int, label: str) -> int:
        return self.data.draw(st.integers(lo, hi), label=label)

    def pick(self, options, label: str):
        return self.data.draw(st.sampled_from(options), label=label)

    def chance(self, percent: int, label: str) -> bool:
        """True about ``percent`` % of the time; shrinks to False (the event does not happen)."""
        return self.data.draw(st.integers(0, 99).map(lambda x: x >= 100 - percent), label=label)

    def tokens(self, n: int, vocab: int, eos: int) -> list[int]:
        """``n`` token ids, about one in six EOS; shrinks to zeros."""
        token = st.integers(-8, vocab - 1).map(lambda t: eos if t < 0 else t)
        return self.data.draw(st.lists(token, min_size=n, max_size=n), label="tokens")


class _Sim:
    """Drives a Session through a drawn schedule and records what every kept token produced.

    With two layers the session runs as a model runs it (begin, run per layer, end), each layer on its
    own hidden rows; with one, through step(). Prefix states are kept at multiples of prefix_every and
    at positions named with keep_prefix_at; the pool grows now and then."""

    def __init__(self, draws: _Draws, variant: int, layers: int, num_spec: int, every, max_requests: int):
        self.draws = draws
        self.layers = [_layer(variant, k) for k in range(layers)]
        self.layer = self.layers[0]
        cfg = self.layer.config
        self.cfg = cfg
        self.num_spec = num_spec
        self.every = every
        group = self.layers[0] if len(self.layers) == 1 else self.layers
        self.session = Session(group, max_requests=max_requests, num_spec=self.num_spec, prefix_every=self.every)
        self.live: dict[int, dict] = {}
        self.done: list[dict] = []
        self.saved: list[tuple[PrefixState, dict]] = []  # checkpoints to resume from, with the history behind them
        self.next_id = 0

    def _row(self):
        return torch.randn(len(self.layers), self.cfg.hc_hidden_size)

    def add(self):
        d = self.draws
        if len(self.live) >= self.session.max_requests:
            if d.chance(30, "grow the pool"):
                self.session.grow(self.session.max_requests + d.int(1, 2, "more slots"))
            else:
                return
        rid = self.next_id
        self.next_id += 1
        rec = {"tokens": [], "hidden": [], "out": [], "target": d.int(1, 30, "request length"), "named": set()}
        if self.saved and d.chance(40, "resume from a prefix state"):
            ck, hist = self.saved[d.int(0, len(self.saved) - 1, "which prefix state")]
            self.session.add(rid, from_state=ck)
            n = ck.length
            rec.update(tokens=list(hist["tokens"][:n]), hidden=list(hist["hidden"][:n]), out=[None] * n)
            rec["target"] = n + d.int(1, 20, "tokens after resuming")
        else:
            self.session.add(rid)
        if d.chance(50, "name prefix positions"):  # an engine's block boundaries: any positions
            start = len(rec["tokens"])
            offsets = self.draws.data.draw(st.lists(st.integers(1, 25), min_size=1, max_size=3), label="named offsets")
            named = {start + k for k in offsets}
            self.session.keep_prefix_at(rid, sorted(named))
            rec["named"] = named
        self.live[rid] = rec

    def step(self):
        d = self.draws
        chosen = [r for r in self.live if not d.chance(20, f"request {r} sits this step out")]
        modes = ["decode", "prefill", "spec"] if self.num_spec else ["decode", "prefill"]
        tokens, spec, plans = {}, set(), {}
        for rid in chosen:
            mode = d.pick(modes, f"request {rid}: step kind")
            n = {"prefill": lambda: d.int(1, 9, "prefill chunk"), "decode": lambda: 1}.get(
                mode, lambda: d.int(1, 1 + self.num_spec, "draft tokens")
            )()
            toks = d.tokens(n, self.cfg.vocab_size, self.cfg.eos_token_id)
            hid = [self._row() for _ in range(n)]
            kept = d.int(1, n, "draft tokens kept") if mode == "spec" else n
            tokens[rid] = torch.tensor(toks)
            plans[rid] = (toks, hid, kept)
            if mode == "spec":
                spec.add(rid)
        if len(self.layers) == 1:
            out = self.session.step({r: (torch.stack(plans[r][1])[:, 0], tokens[r]) for r in tokens}, speculative=spec)
            outs = {r: o[:, None] for r, o in out.items()}
        else:
            st_ = self.session.begin(tokens, speculative=spec)
            per_layer = []
            for k in range(len(self.layers)):
                hidden = torch.cat([torch.stack(plans[r][1])[:, k] for r in st_.request_ids]) if plans else None
                if hidden is None:
                    hidden = torch.zeros(0, self.cfg.hc_hidden_size)
                per_layer.append(st_.split(self.session.run(st_, k, hidden)))
            self.session.end(st_)
            outs = {r: torch.stack([per_layer[k][r] for k in range(len(self.layers))], dim=1) for r in tokens}
        for rid, (toks, hid, kept) in plans.items():
            rec = self.live[rid]
            if rid in spec:
                self.session.accept(rid, kept)
            rec["tokens"] += toks[:kept]
            rec["hidden"] += hid[:kept]
            rec["out"] += list(outs[rid][:kept])

    def maybe_finish_or_preempt(self):
        d = self.draws
        for rid in list(self.live):
            rec = self.live[rid]
            if len(rec["tokens"]) >= rec["target"] or d.chance(5, f"request {rid} ends early"):
                self.check_request(rid)
                self.session.finish(rid)
                self.done.append(self.live.pop(rid))
            elif d.chance(8, f"request {rid} is preempted"):  # checkpoint, finish, resume later under a new id
                ck = self.session.prefix_state(rid)
                self.saved.append((ck, {"tokens": list(rec["tokens"]), "hidden": list(rec["hidden"])}))
                self.check_request(rid)
                self.session.finish(rid)
                self.live.pop(rid)

    def _expected_state(self, c_hists, toks, pos) -> PrefixState:
        want = _expected_checkpoint(self.layer, c_hists[0], toks, pos)
        if len(self.layers) == 1:
            return want
        windows = torch.stack([_expected_window(self.layer, c, pos) for c in c_hists])
        return PrefixState(windows, want.ngram_context, pos)

    def check_request(self, rid):
        rec = self.live[rid]
        if not rec["tokens"]:
            return
        toks = torch.tensor(rec["tokens"])
        hidden = torch.stack(rec["hidden"])  # [S, layers, C]
        c_hists = []
        for k, layer in enumerate(self.layers):
            want, c_hist = _oneshot(layer, hidden[:, k], toks)
            c_hists.append(c_hist)
            for p, row in enumerate(rec["out"]):
                if row is not None:
                    torch.testing.assert_close(row[k], want[p], rtol=1e-5, atol=1e-5, msg=f"request {rid} position {p}")
        final = self.session.prefix_state(rid)
        _assert_checkpoint(final, self._expected_state(c_hists, toks, len(toks)), f"final state of {rid}")
        kept = self.session.prefix_states(rid)
        for pos, ck in kept.items():
            assert (self.every and pos % self.every == 0) or pos in rec["named"], pos
            _assert_checkpoint(ck, self._expected_state(c_hists, toks, pos), f"checkpoint {pos} of {rid}")
            if self.draws.chance(30, f"keep prefix state {pos} of request {rid} to resume from"):
                self.saved.append((ck, {"tokens": list(rec["tokens"]), "hidden": list(rec["hidden"])}))
        # every wanted position reached after the request's own start is there
        start = next((i for i, o in enumerate(rec["out"]) if o is not None), len(rec["out"]))
        reached = {p for p in rec["named"] if start < p <= len(toks)}
        if self.every:
            reached |= {p for p in range(self.every, len(toks) + 1, self.every) if p > start}
        assert reached <= set(kept), (reached, sorted(kept))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    variant=st.integers(0, 2),
    layers=st.integers(1, 2),
    num_spec=st.integers(0, 3),
    every=st.sampled_from([None, 1, 2, 3, 5, 8]),
    max_requests=st.integers(1, 4),
    rounds=st.integers(1, 25),
    data=st.data(),
)
def test_random_schedules_match_oneshot(variant, layers, num_spec, every, max_requests, rounds, data):
    """Any schedule (requests arriving, prefill chunks, decode and speculative steps with rejections,
    preemption and resumption from prefix states, pool growth) gives every kept token the one-shot
    output, and every prefix state the one-shot state. Hidden rows are random (they steer nothing)."""
    torch.manual_seed(variant * 1000 + rounds)
    draws = _Draws(data)
    sim = _Sim(draws, variant, layers, num_spec, every, max_requests)
    for r in range(rounds):
        if not sim.live or draws.chance(50, f"round {r}: a request arrives"):
            sim.add()
        if sim.live:
            sim.step()
        sim.maybe_finish_or_preempt()
    for rid in list(sim.live):
        sim.check_request(rid)


def test_session_errors_leave_others_unaffected():
    layer = _layer(0)
    cfg = layer.config
    s = Session(layer, max_requests=2, num_spec=2)
    s.add("a")
    s.add("b")
    with pytest.raises(SessionError, match="all 2 slots are in use"):
        s.add("c")
    with pytest.raises(SessionError, match="already active"):
        s.add("a")
    h = torch.randn(4, cfg.hc_hidden_size)
    t = torch.tensor([5, 6, 7, 8])
    with pytest.raises(SessionError, match="unknown request 'zz'"):
        s.step({"a": (h, t), "zz": (h, t)})
    with pytest.raises(SessionError, match=r"at most 1 \+ num_spec = 3 tokens, got 4"):
        s.step({"a": (h, t)}, speculative={"a"})
    with pytest.raises(SessionError, match=r"hidden must be \[4, 20\]"):
        s.step({"a": (h[:, :3], t)})
    before = s.conv_state.clone()
    assert torch.equal(before, torch.zeros_like(before))  # nothing ran
    out = s.step({"a": (h, t), "b": (h[:2], t[:2])}, speculative={"b"})
    with pytest.raises(SessionError, match="no speculative chunk to accept"):
        s.accept("a", 1)
    with pytest.raises(SessionError, match=r"kept=3 outside 1..2"):
        s.accept("b", 3)
    with pytest.raises(SessionError, match="call accept"):
        s.step({"b": (h[:1], t[:1])})
    with pytest.raises(SessionError, match="awaiting accept"):
        s.prefix_state("b")
    s.accept("b", 1)
    want, _ = _oneshot(layer, h, t)
    torch.testing.assert_close(out["a"], want, rtol=1e-5, atol=1e-5)
    s.finish("b")
    with pytest.raises(SessionError, match="unknown request 'b'"):
        s.finish("b")
    s.add("c")  # the slot is reused
    assert sorted(s.request_ids) == ["a", "c"]


def test_pending_chunks_are_refused_until_accepted_or_finished():
    """A request with a speculative chunk awaiting accept() is refused in a step, whichever other
    requests had one and were finished; once none is pending, steps of the others run and match the
    one-shot outputs, and a slot freed while its chunk was pending serves a new request from scratch."""
    layer = _layer(0)
    cfg = layer.config
    s = Session(layer, max_requests=3, num_spec=2)
    g = torch.Generator().manual_seed(5)
    hist = {
        r: (torch.randn(6, cfg.hc_hidden_size, generator=g), torch.randint(0, cfg.vocab_size, (6,), generator=g))
        for r in "abc"
    }
    for r in "abc":
        s.add(r)
    s.step({r: (hist[r][0][:2], hist[r][1][:2]) for r in "abc"}, speculative={"b", "c"})
    s.finish("c")  # finished while pending
    with pytest.raises(SessionError, match="request 'b': call accept"):
        s.step({"a": (hist["a"][0][2:3], hist["a"][1][2:3]), "b": (hist["b"][0][2:3], hist["b"][1][2:3])})
    s.accept("b", 2)
    outs = s.step({r: (hist[r][0][2:4], hist[r][1][2:4]) for r in "ab"})
    s.add("d")  # into c's slot
    out_d = s.step({"d": (hist["c"][0], hist["c"][1])})["d"]
    for r in "ab":
        want, _ = _oneshot(layer, hist[r][0][:4], hist[r][1][:4])
        torch.testing.assert_close(outs[r], want[2:4], rtol=1e-5, atol=1e-5)
    want, _ = _oneshot(layer, *hist["c"])
    torch.testing.assert_close(out_d, want, rtol=1e-5, atol=1e-5)


def _schedule(rng, cfg, ids, steps, num_spec):
    """A fixed random schedule: per step {request: (hidden, tokens)}, speculative ids, kept counts."""
    out = []
    for _ in range(steps):
        inputs, spec, kept = {}, set(), {}
        for rid in ids:
            mode = rng.choice(["prefill", "decode", "spec"])
            n = {"prefill": rng.randint(1, 12), "decode": 1, "spec": rng.randint(1, 1 + num_spec)}[mode]
            inputs[rid] = (torch.randn(n, cfg.hc_hidden_size), torch.randint(0, cfg.vocab_size, (n,)))
            if mode == "spec":
                spec.add(rid)
                kept[rid] = rng.randint(1, n)
        out.append((inputs, spec, kept))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_pools_equal_engine_pools_bitwise(dtype):
    """The same schedule through a session keeping token-major rings and one keeping the engine layout:
    identical outputs and prefix states, and the rings convert to exactly the engine pool."""
    layer = _layer(1).to(dtype)
    try:
        cfg = layer.config
        rng = random.Random(3)
        sessions = [Session(layer, 4, num_spec=2, prefix_every=3, state_layout=x) for x in ("ring", "engine")]
        assert sessions[0]._ring and not sessions[1]._ring
        for s in sessions:
            for rid in "abc":
                s.add(rid)
        for inputs, spec, kept in _schedule(rng, cfg, "abc", 12, 2):
            inputs = {r: (h.to(dtype), t) for r, (h, t) in inputs.items()}
            outs = [s.step(inputs, speculative=spec) for s in sessions]
            for r in inputs:
                assert torch.equal(outs[0][r], outs[1][r])
            for s in sessions:
                for r, k in kept.items():
                    s.accept(r, k)
            assert torch.equal(sessions[0].conv_state, sessions[1].conv_state)
            for r in "abc":
                a, b = (s.prefix_states(r) for s in sessions)
                assert a.keys() == b.keys()
                for pos in a:
                    assert torch.equal(a[pos].conv_window, b[pos].conv_window)
                    assert torch.equal(a[pos].ngram_context, b[pos].ngram_context)
    finally:
        layer.to(torch.float32)


def test_grow_keeps_every_request_state():
    layer = _layer(0)
    cfg = layer.config
    rng = random.Random(5)
    grown, fixed = Session(layer, 2, prefix_every=4), Session(layer, 5, prefix_every=4)
    for s in (grown, fixed):
        s.add("a")
        s.add("b")
    sched = _schedule(rng, cfg, "ab", 6, 0)
    for i, (inputs, _, _) in enumerate(sched):
        if i == 3:
            with pytest.raises(SessionError, match="all 2 slots"):
                grown.add("c")
            grown.grow(5)
            assert grown.max_requests == 5
            with pytest.raises(SessionError, match=r"max_requests must be an int >= 5"):
                grown.grow(3)
            for s in (grown, fixed):
                s.add("c")
        if "c" in grown.request_ids:
            inputs = dict(inputs, c=(torch.randn(2, cfg.hc_hidden_size), torch.tensor([5, 6])))
        got, want = grown.step(inputs), fixed.step(inputs)
        for r in inputs:
            assert torch.equal(got[r], want[r])
    for r in "abc":
        assert torch.equal(grown.prefix_state(r).conv_window, fixed.prefix_state(r).conv_window)


def test_prefix_states_at_named_positions():
    layer = _layer(0)
    cfg = layer.config
    s = Session(layer, 2)
    s.add("a")
    s.keep_prefix_at("a", [3, 7, 8, 20])
    h = torch.randn(12, cfg.hc_hidden_size)
    t = torch.randint(0, cfg.vocab_size, (12,))
    s.step({"a": (h[:5], t[:5])})
    assert sorted(s.prefix_states("a")) == [3]
    s.keep_prefix_at("a", [5])  # the current length: taken now
    with pytest.raises(SessionError, match=r"prefix position 4 must be an int >= its length 5"):
        s.keep_prefix_at("a", [4])
    s.step({"a": (h[5:12], t[5:12])})
    assert sorted(s.prefix_states("a")) == [3, 5, 7, 8]
    _, c = _oneshot(layer, h, t)
    for pos, state in s.prefix_states("a").items():
        _assert_checkpoint(state, _expected_checkpoint(layer, c, t, pos), f"position {pos}")


def test_one_session_for_several_layers():
    layers = [_layer(2, 0), _layer(2, 1)]
    cfg = layers[0].config
    s = Session(layers, 3)
    s.add("x")
    s.add("y")
    toks = {"x": torch.tensor([1, 2, 3]), "y": torch.tensor([4])}
    with pytest.raises(SessionError, match="serves 2 layers"):
        s.step({"x": (torch.randn(3, cfg.hc_hidden_size), toks["x"])})
    step = s.begin(toks)
    with pytest.raises(SessionError, match="during a step"):
        s.add("z")
    with pytest.raises(SessionError, match=r"hidden must be \[T, HC\*H\] = \[4, 24\]"):
        s.run(step, 0, torch.randn(3, cfg.hc_hidden_size))
    hidden = [torch.randn(4, cfg.hc_hidden_size) for _ in layers]
    out1 = s.run(step, 1, hidden[1])  # layers in any order, each once
    with pytest.raises(SessionError, match="layers \\[0\\] have not run"):
        s.end(step)
    out0 = s.run(step, 0, hidden[0])
    with pytest.raises(SessionError, match="layer 0 already ran"):
        s.run(step, 0, hidden[0])
    s.end(step)
    for k, out in enumerate((out0, out1)):
        want_x, _ = _oneshot(layers[k], hidden[k][:3], toks["x"])
        torch.testing.assert_close(out[:3], want_x, rtol=1e-5, atol=1e-5)
    state = s.prefix_state("x")
    assert state.conv_window.shape == (2, cfg.hc_hidden_size, cfg.conv_window)
    s2 = Session(layers, 1)
    s2.add("x2", from_state=state)
    assert torch.equal(s2.prefix_state("x2").conv_window, state.conv_window)
    with pytest.raises(SessionError, match=r"is torch.float32 \(2, 24, 4\); this session needs .* \(24, 4\)"):
        Session(layers[0], 1).add("q", from_state=state)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda L: Session(L, 2.0), "max_requests must be an int >= 1, got 2.0"),
        (lambda L: Session(L, True), "max_requests must be an int >= 1, got True"),
        (lambda L: Session(L, 2, num_spec=1.5), "num_spec must be an int >= 0, got 1.5"),
        (lambda L: Session(L, 2, prefix_every=2.0), "prefix_every must be an int >= 1, got 2.0"),
    ],
)
def test_session_arguments_are_not_converted(make, match):
    with pytest.raises(SessionError, match=match):
        make(_layer(0))


def test_session_refuses_converted_inputs():
    layer = _layer(0)
    cfg = layer.config
    s = Session(layer, 2, num_spec=1)
    s.add("a")
    h = torch.randn(2, cfg.hc_hidden_size)
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([True, False])):
        with pytest.raises(SessionError, match=f"request 'a': tokens must be int32/int64 token ids, got {bad.dtype}"):
            s.step({"a": (h, bad)})
    with pytest.raises(SessionError, match=r"request 'a': tokens must be a 1-D tensor \[n\], got \(1, 2\)"):
        s.step({"a": (h, torch.tensor([[1, 2]]))})
    with pytest.raises(SessionError, match=r"request 'a': hidden must be \[2, "):
        s.step({"a": (h[:1], torch.tensor([1, 2]))})
    with pytest.raises(SessionError, match=r"request 'a': token 40 at offset 1 is outside \[0, vocab_size=40\)"):
        s.step({"a": (h, torch.tensor([1, 40]))})
    s.step({"a": (h, torch.tensor([1, 2]))}, speculative={"a"})
    for kept in (1.0, True):
        with pytest.raises(SessionError, match=f"kept={kept!r} outside"):
            s.accept("a", kept)
    s.accept("a", 1)
    good = s.prefix_state("a")
    bad_states = [
        (PrefixState(good.conv_window, good.ngram_context, -1), "length -1 must be a non-negative int"),
        (PrefixState(good.conv_window, good.ngram_context, True), "length True must be a non-negative int"),
        (PrefixState(good.conv_window * float("nan"), good.ngram_context, 3), "NaN or infinite"),
        (PrefixState(good.conv_window, good.ngram_context.float(), 3), "must hold integer tokens"),
        (PrefixState(good.conv_window, good.ngram_context + 100, 3), "tokens outside"),
    ]
    for state, match in bad_states:
        with pytest.raises(SessionError, match=match):
            s.add("b", from_state=state)
    assert s.request_ids == ["a"]
    assert torch.equal(s.prefix_state("a").conv_window, good.conv_window)  # nothing changed


def test_requests_that_cannot_be_held_and_odd_arguments_are_refused_by_name():
    """State that cannot be allocated, ``speculative=`` that is not a collection of ids (a string
    would read as its characters), and tokens on another device end in a SessionError; nothing
    changes."""
    layer = _layer(0)
    cfg = layer.config
    with pytest.raises(SessionError, match=r"100,000,000,000 slots of conv state .* cannot be allocated"):
        Session(layer, 10**11)
    s = Session(layer, 2, num_spec=1)
    with pytest.raises(SessionError, match=r"99,999,999,998 slots of conv state .* cannot be allocated"):
        s.grow(10**11)
    assert s.max_requests == 2 and s.conv_state.shape[0] == 2
    s = Session(layer, 3, num_spec=1)
    for rid in ("a", "b", "ab"):
        s.add(rid)
    h = torch.randn(1, cfg.hc_hidden_size)
    t = torch.tensor([3])
    with pytest.raises(
        SessionError, match=r"speculative must be a collection of request ids \(e.g. \{'a'\}\), got 'ab'"
    ):
        s.step({"ab": (h, t)}, speculative="ab")
    with pytest.raises(SessionError, match="speculative must be a collection of request ids .*, got 5"):
        s.step({"ab": (h, t)}, speculative=5)
    with pytest.raises(SessionError, match="speculative holds a request id that is not hashable"):
        s.step({"ab": (h, t)}, speculative=[["a"]])
    with pytest.raises(SessionError, match="request 'ab': tokens are on meta; give them on the CPU or cpu"):
        s.step({"ab": (h, t.to("meta"))})
    s.step({"ab": (h, t)}, speculative={"ab"})  # the set form works, and nothing else was marked
    s.accept("ab", 1)
    s.step({"a": (h, t), "b": (h, t)})


def test_run_and_end_without_an_open_step_are_refused():
    layer = _layer(0)
    s = Session(layer, 2)
    s.add("a")
    h = torch.randn(2, layer.config.hc_hidden_size)
    for _ in range(2):  # before any step, then after one ended
        with pytest.raises(SessionError, match="run\\(\\) needs the open step"):
            s.run(None, 0, h)
        with pytest.raises(SessionError, match="end\\(\\) needs the open step"):
            s.end(None)
        s.step({"a": (h, torch.tensor([4, 5]))})
    assert s.prefix_state("a").length == 4


def test_positions_that_are_not_a_collection_are_refused():
    layer = _layer(0)
    s = Session(layer, 2)
    s.add("a")
    for bad in (3, "37"):
        with pytest.raises(SessionError, match=f"positions must be a collection of ints \\(e.g. \\[{bad!r}\\]\\)"):
            s.keep_prefix_at("a", bad)
    assert s.prefix_states("a") == {}


def test_calls_between_run_and_end_are_refused_and_change_nothing():
    """Between run() and end() a request's state is half updated: its prefix state and positions at or
    inside its open chunk are refused, positions after the chunk are taken, other requests answer as
    usual. The session then goes on exactly as one that never saw these calls."""
    layer = _layer(0)
    cfg = layer.config
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 9, cfg.hc_hidden_size, generator=g)
    t = torch.randint(0, cfg.vocab_size, (3, 9), generator=g)
    chunks = [(0, 4), (4, 7), (7, 8), (8, 9)]
    paused, plain = Session(layer, 3), Session(layer, 3)
    for s in (paused, plain):
        for rid in ("a", "b"):
            s.add(rid)
    plain.keep_prefix_at("a", [9])
    outs: dict = {"paused": [], "plain": []}
    for k, (a, e) in enumerate(chunks):
        inputs = {"a": (h[0, a:e], t[0, a:e])}
        if k != 1:
            inputs["b"] = (h[1, a:e], t[1, a:e])
        outs["plain"].append(plain.step(inputs))
        if k != 1:
            outs["paused"].append(paused.step(inputs))
            continue
        step = paused.begin({rid: x[1] for rid, x in inputs.items()})
        before_b = paused.prefix_state("b")  # not in this step: its state is whole
        out = paused.run(step, 0, h[0, a:e])
        with pytest.raises(SessionError, match="'a' is in the open step: call end\\(\\) before prefix_state"):
            paused.prefix_state("a")
        for pos in (a, a + 1, e):  # the current length, inside the chunk, its end
            with pytest.raises(SessionError, match=f"prefix position {pos} is inside its chunk of the open step"):
                paused.keep_prefix_at("a", [pos])
        paused.keep_prefix_at("a", [9])  # after the chunk: kept when reached
        paused.end(step)
        outs["paused"].append(step.split(out))
        after_b = paused.prefix_state("b")
        assert torch.equal(before_b.conv_window, after_b.conv_window) and before_b.length == after_b.length
    for x, y in zip(outs["paused"], outs["plain"]):
        assert x.keys() == y.keys()
        for rid in x:
            assert torch.equal(x[rid], y[rid])
    for rid in ("a", "b"):
        got, want = paused.prefix_state(rid), plain.prefix_state(rid)
        assert got.length == want.length == {"a": 9, "b": 6}[rid]
        assert torch.equal(got.conv_window, want.conv_window) and torch.equal(got.ngram_context, want.ngram_context)
    kept_p, kept_q = paused.prefix_states("a"), plain.prefix_states("a")
    assert sorted(kept_p) == sorted(kept_q) == [9]
    assert torch.equal(kept_p[9].conv_window, kept_q[9].conv_window)


def test_rows_cut_from_one_tensor_give_the_outputs_of_separate_rows():
    """Hidden rows given as views of one packed tensor (in order: read in place; out of order, with gaps
    or of another dtype: copied) give exactly the outputs of separate tensors."""
    layer = _layer(1)
    cfg = layer.config
    g = torch.Generator().manual_seed(9)
    lens = [3, 1, 2, 1]
    packed = torch.randn(sum(lens) * 2, cfg.hc_hidden_size, generator=g)
    t = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g)
    starts = [0, 3, 4, 6, 7]
    cuts = {
        "in order": [packed[a:e] for a, e in zip(starts, starts[1:])],
        "reversed": [packed[a:e] for a, e in zip(starts, starts[1:])][::-1],
        "with gaps": [packed[2 * a : 2 * a + (e - a)] for a, e in zip(starts, starts[1:])],
    }
    for name, rows in cuts.items():
        ids = list(range(len(lens)))
        if name == "reversed":
            ids = ids[::-1]
        toks = {rid: t[starts[rid] : starts[rid + 1]] for rid in range(len(lens))}
        got_s, want_s = Session(layer, 4), Session(layer, 4)
        for s in (got_s, want_s):
            for rid in range(len(lens)):
                s.add(rid)
        got = got_s.step({rid: (h, toks[rid]) for rid, h in zip(ids, rows)})
        want = want_s.step({rid: (h.clone(), toks[rid]) for rid, h in zip(ids, rows)})
        for rid in range(len(lens)):
            assert torch.equal(got[rid], want[rid]), (name, rid)
        assert got_s.prefix_state(0).length == lens[0]


def test_session_steps_follow_weights_changed_in_place_and_refuse_gradients():
    # the session's engine call skips the operators' checks (it built every operand) but still picks
    # up weights changed in place, and still refuses a hidden that wants gradients
    from ple.errors import UsageError

    changed, later = _layer.__wrapped__(0), _layer.__wrapped__(0)  # two fresh copies of one layer
    with torch.no_grad():
        changed.norm_key.mul_(1.5)
    width = changed.config.hc_hidden_size
    g = torch.Generator().manual_seed(3)
    steps = [
        {r: (torch.randn(n, width, generator=g), torch.randint(0, 40, (n,), generator=g)) for r, n in pairs}
        for pairs in (((0, 3), (1, 1)), ((2, 4), (3, 2)))
    ]
    a, b = Session(changed, 4), Session(later, 4)
    for s in (a, b):
        s.add(0)
        s.add(1)
    first_a, first_b = a.step(steps[0]), b.step(steps[0])
    assert not torch.equal(first_a[0], first_b[0])  # the change matters
    with torch.no_grad():
        later.norm_key.mul_(1.5)
    for s in (a, b):  # fresh requests: the same state in both sessions
        s.add(2)
        s.add(3)
    second_a, second_b = a.step(steps[1]), b.step(steps[1])
    for r in (2, 3):
        assert torch.equal(second_a[r], second_b[r]), r
    wants_grad = {0: (torch.randn(1, width).requires_grad_(), torch.tensor([5]))}
    with torch.enable_grad(), pytest.raises(UsageError, match="inference-only"):
        a.step(wants_grad)
    assert a.request_ids == [0, 1, 2, 3]


def test_session_steps_go_through_the_module_call():
    # forward hooks and a forward replaced on the instance see every step, as with a plain engine call
    layer = _layer.__wrapped__(1)
    width = layer.config.hc_hidden_size
    seen = []
    handle = layer.register_forward_hook(
        lambda mod, args, kwargs, out: seen.append(kwargs["_checked"]), with_kwargs=True
    )
    s = Session(layer, 2)
    s.add("a")
    s.step({"a": (torch.randn(2, width), torch.tensor([1, 2]))})
    handle.remove()
    assert seen == [False]  # the session's call skips the checks of operands it built itself
    layer.forward = lambda hidden, *args, **kwargs: hidden * 0  # type: ignore[method-assign]
    try:
        out = s.step({"a": (torch.ones(1, width), torch.tensor([3]))})
    finally:
        del layer.forward
    assert torch.equal(out["a"], torch.zeros(1, width))
