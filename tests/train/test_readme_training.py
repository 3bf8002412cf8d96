"""The README's training snippet runs as written, on a tiny qwen4_exp model at ``path/to/model``."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ple.table.adapted import AdaptedTable

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_training_snippet_runs_as_written(tmp_path, monkeypatch):
    from ..integrations.helpers import tiny_config, tiny_model

    text = README.read_text()
    section = text[text.index("## Training the table") :]
    (code,) = re.findall(r"```python\n(.*?)```", section[: section.index("See `docs/ARCHITECTURE.md`")], flags=re.S)
    tiny_model(tiny_config(split_ngram_parts=4), seed=61).save_pretrained(tmp_path / "path" / "to" / "model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    served = scope["served"]
    trained = scope["model"]
    from ple.integrations.transformers import patched_layers

    for a, b in zip(patched_layers(trained), patched_layers(served), strict=True):
        assert isinstance(b.layer.table, AdaptedTable) and len(b.layer.table.overlay) == len(a.layer.table.overlay) > 0
