"""The fused gate + conv step: the C kernel against the composed PyTorch and reference ops."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import ple.kernels.native as native_build
import ple.ops
from ple.ops.conv import reference as conv_reference
from ple.ops.fused import native, reference
from ple.ops.fused.composed import TORCH
from ple.ops.records import ConvWeights, GateWeights, StepMeta
from tests.ops._helpers import DTYPE_TOL, random_fused_step, run_fused, with_state

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_native_matches_composed_ops(seed, decode, dtype):
    # H around the kernel's 16-lane partial sums: below, equal, and with a remainder
    step = random_fused_step(seed, dtype=dtype, decode=decode, hidden_size=(16, 37, 5, 48)[seed % 4])
    got = run_fused(native.gate_conv, step)
    fast = run_fused(TORCH.gate_conv, step)
    ref = run_fused(reference.gate_conv, step)
    tol = DTYPE_TOL[dtype]
    for name, a, b, r in zip(("out", "c", "state"), got, fast, ref):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name} vs torch path: {m}")
        if dtype == torch.float32:
            torch.testing.assert_close(a, r, **tol, msg=lambda m, name=name: f"{name} vs reference: {m}")
        elif a.numel():
            # Same rounding points as the PyTorch path: only sum-order ties may flip a last bit; against the
            # literal reference (transformers' rounding points) no worse than the PyTorch path.
            assert (a != b).float().mean().item() < 2e-3, name
            err, err_fast = ((x.double() - r.double()).abs().max().item() for x in (a, b))
            assert err <= 2 * err_fast + 1e-2, (name, err, err_fast)


@pytest.mark.parametrize("taps,dilation,num_spec", [(1, 1, 0), (2, 1, 2), (3, 2, 0), (5, 2, 1)])
@pytest.mark.parametrize("seed", range(3))
def test_other_conv_geometries(seed, taps, dilation, num_spec):
    """K other than the published 4 takes the kernel's generic tap loop."""
    step = random_fused_step(seed, dtype=torch.float32, taps=taps, dilation=dilation, num_spec=num_spec)
    for a, b in zip(run_fused(native.gate_conv, step), run_fused(reference.gate_conv, step)):
        torch.testing.assert_close(a, b, **DTYPE_TOL[torch.float32])


