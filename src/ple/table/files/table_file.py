"""Table files: one memory-mappable file per PLE layer, written atomically, verified by checksums.

File layout (all integers little-endian)::

    [0, 8)                 magic b"PLETABLE"
    [8, 16)                header length L (uint64)
    [16, 16 + L)           header: UTF-8 JSON (see below), space-padded up to data_offset
    [data_offset, ...)     rows: rows * head_dim values of the storage dtype, row-major (block
                           formats: each row its head_dim / block blocks, see ple.table.formats.blocks)
    [scale_offset, ...)    scales, float32: 1 value (global) or one per row (per-row formats)

``data_offset`` and ``scale_offset`` are multiples of 4096. The header records the geometry
(``rows``, ``head_dim``, ``format``, ``storage_dtype``), where the rows and scales are, the caller's
``layout_hash`` (see :func:`hash_layout`), the shard geometry (``shard_rows``, ``num_shards``), one
blake2b-128 checksum per shard covering the shard's row bytes followed by its per-row scale bytes
(plus one for a global scale), and ``header_checksum``: blake2b-128 of the header itself (its JSON
with sorted keys and no spaces, without this field). Checksums detect damage, not forgery. A table
file written by merging an adapter into another (:func:`ple.train.merge_table_file`) also says so:
``merged``, a JSON object naming the adapter and the table it was merged into, and holding the trained
rows' ids and digests (:mod:`ple.train.merge_record` checks it; files without the key read as before).

Format version 2 (this one) added the header checksum; version 1 files are refused with a message
saying to convert the table again (their headers cannot be trusted).

One validator, :func:`read_table_header`, is used by every reader (:meth:`ple.table.MmapTable.open`,
:func:`verify_table_file`): it refuses a header whose checksum does not match, fields of the wrong
type or out of range, and geometry that does not add up (a format and storage dtype or scale kind
that disagree, a row size that is not ``head_dim`` values, data starting inside the header, scales
overlapping the rows, a file size other than the header's, a checksum list that does not have one
entry per shard of ``ceil(rows / shard_rows)``). A global scale must be a positive finite number.

Atomic publication: each writer fills its own temporary file ``<name>.<pid>-<random>.partial``
beside ``path``, created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``: never through a link) and
locked (``flock``) while it is written; its header says ``"complete": false``. ``close()`` checks
every shard was written, writes the final header (``"complete": true``), fsyncs and publishes it
under ``path`` in one step (a hard link that fails if ``path`` appeared meanwhile, or, with
``force``, a rename over it), then fsyncs the folder. So the file under ``path`` is always exactly
one writer's complete output: two writers of one path never share a temporary file; without
``force`` the second is refused (at the start if the first is still writing, else when it
publishes); with ``force`` the last to finish wins. A crash leaves at most a ``.partial`` file,
which every reader refuses (by name and by its header) and the next writer of the same path
removes once no process holds its lock (a symbolic link of that name is removed, never followed).

Resumable writes (``TableFileWriter(..., resume=KEY)``, KEY naming the source and options, as
:func:`ple.table.files.transcode.convert_layer` makes it): after each shard the caller :meth:`~TableFileWriter.
commit` s, the file's data is synced (``fdatasync``) and then its temporary header records that shard's
checksum, the caller's progress record and KEY. An interrupted writer (Ctrl-C, SIGTERM: any
``KeyboardInterrupt``) keeps its temporary file when it has committed a shard; one killed (SIGKILL, a
power cut) leaves it anyway. The next writer of the same path with the same KEY and geometry takes it
over (:attr:`~TableFileWriter.resumed`: the committed shards whose bytes, read and hashed again,
still give their recorded checksums, which it then skips; :attr:`~TableFileWriter.rejected`: the others,
to be written again); a writer with another KEY removes it as any stale temporary file. A header torn
by a crash fails its checksum and is not taken over.

Sparse files (``TableFileWriter(..., sparse=True)``) are for tests
and benchmarks at full geometry: the file is sized with ``ftruncate`` (unwritten rows read as
zeros and take no disk space), rows are written by id, no shard needs to be complete, and no
checksums are computed (``"checksum": {"shards": null}``); :func:`verify_table_file` reports such a
file as unverifiable.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from ple.common.files import (
    PARTIAL_SUFFIX,
    open_regular,
    parse_json,
    partial_entries,
    pread_exact,
)
from ple.errors import ArgumentTypeError, InvalidArgumentError, PLEError
from ple.table.files.shard_writer import DIGEST_SIZE, ShardWriter
from ple.table.formats.catalog import FORMATS, format_info

__all__ = [
    "ShardWriter",
    "TableFileError",
    "hash_layout",
    "open_table_file",
    "read_table_header",
    "tensor_bytes",
    "read_open_header",
    "read_global_scale",
    "PARTIAL_SUFFIX",
    "TABLE_SUFFIX",
    "VERSION",
]

MAGIC = b"PLETABLE"
VERSION = 2
"""The table file format version this module writes and reads (2: the header is checksummed)."""
TABLE_SUFFIX = ".pletable"
"""The file name suffix of table files (``ple convert`` writes ``<layer prefix>.pletable``)."""
_ALIGN = 4096
PREFIX = 16
CHECKSUM_ALGORITHM = "blake2b-128"
_READ_CHUNK = 8 << 20
_MAX_HEADER = 1 << 26
_MAX_BYTES = 1 << 62  # every offset and size in a table file fits an int64 with room to add
_MAX_HEAD_DIM = 1 << 24
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


class TableFileError(PLEError, ValueError):
    """A table file is malformed, unfinished, or does not match what the caller expects."""


def hash_layout(fields: dict[str, Any]) -> str:
    """Stable hash (sha256 hex) of the layout-defining config fields, e.g. ``PLEConfig.layout_key()``
    plus the layer index. Keys are sorted, so dict order does not matter."""
    if not isinstance(fields, dict):
        raise ArgumentTypeError(f"layout fields must be a dict, got {type(fields).__name__}")
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def as_layout_hash(layout_hash: str | dict) -> tuple[str, dict | None]:
    if isinstance(layout_hash, dict):
        return hash_layout(layout_hash), layout_hash
    if isinstance(layout_hash, str) and layout_hash:
        return layout_hash, None
    raise ArgumentTypeError(f"layout_hash must be a non-empty str or a dict of layout fields, got {layout_hash!r}")


def align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def header_digest(header: dict[str, Any]) -> str:
    """blake2b-128 of the header's canonical JSON (sorted keys, no spaces), ``header_checksum`` left out."""
    body = {k: v for k, v in header.items() if k != "header_checksum"}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=DIGEST_SIZE).hexdigest()


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's bytes (one copy only if it is not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def ended(path: Path):
    """The error of a read of ``path`` past its end (for :func:`ple.common.files.pread_exact`)."""
    return lambda at: TableFileError(f"{path}: unexpected end of file at byte {at}")


