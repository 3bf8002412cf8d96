"""Reading PLE layers from safetensors checkpoints.

One validation for every reader. :func:`scan_checkpoint` reads the safetensors headers (names,
dtypes, shapes, byte ranges) and the few small tensors whose values decide the layout (the hash
buffers, compared with the config; the global fp8 scale, a positive finite number), never the
table, and lists every problem it sees. :func:`check_checkpoint` raises on those problems (for the
layers asked for) and, on request, checks the dense weights' values; :func:`load_ple_weights`,
``ple convert`` and ``ple verify --checkpoint`` all go through it. Values of the bulk data are
checked as they stream by whoever reads them (per-row scales and finite table rows by the loader
and the converter, the dense weights by the loader). Pickled formats are never opened; only regular files are read.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from .config import ConfigError, PLEConfig
from .errors import InvalidArgumentError, PLEError
from .files import file_kind, open_regular, parse_json, read_json, require_regular
from .layout import Layout
from .table import TABLE_SUFFIX, MemoryTable, MmapTable, convert_layer
from .table.convert import nonfinite_problem
from .table.formats import check_scale_values

__all__ = [
    "CheckpointError",
    "LayerEntry",
    "CheckpointScan",
    "PLEWeights",
    "check_checkpoint",
    "scan_checkpoint",
    "load_ple_weights",
    "iter_table_shards",
    "read_safetensors_header",
    "read_header",
    "SafetensorsHeader",
    "TensorInfo",
    "checkpoint_files",
    "load_table",
    "PreadReader",
    "SAFETENSORS_DTYPES",
    "INDEX_NAME",
    "resolve_model",
    "table_shards",
    "table_file_name",
    "write_layer_table",
    "open_layer_table",
    "TensorReader",
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
_TABLE = "ple_embedding.ngram_embedding.weight"
_TABLE_SCALE = "ple_embedding.ngram_embedding.weight_scale"
_TABLE_SCALE2 = "ple_embedding.ngram_embedding.weight_scale_2"  # NVFP4's fp32 scale of the whole table
_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_DENSE = (
    "key_proj.weight",
    "value_proj.weight",
    "norm_key.weight",
    "norm_query.weight",
    "norm_conv.weight",
    "conv1d.weight",
)

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype names -> torch dtypes (those ple reads)."""
_DTYPE_BITS: dict[str, int] = {
    **{name: 8 for name in ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")},
    **{name: 16 for name in ("I16", "U16", "F16", "BF16")},
    **{name: 32 for name in ("I32", "U32", "F32")},
    **{name: 64 for name in ("I64", "U64", "F64", "C64")},
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
"""Bits per element of every dtype a safetensors file may hold (the format's list): a header entry's
byte range is checked against its shape for each, and an unknown dtype is a malformed entry."""
_PLAIN = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_BUFFER_DTYPES = ("I64", "I32", "I16", "I8", "U8", *_FLOAT_DTYPES)
_MAX_INDEX_BYTES = 64 << 20


class CheckpointError(PLEError, ValueError):
    """A checkpoint cannot be loaded; ``problems`` lists every reason found."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("checkpoint problems:\n  - " + "\n  - ".join(self.problems))


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a safetensors file is: its file, dtype, shape, and byte range ``[begin, end)``
    in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class _PastTheEnd(ValueError):
    """A header entry whose data ends past the end of the file (``end``: its end offset in the data)."""

    def __init__(self, end: int) -> None:
        super().__init__(end)
        self.end = end


def _tensor_info(path: Path, meta, data_start: int, data_size: int) -> TensorInfo:
    """One header entry as a :class:`TensorInfo`; ValueError when it is malformed: not an object of
    ``dtype``, ``shape`` and ``data_offsets``, a dtype safetensors does not know, offsets that decrease
    or pass the end of the file's data (``data_size`` bytes), or a byte count other than the shape's."""
    if not isinstance(meta, dict):
        raise ValueError("not an object")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        raise ValueError("dtype, shape or data_offsets malformed")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in [*shape, *offsets]):
        raise ValueError("negative or non-integer sizes")
    bits = _DTYPE_BITS.get(dtype)
    if bits is None:
        raise ValueError(f"unknown dtype {dtype!r}")
    begin, end = offsets
    if begin > end:
        raise ValueError("data_offsets decrease")
    if end > data_size:
        raise _PastTheEnd(end)
    numel = 0 if 0 in shape else 1  # a zero-size tensor of any other dimensions is valid
    for d in shape if numel else ():  # stops early: a shape of huge dimensions costs no huge product
        numel *= d
        if numel * bits > 8 * data_size:
            raise ValueError(
                f"a {dtype} tensor of shape {_cut(str(shape), 100)} needs more than the file's {data_size} data bytes"
            )
    if numel * bits != 8 * (end - begin):
        raise ValueError(f"{end - begin} bytes for a {dtype} tensor of shape {_cut(str(shape), 100)}")
    return TensorInfo(path, dtype, tuple(shape), data_start + begin, data_start + end)


def _coverage_problem(path: Path, tensors: dict[str, TensorInfo], data_start: int, size: int) -> str | None:
    """Whether the tensors' byte ranges tile the file's data exactly, as safetensors requires (and its
    library checks when it opens the file): in offset order each range starts where the one before
    ends, the first at the data's start, the last at the file's end. None when they do."""
    at, last = data_start, None
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != at:
            where = f"after {_shown(last)}" if last is not None else "before the first tensor"
            if info.begin > at:
                return (
                    f"{path.name}: bytes [{at}, {info.begin}) {where} belong to no tensor "
                    "(tensor data must be contiguous)"
                )
            return f"{path.name}: tensor {_shown(name)} at bytes [{info.begin}, {info.end}) overlaps {_shown(last)}"
        at, last = info.end, name
    if at != size:
        return (
            f"{path.name}: {size - at} bytes after the end of the tensor data (byte {at}; the file has {size}): "
            "a damaged or foreign file"
        )
    return None


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shown(name: str | None) -> str:
    """A tensor name for a message: quoted, a long one cut short."""
    return _cut(repr(name), 120)


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed safetensors header: ``tensors`` by name (absolute byte ranges), ``metadata``, and
    the raw header bytes (whose digest identifies the file's layout cheaply)."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    raw: bytes


def _parse_header(fd: int, path: Path) -> tuple[SafetensorsHeader, str | None]:
    """The header of the open safetensors file ``fd``, and a problem (malformed, truncated, tensor data
    that does not tile the rest of the file) or None; with a problem the header holds the entries
    read before it."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        return SafetensorsHeader(path, {}, {}, b""), f"{path.name}: not a safetensors file (only {size} bytes)"
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8 or n > 100_000_000:
        return SafetensorsHeader(path, {}, {}, b""), (
            f"{path.name}: header length {n} exceeds the file size {size} (truncated or not safetensors)"
        )
    blob = os.pread(fd, n, 8)
    if len(blob) != n:
        return SafetensorsHeader(path, {}, {}, b""), f"{path.name}: truncated inside its header"
    out: dict[str, TensorInfo] = {}
    try:
        header = parse_json(blob, f"{path.name}: the safetensors header", CheckpointError)
    except CheckpointError as e:
        return SafetensorsHeader(path, out, {}, blob), str(e.problems[0])
    if not isinstance(header, dict):
        return SafetensorsHeader(path, out, {}, blob), f"{path.name}: the safetensors header is not a JSON object"
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return SafetensorsHeader(path, out, {}, blob), (
            f"{path.name}: malformed safetensors __metadata__ (not an object of strings)"
        )
    data_start = 8 + n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            info = _tensor_info(path, meta, data_start, size - data_start)
        except _PastTheEnd as exc:
            problem = f"{path.name}: truncated: tensor data needs {data_start + exc.end} bytes, the file has {size}"
            return SafetensorsHeader(path, out, metadata, blob), problem
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            why = f" ({exc})" if isinstance(exc, ValueError) else ""
            problem = (
                f"{path.name}: malformed safetensors header entry for {_shown(name)}: {_cut(repr(meta), 200)}{why}"
            )
            return SafetensorsHeader(path, out, metadata, blob), problem
        out[name] = info
    return SafetensorsHeader(path, out, metadata, blob), _coverage_problem(path, out, data_start, size)


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The header of a safetensors file (only the header is read). Raises :class:`CheckpointError`
    for anything but a regular file with a sound header whose byte ranges fit in the file."""
    path = Path(path)
    fd = open_regular(path, "checkpoint file", CheckpointError)
    try:
        header, problem = _parse_header(fd, path)
    finally:
        os.close(fd)
    if problem:
        raise CheckpointError(problem)
    return header


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], str | None]:
    """Tensor names -> info from a safetensors header, and a problem string (not a regular file,
    malformed, truncated) or None; with a problem, the entries read before it."""
    try:
        fd = open_regular(path, "checkpoint file", CheckpointError)
    except CheckpointError as e:
        return {}, f"{path.name}: {e.problems[0]}"
    try:
        header, problem = _parse_header(fd, path)
    finally:
        os.close(fd)
    return header.tensors, problem


def _read_small(info: TensorInfo) -> torch.Tensor:
    """A small tensor (a hash buffer, a global scale) read straight from its byte range."""
    fd = open_regular(info.file, "checkpoint file", CheckpointError)
    try:
        n = info.end - info.begin
        blob = os.pread(fd, n, info.begin)
    finally:
        os.close(fd)
    if len(blob) != n:
        raise CheckpointError(f"{info.file.name}: truncated at byte {info.begin + len(blob)}")
    dtype = SAFETENSORS_DTYPES[info.dtype]
    flat = torch.frombuffer(bytearray(blob), dtype=dtype) if n else torch.empty(0, dtype=dtype)
    return flat.reshape(info.shape)


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
                        f"{fp.name}: tensor {_shown(name)}: the layer {_cut(repr(loose['layer']), 40)} is not a "
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
        elif rest == _TABLE:
            e.whole_table = info
        elif rest == _TABLE_SCALE:
            e.global_scale = info
        elif rest == _TABLE_SCALE2:
            e.global_scale2 = info
        elif rest.startswith("ple_embedding.") and rest.split(".", 1)[1] in _BUFFERS:
            e.buffers[rest.split(".", 1)[1]] = info
        elif rest in _DENSE:
            e.dense[rest] = info
        else:
            e.unexpected.append(prefix + rest)
    for name in e.unexpected:
        p(f"unexpected tensor {_cut(name, 200)}")
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
        p(f"{prefix}: both an unsharded {_TABLE} and {len(e.shards)} shard(s); expected one form")
    table_infos = [e.whole_table] if e.whole_table is not None else [e.shards[k] for k in sorted(e.shards)]
    if e.whole_table is None and not e.shards:
        p(f"missing table: no {prefix}{_TABLE} and no {prefix}ple_embedding.ngram_embedding.shard_*.weight")
    # an NVFP4 table (U8, two E2M1 values a byte) is half as wide
    nvfp4 = bool(table_infos) and all(i.dtype == "U8" for i in table_infos)
    width = lay.head_dim // 2 if nvfp4 else lay.head_dim
    if e.whole_table is not None and nvfp4:
        p(f"{prefix}{_TABLE}: an NVFP4 table is read as shards with their weight_scale, not as one tensor")
    if e.whole_table is not None and e.whole_table.shape != (lay.padded_rows, lay.head_dim):
        p(f"{prefix}{_TABLE}: shape {list(e.whole_table.shape)}, expected [{lay.padded_rows}, {lay.head_dim}]")
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
                    f"{prefix}: the table has both per-row weight_scale tensors and a global {_TABLE_SCALE}; "
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
                    p(f"{prefix}: the table is F8_E4M3 but {prefix}{_TABLE_SCALE} is missing (fp8 needs its scale)")
                elif e.global_scale.shape not in ((1,), ()):
                    p(f"{prefix}{_TABLE_SCALE}: shape {list(e.global_scale.shape)}, expected [1]")
            else:
                p(f"{prefix}: an I8 table needs per-row weight_scale tensors")
        elif dt == "U8":
            _scan_nvfp4(e, prefix, p)
        else:
            p(f"{prefix}: unsupported table dtype {dt}")
    if e.global_scale2 is not None and e.table_format != "nvfp4":
        p(f"{prefix}{_TABLE_SCALE2} belongs to NVFP4 (U8) tables, the table is {sorted(dtypes)}")
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
        p(f"{prefix}: an NVFP4 table has a global {_TABLE_SCALE2}, not {_TABLE_SCALE}")
    if e.global_scale2 is None:
        p(f"{prefix}: the table is U8 (NVFP4) but {prefix}{_TABLE_SCALE2} is missing")
    elif e.global_scale2.shape not in ((1,), ()):
        p(f"{prefix}{_TABLE_SCALE2}: shape {list(e.global_scale2.shape)}, expected [1]")
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
            t = _read_small(info)
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
    for g, gname in ((e.global_scale, _TABLE_SCALE), (e.global_scale2, _TABLE_SCALE2)):
        if g is None or g.shape not in ((1,), ()) or g.dtype not in _FLOAT_DTYPES:
            continue
        try:
            read = _read_small(g).reshape(-1)[0]
        except (OSError, CheckpointError) as exc:
            out.append(f"{e.prefix}{gname}: could not be read ({exc})")
        else:
            value, stored = float(read), float(read.float())  # tables keep float32 scales
            if not (math.isfinite(stored) and stored > 0):
                shown = f"{value} ({stored} as float32)" if value != stored and not math.isnan(value) else str(value)
                out.append(f"{e.prefix}{gname} = {shown}: the global scale must be a positive finite number")
    return out


# ---------------------------------------------------------------------------------------------- loading


@dataclasses.dataclass
class PLEWeights:
    """Everything one PLE layer needs, loaded. ``table`` is a :class:`ple.table.Table`."""

    ple_layer_index: int
    prefix: str
    layout: Layout
    key_proj: torch.Tensor  # [HC*H, E]
    value_proj: torch.Tensor  # [H, E]
    norm_key: torch.Tensor  # [HC*H]
    norm_query: torch.Tensor  # [HC*H]
    norm_conv: torch.Tensor  # [HC*H]
    conv1d: torch.Tensor  # [HC*H, K]
    table: object  # None when loaded with ``with_table=False``


class TensorReader:
    """Reads checkpoint tensors one at a time, keeping one open safetensors handle per file (the
    files are mapped: pages a read touched stay resident until :meth:`close`). For reads that map
    nothing, use :class:`PreadReader`.

    Only regular files are opened; whatever the safetensors library refuses (a file that changed
    since it was scanned, a damaged header) raises :class:`CheckpointError` naming the file."""

    def __init__(self):
        self._handles = {}

    def _handle(self, file: Path):
        from safetensors import safe_open

        h = self._handles.get(file)
        if h is None:
            require_regular(file, "checkpoint file", CheckpointError)
            h = self._handles[file] = _safetensors_call(file, safe_open, str(file), framework="pt")
        return h

    def get(self, info: TensorInfo, name: str) -> torch.Tensor:
        """The tensor ``name`` of ``info.file``."""
        return _safetensors_call(info.file, lambda: self._handle(info.file).get_tensor(name))

    def rows(self, info: TensorInfo, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (along the first dimension) of the tensor ``name`` of ``info.file``."""
        return _safetensors_call(info.file, lambda: self._handle(info.file).get_slice(name)[start:stop])

    def close(self):
        self._handles.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _safetensors_call(file: Path, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a call into the safetensors library; what the library raises becomes a
    :class:`CheckpointError` naming ``file``."""
    from safetensors import SafetensorError

    try:
        return fn(*args, **kwargs)
    except SafetensorError as e:
        raise CheckpointError(f"{file.name}: the safetensors library cannot read it: {e}") from None


class PreadReader(TensorReader):
    """A :class:`TensorReader` that reads each tensor (or rows of one) with ``pread`` into a fresh
    buffer: nothing is mapped, so streaming a table shard by shard keeps the process's resident
    memory at one shard. Files are opened as regular files only (:func:`ple.files.open_regular`),
    once each; the header is read again at the first read of a file, and a tensor whose name, dtype,
    shape or byte range differ from the ``info`` given (the scan's) raises :class:`CheckpointError`
    (the file changed after it was scanned), as does a file cut short."""

    def __init__(self) -> None:
        super().__init__()
        self._files: dict[Path, tuple[int, SafetensorsHeader]] = {}

    def _open(self, file: Path) -> tuple[int, SafetensorsHeader]:
        got = self._files.get(file)
        if got is None:
            fd = open_regular(file, "checkpoint file", CheckpointError)
            try:
                header, problem = _parse_header(fd, file)
                if problem:
                    raise CheckpointError(f"{problem} (the file changed after it was scanned)")
            except BaseException:
                os.close(fd)
                raise
            got = self._files[file] = (fd, header)
        return got

    def _checked(self, info: TensorInfo, name: str) -> int:
        """The descriptor of ``info.file`` once its header says what ``info`` says of ``name``."""
        fd, header = self._open(info.file)
        now = header.tensors.get(name)
        if now is None:
            raise CheckpointError(f"{info.file.name}: no tensor {name!r} (the file changed after it was scanned)")
        if (now.dtype, now.shape, now.begin, now.end) != (info.dtype, info.shape, info.begin, info.end):
            raise CheckpointError(
                f"{name} in {info.file.name}: {now.dtype} {list(now.shape)} at bytes [{now.begin}, {now.end}), "
                f"expected {info.dtype} {list(info.shape)} at [{info.begin}, {info.end}) "
                "(the file changed after it was scanned)"
            )
        return fd

    def raw(self, info: TensorInfo, name: str, start: int = 0, stop: int | None = None) -> bytearray:
        """Bytes ``[start, stop)`` of tensor ``name``'s data (offsets within the tensor; default all),
        whatever its dtype."""
        fd = self._checked(info, name)
        stop = info.nbytes if stop is None else stop
        if not 0 <= start <= stop <= info.nbytes:
            raise InvalidArgumentError(f"bytes [{start}, {stop}) outside {name}'s {info.nbytes} bytes")
        return _pread_exact(fd, stop - start, info.begin + start, info.file)

    def get(self, info: TensorInfo, name: str) -> torch.Tensor:
        return _as_tensor(self.raw(info, name), info, name, info.shape)

    def rows(self, info: TensorInfo, name: str, start: int, stop: int) -> torch.Tensor:
        n = info.shape[0] if info.shape else 1
        if not 0 <= start <= stop <= n or not info.shape:
            raise InvalidArgumentError(f"rows [{start}, {stop}) outside {name}'s shape {list(info.shape)}")
        row = info.nbytes // n if n else 0
        shape = (stop - start, *info.shape[1:])
        return _as_tensor(self.raw(info, name, start * row, stop * row), info, name, shape)

    def __enter__(self) -> PreadReader:
        return self

    def close(self) -> None:
        files, self._files = self._files, {}
        for fd, _ in files.values():
            os.close(fd)
        super().close()


def _pread_exact(fd: int, n: int, offset: int, path: Path) -> bytearray:
    """``n`` bytes at ``offset`` of ``fd`` (the file ``path``) into a fresh buffer; a file that ends
    first raises :class:`CheckpointError`."""
    buf = bytearray(n)
    view = memoryview(buf)
    done = 0
    while done < n:
        k = os.preadv(fd, [view[done:]], offset + done)
        if k <= 0:
            raise CheckpointError(
                f"{path.name} ends at byte {offset + done}, {n - done} bytes before the end of the range read "
                "(it was cut short after it was scanned)"
            )
        done += k
    return buf


def _as_tensor(buf: bytearray, info: TensorInfo, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = SAFETENSORS_DTYPES.get(info.dtype)
    if t is None:
        raise CheckpointError(f"{name} in {info.file.name}: unsupported safetensors dtype {info.dtype}")
    if not buf:
        return torch.empty(shape, dtype=t)
    return torch.frombuffer(buf, dtype=torch.uint8).view(t).reshape(shape)


def iter_table_shards(
    entry: LayerEntry, reader: TensorReader | None = None
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """Yield ``(k, rows [n_k, head_dim], per_row_scale [n_k, 1] | None)`` shard by shard, in order,
    read through ``reader`` (default: a :class:`TensorReader` of its own).

    An unsharded table is yielded in slices of ``shard_rows`` rows (so memory stays bounded by one shard).
    """
    own = reader is None
    reader = reader or TensorReader()
    try:
        lay = entry.layout
        if entry.whole_table is not None:
            for k in range(lay.split_parts):
                a, b = lay.shard_range(k)
                yield k, reader.rows(entry.whole_table, entry.prefix + _TABLE, a, b), None
            return
        for k in range(lay.split_parts):
            info = entry.shards[k]
            base = f"{entry.prefix}ple_embedding.ngram_embedding.shard_{k}"
            rows = reader.get(info, base + ".weight")
            scale = reader.get(entry.shard_scales[k], base + ".weight_scale") if k in entry.shard_scales else None
            if entry.table_format == "nvfp4" and scale is not None:
                # ple's nvfp4 row: the packed values, then the row's E4M3 block scales
                rows, scale = torch.cat([rows.view(torch.uint8), scale.view(torch.uint8)], dim=1), None
            yield k, rows, scale
    finally:
        if own:
            reader.close()


def _read_checked(reader: TensorReader, info: TensorInfo, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Read one tensor and insist on the shape and dtype its header promised (the file may have
    changed since the scan; ``copy_`` would otherwise broadcast or convert silently)."""
    t = reader.get(info, name)
    want_dtype = SAFETENSORS_DTYPES.get(info.dtype)
    if tuple(t.shape) != shape or (want_dtype is not None and t.dtype != want_dtype):
        raise CheckpointError(
            f"{name} in {info.file.name}: read {list(t.shape)} {t.dtype}, expected {list(shape)} {want_dtype} "
            "(the file changed after it was scanned)"
        )
    if t.is_floating_point():
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            where = [int(v) for v in bad.nonzero()[0]]
            raise CheckpointError(
                f"{name} in {info.file.name}: element {where} is {float(t[tuple(where)])}, not finite"
            )
    return t


def load_table(
    e: LayerEntry,
    reader: TensorReader | None = None,
    *,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> MemoryTable:
    """PLE layer ``e``'s table (an entry of a scan without problems), read shard by shard through
    ``reader`` (default: a :class:`TensorReader` of its own; :class:`PreadReader` maps nothing)
    into a fresh :class:`~ple.table.MemoryTable` ``[padded_rows, head_dim]`` on ``device``, in the
    checkpoint's format. Every shard must have the shape and dtype the scan found, every scale must
    be a positive finite number; :class:`CheckpointError` otherwise (the file changed after it was
    scanned, or holds bad scales)."""
    if reader is None:
        with TensorReader() as own:
            return load_table(e, own, device=device, progress=progress)
    lay = e.layout
    assert e.table_format is not None  # a scan without problems found the format
    table = MemoryTable.empty(lay.padded_rows, lay.head_dim, e.table_format, device=device)
    data, tscale = table.data, table.scale
    shard_iter: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]] = iter_table_shards(e, reader)
    if progress:
        from tqdm.auto import tqdm

        shard_iter = tqdm(shard_iter, total=lay.split_parts, desc=f"PLE layer {e.ple_layer_index}", unit="shard")
    width = data.shape[1]
    for sk, rows, scale in shard_iter:
        a, b = lay.shard_range(sk)
        name = f"{e.prefix}ple_embedding.ngram_embedding.shard_{sk}"
        if tuple(rows.shape) != (b - a, width) or rows.dtype != data.dtype:
            raise CheckpointError(
                f"{name}: read {list(rows.shape)} {rows.dtype}, expected [{b - a}, {width}] "
                f"{data.dtype} (the file changed after it was scanned)"
            )
        problem = nonfinite_problem(sk, rows, a)
        if problem:  # a NaN row (an fp8 NaN byte included) would be served as it is
            raise CheckpointError(f"{name}: {problem}")
        data[a:b].copy_(rows)
        if scale is not None and tscale is not None:
            if tuple(scale.shape) != (b - a, 1):
                raise CheckpointError(
                    f"{name}.weight_scale: read {list(scale.shape)}, expected [{b - a}, 1] "
                    "(the file changed after it was scanned)"
                )
            _check_scale(scale, f"{name}.weight_scale", a)
            tscale[a:b].copy_(scale)
        del rows, scale
    if e.table_format == "fp8" and tscale is not None and e.global_scale is not None:
        gscale = reader.get(e.global_scale, e.prefix + _TABLE_SCALE).reshape(1).float()
        _check_scale(gscale, e.prefix + _TABLE_SCALE, 0)
        tscale.copy_(gscale)
    if e.table_format == "nvfp4" and tscale is not None and e.global_scale2 is not None:
        gscale = reader.get(e.global_scale2, e.prefix + _TABLE_SCALE2).reshape(1).float()
        _check_scale(gscale, e.prefix + _TABLE_SCALE2, 0)
        tscale.copy_(gscale)
    return table


def _check_scale(scale: torch.Tensor, name: str, first_row: int) -> None:
    try:
        check_scale_values(scale, name, first_row=first_row)
    except InvalidArgumentError as exc:
        raise CheckpointError(str(exc)) from None


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
                        _read_checked(reader, info, e.prefix + n, info.shape)
                    except CheckpointError as exc:
                        problems += exc.problems
                    except Exception as exc:  # a file that changed or broke since the scan
                        problems.append(f"{e.prefix}{n}: reading failed: {type(exc).__name__}: {exc}")
    if problems:
        raise CheckpointError(problems)
    return scan


def load_ple_weights(
    path: str | os.PathLike,
    config: PLEConfig,
    *,
    layers: list[int] | None = None,
    device: str | torch.device = "cpu",
    strict: bool = True,
    progress: bool = False,
    with_table: bool = True,
) -> dict[int, PLEWeights]:
    """Load PLE layers (``{ple_layer_index: PLEWeights}``) from a safetensors file or directory.

    The checkpoint is validated first (:func:`check_checkpoint`); then tensors are read one at a
    time, the table shard by shard into a freshly allocated :class:`ple.table.MemoryTable`, every
    dense weight checked finite and every scale a positive finite number as it is read. Nothing is
    returned (and no caller state is touched) unless every layer loaded; any failure raises
    :class:`CheckpointError`.

    Args:
        layers: ``ple_layer_index`` values to load (default: all).
        strict: unexpected tensor names under a PLE prefix are an error (else ignored).
        with_table: False reads everything but the table (``PLEWeights.table`` is None), for
            tables served from another tier (e.g. a table file made by ``ple convert``).
    """
    scan = check_checkpoint(path, config, layers=layers, strict=strict)
    wanted = [e for e in scan.layers if layers is None or e.ple_layer_index in layers]
    reader = TensorReader()
    out: dict[int, PLEWeights] = {}
    try:
        c, k = config.hc_hidden_size, config.ple_conv_kernel_size
        for e in wanted:
            lay = e.layout
            dense = {n: _read_checked(reader, i, e.prefix + n, i.shape).to(device) for n, i in e.dense.items()}
            table = load_table(e, reader, device=device, progress=progress) if with_table else None
            out[e.ple_layer_index] = PLEWeights(
                ple_layer_index=e.ple_layer_index,
                prefix=e.prefix,
                layout=lay,
                key_proj=dense["key_proj.weight"],
                value_proj=dense["value_proj.weight"],
                norm_key=dense["norm_key.weight"],
                norm_query=dense["norm_query.weight"],
                norm_conv=dense["norm_conv.weight"],
                conv1d=dense["conv1d.weight"].reshape(c, k),
                table=table,
            )
    except CheckpointError:
        raise
    except Exception as exc:  # a file changed or broke under us: report it as a checkpoint problem
        raise CheckpointError([f"reading failed: {type(exc).__name__}: {exc}"]) from exc
    finally:
        reader.close()
    return out


# ---------------------------------------------------------------------------------------------- paths and table files


def resolve_model(path: str | os.PathLike) -> tuple[PLEConfig, Path | None]:
    """``(config, checkpoint or None)`` for a ``config.json``, a model directory or an index file.

    The checkpoint is None when the folder holds a config but no weights. Pickled weights count as
    weights, so that the reader refuses them by name instead of the folder reading as config-only.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such file or directory: {p}")
    if not p.is_dir() and not p.is_file():
        raise ConfigError(f"{p} is {file_kind(p.stat().st_mode)}, not a regular file or a folder")
    if p.is_file() and p.name.endswith(".json") and p.name != INDEX_NAME:
        return PLEConfig.from_pretrained(p), None
    root = p.parent if p.is_file() else p
    if not (root / "config.json").exists():
        raise ConfigError(f"{root} has no config.json")
    cfg = PLEConfig.from_pretrained(root)
    has_weights = (
        p.is_file()
        or any(root.glob("*.safetensors"))
        or (root / INDEX_NAME).exists()
        or any(q.suffix in _PICKLE_SUFFIXES for q in root.iterdir())
    )
    return cfg, (p if has_weights else None)


def table_shards(
    entry: LayerEntry, reader: TensorReader | None = None
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """A layer's table shard by shard as :func:`ple.table.convert_layer` takes them: ``(k, rows
    [n_k, head_dim], scale)`` where ``scale`` is the shard's per-row scale or, for an fp8 table, the
    global scale ``[1]`` (None for plain tables)."""
    own = reader is None
    reader = reader or TensorReader()
    try:
        gscale = None
        if entry.table_format == "fp8" and entry.global_scale is not None:
            gscale = reader.get(entry.global_scale, entry.prefix + _TABLE_SCALE).reshape(1).float()
        if entry.table_format == "nvfp4" and entry.global_scale2 is not None:
            gscale = reader.get(entry.global_scale2, entry.prefix + _TABLE_SCALE2).reshape(1).float()
        for k, rows, scale in iter_table_shards(entry, reader):
            yield k, rows, (gscale if scale is None else scale)
    finally:
        if own:
            reader.close()


def table_file_name(prefix: str, format: str | None = None) -> str:
    """The table file name ``ple convert`` gives a PLE layer with this checkpoint prefix (with
    ``format``: the name of a copy in that format, beside the checkpoint-format one)."""
    stem = prefix.rstrip(".").replace("/", "_")
    return stem + ("" if format is None else "." + format) + TABLE_SUFFIX


def write_layer_table(
    shards: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]],
    path: str | os.PathLike,
    config: PLEConfig,
    ple_layer_index: int,
    *,
    to: str | None = None,
    force: bool = False,
    progress: bool = False,
    global_scale: float | None = None,
) -> dict:
    """Write PLE layer ``ple_layer_index``'s table, from ``(k, rows, scale)`` shards (any source: a
    checkpoint's :func:`table_shards`, slices of an in-memory weight), as a table file carrying the
    layer's layout fields. ``to="nvfp4"`` needs ``global_scale``. Returns
    :func:`ple.table.convert_layer`'s statistics."""
    lay = config.layout(ple_layer_index)
    return convert_layer(
        shards,
        path,
        config.layout_fields(ple_layer_index),
        lay.padded_rows,
        lay.head_dim,
        lay.shard_rows,
        to=to,
        force=force,
        progress=progress,
        head_ranges=[(o, o + n) for o, n in zip(lay.head_offsets, lay.head_sizes)],
        global_scale=global_scale,
    )


def open_layer_table(
    path: str | os.PathLike, config: PLEConfig, ple_layer_index: int, *, random_access: bool = True
) -> MmapTable:
    """Map a table file, refusing one made for another layer or layout than ``config``'s layer
    ``ple_layer_index``."""
    return MmapTable.open(path, config.layout_fields(ple_layer_index), random_access=random_access)
