"""Reading PLE layers from safetensors checkpoints.

Two steps: :func:`scan_checkpoint` reads only the safetensors headers (names, dtypes, shapes, byte
ranges) and lists every problem it can see; :func:`load_ple_weights` then streams the tensors one at
a time into fresh buffers (the table shard by shard) and hands them over only when everything
loaded. Pickled formats are never opened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from .config import ConfigError, PLEConfig
from .errors import PLEError
from .layout import Layout
from .table import TABLE_SUFFIX, MemoryTable, MmapTable, convert_layer

__all__ = [
    "CheckpointError",
    "LayerEntry",
    "CheckpointScan",
    "PLEWeights",
    "scan_checkpoint",
    "load_ple_weights",
    "iter_table_shards",
    "read_safetensors_header",
    "resolve_model",
    "table_shards",
    "table_file_name",
    "write_layer_table",
    "open_layer_table",
    "TensorReader",
]

INDEX_NAME = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.ple\.)(?P<rest>.+)$")
_SHARD_RE = re.compile(r"^ple_embedding\.ngram_embedding\.shard_(?P<k>\d+)\.(?P<what>weight|weight_scale)$")
_TABLE = "ple_embedding.ngram_embedding.weight"
_TABLE_SCALE = "ple_embedding.ngram_embedding.weight_scale"
_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_DENSE = (
    "key_proj.weight",
    "value_proj.weight",
    "norm_key.weight",
    "norm_query.weight",
    "norm_conv.weight",
    "conv1d.weight",
)

_ST_DTYPES = {
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
_PLAIN = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


class CheckpointError(PLEError, ValueError):
    """A checkpoint cannot be loaded; ``problems`` lists every reason found."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("checkpoint problems:\n  - " + "\n  - ".join(self.problems))


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], str | None]:
    """Tensor names -> info from a safetensors header, and a problem string (truncation) or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return {}, f"{path.name}: not a safetensors file (only {size} bytes)"
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100_000_000:
            return {}, f"{path.name}: header length {n} exceeds the file size {size} (truncated or not safetensors)"
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return {}, f"{path.name}: unreadable safetensors header ({e})"
    if not isinstance(header, dict):
        return {}, f"{path.name}: unreadable safetensors header (not a JSON object)"
    out: dict[str, TensorInfo] = {}
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            info = TensorInfo(path, str(meta["dtype"]), tuple(int(d) for d in meta["shape"]))
            end = max(end, int(meta["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            return out, f"{path.name}: malformed safetensors header entry for {name!r}: {meta!r}"
        out[name] = info
    if 8 + n + end > size:
        return out, f"{path.name}: truncated: tensor data needs {8 + n + end} bytes, the file has {size}"
    return out, None


def _checkpoint_files(path: Path) -> list[Path]:
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
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted({path / v for v in weight_map.values()})
        pickled = [p.name for p in files if p.suffix in _PICKLE_SUFFIXES]
        if pickled:
            raise CheckpointError(
                f"{INDEX_NAME} names pickled weights ({', '.join(pickled[:3])}); they are refused "
                "(unpickling runs arbitrary code); convert to safetensors"
            )
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise CheckpointError([f"{INDEX_NAME} names missing file(s): {', '.join(missing)}"])
        return files
    files = sorted(path.glob("*.safetensors"))
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
    """Check names, shapes and dtypes of every PLE layer from the safetensors headers alone."""
    files = _checkpoint_files(Path(path))
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
        elif rest.startswith("ple_embedding.") and rest.split(".", 1)[1] in _BUFFERS:
            e.buffers[rest.split(".", 1)[1]] = info
        elif rest in _DENSE:
            e.dense[rest] = info
        else:
            e.unexpected.append(prefix + rest)
    for name in e.unexpected:
        p(f"unexpected tensor {name}")
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
        elif dense_info.shape != shape:
            p(f"{prefix}{name}: shape {list(dense_info.shape)}, expected {list(shape)}")
    nbuf = {
        "layer_multipliers": lay.ngram_size,
        "ngram_heads_vocab_sizes": lay.num_heads,
        "ngram_heads_offsets": lay.num_heads,
    }
    for name, info in e.buffers.items():
        if info.shape != (nbuf[name],):
            p(f"{prefix}ple_embedding.{name}: shape {list(info.shape)}, expected [{nbuf[name]}]")
    # table
    if e.whole_table is not None and e.shards:
        p(f"{prefix}: both an unsharded {_TABLE} and {len(e.shards)} shard(s); expected one form")
    table_infos = [e.whole_table] if e.whole_table is not None else [e.shards[k] for k in sorted(e.shards)]
    if e.whole_table is None and not e.shards:
        p(f"missing table: no {prefix}{_TABLE} and no {prefix}ple_embedding.ngram_embedding.shard_*.weight")
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
            if info.shape != (b - a, lay.head_dim):
                p(
                    f"{prefix}ple_embedding.ngram_embedding.shard_{k}.weight: shape {list(info.shape)}, "
                    f"expected [{b - a}, {lay.head_dim}] (rows {a}..{b} of {lay.padded_rows})"
                )
    orphans = sorted(set(e.shard_scales) - set(e.shards))
    if orphans:
        p(f"{prefix}: weight_scale for shard(s) {orphans[:8]} without the shard's weight")
    scales = list(e.shard_scales.values()) + ([e.global_scale] if e.global_scale is not None else [])
    bad_scale = sorted({i.dtype for i in scales} - {"F32", "BF16", "F16", "F64"})
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
            if per_row:
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
        else:
            p(f"{prefix}: unsupported table dtype {dt}")
    return e


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
    """Reads checkpoint tensors one at a time, keeping one open safetensors handle per file."""

    def __init__(self):
        self._handles = {}

    def get(self, info: TensorInfo, name: str) -> torch.Tensor:
        from safetensors import safe_open

        h = self._handles.get(info.file)
        if h is None:
            h = self._handles[info.file] = safe_open(str(info.file), framework="pt")
        return h.get_tensor(name)

    def close(self):
        self._handles.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_table_shards(
    entry: LayerEntry, reader: TensorReader | None = None
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """Yield ``(k, rows [n_k, head_dim], per_row_scale [n_k, 1] | None)`` shard by shard, in order.

    An unsharded table is yielded in slices of ``shard_rows`` rows (so memory stays bounded by one shard).
    """
    own = reader is None
    reader = reader or TensorReader()
    try:
        lay = entry.layout
        if entry.whole_table is not None:
            from safetensors import safe_open

            with safe_open(str(entry.whole_table.file), framework="pt") as f:
                sl = f.get_slice(entry.prefix + _TABLE)
                for k in range(lay.split_parts):
                    a, b = lay.shard_range(k)
                    yield k, sl[a:b], None
            return
        for k in range(lay.split_parts):
            info = entry.shards[k]
            base = f"{entry.prefix}ple_embedding.ngram_embedding.shard_{k}"
            rows = reader.get(info, base + ".weight")
            scale = reader.get(entry.shard_scales[k], base + ".weight_scale") if k in entry.shard_scales else None
            yield k, rows, scale
    finally:
        if own:
            reader.close()


def _buffer_problem(name: str, got: list[int], want: list[int], prefix: str) -> str:
    return (
        f"{prefix}ple_embedding.{name} = {got} but the config implies {want}; a wrong or missing `seed` "
        "(default 1234) or `ngram_vocab_size_base` in config.json is the usual cause"
    )


def _check_buffers(e: LayerEntry, reader: TensorReader) -> list[str]:
    """Compare the layer's hash buffers (a few integers each) with the values the config implies.

    Buffers whose header shape is already reported as wrong are skipped; a buffer that cannot be
    read is reported as such.
    """
    lay = e.layout
    want = {
        "layer_multipliers": list(lay.multipliers),
        "ngram_heads_vocab_sizes": list(lay.head_sizes),
        "ngram_heads_offsets": list(lay.head_offsets),
    }
    out = []
    for name, info in sorted(e.buffers.items()):
        if info.shape != (len(want[name]),):
            continue
        full = f"{e.prefix}ple_embedding.{name}"
        try:
            got = [int(v) for v in reader.get(info, full).tolist()]
        except Exception as exc:  # a truncated file: its own problem is reported by the scan
            out.append(f"{full}: could not be read ({type(exc).__name__}: {exc})")
            continue
        if got != want[name]:
            out.append(_buffer_problem(name, got, want[name], e.prefix))
    return out


def _read_checked(reader: TensorReader, info: TensorInfo, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Read one tensor and insist on the shape and dtype its header promised (the file may have
    changed since the scan; ``copy_`` would otherwise broadcast or convert silently)."""
    t = reader.get(info, name)
    want_dtype = _ST_DTYPES.get(info.dtype)
    if tuple(t.shape) != shape or (want_dtype is not None and t.dtype != want_dtype):
        raise CheckpointError(
            f"{name} in {info.file.name}: read {list(t.shape)} {t.dtype}, expected {list(shape)} {want_dtype} "
            "(the file changed after it was scanned)"
        )
    return t