@pytest.mark.parametrize("taps,dilation", [(2, 50), (4, 6), (3, 20)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_work_units_inside_the_window_read_the_slot(taps, dilation, threads):
    """A window W longer than a work unit: units that start at 0 < p0 < W also read history taps."""
    hc, h = 1, 4
    window = (taps - 1) * dilation
    g = torch.Generator().manual_seed(taps * 100 + dilation)
    lens = [40, 33, 33, 1, 70, 33]
    q = torch.tensor([0, *lens]).cumsum(0)
    t = int(q[-1])
    kv = torch.randn(t, hc * h + h, generator=g)
    key, value = kv.split([hc * h, h], dim=1)
    zeros = torch.zeros(hc * h)
    step = dict(
        key=key,
        value=value,
        hidden=torch.randn(t, hc * h, generator=g),
        gate=GateWeights.build(zeros, zeros, zeros, 1e-6, hc),
        conv=ConvWeights.build(torch.randn(hc * h, taps, generator=g), dilation),
        step=StepMeta.build(
            q,
            torch.randn(len(lens) + 1, hc * h, window + 2, generator=g),
            torch.arange(len(lens)),
            torch.tensor([True, True, True, True, False, True]),
            torch.tensor([0, 1, 2, 0, 0, 2]),
        ),
        return_conv_input=True,
    )
    for a, b in zip(run_fused(native.gate_conv, step, threads=threads), run_fused(reference.gate_conv, step)):
        torch.testing.assert_close(a, b, **DTYPE_TOL[torch.float32])


def test_masked_non_finite_values_propagate_like_the_torch_path():
    step = random_fused_step(0, dtype=torch.float32)  # seed 0 carries a token mask
    mask = step["token_mask"]
    masked = int(torch.nonzero(~mask)[0])
    step["value"][masked, 0] = float("nan")
    step["key"][masked, 1] = float("inf")
    got, fast = run_fused(native.gate_conv, step), run_fused(TORCH.gate_conv, step)
    for a, b in zip(got, fast):
        torch.testing.assert_close(a, b, **DTYPE_TOL[torch.float32], equal_nan=True)


def test_chunk_longer_than_the_whole_slot():
    """More new rows than the slot has elements (tiny C and L): the slot is rebuilt from the rows alone."""
    g = torch.Generator().manual_seed(3)
    hc, h, taps, n = 2, 1, 2, 50
    kv = torch.randn(n, hc * h + h, generator=g)
    key, value = kv.split([hc * h, h], dim=1)
    hidden = torch.randn(n, hc * h, generator=g)
    gate = GateWeights.build(*[torch.randn(hc * h, generator=g) for _ in range(3)], 1e-6, hc)
    conv = ConvWeights.build(torch.randn(hc * h, taps, generator=g), 1)
    pool = torch.randn(1, hc * h, 2, generator=g)  # C * L = 4 elements
    want_pool = pool.clone()

    def meta(p):
        return StepMeta.build(torch.tensor([0, n]), p, torch.tensor([0]), torch.tensor([True]), torch.tensor([1]))

    got = native.gate_conv(key, value, hidden, gate, conv, meta(pool))
    want = reference.gate_conv(key, value, hidden, gate, conv, meta(want_pool))
    torch.testing.assert_close(got, want, **DTYPE_TOL[torch.float32])
    assert torch.equal(pool, want_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_state_is_the_tail_of_kept_history_and_c(seed, dtype):
    """The new slots hold exactly what the literal conv writes for the kernel's own conv inputs."""
    step = random_fused_step(seed, dtype=dtype)
    _, c, state = run_fused(native.gate_conv, step)
    m = step["step"]
    want = m.conv_state.clone()
    conv_reference.dilated_conv(c, step["conv"], dataclasses.replace(m, conv_state=want))
    assert torch.equal(state, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_work_split_does_not_change_results(seed, dtype):
    """Long chunks are split into token ranges (each recomputes the W rows before it): any split, same bits."""
    step = random_fused_step(seed, dtype=dtype, long=True)
    one = run_fused(native.gate_conv, step, threads=1)
    for threads in (2, 3, 7):
        other = run_fused(native.gate_conv, step, threads=threads)
        for a, b in zip(one, other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_stream_equals_one_shot_bitwise(dtype):
    """A request fed in chunks (shorter than the window too), then decoded, equals one whole prefill."""
    hc, h, taps, dilation = 2, 16, 4, 3
    channels = hc * h
    window = (taps - 1) * dilation
    g = torch.Generator().manual_seed(7)
    n = 60
    kv = torch.randn(n, channels + h, generator=g).to(dtype)
    hidden = torch.randn(n, channels, generator=g).to(dtype)
    ws = [0.3 * torch.randn(channels, generator=g) for _ in range(3)]
    conv_w = torch.randn(channels, taps, generator=g)

    gate = GateWeights.build(*ws, 1e-6, hc)
    conv = ConvWeights.build(conv_w, dilation)

    def step(a, b, pool, resume):
        key, value = kv[a:b].split([channels, h], dim=1)
        meta = StepMeta.build(torch.tensor([0, b - a]), pool, torch.tensor([1]), torch.tensor([resume]))
        return native.gate_conv(key, value, hidden[a:b], gate, conv, meta)

    whole = step(0, n, torch.zeros(2, channels, window, dtype=dtype), False)
    pool = torch.full((2, channels, window), float("nan"), dtype=dtype)
    cuts = [0, 1, 3, 13, 20, 41, 50] + list(range(51, n + 1))
    parts = [step(a, b, pool, a > 0) for a, b in zip(cuts[:-1], cuts[1:])]
    assert torch.equal(torch.cat(parts), whole)


def test_dispatch_picks_the_kernel_on_cpu(monkeypatch):
    calls = []
    real = native.run
    monkeypatch.setattr(native, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
    step = random_fused_step(1, dtype=torch.bfloat16)
    ple.ops.gate_conv(**step)
    assert calls == [1]
    step16 = random_fused_step(1, dtype=torch.float16)  # fp16 runs the PyTorch path
    out, c = ple.ops.gate_conv(**step16)
    assert calls == [1] and out.dtype == torch.float16


def test_token_mask_of_the_wrong_length_is_refused():
    step = random_fused_step(0, dtype=torch.float32)
    step["token_mask"] = torch.ones(step["value"].shape[0] + 1, dtype=torch.bool)
    for impl in (native, TORCH, reference):
        with pytest.raises(ValueError, match=r"token_mask.shape=.*expected \[T\]"):
            run_fused(impl.gate_conv, step)


def test_unsupported_inputs_are_refused_by_name():
    step = random_fused_step(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        native.gate_conv(**step)
    step = random_fused_step(2, dtype=torch.float32)
    step = with_state(step, step["step"].conv_state.to(torch.bfloat16))
    with pytest.raises(ValueError, match="state pool dtype"):
        native.gate_conv(**step)
    assert "not contiguous" in native.unsupported_reason(step["value"], torch.zeros(2, 3, 4).transpose(1, 2), 4)
    assert "65 conv taps" in native.unsupported_reason(step["value"], step["step"].conv_state, 65)


def test_rejection_beyond_the_slot_is_caught_without_validation():
    for seed in range(50):  # the first random batch with a request that resumes from its slot
        step = random_fused_step(seed, dtype=torch.float32)
        m = step["step"]
        active = (m.state_indices >= 0) & m.has_initial_state
        if bool(active.any()):
            break
    r = int(torch.nonzero(active)[0])
    bad = torch.zeros_like(m.state_indices)
    bad[r] = m.conv_state.shape[-1]  # more than L - W
    step["step"] = dataclasses.replace(m, num_rejected=bad)
    with pytest.raises(ValueError, match=f"request {r}"):
        native.gate_conv(**step, validate=False)
    with pytest.raises(ValueError, match="num_rejected"):
        native.gate_conv(**step)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A clean build state with its own cache folder."""
    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_lib", None)
    monkeypatch.setattr(native_build, "_error", None)
    monkeypatch.setattr(native_build, "_warned", False)
    return tmp_path


def test_build_is_cached_and_atomic(fresh_build, monkeypatch):
    lib = native_build.library()
    built = sorted(p.name for p in fresh_build.iterdir())
    assert len(built) == 2 and built[0].startswith("ple_cpu-") and built[0].endswith(".so"), built
    assert built[1] == built[0] + ".sha256"
    data = (fresh_build / built[0]).read_bytes()
    digest, size = (fresh_build / built[1]).read_text().split()
    assert digest == hashlib.sha256(data).hexdigest() and int(size) == len(data)
    assert lib is native_build.library()
    # another CPU (a cache folder shared between machines) gets its own -march=native build
    monkeypatch.setattr(native_build, "_lib", None)
    monkeypatch.setattr(native_build, "_cpu_signature", lambda: b"flags: none")
    native_build.library()
    assert len(list(fresh_build.glob("ple_cpu-*.so"))) == 2
    assert not list(fresh_build.glob("*.partial"))


_DAMAGE_CHILD = textwrap.dedent(
    """
    import os, random, sys
    from pathlib import Path
    import torch
    from ple.kernels import native as _native
    from ple.config import PLEConfig
    from ple.ngram import fresh_context, reference
    from ple.ngram import native as ngram_native

    cfg = PLEConfig(hidden_size=8, eos_token_id=2, vocab_size=100, ngram_vocab_size_base=50, ple_embed_dim=8,
                    heads_per_ngram=2, ple_layer_ids=(1,))
    lay = cfg.layout(0)
    x = torch.tensor([5, 9, 2, 7, 7, 11])
    qsl, ctx = torch.tensor([0, 6]), fresh_context(1, lay, 2)
    want = reference.ngram_ids(x, qsl, ctx, lay, 2)
    folder = Path(os.environ["PLE_CACHE_DIR"])

    def fresh_load():
        _native._lib, _native._error = None, None
        return torch.equal(ngram_native.ngram_ids(x, qsl, ctx, lay, 2), want)

    def intact(lib):
        import hashlib
        digest, size = Path(str(lib) + ".sha256").read_text().split()
        return hashlib.sha256(lib.read_bytes()).hexdigest() == digest

    assert fresh_load()
    (lib,) = folder.glob("*.so")
    good = lib.read_bytes()
    for damage in sys.argv[1:]:
        if damage == "truncated":
            os.truncate(lib, len(good) // 2)
        elif damage == "garbage":
            lib.write_bytes(random.Random(0).randbytes(len(good)))
        elif damage == "garbage_with_record":
            import hashlib
            junk = random.Random(1).randbytes(4096)
            lib.write_bytes(junk)
            Path(str(lib) + ".sha256").write_text(f"{hashlib.sha256(junk).hexdigest()} {len(junk)}\\n")
        elif damage == "no_record":
            os.unlink(str(lib) + ".sha256")
        ok = fresh_load()
        print(damage, "ok" if ok else "wrong", "repaired" if intact(lib) else "broken", flush=True)
    # the cache file cut short while this process runs the library it loaded
    os.truncate(lib, 0)
    print("cut", "ok" if torch.equal(ngram_native.ngram_ids(x, qsl, ctx, lay, 2), want) else "wrong", flush=True)
    """
)


def test_damaged_cached_library_is_rebuilt_not_loaded(tmp_path):
    """A truncated or garbage library in the cache is rebuilt (not loaded: a truncated mapped library
    dies of SIGBUS), and a cache file cut short after loading does not touch a running process.

    The child's "compiler" copies a library built here once, so its rebuilds take no time."""
    native_build.library()  # this machine's build, from its usual cache
    built = tmp_path / "built.so"
    built.write_bytes(native_build._library_file.read_bytes())
    cc = tmp_path / "fake-cc"
    cc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fake cc 1"; exit 0; fi\n'
        'while [ "$#" -gt 0 ]; do if [ "$1" = "-o" ]; then cp "' + str(built) + '" "$2"; exit $?; fi; shift; done\n'
        "exit 1\n"
    )
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    damages = ["truncated", "garbage", "garbage_with_record", "no_record"]
    env = {**os.environ, "PYTHONPATH": str(SRC), "PLE_CACHE_DIR": str(cache), "CC": str(cc)}
    proc = subprocess.run(
        [sys.executable, "-c", _DAMAGE_CHILD, *damages], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.splitlines() == [f"{d} ok repaired" for d in damages] + ["cut ok"]


def test_unwritable_cache_folder(fresh_build, monkeypatch, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("PLE_CACHE_DIR", str(blocked / "ple"))  # explicit: refused with the reason
    with pytest.raises(native_build.NativeUnavailable, match="PLE_CACHE_DIR=.*cannot be created"):
        native_build.library()
    monkeypatch.setattr(native_build, "_error", None)
    monkeypatch.delenv("PLE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # the default folder: a per-user temp folder instead
    monkeypatch.setattr(native_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    native_build.library()
    assert len(list((tmp_path / "tmp").glob("ple-*/ple_cpu-*.so"))) == 1


def test_shared_fallback_cache_folder_is_refused(fresh_build, monkeypatch, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.delenv("PLE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(native_build.tempfile, "gettempdir", lambda: str(tmp_path))
    shared = tmp_path / f"ple-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could plant a library here
    with pytest.raises(native_build.NativeUnavailable, match="not private"):
        native_build.library()


def test_compiler_timeout_is_a_failed_build(fresh_build, monkeypatch):
    real = native_build.subprocess.run

    def slow(cmd, *a, **k):
        if "-o" in cmd:
            raise native_build.subprocess.TimeoutExpired(cmd, 300)
        return real(cmd, *a, **k)

    monkeypatch.setattr(native_build.subprocess, "run", slow)
    with pytest.raises(native_build.NativeUnavailable, match="timed out"):
        native_build.library()
    assert not list(fresh_build.glob("*"))


def test_failed_build_warns_once_and_falls_back(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.warns(RuntimeWarning, match="failed"):
        assert not native_build.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native_build.available()  # once
        step = random_fused_step(4, dtype=torch.float32)
        out, _ = ple.ops.gate_conv(**with_state(step, step["step"].conv_state.clone()))  # the PyTorch path
    want, _ = TORCH.gate_conv(**with_state(step, step["step"].conv_state.clone()))
    torch.testing.assert_close(out, want)
    assert not list(fresh_build.glob("*.partial"))
    with pytest.raises(native_build.NativeUnavailable, match="failed"):
        native_build.library()


def test_missing_compiler_and_switch_off(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-ple")
    with pytest.raises(native_build.NativeUnavailable, match="no-such-compiler-ple"):
        native_build.library()
    monkeypatch.setenv("PLE_NATIVE", "0")
    with pytest.raises(native_build.NativeUnavailable, match="PLE_NATIVE=0"):
        native_build.library()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native_build.available()  # turned off on purpose: no warning
