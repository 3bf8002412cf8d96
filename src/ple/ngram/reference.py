"""Literal n-gram id computation: one token at a time, readable, slow.

This is the executable specification the fast paths are tested against.
"""

from __future__ import annotations

import torch

from ple.layout import Layout
from ple.ngram.tensors import layout_tensors

_MASK64 = (1 << 64) - 1


def _wrap64(x: int) -> int:
    """Python int -> int64 two's complement value."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def ngram_tokens(history: list[int], ngram_size: int, eos_token_id: int) -> list[list[int]]:
    """For each token of a fresh request: ``[y_0, ..., y_{N-1}]`` (itself, then its predecessors as
    the hash sees them: EOS at or before the most recent earlier EOS, and before the start)."""
    out = []
    for t in range(len(history)):
        last_eos = max((p for p in range(t) if history[p] == eos_token_id), default=-1)
        out.append([history[t - s] if t - s > last_eos and t - s >= 0 else eos_token_id for s in range(ngram_size)])
    return out


def ngram_ids(input_ids, query_start_loc, ngram_context, layout: Layout, eos_token_id: int) -> torch.Tensor:
    """N-gram row ids of a packed batch.

    Args:
        input_ids: ``[T]`` tokens of all requests, packed.
        query_start_loc: ``[R+1]`` cumulative token offsets (``0 = q[0] <= ... <= q[R] = T``).
        ngram_context: ``[R, N-1]`` the last N-1 tokens of each request's history before this chunk
            (EOS-filled for a fresh request).
        layout: the layer's :class:`~ple.layout.Layout`.
        eos_token_id: the id that cuts n-gram history.

    Returns:
        ``[T, G]`` int64 row ids into the layer's table.
    """
    return ids_from_tensors(
        input_ids, query_start_loc, ngram_context, *layout_tensors(layout, torch.device("cpu")),
        layout.heads_per_ngram, eos_token_id,
    )  # fmt: skip


def ids_from_tensors(
    input_ids, query_start_loc, ngram_context, multipliers, head_sizes, head_offsets, heads_per_ngram, eos_token_id
) -> torch.Tensor:
    """:func:`ngram_ids` with the layout given as its int64 tensors (``multipliers [N]``, ``head_sizes [G]``,
    ``head_offsets [G]``, see :func:`ple.ngram.tensors.layout_tensors`); ``[T, G]`` int64 on the CPU."""
    multipliers, head_sizes, head_offsets = (t.tolist() for t in (multipliers, head_sizes, head_offsets))
    n = len(multipliers)
    hpn = heads_per_ngram
    qsl = [int(v) for v in query_start_loc.tolist()]
    out = torch.empty(len(input_ids), len(head_sizes), dtype=torch.int64)
    for r in range(len(qsl) - 1):
        history = [int(v) for v in ngram_context[r].tolist()] + [
            int(v) for v in input_ids[qsl[r] : qsl[r + 1]].tolist()
        ]
        for t in range(n - 1, len(history)):
            # most recent EOS strictly before t; everything at or before it reads as EOS
            last_eos = max((p for p in range(t) if history[p] == eos_token_id), default=-1)
            y = [history[t - s] if t - s > last_eos else eos_token_id for s in range(n)]
            for order in range(2, n + 1):
                h = 0
                for s in range(order):
                    h ^= _wrap64(y[s] * multipliers[s]) & _MASK64
                h = _wrap64(h)
                for j in range(hpn):
                    g = (order - 2) * hpn + j
                    out[qsl[r] + t - (n - 1), g] = head_offsets[g] + h % head_sizes[g]
    return out


def next_ngram_context(
    input_ids: torch.Tensor, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
) -> torch.Tensor:
    """``[R, N-1]``: the last N-1 tokens of (context ++ chunk) for every request."""
    k = ngram_context.shape[1]
    qsl = [int(v) for v in query_start_loc.tolist()]
    rows = []
    for r in range(len(qsl) - 1):
        history = ngram_context[r].tolist() + input_ids[qsl[r] : qsl[r + 1]].tolist()
        rows.append(history[len(history) - k :] if k else [])
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), k)
