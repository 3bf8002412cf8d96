"""The test suite's warning filters hide only what ple does not cause: torch's own TorchScript uses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FORWARD_AD = """
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import jvp


def test_forward_mode():
    x = torch.randn(3)
    _, t = jvp(torch.sin, (x,), (torch.ones(3),))
    with fwAD.dual_level():
        y = fwAD.unpack_dual(torch.sin(fwAD.make_dual(x, torch.ones(3)))).tangent
    assert torch.equal(t, y)
"""


def test_ple_calls_no_torchscript_api():
    """What the filters hide (``torch.jit.script`` / ``script_method`` deprecation) cannot be ple's."""
    used = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in sorted((ROOT / "src" / "ple").rglob("*.py"))
        for m in re.finditer(r"\bjit\.\w+|from torch import jit|torch\.jit\b", p.read_text())
    ]
    assert used == []


def test_forward_mode_derivatives_leave_no_torchscript_warning(tmp_path):
    """torch's forward-mode derivatives script their decompositions on first use (18 deprecation
    warnings from torch.jit._script); under the project's pytest settings none is shown."""
    test = tmp_path / "test_forward_ad.py"
    test.write_text(_FORWARD_AD)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml")]
    out = subprocess.run([*cmd, "--rootdir", str(tmp_path), str(test)], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "1 passed" in text, text
    assert "jit.script" not in text and "warning" not in text, text
    # the same run without the project's filters shows them: the filter is what hides them
    bare = subprocess.run(
        [*cmd[:-2], "--rootdir", str(tmp_path), str(test)], capture_output=True, text=True, timeout=300
    )
    assert "`torch.jit.script` is deprecated" in bare.stdout + bare.stderr
