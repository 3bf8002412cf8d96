"""Merging an adapter into a table: the trained rows written into a table file of the base's format.

:func:`merge_table_file` streams a table file shard by shard into a new table file (written and
published atomically by :class:`~ple.table.files.writer.TableFileWriter`), each trained row requantized
to the table's format (:func:`requantize`): plain formats are cast; "fp8" keeps the table's global
scale (a trained value past ``448 * scale`` saturates); "fp8_row" and "int8_row" get a new per-row
scale; block formats are quantized as ``ple convert`` quantizes (nvfp4 with the table's global
scale). Every other row keeps its stored bytes exactly. The new file's header records the merge
(``merged``, :mod:`ple.train.merge_record`: the adapter, its layer, the trained rows' count and the
digest of their ids, the table merged into and the one the adapter was trained over, the new table's
``identity``: that of the table merged into with this merge on top,
:func:`ple.checkpoint.classify.merged_identity`; and the trained rows' ids with digests of their
stored bytes), so that :func:`merged_rows` tells its trained rows from the rest: ``ple verify FILE
--checkpoint DIR`` compares only the rest with the checkpoint, and the trained rows with the adapter
when the file it names is there and is the one merged, else with the record's digests (the file
verifies on its own, with no adapter file).

An adapter merges into the table it was trained over, or into any table of the same identity
(:func:`ple.checkpoint.classify.require_trained_over`): a conversion of the same checkpoint table to
any format (``ple convert CHECKPOINT DIR --to q4_0`` of the checkpoint whose fp8 table it was trained
over), the trained rows requantized to that format. A table of another identity (another checkpoint
of the same layout, a table changed since) is refused, naming both: the adapter's untrained rows
would be another table's.

:func:`merge_model` does it for every adapted layer of a model whose base tables are table files
(a ``from_pretrained`` model) and serves the merged files instead: ``model.save_pretrained(dst)``
then writes a checkpoint in the published layout with the trained rows in it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ple.checkpoint.classify import merged_identity, require_trained_over, table_identity
from ple.errors import InvalidArgumentError, PLEError, UsageError
from ple.layer import PLELayer
from ple.table import MmapTable, format_info
from ple.table.files.table_file import read_table_header
from ple.table.files.writer import TableFileWriter
from ple.table.formats.blocks import quantize_blocks
from ple.table.tiers.adapted import AdaptedTable
from ple.train.adapter import AdapterFile, AdapterLayer, as_adapter, layout_hash_of, read_adapter
from ple.train.attach import ple_layers
from ple.train.merge_record import (
    MODEL_ADAPTER,
    GroupDigests,
    RecordedRows,
    ids_digest,
    recorded_rows,
    rows_record,
    stored_row_bytes,
)

__all__ = [
    "requantize",
    "merge_rows",
    "global_scale_of",
    "merge_table_file",
    "merge_model",
    "merged_rows",
    "check_merged_rows",
]

_MAX_RECORD = 1 << 25  # bytes of a merge record's JSON (a table header holds at most 64 MiB)


def requantize(values: torch.Tensor, format: str, global_scale: float | None = None):
    """Rows ``values [n, head_dim]`` (fp32) as a table of ``format`` stores them: ``(stored [n, width],
    per-row scale [n, 1] or None)``. ``global_scale``: the table's ("fp8", "nvfp4")."""
    info = format_info(format)
    values = values.to(torch.float32)
    if not bool(torch.isfinite(values).all()):
        raise InvalidArgumentError("a trained row is not finite: it cannot be merged")
    if info.blocked:
        return torch.from_numpy(quantize_blocks(values, format, global_scale)), None
    if info.scale_kind == "none":
        return values.to(info.storage_dtype), None
    if info.scale_kind == "global":
        if global_scale is None:
            raise InvalidArgumentError(f"merging into an {format!r} table needs its global scale")
        return (values / global_scale).clamp(-448.0, 448.0).to(info.storage_dtype), None
    from ple.table import quantize_rows

    return quantize_rows(values, format)


def global_scale_of(table) -> float | None:
    """The global scale of a stored table of a "global" scale format ("fp8", "nvfp4"), else None."""
    scale = table.scale
    if format_info(table.format).scale_kind != "global" or scale is None:
        return None
    return float(scale.reshape(-1)[0])


