"""benchmarks/train_bench.py runs end to end at a tiny size: every part reports, the table file is removed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_training_benchmark_reports_every_part(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_bench", ROOT / "benchmarks" / "train_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    args = ["--tokens", "8", "--steps", "2", "--rounds", "1", "--repeats", "1", "--million", "0.04"]
    args += ["--threads", "1", "2", "--spill-steps", "3", "--spill-budget", "0.5"]
    assert bench.main([*args, "--dir", str(tmp_path), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert sorted(res["step"]["threads"]) == ["1", "2"]
    assert set(res["step"]["threads"]["1"]) == {
        "projections",
        "layer, table frozen",
        "layer, table trained (SparseAdam)",
        "layer, table trained (fused)",
        "layer, table trained (SparseAdam), autograd of the reference gate and conv",
    }
    spill = res["spill"]
    assert spill["same_rows"] and spill["rows_in_memory"] < spill["rows_touched"]
    for policy in ("recent rows in memory", "first rows in memory"):
        assert spill[policy]["records_written_to_spill"] > 0 and spill[policy]["rows_spilled"] > 0
    rss = res["rss"]
    assert rss["rows_trained"] > 0 and rss["adapter_bytes"] < 1 << 20
    assert rss["dense_adam_states_bytes"] == 2 * rss["dense_fp32_gradient_bytes"] == 2 * 320_001_536 * 160 * 4
    rows = res["rows"]
    assert not rows["extrapolated"] and rows["distinct_rows"] == rows["measured"][-1]["distinct_rows"] > 1000
    assert list(tmp_path.glob("*.pletable")) == []
    assert "distinct rows" in capsys.readouterr().out


def test_a_given_table_file_is_trained_over_and_kept(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_bench", ROOT / "benchmarks" / "train_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    table = bench.sparse_table(tmp_path / "given.pletable", bench.config(), "q4_0")
    out = tmp_path / "r.json"
    args = ["--part", "rss", "--tokens", "8", "--steps", "2", "--table-file", str(table)]
    assert bench.main([*args, "--dir", str(tmp_path), "--out", str(out)]) == 0
    rss = json.loads(out.read_text())["rss"]
    assert rss["table_format"] == "q4_0" and rss["table_file_bytes"] == table.stat().st_size
    assert rss["table_file_allocated_bytes"] < rss["table_file_bytes"] // 100  # the holes take no disk
    assert rss["rows_trained"] > 0
    assert table.is_file()  # a given file is never removed
    assert "sparse q4_0 table file" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--part", "rss", "--table-file", str(tmp_path / "missing.pletable")])
