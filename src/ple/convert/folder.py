"""Table files for a checkpoint's PLE layers: made once, reused on every later start.

For each PLE layer the folder holds ``<prefix>.pletable`` (the file ``ple convert`` writes) and a
small record ``<prefix>.pletable.source.json`` naming what the table was made from; a copy in
another format (``table_format=``) is ``<prefix>.<format>.pletable``, or the file ``ple convert
--to <format>`` wrote under the first name. A start reuses a table file only when

- its header says it holds the format served (the checkpoint's own, or the one asked for): a file
  of another format under the name is refused, naming both, and left as it is; and
- it opens as a complete table file of the layer's layout hash, rows and row width (its header, and
  for per-row formats its scales, are read: :meth:`~ple.table.MmapTable.open`), and
- the record's source identity equals the checkpoint's now: for every safetensors file holding the
  layer's table or scales, its name, size, modification time, change time and the sha256 of its
  header (which lists every tensor's name, dtype, shape and byte range); and the record's table identity (format,
  size, the header's per-shard checksums) equals the file's; and the table file itself is the one
  recorded (its size, modification and change times and inode): a table file changed in place since
  (a copy over it, an edit, even one whose modification time was set back, a copy of the folder
  elsewhere) is compared with the checkpoint again. Both identities are
  :func:`ple.common.files.file_identity`, the one a conversion's resume key is made of.

A checkpoint file edited in place with its modification time set back still has a new change time
(no program can set that one): the table file is then compared with the checkpoint row by row before
it is served, as when only the change time or the inode moved (a ``chmod``, a new hard link, a copy
of the checkpoint), which converts nothing when the rows are equal.

That costs a ``stat`` and a header read per checkpoint file, and opening the table file reads its
per-row scales when it has them (4 bytes per row, checked at every open); never the rows. ``ple
convert`` writes the record too (:func:`record_table`). A table file without a record (from a GGUF
file, or replaced since) is compared with the checkpoint row by row once and recorded when it
matches; a stale file (the checkpoint in the same folder changed) is converted again, with a warning
that says why. Nothing is used silently. Conversion streams the checkpoint shard by shard with
``pread`` (:class:`ple.checkpoint.PreadReader`: nothing mapped, a table stored as one tensor
included) into a ``.partial`` file renamed when complete; concurrent starts take a lock per table
(``<file>.lock``, kept beside it; a start that fails removes the lock file it made), and the table
is opened (:class:`~ple.table.MmapTable`) while the lock is held, so the file checked is the file
served.

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

from ple.checkpoint import (
    LayerEntry,
    PreadReader,
    open_layer_table,
    read_header,
    table_file_name,
    table_shards,
    write_layer_table,
)
from ple.common.files import file_identity, read_json, write_atomically
from ple.config import PLEConfig
from ple.errors import InvalidArgumentError, PLEError
from ple.kernels.native import cache_dir
from ple.table import MmapTable, TableFileError, format_info, read_table_header
from ple.table.files.transcode import TARGET_NAMES, compare_with_source, table_amax, target_format
from ple.table.formats.blocks import nvfp4_global_scale

__all__ = [
    "default_table_dir",
    "prepare_table",
    "served_format",
    "made_from",
    "record_table",
    "source_identity",
    "PreparedTable",
    "RECORD_SUFFIX",
]

RECORD_SUFFIX = ".source.json"
"""Suffix of the record beside a table file: ``<table file name>.source.json``."""
_RECORD_VERSION = 4  # 4: the file identities carry change times and inodes (ple.common.files.file_identity)
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
    for each safetensors file holding the table or its scales its name, identity
    (:func:`ple.common.files.file_identity`: size, modification and change times, inode) and header digest."""
    files = []
    for f in sorted({i.file for i in _table_infos(entry)}):
        files.append(
            {"file": f.name, **file_identity(f), "header_sha256": hashlib.sha256(read_header(f).raw).hexdigest()}
        )
    return {"prefix": entry.prefix, "format": entry.table_format, "files": files}


