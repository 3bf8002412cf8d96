"""Making a layer's table trainable: an overlay for the trained rows and a gradient handle.

:func:`trainable` takes a :class:`ple.PLELayer` or any module holding them (a model patched by
``ple.integrations.transformers``, a ``from_pretrained`` model) and, for each layer:

- puts a :class:`~ple.table.tiers.adapted.RowOverlay` on its table (an
  :class:`~ple.table.tiers.adapted.AdaptedTable`; a table that already is one keeps its overlay, so
  training continues an adapter that was loaded; a :class:`~ple.table.ShardedTable` gets one on its
  local table, so each rank keeps the rows it owns);
- gives it a gradient handle (``layer.table_weight``, :func:`ple.table.grad.table_parameter`)
  that remembers its layer (:class:`TableTarget`, the handle's ``ple_target``).

The handles are what a row-sparse optimizer of :mod:`ple.train.optim` takes. The base table is
never written: the optimizers write the trained rows to the overlay (initialized, when a row is first
updated, from the base's own fp32 lookup of it).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ple.errors import InvalidArgumentError, UsageError
from ple.layer import PLELayer
from ple.table import ShardedTable, Table
from ple.table.grad import table_parameter
from ple.table.tiers.adapted import AdaptedTable, RowOverlay
from ple.train.data_parallel import check_setting, refuse_fused
from ple.train.sharded import owned_gradient

__all__ = [
    "trainable",
    "freeze",
    "table_parameters",
    "ple_layers",
    "target_of",
    "default_spill_dir",
    "TableTarget",
    "Part",
]


@dataclass(frozen=True)
class Part:
    """The rows of a table this process trains: the overlay that holds them, the table under it (for
    the rows' first values), and the range ``[start, stop)`` of the full table's row ids they are
    (an overlay's ids are ``id - start``)."""

    overlay: RowOverlay
    base: Table
    start: int
    stop: int


class TableTarget:
    """What a gradient handle trains: its layer's table, resolved at each step (``parts``)."""

    def __init__(self, layer: PLELayer, data_parallel: Any = "auto") -> None:
        self._layer = weakref.ref(layer)
        self.ple_layer_index = layer.ple_layer_index
        self.data_parallel = data_parallel  # see ple.train.data_parallel

    @property
    def layer(self) -> PLELayer:
        layer = self._layer()
        if layer is None:
            raise UsageError(f"PLE layer {self.ple_layer_index} of this table handle no longer exists")
        return layer

    def parts(self) -> list[Part]:
        """The overlays this process writes (one; none on a rank that owns no rows)."""
        layer = self.layer
        table = layer.table
        if isinstance(table, AdaptedTable):
            return [Part(table.overlay, table.base, 0, table.rows)]
        if isinstance(table, ShardedTable) and isinstance(table.local_table, AdaptedTable):
            local = table.local_table
            if table.row_stop <= table.row_start:
                return []
            return [Part(local.overlay, local.base, table.row_start, table.row_stop)]
        raise UsageError(
            f"PLE layer {layer.ple_layer_index}'s table ({type(table).__name__}) has no overlay to train: "
            "call ple.train.trainable(layer) after setting its table"
        )

    def gradient(self, rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient this process applies now, from its backward's ``(rows, values)``: the same, except
        for a table sharded across ranks with per-rank ids (:func:`ple.train.sharded.owned_gradient`).
        A replicated table under data parallelism is averaged over the ranks at ``step()``
        (:mod:`ple.train.data_parallel`), never here: a fused update, which would apply this rank's
        gradient alone, is refused."""
        table = self.layer.table
        if isinstance(table, ShardedTable):
            return owned_gradient(table, rows, values)
        refuse_fused(self)
        return rows, values

    def overlays(self) -> list[RowOverlay]:
        return [p.overlay for p in self.parts()]


def ple_layers(model: nn.Module | PLELayer) -> list[PLELayer]:
    """The :class:`ple.PLELayer` modules of ``model`` (itself if it is one), in module order."""
    if isinstance(model, PLELayer):
        return [model]
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"expected a PLELayer or a torch module holding them, got {type(model).__name__}")
    layers = [m for m in model.modules() if isinstance(m, PLELayer)]
    if not layers:
        raise InvalidArgumentError(
            f"{type(model).__name__} holds no ple.PLELayer (patch a transformers model first, or load it with "
            "ple.integrations.transformers.from_pretrained)"
        )
    return layers


def _adapt(table: Table, memory_budget: int | None, spill_dir) -> AdaptedTable:
    if isinstance(table, AdaptedTable):
        if table.overlay.dtype != torch.float32:
            raise InvalidArgumentError(
                f"the adapter on this table keeps {table.overlay.dtype} rows; training needs float32 rows "
                "(load the adapter with dtype=torch.float32)"
            )
        return table
    return AdaptedTable(table, RowOverlay(table.rows, table.head_dim, memory_budget=memory_budget, spill_dir=spill_dir))


def default_spill_dir(table: Table | None) -> str | None:
    """The folder of the table's file (where the disk has room for the table), else None."""
    seen = 0
    at: object = table
    while at is not None and seen < 8:
        path = getattr(at, "path", None)
        if isinstance(path, (str, os.PathLike)):
            return os.path.dirname(os.path.abspath(path))
        at = getattr(at, "backing", None) or getattr(at, "local_table", None)
        seen += 1
    return None


def trainable(
    model: nn.Module | PLELayer,
    *,
    memory_budget: int | None = None,
    spill_dir: str | os.PathLike | None = None,
    data_parallel: Any = "auto",
) -> list[nn.Parameter]:
    """Make the table of every PLE layer of ``model`` trainable; returns their gradient handles.

    Args:
        model: a :class:`ple.PLELayer` or a module holding them.
        memory_budget: bytes of trained rows each table keeps in memory (None: all); rows beyond
            it spill to an unnamed file in ``spill_dir``.
        spill_dir: where trained rows spill (default: the folder of the table's file, else the system's
            temporary folder).
        data_parallel: which ranks average the table's gradient at each optimizer step, as DDP
            averages the other weights' (:mod:`ple.train.data_parallel`): ``"auto"`` the default
            process group when one is initialised with more than one rank at the step, a
            ``ProcessGroup`` that group, ``False`` none (each process trains its own rows). A
            table sharded across ranks trains each rank's own rows whatever this says.

    A layer that is already trainable keeps its handle (and takes this ``data_parallel``). Returns the
    handles in layer order, each ``requires_grad`` and carrying a :class:`TableTarget` as ``ple_target``.
    """
    data_parallel = check_setting(data_parallel)
    handles = []
    for layer in ple_layers(model):
        table = layer.table
        if table is None:
            raise UsageError(f"PLE layer {layer.ple_layer_index} has no table to train")
        spill = spill_dir if spill_dir is not None else default_spill_dir(table)
        if isinstance(table, ShardedTable):
            table.local_table = _adapt(table.local_table, memory_budget, spill)
        else:
            adapted = _adapt(table, memory_budget, spill)
            if adapted is not table:
                layer.table = adapted
        weight = layer.table_weight
        if weight is None:
            weight = table_parameter(table.rows, table.head_dim)
            weight.ple_target = TableTarget(layer, data_parallel)  # type: ignore[attr-defined]
            layer.set_table_weight(weight)
        else:
            target_of(weight).data_parallel = data_parallel
        weight.requires_grad_(True)
        handles.append(weight)
    return handles


def freeze(model: nn.Module | PLELayer) -> None:
    """Stop recording the tables' gradients (the overlays and their rows stay, and serve lookups)."""
    for layer in ple_layers(model):
        layer.set_table_weight(None)


def table_parameters(model: nn.Module | PLELayer) -> list[nn.Parameter]:
    """The gradient handles of the trainable tables of ``model`` (see :func:`trainable`)."""
    return [w for w in (layer.table_weight for layer in ple_layers(model)) if w is not None]


def target_of(param: torch.Tensor) -> TableTarget:
    """The :class:`TableTarget` of a handle from :func:`trainable`, or :class:`InvalidArgumentError`."""
    target = getattr(param, "ple_target", None)
    if not isinstance(target, TableTarget):
        raise InvalidArgumentError(
            f"a ple.train optimizer takes the table handles of ple.train.trainable(model), got a tensor of shape "
            f"{list(param.shape)}; give the other weights to a torch optimizer"
        )
    return target
