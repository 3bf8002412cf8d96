"""Training a table sharded across ranks: each rank updates the rows it owns.

A :class:`~ple.table.ShardedTable` is trained with an overlay on each rank's local table
(:func:`ple.train.trainable` puts it there), so the sharded lookup serves every rank's trained rows
to every rank, and each rank's optimizer writes only its own rows (:class:`~ple.train.attach.TableTarget`
gives it the range it owns).

The gradient each rank's optimizer applies (:func:`owned_gradient`):

- replicated ids (tensor parallelism, ``"etp"``: every rank runs the same batch through the same
  weights): every rank's backward computes the whole table's sparse gradient, the same bits on every
  rank, and each rank applies the rows it owns. Nothing is exchanged, and the trained rows are
  bit-identical to one process's, whatever the optimizer.
- per-rank ids (data parallelism, ``"dp"``: each rank its own batch): the ranks' sparse gradients are
  all-gathered and each rank sums, for the rows it owns, the ranks' values in rank order; one process
  running the ranks' batches as one sums the same terms in another grouping, so the rows agree
  within fp32 rounding. (The other weights' gradients are the caller's to average, as with DDP.)

:func:`ple.train.save_sharded_adapter` writes one adapter file of the whole table (rank 0 writes,
every rank calls); :func:`ple.train.load_adapter` gives each rank the rows it owns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ple.table import ShardedTable

__all__ = ["owned_gradient", "all_gather_rows"]


def all_gather_rows(group, ids: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``(ids [k_r], values [k_r, w])`` (CPU), in rank order: one all-gather of the counts,
    one of the padded ids and one of the padded values (a collective: every rank calls)."""
    world = dist.get_world_size(group)
    width = values.shape[1]
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([ids.numel()], dtype=torch.int64), group=group)
    most = max(int(c) for c in counts)
    pad_ids = torch.zeros(most, dtype=torch.int64)
    pad_ids[: ids.numel()] = ids
    pad_vals = torch.zeros(most, width, dtype=values.dtype)
    pad_vals[: ids.numel()] = values
    got_ids = [torch.empty_like(pad_ids) for _ in range(world)]
    got_vals = [torch.empty_like(pad_vals) for _ in range(world)]
    dist.all_gather(got_ids, pad_ids, group=group)
    dist.all_gather(got_vals, pad_vals, group=group)
    return [(i[: int(c)], v[: int(c)]) for i, v, c in zip(got_ids, got_vals, counts, strict=True)]


def owned_gradient(table: ShardedTable, rows: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of the whole table this rank's optimizer applies (see the module docstring):
    ``(rows [U] sorted distinct, values [U, head_dim])``; with per-rank ids the rows this rank owns,
    summed over the ranks in rank order (a collective)."""
    if table.ids == "replicated":
        return rows, values
    parts = all_gather_rows(table.group, rows, values)
    ids = torch.cat([p[0] for p in parts])
    mine = (ids >= table.row_start) & (ids < table.row_stop)
    ids = ids[mine]
    vals = torch.cat([p[1] for p in parts])[mine]
    out_rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    out = torch.zeros(out_rows.numel(), values.shape[1], dtype=torch.float32).index_add_(0, inverse, vals)
    return out_rows, out
