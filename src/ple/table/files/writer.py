"""Writing a table file: :class:`TableFileWriter` (the file's layout, its header and what two writers
of one path do are described in :mod:`ple.table.files.table_file`).

The writer makes the file under a private temporary name, takes over or continues a ``.partial``
left by an earlier writer of the same conversion, writes shards whole or in parts (a
:class:`~ple.table.files.shard_writer.ShardWriter`), checks every scale as it comes, and publishes
the file by renaming it into place once every shard's checksum is recorded.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
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
    parse_json,
    pread_exact,
)
from ple.errors import InvalidArgumentError
from ple.layout import shard_bounds
from ple.table.files.shard_writer import DIGEST_SIZE, ShardWriter, matching_shards, open_direct, pwrite_all
from ple.table.formats.catalog import check_scale_values, format_info

__all__ = ["TableFileWriter"]
from ple.table.files.table_file import (
    CHECKSUM_ALGORITHM,
    MAGIC,
    PREFIX,
    VERSION,
    TableFileError,
    align,
    as_layout_hash,
    ended,
    geometry,
    header_digest,
    open_partials,
    read_header_at,
    same_file,
    scale_bytes,
    sweep_partials,
    tensor_bytes,
)


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
    the temporary file. See :mod:`ple.table.files.table_file` for what two writers of one path do.
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
        self._geo = geometry(rows, head_dim, format, shard_rows)
        self.rows, self.head_dim, self.format, self.shard_rows = rows, head_dim, format, shard_rows
        self.row_nbytes, self.scale_kind = self._geo["row_nbytes"], format_info(format).scale_kind
        self.num_shards = self._geo["num_shards"]
        self._info = format_info(format)
        self._layout_hash, self._layout = as_layout_hash(layout_hash)
        if self.path.is_dir():
            raise InvalidArgumentError(f"table file {self.path} is a folder")
        if os.path.lexists(self.path) and not force:
            raise FileExistsError(errno.EEXIST, "table file exists: pass force=True to replace it", str(self.path))
        self._checksums: list[str | None] = [None] * self.num_shards
        self._written = [False] * self.num_shards
        self._global_scale: float | None = None
        self._scale_checksum: str | None = None
        room = 0 if resume is None else len(resume) + progress_room + 256
        self._data_offset = align(PREFIX + len(self._header_json(complete=True, capacity_probe=True)) + 1024 + room)
        self._data_nbytes = rows * self._geo["row_nbytes"]
        self._scale_offset = align(self._data_offset + self._data_nbytes)
        self._scale_nbytes = scale_bytes(self._info.scale_kind, rows)
        self._file_nbytes = self._scale_offset + self._scale_nbytes
        if resume is not None and self._take_over():
            self._dfd = -1 if sparse else open_direct(self.partial_path, self._ident)
            return
        live = sweep_partials(self.path)
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
                if same_file(partial, st):
                    self.partial_path, self._fd, self._ident = partial, fd, st
                    return
            except BlockingIOError:
                pass  # a sweeper took it for a stale file in the instant before the lock: it removes it
            os.close(fd)
        raise TableFileError(f"could not create a temporary file for {self.path}: other processes removed every try")

    def _take_over(self) -> bool:
        """Adopt an unlocked temporary file of this path whose header (complete false) has this writer's
        resume key and geometry; True when one was taken."""
        for p, fd in open_partials(self.path, os.O_RDWR):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                ident = os.fstat(fd)
                if same_file(p, ident) and self._adopt(fd, read_header_at(fd, p)):
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
            b = pread_exact(fd, 4, self._scale_offset, ended(self.path))
            if hashlib.blake2b(b, digest_size=DIGEST_SIZE).hexdigest() != header["checksum"]["scale"]:
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
            checksums = None if self.sparse else ["0" * (2 * DIGEST_SIZE)] * geo["num_shards"]
            offsets = {"data_offset": 10**15, "scale_offset": 10**15, "file_nbytes": 10**15}
            scale_sum = "0" * (2 * DIGEST_SIZE)
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
                "nbytes": scale_bytes(geo["scale_kind"], geo["rows"]),
            },
            "shard_rows": geo["shard_rows"],
            "num_shards": geo["num_shards"],
            "layout_hash": self._layout_hash,
            "layout": self._layout,
            "sparse": self.sparse,
            "checksum": {
                "algorithm": CHECKSUM_ALGORITHM,
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
        header["header_checksum"] = "0" * (2 * DIGEST_SIZE) if capacity_probe else header_digest(header)
        return header

    def _header_json(self, complete: bool, capacity_probe: bool = False) -> bytes:
        return json.dumps(self._header(complete, capacity_probe), indent=1).encode()

    def _write_header(self, complete: bool) -> None:
        blob = self._header_json(complete)
        room = self._data_offset - PREFIX
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
        self._scale_checksum = hashlib.blake2b(b.tobytes(), digest_size=DIGEST_SIZE).hexdigest()

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
        if not same_file(self.partial_path, self._ident):
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
            if self._ident is not None and same_file(self.partial_path, self._ident):
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
