"""The C conversion kernels (``ple_encode.c`` through :mod:`ple.table.formats.encode`) against their references:
the numpy quantizers of :mod:`ple.table.formats.blocks` (and through them the ``gguf`` package's ``quantize``
where it has one), torch's per-row quantizers, on every instruction set the CPU runs; the fp16 scale
overflow refused alike; the non-finite scans against torch's ``isfinite`` and the blocks' decoding."""

from __future__ import annotations

import gguf  # the oracle: a dev dependency, so a missing install fails here
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ple.kernels import native as _native
from ple.table.formats.blocks import ScaleOverflowError, dequantize_blocks, quantize_blocks
from ple.table.formats.catalog import BLOCK_FORMATS
from ple.table.formats.encode import RowFailure, encode_rows, first_nonfinite, rows_amax

pytestmark = pytest.mark.skipif(not _native.available(), reason="the C kernels do not build here")

TARGETS = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "mxfp4", "nvfp4", "fp8_row", "int8_row")
BY_GGUF = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "mxfp4")


def _isas() -> list[str]:
    return [i for i in ("portable", "avx2", "avx512") if _native.isa_available(i)]


@pytest.fixture
def each_isa():
    """Runs the body once per instruction set this CPU runs, restoring the choice after."""
    before = _native.current_isa()
    yield _isas()
    _native.set_isa(before)


