"""The C row gather behind ``gather_rows`` on the CPU: the bytes of ``index_select``, for every dtype and
row layout it takes, with or without an output buffer; an id outside the table is refused as before."""

from __future__ import annotations

import pytest
import torch

import ple._native as native_build
from ple.table.lookup.torch_impl import _gather_rows_native, gather_rows


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
