"""Row traffic statistics of a token stream: what a cache of hot rows in a faster tier would save.

Two views of the same stream, both computed chunk by chunk (memory grows with the distinct rows and
n-grams the stream touches, never with its length; a token file is read in blocks, never whole, by
:mod:`ple.data.tokens`):

- per head, the stream as one request (EOS separates documents): distinct rows touched, the share of
  lookups served by the hottest 1% / 10% of touched rows, and bucket load (how many distinct
  n-grams share a row: the hash collision view);
- per n-gram order, the stream served as decode: consecutive pieces of ``request_tokens`` tokens are
  requests, ``batch`` of them run side by side one token per step (then the next ``batch``). Every
  lookup is put in the first class that fits: its row was already read in this step (by another
  request), read by the same request in an earlier step, read by another request earlier, or new.
  Also the distinct rows a step reads, and the hit rate of a least-recently-used row cache of each
  size in ``cache_rows`` (a step's distinct rows are its cache accesses).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from ple.config import PLEConfig
from ple.data.tokens import CHUNK_TOKENS
from ple.errors import InvalidArgumentError
from ple.ngram import fresh_context, next_ngram_context, ngram_ids
from ple.ngram.torch_impl import ngram_windows

__all__ = ["row_traffic"]

# ---------------------------------------------------------------------------------------------- traffic


def _top_share(counts: np.ndarray, fraction: float) -> float:
    """Share of all lookups that the hottest ``fraction`` of touched rows serve."""
    if not counts.size:
        return 0.0
    k = max(1, int(round(fraction * counts.size)))
    return float(np.partition(counts, counts.size - k)[counts.size - k :].sum()) / float(counts.sum())


def _merge_counts(rows: np.ndarray, counts: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct rows and their counts after adding the rows ``new``."""
    r2, c2 = np.unique(new, return_counts=True)
    allr, inv = np.unique(np.concatenate([rows, r2]), return_inverse=True)
    return allr, np.bincount(inv, weights=np.concatenate([counts, c2]), minlength=allr.size).astype(np.int64)


def _firsts(*keys: np.ndarray) -> np.ndarray:
    """Bool mask: entry ``j`` is the first (in index order) of the entries sharing its key tuple."""
    n = keys[0].size
    order = np.lexsort((np.arange(n), *reversed(keys)))
    first_sorted = np.ones(n, dtype=bool)
    if n > 1:
        same = np.ones(n - 1, dtype=bool)
        for k in keys:
            ks = k[order]
            same &= ks[1:] == ks[:-1]
        first_sorted[1:] = ~same
    out = np.empty(n, dtype=bool)
    out[order] = first_sorted
    return out