def _values(rows: int, D: int = 160, seed: int = 0) -> np.ndarray:
    """Rows of every magnitude from 1e-38 to 1e4, and rows that probe the rules' edges: zeros of both
    signs, constants, one large value, exact ties of the rounding rules, subnormals, powers of two and
    their neighbours (the mxfp4 exponent), equal extremes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, D)) * np.exp(rng.uniform(-20, 9, (rows, 1)))).astype(np.float32)
    edges = [
        np.zeros(D),
        np.full(D, 0.75),
        np.where(np.arange(D) == 5, -3.0, 0.0),
        np.tile(np.arange(-16, 16) / 2, D // 32),  # halves: ties
        np.full(D, 1e-30),
        np.full(D, 1e-40),  # subnormal
        np.tile(2.0 ** np.arange(-16, 16), D // 32),
        np.tile(np.float32(2.0**10) * (1 - 2.0**-24) * np.ones(32), D // 32),  # just below a power of two
        np.tile(np.array([3.0, -3.0] * 16), D // 32),  # equal extremes of both signs
        np.tile(np.arange(32) * 0.25 - 4, D // 32),
        np.full(D, 6e3),
    ]
    for i, e in enumerate(edges):
        x[i % rows] = np.asarray(e, dtype=np.float32)
    x[len(edges) % rows, ::7] *= -1
    return x


def _sources(x: np.ndarray):
    """The same rows as each kind of source a table stores: fp32, bf16, fp16, fp8 with a global and with
    per-row scales, int8 with per-row scales, nvfp4 with its global scale."""
    n, D = x.shape
    t = torch.from_numpy(x)
    rng = np.random.default_rng(1)
    fp8 = torch.from_numpy(rng.integers(0, 256, (n, D), dtype=np.uint8) & 0xBF).view(torch.float8_e4m3fn)
    row_scale = torch.from_numpy(rng.uniform(0.001, 3, (n, 1)).astype(np.float32))
    int8 = torch.from_numpy(rng.integers(-127, 128, (n, D), dtype=np.int8))
    g = 0.004
    nv = torch.from_numpy(quantize_blocks(np.clip(x, -1e3, 1e3), "nvfp4", g))
    return [
        ("fp32", t, None),
        ("bf16", t.bfloat16(), None),
        ("fp16", t.clamp(-6e4, 6e4).half(), None),
        ("fp8", fp8, torch.tensor([0.02])),
        ("fp8_row", fp8, row_scale),
        ("int8_row", int8, row_scale),
        ("nvfp4", nv, torch.tensor([g])),
    ]


def _assert_same(a, b, what):
    assert np.array_equal(a.data, b.data), f"{what}: rows {np.nonzero((a.data != b.data).any(axis=1))[0][:8]} differ"
    if b.scale is not None:
        assert np.array_equal(a.scale.view(np.uint32), b.scale.view(np.uint32)), f"{what}: scales differ"
    for name in ("err_sq", "ref_sq", "max_rel"):
        got, want = getattr(a.stats, name).numpy(), getattr(b.stats, name).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=0, err_msg=f"{what}: {name}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's 1/d of subnormal scales
def test_every_source_and_target_equals_the_reference(each_isa):
    x = _values(300)
    for src_name, rows, scale in _sources(x):
        for to in TARGETS:
            g = 0.01 if to == "nvfp4" else None
            try:
                want = encode_rows(rows, scale, to, g, stats=True, native=False)
            except RowFailure as e:  # fp32 rows of 6e3 overflow nothing; only the 1e4 magnitudes may
                for isa in each_isa:
                    _native.set_isa(isa)
                    with pytest.raises(RowFailure) as got:
                        encode_rows(rows, scale, to, g, stats=True, native=True, threads=2)
                    assert (got.value.kind, got.value.row, got.value.column) == (e.kind, e.row, e.column)
                continue
            for isa in each_isa:
                _native.set_isa(isa)
                got = encode_rows(rows, scale, to, g, stats=True, native=True, threads=2)
                _assert_same(got, want, f"{src_name} -> {to} on {isa}")


# the gguf package warns on the tiny blocks of the test rows (its 1 / d overflows to inf, which it handles)
@pytest.mark.filterwarnings("ignore::RuntimeWarning:gguf.quants")
@pytest.mark.parametrize("fmt", BY_GGUF)
def test_native_blocks_equal_gguf_quantize(fmt, each_isa):
    x = _values(200, seed=3)
    x = x[np.abs(x).max(axis=1) < 1e4]  # within every format's fp16 scale
    want = gguf_quantize(x, getattr(gguf.GGMLQuantizationType, fmt.upper()))
    for isa in each_isa:
        _native.set_isa(isa)
        got = encode_rows(torch.from_numpy(x), None, fmt, native=True).data
        assert np.array_equal(got, want), (fmt, isa, np.nonzero((got != want).any(axis=1))[0][:8])


def test_iq4_nl_on_many_rows_equals_the_numpy_reference(each_isa):
    """GGML's reference search (16 candidate scales, sums in order, nearest grid points) in every
    variant: 6,000 rows of 160 values (30,000 blocks) of assorted magnitudes, and rows from fp8."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((6000, 160)) * np.exp(rng.uniform(-6, 6, (6000, 1)))).astype(np.float32)
    x[::5] = rng.laplace(size=(1200, 160)).astype(np.float32)  # heavy tails
    x[1::5] = np.round(x[1::5] * 4) / 4  # many equal values
    want = quantize_blocks(x, "iq4_nl")
    for isa in each_isa:
        _native.set_isa(isa)
        got = encode_rows(torch.from_numpy(x), None, "iq4_nl", native=True, threads=2).data
        assert np.array_equal(got, want), (isa, np.nonzero((got != want).any(axis=1))[0][:8])
    # the values decode as the gguf package decodes IQ4_NL
    dec = gguf_dequantize(want, gguf.GGMLQuantizationType.IQ4_NL)
    assert torch.equal(dequantize_blocks(torch.from_numpy(want), "iq4_nl"), torch.from_numpy(dec))


def _ggml_affine(block: np.ndarray, top: int) -> tuple[np.float32, np.float32]:
    """GGML's reference loop for q4_1 / q5_1's min and max: the first of equal values (strict < and >)."""
    lo, hi = np.float32(np.finfo(np.float32).max), np.float32(-np.finfo(np.float32).max)
    for v in block:
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    return np.float32((hi - lo) / np.float32(top)), lo


