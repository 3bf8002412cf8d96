"""Table adapters: the trained rows of a model's PLE tables as a small file of their own.

An adapter file is a safetensors file (``.safetensors``; any name) holding, per PLE layer ``i``:

- ``layer{i}.ids`` I64 ``[n]``: the row ids trained, sorted and distinct, in ``[0, rows)``;
- ``layer{i}.rows`` F32 or BF16 ``[n, head_dim]``: their values;
- in a training checkpoint also ``layer{i}.state.ids`` I64 ``[m]`` and ``layer{i}.state.values`` F32
  ``[m, width]``: the optimizer's per-row states (see :mod:`ple.train.optim`);

and in its ``__metadata__``: ``format`` = ``"ple-table-adapter"``, ``version`` = ``"1"``, ``layers``
(JSON: per layer its ``ple_layer_index``, ``rows``, ``head_dim``, ``layout_hash`` (the layer's
layout, :func:`ple.table.files.table_file.hash_layout`), the base table's ``format``, the row count and
``base``: the table file the rows were trained over, :func:`base_identity`, absent or null where
the base is not a table file),
``optimizer`` (JSON, checkpoints only: class, hyperparameters and step count per layer) and
``user`` (JSON: what the caller passed as ``meta``).

An adapter is served on top of any base table, tier and format, as the model's default adapter or
beside others under a name (:mod:`ple.train.serve`). Files are written atomically
(:func:`ple.common.files.write_atomically_from`, streamed), so a process killed while saving leaves the last
saved file whole; :func:`save_adapter` first removes temporary files that dead writers of the same
path left.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ple.checkpoint.classify import ADAPTER_FORMAT
from ple.common.files import file_kind, parse_json, sweep_partial_files, write_atomically_from
from ple.common.safetensors import CheckpointError, PreadReader, TensorInfo, read_header
from ple.errors import ArgumentTypeError, InvalidArgumentError, PLEError, UsageError
from ple.layer import PLELayer
from ple.table import ShardedTable, Table
from ple.table.files.table_file import hash_layout
from ple.table.tiers.adapted import AdaptedTable, RowOverlay
from ple.train.attach import TableTarget, ple_layers
from ple.train.identity import base_identity
from ple.train.optim import RowSparseOptimizer, check_step, short_repr
from ple.train.sharded import all_gather_rows

__all__ = [
    "ADAPTER_FORMAT",
    "AdapterFile",
    "AdapterFileError",
    "AdapterLayer",
    "adapter_overlays",
    "local_part",
    "base_identity",
    "check_layer_fits",
    "as_adapter",
    "load_optimizer_state",
    "read_adapter",
    "save_adapter",
    "save_sharded_adapter",
    "write_adapter_file",
]

_VERSION = "1"
_CHUNK = 1 << 16  # rows read or written at a time
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}


class AdapterFileError(PLEError, ValueError):
    """An adapter file is not one, is damaged, or does not fit the model it is loaded into."""


# ---------------------------------------------------------------------------------------------- sources
def layout_hash_of(layer: PLELayer) -> str:
    return hash_layout(layer.config.layout_fields(layer.ple_layer_index))


def check_layer_fits(path, entry: AdapterLayer, layout_hash: str, rows: int, head_dim: int, what: str) -> None:
    """Refuse ``entry`` (a layer of adapter file ``path``) unless it was trained for ``what`` (a phrase
    naming the layer it is served or checked against): that layout hash, rows and row width."""
    if entry.layout_hash != layout_hash or (entry.rows, entry.head_dim) != (rows, head_dim):
        raise AdapterFileError(
            f"{path}: PLE layer {entry.ple_layer_index} was trained for another layout or table ([{entry.rows}, "
            f"{entry.head_dim}], layout hash {entry.layout_hash[:16]}...) than {what} ([{rows}, {head_dim}], "
            f"{layout_hash[:16]}...)"
        )


def local_part(layer: PLELayer) -> tuple[Table, int, int, bool]:
    """``(the table this process adapts, its first row, its last row + 1, sharded)``."""
    table = layer.table
    if table is None:
        raise UsageError(f"PLE layer {layer.ple_layer_index} has no table")
    if isinstance(table, ShardedTable):
        return table.local_table, table.row_start, table.row_stop, True
    return table, 0, table.rows, False


def adapter_overlays(model: nn.Module | PLELayer) -> dict[int, tuple[RowOverlay, int, Table]]:
    """``{ple_layer_index: (overlay, first row, base table)}`` for the adapted tables of ``model`` in
    this process (a rank of a sharded table holds its own rows: ``id = first row + overlay id``)."""
    out: dict[int, tuple[RowOverlay, int, Table]] = {}
    for layer in ple_layers(model):
        table, start, _, _ = local_part(layer)
        if isinstance(table, AdaptedTable):
            out[layer.ple_layer_index] = (table.overlay, start, table)
    return out


# ---------------------------------------------------------------------------------------------- writing
def _header(entries: list[tuple[str, str, list[int], int]], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def _raw(t: torch.Tensor) -> memoryview:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


def save_adapter(
    path: str | os.PathLike,
    model: nn.Module | PLELayer,
    *,
    dtype: torch.dtype = torch.float32,
    optimizer: RowSparseOptimizer | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write the trained rows of every adapted table of ``model`` to ``path``, atomically.

    Args:
        dtype: the rows' dtype in the file, ``torch.float32`` or ``torch.bfloat16`` (half the size,
            for serving).
        optimizer: also write its per-row states and step counts (a training checkpoint, to
            resume from with :func:`load_adapter` and :func:`load_optimizer_state`); needs fp32 rows.
        meta: JSON-serializable facts kept with the file (``AdapterFile.meta``), e.g. the step.

    The rows are streamed (bounded memory). A model whose layers hold no adapter is refused.
    Returns ``path``."""
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"an adapter keeps rows in torch.float32 or torch.bfloat16, got {dtype}")
    if optimizer is not None and dtype != torch.float32:
        raise InvalidArgumentError("a training checkpoint (optimizer=...) keeps its rows in torch.float32")
    path = Path(path)
    check_destination(path, model)
    layers = [layer for layer in ple_layers(model) if isinstance(local_part(layer)[0], AdaptedTable)]
    if not layers:
        raise UsageError("no PLE layer of this model holds an adapter: nothing to save (ple.train.trainable(model))")
    for layer in layers:
        if local_part(layer)[3]:
            raise UsageError(
                "an adapter of a table sharded across ranks is saved with ple.train.save_sharded_adapter "
                "(every rank calls it; rank 0 writes the file)"
            )
    states = _optimizer_states(optimizer, layers) if optimizer is not None else {}
    sources = []
    for layer in layers:
        table = layer.table
        assert isinstance(table, AdaptedTable)
        sources.append((layer, table.overlay, 0, table.base))
    return write_adapter_file(path, sources, dtype, states, optimizer, meta)


