"""``ple`` on table files: ``verify`` of several files, ``inspect`` of a table file, a failed
``convert`` that leaves no folder behind, exit statuses of ``--to`` values the data cannot hold, the
help of the commands that read GGUF files, and every ``ple`` command line of docs/FORMATS.md run as
written on a small generated checkpoint and GGUF."""

from __future__ import annotations

import glob
import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ple.checkpoint import read_header
from ple.commands.cli import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, main
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig
from ple.table import MmapTable, read_table_header
from tests.checkpoint.test_gguf_hostile import write_gguf
from tests.conftest import SMALL

FORMATS_MD = Path(__file__).resolve().parents[2] / "docs" / "FORMATS.md"
TWO = {**SMALL, "ple_embed_dim": 128}  # two PLE layers, head_dim 32: every block format fits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = PLEConfig(**TWO)
    return cfg, synthesize_checkpoint(cfg, tmp_path_factory.mktemp("ckpt"), seed=3, files=2)


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------ verify


def test_verify_takes_several_files_each_matched_to_its_layer(checkpoint, tmp_path, capsys):
    cfg, ckpt = checkpoint
    assert run(capsys, "convert", ckpt, tmp_path / "out", "--to", "q4_0")[0] == EXIT_OK
    files = sorted((tmp_path / "out").glob("*.pletable"))
    assert [read_table_header(f)["layout"]["ple_layer_index"] for f in files] == [0, 1]
    code, out, _ = run(capsys, "verify", *files, "--checkpoint", ckpt)
    assert code == EXIT_OK
    assert out.splitlines() == [f"{files[0]}: OK", f"{files[1]}: OK", "2 files: all OK"]
    code, out, _ = run(capsys, "verify", *files, "--checkpoint", ckpt, "--json")
    assert code == EXIT_OK
    assert json.loads(out) == {"ok": True, "files": [{"file": str(f), "ok": True, "problems": []} for f in files]}
    # one damaged file: each is still verified and reported, the status says one failed
    h = read_table_header(files[0])
    with open(files[0], "r+b") as fh:
        fh.seek(h["data_offset"] + 5)
        b = fh.read(1)
        fh.seek(h["data_offset"] + 5)
        fh.write(bytes([b[0] ^ 0x10]))
    code, out, _ = run(capsys, "verify", *files)
    assert code == EXIT_PROBLEM
    lines = out.splitlines()
    assert lines[0] == f"{files[0]}: 1 problem" and "shard 0 (rows [0, " in lines[1] and "checksum mismatch" in lines[1]
    assert lines[2:] == [f"{files[1]}: OK", "2 files: 1 with problems"]
    doc = json.loads(run(capsys, "verify", *files, "--json")[1])
    assert doc["ok"] is False and [d["ok"] for d in doc["files"]] == [False, True]
    # a file that cannot be read at all is one line, before anything is verified
    code, out, err = run(capsys, "verify", files[1], tmp_path / "absent.pletable")
    assert (code, out) == (
        EXIT_PROBLEM,
        "",
    ) and err == f"ple verify: No such file or directory: {tmp_path / 'absent.pletable'}\n"


# ------------------------------------------------------------------------------------------ inspect


def test_inspect_describes_a_table_file(checkpoint, tmp_path, capsys):
    cfg, ckpt = checkpoint
    assert run(capsys, "convert", ckpt, tmp_path / "out", "--layers", "1")[0] == EXIT_OK  # a copy: fp8, global scale
    (f,) = (tmp_path / "out").glob("*.pletable")
    code, out, _ = run(capsys, "inspect", f, "--json")
    assert code == EXIT_OK
    doc = json.loads(out)
    h = read_table_header(f)
    table = MmapTable.open(f, cfg.layout_fields(1))
    lay = cfg.layout(1)
    assert doc["format"] == table.format == "fp8" and doc["storage_dtype"] == "float8_e4m3fn"
    assert (doc["rows"], doc["head_dim"], doc["row_nbytes"]) == (lay.padded_rows, lay.head_dim, lay.head_dim)
    assert doc["scale"] == {"kind": "global", "value": float(table.scale.reshape(-1)[0])}
    assert doc["layout"] == cfg.layout_fields(1) and doc["layout_hash"] == h["layout_hash"]
    assert doc["source"] == "a checkpoint's config, PLE layer 1"
    assert (doc["shard_rows"], doc["num_shards"]) == (lay.shard_rows, cfg.split_ngram_parts)
    assert doc["checksums"]["shards"] == h["checksum"]["shards"] and doc["checksums"]["scale"] == h["checksum"]["scale"]
    assert doc["complete"] is True and doc["sparse"] is False and doc["file_nbytes"] == f.stat().st_size
    code, out, _ = run(capsys, "inspect", f)
    assert code == EXIT_OK
    assert out.startswith(f"table file {f}: complete\n")
    assert f"  format    fp8 (stored as float8_e4m3fn); one global scale {doc['scale']['value']!r}\n" in out
    assert f"  rows      {lay.padded_rows:,} x 32 values, 32 B a row; " in out
    assert "  source    a checkpoint's config, PLE layer 1\n" in out and h["layout_hash"] in out
    assert all(c in out for c in h["checksum"]["shards"])


