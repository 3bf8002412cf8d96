"""Verifying a table file against its header: every shard's checksum recomputed, every scale checked.

:func:`verify_table_file` reads the file with ``pread`` (16 MiB at a time: memory stays bounded
whatever the table's size, nothing is mapped) and hashes its shards side by side, two per thread
(``torch.get_num_threads()``: the hash runs at about one byte per cycle, so a single thread would hold
the check below the disk's speed, and a second shard a thread reads while the other is hashed);
problems are listed in shard order.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ple.common.files import PARTIAL_SUFFIX, open_regular
from ple.errors import PLEError
from ple.layout import shard_bounds
from ple.table.files.table_file import DIGEST_SIZE, TableFileError, read_global_scale, read_open_header

__all__ = ["verify_table_file"]

_READ_CHUNK = 16 << 20


def verify_table_file(path: str | os.PathLike, *, threads: int | None = None, progress: bool = False) -> list[str]:
    """Re-check a table file against its header; returns the problems found (empty when sound).

    Validates the header (checksum, fields, geometry; see :func:`ple.table.read_table_header`), then
    recomputes the checksum of every shard the geometry implies (``threads`` shards at a time, default
    ``torch.get_num_threads()``) and checks every scale is a positive finite number; a corrupted shard
    is reported with its index and row range. Unfinished files, and sparse files (which carry no
    checksums), are problems too. ``progress``: a tqdm bar of the rows checked (rows/s, time left).
    """
    path = Path(path)
    problems: list[str] = []
    if path.name.endswith(PARTIAL_SUFFIX):
        problems.append(f"{path} is an unfinished table file (a {PARTIAL_SUFFIX!r} write never completed)")
    try:
        fd = open_regular(path, "table file", TableFileError)
    except (OSError, PLEError) as e:
        return problems + [str(e)]
    try:
        try:
            header = read_open_header(fd, path)
        except TableFileError as e:
            return problems + [str(e)]
        if header["complete"] is not True:
            return problems + [f"{path}: header says the file is incomplete (its writer never finished)"]
        if header["sparse"]:
            return problems + [f"{path}: no checksums recorded (sparse build): the rows cannot be verified"]
        try:
            problems += _verify_rows(fd, header, path, threads or torch.get_num_threads(), progress)
        except (OSError, TableFileError) as e:  # the file shrank or failed under us
            problems.append(str(e))
    finally:
        os.close(fd)
    return problems


def _shard_problem(fd: int, header: dict[str, Any], path: Path, k: int) -> str | None:
    rn, s = header["row_nbytes"], header["shard_rows"]
    start, stop = shard_bounds(k, s, header["rows"])
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    _hash_range(fd, h, header["data_offset"] + start * rn, (stop - start) * rn, path)
    bad_scale = None
    per_row = header["scale"]["kind"] == "row"
    if per_row:
        scales = _read(fd, header["scale"]["offset"] + 4 * start, 4 * (stop - start), path)
        h.update(scales)
        values = np.frombuffer(scales, dtype="<f4")
        bad = np.nonzero(~(np.isfinite(values) & (values > 0)))[0]
        if len(bad):
            bad_scale = f"the per-row scale of row {start + int(bad[0])} is {float(values[bad[0]])}"
    if h.hexdigest() != header["checksum"]["shards"][k]:
        what = "rows or their per-row scales" if per_row else "rows"
        return f"{path}: shard {k} (rows [{start}, {stop})): checksum mismatch, the stored {what} changed"
    if bad_scale is not None:
        return f"{path}: shard {k} (rows [{start}, {stop})): {bad_scale}, not a positive finite number"
    return None


def _verify_rows(fd: int, header: dict[str, Any], path: Path, threads: int, progress: bool = False) -> list[str]:
    shards = range(-(-header["rows"] // header["shard_rows"]))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=header["rows"], unit="row", unit_scale=True, desc=f"verify {path.name}")

    def check(k: int) -> str | None:
        problem = _shard_problem(fd, header, path, k)
        if bar is not None:
            a, b = shard_bounds(k, header["shard_rows"], header["rows"])
            bar.update(b - a)
        return problem

    try:
        if threads > 1 and len(shards) > 1:
            with ThreadPoolExecutor(min(2 * threads, len(shards))) as pool:  # reads overlap hashing
                found = list(pool.map(check, shards))
        else:
            found = [check(k) for k in shards]
    finally:
        if bar is not None:
            bar.close()
    problems = [p for p in found if p is not None]
    if header["scale"]["kind"] == "global":
        b = _read(fd, header["scale"]["offset"], 4, path)
        if hashlib.blake2b(b, digest_size=DIGEST_SIZE).hexdigest() != header["checksum"]["scale"]:
            problems.append(f"{path}: global scale checksum mismatch, the stored scale changed")
        else:
            try:
                read_global_scale(fd, header, path)
            except TableFileError as e:
                problems.append(str(e))
    return problems


def _read(fd: int, offset: int, n: int, path: Path) -> bytes:
    b = os.pread(fd, n, offset)
    if len(b) != n:
        raise TableFileError(f"{path}: unexpected end of file at byte {offset + len(b)}")
    return b


def _hash_range(fd: int, h, offset: int, n: int, path: Path) -> None:
    buf = bytearray(min(n, _READ_CHUNK))
    view = memoryview(buf)
    while n > 0:
        if n > _READ_CHUNK and hasattr(os, "posix_fadvise"):  # the next chunk: read ahead while this one is hashed
            os.posix_fadvise(fd, offset + _READ_CHUNK, min(n - _READ_CHUNK, _READ_CHUNK), os.POSIX_FADV_WILLNEED)
        got = os.preadv(fd, [view[: min(n, _READ_CHUNK)]], offset)
        if got <= 0:
            raise TableFileError(f"{path}: unexpected end of file at byte {offset}")
        h.update(view[:got])
        n -= got
        offset += got
