"""``dequantize_checkpoint``: a copy whose quantized PLE tables are dequantized exactly as ple's lookup
dequantizes them, every other tensor and file unchanged; the ``pread`` reader reads what safetensors reads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ple.checkpoint import load_ple_weights, scan_checkpoint
from ple.config import PLEConfig
from ple.demo import synthesize_checkpoint
from ple.integrations.checkpoints import PreadReader, checkpoint_files, dequantize_checkpoint

SMALL = dict(
    hidden_size=32,
    hc_count=2,
    ple_layer_ids=(2, 3),
    ple_embed_dim=32,
    ngram_size=3,
    heads_per_ngram=2,
    vocab_size=500,
    ngram_vocab_size_base=700,
    make_ngram_vocab_size_divisible_by=64,
    split_ngram_parts=7,
    eos_token_id=2,
)


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


def test_the_pread_reader_reads_what_safetensors_reads(tmp_path):
    cfg = PLEConfig(**SMALL)
    src = synthesize_checkpoint(cfg, tmp_path / "src", seed=8, files=2)
    with PreadReader() as reader:
        for f in checkpoint_files(src):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    got, want = reader.read(f, k), h.get_tensor(k)
                    assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), k
