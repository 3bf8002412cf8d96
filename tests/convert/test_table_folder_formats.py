"""A table folder serves a table file only in the format asked for (the checkpoint's own when none
is), read from the file's header; a file of another format under the name is refused, naming both,
and left as it is. ``ple convert --to FORMAT`` output is found and served by
``from_pretrained(table_format=FORMAT, table_dir=...)``, and a failed start leaves nothing it made."""

from __future__ import annotations

import collections
import os
import shutil
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from ple.commands.cli import main
from ple.convert.folder import RECORD_SUFFIX, source_identity
from ple.errors import InvalidArgumentError
from ple.integrations.transformers import from_pretrained, patched_layers
from tests.integrations.helpers import prompts, tiny_config, tiny_model

# rows of 32 values (one block of every block format); tables in 3 shards
PREFIX = "model.layers.0.ple"
PLAIN = f"{PREFIX}.pletable"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    model = tiny_model(tiny_config(split_ngram_parts=3, ple_embed_dim=128), seed=41)
    path = tmp_path_factory.mktemp("ckpt") / "wide"
    model.save_pretrained(path)
    return path


def _logits(model):
    ids, mask = prompts(seed=41)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _state(folder):
    """Every file of ``folder``: name -> (inode, size, modification time)."""
    return {p.name: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_a_convert_output_of_another_format_is_refused_without_table_format(wide, tmp_path):
    """``ple convert --to q4_0`` output, then a start asking for no format: the q4_0 rows are not
    the checkpoint's (fp32); refused, naming both formats and the way to serve it, file untouched."""
    out = tmp_path / "out"
    assert main(["convert", str(wide), str(out), "--to", "q4_0"]) == 0
    before = _state(out)
    with pytest.raises(InvalidArgumentError, match=r"holds q4_0 rows, but the checkpoint's table is fp32") as e:
        from_pretrained(wide, table_dir=out)
    assert "pass table_format='q4_0' to serve it" in str(e.value) and PLAIN in str(e.value)
    assert _state(out) == before  # neither replaced nor given a lock file


@pytest.mark.parametrize("fmt", ["q4_0", "iq4_nl"])
def test_a_convert_output_is_served_for_its_format(wide, tmp_path, fmt):
    """``ple convert --to FMT`` wrote the table under the checkpoint-format name with its record:
    ``table_format=FMT`` serves that file (no second copy, nothing quantized again), with the rows
    a copy made by the folder itself holds."""
    out = tmp_path / "out"
    assert main(["convert", str(wide), str(out), "--to", fmt]) == 0
    assert sorted(p.name for p in out.glob("*" + RECORD_SUFFIX)) == [
        f"{PREFIX}.pletable{RECORD_SUFFIX}",
        f"model.layers.1.ple.pletable{RECORD_SUFFIX}",
    ]
    model = from_pretrained(wide, table_dir=out, table_format=fmt)
    layers = patched_layers(model)
    assert [w.prepared.action for w in layers] == ["reused", "reused"]
    assert [w.table_path.name for w in layers] == [PLAIN, "model.layers.1.ple.pletable"]
    assert {w.layer.table.format for w in layers} == {fmt}
    assert not list(out.glob(f"*.{fmt}.pletable"))
    own = from_pretrained(wide, table_dir=tmp_path / "own", table_format=fmt)
    assert [w.prepared.action for w in patched_layers(own)] == ["converted", "converted"]
    for a, b in zip(layers, patched_layers(own)):
        assert np.array_equal(a.layer.table.data.numpy(), b.layer.table.data.numpy())
    torch.testing.assert_close(_logits(model), _logits(own), rtol=0, atol=0)


def test_a_convert_output_without_its_record_is_compared_then_served(wide, tmp_path):
    """A copy of the output without the record (moved by hand): compared with the checkpoint once,
    recorded, then reused."""
    out = tmp_path / "out"
    assert main(["convert", str(wide), str(out), "--to", "q4_0", "--layers", "0"]) == 0
    (out / (PLAIN + RECORD_SUFFIX)).unlink(missing_ok=True)
    first = from_pretrained(wide, table_dir=out, table_format="q4_0")
    assert [w.prepared.action for w in patched_layers(first)] == ["verified", "converted"]
    assert [w.table_path.name for w in patched_layers(first)] == [PLAIN, "model.layers.1.ple.q4_0.pletable"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = from_pretrained(wide, table_dir=out, table_format="q4_0")
    assert [w.prepared.action for w in patched_layers(again)] == ["reused", "reused"]


def test_a_convert_output_of_other_rows_is_not_served(wide, tmp_path):
    """Another checkpoint's q4_0 output, without its record: its rows differ, so the copy is made
    under the folder's own name, with a warning; the other file stays."""
    other = tmp_path / "other"
    tiny_model(tiny_config(split_ngram_parts=3, ple_embed_dim=128), seed=42).save_pretrained(other)
    out = tmp_path / "out"
    assert main(["convert", str(other), str(out), "--to", "q4_0", "--layers", "0"]) == 0
    (out / (PLAIN + RECORD_SUFFIX)).unlink(missing_ok=True)
    before = _state(out)[PLAIN]
    with pytest.warns(UserWarning, match=rf"{PLAIN} \(q4_0\) is not used: its rows differ .* converting {PREFIX}.q4_0"):
        model = from_pretrained(wide, table_dir=out, table_format="q4_0")
    assert [w.prepared.action for w in patched_layers(model)] == ["converted", "converted"]
    assert patched_layers(model)[0].table_path.name == f"{PREFIX}.q4_0.pletable"
    assert _state(out)[PLAIN] == before and not (out / (PLAIN + ".lock")).exists()  # looked at, left as it was


@pytest.mark.parametrize("how", ["copy", "hard link with its record"])
def test_a_file_of_another_block_format_under_the_name_is_refused(wide, tmp_path, how):
    """A q4_1 file under the q4_0 name (a copy; a hard link, whose record vouches for the same
    inode): refused naming both formats, never served as q4_0."""
    tables = tmp_path / "t"
    from_pretrained(wide, table_dir=tables, table_format="q4_1")
    src, dst = tables / f"{PREFIX}.q4_1.pletable", tables / f"{PREFIX}.q4_0.pletable"
    if how == "copy":
        shutil.copy(src, dst)
    else:
        os.link(src, dst)
        shutil.copy(tables / (src.name + RECORD_SUFFIX), tables / (dst.name + RECORD_SUFFIX))
    before = _state(tables)
    with pytest.raises(InvalidArgumentError, match=r"holds q4_1 rows, but table_format='q4_0' asks for q4_0") as e:
        from_pretrained(wide, table_dir=tables, table_format="q4_0")
    assert dst.name in str(e.value) and "pass table_format='q4_1' to serve it" in str(e.value)
    assert _state(tables) == before


def test_a_checkpoint_saved_again_in_another_dtype_is_converted_again(wide, tmp_path):
    """The folder's own copy of a checkpoint (fp32) whose folder now holds bf16 tables: stale, so
    converted again with a warning naming both formats (not refused)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(wide, ckpt)
    from_pretrained(ckpt, table_dir=tmp_path / "t")
    shutil.rmtree(ckpt)
    tiny_model(tiny_config(split_ngram_parts=3, ple_embed_dim=128), seed=41).to(torch.bfloat16).save_pretrained(ckpt)
    with pytest.warns(UserWarning, match="holds a copy of the checkpoint's table in fp32, which is bf16 now"):
        model = from_pretrained(ckpt, table_dir=tmp_path / "t")
    assert {w.layer.table.format for w in patched_layers(model)} == {"bf16"}


def test_a_table_file_of_other_rows_with_a_record_is_not_served(wide, tmp_path):
    """Header facts beside the format: a file of the layer's layout hash but other rows is not used
    even when a record vouches for it; the warning names both geometries."""
    from ple.checkpoint import scan_checkpoint
    from ple.config import PLEConfig
    from ple.convert.folder import record_table
    from ple.table.files.table_file import TableFileWriter

    config = PLEConfig.from_pretrained(wide)
    entry = scan_checkpoint(wide, config).layers[0]
    lay = config.layout(0)
    tables = tmp_path / "t"
    tables.mkdir()
    rows = lay.padded_rows + 16
    path = tables / PLAIN
    with TableFileWriter(path, rows, lay.head_dim, "fp32", rows, config.layout_fields(0)) as w:
        w.write_shard(0, torch.zeros(rows, lay.head_dim))
    record_table(path, entry, source_identity(entry))
    msg = rf"holds {rows:,} rows of {lay.head_dim} values, PLE layer 0's layout {lay.padded_rows:,} of {lay.head_dim}"
    with pytest.warns(UserWarning, match=msg):
        model = from_pretrained(wide, table_dir=tables)
    assert patched_layers(model)[0].prepared.action == "converted"
    assert patched_layers(model)[0].layer.table.rows == lay.padded_rows


def test_a_format_the_rows_cannot_hold_leaves_nothing(tmp_path):
    """Rows of 8 values and table_format='q4_0' (blocks of 32): refused before any file or folder is
    made, naming the layer, its row width and the block."""
    ckpt = tmp_path / "ckpt"
    tiny_model(tiny_config(), seed=43).save_pretrained(ckpt)
    with pytest.raises(InvalidArgumentError, match=r"q4_0 stores rows as blocks of 32 values, and PLE layer 0's rows"):
        from_pretrained(ckpt, table_dir=tmp_path / "new" / "tables", table_format="q4_0")
    assert not (tmp_path / "new").exists()
    tables = tmp_path / "tables"
    tables.mkdir()
    with pytest.raises(InvalidArgumentError, match="blocks of 32"):
        from_pretrained(ckpt, table_dir=tables, table_format="q4_0")
    assert list(tables.iterdir()) == []


def test_a_failed_conversion_leaves_no_lock_file(wide, tmp_path, monkeypatch):
    """A start that fails once it holds the lock (here: no disk space) removes the lock file and the
    folder it made; a lock file that was there before stays."""
    import ple.convert.folder as tf

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(tf.shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 0))
    with pytest.raises(InvalidArgumentError, match="free, PLE layer 0's table needs"):
        from_pretrained(wide, table_dir=tmp_path / "made" / "t", table_format="q4_0")
    assert not (tmp_path / "made").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / f"{PREFIX}.q4_0.pletable.lock").touch()
    with pytest.raises(InvalidArgumentError, match="free"):
        from_pretrained(wide, table_dir=kept, table_format="q4_0")
    assert [p.name for p in kept.iterdir()] == [f"{PREFIX}.q4_0.pletable.lock"]


def test_a_lock_file_removed_by_its_maker_is_not_shared(tmp_path):
    """A start waiting on a lock file that its maker removes (it failed) takes a new one: two starts
    never hold the lock at once."""
    from ple.convert.folder import _lock

    path = tmp_path / "t.pletable"
    events: list[str] = []
    held, second_holds = threading.Event(), threading.Event()

    def second():
        held.wait()
        with _lock(path):
            events.append("second holds")
            second_holds.set()
            assert (tmp_path / "t.pletable.lock").exists()
            time.sleep(0.2)
            events.append("second done")

    t = threading.Thread(target=second)
    t.start()
    with pytest.raises(RuntimeError):
        with _lock(path):
            held.set()
            time.sleep(0.3)  # the second start is waiting on this lock file now
            events.append("first fails")
            raise RuntimeError("conversion failed")
    assert second_holds.wait(10)
    with _lock(path):  # a third start: after the second, never beside it
        events.append("third holds")
    t.join(10)
    assert events == ["first fails", "second holds", "second done", "third holds"]


def test_an_interrupted_copy_continues_only_with_the_shards_that_check_out(wide, tmp_path, monkeypatch):
    """A ``table_format="q4_0"`` start interrupted after two shards of its first table, then a byte of
    a finished shard flipped in the kept ``.partial``: the next start converts that shard again and
    serves the rows a start that was never interrupted serves."""
    from ple.table.files.table_file import TableFileWriter, read_table_header

    folder = tmp_path / "tables"
    orig = TableFileWriter.commit
    done: list[int] = []

    def commit(self, k, *a, **kw):
        orig(self, k, *a, **kw)
        done.append(k)
        if len(done) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(TableFileWriter, "commit", commit)
    with pytest.raises(KeyboardInterrupt) as stopped:
        from_pretrained(wide, table_dir=folder, table_format="q4_0")
    monkeypatch.setattr(TableFileWriter, "commit", orig)
    (partial,) = folder.glob("*.partial")
    assert any(n.startswith(f"kept {partial} (2 of 3 shards done)") for n in stopped.value.__notes__)
    h = read_table_header(partial)
    a = done[0] * h["shard_rows"]
    at = h["data_offset"] + (a + 1) * h["row_nbytes"] + 4  # a code byte of the shard's second row
    with open(partial, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 0x21]))
    model = from_pretrained(wide, table_dir=folder, table_format="q4_0")
    own = from_pretrained(wide, table_dir=tmp_path / "own", table_format="q4_0")
    for x, y in zip(patched_layers(model), patched_layers(own)):
        assert np.array_equal(x.layer.table.data.numpy(), y.layer.table.data.numpy())
    torch.testing.assert_close(_logits(model), _logits(own), rtol=0, atol=0)
