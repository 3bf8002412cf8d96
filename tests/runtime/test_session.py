"""Streaming exactness: every schedule a serving engine may produce gives the one-shot results."""

import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ple.layer import PLELayer
from ple.runtime import PrefixState, Session, SessionError

from ..conftest import hf_config, hf_ple_layer


@functools.lru_cache(maxsize=4)
def _layer(variant: int) -> PLELayer:
    geo = [
        dict(hidden_size=10, hc_count=2, ngram_size=3, heads_per_ngram=2, ple_embed_dim=12, ple_conv_kernel_size=3),
        dict(hidden_size=14, hc_count=3, ngram_size=2, heads_per_ngram=3, ple_embed_dim=9, ple_conv_kernel_size=4),
        dict(hidden_size=6, hc_count=4, ngram_size=4, heads_per_ngram=1, ple_embed_dim=6, ple_conv_kernel_size=2),
    ][variant]
    hf = hf_config(vocab_size=40, eos_token_id=3, **geo)
    return PLELayer.from_transformers(hf_ple_layer(hf, 0, seed=variant))


def _oneshot(layer: PLELayer, hidden: torch.Tensor, tokens: torch.Tensor):
    """(new hidden [S, C], conv inputs [S, C]) of one fresh request over its whole history."""
    with torch.no_grad():
        out, c = layer.forward_padded(hidden[None], tokens[None], return_conv_input=True)
    return hidden + out[0], c[0]


def _expected_checkpoint(layer, c_hist: torch.Tensor, tokens: torch.Tensor, pos: int) -> PrefixState:
    cfg = layer.config
    w = cfg.conv_window
    padded = torch.cat([torch.zeros(w, c_hist.shape[1]), c_hist[:pos]])
    ctx = torch.cat([torch.full((cfg.ngram_size - 1,), cfg.eos_token_id), tokens[:pos]])
    return PrefixState(padded[-w:].t(), ctx[len(ctx) - (cfg.ngram_size - 1) :], pos)


def _assert_checkpoint(got: PrefixState, want: PrefixState, what: str):
    assert got.length == want.length, what
    assert torch.equal(got.ngram_context, want.ngram_context), what
    torch.testing.assert_close(got.conv_window, want.conv_window, rtol=1e-5, atol=1e-6, msg=what)


class _Sim:
    """Drives a Session through a random schedule and records what every kept token produced."""

    def __init__(self, rng: random.Random, layer: PLELayer):
        self.rng = rng
        self.layer = layer
        cfg = layer.config
        self.cfg = cfg
        self.num_spec = rng.randint(0, 3)
        self.every = rng.choice([None, 1, 2, 3, 5, 8])
        self.session = Session(layer, max_requests=rng.randint(1, 4), num_spec=self.num_spec, prefix_every=self.every)
        self.live: dict[int, dict] = {}
        self.done: list[dict] = []
        self.saved: list[tuple[PrefixState, dict]] = []  # checkpoints to resume from, with the history behind them
        self.next_id = 0

    def _token(self):
        return self.cfg.eos_token_id if self.rng.random() < 0.2 else self.rng.randrange(self.cfg.vocab_size)

    def _row(self):
        return torch.randn(self.cfg.hc_hidden_size)

    def add(self):
        if len(self.live) >= self.session.max_requests:
            return
        rid = self.next_id
        self.next_id += 1
        rec = {"tokens": [], "hidden": [], "out": [], "target": self.rng.randint(1, 30)}
        if self.saved and self.rng.random() < 0.4:
            ck, hist = self.rng.choice(self.saved)
            self.session.add(rid, from_state=ck)
            n = ck.length
            rec.update(tokens=list(hist["tokens"][:n]), hidden=list(hist["hidden"][:n]), out=[None] * n)
            rec["target"] = n + self.rng.randint(1, 20)
        else:
            self.session.add(rid)
        self.live[rid] = rec

    def step(self):
        rng = self.rng
        chosen = [r for r in self.live if rng.random() < 0.8]
        inputs, spec, plans = {}, set(), {}
        for rid in chosen:
            rec = self.live[rid]
            mode = rng.choice(["prefill", "decode", "spec"] if self.num_spec else ["prefill", "decode"])
            n = {"prefill": rng.randint(1, 9), "decode": 1, "spec": rng.randint(1, 1 + self.num_spec)}[mode]
            toks = [self._token() for _ in range(n)]
            hid = [self._row() for _ in range(n)]
            kept = rng.randint(1, n) if mode == "spec" else n
            kept = rng.choice([kept, 1, n]) if mode == "spec" else n
            inputs[rid] = (torch.stack(hid), torch.tensor(toks))
            plans[rid] = (toks, hid, kept)
            if mode == "spec":
                spec.add(rid)
        out = self.session.step(inputs, speculative=spec)
        for rid, (toks, hid, kept) in plans.items():
            rec = self.live[rid]
            if rid in spec:
                self.session.accept(rid, kept)
            rec["tokens"] += toks[:kept]
            rec["hidden"] += hid[:kept]
            rec["out"] += list(out[rid][:kept])

    def maybe_finish_or_preempt(self):
        rng = self.rng
        for rid in list(self.live):
            rec = self.live[rid]
            if len(rec["tokens"]) >= rec["target"] or rng.random() < 0.05:
                self.check_request(rid)
                self.session.finish(rid)
                self.done.append(self.live.pop(rid))
            elif rng.random() < 0.08:  # preemption: checkpoint, finish, resume later under a new id
                ck = self.session.prefix_state(rid)
                self.saved.append((ck, {"tokens": list(rec["tokens"]), "hidden": list(rec["hidden"])}))
                self.check_request(rid)
                self.session.finish(rid)
                self.live.pop(rid)

    def check_request(self, rid):
        rec = self.live[rid]
        if not rec["tokens"]:
            return
        toks = torch.tensor(rec["tokens"])
        want, c_hist = _oneshot(self.layer, torch.stack(rec["hidden"]), toks)
        for p, row in enumerate(rec["out"]):
            if row is not None:
                torch.testing.assert_close(row, want[p], rtol=1e-5, atol=1e-5, msg=f"request {rid} position {p}")
        final = self.session.prefix_state(rid)
        _assert_checkpoint(final, _expected_checkpoint(self.layer, c_hist, toks, len(toks)), f"final state of {rid}")
        for pos, ck in self.session.prefix_states(rid).items():
            assert self.every and pos % self.every == 0
            _assert_checkpoint(ck, _expected_checkpoint(self.layer, c_hist, toks, pos), f"checkpoint {pos} of {rid}")
            if self.rng.random() < 0.3:
                self.saved.append((ck, {"tokens": list(rec["tokens"]), "hidden": list(rec["hidden"])}))
        if self.every:
            # every multiple reached after the request's own start is there
            start = next((i for i, o in enumerate(rec["out"]) if o is not None), len(rec["out"]))
            reached = {p for p in range(self.every, len(toks) + 1, self.every) if p > start}
            assert reached <= set(self.session.prefix_states(rid)), (reached, sorted(self.session.prefix_states(rid)))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), variant=st.integers(0, 2))
def test_random_schedules_match_oneshot(seed, variant):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    sim = _Sim(rng, _layer(variant))
    for _ in range(rng.randint(3, 25)):
        if rng.random() < 0.5 or not sim.live:
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
