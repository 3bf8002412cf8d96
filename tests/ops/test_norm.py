import pytest
import torch

from ple.ops import grouped_rms_norm
from ple.ops.norm import reference, torch_impl
from tests.ops._helpers import assert_no_worse_than_reference


def _hf_norm(weight: torch.Tensor, group_size: int, eps: float):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    mod = Qwen4ExpTextRMSNorm(weight.shape[0], group_size=group_size, eps=eps)
    with torch.no_grad():
        mod.weight.copy_(weight)
    return mod


def _exact(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    g = x.double().reshape(*x.shape[:-1], -1, group_size)
    y = g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return y.flatten(-2) * (1 + weight.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, groups, group_size", [(1, 1, 8), (2, 3, 12), (63, 4, 20), (129, 2, 37)])
def test_reference_matches_transformers_bitwise(dtype, tokens, groups, group_size):
    g = torch.Generator().manual_seed(tokens * 31 + group_size)
    channels = groups * group_size
    x = (3 * torch.randn(tokens, channels, generator=g)).to(dtype)
    w = (0.3 * torch.randn(channels, generator=g)).to(dtype)
    want = _hf_norm(w, group_size, 1e-6).to(dtype)(x)
    got = reference.grouped_rms_norm(x, w, group_size, 1e-6)
    assert got.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, groups, group_size", [(1, 1, 8), (2, 3, 12), (63, 4, 20), (129, 2, 37)])
@pytest.mark.parametrize("fn", [torch_impl.grouped_rms_norm, grouped_rms_norm], ids=["torch_impl", "operator"])
def test_fast_path_vs_reference(fn, dtype, tokens, groups, group_size):
    g = torch.Generator().manual_seed(tokens * 7 + group_size)
    channels = groups * group_size
    x = (2 * torch.randn(tokens, channels, generator=g)).to(dtype)
    w = (0.3 * torch.randn(channels, generator=g)).to(dtype)
    ref = reference.grouped_rms_norm(x, w, group_size, 1e-5)
    got = fn(x, w, group_size, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    else:
        assert_no_worse_than_reference(got, ref, _exact(x, w, group_size, 1e-5), atol=1e-3)


def test_non_contiguous_and_leading_dims():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, 2 * 30, generator=g)
    x = base[::2, ::2]  # [20, 30], strided in both dims
    w = torch.randn(60, generator=g)[::2]
    assert not x.is_contiguous() and not w.is_contiguous()
    ref = reference.grouped_rms_norm(x.contiguous(), w.contiguous(), 10, 1e-6)
    torch.testing.assert_close(torch_impl.grouped_rms_norm(x, w, 10, 1e-6), ref, rtol=1e-6, atol=1e-6)
    x3 = x.reshape(4, 5, 30)
    torch.testing.assert_close(
        torch_impl.grouped_rms_norm(x3, w, 10, 1e-6), ref.reshape(4, 5, 30), rtol=1e-6, atol=1e-6
    )


def test_zero_rows_and_eps():
    x = torch.zeros(3, 8)
    w = torch.zeros(8)
    for fn in (reference.grouped_rms_norm, torch_impl.grouped_rms_norm):
        assert torch.equal(fn(x, w, 4, 1e-6), x)
        assert fn(torch.zeros(0, 8), w, 4, 1e-6).shape == (0, 8)


@pytest.mark.parametrize("fn", [reference.grouped_rms_norm, torch_impl.grouped_rms_norm])
def test_validation(fn):
    x = torch.randn(4, 12)
    with pytest.raises(ValueError, match="group_size=5"):
        fn(x, torch.zeros(12), 5, 1e-6)
    with pytest.raises(ValueError, match=r"weight.shape=\(11,\)"):
        fn(x, torch.zeros(11), 4, 1e-6)
    with pytest.raises(TypeError, match="x.dtype=torch.int64"):
        fn(x.long(), torch.zeros(12), 4, 1e-6)


def test_operator_wrapper_refuses_wrong_scalar_types_with_ple_errors():
    from ple import ops
    from ple.errors import ArgumentTypeError

    x = torch.randn(4, 12)
    with pytest.raises(ArgumentTypeError, match=r"group_size=2\.5"):
        ops.grouped_rms_norm(x, torch.zeros(12), 2.5, 1e-6)
    with pytest.raises(ArgumentTypeError, match="group_size=True"):
        ops.grouped_rms_norm(x, torch.zeros(12), True, 1e-6)
    with pytest.raises(ArgumentTypeError, match="eps='1e-6'"):
        ops.grouped_rms_norm(x, torch.zeros(12), 4, "1e-6")
    assert torch.equal(
        ops.grouped_rms_norm(x, torch.zeros(12), 4, 1e-6), torch_impl.grouped_rms_norm(x, torch.zeros(12), 4, 1e-6)
    )
