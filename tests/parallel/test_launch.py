"""``ple demo --ranks N --parallel MODE`` and torchrun, end to end: a run that matches exits 0; a rank
that dies or stalls mid-step makes the others fail with a clear error, never hang (each command runs
under a hard timeout). Each command gets its own temporary folder (``TMPDIR``): however the ranks
ended, no ``ple-parallel-*`` folder is left in it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.test_modes import TINY

HARD_TIMEOUT_S = 240
SRC = str(Path(__file__).resolve().parents[2] / "src")
DRILL = str(Path(__file__).resolve().parent / "fault_drill.py")  # ple demo with one rank failing on purpose
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["TMPDIR"] = str(tmp)
    return env


def _left_behind(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("ple-parallel"))


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("parallel_cli") / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def _demo(
    config: str, tmp: Path, *argv: str, launcher: list[str] | None = None, fault: str | None = None
) -> subprocess.CompletedProcess:
    """Run ``ple demo`` with ``tmp`` as its temporary folder; fail when a ``ple-parallel`` folder is left there.
    ``fault``: ``KIND:RANK:STEP``, run through the test launcher ``fault_drill.py`` that makes that rank fail."""
    entry = ["-m", "ple.commands.cli"] if fault is None else [DRILL, fault]
    cmd = (launcher or [sys.executable]) + entry + ["demo", "--config", config, "--requests", "5"]
    cmd += ["--slots", "3", "--chunk", "9", *argv]
    out = subprocess.run(cmd, env=_env(tmp), capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    assert _left_behind(tmp) == [], (out.stderr[-4000:], _left_behind(tmp))
    return out


def test_demo_sp_x_dp_on_four_ranks_matches_one_process(tiny_config, tmp_path):
    """Two sequence-parallel groups of two (TP x DP), the table file sharded across all four ranks."""
    out = _demo(
        tiny_config, tmp_path, "--ranks", "4", "--parallel", "sp", "--sp-size", "2", "--table-split", "sharded",
        "--tier", "mmap", "--parallel-dtype", "bfloat16", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout)
    assert res["ok"] and res["ranks"] == 4 and res["sp_size"] == 2 and res["table"] == "sharded (mmap)"
    for r in res["per_rank"]:
        assert r["bad_rows"] == 0 and r["bad_pools"] == 0 and r["rows"] > 0
    # ranks 0 and 1 share a batch, 2 and 3 another: each pair checked its batch's tokens between them
    pr = res["per_rank"]
    assert pr[0]["tokens"] == pr[1]["tokens"] and pr[2]["tokens"] == pr[3]["tokens"]
    assert pr[0]["rows"] + pr[1]["rows"] == pr[0]["tokens"]


def test_torchrun_data_parallel(tiny_config, tmp_path):
    out = _demo(tiny_config, tmp_path, "--parallel", "dp", "--json", launcher=TORCHRUN)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    res = json.loads(out.stdout)  # --json: one document on stdout, under torchrun too (rank 0 writes it)
    # the demo's default tier: the table file, memory-mapped, each rank holding its rows
    assert res["ok"] and res["ranks"] == 2 and res["mode"] == "dp" and res["table"] == "sharded (mmap)"


def test_torchrun_ranks_that_die_or_are_killed_leave_nothing_behind(tiny_config, tmp_path):
    """Under torchrun each rank has a temporary folder of its own: gone once its tables are open, so
    neither rank 1 (it dies) nor rank 0 (the launcher ends it) leaves one behind (checked by _demo)."""
    out = _demo(tiny_config, tmp_path, "--parallel", "dp", launcher=TORCHRUN, fault="die:1:1")
    assert out.returncode != 0 and re.search(r"exitcode\s*:\s*17\b", out.stderr), out.stderr[-4000:]


def test_a_rank_that_dies_fails_the_others(tiny_config, tmp_path):
    out = _demo(tiny_config, tmp_path, "--ranks", "3", "--parallel", "sp", "--dist-timeout", "20", fault="die:1:2")
    assert out.returncode == 1
    err = out.stderr
    assert "ple demo: 3 of 3 ranks failed (rank 0: exit 1, rank 1: exit 17, rank 2: exit 1)" in err, err[-4000:]
    for r in (0, 2):
        assert f"ple demo: rank {r} of 3: PLE layer 0, 'sp' mode, step 2 failed after" in err
    assert "a peer closed its connection (it died or left with an error)" in err
    assert "rank 1: no report (died, or still stalled)" in err
    assert "killed after the grace period" not in err  # the others ended on their own


def test_a_rank_that_stalls_fails_the_others_within_the_timeout(tiny_config, tmp_path):
    out = _demo(tiny_config, tmp_path, "--ranks", "2", "--parallel", "etp", "--dist-timeout", "3", fault="stall:1:2")
    assert out.returncode == 1
    err = out.stderr
    assert "ple demo: rank 0 of 2: PLE layer 0, 'etp' mode, step 2 failed after 3." in err, err[-4000:]
    assert "a peer did not take part within 3 s timeout" in err
    assert "rank 1: no report (died, or still stalled)" in err
    assert "ple demo: 2 of 2 ranks failed (rank 0: exit 1, rank 1: exit -9); killed after the grace period: [1]" in err


def test_a_rank_that_raises_is_named_by_the_others(tiny_config, tmp_path):
    out = _demo(tiny_config, tmp_path, "--ranks", "2", "--parallel", "dp", fault="raise:1:1")
    assert out.returncode == 1
    err = out.stderr
    assert "ple demo: rank 1: InvalidArgumentError: fault raise:1:1: rank 1 raised at step 1 as asked" in err
    assert "ple demo: rank 0 of 2: PLE layer 0, 'dp' mode, step 1 failed after" in err
    assert "rank 1: raised InvalidArgumentError: fault raise:1:1" in err, err[-4000:]
