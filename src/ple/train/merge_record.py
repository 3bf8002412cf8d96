"""The merge record of a merged table file: what it says was merged, checked before use, and what
lets ``ple verify FILE --checkpoint DIR`` check the file on its own, with no adapter file.

A merged table file's header (:func:`ple.train.merge_table_file`) holds ``merged``:

- ``adapter``: the adapter file merged (its absolute path), or, for :func:`ple.train.merge_model` of a
  model's own trained rows, :data:`MODEL_ADAPTER` (no file);
- ``ple_layer_index``: its PLE layer (the table's own, when the header records layout fields);
  ``trained_rows``: how many rows were trained; ``ids_digest``: blake2b-128 of their ids (int64, little
  endian, ascending);
- ``into``: the table merged into (``file``, ``format``, ``header_checksum``); ``trained_over``: the
  table the adapter was trained over (or null); ``identity``: the new table's
  (:func:`ple.checkpoint.classify.merged_identity`; its last merge's ``ids`` is ``ids_digest``);
- ``rows`` (merges since this record): the trained rows themselves as the file stores them:
  ``ids``, their ids (the first, then each one's difference from the one before, int64 little endian,
  zlib-compressed, base64); ``group`` and ``digests``: blake2b-64 of each ``group`` consecutive trained
  rows (in id order; each row's stored bytes followed, in a per-row scale format, by its float32
  scale), concatenated, base64. ``group`` is 1 (a digest a row) up to :data:`MAX_DIGESTS` trained rows,
  beyond that the smallest power of two that keeps to that many digests.

:func:`recorded_rows` checks every field (type and range, against the table's header) and raises
:class:`~ple.table.TableFileError` naming the first that is wrong; it returns the ``rows`` part as
:class:`RecordedRows`, which checks the trained rows of the file against their digests
(:meth:`RecordedRows.problems`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ple.checkpoint.classify import TableIdentity
from ple.table import MmapTable
from ple.table.files.table_file import HeaderFields, TableFileError
from ple.table.formats.catalog import FORMATS, format_info

__all__ = [
    "MAX_DIGESTS",
    "MODEL_ADAPTER",
    "GroupDigests",
    "RecordedRows",
    "digest_group",
    "encode_ids",
    "ids_digest",
    "recorded_rows",
    "stored_row_bytes",
]

MODEL_ADAPTER = "the adapter of a model in memory"
"""What the merge record of :func:`ple.train.merge_model` names as its adapter (it merges from memory)."""
MAX_DIGESTS = 1 << 19
"""At most this many row digests a record (4 MiB): beyond, each digest covers a group of rows."""
DIGEST_SIZE = 8
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


# ---------------------------------------------------------------------------------------------- writing
def ids_digest(ids: np.ndarray) -> str:
    """blake2b-128 of sorted row ids (as int64, little endian): the record's ``ids_digest``."""
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype="<i8").tobytes(), digest_size=16).hexdigest()


def encode_ids(ids: np.ndarray) -> str:
    """The record's ``rows.ids`` of sorted row ids: differences, int64 little endian, zlib, base64."""
    ids = np.asarray(ids, dtype=np.int64)
    deltas = np.diff(ids, prepend=np.int64(0)).astype("<i8")
    return base64.b64encode(zlib.compress(deltas.tobytes(), 6)).decode("ascii")


