"""Table files for a checkpoint's PLE layers: made once, reused on every later start.

For each PLE layer the folder holds ``<prefix>.pletable`` (the file ``ple convert`` writes) and a
small record ``<prefix>.pletable.source.json`` naming what the table was made from. A start reuses
a table file only when

- it opens as a complete table file of the layer's geometry and layout hash (its header, and for
  per-row formats its scales, are read: :meth:`~ple.table.MmapTable.open`), and
- the record's source identity equals the checkpoint's now: for every safetensors file holding the
  layer's table or scales, its name, size, modification time, change time and the sha256 of its
  header (which lists every tensor's name, dtype, shape and byte range); and the record's table identity (format,
  size, the header's per-shard checksums) equals the file's; and the table file itself is the one
  recorded (its size, modification time and inode): a table file changed in place since
  (a copy over it, an edit, a copy of the folder elsewhere) is compared with the checkpoint again.

A shard edited in place with its modification time set back still has a new change time (no
program can set that one): the table file is then compared with the checkpoint row by row before it
is served, as when only the change time moved (a ``chmod``, a new hard link), which converts
nothing when the rows are equal.

That costs a ``stat`` and a header read per checkpoint file, and opening the table file reads its
per-row scales when it has them (4 bytes per row, checked at every open); never the rows. A table file without
a record (made by ``ple convert``, or replaced since) is compared with the checkpoint row by row once
and recorded when it matches; a stale file (the checkpoint in the same folder changed) is converted
again, with a warning that says why. Nothing is used silently. Conversion streams the checkpoint
shard by shard with ``pread`` (:class:`ple.checkpoint.PreadReader`: nothing mapped, a table stored
as one tensor included) into a ``.partial`` file renamed when complete; concurrent starts take a
lock per table, and the table is opened (:class:`~ple.table.MmapTable`) while the lock is held, so
the file checked is the file served.

One folder serves one checkpoint. The record also names the checkpoint folder the table was made
from; a table of another checkpoint folder that still exists is never replaced:
:func:`prepare_table` raises :class:`~ple.errors.InvalidArgumentError` instead (two checkpoints
sharing a folder would otherwise convert each other's tables back and forth on every start). Give
each checkpoint its own ``table_dir``, or delete the files to hand the folder over.

Without a ``table_dir`` the folder is ``$PLE_CACHE_DIR/tables/<checkpoint folder name>-<hash of its
absolute path>`` (``PLE_CACHE_DIR`` defaults to ``$XDG_CACHE_HOME/ple``, else ``~/.cache/ple``).
Such folders are never removed by ple (a Hub checkpoint gets one per downloaded revision, since each
revision is a folder of its own): delete a folder to reclaim its space; the next start of that
checkpoint converts its tables again.
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

from .._native import cache_dir
from ..checkpoint import (
    LayerEntry,
    PreadReader,
    open_layer_table,
    read_header,
    table_file_name,
    table_shards,
    write_layer_table,
)
from ..config import PLEConfig
from ..errors import InvalidArgumentError, PLEError
from ..files import read_json, write_atomically
from ..table import MmapTable, TableFileError, format_info, read_table_header
from ..table.blocks import nvfp4_global_scale
from ..table.convert import compare_with_source, table_amax, target_format

__all__ = [
    "default_table_dir",
    "prepare_table",
    "source_identity",
    "PreparedTable",
    "RECORD_SUFFIX",
]

RECORD_SUFFIX = ".source.json"
"""Suffix of the record beside a table file: ``<table file name>.source.json``."""
_RECORD_VERSION = 3
_MAX_RECORD_BYTES = 1 << 20


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
    for each safetensors file holding the table or its scales its name, size, modification and change
    times and header digest."""
    files = []
    for f in sorted({i.file for i in _table_infos(entry)}):
        st = f.stat()
        files.append(
            {
                "file": f.name,
                "bytes": st.st_size,
                "mtime_ns": st.st_mtime_ns,
                "ctime_ns": st.st_ctime_ns,
                "header_sha256": hashlib.sha256(read_header(f).raw).hexdigest(),
            }
        )
    return {"prefix": entry.prefix, "format": entry.table_format, "files": files}


def _without_ctime(source: dict[str, Any]) -> dict[str, Any]:
    files = [{k: v for k, v in f.items() if k != "ctime_ns"} for f in source.get("files", [])]
    return {**source, "files": files}


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


