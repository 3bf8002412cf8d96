"""PrefixState scanning and loading: published naming, sharded tables, formats, broken files, pickles.

Checkpoints are written here from transformers' ``Qwen4ExpTextPLELayer`` state dicts under the
published prefix (``model.language_model.layers.{i}.ple.``), the table split into
``split_ngram_parts`` shards, the names shuffled over several files with an index.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import save_file

import ple.checkpoint as ckpt
import ple.checkpoint.scan as ckpt_scan
from ple.checkpoint import (
    CheckpointError,
    iter_table_shards,
    load_ple_weights,
    read_safetensors_header,
    scan_checkpoint,
)
from ple.config import PLEConfig
from tests.conftest import hf_config, hf_ple_layer, ple_config_from_hf

PREFIX = "model.language_model.layers.{}.ple."
EMB = "ple_embedding.ngram_embedding."
TABLE = EMB + "weight"
SCALE = EMB + "weight_scale"
BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
INDEX = "model.safetensors.index.json"

# hf_config overrides. head_dim is 6 (E=24, G=4). With ngram_vocab_size_base=500 the table has
# 2056 rows padded to 2064; with base 11, 60 rows padded to 64.
GEOMETRIES = {
    "even": dict(ngram_vocab_size_base=500, split_ngram_parts=3),  # 3 x 688
    "short_last": dict(ngram_vocab_size_base=500, split_ngram_parts=5),  # 4 x 413 + 412
    "empty_tail": dict(ngram_vocab_size_base=11, split_ngram_parts=30),  # 21 x 3 + 1, then 8 empty
    "one_shard": dict(ngram_vocab_size_base=11, split_ngram_parts=1),
    "more_parts_than_rows": dict(ngram_vocab_size_base=11, split_ngram_parts=100),  # 64 x 1, then 36 empty
}


# ------------------------------------------------------------------------------------------ helpers


def shard_rows(table: torch.Tensor, layout) -> dict[int, torch.Tensor]:
    """``{k: table[shard k rows]}`` for every shard of the layout (copies; empty ones included)."""
    return {k: table[slice(*layout.shard_range(k))].clone() for k in range(layout.split_parts)}


def published_tensors(
    mod,
    layout,
    prefix: str,
    *,
    table: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    sharded: bool = True,
    buffers: bool = True,
) -> dict[str, torch.Tensor]:
    """A transformers PLE module's state dict under ``prefix`` in the published naming.

    The table ``[R_pad, D]`` (the module's, or ``table``) is split into ``layout.split_parts``
    shards ``ple_embedding.ngram_embedding.shard_{k}.weight`` (or kept whole when not ``sharded``);
    ``global_scale`` [1] becomes ``ngram_embedding.weight_scale``, ``row_scale`` [R_pad, 1] is split
    into ``shard_{k}.weight_scale``.
    """
    sd = mod.state_dict()
    out = {}
    for name, t in sd.items():
        if name == TABLE or (not buffers and name.rsplit(".", 1)[-1] in BUFFERS):
            continue
        out[prefix + name] = t.detach().clone().contiguous()
    table = sd[TABLE] if table is None else table
    if sharded:
        for k, rows in shard_rows(table, layout).items():
            out[f"{prefix}{EMB}shard_{k}.weight"] = rows
        if row_scale is not None:
            for k, s in shard_rows(row_scale, layout).items():
                out[f"{prefix}{EMB}shard_{k}.weight_scale"] = s
    else:
        assert row_scale is None
        out[prefix + TABLE] = table.detach().clone()
    if global_scale is not None:
        out[prefix + SCALE] = global_scale.reshape(1).clone()
    return out


def write_checkpoint(
    root: Path,
    tensors: dict[str, torch.Tensor],
    *,
    files: int = 3,
    seed: int = 0,
    index: bool = True,
    groups: list[list[str]] | None = None,
) -> Path:
    """Write ``tensors`` into ``files`` safetensors files (names shuffled over the files) plus
    ``model.safetensors.index.json``; ``groups`` fixes which names go in which file."""
    root.mkdir(parents=True, exist_ok=True)
    if groups is None:
        names = list(tensors)
        random.Random(seed).shuffle(names)
        groups = [names[i::files] for i in range(files)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(root / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
    if index:
        (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return root


def file_of(root: Path, name: str) -> Path:
    with open(root / INDEX) as f:
        return root / json.load(f)["weight_map"][name]


def tiny_model(geometry: str = "short_last", *, ple_layer_ids=(1,), **kw):
    """(transformers config, PLEConfig, [one Qwen4ExpTextPLELayer per PLE layer])."""
    hf = hf_config(ple_layer_ids=list(ple_layer_ids), **{**GEOMETRIES[geometry], **kw})
    mods = [hf_ple_layer(hf, i, seed=i + 1) for i in range(len(ple_layer_ids))]
    return hf, ple_config_from_hf(hf), mods


def model_tensors(cfg: PLEConfig, mods, **kw) -> dict[str, torch.Tensor]:
    out = {}
    for i, mod in enumerate(mods):
        out.update(published_tensors(mod, cfg.layout(i), PREFIX.format(cfg.ple_layer_ids[i] - 1), **kw))
    return out


def foreign_tensors(prefix: str) -> dict[str, torch.Tensor]:
    """Tensors a real checkpoint holds beside the PLE weights: other modules, and PLE statistics."""
    return {
        "model.language_model.embed_tokens.weight": torch.randn(5, 24),
        "model.language_model.layers.0.mlp.up_proj.weight": torch.randn(3, 24),
        "lm_head.weight": torch.randn(5, 24),
        prefix + "ple_embedding.hashstats_counts": torch.arange(4),
        prefix + "ple_embedding.hashstats_collisions": torch.zeros(2),
        prefix + "ple_embedding.token_lookup": torch.arange(6),
    }


def garble_large(root: Path, seed: int = 0) -> None:
    """Overwrite the bytes of every tensor but the small ones (hash buffers, global scales) with random
    bytes, in every safetensors file of ``root``; the headers stay valid."""
    rng = random.Random(seed)
    for f in root.glob("*.safetensors"):
        infos, err = read_safetensors_header(f)
        assert err is None
        raw = bytearray(f.read_bytes())
        for name, info in infos.items():
            if name.rsplit(".", 1)[-1] in BUFFERS or name.endswith(SCALE):
                continue
            raw[info.begin : info.end] = rng.randbytes(info.end - info.begin)
        f.write_bytes(bytes(raw))


def truncate(path: Path, nbytes: int) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - nbytes)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Exact bit pattern (fp8 tensors have no torch.equal on every build)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def assert_problem(problems: list[str], *parts: str) -> None:
    """One problem contains every part."""
    assert any(all(p in q for p in parts) for q in problems), f"no problem with {parts} in {problems}"


# --------------------------------------------------------------------------- geometry and naming


def test_geometries_exercise_short_and_empty_shards():
    def sizes(name):
        cfg = ple_config_from_hf(hf_config(**GEOMETRIES[name]))
        lay = cfg.layout(0)
        return lay, [b - a for a, b in (lay.shard_range(k) for k in range(lay.split_parts))]

    lay, s = sizes("even")
    assert lay.padded_rows == 2064 and s == [688] * 3
    lay, s = sizes("short_last")
    assert s == [413] * 4 + [412]
    lay, s = sizes("empty_tail")
    assert lay.padded_rows == 64 and s == [3] * 21 + [1] + [0] * 8
    lay, s = sizes("more_parts_than_rows")
    assert s == [1] * 64 + [0] * 36
    assert sum(sizes("one_shard")[1]) == 64


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_scan_finds_shards_in_numeric_order(tmp_path, geometry):
    _, cfg, (mod,) = tiny_model(geometry)
    prefix = PREFIX.format(0)
    tensors = {**model_tensors(cfg, [mod]), **foreign_tensors(prefix)}
    write_checkpoint(tmp_path, tensors, files=4, seed=len(geometry))
    scan = scan_checkpoint(tmp_path, cfg)
    assert scan.all_problems == []
    (e,) = scan.layers
    lay = cfg.layout(0)
    assert (e.ple_layer_index, e.decoder_layer, e.prefix, e.table_format) == (0, 0, prefix, "fp32")
    assert sorted(e.shards) == list(range(lay.split_parts))
    assert sorted(e.dense) == sorted(ckpt_scan._DENSE) and sorted(e.buffers) == sorted(BUFFERS)
    assert len(scan.files) == 4
    ks, rows = zip(*[(k, r) for k, r, s in iter_table_shards(e)])
    assert list(ks) == list(range(lay.split_parts))
    assert torch.equal(torch.cat(rows), mod.state_dict()[TABLE])


@pytest.mark.parametrize("how", ["dir", "index", "config", "dir_without_index", "single_file"])
def test_scan_path_forms_and_two_layers(tmp_path, how):
    _, cfg, mods = tiny_model("empty_tail", ple_layer_ids=(1, 3))
    tensors = model_tensors(cfg, mods)
    files = 1 if how == "single_file" else 3
    write_checkpoint(tmp_path, tensors, files=files, index=how != "dir_without_index")
    (tmp_path / "config.json").write_text("{}")
    path = {
        "dir": tmp_path,
        "dir_without_index": tmp_path,
        "index": tmp_path / INDEX,
        "config": tmp_path / "config.json",
        "single_file": tmp_path / "model-00001-of-00001.safetensors",
    }[how]
    scan = scan_checkpoint(path, cfg)
    assert scan.all_problems == []
    assert [(e.ple_layer_index, e.decoder_layer, e.prefix) for e in scan.layers] == [
        (0, 0, PREFIX.format(0)),
        (1, 2, PREFIX.format(2)),
    ]
    for e, mod in zip(scan.layers, mods):
        assert e.layout == cfg.layout(e.ple_layer_index)
        assert torch.equal(torch.cat([r for _, r, _ in iter_table_shards(e)]), mod.state_dict()[TABLE])


def test_scan_reads_no_table(tmp_path, monkeypatch):
    """The scan reads headers and the small tensors only: garbled tables and dense weights pass it."""
    _, cfg, mods = tiny_model("short_last")
    lay = cfg.layout(0)
    write_checkpoint(
        tmp_path, published_tensors(mods[0], lay, P0, table=_fp8_table(lay, 0), global_scale=torch.ones(1))
    )
    garble_large(tmp_path)

    def no_data(*a, **k):
        raise AssertionError("the scan read tensor data through safetensors")

    monkeypatch.setattr(ckpt.TensorReader, "get", no_data)
    monkeypatch.setattr(safetensors, "safe_open", no_data)
    assert scan_checkpoint(tmp_path, cfg).all_problems == []


def test_read_header_shapes_and_dtypes(tmp_path):
    f = tmp_path / "a.safetensors"
    save_file({"x": torch.zeros(3, 5, dtype=torch.float8_e4m3fn), "y": torch.zeros(0, 2), "z": torch.zeros(())}, str(f))
    infos, err = read_safetensors_header(f)
    assert err is None
    assert {n: (i.dtype, i.shape) for n, i in infos.items()} == {
        "x": ("F8_E4M3", (3, 5)),
        "y": ("F32", (0, 2)),
        "z": ("F32", ()),
    }


# -------------------------------------------------------------------------------- broken checkpoints

P0 = PREFIX.format(0)


def _shard(k, what="weight"):
    return f"{P0}{EMB}shard_{k}.{what}"


def _to_format(t, dtype, *, scale=None, row_scale=False):
    """Convert every shard to ``dtype``; add a global or per-row scale."""
    for name in [n for n in t if ".shard_" in n and n.endswith(".weight")]:
        t[name] = t[name].to(dtype)
        if row_scale:
            t[name + "_scale"] = torch.rand(t[name].shape[0], 1) + 0.5
    if scale is not None:
        t[P0 + SCALE] = scale


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


# short_last geometry: 5 shards of 413 (last 412) x 6; HC*H = 48, H = E = 24, K = 4.
BROKEN = {
    "missing_shard": (_drop(_shard(2)), ["missing table shard(s) [2] of 5"]),
    "missing_last_shard": (_drop(_shard(4)), ["missing table shard(s) [4] of 5"]),
    "short_shard": (_set(_shard(1), torch.zeros(412, 6)), ["shard_1.weight: shape [412, 6], expected [413, 6]"]),
    "wrong_last_shard": (_set(_shard(4), torch.zeros(413, 6)), ["shard_4.weight: shape [413, 6], expected [412, 6]"]),
    "wrong_head_dim": (_set(_shard(0), torch.zeros(413, 8)), ["shard_0.weight: shape [413, 8], expected [413, 6]"]),
    "shard_index_too_big": (_set(_shard(5), torch.zeros(0, 6)), ["shard index 5 >= split_ngram_parts=5"]),
    "mixed_dtypes": (lambda t: t.__setitem__(_shard(3), t[_shard(3)].bfloat16()), ["mixed dtypes ['BF16', 'F32']"]),
    "fp8_without_scale": (lambda t: _to_format(t, torch.float8_e4m3fn), ["F8_E4M3", "weight_scale is missing"]),
    "fp8_scale_shape": (
        lambda t: _to_format(t, torch.float8_e4m3fn, scale=torch.ones(2)),
        [f"{P0}{SCALE}: shape [2], expected [1]"],
    ),
    "plain_with_scale": (_set(P0 + SCALE, torch.ones(1)), ["F32 table carries a weight_scale"]),
    "int8_without_scale": (lambda t: _to_format(t, torch.int8), ["I8 table needs per-row weight_scale"]),
    "row_scale_missing": (
        lambda t: (_to_format(t, torch.int8, row_scale=True), t.pop(_shard(3, "weight_scale"))),
        ["shard 3 is I8 with per-row scales elsewhere but has no weight_scale"],
    ),
    "row_scale_shape": (
        lambda t: (
            _to_format(t, torch.float8_e4m3fn, row_scale=True),
            t.__setitem__(_shard(0, "weight_scale"), torch.ones(413)),
        ),
        [f"{_shard(0, 'weight_scale')}: shape [413], expected [413, 1]"],
    ),
    "row_scale_int": (
        lambda t: (
            _to_format(t, torch.int8, row_scale=True),
            t.__setitem__(_shard(2, "weight_scale"), torch.ones(413, 1, dtype=torch.int32)),
        ),
        ["weight_scale dtype(s) ['I32']"],
    ),
    "orphan_scale": (_set(_shard(7, "weight_scale"), torch.ones(3, 1)), ["weight_scale for shard(s) [7] without"]),
    "unsupported_dtype": (lambda t: _to_format(t, torch.float8_e5m2), ["unsupported table dtype F8_E5M2"]),
    "unexpected_name": (_set(P0 + "extra_proj.weight", torch.zeros(2)), [f"unexpected tensor {P0}extra_proj.weight"]),
    "missing_dense": (_drop(P0 + "value_proj.weight"), [f"missing {P0}value_proj.weight"]),
    "dense_shape": (
        _set(P0 + "key_proj.weight", torch.zeros(48, 23)),
        ["key_proj.weight: shape [48, 23], expected [48, 24]"],
    ),
    "conv_shape": (
        _set(P0 + "conv1d.weight", torch.zeros(48, 4)),
        ["conv1d.weight: shape [48, 4], expected [48, 1, 4]"],
    ),
    "buffer_shape": (
        _set(P0 + "ple_embedding.layer_multipliers", torch.ones(2, dtype=torch.int64)),
        ["ple_embedding.layer_multipliers: shape [2], expected [3]"],
    ),
    "whole_and_shards": (_set(P0 + TABLE, torch.zeros(2064, 6)), ["both an unsharded", "and 5 shard(s)"]),
    "whole_table_shape": (
        lambda t: ([t.pop(_shard(k)) for k in range(5)], t.__setitem__(P0 + TABLE, torch.zeros(2056, 6))),
        [f"{P0}{TABLE}: shape [2056, 6], expected [2064, 6]"],
    ),
    "no_table": (lambda t: [t.pop(_shard(k)) for k in range(5)], ["missing table: no", "shard_*.weight"]),
    "dense_int": (
        _set(P0 + "key_proj.weight", torch.ones(48, 24, dtype=torch.int32)),
        ["key_proj.weight: dtype I32, expected a floating point dtype", "not converted"],
    ),
    "dense_bool": (_set(P0 + "norm_key.weight", torch.ones(48, dtype=torch.bool)), ["norm_key.weight: dtype BOOL"]),
    "buffer_bool": (
        _set(P0 + "ple_embedding.ngram_heads_offsets", torch.ones(4, dtype=torch.bool)),
        ["ple_embedding.ngram_heads_offsets: dtype BOOL, expected integers"],
    ),
    "buffer_fraction": (
        _set(P0 + "ple_embedding.ngram_heads_vocab_sizes", torch.tensor([503.5, 509, 521, 523], dtype=torch.float64)),
        ["ngram_heads_vocab_sizes: element 0 is 503.5, not a whole number"],
    ),
    "buffer_float_wrong": (
        _set(P0 + "ple_embedding.ngram_heads_vocab_sizes", torch.tensor([503.0, 509, 521, 524], dtype=torch.float32)),
        ["ngram_heads_vocab_sizes = [503, 509, 521, 524] but the config implies [503, 509, 521, 523]"],
    ),
    "global_scale_zero": (
        lambda t: _to_format(t, torch.float8_e4m3fn, scale=torch.zeros(1)),
        [f"{P0}{SCALE} = 0.0: the global scale must be a positive finite number"],
    ),
    "global_scale_negative": (
        lambda t: _to_format(t, torch.float8_e4m3fn, scale=-torch.ones(1)),
        [f"{P0}{SCALE} = -1.0: the global scale must be a positive finite number"],
    ),
    "global_scale_nan": (
        lambda t: _to_format(t, torch.float8_e4m3fn, scale=torch.tensor([float("nan")])),
        [f"{P0}{SCALE} = nan: the global scale"],
    ),
    "global_scale_inf": (
        lambda t: _to_format(t, torch.float8_e4m3fn, scale=torch.tensor([float("inf")], dtype=torch.bfloat16)),
        [f"{P0}{SCALE} = inf: the global scale"],
    ),
    "row_and_global_scale": (
        lambda t: _to_format(t, torch.float8_e4m3fn, scale=torch.ones(1), row_scale=True),
        ["both per-row weight_scale tensors and a global", "one or the other"],
    ),
}


def _broken_checkpoint(tmp_path, case):
    _, cfg, mods = tiny_model("short_last")
    tensors = model_tensors(cfg, mods)
    BROKEN[case][0](tensors)
    write_checkpoint(tmp_path, tensors, seed=3)
    return cfg


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_is_reported(tmp_path, case):
    cfg = _broken_checkpoint(tmp_path, case)
    problems = scan_checkpoint(tmp_path, cfg).all_problems
    assert_problem(problems, *BROKEN[case][1])


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_refused_by_loader(tmp_path, case):
    cfg = _broken_checkpoint(tmp_path, case)
    with pytest.raises(CheckpointError) as err:
        load_ple_weights(tmp_path, cfg)
    assert_problem(err.value.problems, *BROKEN[case][1])
    assert all(p in str(err.value) for p in BROKEN[case][1])


@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_bad_per_row_scale_refused_by_loader(tmp_path, value, dtype):
    _, cfg, mods = tiny_model("short_last")
    tensors = model_tensors(cfg, mods)
    _to_format(tensors, dtype, row_scale=True)
    tensors[_shard(2, "weight_scale")][5, 0] = value
    write_checkpoint(tmp_path, tensors)
    assert scan_checkpoint(tmp_path, cfg).all_problems == []  # values of the bulk data are read by the readers
    with pytest.raises(CheckpointError, match=f"shard_2.weight_scale: the scale of row {2 * 413 + 5} is {value}"):
        load_ple_weights(tmp_path, cfg)
    assert load_ple_weights(tmp_path, cfg, with_table=False)[0].table is None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_dense_weight_refused(tmp_path, value):
    _, cfg, mods = tiny_model("short_last")
    tensors = model_tensors(cfg, mods)
    tensors[P0 + "value_proj.weight"][3, 7] = value
    write_checkpoint(tmp_path, tensors)
    want = f"{P0}value_proj.weight in .*: element \\[3, 7\\] is {value}, not finite"
    with pytest.raises(CheckpointError, match=want):
        load_ple_weights(tmp_path, cfg)
    with pytest.raises(CheckpointError, match=want):
        ckpt.check_checkpoint(tmp_path, cfg, dense_values=True)
    ckpt.check_checkpoint(tmp_path, cfg)  # headers and small tensors only: fine


def test_float_buffers_with_whole_values_load(tmp_path):
    _, cfg, (mod,) = tiny_model("short_last")
    tensors = model_tensors(cfg, [mod])
    for name in ("ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        tensors[P0 + "ple_embedding." + name] = tensors[P0 + "ple_embedding." + name].double()
    write_checkpoint(tmp_path, tensors)
    _assert_matches_module(load_ple_weights(tmp_path, cfg)[0], mod, cfg)


@pytest.mark.parametrize(
    "index, message",
    [
        ("{not json", "model.safetensors.index.json is not valid JSON"),
        ("[1, 2]", 'has no "weight_map" object'),
        ('{"weight_map": ["a"]}', 'has no "weight_map" object'),
        ('{"weight_map": {"x": 3}}', "weight_map['x'] = 3 is not a file name in the model folder"),
        ('{"weight_map": {"x": "../outside.safetensors"}}', "= '../outside.safetensors' is not a file name"),
        ('{"weight_map": {"x": "/etc/passwd"}}', "= '/etc/passwd' is not a file name"),
        ("[" * 100000 + "]" * 100000, "is not valid JSON"),
        (b"\xff\xfe{}", "is not valid JSON"),
    ],
)
def test_malformed_index(tmp_path, index, message):
    _, cfg, mods = tiny_model("short_last")
    write_checkpoint(tmp_path, model_tensors(cfg, mods))
    if isinstance(index, bytes):
        (tmp_path / INDEX).write_bytes(index)
    else:
        (tmp_path / INDEX).write_text(index)
    for fn in (scan_checkpoint, load_ple_weights):
        with pytest.raises(CheckpointError, match=re.escape(message)):
            fn(tmp_path, cfg)


def test_byte_range_disagreeing_with_shape(tmp_path):
    f = tmp_path / "model.safetensors"
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    f.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    infos, err = read_safetensors_header(f)
    assert "malformed safetensors header entry for 'x'" in err


@pytest.mark.parametrize("what", ["safetensors", "index", "direct"])
def test_fifo_is_refused_without_blocking(tmp_path, what):
    _, cfg, mods = tiny_model("short_last")
    if what == "safetensors":
        write_checkpoint(tmp_path, model_tensors(cfg, mods), index=False)
        os.mkfifo(tmp_path / "zz-model.safetensors")
        path, message = tmp_path, "zz-model.safetensors: checkpoint file .* is a FIFO, not a regular file"
    elif what == "index":
        write_checkpoint(tmp_path, model_tensors(cfg, mods), index=False)
        os.mkfifo(tmp_path / INDEX)
        path, message = tmp_path, "checkpoint index .* is a FIFO, not a regular file"
    else:
        os.mkfifo(tmp_path / "model.safetensors")
        path, message = tmp_path / "model.safetensors", "is a FIFO, not a regular file"
    for fn in (scan_checkpoint, load_ple_weights):
        with pytest.raises(CheckpointError, match=message):
            problems = fn(path, cfg).all_problems
            if problems:
                raise CheckpointError(problems)


def test_duplicate_shard_across_files(tmp_path):
    _, cfg, mods = tiny_model("short_last")
    tensors = model_tensors(cfg, mods)
    names = sorted(tensors)
    dup = _shard(2)
    a = [n for n in names[::2]] + ([dup] if dup not in names[::2] else [])
    b = [n for n in names[1::2]] + ([dup] if dup not in names[1::2] else [])
    write_checkpoint(tmp_path, tensors, groups=[a, b])
    with pytest.raises(CheckpointError) as err:
        load_ple_weights(tmp_path, cfg)
    assert_problem(err.value.problems, dup, "appears twice", "model-00001-of-00002", "model-00002-of-00002")


@pytest.mark.parametrize("cut", [1, 100])
def test_truncated_file(tmp_path, cut):
    _, cfg, mods = tiny_model("short_last")
    write_checkpoint(tmp_path, model_tensors(cfg, mods))
    victim = file_of(tmp_path, _shard(3))
    truncate(victim, cut)
    size = victim.stat().st_size
    problems = scan_checkpoint(tmp_path, cfg).all_problems
    assert_problem(problems, victim.name, "truncated: tensor data needs", f"the file has {size}")
    with pytest.raises(CheckpointError, match="truncated: tensor data needs"):
        load_ple_weights(tmp_path, cfg)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x10\x00", "not a safetensors file (only 2 bytes)"),
        ((10**6).to_bytes(8, "little") + b"{}", "header length 1000000 exceeds the file size 10"),
        ((4).to_bytes(8, "little") + b"{no}", "the safetensors header is not valid JSON"),
        ((2).to_bytes(8, "little") + b"[]", "the safetensors header is not a JSON object"),
        ((11).to_bytes(8, "little") + b'{"a": "b"}\n', "malformed safetensors header entry for 'a'"),
    ],
)
def test_not_safetensors(tmp_path, content, message):
    _, cfg, _ = tiny_model("short_last")
    (tmp_path / "model.safetensors").write_bytes(content)
    scan = scan_checkpoint(tmp_path, cfg)
    assert_problem(scan.problems, "model.safetensors: " + message)
    with pytest.raises(CheckpointError, match="model.safetensors: "):
        load_ple_weights(tmp_path, cfg)


def test_layers_missing_or_not_configured(tmp_path):
    _, cfg2, mods = tiny_model("empty_tail", ple_layer_ids=(1, 3))
    # config expects PLE on decoder layers 0 and 2; the checkpoint only has layer 0
    write_checkpoint(tmp_path / "a", published_tensors(mods[0], cfg2.layout(0), PREFIX.format(0)))
    with pytest.raises(CheckpointError) as err:
        load_ple_weights(tmp_path / "a", cfg2)
    assert_problem(err.value.problems, "PLE layer 1 (decoder layer 2, ple_layer_ids[1]=3) has no tensors")
    # the checkpoint has layers 0 and 2; the config only knows layer 0
    write_checkpoint(tmp_path / "b", model_tensors(cfg2, mods))
    cfg1 = PLEConfig(**{**cfg2.to_dict(), "ple_layer_ids": (1,)})
    with pytest.raises(CheckpointError) as err:
        load_ple_weights(tmp_path / "b", cfg1)
    assert_problem(err.value.problems, "decoder layer 2 has PLE tensors but is not in ple_layer_ids=[1]")


def test_missing_files_and_paths(tmp_path):
    _, cfg, mods = tiny_model("short_last")
    write_checkpoint(tmp_path / "m", model_tensors(cfg, mods))
    victim = file_of(tmp_path / "m", _shard(0))
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json names missing file\\(s\\): {victim.name}"):
        scan_checkpoint(tmp_path / "m", cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files and no model.safetensors.index.json"):
        load_ple_weights(tmp_path / "empty", cfg)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        scan_checkpoint(tmp_path / "nothing", cfg)


# ------------------------------------------------------------------------------------- pickles


def _evil_pickle(marker: Path) -> bytes:
    """A pickle whose loading creates the folder ``marker`` (as any unpickled .bin can run code)."""

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    return pickle.dumps({"model.language_model.layers.0.ple.key_proj.weight": Payload()})


def test_evil_pickle_would_run(tmp_path):
    control = tmp_path / "control"
    pickle.loads(_evil_pickle(control))
    assert control.exists()


@pytest.mark.parametrize("layout", ["bin_file", "pt_file", "bin_dir", "bin_index", "bin_in_index"])
def test_pickled_weights_are_refused_unopened(tmp_path, layout):
    _, cfg, mods = tiny_model("short_last")
    marker = tmp_path / "MARKER"
    root = tmp_path / "model"
    root.mkdir()
    payload = _evil_pickle(marker)
    if layout == "bin_file":
        (root / "pytorch_model.bin").write_bytes(payload)
        path = root / "pytorch_model.bin"
    elif layout == "pt_file":
        (root / "weights.pt").write_bytes(payload)
        path = root / "weights.pt"
    elif layout == "bin_dir":
        (root / "pytorch_model.bin").write_bytes(payload)
        path = root
    elif layout == "bin_index":
        (root / "pytorch_model-00001-of-00001.bin").write_bytes(payload)
        weight_map = {"model.language_model.layers.0.ple.key_proj.weight": "pytorch_model-00001-of-00001.bin"}
        (root / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
        path = root
    else:  # a safetensors index that points at a pickle
        (root / "evil.bin").write_bytes(payload)
        (root / INDEX).write_text(json.dumps({"weight_map": {"x": "evil.bin"}}))
        path = root
    for fn in (scan_checkpoint, load_ple_weights):
        with pytest.raises(CheckpointError, match="pickled weights.*refused.*convert to safetensors"):
            fn(path, cfg)
    assert not marker.exists()


def test_pickle_beside_safetensors_is_ignored(tmp_path):
    _, cfg, mods = tiny_model("short_last")
    marker = tmp_path / "MARKER"
    write_checkpoint(tmp_path, model_tensors(cfg, mods), index=False)
    (tmp_path / "pytorch_model.bin").write_bytes(_evil_pickle(marker))
    scan = scan_checkpoint(tmp_path, cfg)
    assert scan.all_problems == [] and all(f.suffix == ".safetensors" for f in scan.files)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------- loading


def _assert_matches_module(w, mod, cfg):
    sd = mod.state_dict()
    c, k = cfg.hc_hidden_size, cfg.ple_conv_kernel_size
    for name in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv"):
        got, want = getattr(w, name), sd[name + ".weight"]
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert torch.equal(w.conv1d, sd["conv1d.weight"].reshape(c, k))
    assert w.table.data.shape == sd[TABLE].shape
    assert torch.equal(w.table.data, sd[TABLE])


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_load_equals_transformers_module(tmp_path, geometry):
    _, cfg, (mod,) = tiny_model(geometry)
    tensors = {**model_tensors(cfg, [mod]), **foreign_tensors(P0)}
    write_checkpoint(tmp_path, tensors, files=3, seed=7)
    out = load_ple_weights(tmp_path, cfg)
    assert list(out) == [0]
    w = out[0]
    assert (w.ple_layer_index, w.prefix, w.layout) == (0, P0, cfg.layout(0))
    assert w.table.format == "fp32" and w.table.scale is None
    _assert_matches_module(w, mod, cfg)


@pytest.mark.parametrize("dtype, fmt", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_load_half_precision_module(tmp_path, dtype, fmt):
    hf = hf_config(ple_layer_ids=[2], num_hidden_layers=2, **GEOMETRIES["empty_tail"])
    cfg = ple_config_from_hf(hf)
    mod = hf_ple_layer(hf, 0, seed=5, dtype=dtype)
    write_checkpoint(tmp_path, published_tensors(mod, cfg.layout(0), PREFIX.format(1)), files=2)
    w = load_ple_weights(tmp_path, cfg)[0]
    assert w.prefix == PREFIX.format(1) and w.table.format == fmt and w.table.data.dtype == dtype
    _assert_matches_module(w, mod, cfg)


def test_load_two_layers_and_selection(tmp_path):
    _, cfg, mods = tiny_model("more_parts_than_rows", ple_layer_ids=(2, 3))
    write_checkpoint(tmp_path, model_tensors(cfg, mods), files=5, seed=11)
    out = load_ple_weights(tmp_path / INDEX, cfg)
    assert sorted(out) == [0, 1]
    for i, mod in enumerate(mods):
        assert out[i].prefix == PREFIX.format(i + 1)
        _assert_matches_module(out[i], mod, cfg)
    # the second layer's primes follow the first's: different tables, different layouts
    assert out[0].layout.head_sizes != out[1].layout.head_sizes
    only = load_ple_weights(tmp_path, cfg, layers=[1])
    assert list(only) == [1]
    assert torch.equal(only[1].table.data, out[1].table.data)
    with pytest.raises(CheckpointError, match="PLE layer 2 requested but not in the checkpoint"):
        load_ple_weights(tmp_path, cfg, layers=[2])


@pytest.mark.parametrize("geometry", ["short_last", "empty_tail"])
def test_load_unsharded_table(tmp_path, geometry):
    _, cfg, (mod,) = tiny_model(geometry)
    write_checkpoint(tmp_path, published_tensors(mod, cfg.layout(0), P0, sharded=False), files=2)
    _assert_matches_module(load_ple_weights(tmp_path, cfg)[0], mod, cfg)


def _fp8_table(lay, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(lay.padded_rows, lay.head_dim, generator=g) * 8).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("geometry", ["short_last", "empty_tail"])
def test_load_fp8_global_scale(tmp_path, geometry):
    _, cfg, (mod,) = tiny_model(geometry)
    lay = cfg.layout(0)
    table = _fp8_table(lay, 1)
    scale = torch.tensor([0.0371], dtype=torch.float32)
    write_checkpoint(tmp_path, published_tensors(mod, lay, P0, table=table, global_scale=scale), files=4, seed=2)
    w = load_ple_weights(tmp_path, cfg)[0]
    assert w.table.format == "fp8" and w.table.data.dtype == torch.float8_e4m3fn
    assert torch.equal(bits(w.table.data), bits(table))
    assert w.table.scale.shape == (1,) and torch.equal(w.table.scale, scale)
    assert torch.equal(w.key_proj, mod.key_proj.weight)


@pytest.mark.parametrize("fmt", ["fp8_row", "int8_row"])
@pytest.mark.parametrize("geometry", ["short_last", "empty_tail"])
def test_load_per_row_scales(tmp_path, fmt, geometry):
    _, cfg, (mod,) = tiny_model(geometry)
    lay = cfg.layout(0)
    g = torch.Generator().manual_seed(3)
    if fmt == "fp8_row":
        table = _fp8_table(lay, 2)
    else:
        table = torch.randint(-128, 128, (lay.padded_rows, lay.head_dim), generator=g, dtype=torch.int8)
    row_scale = torch.rand(lay.padded_rows, 1, generator=g) + 0.01
    write_checkpoint(tmp_path, published_tensors(mod, lay, P0, table=table, row_scale=row_scale), files=3, seed=4)
    w = load_ple_weights(tmp_path, cfg)[0]
    assert w.table.format == fmt
    assert torch.equal(bits(w.table.data), bits(table))
    assert w.table.scale.shape == (lay.padded_rows, 1) and torch.equal(w.table.scale, row_scale)


def test_buffers_are_optional(tmp_path):
    _, cfg, (mod,) = tiny_model("short_last")
    write_checkpoint(tmp_path, published_tensors(mod, cfg.layout(0), P0, buffers=False))
    assert scan_checkpoint(tmp_path, cfg).layers[0].buffers == {}
    _assert_matches_module(load_ple_weights(tmp_path, cfg)[0], mod, cfg)


def test_wrong_seed_is_named(tmp_path):
    """A checkpoint made with seed 99 read under a config.json without a seed (so 1234)."""
    hf, _, (mod,) = tiny_model("short_last", seed=99)
    write_checkpoint(tmp_path, model_tensors(ple_config_from_hf(hf), [mod]))
    d = hf.to_dict()
    del d["seed"]
    cfg = PLEConfig.from_dict(d)
    assert cfg.seed == 1234
    with pytest.raises(CheckpointError) as err:
        load_ple_weights(tmp_path, cfg)
    (problem,) = err.value.problems
    want = list(cfg.layout(0).multipliers)
    assert problem.startswith(
        f"{P0}ple_embedding.layer_multipliers = {list(mod.ple_embedding.layer_multipliers.tolist())}"
    )
    assert f"the config implies {want}" in problem and "wrong or missing `seed`" in problem
    # with the right seed the same checkpoint loads
    _assert_matches_module(load_ple_weights(tmp_path, PLEConfig.from_dict({**d, "seed": 99}))[0], mod, cfg)


def test_wrong_vocab_base_names_buffers_and_shapes(tmp_path):
    hf, cfg, (mod,) = tiny_model("short_last")
    write_checkpoint(tmp_path, model_tensors(cfg, [mod]))
    other = PLEConfig(**{**cfg.to_dict(), "ngram_vocab_size_base": 600})
    with pytest.raises(CheckpointError) as err:
        load_ple_weights(tmp_path, other)
    problems = err.value.problems
    assert_problem(
        problems, "ngram_heads_vocab_sizes = [503, 509, 521, 523]", "[601, 607, 613, 617]", "ngram_vocab_size_base"
    )
    assert_problem(problems, "ngram_heads_offsets = [0, 503, 1012, 1533]")
    assert_problem(problems, "shard_0.weight: shape [413, 6], expected")
    assert not any("layer_multipliers" in p for p in problems)


def test_unexpected_names_strict_and_lenient(tmp_path):
    _, cfg, (mod,) = tiny_model("short_last")
    tensors = {**model_tensors(cfg, [mod]), **foreign_tensors(P0), P0 + "ple_embedding.mystery": torch.zeros(3)}
    write_checkpoint(tmp_path, tensors)
    with pytest.raises(CheckpointError) as err:
        load_ple_weights(tmp_path, cfg)
    assert err.value.problems == [f"unexpected tensor {P0}ple_embedding.mystery"]  # hashstats_*, token_lookup ignored
    _assert_matches_module(load_ple_weights(tmp_path, cfg, strict=False)[0], mod, cfg)


def test_reads_one_tensor_at_a_time(tmp_path, monkeypatch):
    _, cfg, (mod,) = tiny_model("empty_tail")
    write_checkpoint(tmp_path, model_tensors(cfg, [mod]), files=3)
    lay = cfg.layout(0)
    reads = []
    orig = ckpt.TensorReader.get

    def spy(self, info, name):
        t = orig(self, info, name)
        reads.append((name, t.numel()))
        return t

    monkeypatch.setattr(ckpt.TensorReader, "get", spy)
    load_ple_weights(tmp_path, cfg)
    names = [n for n, _ in reads]
    assert len(names) == len(set(names))
    shard_reads = [(n, k) for n, k in reads if ".shard_" in n]
    assert [n for n, _ in shard_reads] == [f"{P0}{EMB}shard_{k}.weight" for k in range(lay.split_parts)]
    assert max(k for _, k in shard_reads) == lay.shard_rows * lay.head_dim


# ----------------------------------------------------------------------- atomic: failure mid-way


def _break_after_scan(monkeypatch, action):
    """Make the loader's scan succeed, then break the checkpoint before the tensors are read."""
    orig = ckpt_scan.scan_checkpoint

    def scan_then_break(path, config):
        scan = orig(path, config)
        action()
        return scan

    monkeypatch.setattr(ckpt_scan, "scan_checkpoint", scan_then_break)


@pytest.mark.parametrize("damage", ["truncate", "delete", "reshape", "retype"])
def test_failure_mid_way_returns_nothing(tmp_path, monkeypatch, damage):
    _, cfg, mods = tiny_model("short_last", ple_layer_ids=(1, 2))
    tensors = model_tensors(cfg, mods)
    last = f"{PREFIX.format(1)}{EMB}shard_4.weight"
    rest = [n for n in tensors if n != last]
    # the last shard of the last layer sits alone in the last file: everything else loads first
    write_checkpoint(tmp_path, tensors, groups=[rest[::2], rest[1::2], [last]])
    victim = file_of(tmp_path, last)

    good = load_ple_weights(tmp_path, cfg)
    snapshot = {i: (w.key_proj.clone(), w.table.data.clone()) for i, w in good.items()}

    def act():
        if damage == "truncate":
            truncate(victim, 40)
        elif damage == "delete":
            victim.unlink()
        elif damage == "reshape":
            save_file({last: torch.zeros(411, 6)}, str(victim))
        else:
            save_file({last: torch.zeros(412, 6, dtype=torch.float64)}, str(victim))

    _break_after_scan(monkeypatch, act)
    reads = []
    orig_get = ckpt.TensorReader.get
    monkeypatch.setattr(ckpt.TensorReader, "get", lambda self, i, n: reads.append(n) or orig_get(self, i, n))
    result = "untouched"
    with pytest.raises(CheckpointError) as err:
        result = load_ple_weights(tmp_path, cfg)
    assert result == "untouched"
    msg = str(err.value)
    if damage == "truncate":  # the safetensors library's error, naming the file
        assert f"{victim.name}: the safetensors library cannot read it" in msg
    elif damage == "delete":
        assert "reading failed" in msg
    else:
        assert f"{PREFIX.format(1)}{EMB}shard_4" in msg and "changed after it was scanned" in msg
    # the failure came after the first layer and most of the second had been read
    assert f"{PREFIX.format(1)}{EMB}shard_3.weight" in reads
    for i, w in good.items():
        assert torch.equal(w.key_proj, snapshot[i][0]) and torch.equal(w.table.data, snapshot[i][1])


def test_no_module_reads_pickles():
    """The checkpoint reading source never calls torch.load or pickle."""
    import ple.common.safetensors

    files = [*Path(ckpt.__file__).parent.glob("*.py"), Path(ple.common.safetensors.__file__)]
    assert len(files) >= 4
    for f in files:
        src = f.read_text()
        assert "torch.load" not in src and "pickle" not in src.replace("pickled", ""), f


# ----------------------------------------------------------------------- the public reading helpers


def test_read_header_raises_what_the_scan_lists(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"x": torch.arange(6.0).reshape(2, 3)}, str(f), metadata={"format": "pt"})
    h = ckpt.read_header(f)
    assert h.metadata == {"format": "pt"} and list(h.tensors) == ["x"]
    x = h.tensors["x"]
    assert (x.dtype, x.shape, x.nbytes) == ("F32", (2, 3), 24) and x.end == f.stat().st_size
    assert h.raw == f.read_bytes()[8 : 8 + int.from_bytes(f.read_bytes()[:8], "little")]
    header = json.dumps({"x": {"dtype": "F32", "shape": [4]}}).encode()  # no data_offsets
    f.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(CheckpointError, match="malformed safetensors header entry for 'x'"):
        ckpt.read_header(f)
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(CheckpointError, match="is a FIFO, not a regular file"):
        ckpt.read_header(tmp_path / "fifo.safetensors")