def _table_files(table: Table | None) -> list[str]:
    """The paths of the table files under ``table`` (through adapters, row caches and shards)."""
    out: list[str] = []
    todo: list[object] = [table]
    seen: set[int] = set()
    while todo:
        at = todo.pop()
        if at is None or id(at) in seen:
            continue
        seen.add(id(at))
        path = getattr(at, "path", None)
        if isinstance(path, (str, os.PathLike)):
            out.append(os.fspath(path))
        for name in ("base", "backing", "local_table"):
            below = getattr(at, name, None)
            if isinstance(below, Table):
                todo.append(below)
    return out


def check_destination(path: Path, model: nn.Module | PLELayer) -> None:
    """Refuse to write an adapter over anything but an adapter: a folder, a table file ``model``
    serves (the same file through any name: a symbolic or hard link), or an existing file that is
    not a ple table adapter (a table file, a checkpoint), each named."""
    try:
        st = os.stat(path)  # follows a symbolic link to what it names
    except FileNotFoundError:
        return
    except OSError as e:
        raise OSError(e.errno, f"cannot check the adapter destination {path}: {e.strerror}", os.fspath(path)) from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgumentError(
            f"{path} is {file_kind(st.st_mode)}, not an adapter file: save the adapter to a file path"
        )
    for layer in ple_layers(model):
        for table_path in _table_files(layer.table):
            try:
                other = os.stat(table_path)
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                raise InvalidArgumentError(
                    f"{path} is the table file {table_path} that PLE layer {layer.ple_layer_index} serves: an "
                    "adapter is saved to a file of its own, never over a table (ple.train.merge_table_file writes "
                    "merged tables)"
                )
    try:
        read_adapter(path)
    except AdapterFileError as e:
        raise InvalidArgumentError(
            f"{path} exists and is not a ple table adapter ({e}): save the adapter to a new path, or remove "
            "that file first"
        ) from None