def digest_group(trained_rows: int) -> int:
    """The rows a digest covers for ``trained_rows`` trained rows: 1, or the smallest power of two that
    keeps to :data:`MAX_DIGESTS` digests."""
    group = 1
    while -(-trained_rows // group) > MAX_DIGESTS:
        group *= 2
    return group


def stored_row_bytes(data: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """The bytes a digest covers of stored rows ``data [m, width]``: each row's bytes, followed by its
    float32 scale (``scale [m, 1]``, a per-row scale format); ``[m, bytes]`` uint8."""
    rows = data.contiguous().view(torch.uint8).reshape(data.shape[0], -1).numpy()
    if scale is None:
        return np.ascontiguousarray(rows)
    scales = scale.to(torch.float32).reshape(-1).numpy().astype("<f4").view(np.uint8).reshape(-1, 4)
    return np.ascontiguousarray(np.concatenate([rows, scales], axis=1))


class GroupDigests:
    """blake2b-64 of each ``group`` consecutive rows added (:meth:`add`, in id order); :meth:`finish`
    gives them concatenated (the last group may be short)."""

    def __init__(self, group: int) -> None:
        self.group, self._k = group, 0
        self._out: list[bytes] = []
        self._h: Any = None  # the open group's hasher

    def add(self, rows: np.ndarray) -> None:
        i, m = 0, rows.shape[0]
        while i < m:
            take = min(self.group - self._k, m - i)
            if self._h is None:
                self._h = hashlib.blake2b(digest_size=DIGEST_SIZE)
            self._h.update(rows[i : i + take])
            self._k += take
            i += take
            if self._k == self.group:
                self._close()

    def _close(self) -> None:
        assert self._h is not None
        self._out.append(self._h.digest())
        self._h, self._k = None, 0

    def finish(self) -> bytes:
        if self._h is not None:
            self._close()
        return b"".join(self._out)


def rows_record(ids: np.ndarray) -> dict[str, Any]:
    """The record's ``rows`` for trained rows ``ids`` (sorted), its digests zeros (of their final size)
    until the merge has written the rows."""
    group = digest_group(len(ids))
    zeros = bytes(DIGEST_SIZE * -(-len(ids) // group))
    return {"ids": encode_ids(ids), "group": group, "digests": base64.b64encode(zeros).decode("ascii")}


# ---------------------------------------------------------------------------------------------- reading
@dataclass(frozen=True, eq=False)
class RecordedRows:
    """The trained rows a merged table file's record holds (its ``rows``): their PLE layer, count, ids,
    and digests of ``group`` rows each. It stands in for the adapter where that is not there: ids by
    :meth:`chunks`, the rows checked by :meth:`problems`."""

    path: str
    ple_layer_index: int
    trained_rows: int
    ids: np.ndarray
    group: int
    digests: bytes

    def chunks(self, index: int, size: int = 1 << 16) -> Iterator[tuple[torch.Tensor, None]]:
        """``(ids [m], None)`` of the trained rows, ``size`` at a time (the values are not recorded)."""
        if index != self.ple_layer_index:
            raise TableFileError(f"{self.path}: its merge record is of PLE layer {self.ple_layer_index}, not {index}")
        for a in range(0, self.trained_rows, size):
            yield torch.from_numpy(self.ids[a : a + size]), None

    def problems(self) -> list[str]:
        """The trained rows of the file that no longer give their recorded digests; ``[]`` when all do."""
        table = MmapTable.open(self.path, random_access=False)
        try:
            per_row = table.scale if format_info(table.format).scale_kind == "row" else None
            got = GroupDigests(self.group)
            step = self.group * max(1, (1 << 16) // self.group)
            for a in range(0, self.trained_rows, step):
                at = torch.from_numpy(self.ids[a : a + step])
                got.add(stored_row_bytes(table.data[at], None if per_row is None else per_row[at]))
        finally:
            table.close()
        have = np.frombuffer(got.finish(), np.uint8).reshape(-1, DIGEST_SIZE)
        want = np.frombuffer(self.digests, np.uint8).reshape(-1, DIGEST_SIZE)
        bad = np.flatnonzero((have != want).any(axis=1))
        if not bad.size:
            return []
        where = f"{self.path}: the trained rows differ from the stored digests of its merge record"
        if self.group == 1:
            return [f"{where}: {bad.size} row{'s' * (bad.size != 1)}, first at row {int(self.ids[bad[0]])}"]
        a, b = int(bad[0]) * self.group, min(self.trained_rows, (int(bad[0]) + 1) * self.group)
        return [
            f"{where}: {bad.size} group{'s' * (bad.size != 1)} of {self.group} rows, the first among rows "
            f"{int(self.ids[a])}..{int(self.ids[b - 1])}"
        ]


class _Record(HeaderFields):
    """A merge record's fields (:class:`~ple.table.files.table_file.HeaderFields`), plus strings and blobs."""

    def string(self, key: str, pattern: re.Pattern[str] | None = None, expected: str = "a non-empty string") -> str:
        v = self.d.get(key)
        if not isinstance(v, str) or not v or (pattern is not None and not pattern.match(v)):
            raise self.bad(key, expected)
        return v

    def blob(self, key: str, nbytes: int, what: str, compressed: bool = False, exact: bool = True) -> bytes:
        """Field ``key``'s bytes (base64, ``compressed`` with zlib): ``nbytes`` of them (at most, not ``exact``)."""
        text = self.string(key, expected=what)
        try:
            raw = base64.b64decode(text, validate=True)
            if compressed:
                inflate = zlib.decompressobj()
                raw = inflate.decompress(raw, nbytes + 1)
                if not inflate.eof or inflate.unconsumed_tail:
                    raise ValueError("not one whole zlib stream of at most that size")
        except (binascii.Error, ValueError, zlib.error):
            raise self.bad(key, what) from None
        if len(raw) > nbytes or (exact and len(raw) != nbytes):
            raise self.bad(key, f"{what} ({nbytes} bytes{'' if exact else ' at most'}; it holds {len(raw)})")
        return raw


def recorded_rows(path: str | os.PathLike, header: dict[str, Any]) -> RecordedRows | None:
    """The merge record of the table file ``path`` (header ``header``), every field checked against the
    table (see the module docstring): its ``rows`` as :class:`RecordedRows`, or None for a merge recorded
    before records held the rows. :class:`TableFileError` naming the first field that is wrong."""
    doc = header.get("merged")
    if not isinstance(doc, dict):
        raise TableFileError(f"{path}: header field 'merged' is {doc!r}, expected a JSON object")
    f, rows = _Record(doc, path, "merged."), int(header["rows"])
    f.string("adapter")
    layout = header.get("layout")
    own = layout.get("ple_layer_index") if isinstance(layout, dict) else None
    index = f.integer("ple_layer_index", 0, 1 << 30)
    if isinstance(own, int) and index != own:
        raise f.bad("ple_layer_index", f"{own}, the PLE layer of the table (its header's layout)")
    n = f.integer("trained_rows", 0, rows)
    digest = f.string("ids_digest", _HEX32, "a blake2b-128 hex digest")
    into = f.obj("into")
    into.string("file")
    fmt = into.string("format", expected=f"one of {list(FORMATS)}")
    if fmt != header["format"]:
        raise into.bad("format", f"{header['format']!r}, the format of the table merged into (this file's)")
    into.string("header_checksum", _HEX32, "a blake2b-128 hex digest")
    if doc.get("trained_over") is not None and not isinstance(doc.get("trained_over"), dict):
        raise f.bad("trained_over", "null or a JSON object (the table the adapter was trained over)")
    identity = TableIdentity.from_json(doc.get("identity"))
    if identity is None or not identity.merges or identity.merges[-1].get("ids") != digest:
        raise f.bad("identity", "a table identity whose last merge's ids are ids_digest")
    if "rows" not in doc:
        return None
    r = f.obj("rows")
    blob = r.blob("ids", 8 * rows, "base64 zlib int64 id differences", compressed=True, exact=False)
    if len(blob) % 8:
        raise r.bad("ids", "base64 zlib int64 id differences (whole int64 values)")
    if len(blob) // 8 != n:
        raise f.bad("trained_rows", f"{len(blob) // 8}, the count of the row ids in merged.rows.ids")
    deltas = np.frombuffer(blob, "<i8").astype(np.int64)
    in_range = (
        n == 0
        or (  # and no sum near int64's end: the last id is then checked exactly
            bool((deltas >= 0).all() and (deltas[1:] >= 1).all() and (deltas <= rows).all())
            and float(deltas.sum(dtype=np.float64)) < 2.0 * rows
        )
    )
    ids = np.cumsum(deltas) if in_range else deltas
    if not in_range or (n and int(ids[-1]) >= rows):
        raise r.bad("ids", f"{n} sorted distinct row ids in [0, {rows})")
    if ids_digest(ids) != digest:
        raise r.bad("ids", "the row ids whose digest is ids_digest")
    group = r.integer("group", 1, max(1, n))
    raw = r.blob("digests", DIGEST_SIZE * -(-n // group), "base64 digests, 8 bytes for each group of rows")
    return RecordedRows(str(path), index, n, ids, group, raw)