def test_inspect_of_a_gguf_made_table_and_of_a_damaged_one(tmp_path, capsys):
    cfg = PLEConfig(**{**TWO, "ple_layer_ids": (2,)})
    write_gguf(tmp_path / "m.gguf", cfg, QT.Q4_1)
    assert run(capsys, "convert", tmp_path / "m.gguf", tmp_path / "out")[0] == EXIT_OK
    (f,) = (tmp_path / "out").glob("*.pletable")
    doc = json.loads(run(capsys, "inspect", f, "--json")[1])
    assert doc["format"] == "q4_1" and doc["block"] == 32 and doc["row_nbytes"] == 20 and doc["scale"]["value"] is None
    assert doc["source"] == "the PLE metadata of a GGUF model (converted without a config)"
    assert doc["layout"]["gguf"]["ple.head_vocab_sizes"] == list(cfg.layout(0).head_sizes)
    out = run(capsys, "inspect", f)[1]
    assert "q4_1 (blocks of 32 values, 20 B each, stored as uint8); no scale" in out
    assert "ple.head_vocab_sizes" in out
    blob = f.read_bytes()  # the header says another format: its checksum no longer holds
    f.write_bytes(blob.replace(b'"format": "q4_1"', b'"format": "q4_0"', 1))
    code, out, err = run(capsys, "inspect", f)
    assert code == EXIT_PROBLEM and out == "" and "header checksum mismatch" in err


# ------------------------------------------------------------------------------------------ convert


def _poke_table_nan(cfg: PLEConfig, src: Path, dst: Path) -> None:
    """A copy of checkpoint ``src`` whose layer-0 table holds an fp8 NaN (refused while converting)."""
    shutil.copytree(src, dst)
    name = f"model.language_model.layers.{cfg.ple_layer_ids[0] - 1}.ple.ple_embedding.ngram_embedding.shard_0.weight"
    for f in sorted(dst.glob("*.safetensors")):
        info = read_header(f).tensors.get(name)
        if info is not None:
            with open(f, "r+b") as fh:
                fh.seek(info.begin + 3)
                fh.write(b"\x7f")
            return
    raise AssertionError(f"{name} not found")


def test_a_failed_convert_leaves_no_folder_it_made(checkpoint, tmp_path, capsys, monkeypatch):
    cfg, ckpt = checkpoint
    bad = tmp_path / "bad"
    _poke_table_nan(cfg, ckpt, bad)
    out = tmp_path / "a" / "b" / "out"
    code, _, err = run(capsys, "convert", bad, out)
    assert code == EXIT_PROBLEM and "table row 0" in err
    assert not (tmp_path / "a").exists()  # the folder and the parents it made, all removed
    mine = tmp_path / "mine"
    mine.mkdir()
    assert run(capsys, "convert", bad, mine)[0] == EXIT_PROBLEM
    assert mine.is_dir() and not list(mine.iterdir())  # a folder the user had stays
    # the same for a GGUF that is cut short while it is copied
    gcfg = PLEConfig(**{**TWO, "ple_layer_ids": (2,)})
    src = tmp_path / "m.gguf"
    write_gguf(src, gcfg, QT.Q8_0)
    import ple.commands.convert as commands

    real = commands.read_gguf

    def read_then_cut(path):
        model = real(path)
        with open(src, "r+b") as fh:
            fh.truncate(src.stat().st_size - 64)
        return model

    monkeypatch.setattr(commands, "read_gguf", read_then_cut)
    code, _, err = run(capsys, "convert", src, tmp_path / "g" / "out")
    assert code == EXIT_PROBLEM and str(src) in err
    assert not (tmp_path / "g").exists()


