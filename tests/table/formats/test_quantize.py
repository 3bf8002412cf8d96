"""Per-row and global quantizers: scales, rounding, error bounds, error statistics."""

from __future__ import annotations

import pytest
import torch

from ple.table import dequantize, quantize_rows
from ple.table.formats.quantize import quantization_error, quantize_global


@pytest.mark.parametrize("n,D", [(1, 1), (7, 160), (129, 33)])
def test_int8_rows(n, D):
    g = torch.Generator().manual_seed(n * D)
    x = torch.randn(n, D, generator=g) * torch.logspace(-3, 3, n).reshape(n, 1)
    q, s = quantize_rows(x, "int8_row")
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (n, 1)
    amax = x.abs().amax(dim=1, keepdim=True)
    assert torch.equal(s, amax / 127)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    # round to nearest: the error is at most half a step (plus fp32 noise)
    err = (q.double() * s.double() - x.double()).abs()
    assert bool((err <= s.double() * (0.5 + 1e-5)).all())
    assert torch.equal(q, torch.round(x / s).to(torch.int8))


@pytest.mark.parametrize("n,D", [(1, 1), (7, 160), (129, 33)])
def test_fp8_rows(n, D):
    g = torch.Generator().manual_seed(n + D)
    x = torch.randn(n, D, generator=g) * torch.logspace(-3, 3, n).reshape(n, 1)
    q, s = quantize_rows(x, "fp8_row")
    assert q.dtype == torch.float8_e4m3fn and s.shape == (n, 1)
    assert torch.equal(s, x.abs().amax(dim=1, keepdim=True) / 448)
    assert float(q.float().abs().max()) == 448.0
    assert not q.float().isnan().any()
    y = x / s
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, abs <= 2^-10 for subnormals
    err = (q.float() - y).abs()
    assert bool((err <= torch.maximum(y.abs() * 2**-4, torch.full_like(y, 2**-10)) * (1 + 1e-6)).all())


def test_zero_rows_and_bad_input():
    x = torch.zeros(3, 4)
    x[1] = torch.tensor([1.0, -2.0, 0.5, 0.0])
    for to in ("fp8_row", "int8_row"):
        q, s = quantize_rows(x, to)
        assert s[0, 0] == 1 and s[2, 0] == 1 and torch.equal(q[0].float(), torch.zeros(4))
        assert torch.equal(dequantize(q, s)[0], torch.zeros(4))
    bad = torch.ones(2, 3)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite value nan at row 1, column 2"):
        quantize_rows(bad, "int8_row")
    with pytest.raises(ValueError, match="to must be"):
        quantize_rows(x, "fp8")
    with pytest.raises(ValueError, match=r"\[n, D\]"):
        quantize_rows(torch.ones(3), "fp8_row")


def test_global_fp8():
    x = torch.randn(50, 8) * 7
    q, s = quantize_global(x)
    assert s.shape == (1,) and torch.equal(s, (x.abs().max() / 448).reshape(1))
    assert float(q.float().abs().max()) == 448.0


def test_error_statistics():
    x = torch.tensor([[1.0, -2.0, 4.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    exact = quantization_error(x, x, None)
    assert exact.max_rel == 0 and exact.rms_rel == 0 and exact.rows == 3
    approx = x.clone()
    approx[0, 1] = -1.5  # |err| 0.5, row max |x| 4 -> 0.125
    approx[2, 0] = 3.3  # |err| 0.3, row max 3 -> 0.1
    e = quantization_error(x, approx, None)
    assert e.max_rel == pytest.approx(0.125)
    assert e.rms_rel == pytest.approx(((0.25 + 0.09) / (1 + 4 + 16 + 9)) ** 0.5)
    q, s = quantize_rows(torch.randn(64, 160), "int8_row")
    err = quantization_error(dequantize(q, s), q, s)
    assert err.max_rel == 0
    x = torch.randn(256, 160)
    e8 = quantization_error(x, *quantize_rows(x, "int8_row"))
    ef = quantization_error(x, *quantize_rows(x, "fp8_row"))
    assert 0 < e8.rms_rel < 0.01 and 0 < ef.rms_rel < 0.05 and e8.max_rel <= 0.5 / 127 * 1.0001
