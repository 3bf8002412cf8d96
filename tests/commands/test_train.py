"""``ple train``: the demo model's tables fine-tuned from disk end to end (loss falls, tables
untouched, an adapter and a loss plot written), on 2 ranks bit-identical to one process; ``--merge``
writes an adapter into a table file; the exit statuses of the ``ple`` command."""

from __future__ import annotations

import json

import pytest
import torch

from ple.commands.cli import main
from ple.table import MmapTable, verify_table_file
from ple.train import SparseAdam, read_adapter, save_adapter, trainable
from tests.train._helpers import batch, new_layer, write_table_file


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_ple_train_fine_tunes_from_disk_on_one_and_two_ranks(tmp_path, capsys):
    plot = tmp_path / "loss.png"
    rc = main(
        ["train", "--steps", "10", "--ranks", "2", "--workdir", str(tmp_path / "w"), "--plot", str(plot), "--json"]
    )
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["ok"], doc["checks"]
    assert doc["checks"] == {
        "loss_fell": True,
        "held_out_loss_fell": True,
        "tables_untouched": True,
        "ranks_bit_identical": True,
    }
    assert len(doc["losses"]) == 10 and doc["ranks"]["losses"] == doc["losses"]  # the same run, sharded
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    adapter = read_adapter(doc["adapter"])
    assert [e.trained_rows for e in adapter.layers.values()] == doc["trained_rows"]
    assert adapter.optimizer["class"] == "SparseAdam"


def test_ple_train_merge_writes_an_adapter_into_a_table_file(tmp_path, capsys):
    table = write_table_file(tmp_path / "t.pletable", "fp8_row", seed=2)
    layer = new_layer(seed=1, table=MmapTable.open(table))
    opt = SparseAdam(trainable(layer), lr=0.1)
    hidden, ids, _ = batch(seed=1)
    layer.forward_padded(hidden, ids).sum().backward()
    opt.step()
    adapter = save_adapter(tmp_path / "a.safetensors", layer)
    out = tmp_path / "merged.pletable"
    assert main(["train", "--merge", str(table), str(adapter), str(out)]) == 0
    assert verify_table_file(out) == [] and "merged" in capsys.readouterr().out
    assert main(["train", "--merge", str(table), str(adapter), str(out)]) == 1  # exists: --force replaces it
    assert "exists" in capsys.readouterr().err
    assert main(["train", "--merge", str(table), str(adapter), str(out), "--force"]) == 0
    assert main(["train", "--merge", str(table), str(tmp_path / "none.safetensors"), str(out), "--force"]) == 1
    with pytest.raises(SystemExit) as e:
        main(["train", "--lr", "-1"])
    assert e.value.code == 2 and "expected a finite number > 0" in capsys.readouterr().err
