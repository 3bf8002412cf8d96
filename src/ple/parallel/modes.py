"""``ParallelLayer``: one :class:`~ple.layer.PLELayer` served by the ranks of a job in one mode.

Modes:

- ``"sp"``, sequence parallel: the ranks of ``group`` share one batch and each holds a contiguous
  shard of its token rows (:mod:`ple.parallel.sequence`); any table tier, or a table sharded across
  ranks with per-rank ids. With several groups (TP x DP) each group serves its own batch.
- ``"etp"``, table ("embedding") tensor parallel: the ranks of ``group`` share one batch, every rank
  computes the whole batch and the table is a :class:`~ple.table.ShardedTable` across the ranks.
- ``"dp"``, data parallel: every rank serves its own batch (any token count, none included; it
  still calls every step) and the table is sharded across the ranks with per-rank ids, or replicated.

Every rank's outputs and state pool are bit-identical to one process running the same layer on its
batch. Construction agrees on the configuration, weights digest, dtype, mode, group size and table
over the whole job, and every step agrees on the batch (token and request counts, a digest of the
ids and metadata) within ``group``, before any data collective: ranks that disagree fail together
with :class:`~ple.parallel.RankMismatchError`. A collective that fails because a peer died or stalled
raises :class:`~ple.parallel.PeerFailureError` (see :mod:`ple.parallel.guard`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import torch
import torch.distributed as dist

from ple.common.collective import collective_device
from ple.errors import InvalidArgumentError, UsageError
from ple.layer import PLELayer
from ple.parallel.guard import agree, collective_failures
from ple.parallel.launch import ProcessContext
from ple.parallel.sequence import sequence_parallel_forward, token_shard
from ple.runtime.batch import Batch
from ple.table.tiers.sharded import ShardedTable

__all__ = ["MODES", "ParallelLayer", "batch_digest"]

MODES: tuple[str, ...] = ("sp", "etp", "dp")


def batch_digest(input_ids: torch.Tensor, batch: Batch) -> str:
    """sha256 (hex) of a step's tokens and metadata: equal on ranks that hold the same batch."""
    h = hashlib.sha256()
    for t in (
        input_ids,
        batch.query_start_loc,
        batch.slot_indices,
        batch.has_initial_state,
        batch.ngram_context,
        batch.num_rejected,
    ):
        x = t.detach().to("cpu").contiguous()
        h.update(str((x.dtype, tuple(x.shape))).encode())
        h.update(x.numpy().tobytes())
    h.update(",".join(batch.kinds).encode() + f"|{batch.num_spec}".encode())
    return h.hexdigest()


def _weights_digest(layer: PLELayer) -> str:
    """sha256 (hex) of the layer's dense weights' bytes (names, shapes, dtypes and values)."""
    h = hashlib.sha256()
    for name, p in sorted(layer.named_parameters()):
        x = p.detach().to("cpu").contiguous()
        h.update(f"{name}{tuple(x.shape)}{x.dtype}".encode())
        h.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _param_stamp(layer: PLELayer) -> tuple:
    """Changes when a parameter is replaced or modified in place."""
    return tuple((p._version, p.data_ptr(), p.dtype, p.device) for p in layer.parameters())


