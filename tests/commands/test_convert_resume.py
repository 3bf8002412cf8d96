"""An interrupted conversion does not lose its work: ``ple convert`` killed with SIGKILL midway (and,
for GGUF, a copy killed so) is continued by the same command run again, which writes only the shards
not done and gives the table an uninterrupted run gives, byte for byte, with the same error statistics;
another target, a changed source or a damaged temporary file start over; a writer interrupted before
its first shard leaves nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ple.commands.cli import main
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig
from ple.table import MmapTable
from ple.table.files.table_file import read_table_header
from ple.table.files.writer import TableFileWriter
from tests.conftest import SMALL

SRC = Path(__file__).resolve().parents[2] / "src"
CFG = {**SMALL, "ple_embed_dim": 128, "ple_layer_ids": (2,), "split_ngram_parts": 9}  # head_dim 32, 9 shards

_KILLED_CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import ple.table.files.writer as f
    orig = f.TableFileWriter.commit
    done = []

    def slow(self, k, *a, **kw):  # a shard is recorded: after the third, stop here until killed
        orig(self, k, *a, **kw)
        done.append(k)
        if len(done) == 3:
            Path(sys.argv[3] + ".tmp").write_text(",".join(map(str, done)))
            os.replace(sys.argv[3] + ".tmp", sys.argv[3])  # whole when the parent sees it
            time.sleep(300)

    f.TableFileWriter.commit = slow
    from ple.commands.cli import main
    sys.exit(main(["convert", sys.argv[1], sys.argv[2], *sys.argv[4:]]))
    """
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = PLEConfig(**CFG)
    return cfg, synthesize_checkpoint(cfg, tmp_path_factory.mktemp("ckpt"), seed=7, files=2)


def _kill_midway(source: Path, out: Path, tmp_path: Path, *args: str) -> list[int]:
    """Run ``ple convert SOURCE OUT ARGS`` in a child and SIGKILL it once three shards are recorded;
    returns those shards."""
    marker = tmp_path / "marker"
    marker.unlink(missing_ok=True)
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, str(source), str(out), str(marker), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), child.communicate(timeout=30)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    return [int(k) for k in marker.read_text().split(",")]


def _convert(capsys, *args) -> dict:
    capsys.readouterr()
    assert main(["convert", *map(str, args), "--json"]) == 0
    captured = capsys.readouterr()
    (doc,) = json.loads(captured.out)["layers"]
    doc["stderr"] = captured.err
    return doc


def _same_stats(a: dict, b: dict) -> None:
    for x, y in [(a["error"], b["error"])] + list(zip(a["per_head"], b["per_head"])):
        assert x["rows"] == y["rows"]
        assert x["max_rel"] == pytest.approx(y["max_rel"], rel=1e-12)
        assert x["rms_rel"] == pytest.approx(y["rms_rel"], rel=1e-12)


@pytest.mark.parametrize("to", ["iq4_nl", None], ids=["iq4_nl", "copy"])
def test_a_conversion_killed_midway_continues(checkpoint, tmp_path, capsys, to):
    cfg, ckpt = checkpoint
    args = ["--to", to] if to else []
    whole = _convert(capsys, ckpt, tmp_path / "whole", *args)
    out = tmp_path / "out"
    done = _kill_midway(ckpt, out, tmp_path, *args)
    (partial,) = out.iterdir()
    header = read_table_header(partial)
    assert partial.name.endswith(".partial") and header["complete"] is False
    assert sorted(k for k, c in enumerate(header["checksum"]["shards"]) if c) == sorted(done)

    again = _convert(capsys, ckpt, out, *args)
    lay = cfg.layout(0)
    assert again["resumed_rows"] == sum(lay.shard_range(k)[1] - lay.shard_range(k)[0] for k in done)
    assert f"3 of {lay.split_parts} shards were done" in again["stderr"]
    _same_stats(again, whole)
    (table,) = out.glob("*.pletable")
    (ref,) = (tmp_path / "whole").glob("*.pletable")
    a, b = MmapTable.open(table), MmapTable.open(ref)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert a.header["checksum"] == b.header["checksum"] and "resume" not in a.header
    capsys.readouterr()
    assert main(["verify", str(table), "--checkpoint", str(ckpt)]) == 0


