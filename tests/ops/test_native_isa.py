"""The C kernel's instruction-set variants (portable, AVX2, AVX-512): each one this CPU runs against the
reference, the PyTorch path and the other layout; forcing one that is unknown or missing is refused."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ple.kernels.native as native_build
from ple.ops.conv import reference as conv_reference
from ple.ops.fused import native, reference
from ple.ops.fused.composed import TORCH
from ple.ops.state import engine_to_ring, ring_to_engine
from tests.ops._helpers import DTYPE_TOL, random_fused_step, run_fused, with_state

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(params=native_build.ISAS)
def isa(request):
    """Each instruction set this CPU runs, forced for the test; one it lacks must be refused by name."""
    name = request.param
    if not native_build.isa_available(name):
        with pytest.raises(native_build.NativeISAError, match=f"this CPU does not run {name}"):
            native_build.set_isa(name)
        assert native_build.current_isa() != name
        return None
    before = native_build.set_isa(name)
    assert native_build.current_isa() == name
    yield name
    native_build.set_isa(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_isa_matches_the_reference_and_keeps_state_exact(isa, dtype):
    if isa is None:
        return  # checked in the fixture: refused
    tol = DTYPE_TOL[dtype]
    for seed in range(8):
        step = random_fused_step(seed, dtype=dtype, decode=seed % 2 == 1, hidden_size=(16, 37, 5, 48)[seed % 4])
        got = run_fused(native.gate_conv, step)
        fast = run_fused(TORCH.gate_conv, step)
        ref = run_fused(reference.gate_conv, step)
        for name, a, b, r in zip(("out", "c", "state"), got, fast, ref):
            torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{isa} {name} vs torch path: {m}")
            if dtype == torch.float32:
                torch.testing.assert_close(a, r, **tol, msg=lambda m, name=name: f"{isa} {name} vs reference: {m}")
            elif a.numel():
                err, err_fast = ((x.double() - r.double()).abs().max().item() for x in (a, b))
                assert err <= 2 * err_fast + 1e-2, (isa, name, err, err_fast)
        # the new slots hold exactly the tail of the kept history and the kernel's own conv inputs
        m = step["step"]
        want = m.conv_state.clone()
        conv_reference.dilated_conv(got[1], step["conv"], dataclasses.replace(m, conv_state=want))
        assert torch.equal(got[2], want), (isa, seed)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_isa_streams_rings_like_the_engine_layout(isa, dtype, threads):
    """Decode and prefill steps on rotated rings (the layout whose slot columns the kernel prefetches
    for the next work unit) equal the engine layout bit for bit, in every variant and split."""
    if isa is None:
        return
    engine_pool = ring_pool = offsets = None
    for seed in range(10):
        step = random_fused_step(seed, dtype=dtype, decode=seed % 3 != 0)
        m = step["step"]
        if engine_pool is None:
            engine_pool = m.conv_state.clone()
            ring_pool, offsets = engine_to_ring(engine_pool)
            offsets[1::2] = 2
            ring_pool = torch.stack(
                [torch.roll(ring_pool[s], shifts=int(offsets[s]), dims=0) for s in range(ring_pool.shape[0])]
            )
        out_e, c_e = native.gate_conv(**with_state(step, engine_pool), threads=threads)
        ring = dict(step, step=dataclasses.replace(m, conv_state=ring_pool, state_offsets=offsets))
        out_r, c_r = native.gate_conv(**ring, threads=threads)
        assert torch.equal(out_r, out_e) and torch.equal(c_r, c_e), (isa, seed)
        assert torch.equal(ring_to_engine(ring_pool, offsets), engine_pool), (isa, seed)


def test_variants_agree_with_each_other():
    """Every variant this CPU runs gives the portable one's results within the dtype's tolerance (they
    sum in the same order; only fused multiply-adds round differently)."""
    names = [n for n in native_build.ISAS if native_build.isa_available(n)]
    assert names[0] == "portable"
    before = native_build.current_isa()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for seed in range(4):
                step = random_fused_step(seed, dtype=dtype, decode=seed % 2 == 0)
                results = {}
                for name in names:
                    native_build.set_isa(name)
                    results[name] = run_fused(native.gate_conv, step)
                for name in names[1:]:
                    for a, b in zip(results[name], results["portable"]):
                        torch.testing.assert_close(a, b, **DTYPE_TOL[dtype])
    finally:
        native_build.set_isa(before)


def test_unknown_isa_names_are_refused():
    with pytest.raises(native_build.NativeISAError, match="'avx9' is not an instruction set of the kernels"):
        native_build.set_isa("avx9")
    with pytest.raises(native_build.NativeISAError, match="'sse' is not an instruction set"):
        native_build.isa_available("sse")


def _child(env_isa: str) -> subprocess.CompletedProcess:
    code = (
        "import ple.kernels.native as n\n"
        "try:\n"
        "    print('runs', n.current_isa())\n"
        "except n.NativeISAError as e:\n"
        "    print('refused', e)\n"
    )
    env = dict(os.environ, PLE_NATIVE_ISA=env_isa, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_environment_variable_forces_or_refuses_by_name():
    assert _child("portable").stdout.strip() == "runs portable"
    for name in native_build.ISAS[1:]:
        out = _child(f" {name.upper()} ").stdout.strip()
        if native_build.isa_available(name):
            assert out == f"runs {name}"
        else:
            assert out.startswith(f"refused PLE_NATIVE_ISA='{name}': this CPU does not run {name}"), out
    best = [n for n in native_build.ISAS if native_build.isa_available(n)][-1]
    assert _child("auto").stdout.strip() == f"runs {best}"
    out = _child("avx9").stdout.strip()
    assert out.startswith("refused PLE_NATIVE_ISA='avx9' is not an instruction set of the kernels"), out


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def test_bf16_rounding_instruction_keeps_pytorch_bits_for_denormals_and_nan():
    """The avx512bf16 variant rounds with VCVTNEPS2BF16, which reads denormals as zero and writes another
    NaN than PyTorch: vectors holding either take the exact rounding, so the conv inputs and the new
    state hold the portable variant's bits exactly, and the outputs match it within tolerance with NaN
    in the same places. Values of about 1e-39 and a large epsilon (the conv factor then stays below 1)
    make the gate's products denormal in fp32 and bf16."""
    if not native_build.isa_available("avx512bf16"):
        with pytest.raises(native_build.NativeISAError, match="this CPU does not run avx512bf16"):
            native_build.set_isa("avx512bf16")
        return
    before = native_build.current_isa()
    denormal_c = nan_c = 0
    try:
        for seed in range(6):
            step = random_fused_step(
                seed, dtype=torch.bfloat16, decode=seed % 2 == 1, hidden_size=(16, 37, 48)[seed % 3]
            )
            if not step["value"].numel():
                continue
            tiny = (step["value"].float() * 3e-39).to(torch.bfloat16)
            kv = torch.cat([step["key"], tiny], dim=1)
            key, value = kv.split([step["key"].shape[1], tiny.shape[1]], dim=1)
            hidden = step["hidden"].clone()
            hidden[0, 1] = float("nan")  # the first token's gate and all its outputs are NaN
            gate = dataclasses.replace(step["gate"], eps=1.0)
            step = dict(step, key=key, value=value, hidden=hidden, gate=gate)
            results = {}
            for name in ("portable", "avx512bf16"):
                native_build.set_isa(name)
                results[name] = run_fused(native.gate_conv, step)
            (out_p, c_p, s_p), (out_x, c_x, s_x) = results["portable"], results["avx512bf16"]
            assert torch.equal(_bf16_bits(c_x), _bf16_bits(c_p)), seed
            assert torch.equal(_bf16_bits(s_x), _bf16_bits(s_p)), seed
            assert torch.equal(torch.isnan(out_x), torch.isnan(out_p)), seed
            torch.testing.assert_close(out_x, out_p, **DTYPE_TOL[torch.bfloat16], equal_nan=True)
            finite = c_p.float().abs()
            denormal_c += int(((finite > 0) & (finite < torch.finfo(torch.float32).tiny)).sum())
            nan_c += int((_bf16_bits(c_p) == 0x7FC0).sum())
    finally:
        native_build.set_isa(before)
    assert denormal_c > 1000 and nan_c > 0, (denormal_c, nan_c)  # the cases the guard exists for did occur


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_isa_writes_the_same_state_without_the_conv_inputs(isa, dtype, threads):
    """Without return_conv_input the kernel writes no conv inputs where a request's new state columns come
    from its work unit's ring (one unit, chunks of at most W + 1 rows): outputs and new state equal those
    of the call that returns every conv input, bit for bit, in both layouts, for decode steps, chunks
    split into several work units, and pools wider than the window (speculative columns)."""
    if isa is None:
        return
    for seed in range(9):
        step = random_fused_step(seed, dtype=dtype, decode=seed % 3 == 1, long=seed % 3 == 2)
        m = step["step"]
        for ring in (False, True):
            if ring:
                pool, offsets = engine_to_ring(m.conv_state.clone())
                offsets[::2] = 1
                pool = torch.stack([torch.roll(pool[s], shifts=int(offsets[s]), dims=0) for s in range(pool.shape[0])])
                base = dict(step, step=dataclasses.replace(m, conv_state=pool, state_offsets=offsets))
            else:
                base = step
            results = []
            for want_c in (True, False):
                s = base["step"]
                run = dict(
                    base,
                    step=dataclasses.replace(
                        s,
                        conv_state=s.conv_state.clone(),
                        state_offsets=None if s.state_offsets is None else s.state_offsets.clone(),
                    ),
                    return_conv_input=want_c,
                )
                got = native.gate_conv(**run, threads=threads)
                out = got[0] if want_c else got
                results.append((out, run["step"].conv_state, run["step"].state_offsets))
            (out_a, pool_a, off_a), (out_b, pool_b, off_b) = results
            assert torch.equal(out_a, out_b), (isa, seed, ring)
            assert torch.equal(pool_a, pool_b), (isa, seed, ring)
            assert off_a is None or torch.equal(off_a, off_b)