class ParallelLayer:
    """A :class:`~ple.layer.PLELayer` run by the ranks of a job in ``mode`` (see the module docstring).

    Args:
        layer: this rank's layer (the same weights on every rank; its table: any tier, or a
            :class:`~ple.table.ShardedTable`).
        mode: "sp", "etp" or "dp".
        group: the ranks that share a batch ("sp": shard its token rows; "etp": replicate it); default
            the default group. Unused with "dp".
        context: this process's :class:`~ple.parallel.ProcessContext` (from
            :func:`~ple.parallel.init_from_env`): its device runs the agreement exchanges and its store
            lets a failed collective name the ranks that are gone.
        check_batches: also compare a digest of each step's ids and metadata within ``group`` (a
            host-side hash of the step's ids; on by default).

    Construction is a collective over the default group.
    """

    def __init__(
        self,
        layer: PLELayer,
        mode: str,
        group: Any = None,
        *,
        context: ProcessContext | None = None,
        check_batches: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("ParallelLayer needs an initialized torch.distributed process group")
        self.layer = layer
        self.mode = mode
        self.group = group
        self.context = context
        self.check_batches = bool(check_batches)
        self.device = collective_device(None, None if context is None else context.device)
        self.group_size = dist.get_world_size(group) if mode != "dp" else 1
        self.group_rank = dist.get_rank(group) if mode != "dp" else 0
        self._steps = itertools.count()
        layer.refresh_weights()
        self._stamp = _param_stamp(layer)
        table = layer.table
        sharded = isinstance(table, ShardedTable)
        cfg = layer.config
        fields: dict[str, int | str] = {
            "config": hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest(),
            "hidden_size": cfg.hidden_size,
            "hc_count": cfg.hc_count,
            "ple_embed_dim": cfg.ple_embed_dim,
            "ngram_size": cfg.ngram_size,
            "heads_per_ngram": cfg.heads_per_ngram,
            "ple_conv_kernel_size": cfg.ple_conv_kernel_size,
            "ple_layer_index": layer.ple_layer_index,
            "dtype": str(layer.dtype).removeprefix("torch."),
            "weights": _weights_digest(layer),
            "mode": str(mode),
            "group_size": self.group_size,
            "table": "none" if table is None else type(table).__name__,
            "table_format": "" if table is None else table.format,
            "table_rows": -1 if table is None else table.rows,
            "table_ids": table.ids if isinstance(table, ShardedTable) else "",
            "table_method": table.method if isinstance(table, ShardedTable) else "",
            "check_batches": int(self.check_batches),
        }
        what = f"PLE layer {layer.ple_layer_index}, {mode!r} mode: configuration"
        with collective_failures(what, context):
            agree(fields, what, None, self.device)
        # the ranks agree on everything below, so they all raise alike
        if mode not in MODES:
            raise InvalidArgumentError(f"mode {mode!r} is not one of {list(MODES)}")
        if table is None:
            raise UsageError(f"PLE layer {layer.ple_layer_index} has no table: load a checkpoint or call set_table()")
        if mode == "etp" and not sharded:
            raise InvalidArgumentError("mode 'etp' shards the table across ranks: give the layer a ShardedTable")
        if mode in ("sp", "dp") and isinstance(table, ShardedTable) and table.ids != "per_rank":
            raise InvalidArgumentError(
                f"mode {mode!r}: each rank looks up its own token rows, so a sharded table needs ids='per_rank' "
                f"(it has ids={table.ids!r})"
            )

    def shard(self, num_tokens: int) -> tuple[int, int, int]:
        """``(start, stop, shard)``: the token rows this rank holds of a batch of ``num_tokens`` in "sp"
        mode (see :func:`~ple.parallel.token_shard`); the whole batch otherwise."""
        if self.mode == "sp":
            return token_shard(num_tokens, self.group_size, self.group_rank)
        return 0, num_tokens, num_tokens

    def __call__(self, hidden: torch.Tensor, input_ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        """One step. "sp": ``hidden`` is this rank's ``[shard, HC*H]`` rows (:meth:`shard`) and the result
        its rows of the new hidden state; "etp"/"dp": the layer's engine call on the whole batch. The
        state pool ``batch.conv_state`` (this rank's replica) is updated in place. A collective."""
        step = next(self._steps)
        layer = self.layer
        what = f"PLE layer {layer.ple_layer_index}, {self.mode!r} mode, step {step}"
        with collective_failures(what, self.context):
            if self.mode != "dp":
                fields: dict[str, int | str] = {
                    "step": step,
                    "tokens": batch.num_tokens,
                    "requests": batch.num_requests,
                    "num_spec": batch.num_spec,
                    "input_ids": int(input_ids.shape[0]) if input_ids.dim() == 1 else -1,
                    "hidden_rows": int(hidden.shape[0]) if hidden.dim() == 2 else -1,
                    "hidden_dtype": str(hidden.dtype).removeprefix("torch."),
                    "batch": batch_digest(input_ids, batch) if self.check_batches else "",
                }
                # the same field names on every rank (fixed here; check_batches agreed at construction)
                agree(fields, f"{what}: the batch", self.group, self.device, same_fields=True)
            if self.mode == "sp":
                stamp = _param_stamp(layer)
                if stamp != self._stamp:  # parameters changed in place since: derived buffers are stale
                    layer.refresh_weights()
                    self._stamp = stamp
                return sequence_parallel_forward(layer, hidden, input_ids, batch, self.group)
            return layer(hidden, input_ids, batch)
