"""An fp32 training step's gate and conv (one autograd node with a written-out backward,
:mod:`ple.ops.padded_grad`, in C or in PyTorch) against autograd through the reference ops: the same outputs and
gradients within fp32 rounding, for every input that asks for one, with padding, sequences shorter
than the conv's reach, the conv inputs returned and used, and frozen weights."""

from __future__ import annotations

import pytest
import torch

import ple.ops.padded_grad as padded_grad
from ple.layer import PLELayer
from ple.train import trainable
from tests.train._helpers import CFG, batch, make_tier, new_layer


def _run(layer, hidden, ids, mask, use_c, seed):
    hidden = hidden.clone().requires_grad_(True)
    out, c = layer.forward_padded(hidden, ids, mask, return_conv_input=True)
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g)).sum()
    if use_c:
        loss = loss + (c * torch.randn(c.shape, generator=g)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    if hidden.grad is not None:
        grads["hidden"] = hidden.grad
    handle = layer.table_weight
    if handle is not None and handle.grad is not None:
        grads["table"] = handle.grad.coalesce().to_dense()
        handle.grad = None
    for p in layer.parameters():
        p.grad = None
    return out.detach(), c.detach(), grads


@pytest.mark.parametrize(("s", "mask", "use_c", "frozen"), [
    (12, False, False, False), (12, True, True, False), (2, False, True, False), (1, True, False, False),
    (7, True, False, True), (5, False, True, "norms"),
])  # fmt: skip
@pytest.mark.parametrize("c_backward", [True, False], ids=["C", "torch"])
def test_the_written_backward_gives_autograds_gradients(tmp_path, monkeypatch, s, mask, use_c, frozen, c_backward):
    monkeypatch.setattr(padded_grad, "NATIVE_BACKWARD", c_backward)  # the C kernel, or the PyTorch backward
    took, real = [], padded_grad._native_backward
    monkeypatch.setattr(padded_grad, "_native_backward", lambda *a: took.append(real(*a)) or took[-1])
    layer = new_layer(seed=3, table=make_tier("mmap", "fp8", tmp_path, seed=3))
    trainable(layer)
    if frozen is True:
        layer.requires_grad_(False)  # the table alone: key and value still need gradients
    elif frozen == "norms":
        for p in (layer.norm_key, layer.norm_query, layer.norm_conv, layer.conv_weight):
            p.requires_grad_(False)
    hidden, ids, attn = batch(seed=40 + s, b=3, s=s, mask=mask)
    runs = {}
    for written in (True, False):
        monkeypatch.setattr(PLELayer, "written_backward", written)
        runs[written] = _run(layer, hidden, ids, attn, use_c, seed=s)
    assert took and all(t is not None for t in took) if c_backward else not took  # the layer's steps took C
    (out_w, c_w, g_w), (out_r, c_r, g_r) = runs[True], runs[False]
    assert torch.equal(out_w, out_r) and torch.equal(c_w, c_r)  # the forward is the reference's
    assert sorted(g_w) == sorted(g_r) and "table" in g_w and "hidden" in g_w
    if frozen is True:
        assert sorted(g_w) == ["hidden", "table"]
    for name in g_r:
        torch.testing.assert_close(g_w[name], g_r[name], rtol=1e-5, atol=1e-5, msg=name)


def test_other_dtypes_and_calls_without_gradients_keep_the_reference():
    layer = new_layer(seed=4, dtype=torch.bfloat16, table=make_tier("memory", "bf16", None, seed=4))
    hidden, ids, _ = batch(seed=9, s=6)
    with torch.no_grad():
        want = layer.forward_padded(hidden.bfloat16(), ids)
    got = layer.forward_padded(hidden.bfloat16().requires_grad_(True), ids)
    assert got.grad_fn is not None and "GateConv" not in type(got.grad_fn).__name__
    assert torch.equal(got.detach(), want)  # bf16 rounds where transformers rounds: autograd of the reference
    fp32 = new_layer(seed=4, table=make_tier("memory", "fp32", None, seed=4))
    assert "GateConv" in type(fp32.forward_padded(hidden, ids).grad_fn).__name__
    with torch.no_grad():
        assert fp32.forward_padded(hidden, ids).grad_fn is None
    assert CFG.ngram_size == 3
