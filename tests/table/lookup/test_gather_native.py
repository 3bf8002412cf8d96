"""The C row gather behind ``gather_rows`` on the CPU: the bytes of ``index_select``, for every dtype and
row layout it takes, with or without an output buffer; an id outside the table is refused as before."""

from __future__ import annotations

import pytest
import torch

import ple.kernels.native as native_build
from ple.table.lookup.torch_impl import _gather_fp8_native, _gather_rows_native, dequantize_rows_into, gather_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("width", [1, 3, 160])
def test_native_gather_copies_the_rows_of_index_select(dtype, width):
    assert native_build.available(), "the C kernels must build here"
    g = torch.Generator().manual_seed(width)
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    base = torch.randint(-100, 100, (301, width + 5), generator=g).to(word)
    for data in (base[:, :width], base[:, 5:]):  # rows further apart than they are wide; unaligned starts
        data = data.view(dtype)
        ids = torch.randint(0, data.shape[0], (777,), generator=g)
        ids[:3] = torch.tensor([0, data.shape[0] - 1, 0])
        want = data.view(word).index_select(0, ids)
        got = _gather_rows_native(data, ids, None)
        assert got is not None and got.dtype == dtype
        assert torch.equal(got.view(word), want)
        out = torch.empty_like(got)
        assert gather_rows(data, ids, out=out) is out
        assert torch.equal(out.view(word), want)


def test_ids_outside_the_table_are_refused_and_nothing_else_taken():
    data = torch.randn(10, 4)
    for bad in (10, -1):
        ids = torch.tensor([1, bad, 2])
        assert _gather_rows_native(data, ids, None) is None
        with pytest.raises((IndexError, RuntimeError)):
            gather_rows(data, ids)
    # layouts the C gather does not take fall back to index_select (same values)
    ids = torch.tensor([3, 1])
    assert _gather_rows_native(data.t(), ids, None) is None
    assert _gather_rows_native(data, ids.to(torch.int32), None) is None
    assert torch.equal(gather_rows(data, ids.to(torch.int32)), data[[3, 1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_fp8_gather_dequantizes_as_the_byte_table_does(dtype):
    """Every byte (NaN included), no scale, a global scale, per-row scales: the values of the byte
    lookup table of dequantize_rows_into after the gather, bit for bit."""
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (97, 40), generator=g, dtype=torch.uint8)
    data[0] = torch.arange(40, dtype=torch.uint8) + 100
    data[1, :2] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)
    data = data.view(torch.float8_e4m3fn)
    ids = torch.randint(0, 97, (300,), generator=g)
    ids[:2] = torch.tensor([0, 1])
    for scale in (None, torch.tensor([0.37]), torch.rand(97, 1, generator=g) * 4):
        got = torch.empty(300, 40, dtype=dtype)
        assert _gather_fp8_native(data, scale, ids, got)
        want = torch.empty_like(got)
        rows = data.view(torch.uint8).index_select(0, ids).view(torch.float8_e4m3fn)
        dequantize_rows_into(rows, None if scale is None else scale[ids] if scale.dim() == 2 else scale, want)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan) and nan.any()
        assert torch.equal(got[~nan].view(-1, 1).view(torch.uint8), want[~nan].view(-1, 1).view(torch.uint8))
    assert not _gather_fp8_native(data, None, torch.tensor([97]), torch.empty(1, 40, dtype=dtype))


def test_the_lookup_operator_refuses_a_scale_that_does_not_fit_the_rows():
    from ple.errors import InvalidArgumentError
    from ple.table.lookup import gather_dequant

    data = torch.randn(10, 4).to(torch.float8_e4m3fn)
    ids = torch.tensor([[1, 9]])
    for scale in (torch.ones(3, 1), torch.ones(10), torch.ones(10, 2)):
        with pytest.raises(InvalidArgumentError, match=r"scale.shape=.* does not fit data of 10 rows"):
            torch.ops.ple.gather_dequant(data, scale, ids, torch.float32, torch.empty(1, 8), False, None)
        with pytest.raises(InvalidArgumentError, match=r"scale.shape="):
            gather_dequant(data, scale, ids, torch.float32)
    want = data.float()[[1, 9]].reshape(1, 8) * 2
    assert torch.equal(gather_dequant(data, torch.full((10, 1), 2.0), ids, torch.float32), want)
    assert torch.equal(gather_dequant(data, torch.tensor([2.0]), ids, torch.float32), want)
