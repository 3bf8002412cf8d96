"""Shared test helpers for ple.ops: tolerances and the streaming conv simulator."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ple.ops.records import ConvWeights, GateWeights, StepMeta, derive_gate_factors

# Tolerance for comparing two fp32 computations of the same quantity in a different order.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
DTYPE_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def assert_no_worse_than_reference(fast: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor, atol: float) -> None:
    """Error of ``fast`` against the fp64 ``exact`` is at most twice the error of ``ref`` plus ``atol``."""
    assert fast.dtype == ref.dtype
    assert torch.isfinite(fast).all(), "fast output has non-finite values"
    err_fast = (fast.double() - exact).abs().max().item()
    err_ref = (ref.double() - exact).abs().max().item()
    assert err_fast <= 2 * err_ref + atol, f"fast error {err_fast:.3g} vs reference error {err_ref:.3g} (+{atol})"


def one_shot_conv(x: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """``silu(conv)`` of one whole sequence ``x [N, C]`` with zero history, as transformers pads it; fp64."""
    window = (weight.shape[1] - 1) * dilation
    xp = F.pad(x.double().t().unsqueeze(0), (window, 0))
    y = F.conv1d(xp, weight.double().unsqueeze(1), groups=x.shape[1], dilation=dilation)
    return F.silu(y)[0].t()


ConvFn = Callable[..., torch.Tensor]


def flat_conv(fn):
    """A ``dilated_conv`` twin (it takes the records) called with the conv's tensors, as engines hold
    them: ``(c, weight, dilation, query_start_loc, conv_state, state_indices, has_initial_state,
    num_rejected=None, residual=None, *, validate=True)``."""

    def call(c, weight, dilation, query_start_loc, conv_state, state_indices, has_initial_state, *rest, **kw):
        num_rejected, residual = (*rest, None, None)[:2] if len(rest) < 2 else rest
        num_rejected, residual = kw.pop("num_rejected", num_rejected), kw.pop("residual", residual)
        conv = ConvWeights(weight, dilation, weight)  # the conv twins do not read the fp32 taps
        step = StepMeta(query_start_loc, conv_state, state_indices, has_initial_state, num_rejected)
        return fn(c, conv, step, residual, **kw)

    return call


def flat_gate(fn):
    """An ``ngram_gate`` twin (it takes the record) called with the gate's tensors: ``(key, value,
    hidden, norm_key_weight, norm_query_weight, norm_conv_weight, eps, hc_count)``."""

    def call(key, value, hidden, norm_key, norm_query, norm_conv, eps, hc_count):
        factors = derive_gate_factors(norm_key, norm_query, norm_conv)
        return fn(key, value, hidden, GateWeights(norm_key, norm_query, norm_conv, eps, hc_count, *factors))

    return call


def random_conv_batch(
    seed, *, channels=11, taps=4, dilation=3, num_spec=3, num_slots=9, dtype=torch.float32, decode=False, device="cpu"
):
    """Random packed conv batch: chunk lengths around the window (0 and 1 included), null slots, random flags."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    window = (taps - 1) * dilation
    num_requests = rnd.randint(1, min(7, num_slots))
    choices = [0, 1, 2, 3, max(window - 1, 0), window, window + 4, 17]
    lens = [1 if decode else rnd.choice(choices) for _ in range(num_requests)]
    qsl = torch.tensor([0] + lens).cumsum(0)
    slots = torch.tensor(rnd.sample(range(num_slots), num_requests))
    slots[torch.rand(num_requests, generator=g) < 0.2] = -1
    has_init = torch.rand(num_requests, generator=g) < 0.7
    rejected = torch.randint(0, num_spec + 1, (num_requests,), generator=g)
    tokens = int(qsl[-1])
    batch = dict(
        c=torch.randn(tokens, channels, generator=g).to(dtype),
        weight=torch.randn(channels, taps, generator=g),
        dilation=dilation,
        query_start_loc=qsl,
        conv_state=torch.randn(num_slots, channels, window + num_spec, generator=g).to(dtype),
        state_indices=slots,
        has_initial_state=has_init,
        num_rejected=rejected if rnd.random() < 0.7 else None,
        residual=torch.randn(tokens, channels, generator=g).to(dtype) if rnd.random() < 0.5 else None,
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def run_conv(fn, batch):
    """Run ``fn`` on a copy of the batch's state; returns ``(out, new_state)``."""
    b = dict(batch)
    b["conv_state"] = b["conv_state"].clone()
    out = fn(**b)
    return out, b["conv_state"]


@dataclasses.dataclass
class _Request:
    history: torch.Tensor  # [N, C] accepted conv inputs of the whole request
    expected: torch.Tensor  # [N, C] fp64 one-shot conv outputs
    done: int = 0  # accepted rows processed so far
    slot: int = -1
    started: bool = False  # the slot holds this request's state
    rejected: int = 0  # rejected rows of the previous step still at the end of the slot


def simulate_streaming(
    impls: dict[str, ConvFn],
    *,
    seed: int,
    channels: int,
    taps: int,
    dilation: int,
    num_spec: int,
    num_requests: int,
    num_slots: int,
    max_len: int,
    max_prefill: int,
    steps: int,
    device: str = "cpu",
) -> dict[str, int]:
    """Drive every implementation in lockstep through one random serving schedule and check it.

    Requests join, run prefill chunks of random size (shorter than the window too), decode rows and
    speculative steps with random rejection, get preempted (restart from scratch) and finish; slots
    are reused and are NaN-poisoned before their first use. Null rows (slot -1) are mixed in. After
    every step: the states of all implementations are identical, every output row of an accepted
    token equals the one-shot conv of its request (plus the residual), null rows equal the residual.
    At the end every live slot holds the tail of its accepted history. Returns counters of what ran.
    """
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    window = (taps - 1) * dilation
    state_len = window + num_spec
    weight = torch.randn(channels, taps, generator=gen)
    reqs = []
    for _ in range(num_requests):
        n = rnd.randint(1, max_len)
        hist = torch.randn(n, channels, generator=gen)
        reqs.append(_Request(hist, one_shot_conv(hist, weight, dilation)))
    pools = {name: torch.full((num_slots, channels, state_len), float("nan"), device=device) for name in impls}
    free = list(range(num_slots))
    rnd.shuffle(free)
    counts = dict(prefill=0, short_prefill=0, decode=0, spec=0, rejected=0, preempt=0, finished=0, null=0)
    weight_dev = weight.to(device)

    for _ in range(steps):
        pending = [r for r in reqs if r.done < len(r.history)]
        if not pending:
            break
        rows, parts, accepted = [], [], []  # per batch request: (slot, has_init, rejected), c rows, accepted count
        for req in rnd.sample(pending, k=rnd.randint(1, len(pending))):
            if req.slot < 0:
                if not free:
                    continue
                req.slot = free.pop()
            kind = rnd.choice(["prefill", "decode", "spec", "spec", "preempt"]) if req.started else "prefill"
            if kind == "preempt":
                counts["preempt"] += 1
                free.append(req.slot)
                req.slot, req.done, req.started, req.rejected = -1, 0, False, 0
                continue
            left = len(req.history) - req.done
            if kind == "prefill":
                n = min(rnd.randint(1, max_prefill), left)
                chunk, n_acc = req.history[req.done : req.done + n], n
                counts["prefill"] += 1
                counts["short_prefill"] += n < window
            elif kind == "decode":
                chunk, n_acc = req.history[req.done : req.done + 1], 1
                counts["decode"] += 1
            else:
                drafts = rnd.randint(0, num_spec)
                good = min(rnd.randint(0, drafts), left - 1)
                bad = drafts - good
                garbage = torch.randn(bad, channels, generator=gen)
                chunk = torch.cat([req.history[req.done : req.done + 1 + good], garbage])
                n_acc = 1 + good
                counts["spec"] += 1
                counts["rejected"] += bad
            rows.append((req, req.slot, req.started, req.rejected))
            parts.append(chunk)
            accepted.append(n_acc)
        for _ in range(rnd.randint(0, 2)):  # null rows: no slot, garbage metadata
            n = rnd.randint(0, 3)
            rows.append((None, -1, rnd.random() < 0.5, 1000))
            parts.append(torch.randn(n, channels, generator=gen))
            accepted.append(0)
            counts["null"] += 1
        if not rows:
            continue
        order = list(range(len(rows)))
        rnd.shuffle(order)
        rows = [rows[i] for i in order]
        parts = [parts[i] for i in order]
        accepted = [accepted[i] for i in order]
        lens = [len(p) for p in parts]
        qsl = torch.tensor([0] + lens).cumsum(0)
        c = torch.cat(parts) if parts else torch.zeros(0, channels)
        residual = torch.randn(c.shape, generator=gen) if rnd.random() < 0.5 else None
        slots = torch.tensor([r[1] for r in rows])
        has_init = torch.tensor([r[2] for r in rows])
        rejected = torch.tensor([r[3] for r in rows])
        num_rejected = rejected if (rnd.random() < 0.8 or bool(rejected[slots >= 0].any())) else None

        outs = {}
        for name, fn in impls.items():
            outs[name] = fn(
                c.to(device),
                weight_dev,
                dilation,
                qsl.to(device=device, dtype=torch.int32 if rnd.random() < 0.5 else torch.int64),
                pools[name],
                slots.to(device),
                has_init.to(device),
                None if num_rejected is None else num_rejected.to(device),
                None if residual is None else residual.to(device),
            ).cpu()
        names = list(impls)
        for name in names[1:]:
            torch.testing.assert_close(
                pools[name].cpu(), pools[names[0]].cpu(), rtol=0, atol=0, equal_nan=True, msg=f"{name} state"
            )
            torch.testing.assert_close(outs[name], outs[names[0]], **FP32_TOL, msg=f"{name} vs {names[0]}")

        base = torch.zeros_like(c) if residual is None else residual
        for i, (req, _, _, _) in enumerate(rows):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            for name in names:
                got = outs[name][lo:hi]
                if req is None:
                    assert torch.equal(got, base[lo:hi]), f"{name}: null row output is not the residual"
                    continue
                n_acc = accepted[i]
                want = req.expected[req.done : req.done + n_acc] + base[lo : lo + n_acc].double()
                torch.testing.assert_close(got[:n_acc].double(), want, **FP32_TOL, msg=f"{name}: accepted rows")
            if req is not None:
                req.done += accepted[i]
                req.rejected = lens[i] - accepted[i]
                req.started = True
                if req.done == len(req.history):
                    counts["finished"] += 1
                    free.append(req.slot)  # the slot keeps this request's state as garbage for the next user
                    req.slot = -1

    for req in reqs:
        if req.slot < 0 or not req.started:
            continue
        end = state_len - req.rejected
        tail = F.pad(req.history[: req.done].t(), (window, 0))[:, -window:] if window else req.history[:0].t()
        for name in names:
            got = pools[name][req.slot, :, end - window : end].cpu()
            assert torch.equal(got, tail), f"{name}: final window of slot {req.slot}"
    return counts


def random_fused_step(
    seed, *, dtype, device="cpu", hidden_size=16, hc=3, taps=4, dilation=3, num_spec=3, decode=False, long=False
):
    """Gate inputs plus a packed conv batch (lengths around the window, null slots, rejections), as the
    keyword arguments of a ``gate_conv`` twin: ``key``, ``value``, ``hidden``, the records ``gate``,
    ``conv``, ``step``, and ``token_mask``, ``add_hidden``, ``return_conv_input``."""
    channels = hc * hidden_size
    conv = random_conv_batch(
        seed, channels=channels, taps=taps, dilation=dilation, num_spec=num_spec, dtype=dtype, decode=decode
    )
    qsl = conv["query_start_loc"]
    if long:  # chunks long enough to be split into several work units
        lens = [random.Random(seed).choice([0, 1, 40, 97, 300]) for _ in range(qsl.numel() - 1)]
        qsl = torch.tensor([0, *lens]).cumsum(0)
    tokens = int(qsl[-1])
    g = torch.Generator().manual_seed(1000 + seed)
    kv = torch.randn(tokens, channels + hidden_size, generator=g).to(dtype)  # key and value as views, like the layer
    key, value = kv.to(device).split([channels, hidden_size], dim=1)
    mask = None
    if seed % 3 == 0 and tokens:
        mask = (torch.rand(tokens, generator=g) > 0.25).to(device)
    hidden = torch.randn(tokens, channels, generator=g).to(dtype).to(device)
    norms = [(0.3 * torch.randn(channels, generator=g)).to(device) for _ in range(3)]
    nr = conv["num_rejected"]
    return dict(
        key=key,
        value=value,
        hidden=hidden,
        gate=GateWeights.build(*norms, 1e-6, hc),
        conv=ConvWeights.build(conv["weight"].to(device), dilation),
        step=StepMeta.build(
            (qsl.to(torch.int32) if seed % 2 else qsl).to(device),
            conv["conv_state"].to(device),
            conv["state_indices"].to(device),
            conv["has_initial_state"].to(device),
            None if nr is None else nr.to(device),
        ),
        token_mask=mask,
        add_hidden=seed % 4 != 1,
        return_conv_input=True,
    )


def with_state(step: dict, conv_state: torch.Tensor) -> dict:
    """The step's keyword arguments with another state pool."""
    return dict(step, step=dataclasses.replace(step["step"], conv_state=conv_state))


def run_fused(fn, step, **extra):
    """Run a ``gate_conv`` twin on a copy of the step's state pool; returns ``(out, c, new_state)``."""
    s = with_state(step, step["step"].conv_state.clone())
    out, c = fn(**s, **extra)
    return out.cpu(), c.cpu(), s["step"].conv_state.cpu()


def run_stages(stages, step, **extra):
    """Run ``stages.gate_stage`` then ``stages.conv_stage`` on a copy of the pool; returns ``(out, c, new_state)``."""
    s = with_state(step, step["step"].conv_state.clone())
    residual, c = stages.gate_stage(
        s["key"], s["value"], s["hidden"], s["gate"], token_mask=s["token_mask"], add_hidden=s["add_hidden"], **extra
    )
    out = stages.conv_stage(c, residual, s["conv"], s["step"], **extra)
    return out.cpu(), c.cpu(), s["step"].conv_state.cpu()
