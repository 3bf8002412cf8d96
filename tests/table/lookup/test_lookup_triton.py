"""The Triton gather+dequantize kernel: natively on a CUDA device, otherwise on CPU tensors under the
Triton interpreter (set up by tests/conftest.py; tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from ple.table import MmapTable
from ple.table.formats.catalog import BLOCK_FORMATS
from ple.table.lookup import gather_dequant_reference
from tests.conftest import TRITON_DEVICE, TRITON_INTERPRETED
from tests.table._helpers import DTYPES, ELEMENT, assert_same, make_table, random_ids, write_sparse_table_file

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def tri():
    """``ple.table.lookup.triton_impl``, its kernel built natively or for the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    import ple.table.lookup.triton_impl as mod

    assert isinstance(mod._gather_dequant_kernel, InterpretedFunction) == TRITON_INTERPRETED
    return mod


def _device():
    return TRITON_DEVICE


@pytest.mark.parametrize("fmt", ELEMENT)
@pytest.mark.parametrize("shape", [(3, 2, 20), (1, 1, 7), (2, 3, 160)], ids=lambda s: "T{}_G{}_D{}".format(*s))
def test_triton_exact(tri, fmt, shape):
    mod = tri
    T, G, D = shape
    data, scale = make_table(fmt, 37, D, seed=D)
    ids = random_ids(37, T, G, seed=T)
    dev = _device()
    for dtype in DTYPES:
        ref = gather_dequant_reference(data, scale, ids, dtype)
        out = torch.full((T, G * D), float("nan"), dtype=dtype, device=dev)
        got = mod.gather_dequant_triton(
            data.to(dev), None if scale is None else scale.to(dev), ids.to(dev), dtype, out=out
        )
        assert got is out
        assert_same(got.cpu(), ref, f"{fmt} {dtype}")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 overflow to inf, on purpose
def test_triton_extreme_values_and_strides(tri):
    mod = tri
    dev = _device()
    fp8 = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    base = fp8.view(torch.float8_e4m3fn).reshape(-1, 2).repeat(1, 2)  # [127, 4]
    data = base[:, 1:3]  # non-contiguous rows
    ids = torch.arange(127).reshape(-1, 1)[::2]  # [64, 1] strided view
    for scale in (torch.tensor([3.1e-3]), torch.tensor([6.0e4]), torch.logspace(-6, 6, 127).reshape(-1, 1)):
        for dtype in DTYPES:
            ref = gather_dequant_reference(data, scale, ids, dtype)
            got = mod.gather_dequant_triton(data.to(dev), scale.to(dev), ids.to(dev), dtype)
            assert_same(got.cpu(), ref, f"scale {scale.flatten()[:2]} {dtype}")
    # fp32 -> bf16 rounding ties and carries (the interpreter's own cast truncates)
    x = torch.tensor([[1.00390625, 1.01171875, -1.00390625, 3.0e38, 1.0e-3, -0.0]], dtype=torch.float32)
    x = torch.cat([x, torch.randn(8, 6) * 100])
    ids = torch.arange(9).reshape(9, 1)
    got = mod.gather_dequant_triton(x.to(dev), None, ids.to(dev), torch.bfloat16)
    assert_same(got.cpu(), gather_dequant_reference(x, None, ids, torch.bfloat16))


def test_triton_unchecked_bad_ids_give_zero_rows(tri):
    mod = tri
    data, scale = make_table("int8_row", 10, 4)
    ids = torch.tensor([[1, 10], [-1, 2]])
    got = mod.gather_dequant_triton(data, scale, ids, torch.float32, check=False)
    ref_ok = gather_dequant_reference(data, scale, torch.tensor([[1, 2]]), torch.float32)
    assert torch.equal(got[0, :4], ref_ok[0, :4]) and torch.equal(got[1, 4:], ref_ok[0, 4:])
    assert torch.equal(got[0, 4:], torch.zeros(4)) and torch.equal(got[1, :4], torch.zeros(4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="memory map of host rows: interpreter-only check")
def test_triton_int64_row_addressing(tri, tmp_path):
    """Byte offsets past 2^31: a sparse 2.3 GB fp8 table, rows written near the end."""
    mod = tri
    rows, D = 14_500_000, 160  # 2.32e9 bytes > 2^31
    ids = torch.tensor([[rows - 1, 13_500_001], [0, 13_421_773]])  # 13_421_773 * 160 > 2^31
    flat = ids.reshape(-1)
    # bytes 8..107: no NaN pattern
    vals = ((torch.arange(4 * D).reshape(4, D) % 100) + 8).to(torch.uint8).view(torch.float8_e4m3fn)
    path = write_sparse_table_file(tmp_path / "big.ple", rows, D, "fp8", "h", flat, vals, torch.tensor([0.5]))
    table = MmapTable.open(path)
    for dtype in (torch.bfloat16, torch.float32):
        got = mod.gather_dequant_triton(table.data, table.scale, ids, dtype)
        want = (vals.to(dtype) * torch.tensor([0.5]).to(dtype)).reshape(2, 2 * D)
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 overflow to inf, on purpose
def test_triton_block_formats_exact(tri, fmt):
    """Every block format, every activation dtype: the kernel's bits are the reference's (fused
    multiply-add off, bf16 and fp16 rounded to nearest even)."""
    data, scale = make_table(fmt, 9, 64, seed=3)
    if fmt == "q8_0":  # values past the fp16 range and fp16 subnormals
        data[0, :2] = torch.tensor([0xFF, 0x7B], dtype=torch.uint8)  # d = 65504
        data[1, :2] = torch.tensor([0x01, 0x00], dtype=torch.uint8)  # d = 2^-24
    ids = torch.tensor([[0, 1], [8, 3], [5, 5]])
    dev = _device()
    for dtype in DTYPES:
        ref = gather_dequant_reference(data, scale, ids, dtype, format=fmt)
        got = tri.gather_dequant_triton(
            data.to(dev), None if scale is None else scale.to(dev), ids.to(dev), dtype, format=fmt
        )
        assert_same(got.cpu(), ref, f"{fmt} {dtype}")