def _file_identity(path: Path) -> dict[str, int]:
    """The table file as the file system knows it: changed by any write to it or any file put in its
    place. (Not the device number: network and overlay file systems do not keep it stable, and hosts
    sharing a folder see different ones.)"""
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + RECORD_SUFFIX)


def _checkpoint_folder(entry: LayerEntry) -> str:
    """The absolute path of the folder holding the layer's table (what a record names)."""
    return str(_table_infos(entry)[0].file.parent.resolve())


def _write_record(path: Path, header: dict[str, Any], source: dict[str, Any], checkpoint: str) -> None:
    record = {
        "record": "ple table source",
        "version": _RECORD_VERSION,
        "table": _table_identity(header),
        "file": _file_identity(path),
        "source": source,
        "checkpoint": checkpoint,
    }
    write_atomically(_record_path(path), (json.dumps(record, indent=1) + "\n").encode())


def _read_record(path: Path) -> dict[str, Any] | None:
    """The record beside table file ``path``, or None (none, unreadable, another version)."""
    try:
        record = read_json(_record_path(path), "table record", _MAX_RECORD_BYTES, TableFileError)
    except (OSError, PLEError):
        return None
    if not isinstance(record, dict) or record.get("version") != _RECORD_VERSION:
        return None
    return record


def _describe_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    if old.get("prefix") != new.get("prefix") or old.get("format") != new.get("format"):
        return f"it was made from {old.get('prefix')!r} ({old.get('format')}), not {new['prefix']!r} ({new['format']})"
    before = {f["file"]: f for f in old.get("files", [])}
    now = {f["file"]: f for f in new["files"]}
    if set(before) != set(now):
        return f"it was made from file(s) {sorted(before)}, the checkpoint now holds the table in {sorted(now)}"
    for name, f in now.items():
        keys = ("bytes", "mtime_ns", "header_sha256", "ctime_ns")
        diff = [k for k in keys if before[name].get(k) != f[k]]
        if diff:
            what = {
                "bytes": "size",
                "mtime_ns": "modification time",
                "header_sha256": "header",
                "ctime_ns": "change time",
            }
            return f"checkpoint file {name} changed since ({', '.join(what[d] for d in diff)})"
    return "its record does not match"


def _foreign_owner(path: Path, record: dict[str, Any] | None, source: dict[str, Any], home: str) -> str | None:
    """The other checkpoint folder whose table ``path`` holds, when that table must not be replaced:
    the record vouches for the file there, was made from another source, in a folder other than
    ``home`` that still exists."""
    if record is None or _without_ctime(record.get("source") or {}) == _without_ctime(source):
        return None  # the same source, or a copy of it (only change times differ): compared, not refused
    other = record.get("checkpoint")
    if not isinstance(other, str) or other == home or not Path(other).is_dir():
        return None
    try:
        header = read_table_header(path)
    except (TableFileError, OSError):
        return None
    return other if record.get("table") == _table_identity(header) else None


@dataclasses.dataclass
class PreparedTable:
    """A layer's table file and how it was obtained: ``action`` is "reused" (record matched),
    "verified" (no record: compared with the checkpoint row by row, then recorded) or "converted"
    (with ``reason``: why the existing file was not used, or "missing"). ``table``: the file, opened
    while it was checked (the caller owns it: serve it, or close it)."""

    path: Path
    action: str
    seconds: float
    reason: str | None = None
    table: MmapTable | None = dataclasses.field(default=None, repr=False)


@contextlib.contextmanager
def _lock(path: Path):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no inter-process lock
        yield
        return
    # never through a symbolic link planted at the lock's name
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def byte_size(n: int) -> str:
    """``n`` bytes so that the number shows: ``"512 bytes"``, ``"1.5 KiB (1,536 bytes)"``."""
    if n < 1024:
        return f"{n:,} bytes"
    value, units = n / 1024, ["KiB", "MiB", "GiB", "TiB", "PiB"]
    while value >= 1024 and len(units) > 1:
        value, units = value / 1024, units[1:]
    return f"{value:.1f} {units[0]} ({n:,} bytes)"


def _table_nbytes(config: PLEConfig, index: int, fmt: str) -> int:
    lay = config.layout(index)
    info = format_info(fmt)
    scales = {"none": 0, "global": 4, "row": 4 * lay.padded_rows}[info.scale_kind]
    return lay.padded_rows * info.row_nbytes(lay.head_dim) + scales