def _load_table(e: LayerEntry, reader: TensorReader, device, progress: bool) -> MemoryTable:
    """The layer's table, read shard by shard into a fresh :class:`~ple.table.MemoryTable`."""
    lay = e.layout
    assert e.table_format is not None  # a scan without problems found the format
    table = MemoryTable.empty(lay.padded_rows, lay.head_dim, e.table_format, device=device)
    data, tscale = table.data, table.scale
    shard_iter: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]] = iter_table_shards(e, reader)
    if progress:
        from tqdm.auto import tqdm

        shard_iter = tqdm(shard_iter, total=lay.split_parts, desc=f"PLE layer {e.ple_layer_index}", unit="shard")
    for sk, rows, scale in shard_iter:
        a, b = lay.shard_range(sk)
        name = f"{e.prefix}ple_embedding.ngram_embedding.shard_{sk}"
        if tuple(rows.shape) != (b - a, lay.head_dim) or rows.dtype != data.dtype:
            raise CheckpointError(
                f"{name}: read {list(rows.shape)} {rows.dtype}, expected [{b - a}, {lay.head_dim}] "
                f"{data.dtype} (the file changed after it was scanned)"
            )
        data[a:b].copy_(rows)
        if scale is not None and tscale is not None:
            if tuple(scale.shape) != (b - a, 1):
                raise CheckpointError(
                    f"{name}.weight_scale: read {list(scale.shape)}, expected [{b - a}, 1] "
                    "(the file changed after it was scanned)"
                )
            tscale[a:b].copy_(scale)
        del rows, scale
    if e.table_format == "fp8" and tscale is not None and e.global_scale is not None:
        tscale.copy_(reader.get(e.global_scale, e.prefix + _TABLE_SCALE).reshape(1).float())
    return table


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

    The whole checkpoint is validated first (headers, plus the small hash buffers, whose values
    must equal the config's); then tensors are read one at a time, the table shard by shard into
    a freshly allocated :class:`ple.table.MemoryTable`. Nothing is returned (and no caller state is
    touched) unless every layer loaded; any failure raises :class:`CheckpointError`.

    Args:
        layers: ``ple_layer_index`` values to load (default: all).
        strict: unexpected tensor names under a PLE prefix are an error (else ignored).
        with_table: False reads everything but the table (``PLEWeights.table`` is None), for
            tables served from another tier (e.g. a table file made by ``ple convert``).
    """
    scan = scan_checkpoint(path, config)
    problems = list(scan.problems)
    wanted = [e for e in scan.layers if layers is None or e.ple_layer_index in layers]
    if layers is not None:
        have = {e.ple_layer_index for e in scan.layers}
        problems += [f"PLE layer {i} requested but not in the checkpoint" for i in layers if i not in have]
    for e in wanted:
        problems += [q for q in e.problems if strict or not q.startswith("unexpected tensor")]
    reader = TensorReader()
    out: dict[int, PLEWeights] = {}
    try:
        # Buffers first, even when the headers already show problems: a wrong seed or
        # ngram_vocab_size_base is the usual cause of wrong table shapes, and the buffers say so.
        for e in wanted:
            problems += _check_buffers(e, reader)
        if problems:
            raise CheckpointError(problems)
        c, k = config.hc_hidden_size, config.ple_conv_kernel_size
        for e in wanted:
            lay = e.layout
            dense = {n: _read_checked(reader, i, e.prefix + n, i.shape).to(device) for n, i in e.dense.items()}
            table = _load_table(e, reader, device, progress) if with_table else None
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
    if p.is_file() and p.name.endswith(".json") and p.name != INDEX_NAME:
        return PLEConfig.from_pretrained(p), None
    root = p.parent if p.is_file() else p
    if not (root / "config.json").is_file():
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
        for k, rows, scale in iter_table_shards(entry, reader):
            yield k, rows, (gscale if scale is None else scale)
    finally:
        if own:
            reader.close()


def table_file_name(prefix: str) -> str:
    """The table file name ``ple convert`` gives a PLE layer with this checkpoint prefix."""
    return prefix.rstrip(".").replace("/", "_") + TABLE_SUFFIX


def write_layer_table(
    shards: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]],
    path: str | os.PathLike,
    config: PLEConfig,
    ple_layer_index: int,
    *,
    to: str | None = None,
    force: bool = False,
    progress: bool = False,
) -> dict:
    """Write PLE layer ``ple_layer_index``'s table, from ``(k, rows, scale)`` shards (any source: a
    checkpoint's :func:`table_shards`, slices of an in-memory weight), as a table file carrying the
    layer's layout fields. Returns :func:`ple.table.convert_layer`'s statistics."""
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
    )


def open_layer_table(
    path: str | os.PathLike, config: PLEConfig, ple_layer_index: int, *, random_access: bool = True
) -> MmapTable:
    """Map a table file, refusing one made for another layer or layout than ``config``'s layer
    ``ple_layer_index``."""
    return MmapTable.open(path, config.layout_fields(ple_layer_index), random_access=random_access)