def test_a_to_format_the_rows_cannot_hold_is_a_command_line_error(tmp_path, capsys):
    """README's exit table: a value the data shows to be out of range is exit 2, with the usage."""
    cfg = PLEConfig(**SMALL)  # head_dim 8
    ckpt = synthesize_checkpoint(cfg, tmp_path / "ckpt", seed=1, files=1)
    for fmt, block in (("q4_0", 32), ("nvfp4", 16), ("iq4_nl", 32)):
        code, out, err = run(capsys, "convert", ckpt, tmp_path / "out", "--to", fmt)
        assert (code, out) == (EXIT_USAGE, "")
        assert err.startswith("usage: ple convert ")
        assert f"ple convert: error: --to {fmt}: the checkpoint's rows are 8 values (head_dim), not whole" in err
        assert f"blocks of {block} values; formats these rows fit: bf16, fp16, fp32, fp8, fp8_row, int8_row\n" in err
        assert not (tmp_path / "out").exists()
    assert run(capsys, "convert", ckpt, tmp_path / "out", "--to", "int8")[0] == EXIT_OK
    # a GGUF's table is copied in its own type: --to another, or a layer it does not have, is exit 2
    gcfg = PLEConfig(**{**TWO, "ple_layer_ids": (2,)})
    write_gguf(tmp_path / "m.gguf", gcfg, QT.Q5_1)
    code, _, err = run(capsys, "convert", tmp_path / "m.gguf", tmp_path / "g", "--to", "q8_0")
    assert code == EXIT_USAGE and "error: --to q8_0: a GGUF table is written in its own type (Q5_1" in err
    code, _, err = run(capsys, "convert", tmp_path / "m.gguf", tmp_path / "g", "--layers", "1")
    assert code == EXIT_USAGE and "error: --layers 1: a GGUF model has one PLE table (layer 0)" in err
    assert run(capsys, "convert", tmp_path / "m.gguf", tmp_path / "g", "--to", "q5_1")[0] == EXIT_OK


@pytest.mark.parametrize("command", ["inspect", "convert"])
def test_the_help_of_the_commands_that_read_gguf_says_so(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "GGUF" in text and ".gguf" in text and "-0000k-of-0000N.gguf split set" in text


# ------------------------------------------------------------------------------------------ docs


def formats_md_commands() -> list[str]:
    """Every ``ple ...`` command line of docs/FORMATS.md (inline code, possibly wrapped)."""
    text = FORMATS_MD.read_text()
    return [" ".join(m.split()) for m in re.findall(r"`(ple [^`]+)`", text)]


def test_the_formats_page_commands_run_as_written(tmp_path, capsys, monkeypatch):
    """Placeholders: CHECKPOINT, a checkpoint of two PLE layers with 32-value rows; OUT, a new folder;
    model.gguf, a qwen4exp GGUF in the working folder; CONFIG, the checkpoint's config. Each command
    runs in the page's order (OUT/*.pletable globbed as a shell would) and exits 0."""
    commands = formats_md_commands()
    assert len(commands) >= 4 and any(c.startswith("ple verify OUT/*.pletable") for c in commands)
    cfg = PLEConfig(**TWO)
    ckpt = synthesize_checkpoint(cfg, tmp_path / "ckpt", seed=4, files=2)
    gcfg = PLEConfig(**{**TWO, "ple_layer_ids": (2,)})
    raw = write_gguf(tmp_path / "model.gguf", gcfg, QT.Q4_0)
    monkeypatch.chdir(tmp_path)
    names = {"CHECKPOINT": str(ckpt), "OUT": "OUT", "CONFIG": str(ckpt / "config.json")}
    ran = []
    for line in commands:
        argv = []
        for word in shlex.split(line)[1:]:
            word = re.sub(r"\b(CHECKPOINT|OUT|CONFIG)\b", lambda m: names[m[1]], word)
            argv += sorted(glob.glob(word)) if "*" in word else [word]
        code, out, err = run(capsys, *argv)
        assert code == EXIT_OK, (line, err)
        ran.append(argv[0])
    assert {"convert", "verify", "inspect"} <= set(ran)
    assert len(list(Path("OUT").glob("*.pletable"))) == 3  # two layers in iq4_nl, the GGUF's table
    t = MmapTable.open(Path("OUT") / "per_layer_token_embd.pletable")
    assert t.format == "q4_0" and np.array_equal(t.data.numpy(), raw)
