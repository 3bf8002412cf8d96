"""Scanning a checkpoint: which files, which PLE layers, and every problem they have, from the
safetensors headers and the few small tensors whose values decide the layout.

:func:`scan_checkpoint` reads the headers (names, dtypes, shapes, byte ranges) and the small tensors
(the hash buffers, compared with the config; the global scales, positive finite numbers), never the
table, and lists every problem it sees. :func:`check_checkpoint` raises on those problems (for the
layers asked for) and, on request, checks the dense weights' values; the loader, ``ple convert``
and ``ple verify --checkpoint`` all go through it. Pickled formats are never opened; only regular
files are read.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import re
from pathlib import Path

import torch

from ple.common.files import file_kind, read_json
from ple.common.safetensors import (
    CheckpointError,
    TensorInfo,
    TensorReader,
    clipped,
    read_checked,
    read_safetensors_header,
    read_small,
    shown_name,
)
from ple.config import ConfigError, PLEConfig
from ple.layout import Layout

__all__ = [
    "CheckpointScan",
    "INDEX_NAME",
    "LayerEntry",
    "SINGLE_NAME",
    "TABLE_SCALE",
    "TABLE_SCALE2",
    "TABLE_WEIGHT",
    "check_checkpoint",
    "checkpoint_files",
    "resolve_model",
    "scan_checkpoint",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
"""The one-file checkpoint name transformers loads first (before an index) from a model folder."""
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Layer and shard numbers: ASCII digits, at most 9 (a decoder layer or shard index beyond 10^9 is no
# index; a longer digit run, or digits of another script, leaves the name unmatched).
_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>[0-9]{1,9})\.ple\.)(?P<rest>.+)$")
_ANY_LAYER_RE = re.compile(r"^(?:.*\.)?layers\.(?P<layer>[^.]*)\.ple\.")
_SHARD_RE = re.compile(r"^ple_embedding\.ngram_embedding\.shard_(?P<k>[0-9]{1,9})\.(?P<what>weight|weight_scale)$")
TABLE_WEIGHT = "ple_embedding.ngram_embedding.weight"
TABLE_SCALE = "ple_embedding.ngram_embedding.weight_scale"
TABLE_SCALE2 = "ple_embedding.ngram_embedding.weight_scale_2"  # NVFP4's fp32 scale of the whole table
_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_DENSE = (
    "key_proj.weight",
    "value_proj.weight",
    "norm_key.weight",
    "norm_query.weight",
    "norm_conv.weight",
    "conv1d.weight",
)
_PLAIN = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_BUFFER_DTYPES = ("I64", "I32", "I16", "I8", "U8", *_FLOAT_DTYPES)
_MAX_INDEX_BYTES = 64 << 20


def _weight_map_files(root: Path, index: Path) -> list[Path]:
    """The files a ``model.safetensors.index.json`` names, each a plain file name in ``root``."""
    doc = read_json(index, "checkpoint index", _MAX_INDEX_BYTES, CheckpointError)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f'{INDEX_NAME} has no "weight_map" object mapping tensor names to files')
    names = set()
    for tensor, fname in weight_map.items():
        if not isinstance(fname, str) or not fname or "/" in fname or "\\" in fname or fname in (".", ".."):
            raise CheckpointError(
                f"{INDEX_NAME}: weight_map[{tensor!r}] = {fname!r} is not a file name in the model folder"
            )
        names.add(fname)
    return sorted(root / f for f in names)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: a folder (the files its index names, each a plain file
    name in the folder and present; else its ``*.safetensors``), its index or ``config.json``, or one
    safetensors file. Pickled weights are refused by name; raises :class:`CheckpointError` or
    ``FileNotFoundError``."""
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        raise CheckpointError(f"{path} is {file_kind(path.stat().st_mode)}, not a regular file")
    if path.is_file():
        if path.name == INDEX_NAME:
            path = path.parent
        elif path.suffix in _PICKLE_SUFFIXES:
            raise CheckpointError(
                f"{path.name}: pickled weights are refused (unpickling runs arbitrary code); convert to safetensors"
            )
        elif path.name == "config.json":
            path = path.parent
        else:
            return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    index = path / INDEX_NAME
    if os.path.lexists(index):
        files = _weight_map_files(path, index)
        pickled = [p.name for p in files if p.suffix in _PICKLE_SUFFIXES]
        if pickled:
            raise CheckpointError(
                f"{INDEX_NAME} names pickled weights ({', '.join(pickled[:3])}); they are refused "
                "(unpickling runs arbitrary code); convert to safetensors"
            )
        missing = [p.name for p in files if not p.exists()]
        if missing:
            raise CheckpointError([f"{INDEX_NAME} names missing file(s): {', '.join(missing)}"])
        single = path / SINGLE_NAME
        if os.path.lexists(single) and files != [single]:
            # transformers loads the single file when both are there: serving the index's tables
            # beside its dense weights would mix two models
            raise CheckpointError(
                f"{path} holds both {SINGLE_NAME} and {INDEX_NAME} (naming {len(files)} other file(s)): "
                f"transformers loads {SINGLE_NAME} and ignores the index; remove the one that is not this model"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    broken = []
    for f in files:
        try:
            os.stat(f)
        except OSError as e:  # a symbolic link in a loop, or to nothing
            broken.append(f"{f.name} cannot be opened: {e.strerror or e}")
    if broken:
        raise CheckpointError(broken)
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickled:
            raise CheckpointError(
                f"{path}: only pickled weights found ({', '.join(pickled[:3])}); they are refused "
                "(unpickling runs arbitrary code); convert to safetensors"
            )
        raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_NAME}")
    return files


