"""Lookup in every format: fast path and tiers bit-exact with the literal reference dequantization."""

from __future__ import annotations

import pytest
import torch

from ple.table import IdOutOfRangeError, MemoryTable, format_info
from ple.table.formats.catalog import infer_format
from ple.table.lookup import gather_dequant, gather_dequant_reference, gather_dequant_torch
from tests.table._helpers import DTYPES, ELEMENT, assert_same, make_table, random_ids

SHAPES = [(1, 1, 1), (2, 3, 7), (63, 16, 5), (129, 3, 160)]  # (T, G, head_dim)


def literal(data, scale, ids, dtype):
    """Element-by-element reading of the lookup definition (independent of the package's reference)."""
    T, G = ids.shape
    D = data.shape[1]
    out = torch.empty(T, G * D, dtype=dtype)
    for t in range(T):
        for g in range(G):
            r = int(ids[t, g])
            row = data[r].to(dtype)
            if scale is not None:
                s = scale[r] if scale.dim() == 2 else scale.reshape(1)
                row = row * s.to(dtype)
            out[t, g * D : (g + 1) * D] = row
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_literal(fmt, dtype):
    data, scale = make_table(fmt, 50, 6, seed=3)
    ids = random_ids(50, 7, 3, seed=4)
    assert torch.equal(gather_dequant_reference(data, scale, ids, dtype), literal(data, scale, ids, dtype))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_G{}_D{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_path_and_table_exact(fmt, dtype, shape):
    T, G, D = shape
    rows = 301
    data, scale = make_table(fmt, rows, D, seed=T + G + D)
    ids = random_ids(rows, T, G, seed=T * G)
    ref = gather_dequant_reference(data, scale, ids, dtype)
    assert ref.shape == (T, G * D) and ref.dtype == dtype
    poisoned = torch.full((T, G * D), float("nan"), dtype=dtype)
    fast = gather_dequant_torch(data, scale, ids, dtype, out=poisoned)
    assert fast is poisoned
    assert torch.equal(fast, ref)
    assert torch.equal(gather_dequant(data, scale, ids, dtype), ref)
    table = MemoryTable(data, scale)
    assert table.format == fmt
    got = table.lookup(ids, dtype)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_ids_and_data(fmt, dtype):
    rows, D = 97, 11
    data, scale = make_table(fmt, rows, D + 3, seed=5)
    data = data[:, 2 : 2 + D]  # row stride D+3
    assert not data.is_contiguous()
    if scale is not None and scale.dim() == 2:
        scale = torch.cat([scale, scale * 2], dim=1)[:, :1]
        assert not scale.is_contiguous()
    ids = random_ids(rows, 12, 10, seed=6)[:, ::2]  # [12, 5], non-contiguous
    assert not ids.is_contiguous()
    ref = literal(data, scale, ids, dtype)
    assert torch.equal(gather_dequant_reference(data, scale, ids, dtype), ref)
    assert torch.equal(gather_dequant_torch(data, scale, ids, dtype), ref)
    assert torch.equal(MemoryTable(data, scale).lookup(ids.t().contiguous().t(), dtype), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_values_exact(dtype):
    """Every finite fp8 byte, every int8 value, scales that over/underflow fp16 and bf16."""
    fp8 = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    fp8 = fp8.view(torch.float8_e4m3fn).reshape(-1, 2)  # [127, 2]
    i8 = torch.arange(-128, 128, dtype=torch.int8).reshape(-1, 2)  # [128, 2]
    ids = torch.arange(127).reshape(-1, 1).repeat(1, 3)
    ids[:, 1] = ids[:, 1].flip(0)
    for s in (1.0, 3.1e-3, 1234.567, 6.0e4, 1.0e-30, 3.0e38):
        scale = torch.tensor([s])
        assert_same(gather_dequant_torch(fp8, scale, ids, dtype), literal(fp8, scale, ids, dtype), f"scale {s}")
    row_scale = torch.logspace(-8, 8, 127).reshape(-1, 1)
    assert_same(gather_dequant_torch(fp8, row_scale, ids, dtype), literal(fp8, row_scale, ids, dtype))
    row_scale = torch.logspace(-8, 8, 128).reshape(-1, 1)
    assert_same(gather_dequant_torch(i8, row_scale, ids, dtype), literal(i8, row_scale, ids, dtype))


def test_scale_in_other_float_dtype():
    data, scale = make_table("fp8", 40, 4, seed=8)
    for sd in (torch.bfloat16, torch.float16, torch.float64):
        s = scale.to(sd)
        ids = random_ids(40, 5, 2)
        for dtype in DTYPES:
            assert torch.equal(MemoryTable(data, s).lookup(ids, dtype), literal(data, s, ids, dtype))


def test_empty_ids():
    data, scale = make_table("int8_row", 10, 4)
    ids = torch.empty(0, 3, dtype=torch.int64)
    out = MemoryTable(data, scale).lookup(ids, torch.bfloat16)
    assert out.shape == (0, 12) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [100, 101, -1, 2**40])
def test_out_of_range_id_names_id_and_position(bad):
    data, scale = make_table("fp8", 100, 4)
    table = MemoryTable(data, scale)
    ids = random_ids(100, 5, 4)
    ids[3, 2] = bad
    ids[4, 0] = bad  # only the first bad position is named
    for fn in (
        lambda: table.lookup(ids, torch.float32),
        lambda: table.start_prefetch(ids, torch.float32),
        lambda: gather_dequant_reference(data, scale, ids, torch.float32),
        lambda: gather_dequant_torch(data, scale, ids, torch.float32),
    ):
        with pytest.raises(IdOutOfRangeError, match=rf"row id {bad} at \(token 3, head 2\).*\[0, 100\)"):
            fn()
    with pytest.raises(IndexError):  # unchecked lookups still never read outside the table
        table.lookup(ids, torch.float32, check=False)


def test_bad_ids_and_dtype_refused():
    table = MemoryTable(*make_table("bf16", 10, 4))
    with pytest.raises(ValueError, match="int64"):
        table.lookup(torch.zeros(2, 2, dtype=torch.int32), torch.float32)
    with pytest.raises(ValueError, match=r"2-D tensor \[T, G\]"):
        table.lookup(torch.zeros(4, dtype=torch.int64), torch.float32)
    with pytest.raises(ValueError, match="lookup dtype"):
        table.lookup(torch.zeros(2, 2, dtype=torch.int64), torch.int8)


def test_format_inference_and_validation():
    x = torch.randn(6, 4)
    assert infer_format(x.bfloat16(), None) == "bf16"
    assert infer_format(x.to(torch.float8_e4m3fn), torch.ones(1)) == "fp8"
    assert infer_format(x.to(torch.float8_e4m3fn), torch.ones(6, 1)) == "fp8_row"
    assert infer_format(x.to(torch.int8), torch.ones(6, 1)) == "int8_row"
    assert MemoryTable(x.to(torch.float8_e4m3fn), torch.tensor(2.0)).scale.shape == (1,)
    with pytest.raises(ValueError, match="needs a scale"):
        MemoryTable(x.to(torch.int8))
    with pytest.raises(ValueError, match=r"per-row scale of shape \[6, 1\]"):
        MemoryTable(x.to(torch.int8), torch.ones(5, 1), format="int8_row")
    with pytest.raises(ValueError, match="global scale of shape"):
        MemoryTable(x.to(torch.float8_e4m3fn), torch.ones(2), format="fp8")
    with pytest.raises(ValueError, match="stores torch.float16"):
        MemoryTable(x, format="fp16")
    with pytest.raises(ValueError, match="has no scale"):
        MemoryTable(x, torch.ones(1), format="fp32")
    with pytest.raises(ValueError, match="unknown table format 'fp4'"):
        format_info("fp4")
    with pytest.raises(ValueError, match="2-D"):
        MemoryTable(torch.zeros(3))


def test_empty_table_filled_by_shards(fmt):
    rows, D, S = 23, 5, 7
    data, scale = make_table(fmt, rows, D, seed=9)
    t = MemoryTable.empty(rows, D, fmt)
    assert t.format == fmt and t.rows == rows and t.head_dim == D and t.device == torch.device("cpu")
    assert t.data.dtype == format_info(fmt).storage_dtype
    ids = random_ids(rows, 9, 4)
    if fmt == "fp8":
        t.data.copy_(data)
        assert t.lookup(ids, torch.float32).isnan().all(), "an unfilled global scale must poison the rows"
    for a in range(0, rows, S):
        b = min(rows, a + S)
        t.data[a:b].copy_(data[a:b])
        if scale is not None and scale.dim() == 2:
            t.scale[a:b].copy_(scale[a:b])
    if fmt == "fp8":
        t.scale.copy_(scale)
    for dtype in DTYPES:
        assert torch.equal(t.lookup(ids, dtype), gather_dequant_reference(data, scale, ids, dtype))
    itemsize = format_info(fmt).itemsize
    extra = {"none": 0, "global": 4, "row": 4 * rows}[format_info(fmt).scale_kind]
    assert t.nbytes == rows * D * itemsize + extra


@pytest.mark.parametrize("fmt_", ELEMENT)
def test_lookup_into_other_output_dtype_is_fresh_tensor(fmt_):
    data, scale = make_table(fmt_, 30, 3)
    t = MemoryTable(data, scale)
    ids = random_ids(30, 4, 2)
    a = t.lookup(ids, torch.float32)
    b = t.lookup(ids, torch.float32)
    assert a.data_ptr() != b.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [1, 2, 3, 4, 8, 20, 160])
@pytest.mark.parametrize("col0", [0, 1, 4])
def test_gather_rows_word_copies_are_exact(dtype, D, col0):
    from ple.table.lookup.torch_impl import gather_rows

    g = torch.Generator().manual_seed(D)
    nbytes = 50 * (D + 8) * torch.empty((), dtype=dtype).element_size()
    base = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype).reshape(50, -1)
    data = base[:, col0 : col0 + D]
    ids = torch.randint(0, 50, (77,), generator=g)
    want = data.contiguous().view(torch.uint8).index_select(0, ids)
    assert torch.equal(gather_rows(data, ids).contiguous().view(torch.uint8), want)
    out = torch.zeros(77, D, dtype=dtype)
    assert gather_rows(data, ids, out=out) is out
    assert torch.equal(out.view(torch.uint8), want)
