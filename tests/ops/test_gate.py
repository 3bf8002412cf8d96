import math

import pytest
import torch
from torch import nn

import ple.ops
from ple.ops.gate import reference, torch_impl
from tests.conftest import hf_config, hf_ple_layer
from tests.ops._helpers import assert_no_worse_than_reference, flat_gate

# the twins and the operator, called with the gate's tensors
reference_gate, torch_gate, operator_gate = map(
    flat_gate, (reference.ngram_gate, torch_impl.ngram_gate, ple.ops.ngram_gate)
)


class _FixedEmbedding(nn.Module):
    def __init__(self, emb: torch.Tensor):
        super().__init__()
        self.emb = emb

    def forward(self, input_ids, cache):
        return self.emb


def _transformers_gate(mod, emb: torch.Tensor, hidden: torch.Tensor):
    """(key, value, v, c) as transformers' Qwen4ExpTextPLELayer computes them for embeddings ``emb [T, E]``."""
    captured = {}

    def hook(module, args, output):
        captured["v"] = args[0]
        captured["c"] = output

    mod.ple_embedding = _FixedEmbedding(emb.unsqueeze(0))
    handle = mod.norm_conv.register_forward_hook(hook)
    try:
        with torch.no_grad():
            mod(hidden.unsqueeze(0), torch.zeros(1, emb.shape[0], dtype=torch.long), None)
            key = mod.key_proj(emb.unsqueeze(0))[0]
            value = mod.value_proj(emb.unsqueeze(0))[0]
    finally:
        handle.remove()
    return key, value, captured["v"][0], captured["c"][0]


def _weights(mod):
    return mod.norm_key.weight.detach(), mod.norm_query.weight.detach(), mod.norm_conv.weight.detach()


def _exact(key, value, hidden, wk, wq, wc, eps, hc):
    """fp64 evaluation of the gate's math on the given inputs."""
    h = value.shape[-1]

    def norm(x, w):
        g = x.double().unflatten(-1, (-1, h))
        return g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.double()).view(-1, h)

    d = (norm(key, wk) * norm(hidden, wq)).sum(-1, keepdim=True) / math.sqrt(h)
    g = torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp_min(1e-6)))
    v = (g * value.double().unsqueeze(-2)).flatten(-2)
    return v, norm(v, wc).flatten(-2)


def _inputs(tokens, hidden_size, hc, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(tokens, hc * hidden_size, generator=g).to(dtype)
    value = torch.randn(tokens, hidden_size, generator=g).to(dtype)
    hidden = (2 * torch.randn(tokens, hc * hidden_size, generator=g)).to(dtype)
    wk, wq, wc = (0.3 * torch.randn(hc * hidden_size, generator=g).to(dtype) for _ in range(3))
    return key, value, hidden, wk, wq, wc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 63, 129])
def test_reference_matches_transformers_bitwise(dtype, tokens):
    cfg = hf_config(hidden_size=20, hc_count=3, ple_embed_dim=16, heads_per_ngram=2)
    mod = hf_ple_layer(cfg, seed=tokens, dtype=dtype)
    g = torch.Generator().manual_seed(100 + tokens)
    emb = torch.randn(tokens, 16, generator=g).to(dtype)
    hidden = (2 * torch.randn(tokens, 60, generator=g)).to(dtype)
    key, value, v_hf, c_hf = _transformers_gate(mod, emb, hidden)
    v, c = reference_gate(key, value, hidden, *_weights(mod), cfg.rms_norm_eps, 3)
    assert v.dtype == c.dtype == dtype
    assert torch.equal(v, v_hf)
    assert torch.equal(c, c_hf)


