"""Hostile files under ple's library API: temporary files at names others can predict, table files
changed or damaged on disk, scales that do not survive the cast to float32, a native library cache
holding something else. Each case fails with an error ple raises on purpose (or is repaired), never
with a stray traceback, a followed link or a clobbered file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ple.integrations.checkpoints as deq
from ple.config import PLEConfig
from ple.demo import synthesize_checkpoint
from ple.files import make_partial_dir, write_atomically
from ple.integrations.checkpoints import dequantize_checkpoint
from ple.integrations.tables import RECORD_SUFFIX, prepare_table

SMALL = dict(
    hidden_size=16,
    hc_count=2,
    ple_layer_ids=(1,),
    ple_embed_dim=16,
    ngram_size=3,
    heads_per_ngram=2,
    vocab_size=300,
    ngram_vocab_size_base=300,
    make_ngram_vocab_size_divisible_by=64,
    split_ngram_parts=3,
    eos_token_id=2,
)


# ---------------------------------------------------------------------------------------------- atomic writes


def _plant_link(at: Path, victim: Path) -> None:
    victim.write_text("precious")
    at.symlink_to(victim)


def test_write_atomically_follows_no_link_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "a.json"
    _plant_link(tmp_path / "a.json.partial", tmp_path / "victim")  # the old fixed temporary name
    write_atomically(target, b"new")
    assert target.read_bytes() == b"new" and (tmp_path / "victim").read_text() == "precious"
    # a link at the name itself is replaced, never written through
    target.unlink()
    _plant_link(target, tmp_path / "victim2")
    write_atomically(target, b"newer")
    assert not target.is_symlink() and target.read_bytes() == b"newer"
    assert (tmp_path / "victim2").read_text() == "precious"

    def fail(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, b"lost")
    assert target.read_bytes() == b"newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "a.json.partial", "victim", "victim2"]


def test_partial_dirs_are_private_to_their_writer(tmp_path):
    a, b = make_partial_dir(tmp_path / "out"), make_partial_dir(tmp_path / "out")
    assert a != b and a.is_dir() and b.is_dir() and a.name.endswith(".partial") and a.name.startswith("out.")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return synthesize_checkpoint(PLEConfig(**SMALL), tmp_path_factory.mktemp("src") / "src", seed=3, files=2)


def test_table_record_is_not_written_through_a_planted_link(fp8_checkpoint, tmp_path):
    from ple.checkpoint import check_checkpoint, table_file_name

    cfg = PLEConfig.from_pretrained(fp8_checkpoint)
    (entry,) = check_checkpoint(fp8_checkpoint, cfg).layers
    folder = tmp_path / "tables"
    folder.mkdir()
    record = folder / (table_file_name(entry.prefix) + RECORD_SUFFIX)
    _plant_link(record.with_name(record.name + ".partial"), tmp_path / "victim")  # the old fixed temporary name
    prepared = prepare_table(entry, cfg, folder)
    prepared.table.close()
    assert prepared.action == "converted"
    assert (tmp_path / "victim").read_text() == "precious"
    assert json.loads(record.read_text())["checkpoint"] == str(fp8_checkpoint.resolve())


def test_dequantize_ignores_a_link_at_the_old_temporary_name(fp8_checkpoint, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    (tmp_path / "dst.partial").symlink_to(victim, target_is_directory=True)
    dst = dequantize_checkpoint(fp8_checkpoint, tmp_path / "dst")
    assert sorted(p.name for p in victim.iterdir()) == ["keep"] and (victim / "keep").read_text() == "precious"
    assert (dst / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "dst.partial", "victim"]


def test_concurrent_dequantize_writers_do_not_clobber(fp8_checkpoint, tmp_path, monkeypatch):
    """A second writer that starts and finishes while the first is mid-way: the second's copy is
    published whole, the first raises FileExistsError and leaves nothing behind."""
    from ple.checkpoint import load_ple_weights

    dst = tmp_path / "dst"
    real = deq._dequantize_file
    calls = []

    def interleaved(reader, h, out, *a, **k):
        calls.append(out)
        if len(calls) == 1:  # the first writer, before its first file: another writer runs to the end
            monkeypatch.setattr(deq, "_dequantize_file", real)
            dequantize_checkpoint(fp8_checkpoint, dst)
        return real(reader, h, out, *a, **k)

    monkeypatch.setattr(deq, "_dequantize_file", interleaved)
    with pytest.raises(FileExistsError, match="another writer finished first"):
        dequantize_checkpoint(fp8_checkpoint, dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
    cfg = PLEConfig.from_pretrained(dst)
    want = load_ple_weights(fp8_checkpoint, cfg)[0].table
    got = load_ple_weights(dst, cfg)[0].table
    assert torch.equal(got.data, want.data.to(torch.bfloat16) * want.scale.to(torch.bfloat16))