@dataclasses.dataclass
class LayerEntry:
    """What a checkpoint holds for one PLE layer (from headers only)."""

    decoder_layer: int  # zero-indexed
    ple_layer_index: int
    prefix: str
    layout: Layout
    table_format: str | None = None
    shards: dict[int, TensorInfo] = dataclasses.field(default_factory=dict)
    shard_scales: dict[int, TensorInfo] = dataclasses.field(default_factory=dict)
    whole_table: TensorInfo | None = None
    global_scale: TensorInfo | None = None
    global_scale2: TensorInfo | None = None  # NVFP4: weight_scale_2
    buffers: dict[str, TensorInfo] = dataclasses.field(default_factory=dict)
    dense: dict[str, TensorInfo] = dataclasses.field(default_factory=dict)
    unexpected: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CheckpointScan:
    files: list[Path]
    layers: list[LayerEntry]
    problems: list[str]  # checkpoint-wide problems (files, missing layers)

    @property
    def all_problems(self) -> list[str]:
        return self.problems + [p for lay in self.layers for p in lay.problems]


def scan_checkpoint(path: str | os.PathLike, config: PLEConfig) -> CheckpointScan:
    """Check every PLE layer: names, shapes and dtypes from the safetensors headers, and the values of
    the small tensors (hash buffers equal to what the config implies, a positive finite global
    scale). The table is never read. Problems are listed, not raised (see :func:`check_checkpoint`)."""
    files = checkpoint_files(path)
    problems: list[str] = []
    by_layer: dict[int, tuple[str, dict[str, TensorInfo]]] = {}
    seen: dict[str, Path] = {}
    for fp in files:
        infos, err = read_safetensors_header(fp)
        if err:
            problems.append(err)
        for name, info in infos.items():
            m = _LAYER_RE.match(name)
            if not m:
                loose = _ANY_LAYER_RE.match(name)
                if loose:  # named like a PLE tensor, but its layer is no decoder layer number
                    problems.append(
                        f"{fp.name}: tensor {shown_name(name)}: the layer {clipped(repr(loose['layer']), 40)} is not a "
                        "decoder layer number (ASCII digits, at most 9)"
                    )
                continue
            if name in seen:
                problems.append(f"{name} appears twice: in {seen[name].name} and {fp.name}")
                continue
            seen[name] = fp
            layer = int(m["layer"])
            prefix, group = by_layer.setdefault(layer, (m["prefix"], {}))
            if m["prefix"] != prefix:
                problems.append(
                    f"decoder layer {layer} has PLE tensors under two prefixes: {prefix!r}, {m['prefix']!r}"
                )
                continue
            group[m["rest"]] = info
    ids = list(config.ple_layer_ids) or [k + 1 for k in sorted(by_layer)]
    layers: list[LayerEntry] = []
    for idx, one_based in enumerate(ids):
        dec = one_based - 1
        if dec not in by_layer:
            problems.append(
                f"PLE layer {idx} (decoder layer {dec}, ple_layer_ids[{idx}]={one_based}) has no tensors "
                f"'...layers.{dec}.ple.*' in the checkpoint"
            )
            continue
        prefix, group = by_layer[dec]
        layers.append(_scan_layer(dec, idx, prefix, group, config))
    extra = sorted(set(by_layer) - {i - 1 for i in ids})
    for dec in extra:
        problems.append(f"decoder layer {dec} has PLE tensors but is not in ple_layer_ids={list(config.ple_layer_ids)}")
    return CheckpointScan(files, layers, problems)


