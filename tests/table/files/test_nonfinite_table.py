"""A NaN (or infinite) value in a checkpoint's table is never served: conversion and the loader refuse
it, naming the shard and the row, and ``ple verify --checkpoint`` reports it."""

from __future__ import annotations

import shutil

import pytest
import torch

from ple.checkpoint import CheckpointError, load_ple_weights, read_header
from ple.commands.cli import main
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig
from ple.table.files import transcode as convert_module
from ple.table.files.transcode import first_nonfinite_row
from tests.conftest import SMALL

LAYER, SHARD, ROW_IN_SHARD, COLUMN = 1, 3, 5, 2


@pytest.fixture(scope="module")
def clean_checkpoint(tmp_path_factory):
    cfg = PLEConfig(**SMALL)
    return cfg, synthesize_checkpoint(cfg, tmp_path_factory.mktemp("ckpt"), seed=5, files=2)


def _poke_nan(cfg: PLEConfig, root, dst, byte: int = 0x7F):
    """A copy of checkpoint ``root`` at ``dst`` with one table byte of layer LAYER set to ``byte``
    (0x7F / 0xFF: an e4m3 NaN); returns the table row it is in."""
    shutil.copytree(root, dst)
    name = f"model.language_model.layers.{cfg.ple_layer_ids[LAYER] - 1}.ple.ple_embedding.ngram_embedding.shard_{SHARD}.weight"
    for f in sorted(dst.glob("*.safetensors")):
        info = read_header(f).tensors.get(name)
        if info is not None:
            lay = cfg.layout(LAYER)
            with open(f, "r+b") as fh:
                fh.seek(info.begin + ROW_IN_SHARD * lay.head_dim + COLUMN)
                fh.write(bytes([byte]))
            return lay.shard_range(SHARD)[0] + ROW_IN_SHARD
    raise AssertionError(f"{name} not found")


def _where(row: int) -> str:
    return f"source shard {SHARD}: table row {row} (row {ROW_IN_SHARD} of the shard), column {COLUMN}"


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_convert_refuses_an_fp8_nan_naming_shard_and_row(clean_checkpoint, tmp_path, capsys, byte):
    cfg, root = clean_checkpoint
    row = _poke_nan(cfg, root, tmp_path / "ckpt", byte)
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--layers", str(LAYER)]) == 1
    err = capsys.readouterr().err
    assert _where(row) in err and f"byte 0x{byte:02x}" in err, err
    assert not list((tmp_path / "out").glob("*.pletable*"))  # nothing half-written left behind
    # the other layer is clean and converts
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--layers", str(1 - LAYER)]) == 0


def test_loader_refuses_an_fp8_nan(clean_checkpoint, tmp_path):
    cfg, root = clean_checkpoint
    row = _poke_nan(cfg, root, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=_where(row).replace("(", "\\(").replace(")", "\\)")):
        load_ple_weights(tmp_path / "ckpt", cfg, layers=[LAYER])
    assert load_ple_weights(tmp_path / "ckpt", cfg, layers=[1 - LAYER])  # the clean layer loads


def test_verify_reports_a_nan_the_file_holds(clean_checkpoint, tmp_path, capsys, monkeypatch):
    """A table file made from the NaN shard (as an older ple did) passes its checksums; compared with
    its checkpoint, the NaN row is a problem."""
    cfg, root = clean_checkpoint
    row = _poke_nan(cfg, root, tmp_path / "ckpt")
    with monkeypatch.context() as m:
        m.setattr(convert_module, "nonfinite_problem", lambda *a: None)
        assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--layers", str(LAYER)]) == 0
    (f,) = (tmp_path / "out").glob("*.pletable")
    capsys.readouterr()
    assert main(["verify", str(f)]) == 0  # the checksums hold
    assert main(["verify", str(f), "--checkpoint", str(tmp_path / "ckpt")]) == 1
    out = capsys.readouterr().out
    assert f"problem: {_where(row)} holds byte 0x7f" in out, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_first_nonfinite_row_against_isfinite(dtype):
    g = torch.Generator().manual_seed(0)
    rows = (torch.rand(300, 7, generator=g) - 0.5).to(dtype)
    assert first_nonfinite_row(rows) is None
    assert first_nonfinite_row(torch.zeros(5, 3, dtype=torch.int8)) is None
    # e4m3 has no infinity (a cast saturates to 448): only its NaN
    specials = (float("nan"),) if dtype == torch.float8_e4m3fn else (float("nan"), float("inf"), -float("inf"))
    for bad in specials:
        t = rows.clone()
        t[217, 4] = bad
        t[250, 0] = bad
        # reference: the first row whose values are not all finite, judged in float32
        want = int((~torch.isfinite(t.float())).any(dim=1).nonzero()[0])
        assert first_nonfinite_row(t) == want == 217
