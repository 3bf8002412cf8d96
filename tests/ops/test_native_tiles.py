"""The fused kernel's tiles (AVX-512 BF16 variant): decode rows run up to four at a time, head by head,
without scratch rows, on ring pools and on the engine layout, and so do the rows of a chunk whose taps
are all rows of that chunk (up to four, fewer than the dilation, at a time). They must give exactly the
bits of the row-by-row path (outputs, conv inputs, new state and ring offsets), in pure decode steps and
in steps that mix them with prefill chunks, speculative rows, rejections, fresh requests and null slots,
on one to three threads."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import ple.kernels.native as native_build
from ple.ops.fused import native
from ple.ops.records import ConvWeights, GateWeights, StepMeta
from ple.ops.state import engine_to_ring, ring_to_engine

pytestmark = pytest.mark.skipif(
    not native_build.isa_available("avx512bf16"), reason="the decode tiles are in the AVX-512 BF16 variant"
)


@pytest.fixture
def lib():
    lib = native_build.library()
    before = native_build.set_isa("avx512bf16")
    yield lib
    lib.ple_set_decode_tiles(1)
    native_build.set_isa(before)


def _step(seed: int, dtype: torch.dtype, mixed: bool):
    """A step of 1..20 requests on a rotated ring pool (heads of 16, 48 or 1,040 channels: the last takes
    three chunks of the tiles' pass, one of them partial): mostly decode rows (some rejected, fresh or
    without a slot), with prefill and verify chunks when ``mixed``; returns (kwargs of gate_conv, the rows
    tiles take: decode rows that resume with nothing rejected, and every row at or after the window of
    a chunk with a slot)."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    h, hc, dilation, num_spec = (
        rnd.choice([16, 48, 1040]),
        rnd.choice([3, 4]),
        rnd.choice([1, 2, 3]),
        rnd.choice([0, 2]),
    )
    c, taps = h * hc, 4
    window = (taps - 1) * dilation
    requests = rnd.randint(1, 20)
    lens = [rnd.choice([1, 1, 1, 2, 5, 13, 40]) if mixed else 1 for _ in range(requests)]
    slots = torch.tensor(rnd.sample(range(requests + 3), requests))
    slots[torch.rand(requests, generator=g) < 0.1] = -1
    has_init = torch.rand(requests, generator=g) < 0.85
    rejected = torch.tensor([rnd.choice([0] * 6 + list(range(1, num_spec + 1))) for _ in range(requests)])
    rejected_or_none = rejected if num_spec and rnd.random() < 0.8 else None
    if rejected_or_none is None:
        rejected.zero_()
    tokens = sum(lens)
    kv = torch.randn(tokens, c + h, generator=g).to(dtype)
    key, value = kv.split([c, h], dim=1)
    engine = torch.randn(requests + 3, c, window + num_spec, generator=g).to(dtype)
    ring, offsets = engine_to_ring(engine)
    offsets.copy_(torch.randint(0, window + num_spec, offsets.shape, generator=g))
    ring = torch.stack([torch.roll(ring[s], int(offsets[s]), dims=0) for s in range(ring.shape[0])])
    assert torch.equal(ring_to_engine(ring, offsets), engine)
    qsl = torch.tensor([0, *lens]).cumsum(0)
    step = StepMeta.build(qsl, ring, slots, has_init, rejected_or_none)
    kwargs = dict(
        key=key,
        value=value,
        hidden=torch.randn(tokens, c, generator=g).to(dtype),
        gate=GateWeights.build(*[0.3 * torch.randn(c, generator=g) for _ in range(3)], 1e-6, hc),
        conv=ConvWeights.build(torch.randn(c, taps, generator=g), dilation),
        step=dataclasses.replace(step, state_offsets=offsets),
        add_hidden=rnd.random() < 0.75,
        return_conv_input=rnd.random() < 0.5,
    )
    decode = sum(1 for r in range(requests) if lens[r] == 1 and slots[r] >= 0 and has_init[r] and int(rejected[r]) == 0)
    rows = decode + sum(max(0, n - window) for n, s in zip(lens, slots.tolist()) if s >= 0)
    return kwargs, rows


def _run(kwargs, threads, ring=True):
    m = kwargs["step"]
    if not ring:  # the engine layout [S, C, L] of the same state
        engine = ring_to_engine(m.conv_state, m.state_offsets)
        got = native.gate_conv(
            **dict(kwargs, step=dataclasses.replace(m, conv_state=engine, state_offsets=None)), threads=threads
        )
        out, c = got if kwargs["return_conv_input"] else (got, None)
        return out, c, engine, None
    pool, offsets = m.conv_state.clone(), m.state_offsets.clone()
    got = native.gate_conv(
        **dict(kwargs, step=dataclasses.replace(m, conv_state=pool, state_offsets=offsets)), threads=threads
    )
    out, c = got if kwargs["return_conv_input"] else (got, None)
    return out, c, pool, offsets


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "engine"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mixed", [False, True])
def test_tiles_give_the_row_paths_bits(lib, dtype, mixed, ring):
    tiled_rows = 0
    for seed in range(24):
        kwargs, rows = _step(seed, dtype, mixed)
        for threads in (1, 2, 3):
            lib.ple_set_decode_tiles(0)
            before = lib.ple_tile_rows()
            want = _run(kwargs, threads, ring)
            assert lib.ple_tile_rows() == before
            lib.ple_set_decode_tiles(1)
            got = _run(kwargs, threads, ring)
            ran = lib.ple_tile_rows() - before
            assert ran == rows, (seed, threads, ran, rows)
            tiled_rows += ran
            for name, a, b in zip(("out", "c", "state", "offsets"), got, want):
                assert (a is None and b is None) or torch.equal(a, b), (seed, threads, name)
    assert tiled_rows > 100


def test_tiles_are_off_for_masked_steps(lib):
    kwargs, rows = _step(3, torch.bfloat16, False)
    assert rows > 0
    before = lib.ple_tile_rows()
    masked = dict(kwargs, token_mask=torch.ones(kwargs["hidden"].shape[0], dtype=torch.bool))
    _run(masked, 2)
    _run(masked, 2, ring=False)
    assert lib.ple_tile_rows() == before
