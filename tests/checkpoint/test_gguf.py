"""GGUF models as table sources: ``ple convert model.gguf OUT`` copies the table's blocks into a table
file (one file or a split set), ``ple inspect`` reads the header; files written by the ``gguf``
package's own writer, with the PLE metadata keys llama.cpp's qwen4exp converter writes."""

from __future__ import annotations

import json

import gguf  # the oracle: a dev dependency, so a missing install fails here
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from ple.checkpoint.gguf import GGUFError, read_gguf, table_tensor
from ple.commands.cli import main
from ple.config import PLEConfig
from ple.table import MmapTable
from ple.table.formats.blocks import quantize_blocks
from ple.table.lookup import gather_dequant_reference
from tests.conftest import SMALL

WIDE = {**SMALL, "ple_embed_dim": 128, "ple_layer_ids": (2,)}  # one PLE layer, head_dim 32


def _config(tmp_path):
    cfg = PLEConfig(**WIDE)
    (tmp_path / "cfg").mkdir(exist_ok=True)
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg.to_dict()))
    return cfg


def _write(path, cfg, qtype=QT.Q5_1, split=0, metadata=True, rows=None, head_dim=None, raw=None):
    """A qwen4exp GGUF holding a random table of ``cfg``'s layer 0 (and one other tensor)."""
    lay = cfg.layout(0)
    rows = lay.padded_rows if rows is None else rows
    D = lay.head_dim if head_dim is None else head_dim
    x = np.random.default_rng(0).standard_normal((rows, D)).astype(np.float32)
    w = gguf.GGUFWriter(str(path), arch="qwen4exp", split_max_tensors=split)
    if metadata:
        p = "qwen4exp."
        w.add_key_value(p + "ple.layers", [i - 1 for i in cfg.ple_layer_ids], VT.ARRAY, VT.UINT32)
        w.add_uint32(p + "ple.ngram_size", cfg.ngram_size)
        w.add_uint32(p + "ple.heads_per_ngram", cfg.heads_per_ngram)
        w.add_uint32(p + "ple.conv_kernel", cfg.ple_conv_kernel_size)
        w.add_uint32(p + "ple.eos_token_id", cfg.eos_token_id)
        w.add_uint32(p + "embedding_length_per_layer_input", lay.head_dim)
        w.add_key_value(p + "ple.layer_multipliers", list(lay.multipliers), VT.ARRAY, VT.UINT64)
        w.add_key_value(p + "ple.head_offsets", list(lay.head_offsets), VT.ARRAY, VT.UINT64)
        w.add_key_value(p + "ple.head_vocab_sizes", list(lay.head_sizes), VT.ARRAY, VT.UINT64)
    if raw is None and qtype == QT.IQ4_NL:  # the gguf package has no IQ4_NL quantizer
        raw = quantize_blocks(x, "iq4_nl")
    elif raw is None:
        raw = gguf.quants.quantize(x, qtype) if qtype != QT.F32 else x
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.add_tensor("per_layer_token_embd.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raw


@pytest.mark.parametrize("qtype", [QT.Q5_1, QT.IQ4_NL, QT.Q8_0, QT.MXFP4, QT.F32])
def test_convert_copies_the_blocks(tmp_path, capsys, qtype):
    cfg = _config(tmp_path)
    raw = _write(tmp_path / "m.gguf", cfg, qtype)
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--config", str(tmp_path / "cfg")]) == 0
    (f,) = (tmp_path / "out").glob("*.pletable")
    assert f.name == "model.language_model.layers.1.ple.pletable"
    t = MmapTable.open(f, cfg.layout_fields(0))  # the config's layout: served with a checkpoint's other weights
    assert np.array_equal(t.data.view(torch.uint8).numpy().reshape(-1), np.asarray(raw).view(np.uint8).reshape(-1))
    ids = torch.randint(0, t.rows, (7, cfg.num_heads))
    want = gguf.quants.dequantize(np.asarray(raw), qtype)[ids.reshape(-1).numpy()].reshape(7, -1)
    assert torch.equal(t.lookup(ids, torch.float32), torch.from_numpy(want))
    assert main(["verify", str(f)]) == 0


def test_split_set_and_metadata_config_and_inspect(tmp_path, capsys):
    cfg = _config(tmp_path)
    raw = _write(tmp_path / "m.gguf", cfg, QT.Q4_0, split=1)
    parts = sorted(tmp_path.glob("m-*.gguf"))
    assert [p.name for p in parts] == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    model = read_gguf(parts[1])
    assert model.paths == parts and table_tensor(model).path == parts[1]
    capsys.readouterr()
    assert main(["inspect", str(parts[0]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["table"]["format"] == "q4_0" and doc["table"]["row_nbytes"] == 18
    assert doc["ple"]["ple.head_vocab_sizes"] == list(cfg.layout(0).head_sizes)
    assert main(["convert", str(parts[0]), str(tmp_path / "out")]) == 0  # no --config: the GGUF's metadata
    (f,) = (tmp_path / "out").glob("*.pletable")
    t = MmapTable.open(f)
    assert t.format == "q4_0" and t.header["layout"]["gguf"]["ple.layer_multipliers"] == list(cfg.layout(0).multipliers)
    assert np.array_equal(t.data.numpy(), raw)
    ids = torch.randint(0, t.rows, (5, 4))
    assert torch.equal(
        t.lookup(ids, torch.bfloat16),
        gather_dequant_reference(torch.from_numpy(raw), None, ids, torch.bfloat16, format="q4_0"),
    )
    parts[1].unlink()
    assert main(["convert", str(parts[0]), str(tmp_path / "o2")]) == 1
    assert "lacks m-00002-of-00002.gguf" in capsys.readouterr().err


def test_bad_files_are_clear_errors(tmp_path, capsys):
    cfg = _config(tmp_path)
    cases = {}
    _write(tmp_path / "shape.gguf", cfg, QT.Q8_0, head_dim=64)
    cases["shape.gguf"] = "qwen4exp.embedding_length_per_layer_input is 32, the table's rows are 64 values"
    _write(tmp_path / "type.gguf", cfg, QT.Q4_K, raw=np.zeros((cfg.layout(0).padded_rows // 8, 144), np.uint8))
    cases["type.gguf"] = "of GGML type Q4_K, which ple has no table format for"
    _write(tmp_path / "cut.gguf", cfg, QT.Q5_0)
    with open(tmp_path / "cut.gguf", "r+b") as fh:
        fh.truncate((tmp_path / "cut.gguf").stat().st_size - 100)
    cases["cut.gguf"] = "runs past the end of the file"
    _write(tmp_path / "rows.gguf", cfg, QT.Q8_0, rows=64, metadata=True)
    for name, msg in cases.items():
        capsys.readouterr()
        assert main(["convert", str(tmp_path / name), str(tmp_path / "out")]) == 1, name
        assert msg in capsys.readouterr().err, name
        assert main(["inspect", str(tmp_path / name)]) == 1, name
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "rows.gguf"), str(tmp_path / "out"), "--config", str(tmp_path / "cfg")]) == 1
    assert "is [32, 64] ([head_dim, rows]), the config's table is [32, " in capsys.readouterr().err
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(60))
    assert main(["inspect", str(tmp_path / "junk.gguf")]) == 1
    assert "GGUF version 0" in capsys.readouterr().err
    with pytest.raises(GGUFError, match="not a GGUF file"):
        (tmp_path / "x.gguf").write_bytes(b"NOPE" * 10)
        read_gguf(tmp_path / "x.gguf")
    assert not list((tmp_path / "out").glob("*.pletable"))
    # blocks ple quantizes itself read back the same way
    assert quantize_blocks(np.zeros((1, 32), np.float32), "q8_0").shape == (1, 34)
