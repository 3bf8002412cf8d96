"""A checkpoint whose tables are NVFP4 as engines store them (U8 shards of packed E2M1 values, an
F8_E4M3 ``weight_scale`` per 16 values, one F32 ``weight_scale_2``) reads like the fp8 one: checked
by the scan, converted (copied, or to another format), loaded into memory."""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ple.checkpoint import load_ple_weights, scan_checkpoint
from ple.commands.cli import main
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig
from ple.table import MmapTable
from ple.table.formats.blocks import dequantize_blocks, nvfp4_global_scale, quantize_blocks
from ple.table.lookup import gather_dequant_reference
from tests.conftest import SMALL

WIDE = {**SMALL, "ple_embed_dim": 128}  # head_dim 32


def _to_nvfp4(ckpt, cfg):
    """Rewrite the synthesized fp8 checkpoint's tables as NVFP4; returns {layer: [rows, 18] ple bytes, g}."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    files = {f: load_file(ckpt / f) for f in sorted(set(index["weight_map"].values()))}
    every = {k: v for t in files.values() for k, v in t.items()}
    made = {}
    for i in range(cfg.num_ple_layers):
        base = cfg.layer_prefix(i) + "ple_embedding.ngram_embedding."
        lay = cfg.layout(i)
        scale = every[base + "weight_scale"].float()
        x = torch.cat([every[f"{base}shard_{k}.weight"].float() for k in range(lay.split_parts)]) * scale
        g = nvfp4_global_scale(float(x.abs().max()))
        q = quantize_blocks(x, "nvfp4", g)
        made[i] = (q, g)
        for f, t in files.items():
            if base + "weight_scale" in t:
                del t[base + "weight_scale"]
                t[base + "weight_scale_2"] = torch.tensor([g], dtype=torch.float32)
                index["weight_map"][base + "weight_scale_2"] = f
                del index["weight_map"][base + "weight_scale"]
            for k in range(lay.split_parts):
                name = f"{base}shard_{k}.weight"
                if name in t:
                    a, b = lay.shard_range(k)
                    t[name] = torch.from_numpy(q[a:b, :16].copy())
                    t[f"{base}shard_{k}.weight_scale"] = torch.from_numpy(q[a:b, 16:].copy()).view(torch.float8_e4m3fn)
                    index["weight_map"][f"{base}shard_{k}.weight_scale"] = f
    for f, t in files.items():
        save_file(t, ckpt / f)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return made


def test_an_nvfp4_checkpoint_reads_like_the_fp8_one(tmp_path, capsys):
    cfg = PLEConfig(**WIDE)
    ckpt = synthesize_checkpoint(cfg, tmp_path / "ckpt", seed=7, files=2)
    made = _to_nvfp4(ckpt, cfg)
    scan = scan_checkpoint(ckpt, cfg)
    assert scan.all_problems == [] and {e.table_format for e in scan.layers} == {"nvfp4"}
    capsys.readouterr()
    assert main(["convert", str(ckpt), str(tmp_path / "out"), "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)["layers"]
    assert [(d["source_format"], d["format"]) for d in docs] == [("nvfp4", "nvfp4")] * 2
    weights = load_ple_weights(ckpt, cfg)
    for i, f in enumerate(sorted((tmp_path / "out").glob("*.pletable"))):
        q, g = made[i]
        t = MmapTable.open(f)
        assert np.array_equal(t.data.numpy(), q) and float(t.scale[0]) == np.float32(g)
        assert main(["verify", str(f), "--checkpoint", str(ckpt)]) == 0
        mem = weights[i].table
        assert mem.format == "nvfp4" and torch.equal(mem.data, t.data)
        ids = torch.randint(0, t.rows, (9, cfg.num_heads))
        want = gather_dequant_reference(torch.from_numpy(q), torch.tensor([g]), ids, torch.bfloat16, format="nvfp4")
        assert torch.equal(mem.lookup(ids, torch.bfloat16), want) and torch.equal(t.lookup(ids, torch.bfloat16), want)
    # to another format: from the NVFP4 values
    assert main(["convert", str(ckpt), str(tmp_path / "q4"), "--to", "q4_0", "--layers", "0"]) == 0
    (f,) = (tmp_path / "q4").glob("*.pletable")
    x = dequantize_blocks(torch.from_numpy(made[0][0]), "nvfp4", made[0][1])
    assert np.array_equal(MmapTable.open(f).data.numpy(), quantize_blocks(x, "q4_0"))
    assert main(["verify", str(f), "--checkpoint", str(ckpt)]) == 0


def test_a_broken_nvfp4_checkpoint_names_its_problem(tmp_path):
    cfg = PLEConfig(**WIDE)
    ckpt = synthesize_checkpoint(cfg, tmp_path / "ckpt", seed=8, files=1)
    _to_nvfp4(ckpt, cfg)
    (f,) = ckpt.glob("*.safetensors")
    t = load_file(f)
    name = cfg.layer_prefix(1) + "ple_embedding.ngram_embedding.shard_2.weight_scale"
    t[name] = t[name].float()
    del t[cfg.layer_prefix(0) + "ple_embedding.ngram_embedding.weight_scale_2"]
    save_file(t, f)
    problems = scan_checkpoint(ckpt, cfg).all_problems
    assert any("weight_scale_2 is missing" in q for q in problems), problems
    assert any("shard_2.weight_scale: F32 [" in q and "expected F8_E4M3" in q for q in problems), problems
