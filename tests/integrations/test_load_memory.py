"""Peak resident memory of load + generate in fresh processes: ple's loader against plain
transformers, on a model whose PLE tables dominate (two fp32 tables of ~6.4 M rows x 4, 205 MB)."""

from __future__ import annotations

import pytest

from ple.integrations.demo_model import build_model, measure, prompts


@pytest.mark.perf
def test_peak_memory_drops_by_the_tables(tmp_path):
    model = build_model(400_000, seed=5)
    tables = sum(p.nbytes for n, p in model.named_parameters() if n.endswith("ngram_embedding.weight"))
    assert tables > 200e6
    model.save_pretrained(tmp_path / "ckpt")  # fp32 tables, the checkpoint both loaders read
    del model
    ids = prompts(seed=5)
    plain = measure("plain", tmp_path / "ckpt", ids, 8, tmp_path / "plain.pt")
    ple = measure("ple", tmp_path / "ckpt", ids, 8, tmp_path / "ple.pt", table_dir=tmp_path / "tables", starts=2)
    assert ple["tables"] == [["converted", "converted"], ["reused", "reused"]]
    assert ple["tokens"] == plain["tokens"]
    saved = plain["peak_rss_bytes"] - ple["peak_rss_bytes"]
    print(
        f"\ntables {tables / 1e6:.0f} MB; peak resident: transformers {plain['peak_rss_bytes'] / 1e6:.0f} MB, "
        f"ple (first start converting, second reusing) {ple['peak_rss_bytes'] / 1e6:.0f} MB; saved {saved / 1e6:.0f} MB"
    )
    assert saved >= 0.9 * tables
