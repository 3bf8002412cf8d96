"""Runs ``triton_cases.py`` in a fresh interpreter, where ``TRITON_INTERPRET`` can be set before triton loads."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ple.ops

pytest.importorskip("triton")

CASES = Path(__file__).with_name("triton_cases.py")
REPO = Path(__file__).resolve().parents[2]
SRC = Path(ple.ops.__file__).resolve().parents[2]


def _run_cases(interpret: bool) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(CASES)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"triton cases failed (interpret={interpret}):\n{report}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], report


def test_triton_kernels_interpreted():
    _run_cases(interpret=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernels_on_gpu():
    _run_cases(interpret=False)
