"""Convert a PLE layer's table, shard by shard, into a table file; compare a file with its source.

The source is an iterator of ``(k, rows, scale)`` shards (any order; a checkpoint reader provides
it): ``rows [n_k, head_dim]`` plain (bf16/fp16/fp32, ``scale`` None), fp8 with the global scale
(``[1]``), or fp8/int8 with per-row scales (``[n_k, 1]``). Memory stays bounded by one shard plus
one chunk of fp32 rows. Source scales must be positive finite numbers (see
:func:`~ple.table.formats.check_scale_values`), and source rows finite (an fp8 NaN byte is refused
too, naming its shard and row: :func:`first_nonfinite_row`).

Targets: the source's own format (an exact copy, whatever ``to`` says), one scale per row
("fp8_row", "int8_row"), or a block format (:mod:`ple.table.blocks`; nvfp4 also needs the table's
global scale, from :func:`table_amax` through :func:`~ple.table.blocks.nvfp4_global_scale`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from .blocks import dequantize_blocks, quantize_blocks
from .formats import BLOCK_FORMATS, check_scale_values, format_info, infer_format
from .mmap import MmapTable
from .quantize import QuantStats, RowStats, dequantize, quantize_rows
from .table_file import TableFileWriter, tensor_bytes

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
_CHUNK_ROWS = 1 << 17


def _source_format(k: int, rows: torch.Tensor, scale: torch.Tensor | None) -> str:
    try:
        return infer_format(rows, scale)
    except ValueError as e:
        raise InvalidArgumentError(f"source shard {k}: {e}") from None


# bits that make a NaN (and, for e5m2, an infinity) of each fp8 storage dtype, sign excluded
_FP8_SPECIAL = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}


def first_nonfinite_row(rows: torch.Tensor) -> int | None:
    """The index of the first row of ``rows [n, ...]`` holding a NaN or an infinity, None when every
    value is finite (integer rows always are). fp8 rows are judged by their bits, so a NaN byte is
    found whatever torch supports for the dtype. Reads ``rows`` in chunks (bounded extra memory)."""
    if not rows.is_floating_point() or rows.shape[0] == 0:
        return None
    special = _FP8_SPECIAL.get(rows.dtype)
    for c0 in range(0, rows.shape[0], _CHUNK_ROWS):
        chunk = rows[c0 : c0 + _CHUNK_ROWS].reshape(min(_CHUNK_ROWS, rows.shape[0] - c0), -1)
        if special is not None:
            bits = chunk.view(torch.uint8)
            bad = (bits & special) == special
        else:
            bad = ~torch.isfinite(chunk)
        hit = bad.any(dim=1).nonzero()
        if hit.numel():
            return c0 + int(hit[0])
    return None


def nonfinite_problem(k: int, rows: torch.Tensor, first_row: int) -> str | None:
    """``"source shard k: row r holds a non-finite value (...)"`` for the first such row of shard ``k``
    (whose first row is table row ``first_row``), or None."""
    i = first_nonfinite_row(rows)
    if i is None:
        return None
    row = rows[i].reshape(-1)
    values = row.view(torch.uint8) if row.dtype in _FP8_SPECIAL else row
    special = _FP8_SPECIAL.get(row.dtype)
    if special is not None:
        col = int(((values & special) == special).nonzero()[0])
        what = f"byte 0x{int(values[col]):02x} (NaN in {row.dtype})"
    else:
        col = int((~torch.isfinite(row)).nonzero()[0])
        what = str(float(row[col]))
    return (
        f"source shard {k}: table row {first_row + i} (row {i} of the shard), column {col} holds {what}, "
        "not a finite value"
    )


def _scale_chunk(scale: torch.Tensor | None, c0: int, c1: int) -> torch.Tensor | None:
    if scale is None or scale.dim() != 2:
        return scale
    return scale[c0:c1]


def _dequantized(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Source rows in fp32 (a global fp8 scale is applied before any requantization; nvfp4 rows,
    the one uint8 source, are decoded)."""
    if rows.dtype == torch.uint8:
        return dequantize_blocks(rows, "nvfp4", scale)
    return dequantize(rows, None if scale is None else scale.float(), torch.float32)


