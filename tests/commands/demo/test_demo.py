"""``ple demo``: the user's path (plain transformers vs ple's loader, fresh processes) and the
serving workload, every check passing; the CLI conventions (--json, --output, exit status)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ple.commands.cli import main
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig
from tests.conftest import SMALL


@pytest.fixture(scope="module")
def small_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    cfg = PLEConfig(**SMALL)
    path.write_text(
        json.dumps({"model_type": "qwen4_exp", "text_config": {**cfg.to_dict(), "model_type": "qwen4_exp_text"}})
    )
    return path


def test_the_main_command_shows_the_users_path(tmp_path, capsys):
    """``ple demo --quick``: both parts, every check, one JSON document."""
    out = tmp_path / "demo.json"
    rc = main(["demo", "--quick", "--json", "--output", str(out), "--workdir", str(tmp_path / "work")])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    # without a terminal the run still says what it does, in the order of the report
    said = [line for line in captured.err.splitlines() if line.startswith("ple demo: ")]
    assert said[0].startswith("ple demo: 1/2 serving workload") and said[1].startswith("ple demo: 2/2 the user's path")
    assert rc == 0, doc["checks"]
    assert json.loads(out.read_text())["checks"] == doc["checks"]
    assert doc["ok"] and set(doc["checks"]) == {
        "serving_outputs_equal_reference",
        "serving_adapters_equal_alone",
        "tokens_equal",
        "logits_close",
        "tables_reused_on_second_start",
        "memory_saved",
    }
    adapters = doc["serving"]["adapters"]  # two named adapters and the base in one session
    assert adapters["ok"] and adapters["requests"] == 6 and adapters["rows"] > 0
    assert adapters["adapters"] == ["legal", "medical"]
    model = doc["model"]
    assert model["tokens_equal"] and model["max_logit_diff"] <= 1e-4
    assert len(model["plain"]["tokens"]) == model["prompts"]
    assert model["ple"]["tables"] == [["converted", "converted"], ["reused", "reused"]]
    # every column is a fresh process: the 2nd start too
    pids = [model["plain"]["pid"], *model["ple"]["pids"]]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert len(model["ple"]["peak_rss_bytes_per_start"]) == len(model["ple"]["load_seconds"]) == 2
    assert model["checkpoint"]["published_table_bytes"] * 4 == pytest.approx(
        model["checkpoint"]["table_bytes_in_memory"], rel=1e-3
    )
    assert model["ple"]["table_resident_bytes"] < model["checkpoint"]["published_table_bytes"]
    serving = doc["serving"]
    assert serving["geometry"] == "H 2560, HC 4, E 2560, 16 heads of 160, K 4"
    assert serving["checked_tokens"] > 0 and serving["worst_error_vs_tolerance"] <= 1
    assert all(serving["phases"][p]["steps"] > 0 for p in ("prefill", "decode", "verify"))
    assert serving["table_file"]["action"] == "converted"
    assert serving["published_geometry"]
    # the text report of the same results: its labels say what was measured
    from ple.commands.demo import _print_model

    _print_model(model)
    text = capsys.readouterr().out
    assert "each column is a process of its own" in text and "transformers, fp32 tables" in text
    assert f"{model['checkpoint']['published_files']} file" in text and "1 files" not in text
    if model["memory_saved_share_of_tables"] > 1:
        assert "over 100 %: transformers' peak holds the tables twice" in text


def res_adapters_ok(out) -> bool:
    """The serving part's check of two named adapters and the base in one session passed."""
    return json.loads(out.read_text())["serving"]["adapters"]["ok"] is True


