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
``merged``, a JSON object naming the adapter and the table it was merged into (files without the
key read as before).

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

import errno
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ple.common.files import (
    PARTIAL_SUFFIX,
    fsync_dir,
    note_kept,
    open_regular,
    parse_json,
    partial_entries,
    pread_exact,
)
from ple.errors import ArgumentTypeError, InvalidArgumentError, PLEError
from ple.layout import shard_bounds
from ple.table.files.shard_writer import DIGEST_SIZE, ShardWriter, matching_shards, open_direct, pwrite_all
from ple.table.formats.catalog import FORMATS, check_scale_values, format_info

__all__ = [
    "ShardWriter",
    "TableFileError",
    "TableFileWriter",
    "hash_layout",
    "open_table",
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
_PREFIX = 16
_DIGEST_SIZE = DIGEST_SIZE
_CHECKSUM_ALGORITHM = "blake2b-128"
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


def _as_layout_hash(layout_hash: str | dict) -> tuple[str, dict | None]:
    if isinstance(layout_hash, dict):
        return hash_layout(layout_hash), layout_hash
    if isinstance(layout_hash, str) and layout_hash:
        return layout_hash, None
    raise ArgumentTypeError(f"layout_hash must be a non-empty str or a dict of layout fields, got {layout_hash!r}")


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _header_digest(header: dict[str, Any]) -> str:
    """blake2b-128 of the header's canonical JSON (sorted keys, no spaces), ``header_checksum`` left out."""
    body = {k: v for k, v in header.items() if k != "header_checksum"}
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=_DIGEST_SIZE).hexdigest()


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's bytes (one copy only if it is not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def _ended(path: Path):
    """The error of a read of ``path`` past its end (for :func:`ple.common.files.pread_exact`)."""
    return lambda at: TableFileError(f"{path}: unexpected end of file at byte {at}")


def _geometry(rows: int, head_dim: int, format: str, shard_rows: int) -> dict[str, Any]:
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


def _scale_nbytes(kind: str, rows: int) -> int:
    return {"none": 0, "global": 4, "row": 4 * rows}[kind]


def _partial_pattern(name: str) -> re.Pattern[str]:
    """Temporary file names of writers of the table file ``name`` (and the fixed name of version 1)."""
    return re.compile(re.escape(name) + r"(\.\d+-[0-9a-f]{12})?" + re.escape(PARTIAL_SUFFIX))


def _same_file(path: Path, st: os.stat_result) -> bool:
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _sweep_partials(path: Path) -> list[Path]:
    """Remove the temporary files that crashed writers of ``path`` left (a symbolic link of such a name
    is removed, never followed); returns those of writers still at work (locked), left alone."""
    live: list[Path] = []
    for p, st in partial_entries(path.parent, _partial_pattern(path.name)):
        if not stat.S_ISREG(st.st_mode):
            continue
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(p)
                continue
            if _same_file(p, os.fstat(fd)):
                os.unlink(p)
        except OSError:
            pass
        finally:
            os.close(fd)  # releases the lock
    return live