def convert_layer(
    shard_iter: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]],
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
        shard_iter: yields ``(k, rows [n_k, head_dim], scale | None)`` for every shard of the table.
        out_path: the table file to create (atomically; see :class:`TableFileWriter`).
        layout_hash: hash of the layout fields (str) or the fields (dict), stored in the header.
        rows, head_dim, shard_rows: table geometry; shard ``k`` holds rows
            ``[k*shard_rows, min((k+1)*shard_rows, rows))``.
        to: None, or the source's own format, copies the source exactly; "fp8_row" / "int8_row"
            dequantize each row (fp32, with the source's global or per-row scale) and requantize it
            with its own scale; a block format quantizes the fp32 rows into its blocks.
        force: replace an existing file.
        progress: show a tqdm progress bar (rows written).
        head_ranges: row ranges ``(start, stop)`` of the hash heads for per-head error statistics.
        global_scale: the nvfp4 table's global scale (needed for ``to="nvfp4"``).

    Returns:
        ``{"path", "format", "source_format", "rows", "error": {max_rel, rms_rel, rows},
        "per_head": [{start, stop, max_rel, rms_rel, rows}, ...]}``; errors are relative to the
        fp32 dequantized source (see :mod:`ple.table.quantize`); zero when ``to`` is None.
    """
    if to not in _TARGETS:
        raise InvalidArgumentError(f"convert_layer: to must be one of {list(_TARGETS)}, got {to!r}")
    heads = [(int(a), int(b)) for a, b in (head_ranges or [])]
    for a, b in heads:
        if not 0 <= a <= b <= rows:
            raise InvalidArgumentError(f"head range ({a}, {b}) is not inside the table's rows [0, {rows})")
    it = iter(shard_iter)
    try:
        first = next(it)
    except StopIteration:
        raise InvalidArgumentError("convert_layer: the source yielded no shards") from None
    src_fmt = _source_format(first[0], first[1], first[2])
    if to == src_fmt:
        to = None  # the format the source already has: an exact copy, never a requantization
    out_fmt = src_fmt if to is None else to
    if to == "nvfp4" and global_scale is None:
        raise InvalidArgumentError("convert_layer: an nvfp4 table needs its global_scale (see table_amax)")
    if to is not None:
        format_info(to).check_head_dim(head_dim)
    head_err = [QuantStats() for _ in heads]
    total_err = QuantStats()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=rows, unit="row", unit_scale=True, desc=f"convert {Path(out_path).name}")
    try:
        with TableFileWriter(out_path, rows, head_dim, out_fmt, shard_rows, layout_hash, force=force) as w:
            for item in _chain(first, it):
                k, src, scale = item
                fmt = _source_format(k, src, scale)
                if fmt != src_fmt:
                    raise InvalidArgumentError(f"source shard {k} is {fmt!r}, but shard {first[0]} was {src_fmt!r}")
                start, stop = w.shard_range(k)
                if scale is not None:  # a zero, negative or non-finite source scale is refused, never requantized
                    check_scale_values(scale, f"source shard {k}", first_row=start)
                problem = nonfinite_problem(k, src, start)
                if problem:  # a NaN or infinite row would be served as it is
                    raise InvalidArgumentError(problem)
                if to is None:
                    w.write_shard(k, src, scale)
                    total_err.rows += stop - start
                    for (a, b), e in zip(heads, head_err):
                        e.rows += max(0, min(b, stop) - max(a, start))
                else:
                    q, qs = _requantize_shard(
                        k, src, scale, head_dim, stop - start, to, start, heads, head_err, total_err, global_scale
                    )
                    w.write_shard(k, q, qs)
                if bar is not None:
                    bar.update(stop - start)
    finally:
        if bar is not None:
            bar.close()
    return {
        "path": str(out_path),
        "format": out_fmt,
        "source_format": src_fmt,
        "rows": rows,
        "error": total_err.to_dict(),
        "per_head": [{"start": a, "stop": b, **e.to_dict()} for (a, b), e in zip(heads, head_err)],
    }


def _chain(first, rest):
    yield first
    yield from rest


def _quantize(x: torch.Tensor, to: str, global_scale: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 rows -> ``(stored rows, per-row scale or None)`` in format ``to``."""
    if format_info(to).blocked:
        return torch.from_numpy(quantize_blocks(x, to, global_scale)), None
    return quantize_rows(x, to)


def _dequantize(q: torch.Tensor, scale: torch.Tensor | None, fmt: str, global_scale: float | None) -> torch.Tensor:
    if format_info(fmt).blocked:
        return dequantize_blocks(q, fmt, global_scale)
    return dequantize(q, scale, torch.float32)


def _requantize_shard(k, src, scale, head_dim, n, to, start, heads, head_err, total_err, global_scale=None):
    width = format_info("nvfp4").width(head_dim) if src.dtype == torch.uint8 else head_dim
    if tuple(src.shape) != (n, width):
        raise InvalidArgumentError(f"source shard {k}: expected rows of shape [{n}, {width}], got {tuple(src.shape)}")
    info = format_info(to)
    q = torch.empty(n, info.width(head_dim), dtype=info.storage_dtype)
    qs = None if info.blocked else torch.empty(n, 1, dtype=torch.float32)
    for c0 in range(0, n, _CHUNK_ROWS):
        c1 = min(n, c0 + _CHUNK_ROWS)
        x = _dequantized(src[c0:c1].cpu(), _scale_chunk(scale, c0, c1))
        qc, sc = _quantize(x, to, global_scale)
        q[c0:c1] = qc
        if qs is not None:
            qs[c0:c1] = sc
        errs = RowStats.of(x, _dequantize(qc, sc, to, global_scale))
        total_err.add(errs)
        g0, g1 = start + c0, start + c1
        for (a, b), e in zip(heads, head_err):
            lo, hi = max(a, g0), min(b, g1)
            if lo < hi:
                e.add(errs, lo - g0, hi - g0)
    if to == "nvfp4":
        qs = torch.tensor([global_scale], dtype=torch.float32)
    return q, qs


def table_amax(shard_iter: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]]) -> float:
    """The largest magnitude of a table's dequantized (fp32) values, one pass over its shards
    (what an nvfp4 conversion's global scale is made from)."""
    amax = 0.0
    for k, src, scale in shard_iter:
        if scale is not None:
            check_scale_values(scale, f"source shard {k}")
        for c0 in range(0, src.shape[0], _CHUNK_ROWS):
            c1 = min(src.shape[0], c0 + _CHUNK_ROWS)
            x = _dequantized(src[c0:c1].cpu(), _scale_chunk(scale, c0, c1))
            if x.numel():
                amax = max(amax, float(x.abs().max()))
    return amax


