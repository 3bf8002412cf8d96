"""README's training section runs as written: its ``ple train`` command lines (each exits 0), its
snippet, and its multi-process command (``torchrun``), on a tiny qwen4_exp model at ``path/to/model``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ple.table.tiers.adapted import AdaptedTable

README = Path(__file__).resolve().parents[2] / "README.md"


def _section() -> str:
    text = README.read_text()
    section = text[text.index("## Training the table") :]
    return section[: section.index("See `docs/ARCHITECTURE.md`")]


def test_the_training_snippet_runs_as_written(tmp_path, monkeypatch):
    from tests.integrations.helpers import tiny_config, tiny_model

    (code,) = re.findall(r"```python\n(.*?)```", _section(), flags=re.S)
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
        assert isinstance(a.layer.table, AdaptedTable)  # saving merged the rows into the checkpoint, not the model
    assert list((tmp_path / "path" / "to" / "tuned").glob("*.safetensors"))


@pytest.mark.slow
def test_the_training_commands_run_as_written(tmp_path, monkeypatch, capsys):
    from ple.commands.cli import main
    from ple.table import verify_table_file

    block = re.findall(r"```bash\n(.*?)```", _section(), flags=re.S)[0]
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["ple", "train"], ["ple", "eval"], ["ple", "train"], ["ple", "train"]]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    before = torch.get_num_threads()
    try:
        for argv in commands:
            assert main(argv[1:]) == 0, (argv, capsys.readouterr())
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert out.count("checks     : all passed") == 2 and "(q4_0), tier direct" in out
    # ple eval of the first run's adapter, on the text it trained on: its perplexity below the reference's
    rows = {
        w[0]: w for w in map(str.split, out.splitlines()) if w[:1] in (["reference"], ["adapter"]) and w[1] == "fp8"
    }
    assert float(rows["adapter"][4]) < float(rows["reference"][4])
    work = tmp_path / "train-demo"
    assert {p.name for p in work.iterdir()} >= {"published", "tables", "adapter.safetensors", "loss.png"}
    assert verify_table_file(tmp_path / "merged.pletable") == []


@pytest.mark.slow
def test_the_multi_process_command_runs_as_written(tmp_path):
    from safetensors import safe_open

    from ple.train import read_adapter
    from tests.integrations.helpers import tiny_config, tiny_model

    blocks = re.findall(r"```bash\n(.*?)```", _section(), flags=re.S)
    (line,) = [x for x in blocks[1].splitlines() if x.strip()]
    argv = shlex.split(line, comments=True)
    assert argv[0] == "torchrun"
    tiny_model(tiny_config(split_ngram_parts=4), seed=62).save_pretrained(tmp_path / "path" / "to" / "model")
    root = README.parent
    runner = [sys.executable, "-m", "torch.distributed.run"]  # torchrun of this interpreter
    env = dict(os.environ, PYTHONPATH=str(root / "src"), PLE_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    args = [str(root / a) if a.startswith("examples/") else a for a in argv[1:]]
    res = subprocess.run([*runner, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} >= {"checkpoint-2", "checkpoint-4", "adapter.safetensors", "tuned"}
    with safe_open(out / "checkpoint-4" / "model.safetensors", "pt") as f:  # the trained rows, not the tables
        assert sum(k.endswith("trained_rows") for k in f.keys()) == 2 and not any(".shard_" in k for k in f.keys())
    adapter = read_adapter(out / "adapter.safetensors")
    assert all(e.trained_rows > 0 for e in adapter.layers.values())
    assert adapter.optimizer["steps"] == {str(i): 4 for i in adapter.layers}
