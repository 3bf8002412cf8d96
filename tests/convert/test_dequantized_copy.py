"""``dequantize_checkpoint``: a copy whose quantized PLE tables are dequantized exactly as ple's lookup
dequantizes them, every other tensor and file unchanged; the checkpoint read the way ple.checkpoint
reads every checkpoint (regular files in the folder only, headers checked) before anything is written."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ple.checkpoint import CheckpointError, checkpoint_files, load_ple_weights, scan_checkpoint
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig
from ple.convert.dequantized import dequantize_checkpoint
from tests.conftest import SMALL


def _all(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in checkpoint_files(folder):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sharded_fp8_checkpoint_is_dequantized_exactly(dtype, tmp_path):
    cfg = PLEConfig(**SMALL)
    src = synthesize_checkpoint(cfg, tmp_path / "src", seed=7, files=3)  # shards and scales spread over files
    (src / "tokenizer.json").write_text("{}")
    dst = dequantize_checkpoint(src, tmp_path / "dst", dtype)
    before, after = _all(src), _all(dst)
    assert sorted(after) == sorted(k for k in before if not k.endswith("weight_scale"))
    want = load_ple_weights(src, cfg)
    for idx, w in want.items():
        prefix = w.prefix + "ple_embedding.ngram_embedding."
        rows = torch.cat([after[f"{prefix}shard_{k}.weight"] for k in range(cfg.layout(idx).split_parts)])
        assert rows.dtype == dtype
        assert torch.equal(rows, w.table.data.to(dtype) * w.table.scale.to(dtype))
    for k, v in after.items():
        if "ngram_embedding" not in k:
            assert torch.equal(v, before[k]), k
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(after)
    assert (dst / "tokenizer.json").read_text() == "{}"
    assert "ple_embedding_dtype" not in json.loads((dst / "config.json").read_text())["text_config"]
    assert scan_checkpoint(dst, PLEConfig.from_pretrained(dst)).all_problems == []
    with pytest.raises(FileExistsError):
        dequantize_checkpoint(src, dst, dtype)
    assert not (tmp_path / "dst.partial").exists()


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    os.mkfifo(src / "model.safetensors")
    failed: list[BaseException] = []

    def run():
        try:
            dequantize_checkpoint(src, tmp_path / "dst")
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            failed.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=30)
    if t.is_alive():  # blocked opening the FIFO: let it go, then fail
        os.close(os.open(src / "model.safetensors", os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout=30)
        pytest.fail("dequantize_checkpoint waited on a FIFO")
    assert len(failed) == 1 and isinstance(failed[0], CheckpointError), failed
    assert "model.safetensors is a FIFO, not a regular file" in str(failed[0])
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.partial").exists()


def test_an_index_naming_files_outside_the_folder_is_refused(tmp_path):
    save_file({"x": torch.arange(4.0)}, str(tmp_path / "outside.safetensors"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"weight_map\['x'\] = '../outside.safetensors' is not a file name"):
        dequantize_checkpoint(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists() and not (tmp_path / "dst.partial").exists()


def test_a_malformed_header_is_a_checkpoint_error(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    header = json.dumps({"x": {"dtype": "F32", "shape": [2]}}).encode()  # no data_offsets
    (src / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(CheckpointError, match="malformed safetensors header entry for 'x'"):
        dequantize_checkpoint(src, tmp_path / "dst")
    assert not (tmp_path / "dst.partial").exists()