def merge_rows(
    data: torch.Tensor,
    row_scale: torch.Tensor | None,
    at: torch.Tensor,
    values: torch.Tensor,
    format: str,
    global_scale: float | None = None,
) -> None:
    """Write trained rows into stored rows, in place: rows ``at [m]`` of ``data [n, width]`` (a
    table's stored rows in ``format``) become ``values [m, head_dim]`` requantized (:func:`requantize`),
    and for a per-row format their scales in ``row_scale [n, 1]`` the new ones."""
    if at.numel() == 0:
        return
    stored, new_scale = requantize(values, format, global_scale)
    data[at] = stored
    if row_scale is not None and new_scale is not None:
        row_scale[at] = new_scale


def _rows_in(chunks: Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """A reader of sorted ``(ids, rows)`` chunks: ``take(stop)`` returns those with ``id < stop``."""
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    it = iter(chunks)
    done = False

    def take(stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal done
        ids_out, rows_out = [], []
        while True:
            if not pending:
                if done:
                    break
                nxt = next(it, None)
                if nxt is None:
                    done = True
                    break
                pending.append(nxt)
            ids, rows = pending[0]
            cut = int(torch.searchsorted(ids, stop))
            ids_out.append(ids[:cut])
            rows_out.append(rows[:cut])
            if cut < ids.numel():
                pending[0] = (ids[cut:], rows[cut:])
                break
            pending.pop(0)
        if not ids_out:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, 0)
        return torch.cat(ids_out), torch.cat(rows_out)

    return take


def merge_table_file(
    table: str | os.PathLike,
    adapter: str | os.PathLike | AdapterFile,
    out: str | os.PathLike,
    *,
    ple_layer_index: int | None = None,
    force: bool = False,
    progress: bool = False,
    adapter_name: str | None = None,
) -> Path:
    """Write ``out``: the table file ``table`` with ``adapter``'s rows for it merged in (see the module
    docstring). The adapter's layer is the one whose layout hash is the table's (``ple_layer_index``
    picks one when several share it). ``force`` replaces an existing ``out``. ``adapter_name``: what the
    record names as the adapter (default: the adapter file's absolute path). Returns ``out``."""
    table, out = Path(table), Path(out)
    file = as_adapter(adapter)
    header = read_table_header(table)
    matches = [e for e in file.layers.values() if e.layout_hash == header["layout_hash"]]
    if ple_layer_index is not None:
        matches = [e for e in matches if e.ple_layer_index == ple_layer_index]
    if len(matches) != 1:
        raise InvalidArgumentError(
            f"{file.path}: {len(matches)} of its layers ({sorted(file.layers)}) fit the layout of {table} "
            f"(layout hash {header['layout_hash'][:16]}...); "
            + ("give ple_layer_index" if matches else "an adapter of another layer or model")
        )
    entry = matches[0]
    if (entry.rows, entry.head_dim) != (header["rows"], header["head_dim"]):
        raise InvalidArgumentError(
            f"{file.path}: layer {entry.ple_layer_index} is for [{entry.rows}, {entry.head_dim}] rows, {table} holds "
            f"[{header['rows']}, {header['head_dim']}]"
        )
    if out.resolve() == table.resolve():
        raise InvalidArgumentError(f"merge into a new file: {out} is the base table (the base stays untouched)")
    over = entry.base
    into = table_identity(table, header)
    if over is not None:
        into = require_trained_over(file.path, entry.ple_layer_index, over, table, header)
    ids = _trained_ids(file, entry.ple_layer_index)
    identity = merged_identity(into, ids_digest(ids), "0" * 32)  # the rows' digest filled in as they are read
    stored = rows_record(ids)  # its digests filled in as the rows are written
    record: dict[str, Any] = {
        "adapter": adapter_name if adapter_name is not None else str(Path(file.path).resolve()),
        "ple_layer_index": entry.ple_layer_index,
        "trained_rows": entry.trained_rows,
        "ids_digest": ids_digest(ids),
        "into": {
            "file": str(table.resolve()),
            "format": header["format"],
            "header_checksum": header["header_checksum"],
        },
        "trained_over": over,
        "identity": identity.to_json(),
        "rows": stored,
    }
    if len(json.dumps(record)) > _MAX_RECORD:
        raise InvalidArgumentError(
            f"{file.path}: PLE layer {entry.ple_layer_index}'s {entry.trained_rows:,} trained rows are too many for "
            f"a table file's merge record (at most {_MAX_RECORD:,} bytes)"
        )
    ids_hash, rows_hash = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
    digests = GroupDigests(stored["group"])
    fmt, rows, shard_rows = header["format"], int(header["rows"]), int(header["shard_rows"])
    base = MmapTable.open(table, header["layout_hash"], random_access=False)
    try:
        scale = base.scale
        kind = format_info(fmt).scale_kind
        global_scale = global_scale_of(base)
        layout = header.get("layout") or header["layout_hash"]
        take = _rows_in(file.chunks(entry.ple_layer_index))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=rows, unit="row", unit_scale=True, desc=f"merge {out.name}")
        with TableFileWriter(out, rows, base.head_dim, fmt, shard_rows, layout, force=force, merged=record) as writer:
            for k in range(writer.num_shards):
                a, b = writer.shard_range(k)
                data = base.data[a:b].clone()
                srow = scale[a:b].clone() if kind == "row" and scale is not None else None
                ids, values = take(b)
                ids_hash.update(ids.numpy().astype("<i8").tobytes())
                rows_hash.update(values.to(torch.float32).numpy().astype("<f4").tobytes())
                merge_rows(data, srow, ids - a, values, fmt, global_scale)
                digests.add(stored_row_bytes(data[ids - a], None if srow is None else srow[ids - a]))
                writer.write_shard(k, data, srow if kind == "row" else (scale if kind == "global" else None))
                if bar is not None:
                    bar.update(b - a)
            if ids_hash.hexdigest() != record["ids_digest"]:
                raise InvalidArgumentError(f"{file.path} changed while it was merged: merge it again")
            # the final header's, written by close(), at the size reserved for them
            stored["digests"] = base64.b64encode(digests.finish()).decode("ascii")
            identity.merges[-1].update(rows=rows_hash.hexdigest())  # record["identity"]'s
        if bar is not None:
            bar.close()
    finally:
        base.close()
    return out


