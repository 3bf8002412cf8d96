"""Table files for a checkpoint's PLE layers: made once, reused on every later start.

For each PLE layer the folder holds ``<prefix>.pletable`` (the file ``ple convert`` writes) and a
small record ``<prefix>.pletable.source.json`` naming what the table was made from. A start reuses
a table file only when

- it opens as a complete table file of the layer's geometry and layout hash (header only), and
- the record's source identity equals the checkpoint's now: for every safetensors file holding the
  layer's table or scales, its name, size, modification time and the sha256 of its header (which
  lists every tensor's name, dtype, shape and byte range); and the record's table identity (format,
  size, the header's per-shard checksums) equals the file's.

That costs a ``stat`` and a header read per file, whatever the table's size. A table file without
a record (made by ``ple convert``, or replaced since) is compared with the checkpoint row by row once
and recorded when it matches; a stale or foreign file is converted again, with a warning that says
why. Nothing is used silently. Conversion streams the checkpoint shard by shard (``pread``, nothing
mapped) into a ``.partial`` file renamed when complete; concurrent starts take a lock per table.

Without a ``table_dir`` the folder is ``$PLE_CACHE_DIR/tables/<checkpoint folder name>-<hash of its
absolute path>`` (``PLE_CACHE_DIR`` defaults to ``$XDG_CACHE_HOME/ple``, else ``~/.cache/ple``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .._native import cache_dir
from ..checkpoint import LayerEntry, open_layer_table, table_file_name, table_shards, write_layer_table
from ..config import PLEConfig
from ..errors import InvalidArgumentError
from ..table import MemoryTable, TableFileError, compare_with_source, format_info, read_table_header
from .checkpoints import PreadReader, read_header

__all__ = [
    "default_table_dir",
    "prepare_table",
    "load_memory_table",
    "source_identity",
    "PreparedTable",
    "RECORD_SUFFIX",
]

RECORD_SUFFIX = ".source.json"
"""Suffix of the record beside a table file: ``<table file name>.source.json``."""
_RECORD_VERSION = 1


def default_table_dir(checkpoint: str | os.PathLike) -> Path:
    """The per-checkpoint table folder under the user's cache (see the module docstring)."""
    real = Path(checkpoint).resolve()
    if real.is_file():  # a safetensors or index file: its folder
        real = real.parent
    key = hashlib.sha256(str(real).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", real.name)[:64] or "checkpoint"
    return cache_dir() / "tables" / f"{name}-{key}"


def _table_infos(entry: LayerEntry):
    infos = [*entry.shards.values(), *entry.shard_scales.values(), entry.whole_table, entry.global_scale]
    return [i for i in infos if i is not None]


def source_identity(entry: LayerEntry) -> dict[str, Any]:
    """What a layer's table is made from, cheap to recompute: the checkpoint prefix and format, and
    for each safetensors file holding the table or its scales its name, size, modification time and
    header digest."""
    files = []
    for f in sorted({i.file for i in _table_infos(entry)}):
        st = f.stat()
        files.append(
            {
                "file": f.name,
                "bytes": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "header_sha256": hashlib.sha256(read_header(f).raw).hexdigest(),
            }
        )
    return {"prefix": entry.prefix, "format": entry.table_format, "files": files}


def _table_identity(header: dict[str, Any]) -> dict[str, Any]:
    checks = json.dumps(header.get("checksum"), sort_keys=True).encode()
    return {
        "format": header["format"],
        "rows": header["rows"],
        "head_dim": header["head_dim"],
        "layout_hash": header["layout_hash"],
        "file_nbytes": header["file_nbytes"],
        "checksums_sha256": hashlib.sha256(checks).hexdigest(),
    }


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + RECORD_SUFFIX)


def _write_record(path: Path, source: dict[str, Any]) -> None:
    record = {
        "record": "ple table source",
        "version": _RECORD_VERSION,
        "table": _table_identity(read_table_header(path)),
        "source": source,
    }
    rec = _record_path(path)
    tmp = rec.with_name(rec.name + ".partial")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, rec)


def _describe_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    if old.get("prefix") != new.get("prefix") or old.get("format") != new.get("format"):
        return f"it was made from {old.get('prefix')!r} ({old.get('format')}), not {new['prefix']!r} ({new['format']})"
    before = {f["file"]: f for f in old.get("files", [])}
    now = {f["file"]: f for f in new["files"]}
    if set(before) != set(now):
        return f"it was made from file(s) {sorted(before)}, the checkpoint now holds the table in {sorted(now)}"
    for name, f in now.items():
        diff = [k for k in ("bytes", "mtime_ns", "header_sha256") if before[name].get(k) != f[k]]
        if diff:
            what = {"bytes": "size", "mtime_ns": "modification time", "header_sha256": "header"}
            return f"checkpoint file {name} changed since ({', '.join(what[d] for d in diff)})"
    return "its record does not match"


