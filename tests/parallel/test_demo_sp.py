"""``ple demo --parallel sp`` as a user runs it (the default geometry, a subprocess, one torch thread
per rank): every rank's output rows and state pool equal one process's bit for bit, also where the
CPU's GEMM gives a row other bits in a GEMM of another row count (``gemm_drill.py``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.parallel.gemm_drill import row_count_linear
from tests.parallel.test_launch import HARD_TIMEOUT_S, _env, _left_behind

DRILL = str(Path(__file__).resolve().parent / "gemm_drill.py")
ROW = re.compile(r"^\|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|\s*(\d+) \|\s*[\d.]+ \|$")


def _run(tmp: Path, entry: list[str], *argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *entry, "demo", *argv]
    out = subprocess.run(cmd, env=_env(tmp), capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    assert _left_behind(tmp) == [], (out.stderr[-4000:], _left_behind(tmp))
    return out


def test_ple_demo_sp_quick_equals_one_process_bit_for_bit(tmp_path):
    out = _run(tmp_path, ["-m", "ple.commands.cli"], "--ranks", "2", "--parallel", "sp", "--quick")
    assert out.returncode == 0, (out.stdout[-4000:], out.stderr[-4000:])
    lines = out.stdout.splitlines()
    assert lines[0] == "mode   : sp on 2 gloo rank(s), sequence-parallel groups of 2; table replicated (mmap); float32"
    rows = [tuple(map(int, m.groups())) for m in map(ROW.match, lines) if m]
    assert [r[0] for r in rows] == [0, 1]
    (_, steps0, tokens, rows0, bad0, pools0), (_, steps1, tokens1, rows1, bad1, pools1) = rows
    # both ranks stepped through the same batches and together checked every token's row
    assert steps0 == steps1 > 0 and tokens == tokens1 > 0 and rows0 + rows1 == tokens and rows1 > 0
    assert (bad0, pools0, bad1, pools1) == (0, 0, 0, 0)
    assert lines[-1] == "check: every rank's output rows and state pool equal one process's, bit for bit, on every step"


def test_the_drills_gemm_gives_a_shards_rows_other_bits():
    """What the next test relies on: a GEMM of a shard's rows differs from the whole batch's rows."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 256, generator=g), torch.randn(1280, 256, generator=g)  # 40 % 3 != 20 % 3 != 27 % 3
    whole = row_count_linear(x, w)
    assert torch.equal(whole, row_count_linear(x.clone(), w))  # one row count: the same bits
    assert not torch.equal(whole[20:], row_count_linear(x[20:].clone(), w))
    assert not torch.equal(whole[:27], row_count_linear(x[:27].clone(), w))


def test_ple_demo_sp_is_exact_where_the_gemms_bits_depend_on_its_row_count(tmp_path):
    out = _run(tmp_path, [DRILL], "--ranks", "3", "--parallel", "sp", "--quick", "--json")
    assert out.returncode == 0, (out.stdout[-4000:], out.stderr[-4000:])
    res = json.loads(out.stdout)
    assert res["ok"] and res["mode"] == "sp" and res["ranks"] == 3 and res["sp_size"] == 3
    pr = res["per_rank"]
    assert [(r["bad_rows"], r["bad_pools"]) for r in pr] == [(0, 0)] * 3
    assert sum(r["rows"] for r in pr) == pr[0]["tokens"] > 0 and all(r["rows"] > 0 for r in pr)
    assert res["rank0_coverage"]["prefill_continued"] > 0 and res["rank0_coverage"]["verify"] > 0
