"""The C backward of a training step's gate and conv (``ple_train.c``) against the written-out PyTorch
backward of :mod:`ple.ops.padded_grad` (itself checked against autograd of the reference in
``tests/train/test_step_grad.py``): the same gradients within fp32 rounding for every input that asks for
one, with padding, sequences shorter than the conv's reach, the conv inputs' own gradient and strided
values; and the same bits for any number of threads and every instruction set."""

from __future__ import annotations

import pytest
import torch

import ple.ops.padded_grad as padded_grad
from ple.kernels import native as native_build
from ple.ops.records import GateWeights

pytestmark = pytest.mark.skipif(not native_build.available(), reason="the C kernels do not build here")

NAMES = ("key", "value", "hidden", "norm_key", "norm_query", "norm_conv", "conv_weight")


def _grads(native, *, b=2, s=9, hc=3, h=10, k=4, dilation=3, mask=True, use_c=True, frozen=(), seed=0, threads=None):
    """The gradients of a random loss over (out, c) with the C backward or the PyTorch one."""
    g = torch.Generator().manual_seed(seed)
    c_width = hc * h
    kv = torch.randn(b * s, c_width + h, generator=g)
    hidden = torch.randn(b * s, c_width, generator=g)
    norms = [0.2 * torch.randn(c_width, generator=g) for _ in range(3)]
    conv = 0.4 * torch.randn(c_width, k, generator=g)
    leaves = dict(zip(NAMES, [kv, None, hidden, *norms, conv]))
    for name in ("key", "hidden", "norm_key", "norm_query", "norm_conv", "conv_weight"):
        grad = name.split("_")[0] not in frozen and name not in frozen
        if name.startswith(("norm", "conv")):  # as the layer holds them (saved for backward as such)
            leaves[name] = torch.nn.Parameter(leaves[name].clone(), requires_grad=grad)
        else:
            leaves[name] = leaves[name].clone().requires_grad_(grad)
    kv = leaves["key"]
    key, value = kv.split_with_sizes([c_width, h], 1)  # value: rows c_width + h apart, as the layer's
    attn = None
    if mask:
        attn = torch.ones(b, s)
        attn[0, : s // 3] = 0  # left padding
    gate = GateWeights.build(leaves["norm_key"], leaves["norm_query"], leaves["norm_conv"], 1e-6, hc)
    out_w = torch.randn(b, s, c_width, generator=g)
    c_w = torch.randn(b, s, c_width, generator=g)
    before, saved = padded_grad.NATIVE_BACKWARD, torch.get_num_threads()
    padded_grad.NATIVE_BACKWARD = native
    if threads:
        torch.set_num_threads(threads)
    calls = []
    real = padded_grad._native_backward

    def spy(*args):
        got = real(*args)
        calls.append(got is not None)  # whether the C kernel computed the gradients
        return got

    padded_grad._native_backward = spy
    try:
        out, c = padded_grad.gate_conv_padded(key, value, leaves["hidden"], gate, leaves["conv_weight"], dilation,
                                              (b, s), attn)  # fmt: skip
        loss = (out * out_w).sum() + ((c * c_w).sum() if use_c else 0)
        loss.backward()
    finally:
        padded_grad.NATIVE_BACKWARD = before
        padded_grad._native_backward = real
        torch.set_num_threads(saved)
    grads = {"took C": calls == [True]} if native else {}
    assert native or not calls
    if kv.grad is not None:
        grads["key"], grads["value"] = kv.grad[:, :c_width], kv.grad[:, c_width:]
    for name in NAMES[2:]:
        if leaves[name].grad is not None:
            grads[name] = leaves[name].grad
    return grads


@pytest.mark.parametrize(
    ("s", "mask", "use_c", "frozen", "k", "dilation"),
    [
        (9, True, True, (), 4, 3),
        (12, False, False, (), 4, 3),
        (2, True, True, (), 4, 3),  # shorter than the conv's reach
        (1, False, True, (), 3, 2),
        (7, True, False, ("norm", "conv_weight"), 4, 3),  # frozen weights: no weight gradients
        (6, False, True, ("key",), 2, 1),  # key and value frozen: the key's path still runs for norm_key
        (5, True, True, ("hidden", "norm_query"), 4, 3),  # the hidden's path skipped
    ],
)
def test_the_c_backward_gives_the_written_backwards_gradients(s, mask, use_c, frozen, k, dilation):
    want = _grads(False, s=s, mask=mask, use_c=use_c, frozen=frozen, k=k, dilation=dilation, seed=s)
    got = _grads(True, s=s, mask=mask, use_c=use_c, frozen=frozen, k=k, dilation=dilation, seed=s)
    assert got.pop("took C")
    assert sorted(got) == sorted(want)
    assert ("key" in got) == ("value" in got) == ("key" not in frozen)  # key and value: one leaf, as the layer's
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_c_backward_gives_the_same_bits_for_any_thread_count_and_instruction_set():
    want = _grads(True, b=3, s=40, h=37, threads=1, seed=5)  # 120 rows: every fixed row range in use
    assert want.pop("took C")
    for threads in (2, 3):
        got = _grads(True, b=3, s=40, h=37, threads=threads, seed=5)
        assert got.pop("took C")
        assert all(torch.equal(got[n], want[n]) for n in want), threads
    before = native_build.current_isa()
    try:
        for isa in native_build.ISAS:
            if not native_build.isa_available(isa):
                continue
            native_build.set_isa(isa)
            got = _grads(True, b=3, s=40, h=37, threads=2, seed=5)
            assert got.pop("took C")
            assert all(torch.equal(got[n], want[n]) for n in want), isa
    finally:
        native_build.set_isa(before)


def test_the_c_backward_steps_aside_for_what_it_does_not_take():
    """More heads than it holds: the PyTorch backward runs (and gives the gradients)."""
    got = _grads(True, hc=65, h=2, s=4, seed=2)
    assert not got.pop("took C")
    want = _grads(False, hc=65, h=2, s=4, seed=2)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