_UNRECORDED = "unrecorded"


def _reuse_problem(path: Path, config: PLEConfig, index: int, source: dict[str, Any]) -> str | None:
    """None when the table file may be reused; else why not (``_UNRECORDED``: sound file, no valid record)."""
    if not path.exists():
        return "missing"
    try:
        table = open_layer_table(path, config, index)
    except (TableFileError, OSError, ValueError) as e:
        return f"it cannot be used ({e})"
    header = table.header
    table.close()
    try:
        record = json.loads(_record_path(path).read_text())
    except (OSError, ValueError):
        return _UNRECORDED
    if not isinstance(record, dict) or record.get("version") != _RECORD_VERSION:
        return _UNRECORDED
    if record.get("table") != _table_identity(header):
        return _UNRECORDED
    if record.get("source") != source:
        return _describe_change(record.get("source") or {}, source)
    return None


@dataclasses.dataclass
class PreparedTable:
    """A layer's table file and how it was obtained: ``action`` is "reused" (record matched),
    "verified" (no record: compared with the checkpoint row by row, then recorded) or "converted"
    (with ``reason``: why the existing file was not used, or "missing")."""

    path: Path
    action: str
    seconds: float
    reason: str | None = None


@contextlib.contextmanager
def _lock(path: Path):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no inter-process lock
        yield
        return
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _table_nbytes(config: PLEConfig, index: int, fmt: str) -> int:
    lay = config.layout(index)
    info = format_info(fmt)
    scales = {"none": 0, "global": 4, "row": 4 * lay.padded_rows}[info.scale_kind]
    return lay.padded_rows * lay.head_dim * info.itemsize + scales


def prepare_table(
    entry: LayerEntry, config: PLEConfig, table_dir: str | os.PathLike, *, progress: bool = False
) -> PreparedTable:
    """The table file of PLE layer ``entry`` in ``table_dir``: reused, verified or converted (see
    the module docstring). The file keeps the checkpoint's format, so lookups are exact."""
    t0 = time.perf_counter()
    folder = Path(table_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / table_file_name(entry.prefix)
    index = entry.ple_layer_index
    with _lock(path):
        source = source_identity(entry)
        reason = _reuse_problem(path, config, index, source)
        if reason is None:
            return PreparedTable(path, "reused", time.perf_counter() - t0)
        if reason == _UNRECORDED:
            with PreadReader() as reader:
                problems = compare_with_source(path, table_shards(entry, reader))
            if not problems:
                _write_record(path, source)
                return PreparedTable(path, "verified", time.perf_counter() - t0)
            reason = f"its rows differ from the checkpoint's ({problems[0]}{' ...' if len(problems) > 1 else ''})"
        if reason != "missing":
            warnings.warn(f"PLE table file {path} is not used: {reason}; converting it again", stacklevel=3)
        _record_path(path).unlink(missing_ok=True)
        assert entry.table_format is not None  # a scan without problems found it
        need = _table_nbytes(config, index, entry.table_format)
        free = shutil.disk_usage(folder).free + (path.stat().st_size if path.exists() else 0)
        if free < need:
            raise InvalidArgumentError(
                f"table folder {folder} has {free / 1e9:.2f} GB free, PLE layer {index}'s table needs "
                f"{need / 1e9:.2f} GB: pass table_dir= on a disk with room"
            )
        with PreadReader() as reader:
            write_layer_table(table_shards(entry, reader), path, config, index, force=True, progress=progress)
        _write_record(path, source)
        return PreparedTable(path, "converted", time.perf_counter() - t0, reason)


def load_memory_table(entry: LayerEntry, device: torch.device | str = "cpu") -> MemoryTable:
    """A layer's table read shard by shard (``pread``) into a fresh :class:`~ple.table.MemoryTable`
    on ``device``, in the checkpoint's format."""
    lay = entry.layout
    assert entry.table_format is not None  # a scan without problems found it
    table = MemoryTable.empty(lay.padded_rows, lay.head_dim, entry.table_format, device=device)
    kind = format_info(entry.table_format).scale_kind
    with PreadReader() as reader:
        for k, rows, scale in table_shards(entry, reader):
            a, b = lay.shard_range(k)
            table.data[a:b].copy_(rows)
            if scale is not None and table.scale is not None:
                if kind == "row":
                    table.scale[a:b].copy_(scale)
                else:
                    table.scale.copy_(scale.reshape(1))
    return table
