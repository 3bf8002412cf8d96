"""``ple eval``'s passes over the logits (``ple_eval.c``, and the PyTorch path where the kernels are off)
against float64 PyTorch: KL divergence, negative log-likelihood, top token and the change of the actual
token's probability, for candidates from identical to unrelated, logits in bf16 and float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ple.commands.evaluate import compare_logits, reference_of
from ple.kernels import native as _native

needs_native = pytest.mark.skipif(not _native.available(), reason="the C kernels do not build here")

P, V = 6, 50_000


def logits_and_candidates():
    """Reference logits with a realistic spread (a few likely tokens, a long tail) and candidates:
    identical; close (a q8_0 table: KL about 1e-5); moderately and far off; one token raised far above
    the reference's maximum (the kernel's own-shift path); unrelated."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(P, V, generator=g) * 2.5 + torch.rand(P, V, generator=g).log() * 2
    z[:, :20] += torch.linspace(14, 4, 20)
    far = z.clone()
    far[:, 7] = z.max(-1).values + 80
    cands = {
        "identical": z.clone(),
        "close": z + 2e-3 * torch.randn(P, V, generator=g),
        "moderate": z + 0.1 * torch.randn(P, V, generator=g),
        "far": z + torch.randn(P, V, generator=g),
        "raised": far,
        "unrelated": torch.randn(P, V, generator=g) * 30,
    }
    targets = torch.randint(0, V, (P,), generator=g)
    targets[0] = 0  # a likely token
    return z, cands, targets


def float64(zr: torch.Tensor, zc: torch.Tensor, t: torch.Tensor):
    lr = torch.log_softmax(zr.double(), -1)
    lc = torch.log_softmax(zc.double(), -1)
    kl = (lr.exp() * (lr - lc)).sum(-1)
    nll_r, nll_c = -lr.gather(1, t[:, None])[:, 0], -lc.gather(1, t[:, None])[:, 0]
    return kl.numpy(), nll_r.numpy(), nll_c.numpy(), ((-nll_c).exp() - (-nll_r).exp()).numpy()


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_against_float64(dtype):
    z, cands, t = logits_and_candidates()
    zr = z.to(dtype)
    ref, nll_r = reference_of(zr, t, native=True)
    assert ref.logits is not None and ref.logp is None
    want_top = zr.double().argmax(-1)
    assert torch.equal(ref.top, want_top)
    for name, c in cands.items():
        zc = c.to(dtype)
        got = compare_logits(ref, zc, t)
        kl, want_nll_r, want_nll_c, dp = float64(zr, zc, t)
        np.testing.assert_allclose(nll_r, want_nll_r, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got["nll"], want_nll_c, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got["delta_p"], dp, rtol=0, atol=1e-6, err_msg=name)
        assert np.array_equal(got["same_top"], (zc.double().argmax(-1) == want_top).numpy()), name
        if name == "identical":
            assert (got["kld"] == 0).all() and got["same_top"].all() and (got["delta_p"] == 0).all()
        else:
            assert (kl > 0).all()
            # far tighter than float32 log-softmaxes give: a close candidate's KL is its changed values'
            np.testing.assert_allclose(got["kld"], kl, rtol=1e-4, atol=0, err_msg=name)
    close = compare_logits(ref, cands["close"].to(dtype), t)["kld"]
    assert 1e-7 < close.mean() < 1e-3  # the small-KL case is exercised


@needs_native
def test_kernel_same_on_every_instruction_set():
    z, cands, t = logits_and_candidates()
    zr = z.to(torch.bfloat16)
    runs = []
    before = _native.set_isa("portable")
    try:
        for isa in _native.ISAS:
            if not _native.isa_available(isa):
                continue
            _native.set_isa(isa)
            ref, nll = reference_of(zr, t, native=True)
            ident = compare_logits(ref, zr.clone(), t)
            assert (ident["kld"] == 0).all() and ident["same_top"].all(), isa
            runs.append((isa, nll, compare_logits(ref, cands["close"].to(torch.bfloat16), t)))
    finally:
        _native.set_isa(before)
    isa0, nll0, c0 = runs[0]
    for isa, nll, c in runs[1:]:
        np.testing.assert_allclose(nll, nll0, rtol=0, atol=1e-6, err_msg=isa)
        np.testing.assert_allclose(c["kld"], c0["kld"], rtol=1e-4, err_msg=isa)
        assert np.array_equal(c["same_top"], c0["same_top"]), isa


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pytorch_path_where_the_kernels_are_off(dtype, monkeypatch):
    """``PLE_NATIVE=0``: the PyTorch passes, equal to float64 within float32 log-softmax rounding."""
    monkeypatch.setenv("PLE_NATIVE", "0")
    z, cands, t = logits_and_candidates()
    zr = z.to(dtype)
    ref, nll_r = reference_of(zr, t)
    assert ref.logp is not None and ref.logits is None
    assert torch.equal(ref.top, zr.double().argmax(-1))
    for name in ("identical", "moderate", "far", "unrelated"):
        zc = cands[name].to(dtype)
        got = compare_logits(ref, zc, t)
        kl, want_nll_r, want_nll_c, dp = float64(zr, zc, t)
        np.testing.assert_allclose(nll_r, want_nll_r, rtol=0, atol=1e-4, err_msg=name)
        np.testing.assert_allclose(got["nll"], want_nll_c, rtol=0, atol=1e-4, err_msg=name)
        np.testing.assert_allclose(got["delta_p"], dp, rtol=0, atol=1e-4, err_msg=name)
        if name == "identical":
            assert (got["kld"] == 0).all() and got["same_top"].all()
        else:
            np.testing.assert_allclose(got["kld"], kl, rtol=1e-2, atol=1e-5, err_msg=name)


@needs_native
def test_kernel_refuses_a_target_outside_the_vocabulary():
    from ple.errors import InvalidArgumentError

    z = torch.randn(3, 100).bfloat16()
    with pytest.raises(InvalidArgumentError, match="target token id 100 is outside"):
        reference_of(z, torch.tensor([0, 100, 5]), native=True)
    ref, _ = reference_of(z, torch.tensor([0, 1, 5]), native=True)
    with pytest.raises(InvalidArgumentError, match="target token id -1 is outside"):
        compare_logits(ref, z, torch.tensor([0, -1, 5]))


def test_the_pytorch_path_refuses_a_target_outside_the_vocabulary_as_the_kernel_does():
    """``PLE_NATIVE=0`` (or no C compiler): the same ple error as the C kernel, never a raw torch error."""
    from ple.errors import InvalidArgumentError

    z = torch.randn(3, 100)
    with pytest.raises(InvalidArgumentError, match="target token id 100 is outside the logits' vocabulary"):
        reference_of(z, torch.tensor([0, 100, 5]), native=False)
    ref, _ = reference_of(z, torch.tensor([0, 1, 5]), native=False)
    with pytest.raises(InvalidArgumentError, match="target token id -1 is outside the logits' vocabulary"):
        compare_logits(ref, z, torch.tensor([0, -1, 5]))
    with pytest.raises(InvalidArgumentError, match="targets of shape"):
        compare_logits(ref, z, torch.tensor([0, 1]))
