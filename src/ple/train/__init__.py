"""Training a PLE table where it lives: row-sparse gradients, row-sparse optimizers, adapters.

Real text reads a small part of a PLE table (0.46 % of the published table's rows per 200,000
tokens), so training one keeps per-row memory for the rows read and nothing table-sized:

- :func:`trainable` puts an overlay on each layer's table (any tier and format: memory, memory map,
  direct reads, a row cache, sharded across ranks) and gives it a gradient handle
  (``layer.table_weight``); ``loss.backward()`` then gives the handle a row-sparse gradient
  (:mod:`ple.table.grad`): the distinct rows read and their summed gradients.
- The optimizers (:mod:`.optim`: :class:`SGD`, :class:`Adagrad`, :class:`RowWiseAdagrad`,
  :class:`SparseAdam`, :class:`Adam`, :class:`AdamW`) update those rows in the overlay, with state
  for the rows ever touched only, in memory up to a budget and spilled to a file beyond it;
  optionally inside the backward (``fused=True``). The base table is never written.
- Adapters (:mod:`.adapter`): the trained rows as a small file of their own (:func:`save_adapter`,
  atomic; with the optimizer's state, a checkpoint to resume from), served on top of any base table
  (:func:`load_adapter`, :func:`remove_adapter`: load, swap and remove on a running model; several at
  once under names, chosen per request, :func:`adapter_names`; see :mod:`.serve`), or merged into a
  table file (:mod:`.merge`).
- Tables sharded across ranks (:mod:`.sharded`): each rank trains the rows it owns.
- Data parallelism (:mod:`.data_parallel`: DDP, ``torchrun``, a multi-process ``Trainer``): every rank
  holds the whole table and the optimizers apply the ranks' mean row-sparse gradient at each step.
- Checkpoints: while a table is trainable, a patched model's ``state_dict()`` holds its trained rows,
  which ``load_state_dict`` puts back (:mod:`ple.integrations.table_state`).
"""

from __future__ import annotations

from ple.train.adapter import (
    AdapterFile,
    AdapterFileError,
    load_optimizer_state,
    read_adapter,
    save_adapter,
    save_sharded_adapter,
)
from ple.train.attach import Part, TableTarget, freeze, ple_layers, table_parameters, trainable
from ple.train.merge import merge_model, merge_table_file
from ple.train.optim import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    CombinedOptimizer,
    RowSparseOptimizer,
    RowWiseAdagrad,
    SparseAdam,
)
from ple.train.serve import adapter_index, adapter_names, load_adapter, remove_adapter

__all__ = [
    "AdapterFile",
    "AdapterFileError",
    "Adagrad",
    "Adam",
    "AdamW",
    "CombinedOptimizer",
    "Part",
    "RowSparseOptimizer",
    "RowWiseAdagrad",
    "SGD",
    "SparseAdam",
    "TableTarget",
    "adapter_index",
    "adapter_names",
    "freeze",
    "load_adapter",
    "load_optimizer_state",
    "merge_model",
    "merge_table_file",
    "ple_layers",
    "read_adapter",
    "remove_adapter",
    "save_adapter",
    "save_sharded_adapter",
    "table_parameters",
    "trainable",
]
