"""Serving adapters on a model: its default adapter, and named adapters chosen per request.

- The **default** adapter (:func:`load_adapter` without ``name``): each PLE layer's table becomes an
  :class:`~ple.table.tiers.adapted.AdaptedTable`, the base untouched and shared; every request or batch
  row that names no adapter reads it. Loading another swaps it, on a running model (the layer's
  ``TableRef`` switches, compiled programs included); :func:`remove_adapter` serves the bases again.
- **Named** adapters (``load_adapter(model, path, name="legal")``): several at once, each over the base
  table (never over the default), each layer's held by its ``TableRef``
  (:class:`~ple.table.tiers.named.NamedAdapters`). A request chooses one by name: ``ple.Session.add(...,
  adapter="legal")``, a batch's ``adapter_indices`` (:func:`adapter_index` gives the index), or
  ``ple_adapters=`` of a patched transformers model. Loading and removing never recompile a compiled
  engine call, and are safe while other threads serve; removing an adapter a live request names is
  refused.

Each adapter's rows are held once (the base tier is shared), in memory up to ``memory_budget`` bytes
per adapter and spilled to an unnamed file beyond. On load, the file is checked against the table it
is served over: every layer's layout and rows, and, where both are known, that the table was made
from the one the adapter was trained over (that table file, or a conversion of the same checkpoint
table in any format). Everything is read and checked before anything changes.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ple.checkpoint.classify import table_identity, trained_over_mismatch
from ple.errors import InvalidArgumentError, UsageError
from ple.layer import PLELayer
from ple.table import ShardedTable
from ple.table.files.table_file import read_table_header
from ple.table.tiers.adapted import AdaptedTable, RowOverlay
from ple.table.tiers.named import ADAPTER_CHANGES, NamedAdapter, NamedAdapters, served_adapters
from ple.table.tiers.named import adapter_index as served_index
from ple.train.adapter import (
    AdapterFile,
    AdapterFileError,
    AdapterLayer,
    as_adapter,
    check_layer_fits,
    layout_hash_of,
    local_part,
)
from ple.train.attach import ple_layers
from ple.train.identity import base_identity, base_of

__all__ = ["adapter_index", "adapter_names", "load_adapter", "remove_adapter"]


def _check_trained_over(file: AdapterFile, index: int, entry: AdapterLayer, table) -> None:
    """Refuse ``entry`` (layer ``index`` of ``file``) over ``table`` when both name their table files and
    the table was not made from the one the adapter was trained over (the judge merges ask too,
    :func:`ple.checkpoint.classify.trained_over_mismatch`)."""
    base = entry.base
    have = base_identity(table) if base else None
    if base is None or have is None or base.get("header_checksum") == have["header_checksum"]:
        return  # the very table it was trained over (no header to read again)
    header = read_table_header(have["file"])
    served = table_identity(have["file"], header)
    want = trained_over_mismatch(base, served, header)
    if want is not None:
        raise AdapterFileError(
            f"{file.path}: PLE layer {index} was trained over the table file {base.get('file')} "
            f"({base.get('format')}, {want.describe()}), not the table served here, {have['file']} "
            f"({have['format']}, {served.describe()}): the rows it did not train would be another table's; serve "
            "it over the table it was trained over or a conversion of the same checkpoint table"
        )


def _read_overlays(
    file: AdapterFile, layers: dict[int, PLELayer], dtype: torch.dtype, memory_budget, spill_dir, named: bool
) -> dict[int, RowOverlay]:
    """Each layer's rows of ``file`` in a new overlay (every layer of ``layers`` for a named adapter, the
    file's layers otherwise), all checked; nothing changes on the model. On any error the overlays
    made so far are closed."""
    missing = sorted(set(file.layers) - set(layers))
    if missing:
        raise AdapterFileError(f"{file.path}: holds rows of PLE layers {missing}, which the model does not have")
    overlays: dict[int, RowOverlay] = {}
    try:
        for i, layer in layers.items():
            e = file.layers.get(i)
            if e is None and not named:
                continue
            local, start, stop, sharded = local_part(layer)
            if named and sharded:
                raise UsageError(
                    f"PLE layer {i}'s table is sharded across ranks: named adapters are served over a whole table "
                    "(load the adapter as the default instead)"
                )
            overlay = RowOverlay(local.rows, local.head_dim, dtype, memory_budget=memory_budget, spill_dir=spill_dir)
            overlays[i] = overlay
            if e is None:
                continue  # the adapter trained nothing here: this layer serves its base under that name
            full_rows = layer.table.rows if layer.table is not None else -1
            check_layer_fits(
                file.path, e, layout_hash_of(layer), full_rows, local.head_dim, f"this model's PLE layer {i}"
            )
            _check_trained_over(file, i, e, local)
            if not sharded:
                overlay.presize(e.trained_rows)  # the rows held once, in one buffer of their size
            for ids, rows in file.chunks(i):
                keep = (ids >= start) & (ids < stop)
                if bool(keep.any()):
                    overlay.put(ids[keep] - start, rows[keep].to(dtype))
    except BaseException:
        for overlay in overlays.values():
            overlay.close()
        raise
    return overlays


def _check_name(name) -> str:
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise InvalidArgumentError(
            f"an adapter's name must be a non-empty str without surrounding spaces, got {name!r}"
        )
    return name


def load_adapter(
    model: nn.Module | PLELayer,
    adapter: str | os.PathLike | AdapterFile,
    *,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    memory_budget: int | None = None,
    spill_dir: str | os.PathLike | None = None,
) -> AdapterFile:
    """Serve ``adapter``'s rows on top of each PLE layer's table (any tier and format).

    Without ``name``: as the model's default adapter (what requests that name none read); an adapter
    already the default is swapped out. With ``name``: as a named adapter beside the others and the
    default (a duplicate name is refused); requests choose it by name (see the module docstring).

    Every layer of the file must be a layer of ``model`` with the same layout and rows; a layer the
    file does not name serves its base table. All rows are read and checked before any table
    changes, so a bad file leaves the model as it was. ``dtype``: the rows' dtype in memory (default:
    the file's; ``torch.float32`` to keep training a default adapter). ``memory_budget``/``spill_dir``:
    bytes of this adapter's rows kept in memory, the rest spilled (as for :func:`ple.train.trainable`).
    A table sharded across ranks gets, on each rank, the rows it owns (default adapters only).
    Returns the file's header."""
    file = as_adapter(adapter)
    dtype = file.dtype if dtype is None else dtype
    if name is not None:
        _check_name(name)
    layers = {layer.ple_layer_index: layer for layer in ple_layers(model)}
    if name is not None:
        _check_free(name, layers.values())  # before the rows are read; again when they are installed
    overlays = _read_overlays(file, layers, dtype, memory_budget, spill_dir, named=name is not None)
    added: list[NamedAdapters] = []
    try:
        with ADAPTER_CHANGES:  # only the install: a session choosing an adapter waits for no file
            if name is None:
                for i, layer in layers.items():
                    _install(layer, overlays.get(i))
                return file
            _check_free(name, layers.values())
            index = _free_index(layers.values())
            for layer in layers.values():
                held = _named_set(layer)
                held.add(NamedAdapter(name, index, overlays[layer.ple_layer_index]))
                added.append(held)
    except BaseException:
        for held in added:
            held.remove(name)  # type: ignore[arg-type]
        for overlay in overlays.values():
            overlay.close()
        raise
    return file