def _optimizer_states(optimizer: RowSparseOptimizer, layers: list[PLELayer]) -> dict[int, tuple[int, Any]]:
    """``{ple_layer_index: (step, row states or None)}`` of the optimizer's tables among ``layers``."""
    wanted = {layer.ple_layer_index for layer in layers}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            target: TableTarget = p.ple_target
            if target.ple_layer_index in wanted:
                out[target.ple_layer_index] = (int(optimizer.state[p].get("step", 0)), optimizer.row_state(p))
    return out


def write_adapter_file(path: Path, sources, dtype, states, optimizer, meta) -> Path:
    """Write an adapter file of ``sources``: ``(layer, overlay, first row, base)`` per layer (the overlay's
    ids + first row are the table's), with ``states`` ``{ple_layer_index: (step, row states or None)}``
    of ``optimizer`` (see :func:`save_adapter`)."""
    info = []
    entries: list[tuple[str, str, list[int], int]] = []
    locks = [overlay.lock for _, overlay, _, _ in sources]
    for lock in locks:
        lock.acquire()
    try:
        for layer, overlay, _, base in sources:
            i, n, d = layer.ple_layer_index, len(overlay), overlay.head_dim
            info.append(
                {
                    "ple_layer_index": i,
                    "rows": overlay.rows if not isinstance(layer.table, ShardedTable) else layer.table.rows,
                    "head_dim": d,
                    "layout_hash": layout_hash_of(layer),
                    "base_format": base.format,
                    "trained_rows": n,
                    "base": base_identity(base),
                }
            )
            entries.append((f"layer{i}.ids", "I64", [n], 8 * n))
            entries.append((f"layer{i}.rows", _DTYPES[dtype], [n, d], n * d * dtype.itemsize))
            st = states.get(i)
            if st is not None and st[1] is not None:
                m, w = len(st[1]), st[1].store.width
                entries.append((f"layer{i}.state.ids", "I64", [m], 8 * m))
                entries.append((f"layer{i}.state.values", "F32", [m, w], 4 * m * w))
        metadata = {"format": ADAPTER_FORMAT, "version": _VERSION, "layers": json.dumps(info)}
        if optimizer is not None:
            groups = []
            for group in optimizer.param_groups:
                hp = {k: v for k, v in group.items() if k != "params"}
                hp["layers"] = [p.ple_target.ple_layer_index for p in group["params"]]
                groups.append(hp)
            metadata["optimizer"] = json.dumps(
                {
                    "class": type(optimizer).__name__,
                    "param_groups": groups,
                    "steps": {str(i): s for i, (s, _) in states.items()},
                }
            )
        if meta is not None:
            try:
                metadata["user"] = json.dumps(meta)
            except (TypeError, ValueError) as e:
                raise InvalidArgumentError(f"meta must be JSON-serializable: {e}") from None

        def chunks() -> Iterator[memoryview | bytes]:
            yield _header(entries, metadata)
            for layer, overlay, start, _ in sources:
                keys = overlay.ids()
                for a in range(0, keys.numel(), _CHUNK):
                    yield _raw(keys[a : a + _CHUNK] + start)
                for _, rows in overlay.chunks(_CHUNK):
                    yield _raw(rows.to(dtype))
                st = states.get(layer.ple_layer_index)
                if st is not None and st[1] is not None:
                    ids, values = st[1].export()
                    yield _raw(ids + start)
                    yield _raw(values)

        sweep_partial_files(path)
        write_atomically_from(path, chunks())
    finally:
        for lock in reversed(locks):
            lock.release()
    return path