def _scan_layer(dec: int, idx: int, prefix: str, group: dict[str, TensorInfo], config: PLEConfig) -> LayerEntry:
    lay = config.layout(idx)
    e = LayerEntry(dec, idx, prefix, lay)
    p = e.problems.append
    for rest, info in sorted(group.items()):
        leaf = rest.rsplit(".", 1)[-1]
        m = _SHARD_RE.match(rest)
        if leaf.startswith("hashstats_") or leaf == "token_lookup":
            continue
        if m:
            k = int(m["k"])
            (e.shards if m["what"] == "weight" else e.shard_scales)[k] = info
        elif rest == TABLE_WEIGHT:
            e.whole_table = info
        elif rest == TABLE_SCALE:
            e.global_scale = info
        elif rest == TABLE_SCALE2:
            e.global_scale2 = info
        elif rest.startswith("ple_embedding.") and rest.split(".", 1)[1] in _BUFFERS:
            e.buffers[rest.split(".", 1)[1]] = info
        elif rest in _DENSE:
            e.dense[rest] = info
        else:
            e.unexpected.append(prefix + rest)
    for name in e.unexpected:
        p(f"unexpected tensor {clipped(name, 200)}")
    c, h, emb, k = config.hc_hidden_size, config.hidden_size, config.ple_embed_dim, config.ple_conv_kernel_size
    want = {
        "key_proj.weight": (c, emb),
        "value_proj.weight": (h, emb),
        "norm_key.weight": (c,),
        "norm_query.weight": (c,),
        "norm_conv.weight": (c,),
        "conv1d.weight": (c, 1, k),
    }
    for name, shape in want.items():
        dense_info = e.dense.get(name)
        if dense_info is None:
            p(f"missing {prefix}{name}")
            continue
        if dense_info.shape != shape:
            p(f"{prefix}{name}: shape {list(dense_info.shape)}, expected {list(shape)}")
        if dense_info.dtype not in _FLOAT_DTYPES:
            p(
                f"{prefix}{name}: dtype {dense_info.dtype}, expected a floating point dtype {list(_FLOAT_DTYPES)} "
                "(integer or bool weights are not converted)"
            )
    nbuf = {
        "layer_multipliers": lay.ngram_size,
        "ngram_heads_vocab_sizes": lay.num_heads,
        "ngram_heads_offsets": lay.num_heads,
    }
    for name, info in e.buffers.items():
        if info.shape != (nbuf[name],):
            p(f"{prefix}ple_embedding.{name}: shape {list(info.shape)}, expected [{nbuf[name]}]")
        if info.dtype not in _BUFFER_DTYPES:
            p(f"{prefix}ple_embedding.{name}: dtype {info.dtype}, expected integers {list(_BUFFER_DTYPES)}")
    # table
    if e.whole_table is not None and e.shards:
        p(f"{prefix}: both an unsharded {TABLE_WEIGHT} and {len(e.shards)} shard(s); expected one form")
    table_infos = [e.whole_table] if e.whole_table is not None else [e.shards[k] for k in sorted(e.shards)]
    if e.whole_table is None and not e.shards:
        p(f"missing table: no {prefix}{TABLE_WEIGHT} and no {prefix}ple_embedding.ngram_embedding.shard_*.weight")
    # an NVFP4 table (U8, two E2M1 values a byte) is half as wide
    nvfp4 = bool(table_infos) and all(i.dtype == "U8" for i in table_infos)
    width = lay.head_dim // 2 if nvfp4 else lay.head_dim
    if e.whole_table is not None and nvfp4:
        p(f"{prefix}{TABLE_WEIGHT}: an NVFP4 table is read as shards with their weight_scale, not as one tensor")
    if e.whole_table is not None and e.whole_table.shape != (lay.padded_rows, lay.head_dim):
        p(f"{prefix}{TABLE_WEIGHT}: shape {list(e.whole_table.shape)}, expected [{lay.padded_rows}, {lay.head_dim}]")
    if e.shards:
        bad = sorted(k for k in e.shards if k >= lay.split_parts)
        if bad:
            p(f"{prefix}: shard index {bad[0]} >= split_ngram_parts={lay.split_parts}")
        missing = [k for k in range(lay.split_parts) if k not in e.shards]
        if missing:
            more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
            p(f"{prefix}: missing table shard(s) {missing[:8]}{more} of {lay.split_parts}")
        for k, info in sorted(e.shards.items()):
            if k >= lay.split_parts:
                continue
            a, b = lay.shard_range(k)
            if info.shape != (b - a, width):
                p(
                    f"{prefix}ple_embedding.ngram_embedding.shard_{k}.weight: shape {list(info.shape)}, "
                    f"expected [{b - a}, {width}] (rows {a}..{b} of {lay.padded_rows})"
                )
    orphans = sorted(set(e.shard_scales) - set(e.shards))
    if orphans:
        p(f"{prefix}: weight_scale for shard(s) {orphans[:8]} without the shard's weight")
    scales = list(e.shard_scales.values()) + [g for g in (e.global_scale, e.global_scale2) if g is not None]
    bad_scale = sorted({i.dtype for i in scales} - {"F32", "BF16", "F16", "F64"} - ({"F8_E4M3"} if nvfp4 else set()))
    if bad_scale:
        p(f"{prefix}: weight_scale dtype(s) {bad_scale}, expected a floating point dtype (F32, BF16, F16)")
    dtypes = {i.dtype for i in table_infos}
    if len(dtypes) > 1:
        p(f"{prefix}: table shards have mixed dtypes {sorted(dtypes)}")
    elif dtypes:
        (dt,) = dtypes
        per_row = bool(e.shard_scales)
        if dt in _PLAIN:
            e.table_format = _PLAIN[dt]
            if e.global_scale is not None or per_row:
                p(f"{prefix}: a {dt} table carries a weight_scale; scales are only for fp8/int8 tables")
        elif dt in ("F8_E4M3", "I8"):
            if per_row and e.global_scale is not None:
                p(
                    f"{prefix}: the table has both per-row weight_scale tensors and a global {TABLE_SCALE}; "
                    "a table has one or the other"
                )
            elif per_row:
                e.table_format = "fp8_row" if dt == "F8_E4M3" else "int8_row"
                for k, info in e.shards.items():
                    s = e.shard_scales.get(k)
                    if s is None:
                        p(f"{prefix}: shard {k} is {dt} with per-row scales elsewhere but has no weight_scale")
                    elif s.shape != (info.shape[0], 1):
                        p(
                            f"{prefix}ple_embedding.ngram_embedding.shard_{k}.weight_scale: shape {list(s.shape)}, "
                            f"expected [{info.shape[0]}, 1]"
                        )
            elif dt == "F8_E4M3":
                e.table_format = "fp8"
                if e.global_scale is None:
                    p(f"{prefix}: the table is F8_E4M3 but {prefix}{TABLE_SCALE} is missing (fp8 needs its scale)")
                elif e.global_scale.shape not in ((1,), ()):
                    p(f"{prefix}{TABLE_SCALE}: shape {list(e.global_scale.shape)}, expected [1]")
            else:
                p(f"{prefix}: an I8 table needs per-row weight_scale tensors")
        elif dt == "U8":
            _scan_nvfp4(e, prefix, p)
        else:
            p(f"{prefix}: unsupported table dtype {dt}")
    if e.global_scale2 is not None and e.table_format != "nvfp4":
        p(f"{prefix}{TABLE_SCALE2} belongs to NVFP4 (U8) tables, the table is {sorted(dtypes)}")
    e.problems += _small_value_problems(e)
    return e