@pytest.mark.parametrize("tier", ["mmap", "cached", "memory", "direct", "synthetic"])
def test_serving_checks_every_output(tier, small_config, tmp_path, capsys):
    out = tmp_path / "demo.json"
    synthetic = tier == "synthetic"
    tier = "mmap" if synthetic else tier
    argv = ["demo", "--config", str(small_config), "--tier", tier, "--requests", "6", "--slots", "3"]
    argv += ["--synthetic-tokens"] if synthetic else []
    rc = main([*argv, "--no-progress", "--output", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = [" ".join(line.split()) for line in text.splitlines()]  # content, not column layout
    assert "equals the one-shot reference" in text and "checks : all passed (2 checks)" in lines
    assert "equal to each adapter served alone, bit for bit" in text and res_adapters_ok(out)
    assert "== serving: one PLE layer through a Session ==" in lines  # not the published geometry
    res = json.loads(out.read_text())["serving"]
    assert res["tier"] == tier and res["checked_tokens"] > 0
    assert res["phases"]["prefill"]["tokens"] > 0 and res["phases"]["verify"]["tokens"] > 0
    assert (res["table_file"] is None) == (tier == "memory")
    assert res["tokens"] == ("synthetic" if synthetic else "real text")
    if tier == "direct":
        assert 0 < res["cache_hit_rate"] < 1  # real text rereads rows; the 64 MB cache holds them


def test_serving_an_existing_checkpoint_reuses_its_table_file(small_config, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = synthesize_checkpoint(PLEConfig(**SMALL), tmp_path / "ckpt", seed=3, files=3)
    argv = ["demo", "--checkpoint", str(ckpt), "--layer", "1", "--requests", "4", "--slots", "2", "--json"]
    actions = []
    for _ in range(2):
        assert main(argv) == 0
        res = json.loads(capsys.readouterr().out)["serving"]
        assert res["source"] == f"checkpoint {ckpt}" and res["ok"]
        actions.append(res["table_file"]["action"])
    assert actions == ["converted", "reused"]
    assert list((tmp_path / "cache" / "tables").glob("ckpt-*/*.pletable"))


def test_bad_arguments_are_one_line_errors(small_config, tmp_path, capsys):
    assert main(["demo", "--config", str(small_config), "--layer", "5", "--workdir", str(tmp_path / "w")]) == 2
    assert "ple demo: error: --layer 5: the config has 2 PLE layer(s)" in capsys.readouterr().err
    assert list((tmp_path / "w").iterdir()) == []  # refused before anything was written
    with pytest.raises(SystemExit) as e:
        main(["demo", "--tier", "disk"])
    assert e.value.code == 2
    # a budget is for the direct tier, as from_pretrained and ple eval say: refused before anything runs
    assert main(["demo", "--tier", "cached", "--memory-budget", "1MiB", "--workdir", str(tmp_path / "w")]) == 2
    assert "ple demo: error: --memory-budget is for --tier direct, not --tier cached" in capsys.readouterr().err
    assert list((tmp_path / "w").iterdir()) == []


def test_a_reused_workdir_is_refused_before_anything_runs(tmp_path, capsys):
    (tmp_path / "model" / "published").mkdir(parents=True)
    assert main(["demo", "--quick", "--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"--workdir {tmp_path} is not empty (it holds model): ple demo keeps" in err
    assert err.rstrip().endswith("reuses nothing; pass an empty or new folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the serving part never ran


def test_a_failed_or_stuck_measuring_process_is_named(tmp_path):
    """A child that fails, or runs past its time limit, is a MeasureError (not a bad-input error)
    naming the loader and what happened; the stuck one is stopped."""
    from ple.errors import InvalidArgumentError
    from ple.integrations.demo_model import MeasureError, measure

    with pytest.raises(
        MeasureError, match=r"(?s)the plain process failed \(exit 1\):\n.*No such file or directory"
    ) as e:
        measure("plain", tmp_path / "missing", [[2, 3]], 1, tmp_path / "l.pt", evict=False, timeout=300)
    assert not isinstance(e.value, InvalidArgumentError)
    with pytest.raises(MeasureError, match="the ple process ran past its 0.01 s limit and was stopped"):
        measure("ple", tmp_path / "missing", [[2, 3]], 1, tmp_path / "l.pt", evict=False, timeout=0.01)


_HUNG_UP_CHILD = """
import sys, time
from pathlib import Path
import ple.commands.demo as demo

def stuck(args, work, progress):
    (work / "table.bin").write_bytes(bytes(1 << 20))
    Path(sys.argv[1]).write_text("working")
    time.sleep(120)

demo.run_serving = stuck
from ple.commands.cli import main
sys.exit(main(["demo", "--quick", "--only", "serving"]))
"""


@pytest.mark.parametrize("sig, code, said", [(signal.SIGHUP, 129, "hung up"), (signal.SIGTERM, 143, "terminated")])
def test_a_closed_terminal_leaves_no_temporary_folder(tmp_path, sig, code, said):
    """SIGHUP (the terminal closed) and SIGTERM end the demo with the cleanup of Ctrl-C: its
    ``ple-demo-*`` folder in ``$TMPDIR`` is removed, and the exit status says which signal."""
    tmpdir, marker = tmp_path / "tmp", tmp_path / "marker"
    tmpdir.mkdir()
    src = str(Path(__file__).resolve().parents[3] / "src")
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": src}
    child = subprocess.Popen(
        [sys.executable, "-c", _HUNG_UP_CHILD, str(marker)], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), child.communicate(timeout=30)
        (work,) = tmpdir.iterdir()
        assert work.name.startswith("ple-demo-") and (work / "table.bin").exists()
        child.send_signal(sig)
        _, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == code, stderr
    assert stderr.splitlines()[-1] == f"ple demo: {said}" and "Traceback" not in stderr
    assert list(tmpdir.iterdir()) == []
