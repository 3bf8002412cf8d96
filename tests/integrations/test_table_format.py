"""``from_pretrained(path, table_format=...)``: a copy of each table in a block format, made once in
the table folder and reused; ``save_pretrained`` of such a model writes what transformers reads."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import Qwen4ExpForCausalLM

from ple.errors import InvalidArgumentError
from ple.integrations.transformers import from_pretrained, patched_layers, unpatch
from ple.table import MemoryTable
from tests.integrations.helpers import prompts, tiny_config, tiny_model


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny fp32 checkpoint whose table rows are 32 values (one block)."""
    model = tiny_model(tiny_config(split_ngram_parts=3, ple_embed_dim=128), seed=31)
    path = tmp_path_factory.mktemp("ckpt") / "wide"
    model.save_pretrained(path)
    return path, model


def _logits(model):
    ids, mask = prompts(seed=31)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "nvfp4"])
def test_a_block_copy_is_made_once_and_served(wide, tmp_path, fmt):
    path, reference = wide
    first = from_pretrained(path, table_dir=tmp_path / "t", table_format=fmt)
    layers = patched_layers(first)
    assert [w.prepared.action for w in layers] == ["converted", "converted"]
    assert {w.layer.table.format for w in layers} == {fmt}
    assert all(w.table_path.name.endswith(f".{fmt}.pletable") for w in layers)
    again = from_pretrained(path, table_dir=tmp_path / "t", table_format=fmt)
    assert [w.prepared.action for w in patched_layers(again)] == ["reused", "reused"]
    want, got = _logits(reference), _logits(first)
    assert 0 < (got - want).abs().max() < (0.05 if fmt == "q8_0" else 0.5) * want.abs().max()
    # the same blocks held in memory give the same logits: the file serves exactly its blocks
    for w in patched_layers(again):
        t = w.layer.table
        w.layer.set_table(MemoryTable(t.data.clone(), t.scale, format=fmt))
    torch.testing.assert_close(_logits(again), got, rtol=0, atol=0)


def test_save_pretrained_writes_dequantized_rows(wide, tmp_path):
    path, _ = wide
    model = from_pretrained(path, table_dir=tmp_path / "t", table_format="q5_1")
    want = _logits(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # saved dequantized: no ScaledTableWarning
        model.save_pretrained(tmp_path / "saved")
    plain = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "saved")
    torch.testing.assert_close(_logits(plain), want, rtol=1e-5, atol=1e-5)
    back = unpatch(model, materialize=True)
    torch.testing.assert_close(_logits(back), want, rtol=1e-5, atol=1e-5)


def test_bad_table_formats_are_refused(wide, tmp_path):
    path, _ = wide
    with pytest.raises(InvalidArgumentError, match="table_format must be one of"):
        from_pretrained(path, table_dir=tmp_path / "t", table_format="q3_k")
    with pytest.raises(InvalidArgumentError, match=r"table-file tiers \(mmap, cached, direct\)"):
        from_pretrained(path, table_tier="memory", table_format="q4_0")


def test_the_direct_tier_serves_a_block_copy(wide, tmp_path):
    """A block-format copy read with pread (the direct tier) gives the logits the mapped copy gives."""
    path, _ = wide
    mapped = from_pretrained(path, table_dir=tmp_path / "t", table_format="q4_0")
    direct = from_pretrained(path, table_dir=tmp_path / "t", table_format="q4_0", table_tier="direct")
    assert [w.prepared.action for w in patched_layers(direct)] == ["reused", "reused"]
    assert {type(w.layer.table).__name__ for w in patched_layers(direct)} == {"DirectTable"}
    assert {w.layer.table.format for w in patched_layers(direct)} == {"q4_0"}
    # the same rows, bit for bit, through the same downstream arithmetic
    torch.testing.assert_close(_logits(direct), _logits(mapped), rtol=0, atol=0)


def _nvfp4_copy(src, dst):
    """``src``'s checkpoint with every table rewritten as NVFP4 (U8 values, F8_E4M3 weight_scale per
    16 values, F32 weight_scale_2), as engines store it; returns the ple-layout blocks per table."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ple.table.formats.blocks import nvfp4_global_scale, quantize_blocks

    shutil.copytree(src, dst)
    (f,) = dst.glob("*.safetensors")
    t = load_file(f)
    made = {}
    for base in sorted({k.rsplit(".shard_", 1)[0] for k in t if ".ngram_embedding.shard_" in k}):
        names = sorted(
            (k for k in t if k.startswith(base + ".shard_")), key=lambda k: int(k.split("shard_")[1].split(".")[0])
        )
        x = torch.cat([t[k].float() for k in names])
        g = nvfp4_global_scale(float(x.abs().max()))
        q = quantize_blocks(x, "nvfp4", g)
        made[base] = (q, g)
        a = 0
        for k in names:
            n = t[k].shape[0]
            t[k] = torch.from_numpy(q[a : a + n, :16].copy())
            t[k.replace(".weight", ".weight_scale")] = torch.from_numpy(q[a : a + n, 16:].copy()).view(
                torch.float8_e4m3fn
            )
            a += n
        t[base + ".weight_scale_2"] = torch.tensor([g])
    save_file(t, f, metadata={"format": "pt"})
    return made


def test_an_nvfp4_checkpoint_loads_like_the_fp8_one(wide, tmp_path):
    path, _ = wide
    made = _nvfp4_copy(path, tmp_path / "nv")
    model = from_pretrained(tmp_path / "nv", table_dir=tmp_path / "t")
    layers = patched_layers(model)
    assert {w.layer.table.format for w in layers} == {"nvfp4"}
    for w, (q, g) in zip(layers, made.values()):
        assert np.array_equal(w.layer.table.data.numpy(), q) and float(w.layer.table.scale[0]) == np.float32(g)
    in_memory = from_pretrained(tmp_path / "nv", table_tier="memory")
    torch.testing.assert_close(_logits(in_memory), _logits(model), rtol=0, atol=0)


def test_an_nvfp4_checkpoint_saves_dequantized(wide, tmp_path):
    from ple.checkpoint import CheckpointError
    from ple.integrations.transformers import dequantize_checkpoint

    path, _ = wide
    _nvfp4_copy(path, tmp_path / "nv")
    with pytest.raises(CheckpointError, match="NVFP4 table"):
        dequantize_checkpoint(tmp_path / "nv", tmp_path / "plain")
    model = from_pretrained(tmp_path / "nv", table_dir=tmp_path / "t")
    want = _logits(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # saved dequantized: no ScaledTableWarning
        model.save_pretrained(tmp_path / "saved")
    torch.testing.assert_close(
        _logits(Qwen4ExpForCausalLM.from_pretrained(tmp_path / "saved")), want, rtol=1e-5, atol=1e-5
    )
