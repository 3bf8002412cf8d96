import pytest
import torch

import ple.ops
from ple.errors import InvalidArgumentError
from ple.ops.conv import reference, torch_impl
from tests.conftest import hf_config, hf_ple_layer
from tests.ops._helpers import (
    DTYPE_TOL,
    FP32_TOL,
    flat_conv,
    one_shot_conv,
    random_conv_batch,
    run_conv,
    simulate_streaming,
)

# the twins and the operator, called with the conv's tensors
reference_conv, torch_conv, operator_conv = map(
    flat_conv, (reference.dilated_conv, torch_impl.dilated_conv, ple.ops.dilated_conv)
)


def _call(fn, c, weight, dilation, qsl, state, slots, has_init, rejected=None, residual=None, **kw):
    return fn(c, weight, dilation, qsl, state, slots, has_init, rejected, residual, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 5, 63, 129])
@pytest.mark.parametrize("fn", [reference_conv, torch_conv], ids=["reference", "torch_impl"])
def test_one_shot_matches_transformers_short_conv(fn, dtype, tokens):
    cfg = hf_config(hidden_size=20, hc_count=3, ngram_size=3, ple_conv_kernel_size=4)
    mod = hf_ple_layer(cfg, seed=tokens, dtype=dtype)
    channels = 60
    x = torch.randn(tokens, channels, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    with torch.no_grad():
        want = mod._short_conv(x.unsqueeze(0), None)[0]
    state = torch.full((2, channels, 9), float("nan"), dtype=dtype)
    got = _call(
        fn,
        x,
        mod.conv1d.weight.detach()[:, 0],
        3,
        torch.tensor([0, tokens]),
        state,
        torch.tensor([1]),
        torch.tensor([False]),
    )
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **DTYPE_TOL[dtype])
    assert torch.isnan(state[0]).all(), "an unused slot was written"
    tail = torch.nn.functional.pad(x.t(), (9, 0))[:, -9:]
    assert torch.equal(state[1], tail)


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_impl_matches_reference(seed, decode, dtype):
    batch = random_conv_batch(seed, dtype=dtype, decode=decode)
    out_ref, state_ref = run_conv(reference_conv, batch)
    out, state = run_conv(torch_conv, batch)
    assert out.dtype == dtype and out.shape == batch["c"].shape
    assert torch.equal(state, state_ref)
    torch.testing.assert_close(out, out_ref, **DTYPE_TOL[dtype])


@pytest.mark.parametrize("taps, dilation, num_spec", [(1, 3, 0), (2, 1, 0), (3, 2, 2), (4, 3, 0), (5, 1, 4)])
def test_geometries(taps, dilation, num_spec):
    for seed in range(4):
        batch = random_conv_batch(100 + seed, channels=7, taps=taps, dilation=dilation, num_spec=num_spec)
        out_ref, state_ref = run_conv(reference_conv, batch)
        out, state = run_conv(torch_conv, batch)
        assert torch.equal(state, state_ref)
        torch.testing.assert_close(out, out_ref, **FP32_TOL)


