"""A patched layer's table in checkpoint form, and given back to a transformers module.

What ``save_pretrained`` writes for a table (:func:`table_state`) and what :func:`unpatch
<ple.integrations.transformers.unpatch>` gives the original module back (:func:`weight_from_table`),
for every tier ple serves from (memory, memory map, row cache, direct reads) and with or without an
adapter (:class:`~ple.table.tiers.adapted.AdaptedTable`, the rows ``ple.train`` trained):

- A table with an adapter is handed over *merged*: the base table's rows with the trained rows in
  place, requantized to the base's format exactly as :func:`ple.train.merge_model` writes them
  (:func:`ple.train.merge.merge_rows`), so saving an adapted model gives the checkpoint that
  ``merge_model`` then ``save_pretrained`` gives, without changing the model (the adapter stays).
- Rows that need writing (a checkpoint shard holding trained rows, a block format's rows dequantized
  for transformers) are *staged*: streamed a chunk at a time into an unnamed file (nothing is left
  behind, whatever happens to the process) and handed over as a read-only map of it; memory stays a
  chunk's, never the table's. The file goes to the folder being saved to (``save_pretrained`` sets it,
  :func:`staging`), else beside the table's file, else to the system's temporary folder; it takes the
  disk space of what it holds until the saved tensors are dropped.
- Untouched rows are maps of the table's file (memory-mapped, cached and direct tiers; a direct
  table's file is mapped after its header is checked equal to the one it reads) or views of the
  table in memory: nothing is copied.
- Given back by ``unpatch``: a table stored in the module's dtype comes back as a copy-on-write map
  of its file (the pages of trained rows written into it become private memory of this process, the
  file is never written) or, in memory, as a copy with the trained rows in it; otherwise it is
  dequantized into memory (``materialize=True``).

A table sharded across ranks holds only this rank's rows: it is refused, naming what to do instead
(save the adapter with ``ple.train.save_sharded_adapter`` and merge it into the table files).

A table being trained (``ple.train.trainable``, not frozen) is in its training state instead
(:func:`trained_state`): the trained rows alone, ids and fp32 rows, exactly as the overlay holds them
(``TRAINED_KEYS``), never a table-sized tensor; what a training checkpoint (transformers' ``Trainer``,
a user's ``torch.save(model.state_dict())``) needs to resume exactly. :func:`load_trained` puts such
rows back (replacing the trained rows; the base table is never written).
"""

from __future__ import annotations

import contextlib
import contextvars
import mmap
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from ple.errors import UsageError
from ple.layer import PLELayer
from ple.table import CachedTable, DirectTable, MmapTable, ShardedTable, StoredTable, Table, dequantize, format_info
from ple.table.files.table_file import TableFileError
from ple.table.formats.blocks import dequantize_blocks
from ple.table.tiers.adapted import AdaptedTable, RowOverlay
from ple.table.tiers.rowstore import unnamed_file
from ple.train.merge import global_scale_of, merge_rows

__all__ = ["table_state", "trained_state", "load_trained", "weight_from_table", "staging", "STAGE_ROWS", "TRAINED_KEYS"]

TRAINED_KEYS = ("trained_ids", "trained_rows")
"""A trainable table's names in a state dict (after the table's prefix): the trained row ids ``[n]``
int64 (sorted) and their rows ``[n, head_dim]`` fp32."""

STAGE_ROWS = 1 << 16
"""Rows a staged copy is written in at a time (its memory: one chunk of stored and dequantized rows)."""

_STAGING: contextvars.ContextVar[Path | None] = contextvars.ContextVar("ple_table_staging", default=None)


@contextlib.contextmanager
def staging(folder: str | os.PathLike) -> Iterator[None]:
    """Within the block, staged table copies go to ``folder`` (see the module docstring)."""
    token = _STAGING.set(Path(folder))
    try:
        yield
    finally:
        _STAGING.reset(token)