@pytest.mark.parametrize("fmt, top", [("q4_1", 15), ("q5_1", 31)])
def test_extremes_of_equal_zeros_follow_ggmls_loop(fmt, top, each_isa):
    """A block whose smallest (or largest) value is a zero present with both signs: the scale and
    minimum are those of GGML's loop (the first zero), in the reference and in every C variant."""
    x = np.abs(_values(4, D=32, seed=5)) + 1
    x[0, [3, 17]] = [0.0, -0.0]
    x[1, [0, 31]] = [-0.0, 0.0]
    x[2] = 0.0
    x[2, [4, 9]] = -0.0
    x[3] = -x[3]
    x[3, [2, 20]] = [-0.0, 0.0]
    want = quantize_blocks(x, fmt)
    for r in range(4):
        d, lo = _ggml_affine(x[r], top)
        assert want[r, 0:2].view(np.float16)[0] == np.float16(d)
        assert np.signbit(want[r, 2:4].view(np.float16)[0]) == np.signbit(lo), r
        assert want[r, 2:4].view(np.float16)[0] == np.float16(lo)
    for isa in each_isa:
        _native.set_isa(isa)
        assert np.array_equal(encode_rows(torch.from_numpy(x), None, fmt, native=True).data, want)
    # the values decode equal to the gguf package's blocks' (its min may be the other zero)
    ours = dequantize_blocks(torch.from_numpy(want), fmt)
    theirs = torch.from_numpy(
        gguf_dequantize(
            gguf_quantize(x, getattr(gguf.GGMLQuantizationType, fmt.upper())),
            getattr(gguf.GGMLQuantizationType, fmt.upper()),
        )
    )
    assert torch.equal(ours, theirs)


