"""What ``ple convert`` refuses in the data, at copy speed, naming row and column (exit status 1, no file
left): GGUF tables holding values that are not finite (a NaN or infinite fp16 block scale or minimum,
an infinity in an F16 / BF16 / F32 table), and quantizing values whose block's fp16 scale overflows."""

from __future__ import annotations

import json

import gguf  # the oracle: a dev dependency, so a missing install fails here
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file, save_file

from ple.commands.cli import main
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig
from ple.table.formats.blocks import quantize_blocks
from tests.checkpoint.test_gguf import _write as write_test_gguf
from tests.conftest import SMALL

WIDE = {**SMALL, "ple_embed_dim": 128, "ple_layer_ids": (2,)}  # one PLE layer, head_dim 32
TWO_BLOCKS = {**SMALL, "ple_embed_dim": 256, "ple_layer_ids": (2,)}  # head_dim 64


def _gguf(path, cfg: PLEConfig, qtype, raw) -> None:
    """A qwen4exp GGUF holding ``raw`` as the table of ``cfg``'s layer 0, with its PLE metadata."""
    write_test_gguf(path, cfg, qtype, raw=raw)


def _table(cfg: PLEConfig) -> np.ndarray:
    lay = cfg.layout(0)
    return np.random.default_rng(0).standard_normal((lay.padded_rows, lay.head_dim)).astype(np.float32)


ROW = 700


def _damaged(kind: str, x: np.ndarray):
    """``(GGML type, raw tensor, column named, what the message says)`` for a table with one value that
    is not finite at row ROW."""
    if kind in ("F16", "BF16", "F32"):
        v = x.copy()
        v[ROW, 19] = np.inf if kind != "BF16" else np.nan
        raw = {"F16": v.astype(np.float16), "F32": v, "BF16": gguf.quants.quantize(v, QT.BF16)}[kind]
        return getattr(QT, kind), raw, 19, "holds inf" if kind != "BF16" else "holds nan"
    qtype = getattr(QT, kind)
    raw = gguf.quants.quantize(x, qtype) if kind != "IQ4_NL" else quantize_blocks(x, "iq4_nl")
    bn = raw.shape[1] // (x.shape[1] // 32)
    at = 0 if kind != "Q4_1" else 2  # q4_1: its minimum
    raw[ROW, bn + at : bn + at + 2] = [0x00, 0x7C] if kind != "Q8_0" else [0x01, 0x7E]  # inf, or NaN
    shown = {"Q8_0": "block scale nan", "Q4_1": "block minimum inf"}.get(kind, "block scale inf")
    return qtype, raw, 32, shown


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "F16", "BF16", "F32"])
def test_a_gguf_table_with_a_value_not_finite_is_refused(tmp_path, capsys, kind):
    cfg = PLEConfig(**TWO_BLOCKS)
    qtype, raw, col, shown = _damaged(kind, _table(cfg))
    _gguf(tmp_path / "m.gguf", cfg, qtype, raw)
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"row {ROW}, column {col} holds" in err and shown in err and "not a finite value" in err, err
    assert not (tmp_path / "out").exists()  # the folder the command made is removed with its partial file


def test_a_clean_gguf_table_still_converts_exactly(tmp_path, capsys):
    cfg = PLEConfig(**WIDE)
    raw = gguf.quants.quantize(_table(cfg), QT.Q4_1)
    _gguf(tmp_path / "m.gguf", cfg, QT.Q4_1, raw)
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 0
    (f,) = (tmp_path / "out").glob("*.pletable")
    assert main(["verify", str(f)]) == 0
    from ple.table import MmapTable

    assert np.array_equal(MmapTable.open(f).data.numpy(), raw)


@pytest.fixture(scope="module")
def big_values_checkpoint(tmp_path_factory):
    """An fp8 checkpoint whose global scale makes values up to 1.9e7 (fp8 bytes of at most 1.875)."""
    cfg = PLEConfig(**WIDE)
    root = synthesize_checkpoint(cfg, tmp_path_factory.mktemp("ckpt"), seed=3, files=1)
    (f,) = root.glob("*.safetensors")
    tensors = load_file(f)
    (name,) = [n for n in tensors if n.endswith("ngram_embedding.weight_scale")]
    tensors[name] = torch.tensor([1e7], dtype=torch.float32)
    save_file(tensors, f)
    return cfg, root


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q5_0", "q4_1", "q5_1", "iq4_nl"])
def test_quantizing_past_fp16_exits_1_naming_row_and_value(big_values_checkpoint, tmp_path, capsys, fmt):
    """GGML would write an infinite block scale (inf and NaN values): refused, with the table row, the
    block's columns and its value, exit status 1, nothing left."""
    cfg, root = big_values_checkpoint
    capsys.readouterr()
    assert main(["convert", str(root), str(tmp_path / "out"), "--to", fmt]) == 1
    err = capsys.readouterr().err
    assert f"cannot quantize table row 0 to {fmt}: its block of columns [0, 32) holds" in err, err
    assert "65504" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "int8"])
def test_formats_with_wider_scales_take_the_same_values(big_values_checkpoint, tmp_path, capsys, fmt):
    cfg, root = big_values_checkpoint
    assert main(["convert", str(root), str(tmp_path / "out"), "--to", fmt, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert np.isfinite(doc["layers"][0]["error"]["rms_rel"])
    (f,) = (tmp_path / "out").glob("*.pletable")
    assert main(["verify", str(f), "--checkpoint", str(root)]) == 0