class _Source:
    """Where a table's rows are read from: a stored table (``stored``), the trained rows on top of it
    (``overlay``, None without any), and a table opened here for the purpose (closed by :meth:`close`;
    its maps outlive it)."""

    def __init__(self, table: Table, layer_index: int) -> None:
        self.overlay: RowOverlay | None = None
        self.opened: MmapTable | None = None
        at = table
        if isinstance(at, AdaptedTable):
            self.overlay = at.overlay if len(at.overlay) else None
            at = at.base
        if isinstance(at, CachedTable):
            at = at.backing
        if isinstance(at, DirectTable):
            at = self.opened = _map_direct(at)
        if isinstance(at, ShardedTable):
            raise UsageError(
                f"PLE layer {layer_index}: the table is sharded across ranks and this process holds only its own "
                "rows; save the trained rows with ple.train.save_sharded_adapter and merge them into the table "
                "files with ple.train.merge_table_file (or ple train --merge), or save from a process that holds "
                "the whole table"
            )
        if not isinstance(at, StoredTable):
            raise UsageError(
                f"PLE layer {layer_index}: a {type(at).__name__} does not expose its rows (not a stored table): the "
                "table cannot be saved from here, nor given back to the original module"
            )
        self.stored: StoredTable = at
        self.format = at.format
        self.kind = format_info(at.format).scale_kind
        self.blocked = format_info(at.format).blocked
        self.global_scale = global_scale_of(at)

    def trained(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [m] in [start, stop), rows [m, head_dim])``: the trained rows there."""
        if self.overlay is None:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.stored.head_dim)
        return self.overlay.range(start, stop)

    def merged(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``[start, stop)`` as stored, trained rows merged in: ``(data [n, width], per-row scale
        [n, 1] or None)``; views of the table where no row there was trained."""
        data = self.stored.data[start:stop]
        scale = self.stored.scale
        row_scale = scale[start:stop] if self.kind == "row" and scale is not None else None
        ids, values = self.trained(start, stop)
        if ids.numel() == 0:
            return data, row_scale
        data = data.clone()
        row_scale = None if row_scale is None else row_scale.clone()
        merge_rows(data, row_scale, ids - start, values, self.format, self.global_scale)
        return data, row_scale

    def values(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[start, stop)`` dequantized to ``[n, head_dim]`` ``dtype``, trained rows merged in."""
        data, row_scale = self.merged(start, stop)
        if self.blocked:
            return dequantize_blocks(data, self.format, self.stored.scale).to(dtype)
        return dequantize(data, row_scale if self.kind == "row" else self.stored.scale, dtype)

    def folder(self) -> Path | None:
        path = getattr(self.stored, "path", None)
        return Path(os.path.abspath(path)).parent if isinstance(path, (str, os.PathLike)) else None

    def close(self) -> None:
        if self.opened is not None:
            self.opened.close()
            self.opened = None


def _map_direct(table: DirectTable) -> MmapTable:
    """The file a direct table reads, mapped; refused unless its header is the one the table read."""
    mapped = MmapTable.open(table.path, table.layout_hash, random_access=False)
    if mapped.header != table.header:
        mapped.close()
        raise TableFileError(
            f"{table.path} is no longer the table file this direct table opened (another file was renamed over "
            "it): open the model again to save or give back its table"
        )
    return mapped


# ---------------------------------------------------------------------------------------------- staging
def _stage_fd(source: _Source) -> int:
    """An unnamed file in the staging folder (see the module docstring)."""
    set_folder = _STAGING.get()
    candidates = [set_folder] if set_folder is not None else [source.folder(), Path(tempfile.gettempdir())]
    error: OSError | None = None
    for folder in candidates:
        if folder is None:
            continue
        try:
            return unnamed_file(folder)
        except OSError as e:
            error = e
    assert error is not None
    raise error


def _staged(source: _Source, n: int, width: int, dtype: torch.dtype, chunks) -> torch.Tensor:
    """``[n, width]`` ``dtype``: the rows ``chunks`` yields (``(first row, rows)``, in any order)
    written to an unnamed file, handed over as a read-only map of it (a storage of its own)."""
    row_nbytes = width * dtype.itemsize
    fd = _stage_fd(source)
    try:
        os.ftruncate(fd, n * row_nbytes)
        for first, rows in chunks:
            raw = memoryview(rows.contiguous().view(torch.uint8).numpy()).cast("B")
            offset, done = first * row_nbytes, 0
            while done < len(raw):
                done += os.pwrite(fd, raw[done:], offset + done)
        buf = mmap.mmap(fd, n * row_nbytes, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)  # the map keeps the file; it is freed when the map is
    arr = np.frombuffer(buf, dtype=np.uint8, count=n * row_nbytes).reshape(n, row_nbytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only on purpose
        t = torch.from_numpy(arr)
    return t if dtype == torch.uint8 else t.view(dtype)


def _chunks(start: int, stop: int) -> Iterator[tuple[int, int]]:
    for a in range(start, stop, STAGE_ROWS):
        yield a, min(stop, a + STAGE_ROWS)


def _distinct_storage(t: torch.Tensor) -> torch.Tensor:
    """The same memory as the CPU tensor ``t``, under a storage of its own (transformers keeps tensors
    of one storage in one file, so shards must not share one to honour ``max_shard_size``)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return t
    raw = t.contiguous().view(torch.uint8).numpy()
    return torch.from_numpy(raw).view(t.dtype)


# ---------------------------------------------------------------------------------------------- save
def table_state(table: Table, layer: PLELayer, base: str) -> dict[str, torch.Tensor]:
    """A table in checkpoint form: ``{base}shard_{k}.weight`` per shard (plus ``{base}weight_scale`` or
    ``{base}shard_{k}.weight_scale``), each tensor with a storage of its own (see the module
    docstring: untouched rows mapped or viewed, trained rows merged and block formats dequantized to
    the layer's dtype through staged files). Raises :class:`UsageError` when the rows are not
    readable here (a table sharded across ranks)."""
    source = _Source(table, layer.ple_layer_index)
    try:
        return _state(source, layer, base)
    finally:
        source.close()


def _state(source: _Source, layer: PLELayer, base: str) -> dict[str, torch.Tensor]:
    lay = layer.layout
    stored = source.stored
    mapped = stored if isinstance(stored, MmapTable) else None
    out: dict[str, torch.Tensor] = {}
    for k in range(lay.split_parts):
        a, b = lay.shard_range(k)
        name = f"{base}shard_{k}.weight"
        if source.blocked:
            # transformers reads no block format: each shard dequantized to the layer's dtype, no scale
            out[name] = _staged(
                source,
                b - a,
                stored.head_dim,
                layer.dtype,
                ((c - a, source.values(c, d, layer.dtype)) for c, d in _chunks(a, b)),
            )
            continue
        trained = source.trained(a, b)[0].numel() > 0
        if trained:
            width = stored.data.shape[1]
            out[name] = _staged(
                source, b - a, width, stored.data.dtype, ((c - a, source.merged(c, d)[0]) for c, d in _chunks(a, b))
            )
        elif mapped is not None:
            out[name] = mapped.map_rows(a, b)
        else:
            out[name] = _distinct_storage(stored.data.detach()[a:b])
        if source.kind == "row":
            scale = stored.scale
            assert scale is not None
            if trained:
                out[f"{base}shard_{k}.weight_scale"] = _staged(
                    source, b - a, 1, torch.float32, ((c - a, _row_scale(source, c, d)) for c, d in _chunks(a, b))
                )
            elif mapped is not None:
                out[f"{base}shard_{k}.weight_scale"] = mapped.map_rows(a, b, scales=True)
            else:
                out[f"{base}shard_{k}.weight_scale"] = _distinct_storage(scale.detach()[a:b])
    if source.kind == "global" and not source.blocked:
        assert stored.scale is not None
        out[f"{base}weight_scale"] = stored.scale.detach().reshape(1).float().clone()
    return out


def _row_scale(source: _Source, a: int, b: int) -> torch.Tensor:
    scale = source.merged(a, b)[1]
    assert scale is not None
    return scale


# ---------------------------------------------------------------------------------------------- training state
def _refuse_sharded(table: Table | None, layer_index: int) -> None:
    if isinstance(table, ShardedTable):
        raise UsageError(
            f"PLE layer {layer_index}: the table is sharded across ranks and this process holds only its own "
            "rows; save the trained rows with ple.train.save_sharded_adapter and load them with "
            "ple.train.load_adapter"
        )


def trained_state(layer: PLELayer, base: str) -> dict[str, torch.Tensor]:
    """A trainable table in checkpoint form: ``{base}trained_ids [n]`` int64 (sorted) and
    ``{base}trained_rows [n, head_dim]`` fp32, the overlay's rows exactly (none before the first step)."""
    table = layer.table
    _refuse_sharded(table, layer.ple_layer_index)
    assert table is not None
    if isinstance(table, AdaptedTable) and len(table.overlay):
        ids, rows = table.overlay.range(0, table.rows)
        rows = rows.to(torch.float32)
    else:
        ids, rows = torch.empty(0, dtype=torch.int64), torch.empty(0, table.head_dim)
    return {base + TRAINED_KEYS[0]: ids, base + TRAINED_KEYS[1]: rows}


def load_trained(layer: PLELayer, ids: torch.Tensor, rows: torch.Tensor, spill_dir) -> str | None:
    """Make ``(ids, rows)`` (from :func:`trained_state`) the trained rows of ``layer``'s table, exactly
    (an overlay put on a table without one, in ``spill_dir`` beyond its memory); the base table is
    never written. Returns what is wrong with them instead (nothing changed), or None."""
    table = layer.table
    i = layer.ple_layer_index
    if table is None:
        return f"PLE layer {i} has no table to load trained rows into"
    if isinstance(table, ShardedTable):
        return (
            f"PLE layer {i}'s table is sharded across ranks: load its trained rows with ple.train.load_adapter "
            "(from ple.train.save_sharded_adapter)"
        )
    if ids.dim() != 1 or ids.dtype != torch.int64 or tuple(rows.shape) != (ids.numel(), table.head_dim):
        return (
            f"trained rows of PLE layer {i}: ids {ids.dtype} {list(ids.shape)} and rows {list(rows.shape)}, expected "
            f"int64 [n] and [n, {table.head_dim}]"
        )
    if ids.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= table.rows or bool((ids[1:] <= ids[:-1]).any())):
        return f"trained rows of PLE layer {i}: the ids must be sorted, distinct and in [0, {table.rows})"
    if not bool(torch.isfinite(rows).all()):
        return f"trained rows of PLE layer {i}: {int((~torch.isfinite(rows)).any(1).sum())} rows are not finite"
    if isinstance(table, AdaptedTable):
        overlay = table.overlay
        with overlay.lock:
            overlay.close()
            overlay.put(ids, rows.to(overlay.dtype))
        return None
    overlay = RowOverlay(table.rows, table.head_dim, spill_dir=spill_dir)
    overlay.put(ids, rows.to(torch.float32))
    layer.set_table(AdaptedTable(table, overlay))
    return None


