"""``ple demo --table-format``: the serving workload from a block-format copy of the table, every
output checked against the one-shot reference of the same table."""

from __future__ import annotations

import json

import pytest

from ple.commands.cli import main
from ple.config import PLEConfig
from ple.table import format_info
from tests.conftest import SMALL


@pytest.fixture(scope="module")
def wide_config(tmp_path_factory):
    """SMALL with rows of 32 values (every block format fits)."""
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    cfg = PLEConfig(**{**SMALL, "ple_embed_dim": 128})
    path.write_text(
        json.dumps({"model_type": "qwen4_exp", "text_config": {**cfg.to_dict(), "model_type": "qwen4_exp_text"}})
    )
    return path


@pytest.mark.parametrize("fmt", ["q4_0", "nvfp4"])
def test_serving_from_a_block_table(wide_config, tmp_path, capsys, fmt):
    argv = ["demo", "--config", str(wide_config), "--table-format", fmt, "--requests", "4", "--slots", "2"]
    rc = main([*argv, "--json", "--no-progress", "--workdir", str(tmp_path / "w")])
    doc = json.loads(capsys.readouterr().out)
    res = doc["serving"]
    assert rc == 0 and doc["ok"], doc["checks"]
    assert res["table"].startswith(f"{fmt} [") and res["table_file"]["path"].endswith(f".{fmt}.pletable")
    rows = PLEConfig(**{**SMALL, "ple_embed_dim": 128}).layout(0).padded_rows
    assert res["checked_tokens"] > 0 and res["table_bytes"] == rows * format_info(fmt).row_nbytes(32)


def test_table_format_needs_a_table_file(wide_config, capsys):
    assert (
        main(["demo", "--config", str(wide_config), "--table-format", "q4_0", "--tier", "memory"]) == 2
    )  # options that do not fit together
    assert "--table-format serves" in capsys.readouterr().err
