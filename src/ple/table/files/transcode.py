"""Convert a PLE layer's table, shard by shard, into a table file; compare a file with its source.

Sources. :func:`convert_layer` takes an iterable of ``(k, rows, scale)`` whole shards (any order; a
generator of in-memory shards, say) or a *shard source*: an object with ``num_shards``, ``format``
(its rows' format; None: inferred from them), ``identity`` (a hex digest naming its rows' bytes and
where they lie, or None) and ``chunks(k, max_rows)``, which yields shard ``k``'s rows in order as
``(rows [m, width], scale)`` pieces of at most ``max_rows`` rows read when asked for
(:func:`ple.checkpoint.table_shards` reads a checkpoint so, :class:`ple.checkpoint.gguf.GGUFRows` a GGUF
tensor; a source may also name a ``nonfinite_problem`` and its ``error`` of its own). Rows are stored
rows: plain (bf16/fp16/fp32, ``scale`` None), fp8 with the global scale (``[1]``), fp8/int8 with
per-row scales (``[m, 1]``), nvfp4 bytes with the global scale, or (GGUF) GGML blocks. Source scales
must be positive finite numbers (:func:`~ple.table.formats.catalog.check_scale_values`) and source values
finite (an fp8 NaN byte, a NaN or infinite block scale, is refused too, naming its shard, row and
column: :func:`nonfinite_problem`).

Targets: the source's own format (an exact copy, whatever ``to`` says), one scale per row
("fp8_row", "int8_row"), or a block format (:mod:`ple.table.formats.blocks`; nvfp4 also needs the table's
global scale, from :func:`table_amax` through :func:`~ple.table.formats.blocks.nvfp4_global_scale`), encoded by
:mod:`ple.table.formats.encode` (a block whose fp16 scale would overflow is refused, naming row and value).

Speed and memory: shards are converted side by side, one per thread (``torch.get_num_threads()``; a
copy, which waits on the disk more than it computes, two per thread), each in pieces of at most 16
MiB of source rows read ahead one piece, hashed and written as they come; memory stays at a few
pieces whatever the table's size (a shard source reads its pieces when asked). A shard source with
an identity makes the conversion resumable: after each shard the file's data is synced and its
temporary header records the shard, its checksum (computed as it is written) and its error sums
(``TableFileWriter(..., resume=)``); an interrupted conversion keeps its temporary file, and the same
conversion run again (the same source files, :func:`ple.common.files.file_identity`: no write to them since,
even with its modification time set back; the same target and layout) writes only the shards not
done, after reading the finished ones once to check them against their checksums (a shard that fails
is converted again: :func:`~ple.table.files.shard_writer.matching_shards` says what that read costs on the
published table, at most what ``ple verify`` of the finished part costs); its statistics cover every
shard.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ple.errors import InvalidArgumentError
from ple.layout import shard_bounds
from ple.table.files.table_file import (
    TableFileError,
    TableFileWriter,
    hash_layout,
    open_table,
    read_global_scale,
    tensor_bytes,
)
from ple.table.formats.blocks import ScaleOverflowError
from ple.table.formats.catalog import BLOCK_FORMATS, check_scale_values, format_info, infer_format
from ple.table.formats.encode import RowFailure, encode_rows, first_nonfinite, rows_amax
from ple.table.formats.quantize import QuantStats, RowStats

__all__ = [
    "convert_layer",
    "compare_with_source",
    "first_nonfinite_row",
    "nonfinite_problem",
    "table_amax",
    "target_format",
    "TARGET_NAMES",
]

TARGET_NAMES = ("fp8", "int8", *BLOCK_FORMATS)
"""What ``ple convert --to`` and ``from_pretrained(table_format=)`` accept."""

_ENCODER = 2  # 2: q4_0/q5_0 zero blocks' -0 scale and 4/5-bit codes of an overflowing 1/d as GGML
"""Bumped when an encoder's bytes change: a temporary file an older one left is not continued."""