# ---------------------------------------------------------------------------------------------- unpatch
def weight_from_table(
    table: Table, dtype: torch.dtype, device, materialize: bool, layer_idx: int
) -> Callable[[], torch.Tensor]:
    """How to give a transformers module its table back as a ``[rows, head_dim]`` ``dtype`` tensor on
    ``device``, trained rows merged in (see the module docstring). Checks everything first (raising
    :class:`UsageError`); the returned function does the work."""
    source = _Source(table, layer_idx)
    stored = source.stored
    exact = source.kind == "none" and not source.blocked and stored.data.dtype == dtype
    if not exact and not materialize:
        source.close()
        mb = stored.rows * stored.head_dim * dtype.itemsize / 1e6
        raise UsageError(
            f"PLE layer {layer_idx}: the table is {stored.format!r} and the module holds {dtype}: giving it "
            f"back means dequantizing {mb:,.1f} MB into memory; pass materialize=True to do so"
        )

    def with_trained(w: torch.Tensor) -> torch.Tensor:
        assert source.overlay is not None
        for ids, values in source.overlay.chunks():
            merge_rows(w, None, ids, values, source.format)
        return w

    def give_back() -> torch.Tensor:
        try:
            if exact and isinstance(stored, MmapTable):
                # a copy-on-write map of the file the table holds: nothing read until touched, the trained
                # rows and training writes go to private pages, never to the file
                w = stored.map_rows(copy_on_write=True)
                return (with_trained(w) if source.overlay is not None else w).to(device)
            if exact:
                w = stored.data.detach()
                return (with_trained(w.clone()) if source.overlay is not None else w).to(device)
            out = torch.empty(stored.rows, stored.head_dim, dtype=dtype, device=device)
            for a, b in _chunks(0, stored.rows):
                out[a:b] = source.values(a, b, dtype).to(device)
            return out
        finally:
            source.close()

    return give_back