@pytest.mark.parametrize("act, state", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_state_dtype_differs_from_activations(act, state):
    for seed in range(4):
        batch = random_conv_batch(200 + seed, channels=5, dtype=act)
        batch["conv_state"] = batch["conv_state"].to(state)
        out_ref, state_ref = run_conv(reference_conv, batch)
        out, new_state = run_conv(torch_conv, batch)
        assert new_state.dtype == state and out.dtype == act
        assert torch.equal(new_state, state_ref)
        torch.testing.assert_close(out, out_ref, **DTYPE_TOL[act])


def test_operator_runs_torch_impl_on_cpu():
    batch = random_conv_batch(7)
    out_ref, state_ref = run_conv(torch_conv, batch)
    out, state = run_conv(operator_conv, batch)
    assert torch.equal(out, out_ref) and torch.equal(state, state_ref)


@pytest.mark.parametrize("fn", [reference_conv, torch_conv], ids=["reference", "torch_impl"])
def test_streaming_equals_one_shot(fn):
    counts = simulate_streaming(
        {"impl": fn},
        seed=1,
        channels=5,
        taps=4,
        dilation=3,
        num_spec=3,
        num_requests=5,
        num_slots=3,
        max_len=40,
        max_prefill=12,
        steps=60,
    )
    for key in ("short_prefill", "decode", "spec", "rejected", "preempt", "finished", "null"):
        assert counts[key] > 0, counts


@pytest.mark.parametrize("seed", range(3))
def test_streaming_lockstep(seed):
    """Reference and fast path driven together through random schedules: identical states at every step."""
    simulate_streaming(
        {"reference": reference_conv, "torch_impl": torch_conv},
        seed=10 + seed,
        channels=6,
        taps=3,
        dilation=2,
        num_spec=2,
        num_requests=6,
        num_slots=4,
        max_len=30,
        max_prefill=9,
        steps=40,
    )


@pytest.mark.parametrize("fn", [reference_conv, torch_conv], ids=["reference", "torch_impl"])
def test_fresh_request_ignores_slot_and_rejected(fn):
    g = torch.Generator().manual_seed(0)
    c = torch.randn(4, 3, generator=g)
    w = torch.randn(3, 4, generator=g)
    state = torch.full((1, 3, 9), float("nan"))
    out = _call(fn, c, w, 2, torch.tensor([0, 4]), state, torch.tensor([0]), torch.tensor([False]), torch.tensor([3]))
    torch.testing.assert_close(out.double(), one_shot_conv(c, w, 2), **FP32_TOL)
    assert torch.equal(state[0], torch.nn.functional.pad(c.t(), (5, 0)))


@pytest.mark.parametrize("fn", [reference_conv, torch_conv], ids=["reference", "torch_impl"])
def test_rejection_longer_than_new_rows_zero_fills(fn):
    """Slot keeps [s0..s8] + 3 rejected; one new row x: state = 0, 0, s0..s8, x (left zero-padded)."""
    g = torch.Generator().manual_seed(1)
    state = torch.randn(1, 2, 12, generator=g)
    old = state.clone()
    x = torch.randn(1, 2, generator=g)
    w = torch.randn(2, 4, generator=g)
    _call(fn, x, w, 3, torch.tensor([0, 1]), state, torch.tensor([0]), torch.tensor([True]), torch.tensor([3]))
    want = torch.cat([torch.zeros(2, 2), old[0, :, :9], x.t()], dim=1)
    assert torch.equal(state[0], want)


@pytest.mark.parametrize("fn", [reference_conv, torch_conv], ids=["reference", "torch_impl"])
def test_null_rows_and_empty_batch(fn):
    g = torch.Generator().manual_seed(2)
    c = torch.randn(5, 3, generator=g)
    res = torch.randn(5, 3, generator=g)
    w = torch.randn(3, 2, generator=g)
    state = torch.randn(2, 3, 2, generator=g)
    before = state.clone()
    out = _call(
        fn, c, w, 2, torch.tensor([0, 2, 5]), state, torch.tensor([-1, -1]), torch.tensor([True, False]), None, res
    )
    assert torch.equal(out, res) and torch.equal(state, before)
    out = _call(fn, c, w, 2, torch.tensor([0, 2, 5]), state, torch.tensor([-1, -1]), torch.tensor([True, False]))
    assert torch.equal(out, torch.zeros_like(c))
    empty = _call(
        fn,
        c[:0],
        w,
        2,
        torch.tensor([0]),
        state,
        torch.tensor([], dtype=torch.long),
        torch.tensor([], dtype=torch.bool),
    )
    assert empty.shape == (0, 3) and torch.equal(state, before)


def test_non_contiguous_inputs():
    batch = random_conv_batch(3, channels=6)
    out_ref, state_ref = run_conv(torch_conv, batch)
    nc = dict(batch)
    nc["c"] = batch["c"].t().contiguous().t()
    nc["weight"] = batch["weight"].t().contiguous().t()
    if batch["residual"] is not None:
        nc["residual"] = batch["residual"].t().contiguous().t()
    pool = torch.full((batch["conv_state"].shape[0], 12, batch["conv_state"].shape[2]), float("nan"))
    pool[:, ::2] = batch["conv_state"]
    nc["conv_state"] = pool[:, ::2]  # a view into a larger pool, written through
    out = torch_conv(**nc)
    torch.testing.assert_close(out, out_ref, **FP32_TOL)
    assert torch.equal(pool[:, ::2], state_ref) and torch.isnan(pool[:, 1::2]).all()


@pytest.mark.parametrize("fn", [reference_conv, torch_conv], ids=["reference", "torch_impl"])
def test_validation(fn):
    c = torch.randn(5, 3)
    w = torch.randn(3, 4)
    state = torch.zeros(4, 3, 8)
    qsl = torch.tensor([0, 2, 5])
    slots = torch.tensor([0, 1])
    init = torch.tensor([True, True])

    def call(**kw):
        args = dict(
            c=c,
            weight=w,
            dilation=2,
            query_start_loc=qsl,
            conv_state=state,
            state_indices=slots,
            has_initial_state=init,
            num_rejected=None,
            residual=None,
        )
        args.update(kw)
        return fn(**args)

    with pytest.raises(
        InvalidArgumentError, match=r"request 1: num_rejected\[1\]=3, expected 0 <= num_rejected <= L-W=2"
    ):
        call(num_rejected=torch.tensor([0, 3]))
    call(num_rejected=torch.tensor([0, 3]), has_initial_state=torch.tensor([True, False]))  # not read: accepted
    with pytest.raises(ValueError, match=r"query_start_loc\[0\]=1, expected 0"):
        call(query_start_loc=torch.tensor([1, 2, 5]))
    with pytest.raises(ValueError, match=r"request 1: query_start_loc\[2\]=1 < query_start_loc\[1\]=2"):
        call(query_start_loc=torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match=r"query_start_loc\[-1\]=4, expected T=5"):
        call(query_start_loc=torch.tensor([0, 2, 4]))
    with pytest.raises(
        ValueError, match=r"request 1: state_indices\[1\]=4, expected -1 \(null\) or a slot in \[0, 4\)"
    ):
        call(state_indices=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"request 0: state_indices\[0\]=-2"):
        call(state_indices=torch.tensor([-2, 1]))
    with pytest.raises(ValueError, match="requests 0 and 1 both use state slot 3"):
        call(state_indices=torch.tensor([3, 3]))
    call(state_indices=torch.tensor([-1, -1]))  # several null rows are fine
    with pytest.raises(ValueError, match=r"conv_state.shape\[-1\]=5 is shorter than the window W=\(K-1\)\*dilation=6"):
        call(conv_state=torch.zeros(4, 3, 5))
    with pytest.raises(ValueError, match=r"weight.shape=\(3, 1, 4\), expected \[C, K\]"):
        call(weight=w.unsqueeze(1))
    with pytest.raises(ValueError, match=r"has_initial_state has shape \(2,\) and dtype torch.int64"):
        call(has_initial_state=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"residual has shape \(5, 3\) and dtype torch.bfloat16"):
        call(residual=c.bfloat16())
    with pytest.raises(ValueError, match="dilation=0"):
        call(dilation=0)
    with pytest.raises(TypeError, match="query_start_loc.dtype=torch.float32"):
        call(query_start_loc=qsl.float())
    before = state.clone()
    with pytest.raises(ValueError):
        call(state_indices=torch.tensor([0, 9]))
    assert torch.equal(state, before), "a refused call must not touch the state"