def prepare_table(
    entry: LayerEntry,
    config: PLEConfig,
    table_dir: str | os.PathLike,
    *,
    progress: bool = False,
    table_format: str | None = None,
) -> PreparedTable:
    """The table file of PLE layer ``entry`` in ``table_dir``: reused, verified or converted (see
    the module docstring), returned open (``PreparedTable.table``). The file keeps the checkpoint's
    format, so lookups are exact; ``table_format`` (a name ``ple convert --to`` takes: "q4_0",
    "nvfp4", ...) makes it a copy in that format instead (its own file name, made once and reused
    the same way; the checkpoint's own format is a plain copy).

    Raises:
        InvalidArgumentError: ``table_dir`` is not a folder and cannot be made one; the folder holds
            this layer's table for another checkpoint folder that still exists, or lacks the disk
            space a conversion needs.
    """
    t0 = time.perf_counter()
    folder = Path(table_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidArgumentError(f"table_dir {folder} cannot be a folder of table files: {e.strerror or e}") from e
    assert entry.table_format is not None  # a scan without problems found it
    target = target_format(table_format, entry.table_format)
    path = folder / table_file_name(entry.prefix, target)
    index = entry.ple_layer_index
    with _lock(path):
        source = source_identity(entry)
        home = _checkpoint_folder(entry)
        record = _read_record(path)
        other = _foreign_owner(path, record, source, home)
        if other is not None:
            raise InvalidArgumentError(
                f"table folder {folder} holds {path.name}, PLE layer {index}'s table of checkpoint {other}, "
                f"not of {home}: converting it here would replace that checkpoint's table (and its next start "
                "would convert it back). Pass each checkpoint a table_dir of its own (the default is one per "
                f"checkpoint), or delete {path} to give the folder to this checkpoint"
            )
        reason = "missing"
        if os.path.lexists(path):
            try:
                table = open_layer_table(path, config, index)
            except (TableFileError, OSError, ValueError) as e:
                reason = f"it cannot be used ({e})"
            else:
                try:
                    action, reason = _check_existing(table, path, entry, record, source, home)
                except BaseException:
                    table.close()
                    raise
                if action is not None:
                    return PreparedTable(path, action, time.perf_counter() - t0, table=table)
                table.close()
        if reason != "missing":
            warnings.warn(f"PLE table file {path} is not used: {reason}; converting it again", stacklevel=3)
        _record_path(path).unlink(missing_ok=True)
        need = _table_nbytes(config, index, target or entry.table_format)
        # the new file is written beside the old one (a .partial renamed at the end): the old one's
        # space is not free until then
        free = shutil.disk_usage(folder).free
        if free < need:
            raise InvalidArgumentError(
                f"table folder {folder} has {byte_size(free)} free, PLE layer {index}'s table needs "
                f"{byte_size(need)}: pass table_dir= on a disk with room"
            )
        g = None
        if target == "nvfp4":
            with PreadReader() as reader:
                g = nvfp4_global_scale(table_amax(table_shards(entry, reader)))
        with PreadReader() as reader:
            write_layer_table(
                table_shards(entry, reader),
                path,
                config,
                index,
                to=target,
                force=True,
                progress=progress,
                global_scale=g,
            )
        table = open_layer_table(path, config, index)
        try:
            _write_record(path, table.header, source, home)
        except BaseException:
            table.close()
            raise
        return PreparedTable(path, "converted", time.perf_counter() - t0, reason, table)


def _check_existing(
    table: MmapTable,
    path: Path,
    entry: LayerEntry,
    record: dict[str, Any] | None,
    source: dict[str, Any],
    home: str,
) -> tuple[str | None, str]:
    """``("reused" | "verified", "")`` when the opened table file may serve ``entry``, else
    ``(None, why not)``."""
    if (
        record is not None
        and record.get("table") == _table_identity(table.header)
        and record.get("file") == _file_identity(path)
    ):
        if record.get("source") == source:
            return "reused", ""
        if _without_ctime(record.get("source") or {}) != _without_ctime(source):
            return None, _describe_change(record.get("source") or {}, source)
        # only a change time moved: the checkpoint may have been written in place with its
        # modification time set back; compare the rows before serving them
    # no record vouches for this file (or only a change time moved): compare it with the checkpoint row by row
    with PreadReader() as reader:
        problems = compare_with_source(path, table_shards(entry, reader))
    if problems:
        return None, f"its rows differ from the checkpoint's ({problems[0]}{' ...' if len(problems) > 1 else ''})"
    if not table.same_file(path):
        return None, "it was replaced while being compared with the checkpoint"
    _write_record(path, table.header, source, home)
    return "verified", ""