# ---------------------------------------------------------------------------------------------- reading
@dataclasses.dataclass(frozen=True)
class AdapterLayer:
    """One layer's entry of an adapter file."""

    ple_layer_index: int
    rows: int
    head_dim: int
    layout_hash: str
    base_format: str
    trained_rows: int
    ids: TensorInfo
    values: TensorInfo
    state_ids: TensorInfo | None
    state_values: TensorInfo | None
    base: dict[str, Any] | None = None
    """The table file the rows were trained over (:func:`base_identity`); None when unknown."""


@dataclasses.dataclass(frozen=True)
class AdapterFile:
    """A checked adapter file's header (see the module docstring); rows are read on demand."""

    path: Path
    layers: dict[int, AdapterLayer]
    dtype: torch.dtype
    optimizer: dict[str, Any] | None
    meta: Any

    @property
    def nbytes(self) -> int:
        return sum(e.ids.nbytes + e.values.nbytes for e in self.layers.values())

    def chunks(self, index: int, size: int = _CHUNK) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(ids [m], rows [m, head_dim])`` of layer ``index``, ``size`` rows at a time, each chunk
        checked (ids sorted, distinct and in range; rows finite)."""
        e = self.layers[index]
        last = -1
        with PreadReader() as reader:
            for a in range(0, e.trained_rows, size):
                b = min(e.trained_rows, a + size)
                try:
                    ids = reader.rows(e.ids, f"layer{index}.ids", a, b).clone()
                    rows = reader.rows(e.values, f"layer{index}.rows", a, b).clone()
                except CheckpointError as err:
                    raise AdapterFileError(f"{self.path}: {err.problems[0]}") from None
                if ids.numel() and (int(ids[0]) <= last or bool((ids[1:] <= ids[:-1]).any()) or int(ids[-1]) >= e.rows):
                    raise AdapterFileError(
                        f"{self.path}: layer{index}.ids must be sorted, distinct and in [0, {e.rows}) "
                        f"(rows {a}..{b} are not)"
                    )
                if not bool(torch.isfinite(rows).all()):
                    bad = int((~torch.isfinite(rows)).any(1).nonzero()[0])
                    raise AdapterFileError(f"{self.path}: row {int(ids[bad])} of layer {index} is not finite")
                last = int(ids[-1]) if ids.numel() else last
                yield ids, rows

    def optimizer_states(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(ids [m], values [m, width])`` of layer ``index``'s optimizer states, or None."""
        e = self.layers[index]
        if e.state_ids is None or e.state_values is None:
            return None
        with PreadReader() as reader:
            try:
                return (
                    reader.get(e.state_ids, f"layer{index}.state.ids").clone(),
                    reader.get(e.state_values, f"layer{index}.state.values").clone(),
                )
            except CheckpointError as err:
                raise AdapterFileError(f"{self.path}: {err.problems[0]}") from None


def read_adapter(path: str | os.PathLike) -> AdapterFile:
    """Open and check an adapter file's header (:class:`AdapterFileError` names what is wrong)."""
    path = Path(path)
    try:
        header = read_header(path)
    except CheckpointError as e:
        raise AdapterFileError(f"{path}: not a readable adapter file: {e.problems[0]}") from None
    md = header.metadata
    if md.get("format") != ADAPTER_FORMAT:
        raise AdapterFileError(f"{path}: not a ple table adapter (metadata format {md.get('format')!r})")
    if md.get("version") != _VERSION:
        raise AdapterFileError(f"{path}: adapter version {md.get('version')!r}, this ple reads version {_VERSION}")
    if "layers" not in md:
        raise AdapterFileError(f"{path}: damaged adapter metadata (no 'layers')")
    info = parse_json(md["layers"], f"{path}: the adapter metadata 'layers'", AdapterFileError)
    optimizer = (
        parse_json(md["optimizer"], f"{path}: the adapter metadata 'optimizer'", AdapterFileError)
        if "optimizer" in md
        else None
    )
    meta = parse_json(md["user"], f"{path}: the adapter metadata 'user'", AdapterFileError) if "user" in md else None
    if not isinstance(info, list):
        raise AdapterFileError(f"{path}: the adapter metadata 'layers' must be a list, got {short_repr(info)}")
    layers: dict[int, AdapterLayer] = {}
    dtypes = set()
    t = header.tensors
    try:
        for entry in info:
            i = int(entry["ple_layer_index"])
            rows, d, n = int(entry["rows"]), int(entry["head_dim"]), int(entry["trained_rows"])
            ids, values = t[f"layer{i}.ids"], t[f"layer{i}.rows"]
            if ids.dtype != "I64" or ids.shape != (n,) or values.shape != (n, d) or values.dtype not in ("F32", "BF16"):
                raise AdapterFileError(
                    f"{path}: layer {i}: ids {ids.dtype} {list(ids.shape)} and rows {values.dtype} "
                    f"{list(values.shape)}, expected I64 [{n}] and F32/BF16 [{n}, {d}]"
                )
            dtypes.add(values.dtype)
            sid, sval = t.get(f"layer{i}.state.ids"), t.get(f"layer{i}.state.values")
            base = entry.get("base")
            if base is not None and not (isinstance(base, dict) and isinstance(base.get("header_checksum"), str)):
                raise AdapterFileError(f"{path}: layer {i}: damaged record of the table it was trained over")
            layers[i] = AdapterLayer(
                i, rows, d, str(entry["layout_hash"]), str(entry["base_format"]), n, ids, values, sid, sval, base
            )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, AdapterFileError):
            raise
        raise AdapterFileError(f"{path}: damaged adapter file (missing or malformed {e})") from None
    if len(dtypes) > 1:
        raise AdapterFileError(f"{path}: layers keep rows in different dtypes {sorted(dtypes)}")
    dtype = torch.bfloat16 if dtypes == {"BF16"} else torch.float32
    return AdapterFile(path, layers, dtype, optimizer, meta)