def _check_free(name: str, layers) -> None:
    if name in _served(layers):
        raise InvalidArgumentError(f"an adapter named {name!r} is already served: remove it first")


def _named_set(layer: PLELayer) -> NamedAdapters:
    """The layer's named adapters (made empty over its base table when it has none)."""
    ref = layer.table_ref
    base = base_of(local_part(layer)[0])
    held = ref.adapters
    if held is None or (not len(held) and held.base is not base):
        held = ref.adapters = NamedAdapters(base)
    elif held.base is not base:
        raise UsageError(
            f"PLE layer {layer.ple_layer_index}'s named adapters were loaded over {held.base!r}, but the layer now "
            f"serves {base!r}: remove them ({', '.join(held.names())}) before serving another"
        )
    return held


def _served(layers) -> dict[str, int]:
    """``{name: index}`` of the named adapters served by any of ``layers``."""
    return served_adapters(layer.table_ref for layer in layers)


def _free_index(layers) -> int:
    used = set(_served(layers).values())
    return next(i for i in range(len(used) + 1) if i not in used)


def _install(layer: PLELayer, overlay: RowOverlay | None) -> None:
    table = layer.table
    if table is None:
        raise UsageError(f"PLE layer {layer.ple_layer_index} has no table")
    if isinstance(table, ShardedTable):
        base = base_of(table.local_table)
        table.local_table = base if overlay is None else AdaptedTable(base, overlay)
        return
    base = base_of(table)
    layer.set_table(base if overlay is None else AdaptedTable(base, overlay))


def remove_adapter(model: nn.Module | PLELayer, name: str | None = None) -> None:
    """Without ``name``: serve every PLE layer's base table again to the requests that name no adapter
    (the default adapter's rows are dropped; save them first); named adapters stay. With ``name``:
    stop serving that named adapter; refused while a live request (added to a session and not
    finished) names it, naming the requests."""
    layers = ple_layers(model)
    with ADAPTER_CHANGES:
        if name is None:
            for layer in layers:
                local = local_part(layer)[0]
                if isinstance(local, AdaptedTable):
                    overlay = local.overlay
                    _install(layer, None)
                    overlay.close()
            return
        _check_name(name)
        served = _served(layers)
        if name not in served:
            raise InvalidArgumentError(f"no adapter named {name!r} is served (served: {sorted(served) or 'none'})")
        live: list = []
        for layer in layers:
            held = layer.table_ref.adapters
            if held is not None:
                live.extend(r for r in held.requests_of(served[name]) if r not in live)
        if live:
            raise UsageError(f"adapter {name!r} is read by live requests {live!r}: finish them before removing it")
        for layer in layers:
            held = layer.table_ref.adapters
            if held is None or held.find(name) is None:
                continue
            gone = held.remove(name)
            gone.overlay.close()
            if not len(held):
                layer.table_ref.adapters = None


def adapter_names(model: nn.Module | PLELayer) -> list[str]:
    """The names of the adapters ``model`` serves (named ones, in the order of their indices)."""
    return list(_served(ple_layers(model)))


def adapter_index(model: nn.Module | PLELayer, name: str) -> int:
    """The index of named adapter ``name`` on every PLE layer of ``model``: what a batch's
    ``adapter_indices`` carries (:class:`~ple.runtime.Batch`); :class:`InvalidArgumentError` naming the
    served adapters when it is not served."""
    return served_index((layer.table_ref for layer in ple_layers(model)), name)