@pytest.mark.parametrize("tokens, hidden_size, hc", [(1, 8, 1), (2, 20, 3), (63, 24, 4), (129, 37, 2)])
@pytest.mark.parametrize("fn", [torch_gate, operator_gate], ids=["torch_impl", "operator"])
def test_fast_path_fp32(fn, tokens, hidden_size, hc):
    args = _inputs(tokens, hidden_size, hc, torch.float32, seed=tokens + hidden_size)
    v_ref, c_ref = reference_gate(*args, 1e-6, hc)
    v, c = fn(*args, 1e-6, hc)
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c, c_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, hidden_size, hc", [(1, 8, 1), (2, 20, 3), (63, 24, 4), (129, 37, 2)])
def test_fast_path_low_precision_vs_fp64(dtype, tokens, hidden_size, hc):
    args = _inputs(tokens, hidden_size, hc, dtype, seed=3 * tokens + hidden_size)
    v_ref, c_ref = reference_gate(*args, 1e-6, hc)
    v, c = torch_gate(*args, 1e-6, hc)
    assert v.dtype == c.dtype == dtype
    v64, c64 = _exact(*args, 1e-6, hc)
    assert_no_worse_than_reference(v, v_ref, v64, atol=1e-3)
    assert_no_worse_than_reference(c, c_ref, c64, atol=1e-3)


def test_zero_dot_gives_half_gate():
    # key orthogonal to the query: d = 0, sign(0) = 0, gate = sigmoid(0) = 1/2 in every implementation
    key = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    hidden = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    value = torch.tensor([[2.0, -4.0, 6.0, 8.0]])
    w = torch.zeros(4)
    for fn in (reference_gate, torch_gate):
        v, _ = fn(key, value, hidden, w, w, w, 1e-6, 1)
        assert torch.equal(v, value / 2)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_tiny_dot_is_clamped(sign):
    # d = 2e-9 * sign: |d| is clamped to 1e-6 before the square root, so the gate is sigmoid(+-1e-3)
    key = torch.tensor([[1.0, sign * 1e-9, 0.0, 0.0]])
    hidden = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    value = torch.tensor([[2.0, -4.0, 6.0, 8.0]])
    w = torch.zeros(4)
    want = value * torch.sigmoid(torch.tensor(sign * 1e-3))
    for fn in (reference_gate, torch_gate):
        v, _ = fn(key, value, hidden, w, w, w, 1e-6, 1)
        torch.testing.assert_close(v, want, rtol=1e-6, atol=0)


def test_non_contiguous_inputs():
    key, value, hidden, wk, wq, wc = _inputs(30, 12, 3, torch.float32, seed=5)
    key_nc = torch.stack([key, torch.full_like(key, float("nan"))], dim=-1)[..., 0]  # column stride 2
    hidden_nc = hidden.t().contiguous().t()  # column-major
    value_nc = torch.stack([value, torch.full_like(value, float("nan"))], dim=1)[:, 0]  # row stride 2H
    assert not (key_nc.is_contiguous() or hidden_nc.is_contiguous() or value_nc.is_contiguous())
    v_ref, c_ref = reference_gate(key, value, hidden, wk, wq, wc, 1e-6, 3)
    v, c = torch_gate(key_nc, value_nc, hidden_nc, wk, wq, wc, 1e-6, 3)
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c, c_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [reference_gate, torch_gate])
def test_validation(fn):
    key, value, hidden, wk, wq, wc = _inputs(4, 6, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"key.shape=\(4, 12\), expected \[T, HC\*H\] = \(4, 18\)"):
        fn(key, value, hidden, wk, wq, wc, 1e-6, 3)
    with pytest.raises(ValueError, match=r"norm_conv_weight.shape=\(11,\)"):
        fn(key, value, hidden, wk, wq, wc[:11], 1e-6, 2)
    with pytest.raises(TypeError, match="hidden.dtype=torch.bfloat16"):
        fn(key, value, hidden.bfloat16(), wk, wq, wc, 1e-6, 2)
    with pytest.raises(ValueError, match="hc_count=0"):
        fn(key, value, hidden, wk, wq, wc, 1e-6, 0)