def target_format(to: str | None, source: str) -> str | None:
    """The format a table in format ``source`` is converted to when ``to`` is asked for: None (an
    exact copy) when the source already has it ("fp8" covers both fp8 formats); otherwise "fp8" and
    "int8" mean one scale per row ("fp8_row", "int8_row") and a block format means itself."""
    if to is not None and to not in TARGET_NAMES:
        raise InvalidArgumentError(f"table format must be one of {list(TARGET_NAMES)}, got {to!r}")
    family = {"fp8": ("fp8", "fp8_row"), "int8": ("int8_row",)}.get(to or "", (to,))
    if to is None or source in family:
        return None
    return {"fp8": "fp8_row", "int8": "int8_row"}.get(to, to)


_TARGETS = (None, "fp8_row", "int8_row", *BLOCK_FORMATS)
_CHUNK_BYTES = 16 << 20
"""Source bytes a shard is read and converted in at a time."""


def _source_format(k: int, rows: torch.Tensor, scale: torch.Tensor | None) -> str:
    try:
        return infer_format(rows, scale)
    except ValueError as e:
        raise InvalidArgumentError(f"source shard {k}: {e}") from None


def first_nonfinite_row(rows: torch.Tensor) -> int | None:
    """The index of the first row of ``rows [n, ...]`` holding a NaN or an infinity, None when every
    value is finite (integer rows always are). fp8 rows are judged by their bits, so a NaN byte is
    found whatever torch supports for the dtype (see :func:`ple.table.formats.encode.first_nonfinite`)."""
    if not rows.is_floating_point() or rows.shape[0] == 0:
        return None
    hit = first_nonfinite(rows.reshape(rows.shape[0], -1))
    return None if hit is None else hit[0]


_GGML_FP16 = {"q8_0": "scale", "q5_0": "scale", "q4_0": "scale", "iq4_nl": "scale", "q4_1": "scale", "q5_1": "scale"}


