"""Table files: one memory-mappable file per PLE layer, written atomically, verified by checksums.

File layout (all integers little-endian)::

    [0, 8)                 magic b"PLETABLE"
    [8, 16)                header length L (uint64)
    [16, 16 + L)           header: UTF-8 JSON (see below), space-padded up to data_offset
    [data_offset, ...)     rows: rows * head_dim values of the storage dtype, row-major
    [scale_offset, ...)    scales, float32: 1 value (global) or one per row (per-row formats)

``data_offset`` and ``scale_offset`` are multiples of 4096. The header records the geometry
(``rows``, ``head_dim``, ``format``, ``storage_dtype``), where the rows and scales are, the caller's
``layout_hash`` (see :func:`hash_layout`), the shard geometry (``shard_rows``, ``num_shards``) and
one blake2b-128 checksum per shard covering the shard's row bytes followed by its per-row scale
bytes (plus one for a global scale).

Atomic publication: the writer fills ``path + ".partial"`` whose header says ``"complete": false``;
``close()`` checks every shard was written, writes the final header (``"complete": true``), fsyncs
and renames the file to ``path`` (then fsyncs the directory). A crash at any point leaves at most a
``.partial`` file, which :func:`open_table_file` (and so :meth:`ple.table.MmapTable.open`) refuses (by name and by its header).

Sparse files (``TableFileWriter(..., sparse=True)``, :func:`write_sparse_table_file`) are for tests
and benchmarks at full geometry: the file is sized with ``ftruncate`` (unwritten rows read as
zeros and take no disk space), rows are written by id, no shard needs to be complete, and no
checksums are computed (``"checksum": {"shards": null}``); :func:`verify_table_file` reports such a
file as unverifiable.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ArgumentTypeError, InvalidArgumentError, PLEError
from ..layout import shard_bounds
from .formats import format_info

__all__ = [
    "TableFileError",
    "TableFileWriter",
    "hash_layout",
    "open_table_file",
    "pread_file",
    "tensor_bytes",
    "read_table_header",
    "verify_table_file",
    "write_sparse_table_file",
    "PARTIAL_SUFFIX",
    "TABLE_SUFFIX",
]

MAGIC = b"PLETABLE"
VERSION = 1
PARTIAL_SUFFIX = ".partial"
TABLE_SUFFIX = ".pletable"
"""The file name suffix of table files (``ple convert`` writes ``<layer prefix>.pletable``)."""
_ALIGN = 4096
_PREFIX = 16
_DIGEST_SIZE = 16
_CHECKSUM_ALGORITHM = "blake2b-128"
_READ_CHUNK = 8 << 20


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


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's bytes (one copy only if it is not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def _pwrite_all(fd: int, buf, offset: int) -> None:
    view = memoryview(buf).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    parts = []
    while n > 0:
        b = os.pread(fd, min(n, _READ_CHUNK), offset)
        if not b:
            raise TableFileError(f"unexpected end of file at byte {offset}")
        parts.append(b)
        n -= len(b)
        offset += len(b)
    return b"".join(parts)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _geometry(rows: int, head_dim: int, format: str, shard_rows: int) -> dict[str, Any]:
    for name, v in (("rows", rows), ("head_dim", head_dim), ("shard_rows", shard_rows)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(f"{name} must be an integer >= 1, got {v!r}")
    info = format_info(format)
    row_nbytes = head_dim * info.itemsize
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


class TableFileWriter:
    """Writes one table file shard by shard, in any order, with bounded memory.

    Args:
        path: final file path; the file is built at ``path + ".partial"`` and renamed by ``close()``.
        rows, head_dim: table geometry ``[rows, head_dim]``.
        format: format name (see :mod:`ple.table.formats`).
        shard_rows: rows per shard; shard ``k`` holds rows ``[k*shard_rows, min((k+1)*shard_rows, rows))``.
        layout_hash: hash of the layout-defining config fields (a str), or the fields themselves (a
            dict, hashed with :func:`hash_layout` and stored in the header too).
        force: replace an existing ``path`` (otherwise ``FileExistsError``).
        sparse: build a sparse file (see the module docstring): rows written with ``write_rows``,
            no completeness check, no checksums.

    A stale ``.partial`` from an interrupted run is replaced. Use as a context manager: an
    exception inside the block removes the partial file.
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
    ) -> None:
        self.path = Path(path)
        if self.path.name.endswith(PARTIAL_SUFFIX):
            raise InvalidArgumentError(f"a table file name must not end with {PARTIAL_SUFFIX!r}: {self.path}")
        self.partial_path = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        self.force = force
        self.sparse = sparse
        self._geo = _geometry(rows, head_dim, format, shard_rows)
        self.rows, self.head_dim, self.format, self.shard_rows = rows, head_dim, format, shard_rows
        self.num_shards = self._geo["num_shards"]
        self._info = format_info(format)
        self._layout_hash, self._layout = _as_layout_hash(layout_hash)
        if self.path.exists() and not force:
            raise FileExistsError(f"table file {self.path} exists: pass force=True to replace it")
        self._checksums: list[str | None] = [None] * self.num_shards
        self._written = [False] * self.num_shards
        self._global_scale: float | None = None
        self._scale_checksum: str | None = None

        row_nbytes = self._geo["row_nbytes"]
        kind = self._info.scale_kind
        scale_nbytes = {"none": 0, "global": 4, "row": 4 * rows}[kind]
        header_cap = _align(_PREFIX + len(self._header_json(complete=True, capacity_probe=True)) + 1024)
        self._data_offset = header_cap
        data_nbytes = rows * row_nbytes
        self._scale_offset = _align(header_cap + data_nbytes)
        self._scale_nbytes = scale_nbytes
        self._file_nbytes = self._scale_offset + scale_nbytes
        self._data_nbytes = data_nbytes
        self._closed = False
        self._fd = -1
        fd = os.open(self.partial_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fd = fd
        try:
            os.ftruncate(fd, self._file_nbytes)
            self._write_header(complete=False)
        except BaseException:
            self.abort()
            raise

    # ------------------------------------------------------------------ header
    def _header(self, complete: bool, capacity_probe: bool = False) -> dict[str, Any]:
        geo = self._geo
        if capacity_probe:
            checksums = None if self.sparse else ["0" * (2 * _DIGEST_SIZE)] * geo["num_shards"]
            offsets = {"data_offset": 10**15, "scale_offset": 10**15, "file_nbytes": 10**15}
            scale_sum = "0" * (2 * _DIGEST_SIZE)
        else:
            checksums = None if self.sparse else [c or "" for c in self._checksums]
            offsets = {
                "data_offset": self._data_offset,
                "scale_offset": self._scale_offset,
                "file_nbytes": self._file_nbytes,
            }
            scale_sum = self._scale_checksum or ""
        return {
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
                "nbytes": {"none": 0, "global": 4, "row": 4 * geo["rows"]}[geo["scale_kind"]],
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

    def _header_json(self, complete: bool, capacity_probe: bool = False) -> bytes:
        return json.dumps(self._header(complete, capacity_probe), indent=1).encode()

    def _write_header(self, complete: bool) -> None:
        blob = self._header_json(complete)
        room = self._data_offset - _PREFIX
        if len(blob) > room:  # pragma: no cover - the capacity probe sizes the room generously
            raise RuntimeError(f"table header of {len(blob)} bytes exceeds its {room} reserved bytes")
        prefix = MAGIC + len(blob).to_bytes(8, "little")
        _pwrite_all(self._fd, prefix + blob + b" " * (room - len(blob)), 0)

    # ------------------------------------------------------------------ writing
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"table file writer for {self.path} is closed")

    def shard_range(self, k: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of shard ``k`` (empty past the end)."""
        return shard_bounds(k, self.shard_rows, self.rows)

    def _check_rows(self, rows: torch.Tensor, n: int, what: str) -> None:
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (n, self.head_dim):
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise InvalidArgumentError(f"{what}: expected rows of shape [{n}, {self.head_dim}], got {shape}")
        if rows.dtype != self._info.storage_dtype:
            raise InvalidArgumentError(
                f"{what}: format {self.format!r} stores {self._info.storage_dtype}, got rows of dtype {rows.dtype}"
            )

    def _row_scale(self, scale: torch.Tensor | None, n: int, what: str) -> np.ndarray | None:
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
        if scale is None or tuple(scale.shape) != (n, 1) or not scale.is_floating_point():
            got = None if scale is None else f"{tuple(scale.shape)} {scale.dtype}"
            raise InvalidArgumentError(
                f"{what}: format {self.format!r} needs a float per-row scale [{n}, 1], got {got}"
            )
        return tensor_bytes(scale.to(torch.float32))

    def set_global_scale(self, scale: torch.Tensor | float) -> None:
        """Set the global scale of an "fp8" table (one value; setting it again must agree)."""
        self._check_open()
        if self._info.scale_kind != "global":
            raise InvalidArgumentError(f"format {self.format!r} has no global scale")
        t = torch.as_tensor(scale, dtype=torch.float32).reshape(-1)
        if t.numel() != 1:
            raise InvalidArgumentError(
                f"a global scale has one element, got shape {tuple(torch.as_tensor(scale).shape)}"
            )
        value = float(t[0])
        if self._global_scale is not None:
            if not (value == self._global_scale or (value != value and self._global_scale != self._global_scale)):
                raise InvalidArgumentError(
                    f"global scale {value} disagrees with the one already set, {self._global_scale}"
                )
            return
        b = tensor_bytes(t)
        _pwrite_all(self._fd, b, self._scale_offset)
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
        if self._written[k]:
            raise InvalidArgumentError(f"{what} was already written")
        self._check_rows(rows, stop - start, what)
        scale_bytes = self._row_scale(scale, stop - start, what)
        row_bytes = tensor_bytes(rows)
        _pwrite_all(self._fd, row_bytes, self._data_offset + start * self._geo["row_nbytes"])
        if scale_bytes is not None:
            _pwrite_all(self._fd, scale_bytes, self._scale_offset + 4 * start)
        if not self.sparse:
            h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
            h.update(row_bytes.tobytes())
            if scale_bytes is not None:
                h.update(scale_bytes.tobytes())
            self._checksums[k] = h.hexdigest()
        self._written[k] = True

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
            _pwrite_all(self._fd, row_bytes[i], self._data_offset + r * rn)
            if srow is not None:
                _pwrite_all(self._fd, srow[i], self._scale_offset + 4 * r)

    # ------------------------------------------------------------------ finishing
    def close(self) -> Path:
        """Check completeness, write the final header, fsync, and rename to ``path`` atomically."""
        if self._closed:
            return self.path
        try:
            if not self.sparse:
                missing = [k for k in range(self.num_shards) if not self._written[k]]
                if missing:
                    shown = ", ".join(str(k) for k in missing[:8]) + (" ..." if len(missing) > 8 else "")
                    raise InvalidArgumentError(
                        f"table file {self.path}: {len(missing)} of {self.num_shards} shards were never written ({shown})"
                    )
            if self._info.scale_kind == "global" and self._global_scale is None:
                raise InvalidArgumentError(
                    f"table file {self.path}: format {self.format!r} needs a global scale, none was set"
                )
            os.fsync(self._fd)
            self._write_header(complete=True)
            os.fsync(self._fd)
            if hasattr(os, "posix_fadvise"):
                # the rows just written are clean now: drop them from the page cache, so a process that
                # maps the file later holds only the rows it reads, not the whole freshly written table
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(self._fd)
            self._fd = -1
            self._publish()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return self.path

    def _publish(self) -> None:
        if self.force:
            os.replace(self.partial_path, self.path)
        else:
            try:
                os.link(self.partial_path, self.path)  # fails if the path appeared meanwhile
            except FileExistsError:
                raise FileExistsError(f"table file {self.path} exists: pass force=True to replace it") from None
            except OSError:  # a filesystem without hard links
                if self.path.exists():
                    raise FileExistsError(f"table file {self.path} exists: pass force=True to replace it") from None
                os.replace(self.partial_path, self.path)
            else:
                os.unlink(self.partial_path)
        _fsync_dir(self.path)

    def abort(self) -> None:
        """Drop the partial file; no table file is published."""
        self._closed = True
        if self._fd >= 0:
            try:
                os.close(self._fd)
            finally:
                self._fd = -1
        try:
            os.unlink(self.partial_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> TableFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


def write_sparse_table_file(
    path: str | os.PathLike,
    rows: int,
    head_dim: int,
    format: str,
    layout_hash: str | dict,
    row_ids: torch.Tensor,
    row_data: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    shard_rows: int | None = None,
    force: bool = False,
) -> Path:
    """Build a sparse table file: zeros everywhere except ``row_data [n, head_dim]`` at ``row_ids [n]``.

    ``scale``: the global scale for "fp8", per-row ``[n, 1]`` for the written rows otherwise (other
    rows get scale 0). No checksums (see the module docstring). Returns the path.
    """
    with TableFileWriter(path, rows, head_dim, format, shard_rows or rows, layout_hash, force=force, sparse=True) as w:
        if format_info(format).scale_kind == "global":
            if scale is None:
                raise InvalidArgumentError(f"format {format!r} needs a global scale")
            w.set_global_scale(scale)
            w.write_rows(row_ids, row_data)
        else:
            w.write_rows(row_ids, row_data, scale)
    return Path(path)


# ---------------------------------------------------------------------- reading
def read_table_header(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a table file's header (magic, length, JSON); does not check completeness or size."""
    path = Path(path)
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX)
        if len(prefix) < _PREFIX or prefix[:8] != MAGIC:
            raise TableFileError(f"{path} is not a PLE table file (bad magic {prefix[:8]!r}, expected {MAGIC!r})")
        n = int.from_bytes(prefix[8:], "little")
        if n > 1 << 26:
            raise TableFileError(f"{path}: header length {n} is implausible")
        blob = f.read(n)
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TableFileError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("magic") != "ple-table":
        raise TableFileError(f"{path}: header does not describe a PLE table")
    if header.get("version") != VERSION:
        raise TableFileError(f"{path}: table file version {header.get('version')!r}, this reader knows {VERSION}")
    return header


def open_table_file(path: str | os.PathLike, expected_layout_hash: str | dict | None = None) -> dict[str, Any]:
    """The header of a complete table file that may be mapped; raises :class:`TableFileError` otherwise
    (unfinished, wrong size, inconsistent, or built for another layout than ``expected_layout_hash``)."""
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise TableFileError(f"{path} is an unfinished table file (a {PARTIAL_SUFFIX!r} write never completed)")
    header = read_table_header(path)
    if header.get("complete") is not True:
        raise TableFileError(f"{path}: header says the file is incomplete (its writer never finished)")
    size = path.stat().st_size
    if size != header["file_nbytes"]:
        raise TableFileError(f"{path}: file is {size} bytes, its header says {header['file_nbytes']}")
    info = format_info(header["format"])
    if header["storage_dtype"] != str(info.storage_dtype).removeprefix("torch."):
        raise TableFileError(
            f"{path}: storage dtype {header['storage_dtype']!r} does not match format {header['format']!r}"
        )
    if header.get("byte_order") != "little":
        raise TableFileError(f"{path}: byte order {header.get('byte_order')!r} is not supported")
    if expected_layout_hash is not None:
        want, _ = _as_layout_hash(expected_layout_hash)
        if header["layout_hash"] != want:
            raise TableFileError(
                f"{path}: layout hash {header['layout_hash']} does not match the expected {want} "
                f"(the table was built for another configuration; file layout fields: {header.get('layout')})"
            )
    return header


def pread_file(path: Path, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _pread_exact(fd, n, offset)
    finally:
        os.close(fd)


def verify_table_file(path: str | os.PathLike) -> list[str]:
    """Re-check a table file against its header; returns the problems found (empty when sound).

    Recomputes every shard checksum (bounded memory: 8 MiB reads); a corrupted shard is reported
    with its index and row range. Also reports unfinished or truncated files, and sparse files
    (which carry no checksums) as unverifiable.
    """
    path = Path(path)
    problems: list[str] = []
    if path.name.endswith(PARTIAL_SUFFIX):
        problems.append(f"{path} is an unfinished table file (a {PARTIAL_SUFFIX!r} write never completed)")
    try:
        header = read_table_header(path)
    except (OSError, TableFileError) as e:
        return problems + [str(e)]
    if header.get("complete") is not True:
        problems.append(f"{path}: header says the file is incomplete (its writer never finished)")
    size = path.stat().st_size
    if size != header.get("file_nbytes"):
        problems.append(f"{path}: file is {size} bytes, its header says {header.get('file_nbytes')}")
        return problems
    checksums = header["checksum"]["shards"]
    if checksums is None:
        problems.append(f"{path}: no checksums recorded (sparse build): the rows cannot be verified")
        return problems
    rows, rn, s = header["rows"], header["row_nbytes"], header["shard_rows"]
    per_row = header["scale"]["kind"] == "row"
    fd = os.open(path, os.O_RDONLY)
    try:
        for k, want in enumerate(checksums):
            start, stop = shard_bounds(k, s, rows)
            h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
            _hash_range(fd, h, header["data_offset"] + start * rn, (stop - start) * rn)
            if per_row:
                _hash_range(fd, h, header["scale"]["offset"] + 4 * start, 4 * (stop - start))
            if h.hexdigest() != want:
                what = "rows or their per-row scales" if per_row else "rows"
                problems.append(
                    f"{path}: shard {k} (rows [{start}, {stop})): checksum mismatch, the stored {what} changed"
                )
        if header["scale"]["kind"] == "global":
            b = _pread_exact(fd, 4, header["scale"]["offset"])
            if hashlib.blake2b(b, digest_size=_DIGEST_SIZE).hexdigest() != header["checksum"]["scale"]:
                problems.append(f"{path}: global scale checksum mismatch, the stored scale changed")
    finally:
        os.close(fd)
    return problems


def _hash_range(fd: int, h, offset: int, n: int) -> None:
    while n > 0:
        b = os.pread(fd, min(n, _READ_CHUNK), offset)
        if not b:
            raise TableFileError(f"unexpected end of file at byte {offset}")
        h.update(b)
        n -= len(b)
        offset += len(b)
