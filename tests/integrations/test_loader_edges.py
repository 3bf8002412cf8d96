"""Checkpoint folders at the edges of what ``from_pretrained`` takes: links that lead nowhere, a shard
edited in place with its modification time set back, two checkpoints in one folder; and the
arguments of ``patch``, a ``config.json`` naming its architecture as a string."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ple.checkpoint import CheckpointError, checkpoint_files, load_ple_weights, read_header
from ple.commands.cli import main
from ple.config import ConfigError, PLEConfig, architecture_names
from ple.errors import ArgumentTypeError
from ple.integrations.transformers import from_pretrained, patch, patched_layers, unpatch
from ple.table import read_table_header
from tests.integrations.helpers import tiny_config, tiny_model

TABLE = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    tiny_model(tiny_config(split_ngram_parts=4), seed=31).save_pretrained(path)
    return path


def _table_rows(model, idx: int) -> torch.Tensor:
    table = patched_layers(model)[idx].layer.table
    return table.data[: table.rows].float()


@pytest.mark.parametrize("target", ["loop.safetensors", "nowhere.safetensors"])
def test_a_link_that_leads_nowhere_is_a_checkpoint_error(checkpoint, tmp_path, capsys, target):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    os.symlink(target, copy / "loop.safetensors")  # a loop, or a link to nothing
    for tier in ("mmap", "memory"):
        with pytest.raises(CheckpointError, match="loop.safetensors cannot be opened"):
            from_pretrained(copy, table_tier=tier, **({"table_dir": tmp_path / "t"} if tier == "mmap" else {}))
    with pytest.raises(CheckpointError, match="loop.safetensors cannot be opened"):
        checkpoint_files(copy)
    assert main(["inspect", str(copy)]) == 1
    assert "loop.safetensors cannot be opened" in capsys.readouterr().err


def test_a_shard_edited_in_place_with_its_time_set_back_is_not_served_stale(checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    tables = tmp_path / "tables"
    first = from_pretrained(copy, table_dir=tables)
    assert [w.prepared.action for w in patched_layers(first)] == ["converted", "converted"]
    (f,) = checkpoint_files(copy)
    info = read_header(f).tensors[TABLE]
    st = os.stat(f)
    with open(f, "r+b") as fh:  # one shard's rows replaced by other finite values, in place
        fh.seek(info.begin)
        fh.write(torch.full((info.nbytes // 4,), 0.25).numpy().tobytes())
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # the modification time put back
    assert os.stat(f).st_mtime_ns == st.st_mtime_ns and os.stat(f).st_size == st.st_size
    with pytest.warns(UserWarning, match="layers.0.ple.pletable is not used: its rows differ from the checkpoint's"):
        second = from_pretrained(copy, table_dir=tables)
    assert [w.prepared.action for w in patched_layers(second)] == ["converted", "verified"]
    want = load_ple_weights(copy, PLEConfig.from_pretrained(copy))[0].table
    assert torch.equal(_table_rows(second, 0), want.data[: want.rows].float())
    assert bool((_table_rows(second, 0) == 0.25).any())
    third = from_pretrained(copy, table_dir=tables)  # recorded again: reused
    assert [w.prepared.action for w in patched_layers(third)] == ["reused", "reused"]


def test_a_table_file_edited_in_place_with_its_time_set_back_is_not_served(checkpoint, tmp_path):
    """The README: a table file written to since it was checked is compared with the checkpoint again,
    even when its modification time was set back (its change time moved: no program sets that one)."""
    tables = tmp_path / "tables"
    first = from_pretrained(checkpoint, table_dir=tables)
    path = patched_layers(first)[0].prepared.path
    want = _table_rows(first, 0).clone()
    del first
    header = read_table_header(path)
    st = os.stat(path)
    at = header["data_offset"] + 3 * header["row_nbytes"] + 1  # a byte of row 3
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the modification time put back
    now = os.stat(path)
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    with pytest.warns(UserWarning, match="layers.0.ple.pletable is not used: its rows differ from the checkpoint's"):
        second = from_pretrained(checkpoint, table_dir=tables)
    assert [w.prepared.action for w in patched_layers(second)] == ["converted", "reused"]
    assert torch.equal(_table_rows(second, 0), want)


def test_a_single_file_beside_an_index_and_its_shards_is_refused(checkpoint, tmp_path, capsys):
    """transformers loads ``model.safetensors`` when both are there; ple would read the tables the
    index names: two models mixed. The folder is refused, naming both."""
    mixed = tmp_path / "mixed"
    tiny_model(tiny_config(split_ngram_parts=4), seed=32).save_pretrained(mixed, max_shard_size="40KB")
    assert (mixed / "model.safetensors.index.json").exists() and not (mixed / "model.safetensors").exists()
    shutil.copy(checkpoint / "model.safetensors", mixed / "model.safetensors")
    for call in (lambda: checkpoint_files(mixed), lambda: from_pretrained(mixed, table_dir=tmp_path / "t")):
        with pytest.raises(CheckpointError, match="holds both model.safetensors and model.safetensors.index.json"):
            call()
    assert main(["inspect", str(mixed)]) == 1
    assert "transformers loads model.safetensors and ignores the index" in capsys.readouterr().err
    assert not (tmp_path / "t").exists() or not list((tmp_path / "t").iterdir())  # refused before any work
    os.remove(mixed / "model.safetensors")
    assert len(checkpoint_files(mixed)) > 1  # the index alone is fine


@pytest.mark.parametrize("value", ["a string", b"bytes", 3, None, "model/folder"])
def test_patch_and_unpatch_name_what_they_take(value):
    for fn in (patch, unpatch):
        with pytest.raises(ArgumentTypeError, match="takes a loaded model \\(a torch.nn.Module\\), got"):
            fn(value)


def test_architectures_as_a_string_is_one_name(checkpoint, tmp_path):
    assert architecture_names({"architectures": "Qwen4ExpForCausalLM"}) == ["Qwen4ExpForCausalLM"]
    assert architecture_names({"architectures": ["A", "B"]}) == ["A", "B"]
    assert architecture_names({}) == [] and architecture_names({"architectures": None}) == []
    for bad in (3, [""], ["A", 1], {"a": 1}):
        with pytest.raises(ConfigError, match="architectures="):
            architecture_names({"architectures": bad})
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    doc = json.loads((copy / "config.json").read_text())
    doc["architectures"] = doc["architectures"][0]
    (copy / "config.json").write_text(json.dumps(doc))
    model = from_pretrained(copy, table_dir=tmp_path / "t")
    assert type(model).__name__ == "Qwen4ExpForCausalLM"
    doc["architectures"] = "Qwen4ExpForSomethingElse"
    (copy / "config.json").write_text(json.dumps(doc))
    with pytest.raises(Exception, match="names architecture 'Qwen4ExpForSomethingElse'"):
        from_pretrained(copy, table_dir=tmp_path / "t")
