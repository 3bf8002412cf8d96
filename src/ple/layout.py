"""Exact integer layout of a PLE table: hash multipliers, per-head prime sizes, offsets, shards.

Everything here is pure Python integer arithmetic (no floats, no tensors), so it is exact for any
geometry. The numbers must be bit-for-bit those of the published reference.
"""

from __future__ import annotations

import dataclasses
import threading

from ple.errors import InvalidArgumentError

__all__ = [
    "Layout",
    "splitmix64",
    "is_prime",
    "nth_prime_after",
    "layer_multipliers",
    "compute_layout",
    "shard_bounds",
]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_LAYER_PRIME = 10007

# Bases that make Miller-Rabin deterministic for every n < 2^64.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def splitmix64(x: int) -> int:
    """SplitMix64 finalizer on an unsigned 64-bit integer (all arithmetic mod 2^64)."""
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return (x ^ (x >> 31)) & _MASK64


def is_prime(n: int) -> bool:
    """Deterministic primality for 0 <= n < 2^64 (Miller-Rabin with the first 12 prime bases)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def nth_prime_after(start: int, count: int) -> int:
    """The ``count``-th prime strictly greater than ``start`` (count >= 1)."""
    if count < 1:
        raise InvalidArgumentError(f"count must be >= 1, got {count}")
    n = start
    for _ in range(count):
        n += 1
        while not is_prime(n):
            n += 1
    return n


def _primes_after(start: int, count: int) -> list[int]:
    out: list[int] = []
    n = start
    while len(out) < count:
        n += 1
        if is_prime(n):
            out.append(n)
    return out


_prime_lock = threading.Lock()
_prime_runs: dict[int, list[int]] = {}  # start -> the primes after it found so far, in order
_MAX_PRIME_RUNS = 16


def _head_primes(start: int, first: int, count: int) -> list[int]:
    """Primes ``first .. first + count - 1`` (zero-based) of those strictly greater than ``start``.

    The primes of every layer's heads follow one another, so the run after each ``start`` is kept
    and extended: the layouts of all PLE layers of a config cost one pass, not one per layer."""
    with _prime_lock:
        run = _prime_runs.get(start)
        if run is None:
            if len(_prime_runs) >= _MAX_PRIME_RUNS:
                _prime_runs.pop(next(iter(_prime_runs)))
            run = _prime_runs[start] = []
        need = first + count - len(run)
        if need > 0:
            run += _primes_after(run[-1] if run else start, need)
        return run[first : first + count]


def layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> list[int]:
    """Odd hash multipliers ``m_0..m_{N-1}`` of one PLE layer."""
    half = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    base = seed + _LAYER_PRIME * ple_layer_index
    return [2 * (splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def shard_bounds(k: int, shard_rows: int, rows: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of shard ``k`` when ``rows`` rows are cut into shards of ``shard_rows``
    (the checkpoint's and the table file's shard geometry); empty past the end."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise InvalidArgumentError(f"shard index must be an integer >= 0, got {k!r}")
    start = min(k * shard_rows, rows)
    return start, min(start + shard_rows, rows)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Geometry of one PLE layer's table.

    ``multipliers`` has N entries; ``head_sizes``/``head_offsets`` have G entries (order-major:
    the first ``heads_per_ngram`` heads hash bigrams). The table is ``[padded_rows, head_dim]``;
    a checkpoint splits it into ``split_parts`` shards of ``shard_rows`` rows (the last ones may
    be short or empty).
    """

    ple_layer_index: int
    ngram_size: int
    heads_per_ngram: int
    vocab_size: int
    multipliers: tuple[int, ...]
    head_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]
    rows: int
    padded_rows: int
    head_dim: int
    split_parts: int
    shard_rows: int

    @property
    def num_heads(self) -> int:
        return len(self.head_sizes)

    @property
    def embed_dim(self) -> int:
        return self.num_heads * self.head_dim

    def shard_range(self, k: int) -> tuple[int, int]:
        """Row range ``[start, stop)`` of checkpoint shard ``k`` (empty when past the end)."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < self.split_parts:
            raise InvalidArgumentError(f"shard index {k!r} out of range [0, {self.split_parts})")
        return shard_bounds(k, self.shard_rows, self.padded_rows)

    def to_dict(self) -> dict:
        return {
            "ple_layer_index": self.ple_layer_index,
            "multipliers": list(self.multipliers),
            "head_sizes": list(self.head_sizes),
            "head_offsets": list(self.head_offsets),
            "rows": self.rows,
            "padded_rows": self.padded_rows,
            "head_dim": self.head_dim,
            "shard_rows": self.shard_rows,
            "split_parts": self.split_parts,
        }


def compute_layout(
    *,
    ple_layer_index: int,
    ngram_size: int,
    heads_per_ngram: int,
    vocab_size: int,
    seed: int,
    ngram_vocab_size_base: int,
    divisible_by: int,
    split_parts: int,
    embed_dim: int,
) -> Layout:
    """Exact layout of PLE layer ``ple_layer_index``."""
    g = (ngram_size - 1) * heads_per_ngram
    sizes = _head_primes(ngram_vocab_size_base - 1, ple_layer_index * g, g)
    offsets, acc = [], 0
    for p in sizes:
        offsets.append(acc)
        acc += p
    padded = -(-acc // divisible_by) * divisible_by
    return Layout(
        ple_layer_index=ple_layer_index,
        ngram_size=ngram_size,
        heads_per_ngram=heads_per_ngram,
        vocab_size=vocab_size,
        multipliers=tuple(layer_multipliers(vocab_size, ngram_size, ple_layer_index, seed)),
        head_sizes=tuple(sizes),
        head_offsets=tuple(offsets),
        rows=acc,
        padded_rows=padded,
        head_dim=embed_dim // g,
        split_parts=split_parts,
        shard_rows=-(-padded // split_parts),
    )