def _what_nonfinite(row: torch.Tensor, col: int, format: str | None) -> str:
    """The stored value that makes column ``col`` of ``row`` (stored bytes or values) not finite."""
    if format == "nvfp4":
        D = format_info("nvfp4").head_dim_of(row.numel())
        return f"byte 0x{int(row[D // 2 + col // 16]):02x} (a NaN E4M3 block scale of nvfp4)"
    if format in BLOCK_FORMATS:
        info = format_info(format)
        block = row[col // 32 * info.block_nbytes :][: info.block_nbytes]
        if format == "mxfp4":
            return f"a value of its mxfp4 block (E8M0 exponent byte 0x{int(block[0]):02x}) that overflows float32"
        d, m = block[0:2].view(torch.float16), block[2:4].view(torch.float16)
        if format in ("q4_1", "q5_1") and not bool(torch.isfinite(m).all()):
            return f"the {format} block minimum {float(m[0])}"
        return f"the {format} block scale {float(d[0])}"
    if row.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return f"byte 0x{int(row.view(torch.uint8)[col]):02x} (NaN in {row.dtype})"
    return str(float(row[col]))


def nonfinite_problem(
    k: int, rows: torch.Tensor, first_row: int, shard_row: int = 0, format: str | None = None
) -> str | None:
    """``"source shard k: table row r (row i of the shard), column c holds ..., not a finite value"`` for
    the first such row of ``rows`` (stored rows whose first is table row ``first_row`` and row
    ``shard_row`` of shard ``k``; ``format``: "nvfp4" or a GGML block format for uint8 rows), or None."""
    hit = first_nonfinite(rows.reshape(rows.shape[0], -1) if rows.dim() != 2 else rows, format)
    if hit is None:
        return None
    i, col = hit
    what = _what_nonfinite(rows[i].reshape(-1), col, format)
    return (
        f"source shard {k}: table row {first_row + i} (row {shard_row + i} of the shard), column {col} holds "
        f"{what}, not a finite value"
    )


# ---------------------------------------------------------------------------------------------- sources


def _is_source(obj: Any) -> bool:
    return callable(getattr(obj, "chunks", None)) and hasattr(obj, "num_shards")


def _pieces(rows: torch.Tensor, scale: torch.Tensor | None, max_rows: int):
    """A whole shard in pieces of at most ``max_rows`` rows (per-row scales sliced alike)."""
    for a in range(0, rows.shape[0], max_rows):
        s = scale[a : a + max_rows] if scale is not None and scale.dim() == 2 else scale
        yield rows[a : a + max_rows].cpu(), s


def _max_rows(width_bytes: int, shard_rows: int) -> int:
    return max(1, min(shard_rows, _CHUNK_BYTES // max(1, width_bytes)))


def _source_width(fmt: str, head_dim: int) -> int:
    return format_info(fmt).width(head_dim)


class _Stopped(Exception):
    """A lane stopped early (an interruption, or a failure in an earlier shard)."""


class _Lanes:
    """Shards run side by side on ``lanes`` threads, in order, at most ``lanes`` at a time; ``on_done``
    runs in the calling thread as each one finishes. The failure of the lowest shard is raised once the
    shards before it are done; an interruption (Ctrl-C) stops every lane at its next piece."""

    def __init__(self, lanes: int, bar=None) -> None:
        self.lanes = max(1, lanes)
        self.bar = bar
        self._lock = threading.Lock()
        self._rows = 0
        self._shown = 0
        self._stop = threading.Event()
        self._limit = float("inf")

    def advance(self, rows: int) -> None:
        """A lane wrote ``rows`` more rows."""
        with self._lock:
            self._rows += rows

    def check(self, k: int) -> None:
        """Raise :class:`_Stopped` in a lane whose shard ``k`` need not go on."""
        if self._stop.is_set() or k > self._limit:
            raise _Stopped

    def _refresh(self) -> None:
        if self.bar is not None:
            with self._lock:
                n, self._shown = self._rows - self._shown, self._rows
            if n:
                self.bar.update(n)

    def run(
        self,
        jobs: Iterator[tuple[int, Any]],
        work: Callable[[int, Any], Any],
        on_done: Callable[[int, Any], None] = lambda k, r: None,
    ) -> None:
        errors: dict[int, BaseException] = {}
        pending: dict[Future, int] = {}
        pool = ThreadPoolExecutor(self.lanes, thread_name_prefix="ple-convert")
        try:
            while True:
                while len(pending) < self.lanes and not errors:
                    job = next(jobs, None)
                    if job is None:
                        break
                    pending[pool.submit(work, *job)] = job[0]
                if not pending:
                    break
                done, _ = wait(list(pending), timeout=0.2, return_when=FIRST_COMPLETED)
                self._refresh()
                for f in sorted(done, key=lambda f: pending[f]):
                    k = pending.pop(f)
                    try:
                        result = f.result()
                    except _Stopped:
                        continue
                    except Exception as e:
                        errors[k] = e
                        self._limit = min(self._limit, k)
                        continue
                    if not errors or k < min(errors):
                        on_done(k, result)
            self._refresh()
            if errors:
                raise errors[min(errors)]
        except BaseException:
            self._stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        finally:
            pool.shutdown(wait=True)


def _threads() -> int:
    return max(1, torch.get_num_threads())


# ---------------------------------------------------------------------------------------------- errors


class _Errors:
    """Quantization error sums of a table (or one shard): in all and per hash head."""

    def __init__(self, heads: list[tuple[int, int]]) -> None:
        self.ranges = heads
        self.total = QuantStats()
        self.heads = [QuantStats() for _ in heads]

    def add(self, e: RowStats, first_row: int) -> None:
        n = e.err_sq.shape[0]
        self.total.add(e)
        for (a, b), h in zip(self.ranges, self.heads):
            lo, hi = max(a, first_row), min(b, first_row + n)
            if lo < hi:
                h.add(e, lo - first_row, hi - first_row)

    def count(self, first_row: int, n: int) -> None:
        """Rows copied exactly (no error)."""
        self.total.add_sums(0.0, 0.0, 0.0, n)
        for (a, b), h in zip(self.ranges, self.heads):
            h.add_sums(0.0, 0.0, 0.0, max(0, min(b, first_row + n) - max(a, first_row)))

    def record(self) -> dict[str, Any]:
        return {"t": self.total.sums(), "h": {str(i): h.sums() for i, h in enumerate(self.heads) if h.rows}}

    def merge(self, record: dict[str, Any]) -> None:
        self.total.add_sums(*record["t"])
        for i, sums in record["h"].items():
            self.heads[int(i)].add_sums(*sums)


# ---------------------------------------------------------------------------------------------- convert


def _resume_key(source: Any, layout_hash: str | dict, geometry: tuple, out_fmt: str, to: str | None, g) -> str | None:
    identity = getattr(source, "identity", None)
    if not isinstance(identity, str) or not identity:
        return None
    lh = hash_layout(layout_hash) if isinstance(layout_hash, dict) else layout_hash
    blob = json.dumps(
        {"source": identity, "layout": lh, "geometry": list(geometry), "format": out_fmt, "requantized": to is not None,
         "global_scale": g, "encoder": _ENCODER},
        sort_keys=True,
    )  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def convert_layer(
    shard_iter: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]] | Any,
    out_path: str | os.PathLike,
    layout_hash: str | dict,
    rows: int,
    head_dim: int,
    shard_rows: int,
    to: str | None = None,
    force: bool = False,
    progress: bool = True,
    head_ranges: list[tuple[int, int]] | None = None,
    global_scale: float | None = None,
) -> dict[str, Any]:
    """Write one layer's table file from its source shards.

    Args:
        shard_iter: a shard source (see the module docstring), or an iterable of ``(k, rows [n_k, width],
            scale | None)`` whole shards.
        out_path: the table file to create (atomically; see :class:`TableFileWriter`).
        layout_hash: hash of the layout fields (str) or the fields (dict), stored in the header.
        rows, head_dim, shard_rows: table geometry; shard ``k`` holds rows
            ``[k*shard_rows, min((k+1)*shard_rows, rows))``.
        to: None, or the source's own format, copies the source exactly; "fp8_row" / "int8_row"
            dequantize each row (fp32, with the source's global or per-row scale) and requantize it
            with its own scale; a block format quantizes the fp32 rows into its blocks.
        force: replace an existing file.
        progress: show a tqdm progress bar (rows written, rows/s, time left).
        head_ranges: row ranges ``(start, stop)`` of the hash heads for per-head error statistics.
        global_scale: the nvfp4 table's global scale (needed for ``to="nvfp4"``).

    Returns:
        ``{"path", "format", "source_format", "rows", "error": {max_rel, rms_rel, rows},
        "per_head": [{start, stop, max_rel, rms_rel, rows}, ...], "resumed_rows"}``; errors are relative
        to the fp32 dequantized source (see :mod:`ple.table.formats.quantize`), zero when ``to`` is None;
        ``resumed_rows``: rows an interrupted run of the same conversion had written.
    """
    if to not in _TARGETS:
        raise InvalidArgumentError(f"convert_layer: to must be one of {list(_TARGETS)}, got {to!r}")
    heads = [(int(a), int(b)) for a, b in (head_ranges or [])]
    for a, b in heads:
        if not 0 <= a <= b <= rows:
            raise InvalidArgumentError(f"head range ({a}, {b}) is not inside the table's rows [0, {rows})")
    source: Any = shard_iter if _is_source(shard_iter) else None
    first: tuple[int, torch.Tensor, torch.Tensor | None] | None = None
    if source is not None:
        src_fmt = source.format or _source_format(0, *next(iter(source.chunks(0, 1))))
        shard_jobs: Iterator[tuple[int, Any]] = iter(())
    else:
        it = iter(shard_iter)
        first = next(it, None)
        if first is None:
            raise InvalidArgumentError("convert_layer: the source yielded no shards")
        src_fmt = _source_format(first[0], first[1], first[2])
        shard_jobs = ((k, (src, scale)) for k, src, scale in itertools.chain([first], it))
    if to == src_fmt:
        to = None  # the format the source already has: an exact copy, never a requantization
    out_fmt = src_fmt if to is None else to
    if to == "nvfp4" and global_scale is None:
        raise InvalidArgumentError("convert_layer: an nvfp4 table needs its global_scale (see table_amax)")
    if to is not None:
        format_info(to).check_head_dim(head_dim)
    num_shards = -(-rows // shard_rows)
    key = _resume_key(source, layout_hash, (rows, head_dim, shard_rows), out_fmt, to, global_scale)
    overlaps = sum(
        1 for k in range(num_shards) for a, b in heads if a < min(rows, (k + 1) * shard_rows) and b > k * shard_rows
    )
    room = 160 * (num_shards + overlaps) + 1024  # the progress record: error sums per shard and head
    errors = _Errors(heads)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=rows, unit="row", unit_scale=True, desc=f"convert {Path(out_path).name}", smoothing=0.1)
    try:
        with TableFileWriter(
            out_path, rows, head_dim, out_fmt, shard_rows, layout_hash, force=force, resume=key, progress_room=room
        ) as w:
            resumed_rows = 0
            for k, record in w.resumed.items():
                errors.merge(record)
                a, b = w.shard_range(k)
                resumed_rows += b - a
            if w.rejected:
                shown = ", ".join(map(str, w.rejected[:8])) + (" ..." if len(w.rejected) > 8 else "")
                print(
                    f"{w.partial_path.name}: {len(w.rejected)} finished shard(s) no longer give the checksums "
                    f"recorded as they were written ({shown}): converting them again",
                    file=sys.stderr,
                )
            if resumed_rows:
                if bar is not None:
                    bar.update(resumed_rows)
                print(
                    f"continuing {w.partial_path.name}: {len(w.resumed)} of {num_shards} shards were done "
                    "(their bytes checked against their checksums)",
                    file=sys.stderr,
                )
            if to == "nvfp4":
                w.set_global_scale(torch.tensor([global_scale], dtype=torch.float32))
            todo = [k for k in range(num_shards) if k not in w.resumed]
            threads = _threads()
            # a copy waits on the disk more than it computes: twice as many lanes as threads keep reads,
            # hashing and writes overlapping; a conversion computes: one lane a thread
            want = 2 * threads if to is None else threads
            lanes = _Lanes(min(want, len(todo)) if source is not None else want, bar)
            kernel_threads = threads if lanes.lanes == 1 else 1  # one lane alone uses every thread
            conv = _ShardConverter(w, source, src_fmt, to, head_dim, heads, global_scale, kernel_threads, lanes)
            conv.first_k = first[0] if first is not None else 0
            jobs = ((k, None) for k in todo) if source is not None else shard_jobs

            def done(k: int, record: dict[str, Any]) -> None:
                errors.merge(record)
                w.commit(k, record)

            lanes.run(jobs, conv.convert, done)
    finally:
        if bar is not None:
            bar.close()
    return {
        "path": str(out_path),
        "format": out_fmt,
        "source_format": src_fmt,
        "rows": rows,
        "error": errors.total.to_dict(),
        "per_head": [{"start": a, "stop": b, **e.to_dict()} for (a, b), e in zip(heads, errors.heads)],
        "resumed_rows": resumed_rows,
    }


class _ShardConverter:
    """One shard of a conversion, in a lane: pieces read, checked, encoded (or copied), written."""

    def __init__(self, w, source, src_fmt, to, head_dim, heads, global_scale, threads, lanes) -> None:
        self.w, self.source, self.src_fmt, self.to = w, source, src_fmt, to
        self.head_dim, self.heads, self.g, self.threads, self.lanes = head_dim, heads, global_scale, threads, lanes
        self.width = _source_width(src_fmt, head_dim)
        itemsize = format_info(src_fmt).itemsize
        self.max_rows = _max_rows(self.width * itemsize, w.shard_rows)
        self.block_fmt = src_fmt if format_info(src_fmt).blocked else None
        self.per_row = format_info(src_fmt).scale_kind == "row"
        self.first_k = 0  # the shard the source's format was read from

    def _problem(self, k: int, rows: torch.Tensor, first_row: int, shard_row: int) -> Exception | None:
        own = getattr(self.source, "nonfinite_problem", None)
        text = (own or nonfinite_problem)(k, rows, first_row, shard_row, self.block_fmt)
        return None if text is None else getattr(self.source, "error", InvalidArgumentError)(text)

    def convert(self, k: int, shard: tuple[torch.Tensor, torch.Tensor | None] | None) -> dict[str, Any]:
        w, start = self.w, self.w.shard_range(k)[0]
        stop = w.shard_range(k)[1]
        if shard is not None:
            src, scale = shard
            fmt = _source_format(k, src, scale)
            if fmt != self.src_fmt:
                raise InvalidArgumentError(
                    f"source shard {k} is {fmt!r}, but shard {self.first_k} was {self.src_fmt!r}"
                )
            if start == stop:  # a shard past the end: nothing to write (a global scale is still checked)
                w.write_shard(k, src, scale)
                return _Errors(self.heads).record()
            if tuple(src.shape) != (stop - start, self.width):
                raise InvalidArgumentError(
                    f"source shard {k}: expected rows of shape [{stop - start}, {self.width}], got {tuple(src.shape)}"
                )
            pieces: Iterable = _pieces(src, scale, self.max_rows)
        else:
            pieces = self.source.chunks(k, self.max_rows)
        part = w.shard_writer(k)
        errors = _Errors(self.heads)
        at = start
        for rows, scale in pieces:
            self.lanes.check(k)
            m = rows.shape[0]
            if rows.dim() != 2 or rows.shape[1] != self.width or at + m > stop:
                raise InvalidArgumentError(
                    f"source shard {k}: rows of shape {tuple(rows.shape)} after row {at - start} do not fit "
                    f"its [{stop - start}, {self.width}]"
                )
            if self.source is not None and self.source.format is None:
                fmt = _source_format(k, rows, scale)
                if fmt != self.src_fmt:
                    raise InvalidArgumentError(f"source shard {k} is {fmt!r}, but shard 0 was {self.src_fmt!r}")
            if scale is not None:  # a zero, negative or non-finite source scale is refused, never requantized
                check_scale_values(scale, f"source shard {k}", first_row=at)
            if self.to is None:
                self._copy(k, part, rows, scale, at, start)
                errors.count(at, m)
            else:
                errors.add(self._encode(k, part, rows, scale, at, start), at)
            at += m
            self.lanes.advance(m)
        if at != stop:
            raise InvalidArgumentError(f"source shard {k}: {at - start} rows, expected {stop - start}")
        part.finish()
        return errors.record()

    def _copy(self, k, part, rows, scale, at, start) -> None:
        hit = first_nonfinite(rows, self.block_fmt)
        if hit is not None:  # a NaN or infinite row would be served as it is
            problem = self._problem(k, rows[hit[0] :], at + hit[0], at - start + hit[0])
            if problem is not None:
                raise problem
        if scale is not None and not self.per_row:
            self.w.set_global_scale(scale)
        part.write(tensor_bytes(rows), tensor_bytes(scale.float()) if self.per_row and scale is not None else None)

    def _encode(self, k, part, rows, scale, at, start) -> RowStats:
        assert self.to is not None
        try:
            enc = encode_rows(rows, scale, self.to, self.g, stats=True, threads=self.threads)
        except RowFailure as f:
            if f.kind == "nonfinite":
                problem = self._problem(k, rows[f.row :], at + f.row, at - start + f.row)
                if problem is not None:
                    raise problem from None
                raise InvalidArgumentError(
                    f"source shard {k}: table row {at + f.row}, column {f.column} is {f.value} once scaled "
                    "(its stored value times its scale), not a finite value"
                ) from None
            raise InvalidArgumentError(
                f"source shard {k}: {ScaleOverflowError(self.to, at + f.row, f.column, f.value, 'table row')}"
            ) from None
        part.write(enc.data, enc.scale)
        assert enc.stats is not None
        return enc.stats


# ---------------------------------------------------------------------------------------------- amax


def table_amax(
    shard_iter: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]] | Any,
    progress: bool = False,
    total_rows: int | None = None,
    name: str = "table",
) -> float:
    """The largest magnitude of a table's dequantized (fp32) values, one pass over its shards, side by
    side (what an nvfp4 conversion's global scale is made from). A value that is not finite is refused,
    naming its shard, row and column. ``progress``: a bar of the rows read (``total_rows`` its total,
    when known), described as ``name``'s amax pass."""
    source: Any = shard_iter if _is_source(shard_iter) else None
    threads = _threads()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=total_rows, unit="row", unit_scale=True, desc=f"amax {name} (nvfp4 global scale)", smoothing=0.1
        )
    lanes = _Lanes(threads, bar)
    found: list[float] = [0.0]

    def pieces_of(k: int, shard) -> Iterable:
        if shard is None:
            return source.chunks(k, 1 << 16)
        return _pieces(shard[0], shard[1], 1 << 16)

    def work(k: int, shard) -> float:
        amax, at = 0.0, 0
        first = k * source.shard_rows if source is not None else None
        for rows, scale in pieces_of(k, shard):
            lanes.check(k)
            if scale is not None:
                check_scale_values(scale, f"source shard {k}")
            try:
                amax = max(amax, rows_amax(rows, scale, threads=1 if lanes.lanes > 1 else threads))
            except RowFailure as f:
                where = f"table row {first + at + f.row}" if first is not None else f"row {at + f.row} of the shard"
                problem = nonfinite_problem(k, rows[f.row :], 0 if first is None else first + at + f.row, at + f.row)
                raise InvalidArgumentError(
                    problem
                    or f"source shard {k}: {where}, column {f.column} is {f.value} once scaled, not a finite value"
                ) from None
            at += rows.shape[0]
            lanes.advance(rows.shape[0])
        return amax

    if source is not None:
        jobs: Iterator = ((k, None) for k in range(source.num_shards))
    else:
        jobs = ((k, (src, scale)) for k, src, scale in shard_iter)
    try:
        lanes.run(jobs, work, lambda k, a: found.__setitem__(0, max(found[0], a)))
    finally:
        if bar is not None:
            bar.close()
    return found[0]


