"""The README's library snippets run as written, on a tiny qwen4_exp model at ``path/to/model``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def library_snippets() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Library") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_library_snippets_run_as_written(tmp_path, monkeypatch):
    from tests.integrations.helpers import tiny_config, tiny_model

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


def four_bit_route() -> tuple[list[str], str]:
    """The README's route to a 4-bit table: its command lines and the Python that follows them."""
    text = README.read_text()
    section = text[text.index("A 4-bit table") :]
    commands = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    code = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert commands is not None and code is not None
    return [line for line in commands.group(1).splitlines() if line.strip()], code.group(1)


@pytest.mark.slow
def test_the_route_to_a_four_bit_table_runs_as_written(tmp_path, monkeypatch, capsys):
    """``ple demo --only model --workdir``, ``ple convert --to q4_0``, ``ple verify --checkpoint``
    and ``from_pretrained(table_format="q4_0", table_dir=...)`` in turn, as the README writes them:
    every command exits 0, and the model serves the q4_0 files ple convert wrote, unchanged."""
    import shlex

    from ple.commands.cli import main
    from ple.integrations.transformers import patched_layers

    commands, code = four_bit_route()
    assert [c.split()[:2] for c in commands] == [["ple", "demo"], ["ple", "convert"], ["ple", "verify"]]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    for line in commands:
        argv = shlex.split(line)
        assert main(argv[1:]) == 0, (line, capsys.readouterr())
    out = capsys.readouterr().out
    assert "demo/model/published (a qwen4_exp checkpoint" in out  # the demo says where it went
    files = sorted((tmp_path / "demo" / "q4").glob("*.pletable"))
    before = {f: f.stat().st_mtime_ns for f in files}
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    layers = patched_layers(scope["model"])
    assert {w.layer.table.format for w in layers} == {"q4_0"}
    assert sorted(w.table_path.resolve() for w in layers) == [f.resolve() for f in files]
    assert [w.prepared.action for w in layers] == ["reused", "reused"]
    assert {f: f.stat().st_mtime_ns for f in files} == before and not (tmp_path / "cache" / "tables").exists()
    ids = torch.tensor([[5, 17, 30, 9]])
    assert scope["model"].generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)