def _member(x: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Bool mask: which entries of ``x`` are in the sorted distinct array ``sorted_set``."""
    if not sorted_set.size:
        return np.zeros(x.shape, dtype=bool)
    i = np.minimum(np.searchsorted(sorted_set, x), sorted_set.size - 1)
    return sorted_set[i] == x


def _insert_sorted(sorted_set: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``sorted_set`` with the entries of ``x`` it lacks, still sorted and distinct (a merge, not a
    new sort of the whole set: the set grows with every window)."""
    new = np.sort(x)
    new = new[np.concatenate([[True], new[1:] != new[:-1]])] if new.size else new
    new = new[~_member(new, sorted_set)]
    return np.insert(sorted_set, np.searchsorted(sorted_set, new), new)


class _Grams:
    """The distinct n-grams of one head and the row each hashes to (a function of the n-gram, so
    distinct (row, n-gram) pairs are distinct n-grams). An n-gram is one int64 key when its tokens
    fit (``order * bits(vocab) <= 63``: the published vocabulary's 18 bits, up to trigrams), else a
    row of tokens (slower)."""

    def __init__(self, order: int, vocab: int) -> None:
        self.bits = max(1, (vocab - 1).bit_length())
        self.packed = order * self.bits <= 63
        self.keys = np.zeros(0 if self.packed else (0, order), dtype=np.int64)
        self.rows = np.zeros(0, dtype=np.int64)

    def add(self, rows: np.ndarray, grams: np.ndarray) -> None:
        if self.packed:
            key = np.zeros(grams.shape[0], dtype=np.int64)
            for k in range(grams.shape[1]):
                key = (key << self.bits) | grams[:, k]
            keys = np.concatenate([self.keys, key])
            self.keys, first = np.unique(keys, return_index=True)
        else:
            keys = np.concatenate([self.keys, grams])
            self.keys, first = np.unique(keys, axis=0, return_index=True)
        self.rows = np.concatenate([self.rows, rows])[first]


class _DecodeTraffic:
    """The decode view (see the module docstring), fed token by token chunk."""

    CLASSES = ("within_step", "within_request", "across_requests", "new")

    def __init__(self, config: PLEConfig, ple_layer_index: int, batch: int, request_tokens: int, cache_rows):
        self.lay = config.layout(ple_layer_index)
        self.eos = config.eos_token_id
        self.batch, self.request_tokens = batch, request_tokens
        self.orders = self.lay.ngram_size - 1
        self.pending: list[np.ndarray] = []
        self.pending_n = 0
        self.seen = np.zeros(0, dtype=np.int64)
        self.requests = 0
        self.steps = 0
        self.lookups = np.zeros(self.orders, dtype=np.int64)
        self.classes = np.zeros((len(self.CLASSES), self.orders), dtype=np.int64)
        self.caches: list[tuple[int, collections.OrderedDict]] = [
            (int(c), collections.OrderedDict()) for c in cache_rows
        ]
        self.hits = np.zeros((len(self.caches), self.orders), dtype=np.int64)

    def feed(self, chunk: np.ndarray) -> None:
        self.pending.append(chunk)
        self.pending_n += chunk.size
        window = self.batch * self.request_tokens
        if self.pending_n >= window:
            flat = np.concatenate(self.pending)
            full = flat.size - flat.size % window
            for k in range(0, full, window):
                self._window(flat[k : k + window], [self.request_tokens] * self.batch)
            self.pending, self.pending_n = [flat[full:]], flat.size - full

    def finish(self) -> None:
        if self.pending_n:
            flat = np.concatenate(self.pending)
            lens = [self.request_tokens] * (flat.size // self.request_tokens)
            if flat.size % self.request_tokens:
                lens.append(flat.size % self.request_tokens)
            self._window(flat, lens)
            self.pending, self.pending_n = [], 0

    def _window(self, tokens: np.ndarray, lens: list[int]) -> None:
        lay = self.lay
        G = lay.num_heads
        R = len(lens)
        qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int64)
        ids = ngram_ids(torch.from_numpy(tokens), qsl, fresh_context(R, lay, self.eos), lay, self.eos).numpy()
        piece = np.repeat(np.arange(R, dtype=np.int64), lens)
        step = np.arange(tokens.size, dtype=np.int64) - np.repeat(qsl[:-1].numpy(), lens)
        # every lookup in time order: step, then request, then head
        r = ids.reshape(-1)
        s = np.repeat(step, G)
        i = np.repeat(piece, G)
        order = np.tile(np.arange(G, dtype=np.int64) // lay.heads_per_ngram, tokens.size)
        t = np.lexsort((np.tile(np.arange(G), tokens.size), i, s))
        r, s, i, order = r[t], s[t], i[t], order[t]
        first_in_step = _firsts(s, r)
        first_in_request = _firsts(i, r)
        earlier = _member(r, self.seen) | ~_firsts(r)
        masks = (
            ~first_in_step,
            first_in_step & ~first_in_request,
            first_in_step & first_in_request & earlier,
            first_in_step & first_in_request & ~earlier,
        )
        for c, m in enumerate(masks):
            self.classes[c] += np.bincount(order[m], minlength=self.orders)
        self.lookups += np.bincount(order, minlength=self.orders)
        self.seen = _insert_sorted(self.seen, r)
        self.requests += R
        self.steps += max(lens)
        reads, read_order = r[first_in_step].tolist(), order[first_in_step]
        for c, (size, lru) in enumerate(self.caches):
            hit = np.zeros(len(reads), dtype=bool)
            for j, row in enumerate(reads):
                if row in lru:
                    hit[j] = True
                    lru.move_to_end(row)
                else:
                    lru[row] = None
                    if len(lru) > size:
                        lru.popitem(last=False)
            self.hits[c] += np.bincount(read_order[hit], minlength=self.orders)

    def result(self) -> dict:
        reads = self.lookups - self.classes[0]  # a step's distinct rows, summed over steps
        steps = max(self.steps, 1)
        out_orders = []
        for o in range(self.orders):
            n = max(int(self.lookups[o]), 1)
            out_orders.append(
                {
                    "order": o + 2,
                    "lookups": int(self.lookups[o]),
                    "distinct_rows_per_step": float(reads[o]) / steps,
                    **{name: float(self.classes[c, o]) / n for c, name in enumerate(self.CLASSES)},
                }
            )
        total_reads = max(int(reads.sum()), 1)
        caches = [
            {
                "rows": size,
                "hit_rate": float(self.hits[c].sum()) / total_reads,
                "per_order": [float(self.hits[c, o]) / max(int(reads[o]), 1) for o in range(self.orders)],
            }
            for c, (size, _) in enumerate(self.caches)
        ]
        return {
            "batch": self.batch,
            "request_tokens": self.request_tokens,
            "requests": self.requests,
            "steps": self.steps,
            "distinct_rows_per_step": float(reads.sum()) / steps,
            "orders": out_orders,
            "cache": caches,
        }


def _as_chunks(tokens: torch.Tensor | np.ndarray | Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        flat = np.ascontiguousarray(tokens.reshape(-1), dtype=np.int64)
        for k in range(0, flat.size, CHUNK_TOKENS):
            yield flat[k : k + CHUNK_TOKENS]
        return
    for chunk in tokens:
        yield np.ascontiguousarray(np.asarray(chunk).reshape(-1), dtype=np.int64)


def row_traffic(
    tokens: torch.Tensor | np.ndarray | Iterable[np.ndarray],
    config: PLEConfig,
    ple_layer_index: int = 0,
    *,
    batch: int = 64,
    request_tokens: int = 256,
    cache_rows: Iterable[int] = (1 << 16, 1 << 20),
) -> dict:
    """Statistics of the rows a stream of tokens reads (see the module docstring for both views).

    ``tokens``: ``[n]`` ids, or an iterable of such chunks (e.g. :func:`ple.data.tokens.read_tokens`), consumed once.

    Returns ``{"tokens", "lookups", "heads": [{"head", "order", "rows", "distinct_rows",
    "top1_share", "top10_share", "distinct_ngrams", "shared_rows", "max_bucket_load"}], "total": {...},
    "decode": {"batch", "request_tokens", "requests", "steps", "distinct_rows_per_step",
    "orders": [{"order", "lookups", "distinct_rows_per_step", "within_step", "within_request",
    "across_requests", "new"}], "cache": [{"rows", "hit_rate", "per_order"}]}}`` (shares in [0, 1]).
    """
    if batch < 1 or request_tokens < 1:
        raise InvalidArgumentError(f"batch and request_tokens must be >= 1, got {batch} and {request_tokens}")
    lay = config.layout(ple_layer_index)
    eos = config.eos_token_id
    G = lay.num_heads
    ctx = fresh_context(1, lay, eos)
    empty = np.zeros(0, dtype=np.int64)
    rows = [empty] * G
    counts = [empty] * G
    grams = [_Grams(g // lay.heads_per_ngram + 2, max(config.vocab_size, eos + 1)) for g in range(G)]
    all_rows, all_counts = empty, empty
    decode = _DecodeTraffic(config, ple_layer_index, batch, request_tokens, cache_rows)
    n_tokens = 0
    for chunk in _as_chunks(tokens):
        if not chunk.size:
            continue
        t = torch.from_numpy(chunk)
        qsl = torch.tensor([0, chunk.size])
        ids = ngram_ids(t, qsl, ctx, lay, eos).numpy()
        y = ngram_windows(t, qsl, ctx, lay.ngram_size, eos).numpy()
        ctx = next_ngram_context(t, qsl, ctx)
        for g in range(G):
            order = g // lay.heads_per_ngram + 2
            col = ids[:, g]
            rows[g], counts[g] = _merge_counts(rows[g], counts[g], col)
            grams[g].add(col, y[:, :order])
        all_rows, all_counts = _merge_counts(all_rows, all_counts, ids.reshape(-1))
        decode.feed(chunk)
        n_tokens += chunk.size
    decode.finish()
    heads = []
    for g in range(G):
        _, per_row = np.unique(grams[g].rows, return_counts=True)
        heads.append(
            {
                "head": g,
                "order": g // lay.heads_per_ngram + 2,
                "rows": lay.head_sizes[g],
                "distinct_rows": int(rows[g].size),
                "top1_share": _top_share(counts[g], 0.01),
                "top10_share": _top_share(counts[g], 0.10),
                "distinct_ngrams": int(grams[g].rows.size),
                "shared_rows": int((per_row > 1).sum()),
                "max_bucket_load": int(per_row.max()) if per_row.size else 0,
            }
        )
    return {
        "tokens": n_tokens,
        "lookups": n_tokens * G,
        "heads": heads,
        "total": {
            "distinct_rows": int(all_rows.size),
            "top1_share": _top_share(all_counts, 0.01),
            "top10_share": _top_share(all_counts, 0.10),
            "bytes_per_row_fp8": lay.head_dim,
        },
        "decode": decode.result(),
    }
