"""``ple train`` as a newcomer meets it: runs of a few steps finish and check what they can compare,
the report names each table's rows and says once that transformers runs its reference code, a
merged table file records the merge (``ple verify --checkpoint`` tells its trained rows from the
rest), an adapter is merged only into the table it was trained over, and ``--workdir`` is a new
or empty folder."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from ple.commands.cli import main
from ple.config import PLEConfig
from ple.data.tokens import vocabulary_map
from ple.table import read_table_header


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_vocabulary_map_of_a_slice_without_an_end_of_text_token():
    """A short slice of the real text ends before its first document: its map still sends the
    end-of-text id (past every id the slice holds) to the model's EOS."""
    tokens = np.array([9, 5, 7, 5, 9, 5], dtype=np.int64)
    m = vocabulary_map(tokens, vocab_size=5, eos_in=20, eos_out=1)
    assert m.shape == (21,) and m[20] == 1
    assert (m[5], m[9]) == (3, 4)  # the most frequent first; the vocabulary holds two ids from 3 on
    assert m[7] == 2 and m[0] == 2  # past the vocabulary, and absent: the unknown id


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--steps", "3", "--batch", "1", "--length", "8"]])
def test_a_run_of_a_few_steps_finishes_and_checks_the_held_out_loss(argv, capsys):
    rc = main(["train", *argv, "--json"])
    doc = json.loads(capsys.readouterr().out)
    # the training loss is one batch's a step: its first and last 5 steps are compared from 10 steps on
    assert doc["checks"] == {"held_out_loss_fell": True, "tables_untouched": True} and rc == 0
    assert doc["loss_first"] is None and len(doc["losses"]) == int(argv[1])
    assert doc["held_out"][0][0] == 0 and doc["held_out"][-1][0] == int(argv[1])


def test_the_report_the_merge_and_its_verification(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()  # transformers warns once a process: as in a fresh one
    work = tmp_path / "w"
    capfd.readouterr()
    assert main(["train", "--steps", "2", "--workdir", str(work)]) == 0
    out, err = capfd.readouterr()
    cfg = PLEConfig.from_pretrained(work / "published")
    rows = [cfg.layout(i).padded_rows for i in range(2)]
    assert rows[0] != rows[1]
    assert f"2 PLE tables of {rows[0]:,} and {rows[1]:,} rows x 32 (fp8), tier mmap" in out
    line = next(s for s in out.splitlines() if s.startswith("rows "))
    assert line.endswith("distinct rows trained (one number a table), of 1,024 row reads a table")
    assert "falling back to its reference PyTorch implementation" not in err
    assert err.count("PyTorch reference code") == 1
    assert "checks     : all passed (2 checks)" in out

    # a reused --workdir is refused before anything runs, naming what it holds
    assert main(["train", "--steps", "2", "--workdir", str(work)]) == 1
    err = capfd.readouterr().err
    assert f"--workdir {work} is not empty (it holds adapter.safetensors, loss.png, published, tables)" in err

    table, adapter, out_file = (
        work / "tables" / "model.layers.1.ple.pletable",
        work / "adapter.safetensors",
        tmp_path / "m.pletable",
    )
    assert main(["train", "--merge", str(table), str(adapter), str(out_file)]) == 0
    said = capfd.readouterr().out
    merged = read_table_header(out_file)["merged"]
    n = merged["trained_rows"]
    assert merged["ple_layer_index"] == 1 and merged["adapter"] == str(adapter.resolve())
    assert merged["into"]["header_checksum"] == read_table_header(table)["header_checksum"]
    assert merged["trained_over"]["file"] == str(table.resolve())
    assert said.startswith(f"merged {adapter}'s PLE layer 1 ({n:,} trained rows) into {out_file}")
    assert main(["train", "--merge", str(table), str(adapter), str(out_file)]) == 1
    assert capfd.readouterr().err == f"ple train: {out_file} exists: pass --force to replace it\n"

    # verify: the file says it is a merge; with its checkpoint, the trained rows are compared with the adapter,
    # the rest with the checkpoint
    assert main(["verify", str(out_file)]) == 0
    assert f"OK (a merge of {adapter.resolve()} (PLE layer 1, {n} rows trained;" in capfd.readouterr().out
    assert main(["verify", str(out_file), "--checkpoint", str(work / "published")]) == 0
    said = capfd.readouterr().out
    assert f"{n:,} rows trained, equal to the adapter's; the rest equal to the checkpoint's" in said
    shutil.move(adapter, tmp_path / "elsewhere.safetensors")  # the header's merge record tells the trained rows
    assert main(["verify", str(out_file), "--checkpoint", str(work / "published")]) == 0
    assert f"{n:,} rows trained, equal to their recorded digests" in capfd.readouterr().out


def test_an_adapter_is_merged_only_into_the_table_it_was_trained_over(tmp_path, capsys):
    """Two checkpoints of one layout (the demo model with two seeds): the first's adapter is refused by
    the second's table, naming both."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", "--steps", "1", "--workdir", str(a), "--json"]) == 0
    assert main(["train", "--steps", "1", "--seed", "1", "--workdir", str(b), "--json"]) == 0
    capsys.readouterr()
    other = b / "tables" / "model.layers.0.ple.pletable"
    assert read_table_header(other)["layout_hash"] == read_table_header(a / "tables" / other.name)["layout_hash"]
    assert main(["train", "--merge", str(other), str(a / "adapter.safetensors"), str(tmp_path / "m.pletable")]) == 1
    err = capsys.readouterr().err
    assert "PLE layer 0 was trained over the table file" in err and str(a / "tables" / other.name) in err
    assert f"not {other}" in err and "merge it into the table it was trained over" in err
    assert not (tmp_path / "m.pletable").exists()


def test_the_trained_rows_of_a_merged_file_are_checked_against_the_adapter(tmp_path):
    """``check_merged_rows`` compares each trained row with the adapter's, requantized as the merge does:
    none differ for the adapter merged; every one for an adapter of the same rows trained further."""
    from ple.table import MmapTable
    from ple.train import SparseAdam, merge_table_file, save_adapter, trainable
    from ple.train.merge import check_merged_rows, merged_rows
    from tests.train._helpers import batch, new_layer, write_table_file

    table = write_table_file(tmp_path / "t.pletable", "int8_row", seed=2)
    layer = new_layer(seed=1, table=MmapTable.open(table))
    opt = SparseAdam(trainable(layer), lr=0.1)
    hidden, ids, _ = batch(seed=1)
    layer.forward_padded(hidden, ids).sum().backward()
    opt.step()
    adapter = save_adapter(tmp_path / "a.safetensors", layer)
    out = merge_table_file(table, adapter, tmp_path / "m.pletable")
    record, entry, file, why = merged_rows(out)
    assert why == "" and entry is not None and file is not None and record["trained_rows"] == entry.trained_rows > 0
    assert check_merged_rows(out, file, 0) == []
    opt.zero_grad()
    layer.forward_padded(hidden, ids).sum().backward()  # the same rows, trained one step further
    opt.step()
    save_adapter(adapter, layer)
    record, entry, file, why = merged_rows(out)
    assert why == "" and file is not None  # the same ids: the file it names passes for the one merged
    (problem,) = check_merged_rows(out, file, 0)
    assert f"{record['trained_rows']} trained rows differ from the adapter's" in problem