def _row_mismatch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Indices of rows whose bytes differ (``a``, ``b``: ``[n, row_bytes]`` uint8)."""
    return np.nonzero((a != b).any(axis=1))[0]


def compare_with_source(
    path: str | os.PathLike, shard_iter: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]]
) -> list[str]:
    """Compare a table file with the source it was converted from, exactly; returns problems.

    A file in the source's format must hold the source's bytes (scales as fp32); a requantized
    file must hold exactly what :func:`~ple.table.quantize_rows` gives for the dequantized source.
    Shards missing from the source, or of the wrong size, are problems too.
    """
    table = MmapTable.open(path)
    problems: list[str] = []
    num_shards = table.header["num_shards"]
    seen: set[int] = set()
    scale_reported = False
    rn = table.header["row_nbytes"]
    for k, src, scale in shard_iter:
        start, stop = table.shard_range(k)
        n = stop - start
        src_width = format_info("nvfp4").width(table.head_dim) if src.dtype == torch.uint8 else table.head_dim
        if src.shape[0] != n or (n and src.shape[1] != src_width):
            problems.append(f"shard {k}: source has shape {tuple(src.shape)}, the file has [{n}, {src_width}]")
            continue
        seen.add(k)
        if n == 0:
            continue
        src_fmt = _source_format(k, src, scale)
        problem = nonfinite_problem(k, src, start)
        if problem:
            problems.append(problem)
        bad_rows = 0
        first_bad = None
        for c0 in range(0, n, _CHUNK_ROWS):
            c1 = min(n, c0 + _CHUNK_ROWS)
            s = _scale_chunk(scale, c0, c1)
            if src_fmt == table.format:
                want_q, want_s = src[c0:c1], s
            else:
                g = float(table.scale[0]) if table.format == "nvfp4" and table.scale is not None else None
                want_q, want_s = _quantize(_dequantized(src[c0:c1].cpu(), s), table.format, g)
            got = tensor_bytes(table.data[start + c0 : start + c1]).reshape(c1 - c0, rn)
            want = tensor_bytes(want_q).reshape(c1 - c0, rn)
            diff = _row_mismatch(got, want)
            if table.scale is not None and table.scale.dim() == 2 and want_s is not None:
                got_s = tensor_bytes(table.scale[start + c0 : start + c1]).reshape(c1 - c0, 4)
                want_s_b = tensor_bytes(want_s.float()).reshape(c1 - c0, 4)
                diff = np.union1d(diff, _row_mismatch(got_s, want_s_b))
            if len(diff):
                bad_rows += len(diff)
                first_bad = start + c0 + int(diff[0]) if first_bad is None else first_bad
        fscale = table.scale
        if (
            fscale is not None
            and fscale.dim() == 1
            and scale is not None
            and src_fmt == table.format
            and not scale_reported
        ):
            if float(scale.float().reshape(-1)[0]) != float(fscale[0]):
                scale_reported = True
                problems.append(f"global scale: file has {float(fscale[0])}, the source {float(scale.reshape(-1)[0])}")
        if bad_rows:
            problems.append(
                f"shard {k} (rows [{start}, {stop})): {bad_rows} rows differ from the source, first at row {first_bad}"
            )
    for k in range(num_shards):
        if k not in seen:
            a, b = table.shard_range(k)
            problems.append(f"shard {k} (rows [{a}, {b})) is in the file but not in the source")
    return problems