def _trained_ids(file: AdapterFile, index: int) -> np.ndarray:
    ids = [i.numpy() for i, _ in file.chunks(index)]
    return np.concatenate(ids) if ids else np.empty(0, np.int64)


def merged_rows(
    path: str | os.PathLike,
) -> tuple[dict | None, AdapterLayer | RecordedRows | None, AdapterFile | RecordedRows | None, str]:
    """What a table file says was merged into it: ``(its header's merge record or None, the trained rows'
    source, the same, "")``. The source is the adapter's layer entry and the adapter file when the file
    the record names is there and is the one merged (the same trained rows' ids, for a table of the same
    geometry); else the record's own rows (:class:`~ple.train.merge_record.RecordedRows`, both times),
    which :func:`check_merged_rows` checks against their recorded digests; a merge recorded without its
    rows gives ``(record, None, None, why the adapter cannot be used)``. The record is checked first
    (:func:`~ple.train.merge_record.recorded_rows`): a field that is wrong raises
    :class:`~ple.table.TableFileError` naming it."""
    header = read_table_header(path)
    record = header.get("merged")
    if record is None:
        return None, None, None, ""
    recorded = recorded_rows(path, header)
    entry, file, why = _merged_adapter(record, header)
    if entry is not None and file is not None:
        return record, entry, file, ""
    if recorded is not None:
        return record, recorded, recorded, ""
    return record, None, None, why


def _merged_adapter(record: dict, header: dict) -> tuple[AdapterLayer | None, AdapterFile | None, str]:
    """The adapter file a (checked) merge record names, when it is there and is the one merged."""
    name = record["adapter"]
    if not os.path.isabs(name) or not os.path.lexists(name):
        return None, None, f"the adapter it names, {name}, is not there"
    index = record["ple_layer_index"]
    try:
        file = read_adapter(name)
        entry = file.layers.get(index)
        if entry is None:
            return None, None, f"the adapter {name} has no PLE layer {index} (another file under its name)"
        shape = (entry.rows, entry.head_dim, entry.layout_hash)
        if shape != (header["rows"], header["head_dim"], header["layout_hash"]):
            why = (
                f"the adapter {name}'s PLE layer {index} is for [{entry.rows}, {entry.head_dim}] rows of another "
                f"layout than the file's [{header['rows']}, {header['head_dim']}] (another file under its name)"
            )
            return None, None, why
        same = entry.trained_rows == record["trained_rows"]
        same = same and ids_digest(_trained_ids(file, index)) == record["ids_digest"]
    except (OSError, PLEError) as e:
        return None, None, f"the adapter it names cannot be read ({e})"
    if not same:
        return None, None, f"the adapter {name} no longer holds the rows merged (another file under its name)"
    return entry, file, ""


