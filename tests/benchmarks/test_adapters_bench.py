"""benchmarks/adapters_bench.py runs end to end in its --quick mode: every part reports, the adapter
files are removed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_adapters_benchmark_reports_every_part(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("adapters_bench", ROOT / "benchmarks" / "adapters_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--quick", "--repeat", "2", "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    decode, prefill = res["timed"]
    assert decode["case"] == "decode 8 x 1, 2 steps, 4 adapters" and prefill["case"] == "prefill 1 x 64, 1 adapter"
    for case in (decode, prefill):
        assert case["outputs_equal"] and case["adapter_rows_read"]  # the adapters' rows were read
        assert {len(v) for v in case["samples"].values()} == {2}
        assert case["apply_s_per_step"] > 0 and case["apply_alone_s"] > 0
    # every adapter holds the rows its requests read, topped up to --rows
    assert res["adapter_rows"] == [4000] * 4 and all(0 < n < 4000 for n in res["adapter_rows_read"])
    mem = res["memory"]
    assert [e["adapters"] for e in mem["loaded"]] == [1, 4, 8]
    assert [e["rows"] for e in mem["loaded"]] == [4000, 16000, 32000]
    per_row = [e["adapters_nbytes"] / e["rows"] for e in mem["loaded"]]
    assert per_row == [per_row[0]] * 3 and per_row[0] == 16 * 2 + 16  # bf16 rows of 16 + id and slot
    assert [e["variant"] for e in mem["session"]] == ["base", "adapters", "adapters", "base"]
    assert all(e["rss_bytes"] > 0 for e in mem["session"]) and mem["model"]["rss_bytes"] > 0
    load = res["load"]
    assert load["rows"] == 20_000 and len(load["load_s"]) == 2 and load["median_s"] > 0
    assert list(tmp_path.iterdir()) == [out]  # the adapter files and their folder are gone
    text = capsys.readouterr().out
    assert "| decode 8 x 1, 2 steps, 4 adapters, Session.step |" in text and "load_adapter" in text