def _without_ctime(source: dict[str, Any]) -> dict[str, Any]:
    """``source`` without what a copy of the same files changes (change times, inodes)."""
    files = [{k: v for k, v in f.items() if k not in ("ctime_ns", "inode")} for f in source.get("files", [])]
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
        "file": file_identity(path),
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
        keys = ("bytes", "mtime_ns", "header_sha256", "ctime_ns", "inode")
        diff = [k for k in keys if before[name].get(k) != f[k]]
        if diff:
            what = {
                "bytes": "size",
                "mtime_ns": "modification time",
                "header_sha256": "header",
                "ctime_ns": "change time",
                "inode": "inode: another file in its place",
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
    """Hold the lock of table file ``path`` (``<file>.lock``, made if missing). A lock file may be
    removed by its maker (a start that failed before a table file lay there): every start checks,
    once it holds the lock, that the name still leads to the file it locked, and takes it again if
    not, so two starts never both hold "the" lock. Yields a :class:`_Held`: its ``unused()`` removes
    a lock file made here for a table file that is not made (another file served instead)."""
    held_lock = _Held()
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no inter-process lock
        yield held_lock
        return
    lock = path.with_name(path.name + ".lock")
    # never through a symbolic link planted at the lock's name
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        created = False
        try:
            fd = os.open(lock, flags | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        except FileExistsError:
            try:
                fd = os.open(lock, flags)
            except FileNotFoundError:  # removed in between: make it again
                continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                now = os.stat(lock, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            held = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # its maker removed it while this start waited: lock the file now there
    try:
        yield held_lock
        if created and held_lock.drop:
            with contextlib.suppress(OSError):
                os.unlink(lock)
    except BaseException:
        if created:  # a failed start leaves no file it made behind (removed while held: safe, see above)
            with contextlib.suppress(OSError):
                os.unlink(lock)
        raise
    finally:
        os.close(fd)


class _Held:
    """A lock :func:`_lock` holds; ``unused()``: the table file it guards is not made, and a lock file
    made for it goes when it is released (a lock for a file that never exists is a leftover)."""

    drop = False

    def unused(self) -> None:
        self.drop = True


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


def served_format(entry: LayerEntry, config: PLEConfig, table_format: str | None = None) -> str:
    """The format :func:`prepare_table` serves PLE layer ``entry``'s table in: the checkpoint's own
    (``table_format`` None, or a name that covers it: "fp8" for an fp8 table) or the one
    ``table_format`` names, as ``ple convert --to`` reads it ("fp8" -> "fp8_row", "q4_0" -> "q4_0").

    Raises:
        InvalidArgumentError: ``table_format`` is not a name ``ple convert --to`` takes, or is a
            block format whose blocks do not divide the layer's rows (``head_dim``).
    """
    assert entry.table_format is not None  # a scan without problems found it
    want = target_format(table_format, entry.table_format) or entry.table_format
    info = format_info(want)
    head_dim = config.layout(entry.ple_layer_index).head_dim
    if info.blocked and head_dim % info.block:
        raise InvalidArgumentError(
            f"table_format={table_format!r}: {want} stores rows as blocks of {info.block} values, and PLE layer "
            f"{entry.ple_layer_index}'s rows have {head_dim} (head_dim {head_dim} is not a multiple of {info.block}): "
            "serve this checkpoint in its own format (table_format=None) or as 'fp8' or 'int8' (a scale per row)"
        )
    return want


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
    the same way; the checkpoint's own format is a plain copy). A copy in that format that
    ``ple convert --to`` wrote into the folder (under the checkpoint-format name) is found and
    served, after the same checks.

    The format a file holds is read from its header: a file that holds another format than the one
    served (:func:`served_format`) is never served, and never replaced either (it was not made by
    the folder under that name: ``ple convert --to`` output, a copy); only a copy the folder made of
    a checkpoint whose format changed since is converted again. A failed call leaves nothing it
    made behind (the folder, a lock file).

    Raises:
        InvalidArgumentError: ``table_dir`` is not a folder and cannot be made one; the folder holds
            this layer's table for another checkpoint folder that still exists, or a table file of
            another format under the name of the one served, or lacks the disk space a conversion
            needs; ``table_format`` does not fit the layer's rows.
    """
    t0 = time.perf_counter()
    want = served_format(entry, config, table_format)  # before anything is made
    folder = Path(table_dir)
    made = _make_folder(folder)
    try:
        return _prepare(entry, config, folder, want, table_format, progress, t0)
    except BaseException:
        for d in reversed(made):  # innermost first; a folder something else wrote into stays
            try:
                d.rmdir()
            except OSError:
                break
        raise


def _make_folder(folder: Path) -> list[Path]:
    """Make ``folder`` and its missing parents; returns the folders made, outermost first."""
    missing = []
    p = folder.absolute()
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidArgumentError(f"table_dir {folder} cannot be a folder of table files: {e.strerror or e}") from e
    return missing[::-1]


def _prepare(
    entry: LayerEntry,
    config: PLEConfig,
    folder: Path,
    want: str,
    table_format: str | None,
    progress: bool,
    t0: float,
) -> PreparedTable:
    target = None if want == entry.table_format else want
    path = folder / table_file_name(entry.prefix, target)
    index = entry.ple_layer_index
    with _lock(path) as held:
        source = source_identity(entry)
        home = _checkpoint_folder(entry)
        if target is not None and not os.path.lexists(path):
            made = _convert_output(entry, config, folder, want, source, home, path, t0)
            if made is not None:
                held.unused()  # ple convert's file is served: no file is made under this name
                return made
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
            prepared, reason = _try_existing(path, entry, config, want, table_format, record, source, home, t0)
            if prepared is not None:
                return prepared
        if reason != "missing":
            warnings.warn(f"PLE table file {path} is not used: {reason}; converting it again", stacklevel=4)
        _record_path(path).unlink(missing_ok=True)
        need = _table_nbytes(config, index, want)
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
                rows = config.layout(index).padded_rows
                g = nvfp4_global_scale(table_amax(table_shards(entry, reader), progress, rows, path.name))
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


def _convert_output(
    entry: LayerEntry,
    config: PLEConfig,
    folder: Path,
    want: str,
    source: dict[str, Any],
    home: str,
    own: Path,
    t0: float,
) -> PreparedTable | None:
    """The copy in format ``want`` that ``ple convert --to`` wrote into ``folder`` (under the name
    of the checkpoint-format file, :func:`~ple.checkpoint.table_file_name` without a format),
    opened, when it may serve ``entry`` after the checks a folder's own file passes; else None
    (with a warning saying why, when the file holds ``want`` rows but cannot serve)."""
    path = folder / table_file_name(entry.prefix)
    if not os.path.lexists(path):
        return None
    reason = None
    try:
        with _lock(path):  # a lock file made here goes again when the file is not served (_NotServed)
            try:
                header = read_table_header(path)
            except (TableFileError, OSError):
                raise _NotServed from None  # not a table file in this format: the checkpoint-format start judges it
            if header["format"] != want:
                raise _NotServed  # the checkpoint-format copy, or another format's: not this one
            index = entry.ple_layer_index
            record = _read_record(path)
            other = _foreign_owner(path, record, source, home)
            if other is not None:
                reason = f"it is PLE layer {index}'s table of checkpoint {other}"
            else:
                prepared, reason = _try_existing(path, entry, config, want, None, record, source, home, t0)
                if prepared is not None:
                    return prepared
            raise _NotServed
    except _NotServed:
        if reason is not None:
            warnings.warn(f"PLE table file {path} ({want}) is not used: {reason}; converting {own.name}", stacklevel=5)
        return None


class _NotServed(Exception):
    """A table file looked at is not served: its lock, when made for the look, is removed."""


def _refused_format(
    path: Path,
    header: dict[str, Any],
    want: str,
    table_format: str | None,
    record: dict[str, Any] | None,
    entry: LayerEntry,
) -> str | None:
    """None when table file ``path`` holds ``want`` rows. A copy made of the checkpoint in its own
    format before that format changed is stale: the reason, to convert it again. Any other file of
    another format is refused (it was not made under this name by the folder; it is not replaced)."""
    have = header["format"]
    if have == want:
        return None
    if (
        want == entry.table_format
        and record is not None
        and record.get("table") == _table_identity(header)
        and record.get("file") == file_identity(path)
        and (record.get("source") or {}).get("format") == have
    ):
        return f"it holds a copy of the checkpoint's table in {have}, which is {want} now"
    if table_format is None:
        asked = f"the checkpoint's table is {want} (no table_format asked for another)"
    else:
        asked = f"table_format={table_format!r} asks for {want}"
    name = {"fp8_row": "fp8", "int8_row": "int8"}.get(have, have)
    hint = ""
    if name in TARGET_NAMES and target_format(name, entry.table_format or "") == have:
        hint = f"pass table_format={name!r} to serve it, or "
    raise InvalidArgumentError(
        f"PLE layer {entry.ple_layer_index}: table file {path} holds {have} rows, but {asked}; it is neither served "
        f"nor replaced: {hint}move it out of {path.parent}, or pass another table_dir"
    )


def _try_existing(
    path: Path,
    entry: LayerEntry,
    config: PLEConfig,
    want: str,
    table_format: str | None,
    record: dict[str, Any] | None,
    source: dict[str, Any],
    home: str,
    t0: float,
) -> tuple[PreparedTable | None, str]:
    """The existing table file ``path``, opened, when it may serve ``entry`` in format ``want``, else
    ``(None, why not)``; raises :class:`InvalidArgumentError` for a file of another format (see
    :func:`_refused_format`). Its header is checked first (format, then, once open, layout hash,
    rows and row width), then its record (or its rows) against the checkpoint."""
    index = entry.ple_layer_index
    try:
        stale = _refused_format(path, read_table_header(path), want, table_format, record, entry)
    except (TableFileError, OSError) as e:
        return None, f"it cannot be used ({e})"
    if stale is not None:
        return None, stale
    try:
        table = open_layer_table(path, config, index)
    except (TableFileError, OSError, ValueError) as e:
        return None, f"it cannot be used ({e})"
    try:
        stale = _refused_format(path, table.header, want, table_format, record, entry)  # the file opened
        lay = config.layout(index)
        if stale is None and (table.rows, table.head_dim) != (lay.padded_rows, lay.head_dim):
            stale = (
                f"it holds {table.rows:,} rows of {table.head_dim} values, PLE layer {index}'s layout "
                f"{lay.padded_rows:,} of {lay.head_dim}"
            )
        if stale is not None:
            table.close()
            return None, stale
        action, reason = _check_existing(table, path, entry, record, source, home)
    except BaseException:
        table.close()
        raise
    if action is None:
        table.close()
        return None, reason
    return PreparedTable(path, action, time.perf_counter() - t0, table=table), ""


def record_table(path: str | os.PathLike, entry: LayerEntry, source: dict[str, Any]) -> None:
    """Write the record beside table file ``path``, just made from PLE layer ``entry`` of a
    checkpoint (``ple convert``), so that a table folder holding it reuses it without comparing it
    with the checkpoint. ``source``: :func:`source_identity` of ``entry`` taken before the
    conversion began (a checkpoint changed meanwhile then does not match)."""
    path = Path(path)
    _write_record(path, read_table_header(path), source, _checkpoint_folder(entry))


def made_from(path: str | os.PathLike, entry: LayerEntry, config: PLEConfig, format: str) -> str | None:
    """None when its record says table file ``path`` is PLE layer ``entry``'s table in ``format``, made
    from the checkpoint as it is now: the record's source identity equals :func:`source_identity` of
    ``entry`` (change times included), its table and file identities the file's, and the file opens for
    the layer's layout; else why not (what ``ple convert`` run again keeps of an interrupted run)."""
    path = Path(path)
    record = _read_record(path)
    if record is None:
        return "no record beside it says what it was made from"
    try:
        table = open_layer_table(path, config, entry.ple_layer_index)
    except (TableFileError, OSError, ValueError) as e:
        return f"it cannot be used ({e})"
    with contextlib.closing(table):
        header = table.header
        if header["format"] != format:
            return f"it holds {header['format']} rows, not {format}"
        if record.get("table") != _table_identity(header) or record.get("file") != file_identity(path):
            return "it was changed since its record was written"
    source = source_identity(entry)
    if record.get("source") != source:
        return _describe_change(record.get("source") or {}, source)
    return None


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
        and record.get("file") == file_identity(path)
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
