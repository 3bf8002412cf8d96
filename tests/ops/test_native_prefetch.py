"""The fused kernel's prefetch plan (how much of its next work unit it fetches ahead): every depth gives
the same bits, the CPU's default is what ``auto`` restores, and bad depths are refused by name."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ple.kernels.native as native_build
from ple.errors import InvalidArgumentError
from ple.ops.fused import native
from ple.ops.state import engine_to_ring
from tests.ops._helpers import random_fused_step, with_state

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def restore_prefetch():
    before = native_build.prefetch_lines()
    yield
    native_build.set_prefetch_lines(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_depth_gives_the_same_bits(dtype, restore_prefetch):
    """Decode and prefill steps on rotated rings (whose next unit's state columns the plan names) and on
    the engine layout, on one and three threads: outputs, conv inputs and new state equal bit for bit
    whether the plan fetches nothing, one line, eight, or whole rows and columns."""
    for seed in range(6):
        step = random_fused_step(seed, dtype=dtype, decode=seed % 3 != 0)
        m = step["step"]
        ring_pool, offsets = engine_to_ring(m.conv_state.clone())
        offsets[1::2] = 1
        ring_pool = torch.stack([torch.roll(ring_pool[s], int(offsets[s]), dims=0) for s in range(ring_pool.shape[0])])
        for threads in (1, 3):
            results = []
            for depth in (0, 1, 8, "all"):
                native_build.set_prefetch_lines(depth)
                engine = m.conv_state.clone()
                out_e, c_e = native.gate_conv(**with_state(step, engine), threads=threads)
                ring, offs = ring_pool.clone(), offsets.clone()
                out_r, c_r = native.gate_conv(
                    **dict(step, step=dataclasses.replace(m, conv_state=ring, state_offsets=offs)), threads=threads
                )
                results.append((out_e, c_e, engine, out_r, c_r, ring, offs))
            for other in results[1:]:
                for a, b in zip(results[0], other):
                    assert torch.equal(a, b), (seed, threads)


def test_depths_set_and_read_back(restore_prefetch):
    native_build.set_prefetch_lines("auto")
    default = native_build.prefetch_lines()
    assert default == "all" or (type(default) is int and default > 0)
    assert native_build.set_prefetch_lines(3) == default
    assert native_build.prefetch_lines() == 3
    assert native_build.set_prefetch_lines(" ALL ") == 3
    assert native_build.prefetch_lines() == "all"
    native_build.set_prefetch_lines("0")
    assert native_build.prefetch_lines() == 0
    native_build.set_prefetch_lines("auto")
    assert native_build.prefetch_lines() == default


def test_the_default_follows_the_cpu(restore_prefetch):
    """``auto`` is 8 lines on Intel cores (whole runs held up their loads there) and whole runs elsewhere."""
    import platform

    vendor = None
    if platform.machine().lower() in ("x86_64", "amd64") and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            vendor = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), None)
    native_build.set_prefetch_lines("auto")
    assert native_build.prefetch_lines() == (8 if vendor == "GenuineIntel" else "all"), vendor


@pytest.mark.parametrize("bad", [-1, -3, 2.5, True, "some", "", None])
def test_bad_depths_are_refused_by_name(bad, restore_prefetch):
    native_build.set_prefetch_lines(5)
    with pytest.raises(InvalidArgumentError, match=f"prefetch depth {bad!r} is not a prefetch depth"):
        native_build.set_prefetch_lines(bad)
    assert native_build.prefetch_lines() == 5


def _child(value: str) -> str:
    code = (
        "import ple.kernels.native as n\n"
        "try:\n"
        "    print('plan', n.prefetch_lines())\n"
        "except ValueError as e:\n"
        "    print('refused', e)\n"
    )
    env = dict(os.environ, PLE_NATIVE_PREFETCH=value, PYTHONPATH=str(SRC))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return proc.stdout.strip()


def test_environment_variable_sets_or_refuses_by_name(restore_prefetch):
    native_build.set_prefetch_lines("auto")
    assert _child("auto") == f"plan {native_build.prefetch_lines()}"
    assert _child(" All ") == "plan all"
    assert _child("12") == "plan 12"
    out = _child("deep")
    assert out.startswith("refused PLE_NATIVE_PREFETCH='deep' is not a prefetch depth of the kernels"), out