def _scan_nvfp4(e: LayerEntry, prefix: str, p) -> None:
    """An NVFP4 table as engines store it: U8 shards ``[n, head_dim / 2]`` (two E2M1 values a byte),
    per shard an F8_E4M3 ``weight_scale [n, head_dim / 16]``, one float ``weight_scale_2``."""
    lay = e.layout
    if lay.head_dim % 16:
        p(f"{prefix}: an NVFP4 (U8) table needs rows of a multiple of 16 values, head_dim is {lay.head_dim}")
        return
    if e.global_scale is not None:
        p(f"{prefix}: an NVFP4 table has a global {TABLE_SCALE2}, not {TABLE_SCALE}")
    if e.global_scale2 is None:
        p(f"{prefix}: the table is U8 (NVFP4) but {prefix}{TABLE_SCALE2} is missing")
    elif e.global_scale2.shape not in ((1,), ()):
        p(f"{prefix}{TABLE_SCALE2}: shape {list(e.global_scale2.shape)}, expected [1]")
    for k, info in e.shards.items():
        s = e.shard_scales.get(k)
        if s is None:
            p(f"{prefix}: shard {k} is NVFP4 (U8) but has no weight_scale")
        elif s.dtype != "F8_E4M3" or s.shape != (info.shape[0], lay.head_dim // 16):
            p(
                f"{prefix}ple_embedding.ngram_embedding.shard_{k}.weight_scale: {s.dtype} {list(s.shape)}, expected "
                f"F8_E4M3 [{info.shape[0]}, {lay.head_dim // 16}] (one E4M3 scale per 16 values)"
            )
    e.table_format = "nvfp4"


def _buffer_problem(name: str, got: list[int], want: list[int], prefix: str) -> str:
    return (
        f"{prefix}ple_embedding.{name} = {got} but the config implies {want}; a wrong or missing `seed` "
        "(default 1234) or `ngram_vocab_size_base` in config.json is the usual cause"
    )


def _small_value_problems(e: LayerEntry) -> list[str]:
    """The values of a layer's small tensors: hash buffers equal to the config's (whole numbers,
    even when stored as floats), a positive finite global scale. Tensors whose header entry is
    already wrong are skipped; one that cannot be read is a problem."""
    lay = e.layout
    want = {
        "layer_multipliers": list(lay.multipliers),
        "ngram_heads_vocab_sizes": list(lay.head_sizes),
        "ngram_heads_offsets": list(lay.head_offsets),
    }
    out = []
    for name, info in sorted(e.buffers.items()):
        if info.shape != (len(want[name]),) or info.dtype not in _BUFFER_DTYPES:
            continue
        full = f"{e.prefix}ple_embedding.{name}"
        try:
            t = read_small(info)
        except (OSError, CheckpointError) as exc:
            out.append(f"{full}: could not be read ({exc})")
            continue
        if t.is_floating_point():
            t64 = t.double()
            bad = ~torch.isfinite(t64) | (t64 != t64.round())
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                out.append(f"{full}: element {i} is {float(t64[i])}, not a whole number (hash buffers hold integers)")
                continue
            got = [int(v) for v in t64.tolist()]
        else:
            got = [int(v) for v in t.tolist()]
        if got != want[name]:
            out.append(_buffer_problem(name, got, want[name], e.prefix))
    for g, gname in ((e.global_scale, TABLE_SCALE), (e.global_scale2, TABLE_SCALE2)):
        if g is None or g.shape not in ((1,), ()) or g.dtype not in _FLOAT_DTYPES:
            continue
        try:
            read = read_small(g).reshape(-1)[0]
        except (OSError, CheckpointError) as exc:
            out.append(f"{e.prefix}{gname}: could not be read ({exc})")
        else:
            value, stored = float(read), float(read.float())  # tables keep float32 scales
            if not (math.isfinite(stored) and stored > 0):
                shown = f"{value} ({stored} as float32)" if value != stored and not math.isnan(value) else str(value)
                out.append(f"{e.prefix}{gname} = {shown}: the global scale must be a positive finite number")
    return out


def check_checkpoint(
    path: str | os.PathLike,
    config: PLEConfig,
    *,
    layers: list[int] | None = None,
    strict: bool = True,
    dense_values: bool = False,
) -> CheckpointScan:
    """The validation every reader of a checkpoint makes (the loader, ``ple convert``, ``ple verify``):
    :func:`scan_checkpoint`'s problems that concern the layers asked for (``layers``, default all)
    plus the checkpoint-wide ones, and with ``dense_values`` the dense weights read and checked
    finite. Raises :class:`CheckpointError` listing every problem; returns the scan.

    ``strict``: unexpected tensor names under a PLE prefix are problems (else ignored)."""
    scan = scan_checkpoint(path, config)
    problems = list(scan.problems)
    wanted = [e for e in scan.layers if layers is None or e.ple_layer_index in layers]
    if layers is not None:
        have = {e.ple_layer_index for e in scan.layers}
        problems += [f"PLE layer {i} requested but not in the checkpoint" for i in layers if i not in have]
    for e in wanted:
        problems += [q for q in e.problems if strict or not q.startswith("unexpected tensor")]
    if not problems and dense_values:
        with TensorReader() as reader:
            for e in wanted:
                for n, info in e.dense.items():
                    try:
                        read_checked(reader, info, e.prefix + n, info.shape)
                    except CheckpointError as exc:
                        problems += exc.problems
                    except Exception as exc:  # a file that changed or broke since the scan
                        problems.append(f"{e.prefix}{n}: reading failed: {type(exc).__name__}: {exc}")
    if problems:
        raise CheckpointError(problems)
    return scan


def resolve_model(path: str | os.PathLike, also: str = "") -> tuple[PLEConfig, Path | None]:
    """``(config, checkpoint or None)`` for a ``config.json``, a model directory, its index file or one
    of its ``.safetensors`` files. ``also``: what else the caller takes, for the message refusing
    another file.

    The checkpoint is None when the folder holds a config but no weights. Pickled weights count as
    weights, so that the reader refuses them by name instead of the folder reading as config-only.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(p))
    if not p.is_dir() and not p.is_file():
        raise ConfigError(f"{p} is {file_kind(p.stat().st_mode)}, not a regular file or a folder")
    if p.is_file() and p.name.endswith(".json") and p.name != INDEX_NAME:
        return PLEConfig.from_pretrained(p), None
    accepted = (
        "a config.json, a model folder (config.json and its safetensors files), its "
        f"{INDEX_NAME} or one of its .safetensors files" + (f", or {also}" if also else "")
    )
    if p.is_file() and p.suffix not in (".safetensors", *_PICKLE_SUFFIXES) and p.name != INDEX_NAME:
        raise ConfigError(f"{p} is not a model file: expected {accepted}")
    root = p.parent if p.is_file() else p
    if not (root / "config.json").exists():
        where = f"{p}'s folder {root.resolve()}" if p.is_file() else str(p)
        raise ConfigError(f"{where} has no config.json: expected {accepted}")
    cfg = PLEConfig.from_pretrained(root)
    has_weights = (
        p.is_file()
        or any(root.glob("*.safetensors"))
        or (root / INDEX_NAME).exists()
        or any(q.suffix in _PICKLE_SUFFIXES for q in root.iterdir())
    )
    return cfg, (p if has_weights else None)