def as_adapter(adapter: str | os.PathLike | AdapterFile) -> AdapterFile:
    """``adapter`` itself, or the file it names opened with :func:`read_adapter`."""
    return adapter if isinstance(adapter, AdapterFile) else read_adapter(adapter)


def load_optimizer_state(optimizer: RowSparseOptimizer, adapter: str | os.PathLike | AdapterFile) -> None:
    """Resume ``optimizer`` from a training checkpoint written by :func:`save_adapter` with
    ``optimizer=``: the same optimizer class, its hyperparameters, step counts and per-row states,
    matched to the optimizer's tables by PLE layer. Load the checkpoint's rows first
    (``load_adapter(model, path)``, then ``ple.train.trainable(model)``)."""
    file = as_adapter(adapter)
    saved = file.optimizer
    if saved is None:
        raise AdapterFileError(f"{file.path}: holds no optimizer state (saved without optimizer=)")
    if not isinstance(saved, dict):
        raise AdapterFileError(f"{file.path}: the optimizer metadata must be a JSON object, got {short_repr(saved)}")
    if saved.get("class") != type(optimizer).__name__:
        raise AdapterFileError(
            f"{file.path}: the state of a {short_repr(saved.get('class'))} optimizer cannot resume a "
            f"{type(optimizer).__name__}"
        )
    groups, steps = saved.get("param_groups"), saved.get("steps")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise AdapterFileError(
            f"{file.path}: optimizer param_groups must be a list of objects, got {short_repr(groups)}"
        )
    if not isinstance(steps, dict):
        raise AdapterFileError(f"{file.path}: optimizer steps must be an object by layer, got {short_repr(steps)}")
    if len(groups) != len(optimizer.param_groups):
        raise AdapterFileError(
            f"{file.path}: {len(groups)} parameter groups saved, the optimizer has {len(optimizer.param_groups)}"
        )
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    index = 0
    try:
        for saved_group, group in zip(groups, optimizer.param_groups, strict=True):
            mine = [p.ple_target.ple_layer_index for p in group["params"]]
            if mine != saved_group.get("layers"):
                raise AdapterFileError(
                    f"{file.path}: a group of PLE layers {short_repr(saved_group.get('layers'))}, the optimizer's {mine}"
                )
            hp = {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved_group.items() if k != "layers"}
            param_groups.append({**hp, "params": list(range(index, index + len(mine)))})
            for p, i in zip(group["params"], mine, strict=True):
                st: dict[str, Any] = {}
                step = steps.get(str(i))
                if step is not None:
                    st["step"] = check_step(step, f"optimizer steps[{str(i)!r}]")
                if i in file.layers:
                    got = file.optimizer_states(i)
                    if got is not None:
                        st["rows"], st["values"] = _local_states(optimizer, group, i, *got)
                        optimizer.check_row_states(p, st["rows"], st["values"], f"layer{i}.state.values")
                state[index] = st
                index += 1
        optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    except (InvalidArgumentError, ArgumentTypeError) as e:
        raise AdapterFileError(f"{file.path}: {e}") from None


