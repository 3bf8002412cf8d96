"""Triton kernels of ple.ops against their references: natively on a CUDA device, otherwise on CPU
tensors under the Triton interpreter (set up by tests/conftest.py; tiny shapes)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from ple.ops.conv import reference as conv_ref  # noqa: E402
from ple.ops.conv import triton_impl as conv_triton  # noqa: E402
from ple.ops.fused import composed  # noqa: E402
from ple.ops.fused import reference as fused_ref  # noqa: E402
from ple.ops.gate import reference as gate_ref  # noqa: E402
from ple.ops.gate import triton_impl as gate_triton  # noqa: E402
from ple.ops.norm import reference as norm_ref  # noqa: E402
from ple.ops.norm import triton_impl as norm_triton  # noqa: E402
from tests.conftest import TRITON_DEVICE, TRITON_INTERPRETED  # noqa: E402
from tests.ops._helpers import (
    DTYPE_TOL,
    FP32_TOL,
    assert_no_worse_than_reference,
    flat_conv,
    flat_gate,
    random_conv_batch,
    random_fused_step,
    run_conv,
    run_fused,
    run_stages,
    simulate_streaming,
)

DEVICE = TRITON_DEVICE
fused_torch, fused_triton = composed.TORCH, composed.triton()
# the twins called with the gate's and the conv's tensors
gate_ref_flat, gate_triton_flat = flat_gate(gate_ref.ngram_gate), flat_gate(gate_triton.ngram_gate)
conv_ref_flat, conv_triton_flat = flat_conv(conv_ref.dilated_conv), flat_conv(conv_triton.dilated_conv)


def test_kernels_run_natively_or_interpreted():
    """Without a CUDA device every kernel is an interpreted function (the variable was set in time)."""
    from triton.runtime.interpreter import InterpretedFunction

    kernels = [getattr(m, k) for m in (norm_triton, gate_triton, conv_triton) for k in dir(m) if k.endswith("_kernel")]
    assert kernels
    assert all(isinstance(k, InterpretedFunction) == TRITON_INTERPRETED for k in kernels), kernels
    assert TRITON_INTERPRETED == (not torch.cuda.is_available())


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


@pytest.fixture(params=[None, 8], ids=["one-block", "chunked"])
def max_block(request, monkeypatch):
    """Also run the kernels with a tiny block so that the multi-chunk loops are exercised."""
    if request.param is not None:
        monkeypatch.setattr(norm_triton, "_MAX_BLOCK", request.param)
        monkeypatch.setattr(gate_triton, "_MAX_BLOCK", request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, groups, group_size", [(1, 1, 8), (2, 3, 12), (5, 2, 37)])
def test_norm(max_block, dtype, tokens, groups, group_size):
    x = _randn(tokens, groups * group_size, seed=tokens, dtype=dtype, scale=2.0)
    w = _randn(groups * group_size, seed=tokens + 1, dtype=dtype, scale=0.3)
    x = x.t().contiguous().t()  # column-major: strided rows and columns
    ref = norm_ref.grouped_rms_norm(x, w, group_size, 1e-6)
    out = norm_triton.grouped_rms_norm(x, w, group_size, 1e-6)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        g = x.double().unflatten(-1, (groups, group_size))
        exact = (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2) * (1 + w.double())
        assert_no_worse_than_reference(out, ref, exact, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden_size, hc", [(1, 8, 1), (3, 12, 3), (4, 37, 2)])
def test_gate(max_block, dtype, tokens, hidden_size, hc):
    width = hc * hidden_size
    key = _randn(tokens, width, seed=1, dtype=dtype)
    value = _randn(tokens, 2 * hidden_size, seed=2, dtype=dtype)[:, ::2]  # strided columns
    hidden = _randn(tokens, width, seed=3, dtype=dtype, scale=2.0)
    weights = [_randn(width, seed=4 + i, dtype=dtype, scale=0.3) for i in range(3)]
    v_ref, c_ref = gate_ref_flat(key, value, hidden, *weights, 1e-6, hc)
    v, c = gate_triton_flat(key, value, hidden, *weights, 1e-6, hc)
    assert v.dtype == c.dtype == dtype
    tol = DTYPE_TOL[dtype]
    torch.testing.assert_close(v, v_ref, **tol)
    torch.testing.assert_close(c, c_ref, **tol)


def test_gate_zero_and_tiny_dot():
    key = torch.tensor([[1.0, 1e-9, 0.0, 0.0], [1.0, -1e-9, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], device=DEVICE)
    hidden = torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 3, device=DEVICE)
    value = torch.tensor([[2.0, -4.0, 6.0, 8.0]] * 3, device=DEVICE)
    w = torch.zeros(4, device=DEVICE)
    v, _ = gate_triton_flat(key, value, hidden, w, w, w, 1e-6, 1)
    gates = torch.sigmoid(torch.tensor([1e-3, -1e-3, 0.0], device=DEVICE))
    torch.testing.assert_close(v, value * gates[:, None], rtol=1e-6, atol=0)


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_batch(seed, decode, dtype):
    batch = random_conv_batch(seed, channels=7, num_slots=6, dtype=dtype, decode=decode, device=DEVICE)
    out_ref, state_ref = run_conv(conv_ref_flat, batch)
    out, state = run_conv(conv_triton_flat, batch)
    assert out.dtype == dtype
    assert torch.equal(state, state_ref)
    torch.testing.assert_close(out, out_ref, **DTYPE_TOL[dtype])


def test_conv_strided_state_pool_and_mixed_dtypes():
    batch = random_conv_batch(11, channels=6, num_slots=5, device=DEVICE)
    batch["conv_state"] = batch["conv_state"].bfloat16()  # state kept in bf16, activations in fp32
    out_ref, state_ref = run_conv(conv_ref_flat, batch)
    s, ch, length = batch["conv_state"].shape
    pool = torch.full((s, 2 * ch, length), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    pool[:, ::2] = batch["conv_state"]
    b = dict(batch, conv_state=pool[:, ::2], c=batch["c"].t().contiguous().t())
    out = conv_triton_flat(**b)
    torch.testing.assert_close(out, out_ref, **FP32_TOL)
    assert torch.isnan(pool[:, 1::2]).all()
    if TRITON_INTERPRETED:
        # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even: allow one bf16 ulp.
        torch.testing.assert_close(pool[:, ::2], state_ref, rtol=2**-7, atol=0)
    else:
        assert torch.equal(pool[:, ::2], state_ref)


def test_conv_streaming_lockstep():
    counts = simulate_streaming(
        {"reference": conv_ref_flat, "triton": conv_triton_flat},
        seed=5,
        channels=3,
        taps=3,
        dilation=2,
        num_spec=2,
        num_requests=4,
        num_slots=3,
        max_len=16,
        max_prefill=7,
        steps=24,
        device=DEVICE,
    )
    for key in ("short_prefill", "decode", "spec", "rejected", "finished", "null"):
        assert counts[key] > 0, counts


def test_conv_null_rows_and_empty_batch():
    c = _randn(5, 3, seed=1)
    res = _randn(5, 3, seed=2)
    w = _randn(3, 2, seed=3)
    state = _randn(2, 3, 2, seed=4)
    before = state.clone()
    qsl = torch.tensor([0, 2, 5], device=DEVICE)
    slots = torch.tensor([-1, -1], device=DEVICE)
    init = torch.tensor([True, False], device=DEVICE)
    out = conv_triton_flat(c, w, 2, qsl, state, slots, init, None, res)
    assert torch.equal(out, res) and torch.equal(state, before)
    empty = conv_triton_flat(c[:0], w, 2, qsl[:1], state, slots[:0], init[:0], None, None)
    assert empty.shape == (0, 3) and torch.equal(state, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_fused_step(seed, dtype):
    """What the layer runs on CUDA: the Triton gate and conv composed, against the literal reference."""
    step = random_fused_step(seed, dtype=dtype, hidden_size=8, hc=2, device=DEVICE)
    got = run_fused(fused_triton.gate_conv, step)
    want = run_fused(fused_ref.gate_conv, step)
    fast = run_fused(fused_torch.gate_conv, step)  # the CPU fast path: same rounding points as the kernels
    for a, b, f in zip(got, want, fast):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, **DTYPE_TOL[dtype])
        else:  # against transformers' rounding points, no worse than the PyTorch fast path
            err, err_fast = ((x.double() - b.double()).abs().max().item() for x in (a, f))
            assert err <= 2 * err_fast + 1e-2, (err, err_fast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_fused_stages_compose_bitwise(seed, dtype):
    """gate_stage then conv_stage through the Triton kernels: the one-call step bit for bit, and the
    gate of a subset of rows equals those rows of the whole batch's gate."""
    step = random_fused_step(seed, dtype=dtype, hidden_size=8, hc=2, device=DEVICE)
    got = run_stages(fused_triton, step)
    want = run_fused(fused_triton.gate_conv, step)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    tokens = step["value"].shape[0]
    if tokens > 2:
        mask = step["token_mask"]
        full = fused_triton.gate_stage(step["key"], step["value"], step["hidden"], step["gate"], token_mask=mask)
        part = fused_triton.gate_stage(
            step["key"][1:-1],
            step["value"][1:-1],
            step["hidden"][1:-1],
            step["gate"],
            token_mask=None if mask is None else mask[1:-1],
        )
        for a, b in zip(part, full):
            assert torch.equal(a, b[1:-1])