# ---------------------------------------------------------------------------------------------- compare


def compare_with_source(
    path: str | os.PathLike,
    shard_iter: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]] | Any,
    progress: bool = False,
    skip_rows: np.ndarray | None = None,
) -> list[str]:
    """Compare a table file with the source it was converted from, exactly; returns problems.

    A file in the source's format must hold the source's bytes (scales as fp32); a requantized
    file must hold exactly what :mod:`ple.table.formats.encode` gives for the dequantized source (what
    :func:`~ple.table.quantize_rows` and :func:`~ple.table.formats.blocks.quantize_blocks` give). Shards
    missing from the source, or of the wrong size, are problems too. The file is read with ``pread``
    and the shards are compared side by side; ``progress``: a tqdm bar of the rows compared.
    ``skip_rows``: sorted row ids that may differ (the trained rows of a merged table file)."""
    fd, header, _ = open_table(path)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=header["rows"], unit="row", unit_scale=True, desc=f"compare {Path(path).name}")
    try:
        return _Comparison(Path(path), fd, header, bar, skip_rows).run(shard_iter)
    finally:
        os.close(fd)
        if bar is not None:
            bar.close()


class _Comparison:
    def __init__(self, path: Path, fd: int, header: dict[str, Any], bar=None, skip=None) -> None:
        self.path, self.fd, self.header, self.skip = path, fd, header, skip
        self.fmt, self.rn, self.head_dim = header["format"], header["row_nbytes"], header["head_dim"]
        self.g = read_global_scale(fd, header, path) if header["scale"]["kind"] == "global" else None
        self.lanes = _Lanes(_threads(), bar)
        self.kernel_threads = 1 if self.lanes.lanes > 1 else _threads()

    def _read(self, offset: int, n: int) -> np.ndarray:
        b = os.pread(self.fd, n, offset)
        if len(b) != n:
            raise TableFileError(f"{self.path}: unexpected end of file at byte {offset + len(b)}")
        return np.frombuffer(b, dtype=np.uint8)

    def run(self, shard_iter) -> list[str]:
        source: Any = shard_iter if _is_source(shard_iter) else None
        h = self.header
        seen: set[int] = set()
        found: dict[int, list[str]] = {}
        if source is not None:
            jobs: Iterator = ((k, None) for k in range(min(source.num_shards, h["num_shards"])))
            seen.update(range(source.num_shards))
        else:
            jobs = ((k, (src, scale)) for k, src, scale in shard_iter)
        self.lanes.run(jobs, lambda k, shard: self.shard(k, shard, source), lambda k, p: found.__setitem__(k, p))
        seen.update(found)
        problems: list[str] = []
        scale_reported = False
        for k in sorted(found):
            for p in found[k]:
                if p.startswith("global scale:"):
                    if scale_reported:
                        continue
                    scale_reported = True
                problems.append(p)
        for k in range(h["num_shards"]):
            if k not in seen:
                a, b = shard_bounds(k, h["shard_rows"], h["rows"])
                problems.append(f"shard {k} (rows [{a}, {b})) is in the file but not in the source")
        return problems

    def shard(self, k: int, shard, source) -> list[str]:
        h = self.header
        start, stop = shard_bounds(k, h["shard_rows"], h["rows"])
        n = stop - start
        problems: list[str] = []
        if shard is not None:
            src, scale = shard
            src_width = format_info("nvfp4").width(self.head_dim) if src.dtype == torch.uint8 else self.head_dim
            if src.shape[0] != n or (n and src.shape[1] != src_width):
                return [f"shard {k}: source has shape {tuple(src.shape)}, the file has [{n}, {src_width}]"]
            if n == 0:
                return []
            pieces: Iterable = _pieces(src, scale, _max_rows(src.shape[1] * src.element_size(), max(n, 1)))
        else:
            pieces = source.chunks(k, _CHUNK_BYTES // (4 * self.head_dim))
        bad_rows, first_bad, at = 0, None, start
        reported = False
        for rows, s in pieces:
            self.lanes.check(k)
            m = rows.shape[0]
            src_fmt = source.format if source is not None and source.format else _source_format(k, rows, s)
            block = src_fmt if src_fmt in BLOCK_FORMATS else None
            problem = None if reported else nonfinite_problem(k, rows, at, at - start, block)
            if problem:
                reported = True
                problems.append(problem)
            got = self._read(h["data_offset"] + at * self.rn, m * self.rn).reshape(m, self.rn)
            got_s = want_s = None
            if src_fmt == self.fmt:
                want = tensor_bytes(rows).reshape(m, self.rn)
                if h["scale"]["kind"] == "row" and s is not None:
                    want_s = tensor_bytes(s.float()).reshape(m, 4)
                elif s is not None and float(s.float().reshape(-1)[0]) != self.g:
                    problems.append(f"global scale: file has {self.g}, the source {float(s.reshape(-1)[0])}")
            else:
                try:
                    enc = encode_rows(rows, s, self.fmt, self.g, threads=self.kernel_threads)
                except RowFailure as f:
                    if not reported:
                        problems.append(f"source shard {k}: table row {at + f.row}: {f}")
                        reported = True
                    at += m
                    continue
                want = enc.data
                if enc.scale is not None:
                    want_s = enc.scale.view(np.uint8).reshape(m, 4)
            diff = np.nonzero((got != want).any(axis=1))[0]
            if want_s is not None:
                got_s = self._read(h["scale"]["offset"] + 4 * at, 4 * m).reshape(m, 4)
                diff = np.union1d(diff, np.nonzero((got_s != want_s).any(axis=1))[0])
            if len(diff) and self.skip is not None:
                diff = diff[~np.isin(diff + at, self.skip)]
            if len(diff):
                bad_rows += len(diff)
                first_bad = at + int(diff[0]) if first_bad is None else first_bad
            at += m
            self.lanes.advance(m)
        if at != stop:
            problems.append(f"shard {k}: the source has {at - start} rows, the file {n}")
        if bad_rows:
            problems.append(
                f"shard {k} (rows [{start}, {stop})): {bad_rows} rows differ from the source, first at row {first_bad}"
            )
        return problems
