"""The CPU fast paths process tokens in blocks: force tiny blocks so every boundary case runs."""

import pytest
import torch

from ple.ops.conv import reference as conv_ref
from ple.ops.conv import torch_impl as conv_fast
from ple.ops.gate import reference as gate_ref
from ple.ops.gate import torch_impl as gate_fast
from ple.ops.records import ConvWeights, GateWeights, StepMeta


@pytest.mark.parametrize("block_tokens", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("seed", range(4))
def test_conv_blocks_match_reference(monkeypatch, block_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    channels, taps, dilation = 7, 3, 2
    monkeypatch.setattr(conv_fast, "_BLOCK_ELEMENTS", block_tokens * channels)
    lens = [int(x) for x in torch.randint(1, 12, (4,), generator=g)]
    lens[0] = 1  # a chunk shorter than the window
    t = sum(lens)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    c = torch.randn(t, channels, generator=g)
    res = torch.randn(t, channels, generator=g)
    w = torch.randn(channels, taps, generator=g)
    state_len = (taps - 1) * dilation + 2
    pool = torch.randn(6, channels, state_len, generator=g)
    slots = torch.tensor([4, 0, -1, 2])
    has_init = torch.tensor([True, False, True, True])
    rejected = torch.tensor([1, 0, 0, 2])
    p1, p2 = pool.clone(), pool.clone()
    conv = ConvWeights.build(w, dilation)
    want = conv_ref.dilated_conv(c, conv, StepMeta(qsl, p1, slots, has_init, rejected), res)
    got = conv_fast.dilated_conv(c, conv, StepMeta(qsl, p2, slots, has_init, rejected), res)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(p1, p2)


@pytest.mark.parametrize("block_tokens", [1, 3, 8])
def test_gate_blocks_match_reference(monkeypatch, block_tokens):
    g = torch.Generator().manual_seed(block_tokens)
    hc, h, t = 3, 10, 11
    monkeypatch.setattr(gate_fast, "_BLOCK_ELEMENTS", block_tokens * hc * h)
    key, hidden = torch.randn(t, hc * h, generator=g), torch.randn(t, hc * h, generator=g)
    value = torch.randn(t, h, generator=g)
    ws = [0.2 * torch.randn(hc * h, generator=g) for _ in range(3)]
    gate = GateWeights.build(*ws, 1e-6, hc)
    want = gate_ref.ngram_gate(key, value, hidden, gate)
    got = gate_fast.ngram_gate(key, value, hidden, gate)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