def _local_states(optimizer, group, index: int, ids: torch.Tensor, values: torch.Tensor):
    """The states of the rows this process owns (a rank of a sharded table), with local ids."""
    for p in group["params"]:
        if p.ple_target.ple_layer_index == index:
            table = p.ple_target.layer.table
            if isinstance(table, ShardedTable):
                keep = (ids >= table.row_start) & (ids < table.row_stop)
                return ids[keep] - table.row_start, values[keep]
    return ids, values


# ---------------------------------------------------------------------------------------------- sharded
class _GatheredStates:
    """The optimizer states of every rank of one table, as :func:`ple.train.adapter` saves them."""

    def __init__(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        self._ids, self._values = ids, values

        class _Store:
            width = values.shape[1]

        self.store = _Store()

    def __len__(self) -> int:
        return self._ids.numel()

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ids, self._values


def save_sharded_adapter(
    path: str | os.PathLike,
    model: nn.Module | PLELayer,
    *,
    dtype: torch.dtype = torch.float32,
    optimizer=None,
    meta: dict[str, Any] | None = None,
) -> Path | None:
    """Write one adapter file of every trained sharded table of ``model`` (the whole table's rows:
    each rank's own, gathered to rank 0, which writes ``path`` atomically). A collective: every rank
    calls it; returns ``path`` on rank 0, None elsewhere. Arguments as :func:`ple.train.save_adapter`."""
    layers = [
        layer
        for layer in ple_layers(model)
        if isinstance(layer.table, ShardedTable) and isinstance(layer.table.local_table, AdaptedTable)
    ]
    if not layers:
        raise UsageError("no PLE layer of this model has a trained sharded table (ple.train.trainable(model))")
    check_destination(Path(path), model)
    steps: dict[int, tuple[int, Any]] = {}
    sources = []
    for layer in layers:
        table = layer.table
        assert isinstance(table, ShardedTable) and isinstance(table.local_table, AdaptedTable)
        local = table.local_table
        with local.overlay.lock:
            ids = local.overlay.ids()
            _, rows = local.overlay.get(ids)
        parts = all_gather_rows(table.group, ids + table.row_start, rows)
        full = RowOverlay(table.rows, table.head_dim, torch.float32)
        for got_ids, got_rows in parts:
            if got_ids.numel():
                full.put(got_ids, got_rows)
        sources.append((layer, full, 0, local.base))
        if optimizer is not None:
            state = _table_state(optimizer, layer)
            step, rs = state if state is not None else (0, None)
            width = 0 if rs is None else rs.store.width
            if rs is not None:
                sid, sval = rs.export()
            else:
                sid, sval = torch.empty(0, dtype=torch.int64), torch.empty(0, max(width, 1))
            widths = all_gather_rows(table.group, torch.tensor([width]), torch.zeros(1, 1))
            w = max(int(x[0][0]) for x in widths)
            if w:
                gathered = all_gather_rows(table.group, sid + table.row_start, sval.reshape(-1, w))
                gid = torch.cat([g[0] for g in gathered])
                order = torch.argsort(gid)
                steps[layer.ple_layer_index] = (
                    step,
                    _GatheredStates(gid[order], torch.cat([g[1] for g in gathered])[order]),
                )
            else:
                steps[layer.ple_layer_index] = (step, None)
    group = layers[0].table.group
    out = None
    if dist.get_rank(group) == 0:
        out = write_adapter_file(Path(path), sources, dtype, steps, optimizer, meta)
    dist.barrier(group=group)
    for _, full, _, _ in sources:
        full.close()
    return out


def _table_state(optimizer, layer: PLELayer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.ple_target.ple_layer_index == layer.ple_layer_index:
                return int(optimizer.state[p].get("step", 0)), optimizer.row_state(p)
    raise InvalidArgumentError(f"the optimizer does not train PLE layer {layer.ple_layer_index}'s table")
