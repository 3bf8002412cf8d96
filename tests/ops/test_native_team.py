"""The C kernels' threads: PyTorch's OpenMP team where the library shares its runtime, threads started
per call otherwise (and in a forked child); results never depend on which, or on how many."""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ple.kernels.native as native_build
from ple.ops.fused import native
from ple.table.lookup.torch_impl import gather_rows
from tests.ops._helpers import random_fused_step, run_fused

SRC = Path(__file__).resolve().parents[2] / "src"

pytestmark = pytest.mark.skipif(not native_build.available(), reason="the C kernels are not built here")


def _gather_inputs():
    g = torch.Generator().manual_seed(5)
    data = torch.randn(5000, 160, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 5000, (1500,), generator=g)
    fp8 = (torch.randn(5000, 160, generator=g) * 4).to(torch.float8_e4m3fn)
    return data, ids, fp8


def _lib_gather(data: torch.Tensor, ids: torch.Tensor, threads: int) -> torch.Tensor:
    out = torch.empty(ids.shape[0], data.shape[1], dtype=data.dtype)
    e = data.element_size()
    rc = native_build.library().ple_gather_rows(
        data.data_ptr(), data.shape[0], data.stride(0) * e, data.shape[1] * e, ids.data_ptr(), ids.shape[0],
        out.data_ptr(), threads,
    )  # fmt: skip
    assert rc == 0
    return out


def _lib_gather_lut(fp8: torch.Tensor, ids: torch.Tensor, threads: int) -> torch.Tensor:
    lut = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).contiguous()
    out = torch.empty(ids.shape[0], fp8.shape[1], dtype=torch.float32)
    rc = native_build.library().ple_gather_lut(
        fp8.data_ptr(), fp8.shape[0], fp8.stride(0), fp8.shape[1], ids.data_ptr(), ids.shape[0], lut.data_ptr(), 4,
        out.data_ptr(), threads,
    )  # fmt: skip
    assert rc == 0
    return out


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _fused_digest(threads: int) -> str:
    step = random_fused_step(3, dtype=torch.bfloat16, hidden_size=48, long=True)
    return _digest(*run_fused(native.gate_conv, step, threads=threads))


def test_team_is_pytorchs_openmp_where_torch_runs_on_gnu_openmp():
    gomp = native_build._torch_openmp()
    if gomp is None:
        pytest.skip("this PyTorch does not run its threads on GNU OpenMP here")
    assert native_build.team() == "openmp"
    assert native_build.library().ple_team_kind() == 1


def test_threads_for_counts_pieces_per_thread(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert native_build.threads_for(511, 256) == 1  # under two threads' worth
        want = 2 if native_build.team() == "openmp" else 1
        assert native_build.threads_for(512, 256) == want
        assert native_build.threads_for(10**6, 256) == want  # never more than torch's threads
        monkeypatch.setattr(native_build, "_team", [native_build.library(), "pthreads"])
        assert native_build.threads_for(10**6, 256) == 1  # a thread started per call costs more
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_gathers_equal_on_any_number_of_threads(threads):
    data, ids, fp8 = _gather_inputs()
    assert torch.equal(_lib_gather(data, ids, threads), data.index_select(0, ids))
    assert torch.equal(_lib_gather(data, ids, threads), _lib_gather(data, ids, 1))
    want = fp8.index_select(0, ids).to(torch.float32)
    assert torch.equal(_lib_gather_lut(fp8, ids, threads), want)
    assert torch.equal(gather_rows(data, ids), data.index_select(0, ids))


def test_fused_step_equal_on_any_number_of_threads():
    one = _fused_digest(1)
    assert all(_fused_digest(k) == one for k in (2, 3, 5))


_CHILD = textwrap.dedent(
    """
    import hashlib, pickle, sys, torch
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    import ple.kernels.native as native_build
    from ple.ops.fused import native
    from ops._helpers import random_fused_step, run_fused
    from ops.test_native_team import _digest, _gather_inputs, _lib_gather, _lib_gather_lut
    data, ids, fp8 = _gather_inputs()
    step = random_fused_step(3, dtype=torch.bfloat16, hidden_size=48, long=True)
    out = {
        "team": native_build.team(),
        "gather": _digest(_lib_gather(data, ids, 2), _lib_gather_lut(fp8, ids, 2)),
        "fused": _digest(*run_fused(native.gate_conv, step, threads=3)),
    }
    sys.stdout.buffer.write(pickle.dumps(out))
    """
)


def test_threads_started_per_call_give_the_same_bits(tmp_path):
    """``PLE_NATIVE_OPENMP=0`` builds the library without OpenMP: the same bits, threads of its own."""
    env = dict(os.environ, PLE_NATIVE_OPENMP="0", PLE_CACHE_DIR=str(tmp_path))
    tests = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(SRC), str(tests)], env=env, capture_output=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr.decode()
    got = pickle.loads(proc.stdout)
    assert got["team"] == "pthreads"
    data, ids, fp8 = _gather_inputs()
    assert got["gather"] == _digest(_lib_gather(data, ids, 2), _lib_gather_lut(fp8, ids, 2))
    assert got["fused"] == _fused_digest(3)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_forked_child_runs_its_kernels_without_the_parents_team():
    """GNU OpenMP cannot start a team in a child forked after its parent ran one: the child's kernels
    run on threads started per call (and give the parent's bits) instead of waiting forever."""
    data, ids, fp8 = _gather_inputs()
    want = _digest(_lib_gather(data, ids, 2), _lib_gather_lut(fp8, ids, 2))
    x = torch.randn(256, 256)
    x @ x  # the parent's OpenMP team has run
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            # torch's own parallel ops cannot run here either: only the kernels, compared as bytes
            got = (native_build.team(), _digest(_lib_gather(data, ids, 2), _lib_gather_lut(fp8, ids, 2)))
            os.write(write, pickle.dumps(got))
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's kernels did not finish within 60 s")
    with os.fdopen(read, "rb") as f:
        team, digest = pickle.loads(f.read())
    assert team == "pthreads"
    assert digest == want