def test_another_target_or_a_changed_source_start_over(checkpoint, tmp_path, capsys):
    cfg, ckpt = checkpoint
    out = tmp_path / "out"
    _kill_midway(ckpt, out, tmp_path, "--to", "q4_0")
    other = _convert(capsys, ckpt, out, "--to", "q8_0")  # another target: the q4_0 shards are not taken
    assert other["resumed_rows"] == 0 and other["format"] == "q8_0"
    assert [p.suffix for p in out.iterdir() if not p.name.endswith(".source.json")] == [".pletable"]

    out2 = tmp_path / "out2"
    _kill_midway(ckpt, out2, tmp_path, "--to", "q4_0")
    for f in ckpt.glob("*.safetensors"):  # the source is rewritten (its modification time changes)
        os.utime(f, ns=(time.time_ns(), time.time_ns()))
    again = _convert(capsys, ckpt, out2, "--to", "q4_0")
    assert again["resumed_rows"] == 0 and len([p for p in out2.iterdir() if p.suffix != ".json"]) == 1
    capsys.readouterr()
    (table,) = out2.glob("*.pletable")
    assert main(["verify", str(table), "--checkpoint", str(ckpt)]) == 0


def test_a_damaged_temporary_file_is_not_continued(checkpoint, tmp_path, capsys):
    cfg, ckpt = checkpoint
    out = tmp_path / "out"
    _kill_midway(ckpt, out, tmp_path, "--to", "q5_1")
    (partial,) = out.iterdir()
    raw = bytearray(partial.read_bytes()[:4096])
    at = raw.index(b'"progress"')
    raw[at + 20] ^= 1  # the header no longer matches its checksum (a torn write)
    with open(partial, "r+b") as fh:
        fh.write(raw)
    again = _convert(capsys, ckpt, out, "--to", "q5_1")
    assert again["resumed_rows"] == 0
    (table,) = [p for p in out.iterdir() if not p.name.endswith(".source.json")]
    capsys.readouterr()
    assert table.suffix == ".pletable" and main(["verify", str(table), "--checkpoint", str(ckpt)]) == 0


