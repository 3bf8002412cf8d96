"""``ple demo --quick --only model --tier direct|cached``: every check passes, and the report gives the
tables' bytes on disk and in memory as the files and the tiers themselves give them."""

from __future__ import annotations

import json
import os

import pytest

from ple.commands.cli import main
from ple.integrations.demo_model import MODEL_DIRECT_BUDGET, model_config
from ple.table import DirectTable


def _run(tmp_path, capsys, *extra):
    """One model-part run: ``(its JSON results, its text report, the workdir)``."""
    work, out = tmp_path / "w", tmp_path / "demo.json"
    rc = main(
        ["demo", "--quick", "--only", "model", "--no-progress", "--output", str(out), "--workdir", str(work), *extra]
    )
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["ok"], (doc["checks"], text)
    return doc["model"], text, work


@pytest.mark.slow
def test_the_direct_tier_reports_its_bytes_and_passes(tmp_path, capsys):
    model, text, work = _run(tmp_path, capsys, "--tier", "direct")
    files = sorted((work / "model" / "tables").glob("*.pletable"))
    assert len(files) == 2
    ple = model["ple"]
    assert ple["tier"] == "direct" and ple["table_file_bytes"] == sum(os.stat(f).st_size for f in files) > 0
    assert ple["table_mapped_bytes"] == 0  # nothing mapped: what is resident is the tier's own memory
    tables = [DirectTable.open(f, memory_budget=MODEL_DIRECT_BUDGET) for f in files]
    try:
        held = sum(t.nbytes for t in tables)
        assert all(t.cache_slots < t.rows for t in tables)  # a cache smaller than the table
    finally:
        for t in tables:
            t.close()
    assert ple["table_resident_bytes"] == ple["table_tier_bytes"] == held
    assert model["table_bytes_kept_in_memory"] == held
    assert model["memory_saved_share_of_tables"] >= 0.9
    on_disk = f"{ple['table_file_bytes'] / 1e6:,.0f} MB on disk"
    assert on_disk in text and "0.0 KB" not in text
    assert f"at most {held / 1e6:,.0f} MB in memory (the row cache and read buffers; nothing mapped)" in text
    assert "checks : all passed" in text
    # the kept checkpoints: their paths end the report
    assert f"{work / 'model' / 'published'} (a qwen4_exp checkpoint" in text


@pytest.mark.slow
def test_the_cached_tier_counts_its_rows(tmp_path, capsys):
    model, text, work = _run(tmp_path, capsys, "--tier", "cached")
    ple = model["ple"]
    files = sorted((work / "model" / "tables").glob("*.pletable"))
    assert ple["table_file_bytes"] == sum(os.stat(f).st_size for f in files) > 0
    assert ple["table_resident_bytes"] >= ple["table_tier_bytes"] >= 0


def test_the_demo_model_fits_every_block_format():
    """The demo's checkpoint has rows of 32 values: ``ple convert --to q4_0|iq4_nl`` takes it."""
    from ple.config import PLEConfig
    from ple.table import FORMATS, format_info

    cfg = PLEConfig.from_dict({"model_type": "qwen4_exp_text", **model_config(30_000)})
    for i in range(cfg.num_ple_layers):
        for fmt in FORMATS:
            format_info(fmt).check_head_dim(cfg.layout(i).head_dim)


def test_without_the_real_text_packages_the_demo_says_what_to_install(tmp_path, monkeypatch, capsys):
    """A user of ``pip install ple[hf]`` (no tiktoken/dashscope): one line naming ``ple[demo]`` and
    ``--synthetic-tokens``, before anything runs; ``--synthetic-tokens`` needs neither."""
    import importlib.util

    from ple.data import realtext

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "dashscope" else real(name, *a))
    realtext.tokenizer.cache_clear()
    try:
        assert main(["demo", "--quick", "--workdir", str(tmp_path / "w")]) == 1
        err = capsys.readouterr().err
        assert "pip install 'ple[demo]'" in err and "--synthetic-tokens" in err and len(err.splitlines()) == 1
        assert not (tmp_path / "w").exists()  # refused before anything was made
        argv = ["demo", "--only", "serving", "--synthetic-tokens", "--requests", "2", "--slots", "2"]
        argv += ["--config", str(_small_config(tmp_path)), "--no-progress"]
        assert main(argv) == 0
    finally:
        realtext.tokenizer.cache_clear()


def _small_config(tmp_path):
    from ple.config import PLEConfig
    from tests.conftest import SMALL

    path = tmp_path / "config.json"
    cfg = PLEConfig(**SMALL)
    text = {**cfg.to_dict(), "model_type": "qwen4_exp_text"}
    path.write_text(json.dumps({"model_type": "qwen4_exp", "text_config": text}))
    return path
