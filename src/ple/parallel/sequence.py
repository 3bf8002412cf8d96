"""Sequence parallelism: the ranks of a group each hold a contiguous shard of a packed batch's token
rows and together compute what one process computes, bit for bit by construction: what a GEMM
library or the conv could compute otherwise for fewer rows (the projection, the conv) runs on the
whole batch as in one process, and only the row-by-row work (ids, lookup, gate) on a shard.

Rank ``s`` of a group of ``W`` holds rows ``[s*S, s*S + S)`` of the batch, ``S = ceil(T / W)``
(the last shards padded, as the engines pad), and every rank has the whole ``input_ids`` and batch
metadata. Per step, on the local rows only: n-gram ids (the context of a request cut by the shard
boundary is its last N-1 tokens before the boundary, as for a prefill chunk) and the table lookup (a
table sharded across ranks is looked up with per-rank ids). The table rows are all-gathered and
every rank projects the whole batch's rows (key and value, one GEMM): a CPU's GEMM library may
block a GEMM of a shard's rows otherwise than the whole batch's and give its rows other last bits
(an fp32 GEMM on an Intel Xeon with AMX does). The gate, row by row, runs on the local rows, which
gives this rank's residual rows ``hidden + v`` and conv inputs ``c``. The conv inputs are
all-gathered; every rank runs the conv over the whole batch with its replica of the state pool
(updated identically everywhere) and keeps its own rows of ``residual + silu(conv(c))``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ple import ops
from ple.errors import InvalidArgumentError, UsageError
from ple.layer import PLELayer
from ple.ngram import next_ngram_context, ngram_ids
from ple.runtime.batch import Batch

__all__ = ["local_ngram_ids", "sequence_parallel_forward", "shard_of", "token_shard"]


def token_shard(num_tokens: int, sp_size: int, sp_rank: int) -> tuple[int, int, int]:
    """``(start, stop, shard)``: the token rows ``[start, stop)`` rank ``sp_rank`` of ``sp_size`` holds,
    and the padded shard size ``shard = ceil(num_tokens / sp_size)`` every rank's buffers have."""
    for name, v, lo in (("num_tokens", num_tokens, 0), ("sp_size", sp_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise InvalidArgumentError(f"token_shard: {name} must be an integer >= {lo}, got {v!r}")
    if isinstance(sp_rank, bool) or not isinstance(sp_rank, int) or not 0 <= sp_rank < sp_size:
        raise InvalidArgumentError(f"token_shard: sp_rank must be in [0, {sp_size}), got {sp_rank!r}")
    shard = -(-num_tokens // sp_size)
    start = min(sp_rank * shard, num_tokens)
    return start, min(start + shard, num_tokens), shard


def shard_of(full: torch.Tensor, sp_size: int, sp_rank: int) -> torch.Tensor:
    """This rank's ``[shard, ...]`` rows of ``full [T, ...]``, zero-padded (what an engine hands the layer)."""
    start, stop, shard = token_shard(full.shape[0], sp_size, sp_rank)
    out = full.new_zeros((shard, *full.shape[1:]))
    out[: stop - start] = full[start:stop]
    return out


def local_ngram_ids(layer: PLELayer, input_ids: torch.Tensor, batch: Batch, start: int, stop: int) -> torch.Tensor:
    """``[stop - start, G]`` row ids of tokens ``[start, stop)`` of the batch, equal to rows
    ``[start, stop)`` of ``layer.ngram_ids(input_ids, batch)``, computed on those tokens only.

    The requests are cut to ``[start, stop)``; a request that began before ``start`` gets as context
    its last N-1 tokens before ``start`` (from its own context and tokens), as a chunked prefill does.
    """
    qsl = batch.query_start_loc.to("cpu", torch.int64)
    ctx = batch.ngram_context
    first = int(torch.searchsorted(qsl[1:], torch.tensor(start), right=True))  # request holding token `start`
    last = int(torch.searchsorted(qsl[1:], torch.tensor(max(stop - 1, start)), right=True))
    if stop <= start or first >= batch.num_requests:
        return torch.empty(0, layer.layout.num_heads, dtype=torch.int64, device=input_ids.device)
    bounds = qsl[first : last + 2].clamp(start, stop) - start
    local_ctx = ctx[first : last + 1].clone()
    a = int(qsl[first])
    if a < start:  # the first request began before this shard: its context is its history up to `start`
        head = input_ids[a:start]
        cut = torch.tensor([0, start - a], dtype=torch.int64, device=input_ids.device)
        local_ctx[0] = next_ngram_context(head, cut, ctx[first : first + 1])[0]
    return ngram_ids(
        input_ids[start:stop],
        bounds.to(input_ids.device),
        local_ctx,
        layer.layout,
        layer.config.eos_token_id,
    )


def sequence_parallel_forward(
    layer: PLELayer,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    batch: Batch,
    group=None,
) -> torch.Tensor:
    """This rank's ``[S, HC*H]`` rows of ``layer(full_hidden, input_ids, batch)`` (rows past the batch's
    end are zero), updating this rank's replica of ``batch.conv_state`` as the one-process layer does.

    Args:
        hidden: this rank's ``[S, HC*H]`` rows of the batch's hidden states, ``S = ceil(T / W)``
            (rows past the batch's end are ignored).
        input_ids: ``[T]``, the whole batch, the same on every rank of ``group``.
        batch: the whole batch's metadata and this rank's replica of the state pool.
        group: the sequence-parallel group (default: the default group).

    A collective over ``group`` (and over the table's group when the table is sharded, with per-rank
    ids): every rank calls it for every step. Check the ranks agree on the batch first
    (:class:`ple.parallel.ParallelLayer` does). The layer's derived weights must be current
    (:meth:`ple.layer.PLELayer.refresh_weights` after changing parameters in place; ParallelLayer does).

    The stages are those of the one-process step: :meth:`~ple.layer.PLELayer.project` of the whole
    batch's table rows (all-gathered), then :func:`ple.ops.gate_stage` of this rank's rows and
    :func:`ple.ops.conv_stage` of the whole batch (their composition equals :func:`ple.ops.gate_conv`
    bit for bit).
    """
    cfg = layer.config
    W, me = dist.get_world_size(group), dist.get_rank(group)
    T = batch.num_tokens
    start, stop, shard = token_shard(T, W, me)
    C = cfg.hc_hidden_size
    if tuple(hidden.shape) != (shard, C):
        raise InvalidArgumentError(
            f"sequence parallel: hidden must be this rank's [ceil(T / W), HC*H] = [{shard}, {C}] rows "
            f"(T = {T}, W = {W}), got {tuple(hidden.shape)}"
        )
    if tuple(input_ids.shape) != (T,):
        raise InvalidArgumentError(
            f"sequence parallel: input_ids must be the whole batch [T = {T}], got {tuple(input_ids.shape)}"
        )
    if hidden.dtype != layer.dtype:
        raise InvalidArgumentError(f"hidden is {hidden.dtype} but the layer computes in {layer.dtype}")
    batch.check_for(hidden.new_empty(1, C).expand(T, C), C, cfg.ngram_size - 1)
    n = stop - start
    with torch.no_grad():
        ids = local_ngram_ids(layer, input_ids, batch, start, stop)
        if layer.table is None:
            raise UsageError(f"PLE layer {layer.ple_layer_index} has no table: load a checkpoint or call set_table()")
        emb = layer.table.lookup(ids, layer.dtype)
        out = hidden.new_zeros(shard, C)
        if T == 0:
            return out
        # the whole batch's GEMM, as one process runs it: a GEMM of a shard's rows may be blocked
        # otherwise by the CPU's GEMM library and differ from it in the last bits
        key, value = layer.project(_all_gather_rows(emb, shard, T, group))
        residual, c = ops.gate_stage(key[start:stop], value[start:stop], hidden[:n], layer.gate_weights)
        c_all = _all_gather_rows(c, shard, T, group)
        res_all = residual.new_zeros(T, C)  # the conv stage adds the conv to every row; only ours are kept
        res_all[start:stop] = residual
        full = ops.conv_stage(c_all, res_all, layer.conv_weights, batch.step_meta())
        out[:n] = full[start:stop]
        return out


def _all_gather_rows(mine: torch.Tensor, shard: int, total: int, group) -> torch.Tensor:
    """``[total, ...]``: every rank's rows ``mine`` (at most ``shard`` each, the first ranks' full) in
    rank order, contiguous from the start of a new buffer (as one process's own tensor)."""
    W = dist.get_world_size(group)
    padded = mine.new_zeros((shard, *mine.shape[1:]))
    padded[: mine.shape[0]] = mine
    every = mine.new_empty((W, shard, *mine.shape[1:]))
    dist.all_gather(list(every.unbind(0)), padded, group=group)
    return every.view(W * shard, *mine.shape[1:])[:total]
