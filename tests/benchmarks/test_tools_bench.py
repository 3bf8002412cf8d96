"""A small-scale run of ``benchmarks/tools_bench.py``: it builds its slice, measures the disk, times the tools
it is asked for in child processes and reports what PERFORMANCE.md records (the full-size run is not
part of the tests)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "tools_bench.py"


@pytest.fixture(scope="module")
def tools_bench():
    spec = importlib.util.spec_from_file_location("tools_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_small_run_reports_every_tool_asked_for(tools_bench, tmp_path, capsys):
    out = tmp_path / "tools.json"
    tools = "copy,to-iq4_nl,gguf,verify-ckpt-iq4_nl"
    argv = ["--rows", "6000", "--small-rows", "0", "--shard-rows", "2000", "--dir", str(tmp_path), "--tools", tools]
    assert tools_bench.main([*argv, "--disk-seconds", "1", "--disk-mb", "16", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["rows"] >= 6000 and doc["shard_rows"] < doc["rows"] and doc["isa"]
    assert set(doc["tools"]) == set(tools.split(","))
    for tool, by in doc["tools"].items():
        e = by["this"]
        assert e["rows_per_s"] == e["rows_per_s_whole"] > 0  # one slice: whole runs
        assert e["projected_s"] == pytest.approx(320_001_536 / e["rows_per_s"])
        assert 0 < e["peak_rss_MiB"] < 2048, tool
    assert doc["disk"]["seq_read_MBps"] > 0 and doc["disk"]["seq_write_MBps"] > 0
    assert 0 < doc["tools"]["copy"]["this"]["of_disk"] and "of_disk" not in doc["tools"]["to-iq4_nl"]["this"]
    printed = capsys.readouterr().out
    assert "projected for 320,001,536 rows" in printed and "to-iq4_nl" in printed
    assert [p.name for p in tmp_path.iterdir()] == ["tools.json"]  # the slice is removed


def test_rates_are_the_slope_between_two_slices(tools_bench):
    """A run's fixed cost (1 s here) drops out: 3 M rows more in 3 s more is 1 M rows/s."""
    run = {"cpu_seconds": 1.0, "bytes": 0, "maxrss": 1 << 28}
    results = {"to-q4_0": {"this": {"big": [dict(run, seconds=5.0)], "small": [dict(run, seconds=2.0)]}}}
    (e,) = tools_bench.summarize(results, {"big": 4_000_000, "small": 1_000_000}, {})["to-q4_0"].values()
    assert e["rows_per_s"] == pytest.approx(1e6) and e["fixed_s"] == pytest.approx(1.0)
    assert e["projected_s"] == pytest.approx(1.0 + 320.001536) and e["rows_per_s_whole"] == pytest.approx(8e5)


def test_unknown_tools_are_refused(tools_bench, tmp_path):
    with pytest.raises(SystemExit):
        tools_bench.main(["--tools", "copy,to-q3_k", "--dir", str(tmp_path)])
