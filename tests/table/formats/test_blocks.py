"""Block formats (q8_0 ... nvfp4): blocks bit-equal to the ``gguf`` package's, values bit-equal to its
``dequantize`` (and, for the fp4 formats, to a literal decode from their definitions), and every
lookup path and tier serving them bit-equal to the reference."""

from __future__ import annotations

import gguf  # the oracle: a dev dependency, so a missing install fails here
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ple.errors import InvalidArgumentError
from ple.table import CachedTable, MemoryTable, MmapTable, format_info
from ple.table.base import TableRef
from ple.table.formats.blocks import E2M1_VALUES, dequantize_blocks, nvfp4_global_scale, quantize_blocks
from ple.table.formats.catalog import BLOCK_FORMATS
from ple.table.lookup import gather_dequant_reference, gather_dequant_torch
from ple.table.lookup.native import gather_dequant_blocks_native, native_available
from tests.table._helpers import DTYPES, assert_same, make_table, random_ids, write_file

GGML = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "mxfp4")
QUANTIZED_BY_GGUF = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "mxfp4")


def _qtype(fmt):
    return getattr(gguf.GGMLQuantizationType, fmt.upper())


def _values(rows=64, D=160, seed=0):
    """Rows of varied magnitude, plus rows that probe the edges: zeros, constants, one big value,
    exact ties of the rounding rules, tiny numbers."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, D)) * np.exp(rng.standard_normal((rows, 1)) * 2)).astype(np.float32)
    x[0] = 0
    x[1] = 0.75
    x[2, :] = 0
    x[2, 5] = -3.0
    x[3] = np.tile(np.arange(-16, 16, dtype=np.float32) / 2, D // 32)  # halves: ties
    x[4] = 1e-30
    x[5] = -x[6]
    return x


@pytest.mark.parametrize("fmt", QUANTIZED_BY_GGUF)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_blocks_equal_gguf_quantize(fmt, seed):
    x = _values(seed=seed)
    ours = quantize_blocks(x, fmt)
    assert ours.shape == (x.shape[0], format_info(fmt).row_nbytes(160))
    np.testing.assert_array_equal(ours, gguf_quantize(x, _qtype(fmt)))


@pytest.mark.parametrize("fmt", GGML)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # E8M0 255 times 12 is inf, in both
def test_values_equal_gguf_dequantize(fmt):
    info = format_info(fmt)
    rng = np.random.default_rng(7)
    # random bytes everywhere, with finite fp16 block scales (and any E8M0 exponent for mxfp4)
    blocks = rng.integers(0, 256, size=(300, info.block_nbytes), dtype=np.uint8)
    if fmt != "mxfp4":
        d = (rng.standard_normal(300) * np.exp(rng.uniform(-12, 10, 300))).astype(np.float16)
        blocks[:, :2] = d.view(np.uint8).reshape(300, 2)
        if fmt in ("q4_1", "q5_1"):
            m = (rng.standard_normal(300) * 10).astype(np.float16)
            blocks[:, 2:4] = m.view(np.uint8).reshape(300, 2)
    rows = blocks.reshape(60, 5 * info.block_nbytes)
    want = gguf_dequantize(rows, _qtype(fmt))
    got = dequantize_blocks(torch.from_numpy(rows), fmt).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _e2m1(code):
    """E2M1 from its definition: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 subnormal."""
    code = int(code)
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def _e4m3(b):
    """E4M3 (fn) from its definition: bias 7, exponent 0 subnormal, 0x7f/0xff NaN."""
    b = int(b)
    if b & 0x7F == 0x7F:
        return float("nan")
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 15, b & 7
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def test_mxfp4_and_nvfp4_equal_a_literal_decode():
    rng = np.random.default_rng(3)
    assert [_e2m1(c) for c in range(16)] == list(E2M1_VALUES)
    mx = rng.integers(0, 256, size=(4, 5 * 17), dtype=np.uint8)
    got = dequantize_blocks(torch.from_numpy(mx), "mxfp4").numpy()
    for r in range(4):
        for c in range(160):
            blk = mx[r, (c // 32) * 17 : (c // 32 + 1) * 17]
            j = c % 32
            code = (blk[1 + j % 16] >> (4 * (j // 16))) & 15
            want = np.float32(2.0 ** (int(blk[0]) - 127)) * np.float32(_e2m1(code)) if blk[0] < 255 else None
            if want is not None:
                assert got[r, c] == want, (r, c)
    nv = rng.integers(0, 256, size=(4, 90), dtype=np.uint8)
    nv[:, 80:] &= 0x7E  # finite, non-negative block scales
    g = np.float32(0.37)
    got = dequantize_blocks(torch.from_numpy(nv), "nvfp4", float(g)).numpy()
    for r in range(4):
        for c in range(160):
            code = (nv[r, c // 2] >> (4 * (c % 2))) & 15
            want = np.float32(np.float32(_e2m1(code)) * np.float32(_e4m3(nv[r, 80 + c // 16]))) * g
            assert got[r, c] == want, (r, c)


def test_nvfp4_blocks_round_trip_within_the_format_step():
    x = _values(seed=4)
    g = nvfp4_global_scale(float(np.abs(x).max()))
    q = quantize_blocks(x, "nvfp4", g)
    assert q.shape == (64, 90)
    y = dequantize_blocks(torch.from_numpy(q), "nvfp4", g).numpy()
    blocks = np.abs(x).reshape(64, 10, 16).max(axis=2, keepdims=True)
    err = np.abs(y - x).reshape(64, 10, 16)
    # half the E2M1 step at the top (1.0 of 6) plus the E4M3 scale's rounding (1/16): about 1/4 of the block max
    assert (err <= blocks * 0.26 + 1e-30).all()
    assert np.array_equal(y[0], np.zeros(160, np.float32)) and len(set(y[1].tolist())) == 1


def _best_index_int8(grid, x: float) -> int:
    """GGML's ``best_index_int8`` as its C reads: a binary search, then the lower neighbour only when
    strictly nearer."""
    if x <= grid[0]:
        return 0
    if x >= grid[-1]:
        return len(grid) - 1
    lo, hi = 0, len(grid) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < grid[mid]:
            hi = mid
        else:
            lo = mid
    return hi - 1 if x - grid[hi - 1] < grid[hi] - x else hi


def test_iq4_nl_nearest_point_is_ggmls_and_the_words_say_so():
    """Halfway between two grid points goes up, as GGML's ``best_index_int8`` (every midpoint, every
    grid point and values near them); the docstring says the same, and docs/FORMATS.md names the
    quantizer llama-quantize runs and GGML's NVFP4 type (blocks of 64, per the gguf package: a row of
    160 values does not fill them)."""
    from pathlib import Path

    from ple.table.formats.blocks import IQ4NL_VALUES, _nearest_iq4

    grid = np.asarray(IQ4NL_VALUES, dtype=np.float32)
    mids = (grid[:-1] + grid[1:]) / 2
    v = np.concatenate([mids, grid, np.nextafter(mids, -np.inf), np.nextafter(mids, np.inf), [-200.0, 200.0]])
    v = v.astype(np.float32)
    got = _nearest_iq4(v[None, :], grid)[0]
    assert [int(i) for i in got] == [_best_index_int8(grid, float(x)) for x in v]
    assert all(int(got[i]) == i + 1 for i in range(len(mids)))  # halfway: up
    assert "the upper one unless the lower is strictly nearer" in " ".join(_nearest_iq4.__doc__.split())
    page = " ".join((Path(__file__).resolve().parents[3] / "docs" / "FORMATS.md").read_text().split())
    assert "`quantize_iq4_nl` (what llama-quantize writes" in page and "reference algorithm" not in page
    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.NVFP4]
    assert block == 64 and 160 % block and f"GGML's own NVFP4 type has blocks of {block}" in page


def test_iq4_nl_quantizer_beats_q4_0_and_uses_nearest_codes():
    x = _values(rows=256, seed=5)[8:]
    q = quantize_blocks(x, "iq4_nl")
    y = dequantize_blocks(torch.from_numpy(q), "iq4_nl").numpy()
    y4 = dequantize_blocks(torch.from_numpy(quantize_blocks(x, "q4_0")), "q4_0").numpy()
    assert ((y - x) ** 2).sum() < ((y4 - x) ** 2).sum()
    assert np.array_equal(
        dequantize_blocks(torch.from_numpy(quantize_blocks(np.zeros((1, 32)), "iq4_nl")), "iq4_nl"), torch.zeros(1, 32)
    )


def test_bad_inputs_are_named():
    with pytest.raises(InvalidArgumentError, match="multiple of 32"):
        quantize_blocks(np.zeros((2, 40), np.float32), "q4_0")
    with pytest.raises(InvalidArgumentError, match="non-finite value inf at row 1, column 3"):
        x = np.zeros((2, 32), np.float32)
        x[1, 3] = np.inf
        quantize_blocks(x, "q8_0")
    with pytest.raises(InvalidArgumentError, match="block formats"):
        MemoryTable(torch.zeros(4, 90, dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError, match="whole blocks of 18 bytes"):
        MemoryTable(torch.zeros(4, 91, dtype=torch.uint8), format="q4_0")
    with pytest.raises(InvalidArgumentError, match="global scale"):
        quantize_blocks(np.zeros((1, 32), np.float32), "nvfp4")


def _extreme_q8(rows=40):
    """q8_0 rows whose values overflow fp16 and others that are fp16 subnormals, and bf16 ties."""
    rng = np.random.default_rng(11)
    b = rng.integers(0, 256, size=(rows, 5, 34), dtype=np.uint8)
    d = np.exp(rng.uniform(-20, 11, size=(rows, 5))).astype(np.float16)
    b[:, :, :2] = d.view(np.uint8).reshape(rows, 5, 2)
    return torch.from_numpy(b.reshape(rows, 170))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_every_cpu_path_equals_the_reference(fmt):
    data, scale = make_table(fmt, 53, 160, seed=2)
    ids = random_ids(53, 17, 4, seed=3)
    for dtype in DTYPES:
        ref = gather_dequant_reference(data, scale, ids, dtype, format=fmt)
        assert ref.shape == (17, 4 * 160)
        assert_same(gather_dequant_torch(data, scale, ids, dtype, format=fmt), ref, f"torch {fmt} {dtype}")
        if native_available():
            assert_same(gather_dequant_blocks_native(data, scale, ids, dtype, format=fmt), ref, f"C {fmt} {dtype}")


def test_native_lookup_refuses_ids_it_would_misread_even_unchecked():
    """The kernel reads ids as int64 [T, G]: int32 ids would be read past their buffer."""
    if not native_available():
        pytest.skip("no C compiler here")
    data, _ = make_table("q4_0", 53, 160, seed=2)
    for bad in (random_ids(53, 17, 4).to(torch.int32), random_ids(53, 17, 4).reshape(-1)):
        with pytest.raises(InvalidArgumentError, match="ids must be int64 \\[T, G\\] on the CPU"):
            gather_dequant_blocks_native(data, None, bad, torch.float32, format="q4_0", check=False)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_native_rounding_to_fp16_and_bf16_at_the_edges():
    if not native_available():
        pytest.skip("no C compiler here")
    data = _extreme_q8()
    ids = torch.arange(40).reshape(20, 2)
    for dtype in DTYPES:
        ref = gather_dequant_reference(data, None, ids, dtype, format="q8_0")
        assert_same(gather_dequant_blocks_native(data, None, ids, dtype, format="q8_0"), ref, str(dtype))
    assert torch.isinf(gather_dequant_reference(data, None, ids, torch.float16, format="q8_0")).any()


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_every_tier_and_the_operator(tmp_path, fmt):
    data, scale = make_table(fmt, 97, 64, seed=1)
    mem = MemoryTable(data, scale, format=fmt)
    assert (mem.head_dim, mem.nbytes) == (64, 97 * format_info(fmt).row_nbytes(64) + (4 if scale is not None else 0))
    path = write_file(tmp_path / "t.ple", fmt, data, scale, 40)
    mapped = MmapTable.open(path)
    assert mapped.format == fmt and mapped.head_dim == 64 and torch.equal(mapped.data, data)
    ids = random_ids(97, 11, 3, seed=2)
    filled = MemoryTable.empty(97, 64, fmt)
    filled.data.copy_(data)
    if scale is not None:
        filled.scale.copy_(scale)
    for table in (mem, mapped, CachedTable(mapped, 20), filled):
        ref = TableRef(table)
        for dtype in (torch.float32, torch.bfloat16):
            want = gather_dequant_reference(data, scale, ids, dtype, format=fmt)
            assert_same(table.lookup(ids, dtype), want, f"{type(table).__name__} {dtype}")
            assert_same(torch.ops.ple.table_lookup(ids, ref, 64, dtype), want)
            assert_same(table.start_prefetch(ids, dtype).wait(), want)
    mapped.close()


def test_compiled_lookup_of_a_block_table():
    data, _ = make_table("q4_0", 30, 64, seed=4)
    ref = TableRef(MemoryTable(data, format="q4_0"))
    ids = random_ids(30, 5, 2, seed=5)

    def f(i, r):
        return torch.ops.ple.table_lookup(i, r, 64, torch.bfloat16) * 2

    got = torch.compile(f, fullgraph=True, backend="eager")(ids, ref)
    assert_same(got, gather_dequant_reference(data, None, ids, torch.bfloat16, format="q4_0") * 2)