def _tiny_blocks(seed: int = 9) -> np.ndarray:
    """Rows whose blocks hold values all below about 5e-38 (the scale's inverse overflows float32), of
    both signs, with zeros among them, and one row of ordinary values beside them."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 64)) * np.array([[1e-38], [2e-39], [1e-40], [3e-45], [4e-38], [1.0]])).astype(
        np.float32
    )
    x[0, [3, 40]] = 0.0
    x[2, 7] = -0.0
    return x


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "q4_1", "q5_1"])
def test_codes_of_an_overflowing_inverse_are_zero_as_gguf_and_ggml(fmt, each_isa):
    """A block of values all below about 5e-38: ``1 / d`` is infinite, so ``x / d`` is infinite (NaN for a
    zero, or the minimum itself); GGML's ``(int8_t)`` cast of such a code gives 0 on x86-64, and so does
    the gguf package: every code is 0 (not the top code), in the reference and in every C variant."""
    x = _tiny_blocks()
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    with np.errstate(invalid="ignore", over="ignore"):  # the gguf package's casts of inf and NaN
        want = gguf_quantize(x, qtype)
    ours = quantize_blocks(x, fmt)
    assert np.array_equal(ours, want), np.nonzero((ours != want).any(axis=1))[0]
    for isa in each_isa:
        _native.set_isa(isa)
        got = encode_rows(torch.from_numpy(x), None, fmt, native=True).data
        assert np.array_equal(got, want), (isa, np.nonzero((got != want).any(axis=1))[0])
    start = {"q4_0": 2, "q5_0": 2, "q4_1": 4, "q5_1": 4}[fmt]  # where a block's codes (qh, nibbles) begin
    blocks = ours[1:3].reshape(4, -1)  # the rows of magnitudes 2e-39 and 1e-40: 1 / d overflows
    assert (blocks[:, start:] == 0).all()


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0"])
def test_a_block_of_zeros_has_ggmls_negative_zero_scale(fmt, each_isa):
    """GGML's loop keeps ``max = 0.0f`` unless a magnitude is strictly larger, so a block of zeros has the
    scale ``0.0f / -levels = -0`` (fp16 0x8000) whatever its first zero's sign; the gguf package takes the
    first value (-0.0 gives it +0), so the bytes here are built by hand: scale 0x8000, every code the
    middle one (8 of q4_0, 16 of q5_0)."""
    x = np.zeros((3, 64), np.float32)
    x[0, 0] = -0.0  # the first a negative zero
    x[1] = -0.0  # every one
    x[2, [0, 33]] = -0.0  # the first of each block
    block = {
        "q4_0": bytes([0x00, 0x80]) + bytes([0x88]) * 16,
        "q5_0": bytes([0x00, 0x80]) + bytes([0xFF]) * 4 + bytes(16),
    }[fmt]
    want = np.frombuffer(block * 6, dtype=np.uint8).reshape(3, -1)
    assert np.array_equal(quantize_blocks(x, fmt), want)
    assert np.array_equal(quantize_blocks(np.zeros((1, 64), np.float32), fmt), want[:1])  # +0 first: the same
    for isa in each_isa:
        _native.set_isa(isa)
        assert np.array_equal(encode_rows(torch.from_numpy(x), None, fmt, native=True).data, want), isa
    # it decodes to zeros of the scale's sign, as GGML's own decode gives
    dec = dequantize_blocks(torch.from_numpy(want.copy()), fmt)
    assert (dec == 0).all() and bool(torch.signbit(dec).all())


LIMITS = {"q8_0": 8.3e6, "q5_0": 1.04e6, "q4_0": 5.2e5, "iq4_nl": 6.8e6, "q4_1": 9.8e5, "q5_1": 2.0e6}


@pytest.mark.parametrize("fmt", sorted(LIMITS))
@pytest.mark.parametrize("native", [False, True], ids=["reference", "native"])
def test_a_block_scale_past_fp16_is_refused_naming_row_and_value(fmt, native):
    """Values of 1e5 to 1e7 (issue: GGML writes an infinite fp16 scale, which decodes to inf and NaN):
    refused, naming the row, the block's first column and its value of largest magnitude; just below
    each format's limit the blocks are finite."""
    x = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    big = np.float32(LIMITS[fmt] * 1.3)
    x[4, 40] = -big
    with pytest.raises(RowFailure) as e:
        encode_rows(torch.from_numpy(x), None, fmt, native=native)
    assert (e.value.kind, e.value.row, e.value.column, e.value.value) == ("overflow", 4, 32, -big)
    assert f"row 4 to {fmt}" in str(e.value) and "columns [32, 64)" in str(e.value) and "65504" in str(e.value)
    if not native:
        with pytest.raises(ScaleOverflowError, match=f"row 4 to {fmt}: its block of columns \\[32, 64\\)"):
            quantize_blocks(x, fmt)
    x[4, 40] = np.float32(LIMITS[fmt] * 0.9) * (1 if fmt in ("q4_1", "q5_1") else -1)  # q4_1's min stays small
    out = encode_rows(torch.from_numpy(x), None, fmt, native=native).data
    assert torch.isfinite(dequantize_blocks(torch.from_numpy(out), fmt)).all()


@pytest.mark.parametrize("fmt", ["q4_1", "q5_1"])
def test_a_minimum_past_fp16_is_refused(fmt):
    """q4_1 / q5_1 store the block's minimum in fp16 too: a block of values near -7e4 has a small
    scale but an infinite minimum."""
    x = np.full((2, 32), -7e4, dtype=np.float32)
    x[1, 3] = -7e4 + 1
    for native in (False, True):
        with pytest.raises(RowFailure) as e:
            encode_rows(torch.from_numpy(x), None, fmt, native=native)
        assert (e.value.kind, e.value.row, e.value.column) == ("overflow", 0, 0)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_row", "int8_row"])
