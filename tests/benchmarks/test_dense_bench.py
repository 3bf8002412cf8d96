"""``benchmarks/dense_bench.py`` at a small scale: its rows, its page-cache measure and one whole run."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ple.table import MmapTable
from ple.table.files.table_file import read_table_header

_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("dense_bench_under_test", _REPO / "benchmarks" / "dense_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _on_tmpfs(path: Path) -> bool:
    best, fs = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, kind = line.split()[:3]
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, fs = mount, kind
    return fs in ("tmpfs", "ramfs")


@pytest.mark.parametrize("fmt", ["q4_0", "iq4_nl"])
def test_generated_blocks_are_finite_and_each_row_can_be_made_alone(bench, fmt):
    gen = bench.RowGenerator(fmt, 160, seed=3)
    rows = gen.range(1000, 1300)
    assert rows.shape == (300, 90) and rows.dtype == np.uint8
    assert np.array_equal(gen.rows_of(np.array([1000, 1123, 1299])), rows[[0, 123, 299]])
    assert not np.array_equal(gen.range(0, 300), rows)  # the rows depend on where they are
    assert not np.array_equal(bench.RowGenerator(fmt, 160, seed=4).range(1000, 1300), rows)  # and on the seed
    d = rows.reshape(-1, 18)[:, :2].copy().view(np.float16).astype(np.float32)
    assert (d >= 2.0**-8).all() and (d < 2.0**-6).all()  # every block's scale finite and positive
    values = gguf_dequantize(rows, getattr(GGMLQuantizationType, fmt.upper()))
    assert values.shape == (300, 160) and np.isfinite(values).all() and (values != 0).mean() > 0.8
    codes = np.concatenate([rows.reshape(-1, 18)[:, 2:] & 15, rows.reshape(-1, 18)[:, 2:] >> 4])
    assert np.bincount(codes.reshape(-1), minlength=16).min() > 0.8 * codes.size / 16  # every code, about evenly


def test_generated_fp8_bytes_are_never_nan(bench):
    gen = bench.RowGenerator("fp8", 160, seed=1)
    rows = gen.range(0, 5000)
    assert not np.isin(rows, [0x7F, 0xFF]).any()
    assert torch.isfinite(torch.from_numpy(rows).view(torch.float8_e4m3fn).float()).all()
    assert np.unique(rows).size == 254  # every other byte


def test_cached_bytes_sees_the_page_cache_and_the_drop(bench, tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 << 20))
    with open(path, "rb") as f:
        f.read()
    assert bench.cached_bytes(path) == 3 << 20  # just read: every page cached
    if _on_tmpfs(path):
        pytest.skip("a tmpfs file cannot leave the page cache")
    dropped = bench.drop_file_cache(path)
    assert dropped["cached_before"] == 3 << 20 and dropped["cached_after"] == 0
    with open(path, "rb") as f:
        f.seek(1 << 20)
        f.read(4096)
    assert 4096 <= bench.cached_bytes(path) < 3 << 20  # a read brings back its pages (and read-ahead), not all


def test_a_small_run_writes_verifies_serves_then_reuses_and_removes_its_table(bench, tmp_path, capsys):
    out = tmp_path / "dense.json"
    argv = ["--dir", str(tmp_path), "--rows", "200000", "--requests", "8", "--decode-steps", "3"]
    argv += ["--prefill", "2", "64", "--prefill-batches", "2", "--warmup-tokens", "20000", "--fio-seconds", "1"]
    argv += ["--no-progress"]
    assert bench.main([*argv, "--budgets-gib", "0", "0.002", "--keep", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert 195_000 < rows < 205_000 and res["format"] == "q4_0" and res["isa"]
    assert res["write"]["file_bytes"] >= rows * 90 and res["write"]["allocated_bytes"] >= rows * 90  # no holes
    assert res["verify"]["exit_status"] == 0 and res["verify"]["report"]
    assert res["device"]["depth32"] > 0 and res["device"]["depth1"] > 0
    kinds = [(c["kind"], c["budget_gib"]) for c in res["configs"]]
    assert kinds == [("direct", 0.0), ("direct", 0.002), ("mmap", 0.0)]
    for c in res["configs"]:
        assert c["exact"] and c["exact_rows_checked"] > 1000  # lookups equal the generator's rows, bit for bit
        assert c["cold_start_s"] >= c["open_s"] + c["pin_s"] + c["first_output_s"] - 1e-6
        assert c["prefill_tokens_per_s"] > 0 and c["decode_tokens_per_s"] > 0 and c["peak_rss_mib"] > 0
        assert c["device"]["depth32"] >= c["device_before_after"][0]["depth32"]
        if not _on_tmpfs(tmp_path):
            assert c["dropped"]["cached_after"] == 0 and c["cached_at_start"] == 0  # cold
    direct0, budget, mmap = res["configs"]
    assert direct0["hit_rate"] == 0 and direct0["rows_from_disk"] > 0 and direct0["rows_per_read_s"] > 0
    assert direct0["reads_alone"]["back_to_back"] > 0 and direct0["reads_alone"]["after_gemm"] > 0
    assert direct0["prefill_rows_per_read_s"] > 0 and direct0["decode_rows_per_read_s"] > 0
    assert 0 < budget["hit_rate"] < 1 and budget["pinned_rows"] == budget["cache_slots"] // 2
    assert budget["filled_slots"] == budget["cache_slots"]  # the budget at its worst: every slot held
    assert mmap["pages_read"] > 0
    if not _on_tmpfs(tmp_path):
        assert direct0["cached_after"] == 0 and mmap["cached_after"] > 0  # the direct tier fills no page cache
    assert "| direct, budget 0 GiB |" in capsys.readouterr().out

    # --keep left the file: --reuse serves it again without writing it, and removes it after (no --keep)
    (path,) = tmp_path.glob("*.pletable")
    assert not list(tmp_path.glob("*.partial"))
    head = read_table_header(path)
    t = MmapTable.open(path)
    try:
        assert head["format"] == "q4_0" and t.rows == head["rows"] == rows
        gen = bench.RowGenerator("q4_0", 160, seed=20260101)
        assert torch.equal(t.data[rows - 5 :], torch.from_numpy(gen.range(rows - 5, rows)))
    finally:
        t.close()
    again = tmp_path / "again.json"
    assert bench.main([*argv, "--budgets-gib", "0", "--no-mmap", "--reuse", "--out", str(again)]) == 0
    res = json.loads(again.read_text())
    assert res["write"] is None and [c["exact"] for c in res["configs"]] == [True]
    assert not path.exists() and not list(tmp_path.glob("*.pletable*"))


def test_a_small_readers_run_times_each_reader_beside_fio(bench, tmp_path, capsys):
    out = tmp_path / "readers.json"
    argv = ["--dir", str(tmp_path), "--rows", "200000", "--readers", "--reader-rounds", "2", "--fio-seconds", "1"]
    argv += ["--reader-depths", "8", "--reader-rows", "300", "3000", "--no-progress", "--out", str(out)]
    assert bench.main(argv) == 0
    res = json.loads(out.read_text())["readers"]
    assert not list(tmp_path.glob("*.pletable*"))  # written, measured, removed
    kinds = {key.split("/")[0] for key in res["summary"]} | set(res["unavailable"])
    assert kinds == {"uring", "native", "threads"}
    for key, v in res["summary"].items():
        kind, depth, rows, order = key.split("/")
        assert depth == "8" and rows in ("300", "3000") and order in ("back_to_back", "after_gemm")
        assert v["rows_per_s"] > 0 and v["reads_per_s"] > 0 and v["of_device"] > 0 and v["cpu_us_per_read"] > 0
        lo, hi = v["of_device_range"]
        assert lo <= v["of_device"] <= hi and 0 <= v["rounds_at_085"] <= 2
    assert len(res["rounds"]) == 2 and all(r["device"]["depth8"] > 0 for r in res["rounds"])
    if not _on_tmpfs(tmp_path):
        assert all(r["cached_after_drop"] == 0 for r in res["rounds"]) and res["cached_after"] == 0
    assert "| reader | depth | rows a call |" in capsys.readouterr().out
