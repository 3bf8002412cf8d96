"""The block-format C lookup under each instruction set this CPU runs (portable, AVX2, AVX-512, forced
with ``ple.kernels.native.set_isa``, the library's one setting): bit for bit the reference decode, and the same
bits, NaN payloads included, whichever is forced. The block lookup has one code path today (the build's
baseline); this holds any per-instruction-set variant of it to the same bits."""

from __future__ import annotations

import pytest
import torch

import ple.kernels.native as native_build
from ple.table import format_info
from ple.table.formats.catalog import BLOCK_FORMATS
from ple.table.lookup import gather_dequant_reference
from ple.table.lookup.native import gather_dequant_blocks_native, native_available
from tests.table._helpers import DTYPES, make_table, random_ids

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(_INT_VIEW[x.dtype])


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """Equal bits everywhere, NaN matched with NaN (any payload): -0.0 differs from 0.0 here."""
    assert got.dtype == want.dtype and got.shape == want.shape, msg
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{msg}: NaN positions differ"
    bad = (_bits(got) != _bits(want)) & ~nan
    assert not bad.any(), f"{msg}: {int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}"


def _tables(fmt: str, head_dim: int):
    """A quantized random table, and rows of random bytes (NaN and infinite scales, subnormals)."""
    yield "quantized", *make_table(fmt, 97, head_dim)
    g = torch.Generator().manual_seed(head_dim)
    raw = torch.randint(0, 256, (97, format_info(fmt).row_nbytes(head_dim)), generator=g, dtype=torch.uint8)
    yield "random bytes", raw, (torch.tensor([0.75]) if fmt == "nvfp4" else None)


def _isas() -> list[str]:
    names = [n for n in native_build.ISAS if native_build.isa_available(n)]
    assert names[0] == "portable"
    return names


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("head_dim", [32, 160, 256])
def test_each_isa_decodes_blocks_bit_for_bit(fmt, head_dim):
    assert native_available(), "the C kernels must build here"
    ids = random_ids(97, 300, 4)  # 1200 ids: several threads' share
    before = native_build.current_isa()
    try:
        for kind, data, scale in _tables(fmt, head_dim):
            for dtype in DTYPES:
                want = gather_dequant_reference(data, scale, ids, dtype, format=fmt)
                first = None
                for isa in _isas():
                    native_build.set_isa(isa)
                    assert native_build.current_isa() == isa
                    got = gather_dequant_blocks_native(data, scale, ids, dtype, format=fmt)
                    msg = f"{fmt} {kind} head_dim {head_dim} {dtype} on {isa}"
                    _assert_bits_equal(got, want, msg)
                    if first is None:
                        first = got
                    else:  # NaN payloads too: the variants run the same operations
                        assert torch.equal(_bits(got), _bits(first)), f"{msg}: other bits than portable"
    finally:
        native_build.set_isa(before)
    assert native_build.current_isa() == before