class TableFileWriter:
    """Writes one table file shard by shard, in any order, with bounded memory.

    Args:
        path: final file path; the file is built in a temporary file of its own beside it
            (``<name>.<pid>-<random>.partial``) and published under ``path`` by ``close()``.
        rows, head_dim: table geometry ``[rows, head_dim]``.
        format: format name (see :mod:`ple.table.formats.catalog`).
        shard_rows: rows per shard; shard ``k`` holds rows ``[k*shard_rows, min((k+1)*shard_rows, rows))``.
        layout_hash: hash of the layout-defining config fields (a str), or the fields themselves (a
            dict, hashed with :func:`hash_layout` and stored in the header too).
        force: replace an existing ``path`` (otherwise ``FileExistsError``), and write even while
            another writer of ``path`` is at work (the last to finish wins).
        sparse: build a sparse file (see the module docstring): rows written with ``write_rows``,
            no completeness check, no checksums.
        resume: a key naming the source and options: take over a temporary file a writer with the same
            key left (see the module docstring), and keep this one when interrupted.
        progress_room: header bytes to reserve for the caller's progress record (with ``resume``).

    Scales are checked as they come: a global scale and every per-row scale must be a positive
    finite number. Use as a context manager: an exception inside the block (Ctrl-C included) removes
    the temporary file. See the module docstring for what two writers of one path do.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        rows: int,
        head_dim: int,
        format: str,
        shard_rows: int,
        layout_hash: str | dict,
        force: bool = False,
        *,
        sparse: bool = False,
        resume: str | None = None,
        progress_room: int = 0,
        merged: dict[str, Any] | None = None,
    ) -> None:
        self._fd = self._dfd = -1
        self.merged = merged
        """The header's ``merged`` record (a merge's writer may complete it before ``close``, in place:
        at the same size, since the header's room is reserved at the start)."""
        self._resume = resume
        self._lock = threading.Lock()
        self._committed: dict[int, Any] = {}
        self.resumed: dict[int, Any] = {}
        """Shards a taken-over temporary file had committed: ``{k: the caller's progress record}``."""
        self.rejected: list[int] = []
        """Shards it had committed whose bytes no longer give their checksums (written again)."""
        self._closed = False
        self._ident: os.stat_result | None = None
        self.path = Path(path)
        if self.path.name.endswith(PARTIAL_SUFFIX):
            raise InvalidArgumentError(f"a table file name must not end with {PARTIAL_SUFFIX!r}: {self.path}")
        self.partial_path = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.force = force
        self.sparse = sparse
        self._geo = _geometry(rows, head_dim, format, shard_rows)
        self.rows, self.head_dim, self.format, self.shard_rows = rows, head_dim, format, shard_rows
        self.row_nbytes, self.scale_kind = self._geo["row_nbytes"], format_info(format).scale_kind
        self.num_shards = self._geo["num_shards"]
        self._info = format_info(format)
        self._layout_hash, self._layout = _as_layout_hash(layout_hash)
        if self.path.is_dir():
            raise InvalidArgumentError(f"table file {self.path} is a folder")
        if os.path.lexists(self.path) and not force:
            raise FileExistsError(errno.EEXIST, "table file exists: pass force=True to replace it", str(self.path))
        self._checksums: list[str | None] = [None] * self.num_shards
        self._written = [False] * self.num_shards
        self._global_scale: float | None = None
        self._scale_checksum: str | None = None
        room = 0 if resume is None else len(resume) + progress_room + 256
        self._data_offset = _align(_PREFIX + len(self._header_json(complete=True, capacity_probe=True)) + 1024 + room)
        self._data_nbytes = rows * self._geo["row_nbytes"]
        self._scale_offset = _align(self._data_offset + self._data_nbytes)
        self._scale_nbytes = _scale_nbytes(self._info.scale_kind, rows)
        self._file_nbytes = self._scale_offset + self._scale_nbytes
        if resume is not None and self._take_over():
            self._dfd = -1 if sparse else open_direct(self.partial_path, self._ident)
            return
        live = _sweep_partials(self.path)
        if live and not force:
            raise FileExistsError(
                errno.EEXIST,
                f"another writer is at work on this table file (its temporary file {live[0].name}); "
                "wait for it, or pass force=True to write anyway (the last writer to finish wins)",
                str(self.path),
            )
        self._create()
        try:
            self._io(os.ftruncate, self._fd, self._file_nbytes)
            self._write_header(complete=False)
            self._dfd = -1 if sparse else open_direct(self.partial_path, self._ident)
        except BaseException:
            self.abort()
            raise

    def _create(self) -> None:
        """Create this writer's own temporary file, exclusively and never through a link, and lock it."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(16):
            partial = self.path.with_name(f"{self.path.name}.{os.getpid()}-{secrets.token_hex(6)}{PARTIAL_SUFFIX}")
            try:
                fd = os.open(partial, flags, 0o644)
            except OSError as e:  # a read-only or missing folder: name the table file, not the temporary one
                raise type(e)(e.errno, e.strerror, str(self.path)) from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                st = os.fstat(fd)
                if _same_file(partial, st):
                    self.partial_path, self._fd, self._ident = partial, fd, st
                    return
            except BlockingIOError:
                pass  # a sweeper took it for a stale file in the instant before the lock: it removes it
            os.close(fd)
        raise TableFileError(f"could not create a temporary file for {self.path}: other processes removed every try")

    def _take_over(self) -> bool:
        """Adopt an unlocked temporary file of this path whose header (complete false) has this writer's
        resume key and geometry; True when one was taken."""
        for p, st in partial_entries(self.path.parent, _partial_pattern(self.path.name)):
            if not stat.S_ISREG(st.st_mode):
                continue
            try:
                fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                ident = os.fstat(fd)
                if _same_file(p, ident) and self._adopt(fd, _read_header(fd, p)):
                    self.partial_path, self._fd, self._ident = p, fd, ident
                    return True
            except (OSError, TableFileError, ValueError):
                pass
            os.close(fd)
        return False

    def _adopt(self, fd: int, header: dict[str, Any]) -> bool:
        mine = self._header(complete=False)
        same = ("format", "rows", "head_dim", "row_nbytes", "shard_rows", "layout_hash", "data_offset", "scale")
        if header["complete"] or header.get("resume") != self._resume or header["sparse"]:
            return False
        if any(header[k] != mine[k] for k in same) or header["file_nbytes"] != self._file_nbytes:
            return False
        record = parse_json(header.get("progress") or "{}", f"{self.path}: progress record", TableFileError)
        sums = header["checksum"]["shards"]
        record = record if isinstance(record, dict) else {}
        done = {k: record[str(k)] for k in range(self.num_shards) if sums[k] and str(k) in record}
        good = matching_shards(self, fd, {k: sums[k] for k in done})  # bytes hashed again
        self.rejected = sorted(set(done) - good)
        done = {k: v for k, v in done.items() if k in good}
        if self._info.scale_kind == "global" and header["checksum"]["scale"]:
            b = pread_exact(fd, 4, self._scale_offset, _ended(self.path))
            if hashlib.blake2b(b, digest_size=_DIGEST_SIZE).hexdigest() != header["checksum"]["scale"]:
                return False
            self._global_scale = struct.unpack("<f", b)[0]
            self._scale_checksum = header["checksum"]["scale"]
        for k in done:
            self._checksums[k], self._written[k] = sums[k], True
        self.resumed = dict(done)
        self._committed = dict(done)
        return True

    # ------------------------------------------------------------------ what a ShardWriter writes through
    def row_place(self, row: int) -> int:
        """The file offset of row ``row``'s first byte."""
        return self._data_offset + row * self._geo["row_nbytes"]

    def scale_place(self, row: int) -> int:
        """The file offset of row ``row``'s per-row scale."""
        return self._scale_offset + 4 * row

    @property
    def direct(self) -> bool:
        """Whether whole pages may be written with ``O_DIRECT`` (:meth:`pwrite`)."""
        return self._dfd >= 0

    def pwrite(self, data, offset: int, direct: bool = False) -> None:
        """``data`` at ``offset`` of the temporary file (``direct``: whole pages from a page-aligned
        buffer, with ``O_DIRECT`` where the file system takes it); an OSError names the table file."""
        fd = self._dfd if direct else -1
        if fd >= 0:
            try:
                return self._io(pwrite_all, fd, data, offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct_refused()  # a file system that takes O_DIRECT at open but not at write
        self._io(pwrite_all, self._fd, data, offset)

    def record_checksum(self, k: int, digest: str) -> None:
        with self._lock:
            self._checksums[k] = digest

    def _direct_refused(self) -> None:
        """Close the ``O_DIRECT`` descriptor: rows go through the page cache from now on."""
        with self._lock:
            if self._dfd >= 0:
                os.close(self._dfd)
                self._dfd = -1

    def _io(self, fn, *args):
        """Run an OS call on the temporary file; an OSError names the table file being written."""
        try:
            return fn(*args)
        except OSError as e:
            if e.filename is not None:
                raise
            raise type(e)(e.errno, e.strerror, str(self.path)) from e

    # ------------------------------------------------------------------ header
    def _header(self, complete: bool, capacity_probe: bool = False) -> dict[str, Any]:
        geo = self._geo
        if capacity_probe:
            checksums = None if self.sparse else ["0" * (2 * _DIGEST_SIZE)] * geo["num_shards"]
            offsets = {"data_offset": 10**15, "scale_offset": 10**15, "file_nbytes": 10**15}
            scale_sum = "0" * (2 * _DIGEST_SIZE)
        else:
            checksums = None if self.sparse else [c or "" for c in self._checksums]
            if self._resume is not None and not complete:  # a shard counts once committed
                checksums = [(c or "") if k in self._committed else "" for k, c in enumerate(self._checksums)]
            offsets = {
                "data_offset": self._data_offset,
                "scale_offset": self._scale_offset,
                "file_nbytes": self._file_nbytes,
            }
            scale_sum = self._scale_checksum or ""
        header = {
            "magic": "ple-table",
            "version": VERSION,
            "complete": complete,
            "format": geo["format"],
            "storage_dtype": geo["storage_dtype"],
            "byte_order": "little",
            "rows": geo["rows"],
            "head_dim": geo["head_dim"],
            "row_nbytes": geo["row_nbytes"],
            "data_offset": offsets["data_offset"],
            "data_nbytes": geo["rows"] * geo["row_nbytes"],
            "scale": {
                "kind": geo["scale_kind"],
                "dtype": "float32",
                "offset": offsets["scale_offset"],
                "nbytes": _scale_nbytes(geo["scale_kind"], geo["rows"]),
            },
            "shard_rows": geo["shard_rows"],
            "num_shards": geo["num_shards"],
            "layout_hash": self._layout_hash,
            "layout": self._layout,
            "sparse": self.sparse,
            "checksum": {
                "algorithm": _CHECKSUM_ALGORITHM,
                "covers": "per shard: its row bytes, then its per-row scale bytes; 'scale': the global scale",
                "shards": checksums,
                "scale": None if self.sparse or geo["scale_kind"] != "global" else scale_sum,
            },
            "file_nbytes": offsets["file_nbytes"],
        }
        if self.merged is not None:
            header["merged"] = self.merged
        if self._resume is not None and not complete and not capacity_probe:
            header["resume"] = self._resume
            header["progress"] = json.dumps({str(k): v for k, v in self._committed.items()}, separators=(",", ":"))
        header = json.loads(json.dumps(header, default=str))  # what a reader will parse
        header["header_checksum"] = "0" * (2 * _DIGEST_SIZE) if capacity_probe else _header_digest(header)
        return header

    def _header_json(self, complete: bool, capacity_probe: bool = False) -> bytes:
        return json.dumps(self._header(complete, capacity_probe), indent=1).encode()

    def _write_header(self, complete: bool) -> None:
        blob = self._header_json(complete)
        room = self._data_offset - _PREFIX
        if len(blob) > room:  # a progress record larger than the room its caller asked for
            raise TableFileError(f"table header of {len(blob)} bytes exceeds its {room} reserved bytes")
        prefix = MAGIC + len(blob).to_bytes(8, "little")
        self._io(pwrite_all, self._fd, prefix + blob + b" " * (room - len(blob)), 0)

    # ------------------------------------------------------------------ writing
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"table file writer for {self.path} is closed")

    def shard_range(self, k: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of shard ``k`` (empty past the end)."""
        return shard_bounds(k, self.shard_rows, self.rows)

    def _check_rows(self, rows: torch.Tensor, n: int, what: str) -> None:
        width = self._info.width(self.head_dim)
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (n, width):
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise InvalidArgumentError(f"{what}: expected rows of shape [{n}, {width}], got {shape}")
        if rows.dtype != self._info.storage_dtype:
            raise InvalidArgumentError(
                f"{what}: format {self.format!r} stores {self._info.storage_dtype}, got rows of dtype {rows.dtype}"
            )

    def _row_scale(self, scale: torch.Tensor | None, n: int, what: str, first_row: int = 0) -> np.ndarray | None:
        kind = self._info.scale_kind
        if kind == "none":
            if scale is not None:
                raise InvalidArgumentError(
                    f"{what}: format {self.format!r} has no scale, got one of shape {tuple(scale.shape)}"
                )
            return None
        if kind == "global":
            if scale is not None:
                self.set_global_scale(scale)
            return None
        if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != (n, 1) or not scale.is_floating_point():
            got = None if not isinstance(scale, torch.Tensor) else f"{tuple(scale.shape)} {scale.dtype}"
            raise InvalidArgumentError(
                f"{what}: format {self.format!r} needs a float per-row scale [{n}, 1], got {got}"
            )
        s32 = scale.detach().to("cpu", torch.float32)
        check_scale_values(s32, what, first_row=first_row)
        return tensor_bytes(s32)

    def set_global_scale(self, scale: torch.Tensor | float) -> None:
        """Set the global scale of an "fp8" or "nvfp4" table (one positive finite value; setting it again must agree)."""
        self._check_open()
        if self._info.scale_kind != "global":
            raise InvalidArgumentError(f"format {self.format!r} has no global scale")
        t = torch.as_tensor(scale, dtype=torch.float32).reshape(-1)
        if t.numel() != 1:
            raise InvalidArgumentError(
                f"a global scale has one element, got shape {tuple(torch.as_tensor(scale).shape)}"
            )
        check_scale_values(t, "the global scale")
        with self._lock:
            self._set_global_scale(t)

    def _set_global_scale(self, t: torch.Tensor) -> None:
        value = float(t[0])
        if self._global_scale is not None:
            if value != self._global_scale:
                raise InvalidArgumentError(
                    f"global scale {value} disagrees with the one already set, {self._global_scale}"
                )
            return
        b = tensor_bytes(t)
        self._io(pwrite_all, self._fd, b, self._scale_offset)
        self._global_scale = value
        self._scale_checksum = hashlib.blake2b(b.tobytes(), digest_size=_DIGEST_SIZE).hexdigest()

    def write_shard(self, k: int, rows: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Write shard ``k``: ``rows [stop-start, head_dim]`` in the storage dtype; ``scale`` is the
        shard's per-row scale ``[stop-start, 1]``, or the global scale (``[1]``) for "fp8".

        Shards come in any order, each once. An empty shard past the end is accepted (and ignored).
        """
        self._check_open()
        start, stop = self.shard_range(k)
        what = f"shard {k} (rows [{start}, {stop}))"
        if start == stop:
            if rows.shape[0] != 0:
                raise InvalidArgumentError(
                    f"shard {k} lies past the table's {self.rows} rows, but {rows.shape[0]} rows were given"
                )
            if self._info.scale_kind == "global":
                self._row_scale(scale, 0, what)
            return
        self._check_rows(rows, stop - start, what)
        scale_bytes = self._row_scale(scale, stop - start, what, first_row=start)
        part = self.shard_writer(k)
        part.write(tensor_bytes(rows), scale_bytes)
        part.finish()

    def shard_writer(self, k: int) -> ShardWriter:
        """A writer of shard ``k``'s rows in order, in parts (:class:`ShardWriter`); shards in any order,
        each once, from any thread (one thread per shard)."""
        self._check_open()
        start, stop = self.shard_range(k)
        if start == stop:
            raise InvalidArgumentError(f"shard {k} lies past the table's {self.rows} rows")
        with self._lock:
            if self._written[k]:
                raise InvalidArgumentError(f"shard {k} (rows [{start}, {stop})) was already written")
            self._written[k] = True
        return ShardWriter(self, k, start, stop)

    def commit(self, k: int, record: Any = None) -> None:
        """Record shard ``k`` as done in the temporary file (resumable writers): its data synced, then the
        header with its checksum and ``record`` (JSON; :attr:`resumed` gives it back to the next writer)."""
        if self._resume is None:
            return
        with self._lock:
            if self._checksums[k] is None:
                raise InvalidArgumentError(f"shard {k} is not finished: it cannot be committed")
            self._io(os.fdatasync, self._fd)
            self._committed[k] = record
            self._write_header(complete=False)
            if hasattr(os, "posix_fadvise"):  # synced rows are clean: leave the page cache to others
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def write_rows(self, row_ids: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Sparse files only: write ``rows [n, head_dim]`` at ``row_ids [n]`` (int64, any order; a
        repeated id keeps its last row). ``scale``: per-row ``[n, 1]``, or the global scale."""
        self._check_open()
        if not self.sparse:
            raise InvalidArgumentError(
                "write_rows is for sparse files (sparse=True); complete files are written by shard"
            )
        ids = torch.as_tensor(row_ids).reshape(-1).cpu()
        if ids.dtype != torch.int64:
            raise InvalidArgumentError(f"row ids must be int64, got {ids.dtype}")
        n = ids.numel()
        self._check_rows(rows, n, "write_rows")
        scale_bytes = self._row_scale(scale, n, "write_rows")
        if n == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.rows:
            bad = lo if lo < 0 else hi
            raise InvalidArgumentError(f"row id {bad} is out of range: the table has rows [0, {self.rows})")
        row_bytes = tensor_bytes(rows).reshape(n, -1)
        srow = None if scale_bytes is None else scale_bytes.reshape(n, 4)
        rn = self._geo["row_nbytes"]
        for i, r in enumerate(ids.tolist()):
            self._io(pwrite_all, self._fd, row_bytes[i], self._data_offset + r * rn)
            if srow is not None:
                self._io(pwrite_all, self._fd, srow[i], self._scale_offset + 4 * r)

    # ------------------------------------------------------------------ finishing
    def close(self) -> Path:
        """Check completeness, write the final header, fsync, and publish the file under ``path``."""
        if self._closed:
            return self.path
        try:
            if not self.sparse:
                missing = [k for k in range(self.num_shards) if self._checksums[k] is None]
                if missing:
                    shown = ", ".join(str(k) for k in missing[:8]) + (" ..." if len(missing) > 8 else "")
                    raise InvalidArgumentError(
                        f"table file {self.path}: {len(missing)} of {self.num_shards} shards were never written ({shown})"
                    )
            if self._info.scale_kind == "global" and self._global_scale is None:
                raise InvalidArgumentError(
                    f"table file {self.path}: format {self.format!r} needs a global scale, none was set"
                )
            self._direct_refused()  # the O_DIRECT descriptor is done with
            self._io(os.fsync, self._fd)
            self._write_header(complete=True)
            self._io(os.fsync, self._fd)
            if hasattr(os, "posix_fadvise"):
                # the rows just written are clean now: drop them from the page cache, so a process that
                # maps the file later holds only the rows it reads, not the whole freshly written table
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self._publish()
            os.close(self._fd)  # releases the lock, after the file is published
            self._fd = -1
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return self.path

    def _publish(self) -> None:
        assert self._ident is not None
        if not _same_file(self.partial_path, self._ident):
            raise TableFileError(
                f"the temporary file of {self.path} ({self.partial_path.name}) was removed or replaced by another "
                "process while it was written; nothing was published"
            )
        if self.force:
            if self.path.is_dir():
                raise InvalidArgumentError(f"table file {self.path} is a folder")
            os.replace(self.partial_path, self.path)
        else:
            exists = FileExistsError(
                errno.EEXIST,
                "table file exists (another writer may have published it meanwhile): pass force=True to replace it",
                str(self.path),
            )
            try:
                os.link(self.partial_path, self.path)  # fails if the path appeared meanwhile
            except FileExistsError:
                raise exists from None
            except OSError:  # a filesystem without hard links
                if os.path.lexists(self.path):
                    raise exists from None
                os.replace(self.partial_path, self.path)
            else:
                os.unlink(self.partial_path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Drop the temporary file; no table file is published."""
        self._closed = True
        try:
            if self._ident is not None and _same_file(self.partial_path, self._ident):
                os.unlink(self.partial_path)
        except FileNotFoundError:
            pass
        finally:
            self._direct_refused()
            if self._fd >= 0:
                fd, self._fd = self._fd, -1
                os.close(fd)

    def __enter__(self) -> TableFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._resume is not None and issubclass(exc_type, KeyboardInterrupt) and self._committed:
            self.keep(exc)
        else:
            self.abort()

    def keep(self, interruption: BaseException | None = None) -> None:
        """Stop, keeping the temporary file with its committed shards for the next writer of the same
        path and key; nothing is published. A line says so: on stderr now, or, given the
        ``interruption`` passing by, noted on it (:func:`ple.common.files.note_kept`: said once it is handled,
        if the file is still there then)."""
        self._closed = True
        self._direct_refused()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        done = f"{len(self._committed)} of {self.num_shards} shards done"
        note_kept(interruption, self.partial_path, f"kept {self.partial_path} ({done}): the same conversion run again continues it; delete it to start over")  # fmt: skip


# ---------------------------------------------------------------------- reading


class _Fields:
    """Typed access to a parsed header: every malformed field is a :class:`TableFileError` naming it."""

    def __init__(self, d: Any, path: Path, where: str = "") -> None:
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

    def obj(self, key: str) -> _Fields:
        v = self.d.get(key)
        if not isinstance(v, dict):
            raise self.bad(key, "a JSON object")
        return _Fields(v, self.path, f"{self.where}{key}.")


def _check_digest(fields: _Fields, key: str, allow_empty: bool) -> None:
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
    if not isinstance(want, str) or _header_digest(header) != want:
        raise TableFileError(f"{path}: header checksum mismatch: the header was changed or damaged")
    f = _Fields(header, path)
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
    scale_nbytes = _scale_nbytes(info.scale_kind, rows)
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
    c.equal("algorithm", _CHECKSUM_ALGORITHM)
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


def _read_header(fd: int, path: Path) -> dict[str, Any]:
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, _PREFIX, 0)
    if len(prefix) < _PREFIX or prefix[:8] != MAGIC:
        raise TableFileError(f"{path} is not a PLE table file (bad magic {prefix[:8]!r}, expected {MAGIC!r})")
    n = int.from_bytes(prefix[8:], "little")
    if n > _MAX_HEADER or _PREFIX + n > size:
        raise TableFileError(f"{path}: header length {n} is implausible for a file of {size} bytes")
    header = parse_json(pread_exact(fd, n, _PREFIX, _ended(path)), f"{path}: header", TableFileError)
    return _validate(header, path, _PREFIX + n, size)


def read_open_header(fd: int, path: str | os.PathLike) -> dict[str, Any]:
    """The validated header of the table file ``path`` open as ``fd`` (see :func:`read_table_header`)."""
    return _read_header(fd, Path(path))


def read_table_header(path: str | os.PathLike) -> dict[str, Any]:
    """The validated header of a table file (see the module docstring), complete or not.

    Raises :class:`TableFileError` for anything that is not a sound version-2 table file: not a
    regular file, bad magic, a header that is not JSON, a header checksum mismatch, malformed or
    inconsistent fields, a file size other than the header's."""
    path = Path(path)
    fd = open_regular(path, "table file", TableFileError)
    try:
        return _read_header(fd, path)
    finally:
        os.close(fd)


def read_global_scale(fd: int, header: dict[str, Any], path: str | os.PathLike) -> float:
    """The global scale of a validated table file open as ``fd``; :class:`TableFileError` when it is not
    a positive finite number."""
    return _read_global_scale(fd, header, Path(path))


def _read_global_scale(fd: int, header: dict[str, Any], path: Path) -> float:
    (value,) = struct.unpack("<f", pread_exact(fd, 4, header["scale"]["offset"], _ended(path)))
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
        values = np.frombuffer(pread_exact(fd, 4 * (stop - start), offset + 4 * start, _ended(path)), dtype="<f4")
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


def open_table(
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
        header = _read_header(fd, path)
        if header["complete"] is not True:
            raise TableFileError(f"{path}: header says the file is incomplete (its writer never finished)")
        if header["scale"]["kind"] == "global":
            _read_global_scale(fd, header, path)
        if expected_layout_hash is not None:
            want, _ = _as_layout_hash(expected_layout_hash)
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
