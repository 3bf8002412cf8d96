"""The README's library snippets run as written, on a tiny qwen4_exp model at ``path/to/model``."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def library_snippets() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Library") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_library_snippets_run_as_written(tmp_path, monkeypatch):
    from .integrations.helpers import tiny_config, tiny_model

    snippets = library_snippets()
    assert len(snippets) == 2
    tiny_model(tiny_config(split_ngram_parts=4), seed=51).save_pretrained(tmp_path / "path" / "to" / "model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    scopes = []
    for code in snippets:
        scope: dict = {}
        exec(compile(code, str(README), "exec"), scope)
        scopes.append(scope)
    hf, engine = scopes
    assert hf["out"].shape == (1, 12)
    assert (tmp_path / "path" / "to" / "copy" / "model.safetensors").is_file()
    assert list((tmp_path / "cache" / "tables").glob("model-*/*.pletable"))
    out = engine["out"]["a"]
    assert out.shape == (4, engine["cfg"].hc_hidden_size) and torch.isfinite(out).all()