def test_formats_with_wide_scales_take_large_values(fmt):
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * np.float32(1e7)
    g = float(np.abs(x).max()) / (6 * 448) if fmt == "nvfp4" else None
    a = encode_rows(torch.from_numpy(x), None, fmt, g, native=True)
    b = encode_rows(torch.from_numpy(x), None, fmt, g, native=False)
    assert np.array_equal(a.data, b.data)


def test_a_value_not_finite_once_scaled_is_refused():
    """fp8 bytes are finite, but 448 times a scale of 1e37 is not."""
    rows = torch.full((3, 32), 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 448
    for native in (False, True):
        with pytest.raises(RowFailure) as e:
            encode_rows(rows, torch.tensor([1e37]), "q8_0", native=native)
        assert (e.value.kind, e.value.row, e.value.column, e.value.value) == ("nonfinite", 0, 0, float("inf"))
        with pytest.raises(RowFailure):
            rows_amax(rows, torch.tensor([1e37]), native=native)


def test_rows_amax_equals_torch():
    for _, rows, scale in _sources(_values(64)):
        x = rows_amax(rows, scale, native=False)
        assert rows_amax(rows, scale, native=True, threads=2) == x


def _planted(kind: str, n: int = 40, D: int = 64):
    """Stored rows of ``kind`` with values that are not finite planted, and where the first one is."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, D)).astype(np.float32)
    if kind in ("fp32", "fp16", "bf16"):
        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[kind]
        t = torch.from_numpy(x).to(dt)
        t[17, 9], t[23, 1], t[30, 0] = float("inf"), float("nan"), -float("inf")
        return t, None, (17, 9)
    if kind in ("e4m3", "e5m2"):
        b = torch.from_numpy(rng.integers(0, 0x70, (n, D), dtype=np.uint8))
        b[12, 33], b[19, 2] = (0xFF, 0x7F) if kind == "e4m3" else (0xFC, 0x7E)
        return b.view(torch.float8_e4m3fn if kind == "e4m3" else torch.float8_e5m2), None, (12, 33)
    if kind == "nvfp4":
        q = torch.from_numpy(quantize_blocks(x, "nvfp4", 0.01))
        q[21, D // 2 + 3] = 0x7F  # a NaN E4M3 block scale: values 48 .. 63
        return q, "nvfp4", (21, 48)
    q = torch.from_numpy(quantize_blocks(x, kind))
    bn = {"q8_0": 34, "q5_1": 24, "q5_0": 22, "q4_1": 20, "q4_0": 18, "iq4_nl": 18, "mxfp4": 17}[kind]
    if kind == "mxfp4":
        q[26, bn : bn + 1] = 255  # 2^127 times the block's codes of 2 and more: past float32
        q[26, bn + 1 : bn + 17] = 0x70  # code 7 (12) in the high nibbles: values 48 ... 63
        return q, kind, (26, 48)
    q[26, bn : bn + 2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # d = inf, block 1
    q[33, 0:2] = torch.tensor([0x01, 0x7E], dtype=torch.uint8)  # d = NaN
    if kind in ("q4_1", "q5_1"):
        q[8, 2:4] = torch.tensor([0x00, 0xFC], dtype=torch.uint8)  # m = -inf, block 0
        return q, kind, (8, 0)
    return q, kind, (26, 32)


@pytest.mark.parametrize(
    "kind", ["fp32", "fp16", "bf16", "e4m3", "e5m2", "nvfp4", *[f for f in BLOCK_FORMATS if f != "nvfp4"]]
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_first_nonfinite_finds_the_first_bad_value(kind):
    rows, fmt, where = _planted(kind)
    assert first_nonfinite(rows, fmt, native=True) == where
    assert first_nonfinite(rows, fmt, native=False) == where
    assert first_nonfinite(rows[: where[0]], fmt, native=True) is None


def test_integer_rows_are_always_finite():
    assert first_nonfinite(torch.full((3, 8), -128, dtype=torch.int8)) is None
