"""``ple convert --to``: block formats from any checkpoint (blocks equal to the ``gguf`` package's),
and the format a checkpoint already has copied exactly."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from ple.checkpoint import load_ple_weights
from ple.commands.cli import main
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig
from ple.table import MmapTable
from ple.table.formats.blocks import nvfp4_global_scale, quantize_blocks
from ple.table.formats.catalog import BLOCK_FORMATS
from ple.table.lookup import gather_dequant_reference
from tests.conftest import SMALL

WIDE = {**SMALL, "ple_embed_dim": 128}  # head_dim 32: one block of 32 values a row


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    cfg = PLEConfig(**WIDE)
    return cfg, synthesize_checkpoint(cfg, tmp_path_factory.mktemp("ckpt"), seed=5, files=2)


def _source_rows(cfg, ckpt, layer):
    """The layer's table as fp32 values (the fp8 source dequantized), ``[rows, head_dim]``."""
    t = load_ple_weights(ckpt, cfg)[layer].table
    return t.data.float() * t.scale.float()


def test_to_fp8_of_an_fp8_checkpoint_copies_it(wide_checkpoint, tmp_path, capsys):
    cfg, ckpt = wide_checkpoint
    assert main(["convert", str(ckpt), str(tmp_path / "plain"), "--layers", "0"]) == 0
    capsys.readouterr()
    assert main(["convert", str(ckpt), str(tmp_path / "to8"), "--layers", "0", "--to", "fp8", "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)["layers"]
    assert (doc["source_format"], doc["format"], doc["error"]["max_rel"]) == ("fp8", "fp8", 0.0)
    (a,) = (tmp_path / "plain").glob("*.pletable")
    (b,) = (tmp_path / "to8").glob("*.pletable")
    ta, tb = MmapTable.open(a), MmapTable.open(b)
    assert tb.format == "fp8" and tb.nbytes == ta.nbytes
    assert torch.equal(ta.data.view(torch.uint8), tb.data.view(torch.uint8)) and torch.equal(ta.scale, tb.scale)
    assert main(["verify", str(b), "--checkpoint", str(ckpt)]) == 0


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_to_a_block_format(wide_checkpoint, tmp_path, capsys, fmt):
    cfg, ckpt = wide_checkpoint
    capsys.readouterr()
    assert main(["convert", str(ckpt), str(tmp_path), "--layers", "1", "--to", fmt, "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)["layers"]
    assert (doc["source_format"], doc["format"]) == ("fp8", fmt)
    assert 0 < doc["error"]["max_rel"] < (0.6 if fmt.endswith("fp4") else 0.3), doc["error"]
    (f,) = tmp_path.glob("*.pletable")
    table = MmapTable.open(f)
    assert (table.format, table.head_dim) == (fmt, 32)
    x = _source_rows(cfg, ckpt, 1)
    g = nvfp4_global_scale(float(x.abs().max())) if fmt == "nvfp4" else None
    want = quantize_blocks(x, fmt, g)
    assert np.array_equal(table.data.numpy(), want)
    if fmt not in ("iq4_nl", "nvfp4"):  # what the gguf package writes for the same values
        import gguf

        np.testing.assert_array_equal(
            want, gguf.quants.quantize(x.numpy(), getattr(gguf.GGMLQuantizationType, fmt.upper()))
        )
    ids = torch.randint(0, table.rows, (9, cfg.num_heads))
    ref = gather_dequant_reference(table.data, table.scale, ids, torch.bfloat16, format=fmt)
    assert torch.equal(table.lookup(ids, torch.bfloat16), ref)
    assert main(["verify", str(f), "--checkpoint", str(ckpt)]) == 0


def test_a_row_width_that_is_not_whole_blocks_is_refused(tmp_path, capsys):
    cfg = PLEConfig(**SMALL)  # head_dim 8
    ckpt = synthesize_checkpoint(cfg, tmp_path / "ckpt", seed=1, files=1)
    capsys.readouterr()
    # a value the data shows to be out of range is a command-line error: exit 2 with the usage
    assert main(["convert", str(ckpt), str(tmp_path / "out"), "--to", "q4_0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ple convert ")
    assert "error: --to q4_0: the checkpoint's rows are 8 values (head_dim), not whole q4_0 blocks of 32" in err
    assert "formats these rows fit: bf16, fp16, fp32, fp8, fp8_row, int8_row\n" in err
    assert not (tmp_path / "out").exists()
    assert dataclasses.asdict(cfg)["ple_embed_dim"] == 32


def test_an_nvfp4_conversion_shows_its_amax_pass(wide_checkpoint, tmp_path, capsys, monkeypatch):
    """nvfp4's global scale needs one pass over the whole table before the conversion: on a terminal
    it has a progress bar of its own, counting every row of the layer."""
    import ple.commands.convert

    cfg, ckpt = wide_checkpoint
    monkeypatch.setattr(ple.commands.convert, "show_progress", lambda: True)
    assert main(["convert", str(ckpt), str(tmp_path / "out"), "--layers", "0", "--to", "nvfp4"]) == 0
    err = capsys.readouterr().err
    amax = [line for line in err.replace("\r", "\n").splitlines() if "amax" in line and "nvfp4 global scale" in line]
    assert amax, err
    rows = cfg.layout(0).padded_rows
    assert f"{rows}/{rows}" in amax[-1] or f"{rows / 1000:.2f}k/{rows / 1000:.2f}k" in amax[-1], amax[-1]