def test_lookahead_worker_gathers_on_its_own_thread():
    """The prefetch worker's gathers never start a team: the model's work keeps the other cores."""
    import threading

    from ple.table import MemoryTable

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        main = native_build.threads_for(10**6, 256)
        seen = []
        worker = threading.Thread(
            target=lambda: (native_build.background_thread(), seen.append(native_build.threads_for(10**6, 256)))
        )
        worker.start()
        worker.join()
        assert seen == [1]
        assert native_build.threads_for(10**6, 256) == main  # the mark is the worker's alone
        table = MemoryTable(torch.randn(4096, 16).to(torch.bfloat16))
        ids = torch.randint(0, 4096, (64, 16))
        handle = table.start_prefetch(ids, torch.bfloat16)
        assert torch.equal(handle.wait(), table.lookup(ids, torch.bfloat16))
        handle.release()
        assert table._engine._pool().submit(native_build.threads_for, 10**6, 256).result() == 1
        table.close()
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A clean build state with its own cache folder (the process's library is restored afterwards)."""
    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native_build, "_lib", None)
    monkeypatch.setattr(native_build, "_error", None)
    monkeypatch.setattr(native_build, "_warned", False)
    return tmp_path


def test_compiler_without_openmp_warns_and_builds_without_it(fresh_build, monkeypatch):
    import shutil

    if native_build._torch_openmp() is None:
        pytest.skip("this PyTorch does not run on GNU OpenMP here: the library is built without it anyway")
    real = shutil.which(os.environ.get("CC", "cc"))
    if real is None:
        pytest.skip("no C compiler")
    fake = fresh_build / "cc-without-openmp"
    fake.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "cc: error: unsupported option -fopenmp (no libgomp)" >&2; '
        "exit 1; }; done\n"
        f'exec {real} "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(RuntimeWarning, match="built without OpenMP"):
        native_build.library()
    assert native_build.team() == "pthreads"
    data, ids, fp8 = _gather_inputs()
    assert torch.equal(_lib_gather(data, ids, 2), data.index_select(0, ids))


@pytest.mark.parametrize("fmt", [0, 4, 7])  # q8_0, q4_0, nvfp4
def test_block_lookup_equal_on_any_number_of_threads_and_writes_nothing_on_a_bad_id(fmt):
    """``ple_quant_lookup`` on a team: the same bits on 1-5 threads; an id outside the table is refused
    (-1) before any row is written."""
    head_dim = 64
    row_bytes = {0: 2 * 34, 4: 2 * 18, 7: 32 + 4}[fmt]
    g = torch.Generator().manual_seed(fmt)
    data = torch.randint(0, 256, (3000, row_bytes), generator=g, dtype=torch.uint8)
    ids = torch.randint(0, 3000, (1100,), generator=g)
    lib = native_build.library()

    def run(ids: torch.Tensor, threads: int) -> tuple[int, torch.Tensor]:
        out = torch.full((ids.shape[0], head_dim), 7.0)
        rc = lib.ple_quant_lookup(
            fmt, data.data_ptr(), data.shape[0], row_bytes, head_dim, ids.data_ptr(), ids.shape[0], 0.5, 0,
            out.data_ptr(), threads,
        )  # fmt: skip
        return rc, out

    rc, one = run(ids, 1)
    assert rc == 0
    for threads in (2, 3, 5):
        rc, got = run(ids, threads)
        assert rc == 0 and _digest(got) == _digest(one)
    bad = ids.clone()
    bad[-1] = 3000
    rc, untouched = run(bad, 3)
    assert rc == -1 and bool((untouched == 7.0).all())