def test_checkpoint_files_keep_to_the_folder(tmp_path):
    _, cfg, mods = tiny_model("short_last")
    write_checkpoint(tmp_path / "ck", model_tensors(cfg, mods), files=2)
    files = ckpt.checkpoint_files(tmp_path / "ck")
    assert len(files) == 2 and all(f.parent == tmp_path / "ck" for f in files)
    assert ckpt.checkpoint_files(tmp_path / "ck" / INDEX) == files
    save_file({"x": torch.zeros(1)}, str(tmp_path / "outside.safetensors"))
    (tmp_path / "ck" / INDEX).write_text(json.dumps({"weight_map": {"x": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match="is not a file name in the model folder"):
        ckpt.checkpoint_files(tmp_path / "ck")


@pytest.mark.parametrize("sharded", [True, False])
def test_the_pread_reader_reads_what_safetensors_reads_and_maps_nothing(tmp_path, monkeypatch, sharded):
    """Every tensor and row range equal to safetensors' reading; a table stored as one tensor is
    streamed with pread too (safetensors, which maps the file, is never called)."""
    _, cfg, (mod,) = tiny_model("short_last")
    lay = cfg.layout(0)
    tensors = published_tensors(mod, lay, P0, sharded=sharded)
    write_checkpoint(tmp_path, tensors, files=2)
    headers = [ckpt.read_header(f) for f in ckpt.checkpoint_files(tmp_path)]
    with ckpt.PreadReader() as reader:
        for h in headers:
            for name, info in h.tensors.items():
                got = reader.get(info, name)
                assert got.dtype == tensors[name].dtype and torch.equal(got, tensors[name]), name
                if got.dim() and got.shape[0] > 3:
                    assert torch.equal(reader.rows(info, name, 1, 3), tensors[name][1:3]), name
    entry = scan_checkpoint(tmp_path, cfg).layers[0]
    assert (entry.whole_table is None) == sharded

    def no_mapping(*a, **k):
        raise AssertionError("safetensors was asked to read")

    monkeypatch.setattr(safetensors, "safe_open", no_mapping)
    with ckpt.PreadReader() as reader:
        rows = torch.cat([r for _, r, _ in iter_table_shards(entry, reader)])
        table = ckpt.load_table(entry, reader)
    assert torch.equal(rows, mod.state_dict()[TABLE]) and torch.equal(table.data, rows)


def test_the_pread_reader_refuses_a_file_changed_since_the_scan(tmp_path):
    _, cfg, (mod,) = tiny_model("short_last")
    tensors = published_tensors(mod, cfg.layout(0), P0)
    write_checkpoint(tmp_path, tensors, files=1, index=False)
    entry = scan_checkpoint(tmp_path, cfg).layers[0]
    name = f"{P0}{EMB}shard_1.weight"
    f = entry.shards[1].file
    save_file({**tensors, name: tensors[name][:-1].clone()}, str(f))  # one row fewer
    with ckpt.PreadReader() as reader:
        with pytest.raises(
            CheckpointError, match=r"shard_\d\.weight in .*: F32 .* \(the file changed after it was scanned\)"
        ):
            ckpt.load_table(entry, reader)
    truncate(f, 100)
    with ckpt.PreadReader() as reader:
        with pytest.raises(CheckpointError, match="changed after it was scanned"):
            reader.get(entry.shards[0], f"{P0}{EMB}shard_0.weight")


@pytest.mark.parametrize("value", [0.0, -2.0, float("nan")])
def test_load_table_checks_every_per_row_scale(tmp_path, value):
    _, cfg, (mod,) = tiny_model("short_last")
    lay = cfg.layout(0)
    table = _fp8_table(lay, 3)
    scale = torch.rand(lay.padded_rows, 1) + 0.5
    scale[lay.shard_range(2)[0] + 5, 0] = value
    write_checkpoint(tmp_path, published_tensors(mod, lay, P0, table=table, row_scale=scale))
    entry = scan_checkpoint(tmp_path, cfg).layers[0]
    with ckpt.PreadReader() as reader:
        with pytest.raises(
            CheckpointError, match=f"shard_2.weight_scale: the scale of row {lay.shard_range(2)[0] + 5}"
        ):
            ckpt.load_table(entry, reader)