def geometry(rows: int, head_dim: int, format: str, shard_rows: int) -> dict[str, Any]:
    for name, v in (("rows", rows), ("head_dim", head_dim), ("shard_rows", shard_rows)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(f"{name} must be an integer >= 1, got {v!r}")
    if head_dim > _MAX_HEAD_DIM:
        raise InvalidArgumentError(f"head_dim must be at most {_MAX_HEAD_DIM}, got {head_dim}")
    info = format_info(format)
    row_nbytes = info.row_nbytes(head_dim)
    if rows * (row_nbytes + 4) > _MAX_BYTES:
        raise InvalidArgumentError(
            f"a table of {rows} rows of {row_nbytes} bytes does not fit a table file (at most {_MAX_BYTES} bytes)"
        )
    num_shards = -(-rows // shard_rows)
    return {
        "format": format,
        "storage_dtype": str(info.storage_dtype).removeprefix("torch."),
        "rows": rows,
        "head_dim": head_dim,
        "row_nbytes": row_nbytes,
        "shard_rows": shard_rows,
        "num_shards": num_shards,
        "scale_kind": info.scale_kind,
    }


def scale_bytes(kind: str, rows: int) -> int:
    return {"none": 0, "global": 4, "row": 4 * rows}[kind]


def partial_pattern(name: str) -> re.Pattern[str]:
    """Temporary file names of writers of the table file ``name`` (and the fixed name of version 1)."""
    return re.compile(re.escape(name) + r"(\.\d+-[0-9a-f]{12})?" + re.escape(PARTIAL_SUFFIX))


def same_file(path: Path, st: os.stat_result) -> bool:
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def open_partials(path: Path, flags: int) -> Iterator[tuple[Path, int]]:
    """Each temporary file that writers of ``path`` left (regular files only; a symbolic link of such a
    name is removed, never followed), opened with ``flags`` (plus no-follow, non-blocking and
    close-on-exec): ``(name, descriptor)``, the descriptor the caller's to close."""
    for p, st in partial_entries(path.parent, partial_pattern(path.name)):
        if not stat.S_ISREG(st.st_mode):
            continue
        try:
            fd = os.open(p, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        yield p, fd


def sweep_partials(path: Path) -> list[Path]:
    """Remove the temporary files that crashed writers of ``path`` left (a symbolic link of such a name
    is removed, never followed); returns those of writers still at work (locked), left alone."""
    live: list[Path] = []
    for p, fd in open_partials(path, os.O_RDONLY):
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(p)
                continue
            if same_file(p, os.fstat(fd)):
                os.unlink(p)
        except OSError:
            pass
        finally:
            os.close(fd)  # releases the lock
    return live


_F = TypeVar("_F", bound="HeaderFields")


class HeaderFields:
    """Typed access to a parsed header (or a part of it, ``where`` its key path): every malformed field is
    a :class:`TableFileError` naming it."""

    def __init__(self, d: Any, path: str | os.PathLike, where: str = "") -> None:
        self.d, self.path, self.where = d, path, where

    def bad(self, key: str, expected: str) -> TableFileError:
        value = self.d.get(key, "<missing>") if isinstance(self.d, dict) else "<missing>"
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return TableFileError(f"{self.path}: header field '{self.where}{key}' is {shown}, expected {expected}")

    def integer(self, key: str, lo: int, hi: int = _MAX_BYTES) -> int:
        v = self.d.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.bad(key, f"an integer in [{lo}, {hi}]")
        return v

    def equal(self, key: str, want: Any, why: str = "") -> None:
        v = self.d.get(key)
        if type(v) is not type(want) or v != want:
            raise self.bad(key, repr(want) + (f" ({why})" if why else ""))

    def choice(self, key: str, options: tuple) -> Any:
        v = self.d.get(key)
        if not isinstance(v, str) or v not in options:
            raise self.bad(key, f"one of {list(options)}")
        return v

    def obj(self: _F, key: str) -> _F:
        v = self.d.get(key)
        if not isinstance(v, dict):
            raise self.bad(key, "a JSON object")
        return type(self)(v, self.path, f"{self.where}{key}.")


def _check_digest(fields: HeaderFields, key: str, allow_empty: bool) -> None:
    v = fields.d.get(key)
    if isinstance(v, str) and (_HEX32.match(v) or (allow_empty and v == "")):
        return
    raise fields.bad(key, "a blake2b-128 hex digest")


def _validate(header: Any, path: Path, header_end: int, file_size: int) -> dict[str, Any]:
    """The one table-header validator (see the module docstring); returns ``header`` or raises."""
    if not isinstance(header, dict) or header.get("magic") != "ple-table":
        raise TableFileError(f"{path}: header does not describe a PLE table")
    version = header.get("version")
    if version != VERSION or isinstance(version, bool):
        if isinstance(version, int) and not isinstance(version, bool) and 0 < version < VERSION:
            raise TableFileError(
                f"{path}: table file format version {version} was written by an older ple and is no longer read "
                f"(version {VERSION} checksums its header); convert the table again (ple convert)"
            )
        raise TableFileError(f"{path}: table file format version {version!r}, this reader knows {VERSION}")
    want = header.get("header_checksum")
    if not isinstance(want, str) or header_digest(header) != want:
        raise TableFileError(f"{path}: header checksum mismatch: the header was changed or damaged")
    f = HeaderFields(header, path)
    if not isinstance(header.get("complete"), bool):
        raise f.bad("complete", "true or false")
    info = format_info(f.choice("format", FORMATS))
    f.equal("storage_dtype", str(info.storage_dtype).removeprefix("torch."), f"what format {info.name!r} stores")
    f.equal("byte_order", "little")
    rows = f.integer("rows", 1)
    head_dim = f.integer("head_dim", 1, _MAX_HEAD_DIM)
    if info.blocked and head_dim % info.block:
        raise f.bad("head_dim", f"a multiple of {info.block}, the block of format {info.name!r}")
    row_nbytes = info.row_nbytes(head_dim)
    f.equal("row_nbytes", row_nbytes, f"head_dim {head_dim} in format {info.name!r}")
    data_nbytes = rows * row_nbytes
    f.equal("data_nbytes", data_nbytes, f"{rows} rows of {row_nbytes} bytes")
    data_offset = f.integer("data_offset", header_end)
    if data_offset % _ALIGN:
        raise f.bad("data_offset", f"a multiple of {_ALIGN}")
    s = f.obj("scale")
    s.equal("kind", info.scale_kind, f"the scale kind of format {info.name!r}")
    s.equal("dtype", "float32")
    scale_offset = s.integer("offset", data_offset + data_nbytes)
    if scale_offset % _ALIGN:
        raise s.bad("offset", f"a multiple of {_ALIGN} at or after the rows' end {data_offset + data_nbytes}")
    scale_nbytes = scale_bytes(info.scale_kind, rows)
    s.equal("nbytes", scale_nbytes, f"{info.scale_kind} scales of {rows} rows")
    f.equal("file_nbytes", scale_offset + scale_nbytes, "the end of the scales")
    if file_size != scale_offset + scale_nbytes:
        raise TableFileError(f"{path}: file is {file_size} bytes, its header says {scale_offset + scale_nbytes}")
    shard_rows = f.integer("shard_rows", 1)
    num_shards = -(-rows // shard_rows)
    f.equal("num_shards", num_shards, f"ceil(rows {rows} / shard_rows {shard_rows})")
    lh = header.get("layout_hash")
    if not isinstance(lh, str) or not lh:
        raise f.bad("layout_hash", "a non-empty string")
    layout = header.get("layout")
    if layout is not None and (not isinstance(layout, dict) or hash_layout(layout) != lh):
        raise f.bad("layout", "null or the layout fields whose hash is layout_hash")
    sparse = header.get("sparse")
    if not isinstance(sparse, bool):
        raise f.bad("sparse", "true or false")
    c = f.obj("checksum")
    c.equal("algorithm", CHECKSUM_ALGORITHM)
    complete = header["complete"]
    sums = c.d.get("shards")
    if sparse:
        if sums is not None:
            raise c.bad("shards", "null (a sparse file carries no checksums)")
    elif not isinstance(sums, list) or len(sums) != num_shards:
        raise c.bad("shards", f"a list of {num_shards} checksums, one per shard")
    else:
        for k in range(num_shards):
            v = sums[k]
            if not (isinstance(v, str) and (_HEX32.match(v) or (not complete and v == ""))):
                raise TableFileError(f"{path}: checksum of shard {k} is {v!r}, expected a blake2b-128 hex digest")
    if info.scale_kind == "global" and not sparse:
        _check_digest(c, "scale", allow_empty=not complete)
    elif c.d.get("scale") is not None:
        raise c.bad("scale", "null")
    if "merged" in header and not isinstance(header["merged"], dict):
        raise f.bad("merged", "a JSON object (what was merged into the table)")
    return header


def read_header_at(fd: int, path: Path) -> dict[str, Any]:
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, PREFIX, 0)
    if len(prefix) < PREFIX or prefix[:8] != MAGIC:
        raise TableFileError(f"{path} is not a PLE table file (bad magic {prefix[:8]!r}, expected {MAGIC!r})")
    n = int.from_bytes(prefix[8:], "little")
    if n > _MAX_HEADER or PREFIX + n > size:
        raise TableFileError(f"{path}: header length {n} is implausible for a file of {size} bytes")
    header = parse_json(pread_exact(fd, n, PREFIX, ended(path)), f"{path}: header", TableFileError)
    return _validate(header, path, PREFIX + n, size)


def read_open_header(fd: int, path: str | os.PathLike) -> dict[str, Any]:
    """The validated header of the table file ``path`` open as ``fd`` (see :func:`read_table_header`)."""
    return read_header_at(fd, Path(path))


def read_table_header(path: str | os.PathLike) -> dict[str, Any]:
    """The validated header of a table file (see the module docstring), complete or not.

    Raises :class:`TableFileError` for anything that is not a sound version-2 table file: not a
    regular file, bad magic, a header that is not JSON, a header checksum mismatch, malformed or
    inconsistent fields, a file size other than the header's."""
    path = Path(path)
    fd = open_regular(path, "table file", TableFileError)
    try:
        return read_header_at(fd, path)
    finally:
        os.close(fd)


def read_global_scale(fd: int, header: dict[str, Any], path: str | os.PathLike) -> float:
    """The global scale of a validated table file open as ``fd``; :class:`TableFileError` when it is not
    a positive finite number."""
    return _read_global_scale(fd, header, Path(path))


def _read_global_scale(fd: int, header: dict[str, Any], path: Path) -> float:
    (value,) = struct.unpack("<f", pread_exact(fd, 4, header["scale"]["offset"], ended(path)))
    if not (math.isfinite(value) and value > 0):
        raise TableFileError(f"{path}: the global scale is {value}, not a positive finite number")
    return value


def _check_row_scales(fd: int, header: dict[str, Any], path: Path, rows: tuple[int, int] | None = None) -> None:
    """Raise :class:`TableFileError` naming the first per-row scale of ``rows`` (``[first, end)``,
    default all) that is not a positive finite number (in a sparse file, where unwritten rows have
    scale 0: not a finite number >= 0). The scales are read with ``pread`` in chunks of 8 MiB
    (nothing mapped, memory bounded): 4 bytes per row, 1.3 GB for the published geometry's 320
    million rows, read once at open."""
    first, end = rows if rows is not None else (0, header["rows"])
    offset = header["scale"]["offset"]
    floor = np.float32(0.0)
    step = _READ_CHUNK // 4
    for start in range(first, end, step):
        stop = min(end, start + step)
        values = np.frombuffer(pread_exact(fd, 4 * (stop - start), offset + 4 * start, ended(path)), dtype="<f4")
        low, high = values.min(), values.max()  # NaN propagates into both
        if (low > floor or (header["sparse"] and low == floor)) and high < np.inf:
            continue
        ok = np.isfinite(values) & ((values >= floor) if header["sparse"] else (values > floor))
        i = int(np.argmin(ok))
        expected = "a finite number >= 0" if header["sparse"] else "a positive finite number"
        raise TableFileError(
            f"{path}: the per-row scale of row {start + i} is {float(values[i])}, not {expected} "
            "(the file was damaged or written by something else than ple)"
        )


def open_table_file(
    path: str | os.PathLike,
    expected_layout_hash: str | dict | None = None,
    *,
    scale_rows: tuple[int, int] | None = None,
) -> tuple[int, dict[str, Any], os.stat_result]:
    """``(fd, header, stat)`` of a complete table file that may be mapped: a read-only descriptor (the
    caller closes it), the validated header, and the file's status at open.

    Raises :class:`TableFileError` for a ``.partial`` name, an incomplete header, everything
    :func:`read_table_header` refuses, a global scale or a per-row scale that is not a positive
    finite number (every per-row scale is read once, see :func:`_check_row_scales`), and (given
    ``expected_layout_hash``, a hash or a fields dict) a file built for another layout.
    ``scale_rows=(first, end)`` checks the per-row scales of those rows only (a rank serving a
    range of rows); a range outside the file's rows is a :class:`TableFileError`."""
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise TableFileError(f"{path} is an unfinished table file (a {PARTIAL_SUFFIX!r} write never completed)")
    fd = open_regular(path, "table file", TableFileError)
    try:
        header = read_header_at(fd, path)
        if header["complete"] is not True:
            raise TableFileError(f"{path}: header says the file is incomplete (its writer never finished)")
        if header["scale"]["kind"] == "global":
            _read_global_scale(fd, header, path)
        if expected_layout_hash is not None:
            want, _ = as_layout_hash(expected_layout_hash)
            if header["layout_hash"] != want:
                raise TableFileError(
                    f"{path}: layout hash {header['layout_hash']} does not match the expected {want} "
                    f"(the table was built for another configuration; file layout fields: {header.get('layout')})"
                )
        st = os.fstat(fd)
        if scale_rows is not None and not 0 <= scale_rows[0] <= scale_rows[1] <= header["rows"]:
            raise TableFileError(
                f"{path}: rows [{scale_rows[0]}, {scale_rows[1]}) are not within [0, {header['rows']})"
            )
        if header["scale"]["kind"] == "row":  # after the cheap checks: a foreign file costs no scan
            _check_row_scales(fd, header, path, scale_rows)
            now = os.fstat(fd)
            if (now.st_size, now.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                raise TableFileError(f"{path} was changed while its scales were checked: open it again")
        return fd, header, st
    except BaseException:
        os.close(fd)
        raise