def test_a_gguf_copy_killed_midway_continues(tmp_path, capsys):
    """With ``--config``, a GGUF's table is copied in the config's shards: 9 here."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    from tests.commands.test_convert_refusals import _gguf

    cfg = PLEConfig(**CFG)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg.to_dict()))
    raw = gguf.quants.quantize(torch.randn(cfg.layout(0).padded_rows, 32).numpy(), QT.Q5_0)
    _gguf(tmp_path / "m.gguf", cfg, QT.Q5_0, raw)
    out = tmp_path / "out"
    done = _kill_midway(tmp_path / "m.gguf", out, tmp_path, "--config", str(tmp_path / "cfg"))
    assert len(done) == 3 and len(list(out.iterdir())) == 1
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "m.gguf"), str(out), "--config", str(tmp_path / "cfg")]) == 0
    assert f"3 of {cfg.layout(0).split_parts} shards were done" in capsys.readouterr().err
    (table,) = out.iterdir()
    assert (MmapTable.open(table).data.numpy() == raw).all()
    assert main(["verify", str(table)]) == 0


def test_a_writer_interrupted_before_its_first_shard_leaves_nothing(tmp_path):
    path = tmp_path / "t.pletable"
    with pytest.raises(KeyboardInterrupt):
        with TableFileWriter(path, 64, 32, "q4_0", 16, "h", resume="k" * 32) as w:
            part = w.shard_writer(0)
            part.write(torch.zeros(16 * 18, dtype=torch.uint8).numpy())
            part.finish()  # finished, never committed
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt):
        with TableFileWriter(path, 64, 32, "q4_0", 16, "h", resume="k" * 32) as w:
            w.write_shard(1, torch.zeros(16, 18, dtype=torch.uint8))
            w.commit(1, {"any": "record"})
            raise KeyboardInterrupt
    (kept,) = tmp_path.iterdir()
    with TableFileWriter(path, 64, 32, "q4_0", 16, "h", resume="k" * 32) as w:
        assert w.resumed == {1: {"any": "record"}} and w.partial_path == kept
        for k in (0, 2, 3):
            w.write_shard(k, torch.zeros(16, 18, dtype=torch.uint8))
    assert [p.name for p in tmp_path.iterdir()] == ["t.pletable"]
    with pytest.raises(KeyboardInterrupt):  # a writer without a key never keeps its file
        with TableFileWriter(tmp_path / "u.pletable", 64, 32, "q4_0", 16, "h") as w:
            w.write_shard(1, torch.zeros(16, 18, dtype=torch.uint8))
            w.commit(1, None)
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["t.pletable"]


def _rewrite_header(partial: Path, edit) -> None:
    """Edit the temporary file's header (``edit(header)`` in place), its header checksum recomputed as a
    writer would: a header that checks out, saying what the edit says."""
    from ple.table.files.table_file import header_digest

    raw = partial.read_bytes()
    n = int.from_bytes(raw[8:16], "little")
    header = json.loads(raw[16 : 16 + n])
    edit(header)
    header["header_checksum"] = header_digest(header)
    blob = json.dumps(header, indent=1).encode()
    room = header["data_offset"] - 16
    assert len(blob) <= room
    with open(partial, "r+b") as fh:
        fh.write(b"PLETABLE" + len(blob).to_bytes(8, "little") + blob + b" " * (room - len(blob)))


def _served_equals(table: Path, ref: Path) -> None:
    a, b = MmapTable.open(table), MmapTable.open(ref)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert a.header["checksum"] == b.header["checksum"]


def test_a_finished_shard_damaged_in_the_temporary_file_is_converted_again(checkpoint, tmp_path, capsys):
    """A byte of a finished shard flipped inside the ``.partial``: the shard no longer gives the checksum
    recorded as it was written, so it is converted again (the others are kept)."""
    cfg, ckpt = checkpoint
    whole = _convert(capsys, ckpt, tmp_path / "whole", "--to", "q4_0")
    out = tmp_path / "out"
    done = _kill_midway(ckpt, out, tmp_path, "--to", "q4_0")
    (partial,) = out.iterdir()
    header = read_table_header(partial)
    k = sorted(done)[1]
    a, b = cfg.layout(0).shard_range(k)
    at = header["data_offset"] + (a + (b - a) // 2) * header["row_nbytes"] + 5  # a code byte of a middle row
    with open(partial, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 0x10]))
    again = _convert(capsys, ckpt, out, "--to", "q4_0")
    lay = cfg.layout(0)
    kept = [j for j in done if j != k]
    assert again["resumed_rows"] == sum(lay.shard_range(j)[1] - lay.shard_range(j)[0] for j in kept)
    assert f"1 finished shard(s) no longer give the checksums recorded as they were written ({k})" in again["stderr"]
    _same_stats(again, whole)
    (table,) = out.glob("*.pletable")
    _served_equals(table, next((tmp_path / "whole").glob("*.pletable")))


def test_a_progress_record_claiming_an_unstarted_shard_is_not_believed(checkpoint, tmp_path, capsys):
    """The record edited to say a shard never started is done (a checksum of another shard put in its
    place, the header's checksum recomputed): its bytes do not give it, so it is converted."""
    cfg, ckpt = checkpoint
    out = tmp_path / "out"
    done = _kill_midway(ckpt, out, tmp_path, "--to", "q4_0")
    (partial,) = out.iterdir()
    lay = cfg.layout(0)
    claimed = next(k for k in range(lay.split_parts) if k not in done)

    def edit(header):
        progress = json.loads(header["progress"])
        progress[str(claimed)] = progress[str(done[0])]
        header["progress"] = json.dumps(progress, separators=(",", ":"))
        header["checksum"]["shards"][claimed] = header["checksum"]["shards"][done[0]]

    _rewrite_header(partial, edit)
    assert read_table_header(partial)["checksum"]["shards"][claimed]  # a header a reader accepts
    again = _convert(capsys, ckpt, out, "--to", "q4_0")
    assert again["resumed_rows"] == sum(lay.shard_range(j)[1] - lay.shard_range(j)[0] for j in done)
    assert f"({claimed}): converting them again" in again["stderr"]
    whole = _convert(capsys, ckpt, tmp_path / "whole", "--to", "q4_0")
    _same_stats(again, whole)
    (table,) = out.glob("*.pletable")
    _served_equals(table, next((tmp_path / "whole").glob("*.pletable")))


def test_a_source_row_rewritten_with_its_time_set_back_starts_over(checkpoint, tmp_path, capsys):
    """A row of a finished shard rewritten in the checkpoint, its modification time set back: the change
    time moved, so the source is another one (the resume key and the record beside the table file are
    made of one identity), and the table holds the new row."""
    import shutil

    from ple.checkpoint import read_header
    from ple.convert.folder import RECORD_SUFFIX

    cfg, ckpt = checkpoint
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    out = tmp_path / "out"
    done = _kill_midway(copy, out, tmp_path, "--to", "q4_0")
    name = f"model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_{done[0]}.weight"
    (f,) = [f for f in copy.glob("*.safetensors") if name in read_header(f).tensors]
    info = read_header(f).tensors[name]
    st = os.stat(f)
    width = info.nbytes // info.shape[0]
    with open(f, "r+b") as fh:  # row 0 of the shard becomes a copy of row 1 (finite fp8 values)
        fh.seek(info.begin + width)
        row1 = fh.read(width)
        fh.seek(info.begin)
        assert fh.read(width) != row1
        fh.seek(info.begin)
        fh.write(row1)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(f).st_size, os.stat(f).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    again = _convert(capsys, copy, out, "--to", "q4_0")
    assert again["resumed_rows"] == 0 and "continuing" not in again["stderr"]
    whole = _convert(capsys, copy, tmp_path / "whole", "--to", "q4_0")
    (table,) = out.glob("*.pletable")
    _served_equals(table, next((tmp_path / "whole").glob("*.pletable")))
    record = json.loads(table.with_name(table.name + RECORD_SUFFIX).read_text())
    assert {r["file"]: r["ctime_ns"] for r in record["source"]["files"]}[f.name] == os.stat(f).st_ctime_ns
    capsys.readouterr()
    assert main(["verify", str(table), "--checkpoint", str(copy)]) == 0
    _same_stats(again, whole)


def test_a_multi_layer_conversion_interrupted_continues_with_the_same_command(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the second layer is converted, the first layer's file finished: the same command
    keeps the first file (its record matches the checkpoint: said on stderr) and continues the second's
    ``.partial``; the files equal an uninterrupted run's. A file whose record does not match the
    conversion asked for (another target) is refused without --force."""
    cfg = PLEConfig(**{**CFG, "ple_layer_ids": (1, 2)})
    ckpt = synthesize_checkpoint(cfg, tmp_path / "ckpt", seed=3, files=2)
    whole = tmp_path / "whole"
    assert main(["convert", str(ckpt), str(whole), "--to", "int8"]) == 0
    orig = TableFileWriter.commit
    commits: list[str] = []

    def commit(self, k, *a, **kw):
        orig(self, k, *a, **kw)
        commits.append(self.path.name)
        if "layers.1." in self.path.name and commits.count(self.path.name) == 2:
            raise KeyboardInterrupt

    out = tmp_path / "out"
    monkeypatch.setattr(TableFileWriter, "commit", commit)
    capsys.readouterr()
    assert main(["convert", str(ckpt), str(out), "--to", "int8"]) == 130
    err = capsys.readouterr().err
    assert "2 of 9 shards done): the same conversion run again continues it" in err
    monkeypatch.setattr(TableFileWriter, "commit", orig)
    first = out / "model.language_model.layers.0.ple.pletable"
    before = os.stat(first)
    assert main(["convert", str(ckpt), str(out), "--to", "int8"]) == 0
    err = capsys.readouterr().err
    assert f"PLE layer 0: kept {first}: its record says it holds this conversion of the checkpoint" in err
    assert "continuing" in err and "2 of 9 shards were done" in err
    assert os.stat(first).st_ino == before.st_ino and os.stat(first).st_mtime_ns == before.st_mtime_ns
    for ref in whole.glob("*.pletable"):
        _served_equals(out / ref.name, ref)
    assert main(["convert", str(ckpt), str(out), "--to", "q4_0"]) == 1
    assert "exists and is not kept (it holds int8_row rows, not q4_0): pass --force" in capsys.readouterr().err


@pytest.mark.parametrize("workdir", [False, True], ids=["temporary", "workdir"])
def test_a_kept_temporary_file_is_named_only_while_it_is_there(tmp_path, capsys, monkeypatch, workdir):
    """``ple demo`` stopped (SIGTERM) while its table is converted: the ``.partial`` kept in its
    temporary folder goes with the folder, so nothing says it was kept; in a ``--workdir`` it stays,
    and the line says so (before the command's last line)."""
    import ple.commands.demo as demo
    from ple.commands.cli import Terminated

    seen: list[Path] = []

    def interrupted_serving(args, work, progress):
        with TableFileWriter(work / "t.pletable", 64, 32, "q4_0", 16, "h", resume="k" * 32) as w:
            w.write_shard(0, torch.zeros(16, 18, dtype=torch.uint8))
            w.commit(0, None)
            seen.append(w.partial_path)
            raise Terminated

    monkeypatch.setattr(demo, "run_serving", interrupted_serving)
    extra = ["--workdir", str(tmp_path / "work")] if workdir else []
    capsys.readouterr()
    assert main(["demo", "--only", "serving", "--synthetic-tokens", *extra]) == 143
    err = capsys.readouterr().err
    (partial,) = seen
    assert err.endswith("ple demo: terminated\n")
    if workdir:
        assert partial.exists()
        assert f"kept {partial} (1 of 4 shards done): the same conversion run again continues it" in err
    else:
        assert not partial.parent.exists() and "kept" not in err and ".partial" not in err
