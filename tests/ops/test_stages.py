"""The fused step in two stages (gate on any rows, conv over the whole batch), the torch.ops.ple
operators, and the ring state layout: each bit for bit what the one-call step computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ple.ops
from ple.ops import library
from ple.ops.fused import native, reference
from ple.ops.fused.composed import TORCH
from ple.ops.records import StepMeta
from ple.ops.state import engine_to_ring, ring_to_engine, ring_window
from tests.ops._helpers import random_fused_step, run_fused, run_stages, with_state

BACKENDS = {"native": native, "torch": TORCH, "reference": reference, "operators": ple.ops}


def _assert_equal(got, want, what=""):
    for name, a, b in zip(("out", "c", "state"), got, want):
        assert torch.equal(a, b), f"{what}: {name} differs (max {float((a.double() - b.double()).abs().max()):.3g})"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_stages_compose_to_gate_conv_bitwise(backend, dtype, seed):
    impl = BACKENDS[backend]
    step = random_fused_step(seed, dtype=dtype, decode=seed % 3 == 2, hidden_size=(16, 37, 5)[seed % 3])
    _assert_equal(run_stages(impl, step), run_fused(impl.gate_conv, step), backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_long_chunks_split_into_work_units(dtype, seed):
    step = random_fused_step(seed, dtype=dtype, long=True)
    _assert_equal(run_stages(native, step, threads=3), run_fused(native.gate_conv, step, threads=2))


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_gate_on_local_rows_conv_on_the_gathered_batch(backend, dtype, seed):
    """What sequence parallelism runs: each rank gates its own rows, the conv inputs are gathered, the
    conv runs over the whole batch with a residual that holds only the rank's rows; the rank's output
    rows and the state equal the one-call step's."""
    impl = BACKENDS[backend]
    step = random_fused_step(seed, dtype=dtype, long=seed % 2 == 1)
    want_out, want_c, want_state = run_fused(impl.gate_conv, step)
    tokens = step["value"].shape[0]
    cut = tokens // 3
    parts = []
    for a, b in ((0, cut), (cut, tokens)):
        mask = None if step["token_mask"] is None else step["token_mask"][a:b]
        parts.append(
            impl.gate_stage(
                step["key"][a:b],
                step["value"][a:b],
                step["hidden"][a:b],
                step["gate"],
                token_mask=mask,
                add_hidden=step["add_hidden"],
            )
        )
    c = torch.cat([p[1] for p in parts])
    for rank, (a, b) in enumerate(((0, cut), (cut, tokens))):
        residual = torch.zeros_like(c)
        residual[a:b] = parts[rank][0]
        s = with_state(step, step["step"].conv_state.clone())
        out = impl.conv_stage(c, residual, s["conv"], s["step"])
        assert torch.equal(out[a:b], want_out[a:b]), (rank, a, b)
        assert torch.equal(s["step"].conv_state, want_state)
    assert torch.equal(c, want_c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_operators_equal_the_python_entry_points(dtype, seed):
    step = random_fused_step(seed, dtype=dtype)
    s = with_state(step, step["step"].conv_state.clone())
    a = dict(token_mask=s["token_mask"], add_hidden=s["add_hidden"])
    m = s["step"]
    kernel_step = StepMeta(m.query_start_loc.long(), m.conv_state, m.state_indices, m.has_initial_state, m.num_rejected)
    out, c = library.gate_conv(
        s["key"], s["value"], s["hidden"], s["gate"], s["conv"], kernel_step, **a, return_conv_input=True
    )
    _assert_equal((out, c, m.conv_state), run_fused(ple.ops.gate_conv, step), "gate_conv operator")
    s2 = with_state(step, step["step"].conv_state.clone())
    residual, c2 = library.gate_stage(s2["key"], s2["value"], s2["hidden"], s2["gate"], **a)
    m2 = dataclasses.replace(kernel_step, conv_state=s2["step"].conv_state)
    out2 = library.conv_stage(c2, residual, s2["conv"], m2)
    _assert_equal((out2, c2, m2.conv_state), (out, c, m.conv_state), "stage operators")


@pytest.mark.parametrize("op", ["gate_conv", "gate_stage", "conv_stage"])
def test_opcheck(op):
    step = random_fused_step(4, dtype=torch.bfloat16)
    s = with_state(step, step["step"].conv_state.clone())
    m = s["step"]
    m = StepMeta(m.query_start_loc.long(), m.conv_state, m.state_indices, m.has_initial_state, m.num_rejected)
    gate = library._gate_args(s["gate"])
    conv = (s["conv"].weight, s["conv"].taps, s["conv"].dilation)
    if op == "gate_conv":
        args = (s["key"], s["value"], s["hidden"], *gate, *conv, *library._step_args(m), s["token_mask"], True, True)
    elif op == "gate_stage":
        args = (s["key"], s["value"], s["hidden"], *gate, s["token_mask"], False)
    else:
        c = torch.randn(s["hidden"].shape).to(s["hidden"].dtype)
        args = (c, s["hidden"].clone(), *conv, *library._step_args(m))
    torch.library.opcheck(getattr(torch.ops.ple, op).default, args)


# ---------------------------------------------------------------------------------------------- ring layout


def test_ring_conversions_are_exact():
    g = torch.Generator().manual_seed(0)
    engine = torch.randn(5, 7, 6, generator=g).bfloat16()
    pool, offsets = engine_to_ring(engine)
    assert pool.shape == (5, 6, 7) and torch.equal(offsets, torch.zeros(5, dtype=torch.int64))
    assert torch.equal(ring_to_engine(pool, offsets), engine)
    # rotate each slot's rows by a different offset: same logical columns
    offsets = torch.tensor([0, 1, 5, 3, 2])
    rotated = torch.stack([torch.roll(pool[s], shifts=int(offsets[s]), dims=0) for s in range(5)])
    assert torch.equal(ring_to_engine(rotated, offsets), engine)
    assert torch.equal(ring_to_engine(rotated, offsets, torch.tensor([3, 1])), engine[[3, 1]])
    assert torch.equal(ring_window(rotated, offsets, 2, 1, 5), engine[2, :, 1:5])


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_layout_streams_like_the_engine_layout(backend, dtype):
    """Many random steps through both layouts (prefill, decode, rejections, fresh restarts, null rows):
    outputs equal bit for bit after every step, and the ring pool converts to the engine pool."""
    impl = BACKENDS[backend]
    engine_pool = None
    ring_pool = offsets = None
    for seed in range(12):
        step = random_fused_step(seed, dtype=dtype, decode=seed % 4 == 3)
        m = step["step"]
        if engine_pool is None:
            engine_pool = m.conv_state.clone()
            ring_pool, offsets = engine_to_ring(engine_pool)
            offsets[1::2] = 3  # start some slots rotated
            ring_pool = torch.stack(
                [torch.roll(ring_pool[s], shifts=int(offsets[s]), dims=0) for s in range(ring_pool.shape[0])]
            )
        eng = with_state(step, engine_pool)
        out_e, c_e = impl.gate_conv(**eng)
        ring = dict(step, step=dataclasses.replace(m, conv_state=ring_pool, state_offsets=offsets))
        out_r, c_r = impl.gate_conv(**ring)
        assert torch.equal(out_r, out_e) and torch.equal(c_r, c_e), seed
        assert torch.equal(ring_to_engine(ring_pool, offsets), engine_pool), seed
