"""Loading what a checkpoint scan found: a PLE layer's weights and table, and its table written to
(or opened from) a table file.

Everything read here was validated by :func:`ple.checkpoint.check_checkpoint` first; the values of
the bulk data are checked as they stream by (per-row scales and finite table rows, finite dense
weights), so a file that changed after the scan raises :class:`CheckpointError` instead of being
served.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ple.checkpoint.scan import TABLE_SCALE, TABLE_SCALE2, TABLE_WEIGHT, LayerEntry, check_checkpoint
from ple.common.files import file_identity
from ple.common.safetensors import CheckpointError, PreadReader, TensorInfo, TensorReader, read_checked
from ple.config import PLEConfig
from ple.errors import InvalidArgumentError
from ple.layout import Layout
from ple.table import TABLE_SUFFIX, MemoryTable, MmapTable
from ple.table.files.transcode import convert_layer, nonfinite_problem
from ple.table.formats.catalog import check_scale_values

__all__ = [
    "PLEWeights",
    "TableShards",
    "iter_table_shards",
    "load_ple_weights",
    "load_table",
    "open_layer_table",
    "table_file_name",
    "table_shards",
    "write_layer_table",
]


@dataclasses.dataclass
class PLEWeights:
    """Everything one PLE layer needs, loaded. ``table`` is a :class:`ple.table.Table`."""

    ple_layer_index: int
    prefix: str
    layout: Layout
    key_proj: torch.Tensor  # [HC*H, E]
    value_proj: torch.Tensor  # [H, E]
    norm_key: torch.Tensor  # [HC*H]
    norm_query: torch.Tensor  # [HC*H]
    norm_conv: torch.Tensor  # [HC*H]
    conv1d: torch.Tensor  # [HC*H, K]
    table: object  # None when loaded with ``with_table=False``


def iter_table_shards(
    entry: LayerEntry, reader: TensorReader | None = None
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """Yield ``(k, rows [n_k, head_dim], per_row_scale [n_k, 1] | None)`` shard by shard, in order,
    read through ``reader`` (default: a :class:`TensorReader` of its own).

    An unsharded table is yielded in slices of ``shard_rows`` rows (so memory stays bounded by one shard).
    """
    own = reader is None
    reader = reader or TensorReader()
    try:
        lay = entry.layout
        if entry.whole_table is not None:
            for k in range(lay.split_parts):
                a, b = lay.shard_range(k)
                yield k, reader.rows(entry.whole_table, entry.prefix + TABLE_WEIGHT, a, b), None
            return
        for k in range(lay.split_parts):
            info = entry.shards[k]
            base = f"{entry.prefix}ple_embedding.ngram_embedding.shard_{k}"
            rows = reader.get(info, base + ".weight")
            scale = reader.get(entry.shard_scales[k], base + ".weight_scale") if k in entry.shard_scales else None
            if entry.table_format == "nvfp4" and scale is not None:
                # ple's nvfp4 row: the packed values, then the row's E4M3 block scales
                rows, scale = torch.cat([rows.view(torch.uint8), scale.view(torch.uint8)], dim=1), None
            yield k, rows, scale
    finally:
        if own:
            reader.close()


def load_table(
    e: LayerEntry,
    reader: TensorReader | None = None,
    *,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> MemoryTable:
    """PLE layer ``e``'s table (an entry of a scan without problems), read shard by shard through
    ``reader`` (default: a :class:`TensorReader` of its own; :class:`PreadReader` maps nothing)
    into a fresh :class:`~ple.table.MemoryTable` ``[padded_rows, head_dim]`` on ``device``, in the
    checkpoint's format. Every shard must have the shape and dtype the scan found, every scale must
    be a positive finite number; :class:`CheckpointError` otherwise (the file changed after it was
    scanned, or holds bad scales)."""
    if reader is None:
        with TensorReader() as own:
            return load_table(e, own, device=device, progress=progress)
    lay = e.layout
    assert e.table_format is not None  # a scan without problems found the format
    table = MemoryTable.empty(lay.padded_rows, lay.head_dim, e.table_format, device=device)
    data, tscale = table.data, table.scale
    shard_iter: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]] = iter_table_shards(e, reader)
    if progress:
        from tqdm.auto import tqdm

        shard_iter = tqdm(shard_iter, total=lay.split_parts, desc=f"PLE layer {e.ple_layer_index}", unit="shard")
    width = data.shape[1]
    for sk, rows, scale in shard_iter:
        a, b = lay.shard_range(sk)
        name = f"{e.prefix}ple_embedding.ngram_embedding.shard_{sk}"
        if tuple(rows.shape) != (b - a, width) or rows.dtype != data.dtype:
            raise CheckpointError(
                f"{name}: read {list(rows.shape)} {rows.dtype}, expected [{b - a}, {width}] "
                f"{data.dtype} (the file changed after it was scanned)"
            )
        problem = nonfinite_problem(sk, rows, a)
        if problem:  # a NaN row (an fp8 NaN byte included) would be served as it is
            raise CheckpointError(f"{name}: {problem}")
        data[a:b].copy_(rows)
        if scale is not None and tscale is not None:
            if tuple(scale.shape) != (b - a, 1):
                raise CheckpointError(
                    f"{name}.weight_scale: read {list(scale.shape)}, expected [{b - a}, 1] "
                    "(the file changed after it was scanned)"
                )
            _check_scale(scale, f"{name}.weight_scale", a)
            tscale[a:b].copy_(scale)
        del rows, scale
    if e.table_format == "fp8" and tscale is not None and e.global_scale is not None:
        gscale = reader.get(e.global_scale, e.prefix + TABLE_SCALE).reshape(1).float()
        _check_scale(gscale, e.prefix + TABLE_SCALE, 0)
        tscale.copy_(gscale)
    if e.table_format == "nvfp4" and tscale is not None and e.global_scale2 is not None:
        gscale = reader.get(e.global_scale2, e.prefix + TABLE_SCALE2).reshape(1).float()
        _check_scale(gscale, e.prefix + TABLE_SCALE2, 0)
        tscale.copy_(gscale)
    return table


def _check_scale(scale: torch.Tensor, name: str, first_row: int) -> None:
    try:
        check_scale_values(scale, name, first_row=first_row)
    except InvalidArgumentError as exc:
        raise CheckpointError(str(exc)) from None


def load_ple_weights(
    path: str | os.PathLike,
    config: PLEConfig,
    *,
    layers: list[int] | None = None,
    device: str | torch.device = "cpu",
    strict: bool = True,
    progress: bool = False,
    with_table: bool = True,
) -> dict[int, PLEWeights]:
    """Load PLE layers (``{ple_layer_index: PLEWeights}``) from a safetensors file or directory.

    The checkpoint is validated first (:func:`check_checkpoint`); then tensors are read one at a
    time, the table shard by shard into a freshly allocated :class:`ple.table.MemoryTable`, every
    dense weight checked finite and every scale a positive finite number as it is read. Nothing is
    returned (and no caller state is touched) unless every layer loaded; any failure raises
    :class:`CheckpointError`.

    Args:
        layers: ``ple_layer_index`` values to load (default: all).
        strict: unexpected tensor names under a PLE prefix are an error (else ignored).
        with_table: False reads everything but the table (``PLEWeights.table`` is None), for
            tables served from another tier (e.g. a table file made by ``ple convert``).
    """
    scan = check_checkpoint(path, config, layers=layers, strict=strict)
    wanted = [e for e in scan.layers if layers is None or e.ple_layer_index in layers]
    reader = TensorReader()
    out: dict[int, PLEWeights] = {}
    try:
        c, k = config.hc_hidden_size, config.ple_conv_kernel_size
        for e in wanted:
            lay = e.layout
            dense = {n: read_checked(reader, i, e.prefix + n, i.shape).to(device) for n, i in e.dense.items()}
            table = load_table(e, reader, device=device, progress=progress) if with_table else None
            out[e.ple_layer_index] = PLEWeights(
                ple_layer_index=e.ple_layer_index,
                prefix=e.prefix,
                layout=lay,
                key_proj=dense["key_proj.weight"],
                value_proj=dense["value_proj.weight"],
                norm_key=dense["norm_key.weight"],
                norm_query=dense["norm_query.weight"],
                norm_conv=dense["norm_conv.weight"],
                conv1d=dense["conv1d.weight"].reshape(c, k),
                table=table,
            )
    except CheckpointError:
        raise
    except Exception as exc:  # a file changed or broke under us: report it as a checkpoint problem
        raise CheckpointError([f"reading failed: {type(exc).__name__}: {exc}"]) from exc
    finally:
        reader.close()
    return out


class TableShards:
    """A layer's table as :func:`ple.table.files.transcode.convert_layer` takes it (:func:`table_shards`).

    Iterated, it yields ``(k, rows [n_k, width], scale)`` shard by shard, in order, where ``scale`` is
    the shard's per-row scale or, for an fp8 or nvfp4 table, the global scale ``[1]`` (None for plain
    tables). As a shard source (``num_shards``, ``shard_rows``, ``format``, ``identity``, ``chunks``)
    it reads pieces of a shard with ``pread`` (a :class:`PreadReader` per shard: nothing mapped, so
    memory stays at a piece, from any thread), and names its bytes by the files' paths and identities
    (:func:`ple.common.files.file_identity`: size, modification and change times, inode) and the tensors'
    places in them (a conversion it feeds can resume).
    """

    def __init__(self, entry: LayerEntry, reader: TensorReader | None = None) -> None:
        self.entry, self.reader = entry, reader
        self.num_shards = entry.layout.split_parts
        self.shard_rows = entry.layout.shard_rows
        self.format: str | None = None  # inferred from the rows
        self._gscale: torch.Tensor | None = None
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        own = self.reader is None
        reader = self.reader or TensorReader()
        try:
            gscale = self._global_scale(reader)
            for k, rows, scale in iter_table_shards(self.entry, reader):
                yield k, rows, (gscale if scale is None else scale)
        finally:
            if own:
                reader.close()

    def _global_scale(self, reader: TensorReader) -> torch.Tensor | None:
        e = self.entry
        if e.table_format == "fp8" and e.global_scale is not None:
            return reader.get(e.global_scale, e.prefix + TABLE_SCALE).reshape(1).float()
        if e.table_format == "nvfp4" and e.global_scale2 is not None:
            return reader.get(e.global_scale2, e.prefix + TABLE_SCALE2).reshape(1).float()
        return None

    def _tensors(self) -> list[tuple[str, TensorInfo]]:
        e = self.entry
        out = [(TABLE_WEIGHT, e.whole_table)] if e.whole_table is not None else []
        out += [(f"shard_{k}.weight", i) for k, i in sorted(e.shards.items())]
        out += [(f"shard_{k}.weight_scale", i) for k, i in sorted(e.shard_scales.items())]
        out += [(n, i) for n, i in ((TABLE_SCALE, e.global_scale), (TABLE_SCALE2, e.global_scale2)) if i is not None]
        return [(n, i) for n, i in out if i is not None]

    @property
    def identity(self) -> str:
        """A digest of where the table's bytes lie and of the files holding them as they are now."""
        files = {}
        for _, info in self._tensors():
            if info.file not in files:
                files[info.file] = [str(Path(info.file).resolve()), file_identity(info.file)]
        record = {
            "prefix": self.entry.prefix,
            "format": self.entry.table_format,
            "files": sorted(files.values()),
            "tensors": [[n, str(i.file), i.dtype, list(i.shape), i.begin, i.end] for n, i in self._tensors()],
        }
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()

    def chunks(self, k: int, max_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Shard ``k``'s rows ``(rows [m, width], scale)`` in pieces of at most ``max_rows`` rows, in order;
        a piece's rows are read into one buffer the shard's pieces share: valid until the next piece."""
        e = self.entry
        a, b = e.layout.shard_range(k)
        step = max(1, max_rows)
        info = e.whole_table if e.whole_table is not None else e.shards[k]
        row_bytes = info.nbytes // max(1, info.shape[0]) if info.shape else 0
        buffer = mmap.mmap(-1, max(1, min(step, b - a) * row_bytes))
        with PreadReader() as reader:
            with self._lock:
                if self._gscale is None:
                    self._gscale = self._global_scale(reader)
            gscale = self._gscale
            base = f"{e.prefix}ple_embedding.ngram_embedding.shard_{k}"
            for lo in range(0, b - a, step):
                hi = min(b - a, lo + step)
                then = (hi, min(b - a, hi + step))  # read ahead while this piece is worked on
                if e.whole_table is not None:
                    nxt = (a + then[0], a + then[1])
                    yield reader.rows_into(e.whole_table, e.prefix + TABLE_WEIGHT, a + lo, a + hi, buffer, nxt), gscale
                    continue
                rows = reader.rows_into(e.shards[k], base + ".weight", lo, hi, buffer, then)
                scale = reader.rows(e.shard_scales[k], base + ".weight_scale", lo, hi) if k in e.shard_scales else None
                if e.table_format == "nvfp4" and scale is not None:
                    # ple's nvfp4 row: the packed values, then the row's E4M3 block scales
                    rows, scale = torch.cat([rows.view(torch.uint8), scale.view(torch.uint8)], dim=1), None
                yield rows, (gscale if scale is None else scale)


def table_shards(entry: LayerEntry, reader: TensorReader | None = None) -> TableShards:
    """A layer's table shard by shard as :func:`ple.table.files.transcode.convert_layer` takes it (see
    :class:`TableShards`): iterated, ``(k, rows [n_k, head_dim], scale)`` where ``scale`` is the shard's
    per-row scale or, for an fp8 table, the global scale ``[1]`` (None for plain tables)."""
    return TableShards(entry, reader)


def table_file_name(prefix: str, format: str | None = None) -> str:
    """The table file name ``ple convert`` gives a PLE layer with this checkpoint prefix (with
    ``format``: the name of a copy in that format, beside the checkpoint-format one)."""
    stem = prefix.rstrip(".").replace("/", "_")
    return stem + ("" if format is None else "." + format) + TABLE_SUFFIX


def write_layer_table(
    shards: Iterable[tuple[int, torch.Tensor, torch.Tensor | None]],
    path: str | os.PathLike,
    config: PLEConfig,
    ple_layer_index: int,
    *,
    to: str | None = None,
    force: bool = False,
    progress: bool = False,
    global_scale: float | None = None,
) -> dict:
    """Write PLE layer ``ple_layer_index``'s table, from ``(k, rows, scale)`` shards (any source: a
    checkpoint's :func:`table_shards`, slices of an in-memory weight), as a table file carrying the
    layer's layout fields. ``to="nvfp4"`` needs ``global_scale``. Returns
    :func:`ple.table.files.transcode.convert_layer`'s statistics."""
    lay = config.layout(ple_layer_index)
    return convert_layer(
        shards,
        path,
        config.layout_fields(ple_layer_index),
        lay.padded_rows,
        lay.head_dim,
        lay.shard_rows,
        to=to,
        force=force,
        progress=progress,
        head_ranges=[(o, o + n) for o, n in zip(lay.head_offsets, lay.head_sizes)],
        global_scale=global_scale,
    )


def open_layer_table(
    path: str | os.PathLike, config: PLEConfig, ple_layer_index: int, *, random_access: bool = True
) -> MmapTable:
    """Map a table file, refusing one made for another layer or layout than ``config``'s layer
    ``ple_layer_index``."""
    return MmapTable.open(path, config.layout_fields(ple_layer_index), random_access=random_access)