def check_merged_rows(path: str | os.PathLike, file: AdapterFile | RecordedRows, index: int) -> list[str]:
    """Problems of the trained rows of the merged table file ``path``: each must hold exactly what
    :func:`requantize` makes of the adapter's row (the merge's own arithmetic), or, given the file's
    :class:`~ple.train.merge_record.RecordedRows` (:func:`merged_rows`), give its recorded digests;
    ``[]`` when all do. An adapter layer of another geometry than the file's is an
    :class:`InvalidArgumentError`."""
    if isinstance(file, RecordedRows):
        if Path(file.path).resolve() != Path(path).resolve() or index != file.ple_layer_index:
            raise InvalidArgumentError(
                f"the merge record of {file.path} (PLE layer {file.ple_layer_index}) is "
                f"not that of {path}'s PLE layer {index}"
            )
        return file.problems()
    table = MmapTable.open(path, random_access=False)
    try:
        entry = file.layers.get(index)
        if entry is None or (entry.rows, entry.head_dim) != (table.rows, table.head_dim):
            have = "none" if entry is None else f"[{entry.rows}, {entry.head_dim}] rows"
            raise InvalidArgumentError(
                f"{file.path}: its PLE layer {index} ({have}) is not for {path} ([{table.rows}, {table.head_dim}])"
            )
        fmt, kind = table.format, format_info(table.format).scale_kind
        g = global_scale_of(table)
        bad, first = 0, None
        for ids, values in file.chunks(index):
            stored, scale = requantize(values, fmt, g)
            got = table.data[ids]
            diff = (got.view(torch.uint8) != stored.view(torch.uint8)).reshape(len(ids), -1).any(1)
            if kind == "row" and scale is not None and table.scale is not None:
                diff |= (table.scale[ids].float() != scale.float()).reshape(-1)
            if bool(diff.any()):
                bad += int(diff.sum())
                first = int(ids[diff.nonzero()[0]]) if first is None else first
    finally:
        table.close()
    if bad:
        return [f"{path}: {bad} trained rows differ from the adapter's {file.path} (requantized), first at row {first}"]
    return []


def merge_model(
    model: nn.Module | PLELayer,
    folder: str | os.PathLike,
    *,
    adapter: str | os.PathLike | AdapterFile | None = None,
    progress: bool = False,
) -> list[Path]:
    """Merge the adapter of every adapted PLE layer of ``model`` into a new table file in ``folder``
    (``<base file name>``, replaced if there) and serve that file instead (memory-mapped; the adapter
    is dropped). The bases must be table files (a ``from_pretrained`` model's tiers). With ``adapter``
    (a file) its rows are merged instead of the layers' own. Returns the new files in layer order;
    ``model.save_pretrained(dst)`` then writes the published layout with the merged rows."""
    from ple.train.adapter import save_adapter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    adapted = [layer for layer in ple_layers(model) if isinstance(layer.table, AdaptedTable)]
    if adapter is None and not adapted:
        raise UsageError("no PLE layer of this model holds an adapter: nothing to merge")
    file = as_adapter(adapter) if adapter is not None else None
    if file is None:
        tmp = folder / ".merge-adapter.safetensors"
        save_adapter(tmp, model)
        file = read_adapter(tmp)
    try:
        made = []
        for layer in ple_layers(model):
            if layer.ple_layer_index not in file.layers:
                continue
            table = layer.table
            base = table.base if isinstance(table, AdaptedTable) else table
            path = _file_of(base)
            if path is None:
                raise UsageError(
                    f"PLE layer {layer.ple_layer_index}'s base table ({type(base).__name__}) is not a table file: "
                    "merge_model needs file-backed tables (from_pretrained); use merge_table_file on a file"
                )
            if file.layers[layer.ple_layer_index].layout_hash != layout_hash_of(layer):
                raise InvalidArgumentError(f"{file.path}: layer {layer.ple_layer_index} is for another layout")
            target = folder / path.name
            if target.resolve() == path.resolve():
                raise InvalidArgumentError(f"{folder} holds the base table {path.name}: merge into another folder")
            merge_table_file(
                path,
                file,
                target,
                ple_layer_index=layer.ple_layer_index,
                force=True,
                progress=progress,
                adapter_name=MODEL_ADAPTER if adapter is None else None,
            )
            made.append((layer, target))
    finally:
        if adapter is None:
            (folder / ".merge-adapter.safetensors").unlink(missing_ok=True)
    for layer, target in made:
        old = layer.table
        layer.set_table(MmapTable.open(target, layout_hash_of(layer)))
        if isinstance(old, AdaptedTable):
            old.overlay.close()
    return [t for _, t in made]


def _file_of(table) -> Path | None:
    at, seen = table, 0
    while at is not None and seen < 8:
        p = getattr(at, "path", None)
        if isinstance(p, (str, os.PathLike)):
            return Path(p)
        at = getattr(at, "backing", None)
        seen += 1
    return None
