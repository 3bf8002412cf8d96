"""Timing primitives shared by the benchmark runner and the profiler: interleaved samples, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["NOISY", "measure", "median_ms", "spread", "sync_of"]

NOISY = 1.5
"""A series whose max / min exceeds this gets extra rounds (up to ``max_repeat``)."""


def sync_of(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _timed(fn: Callable[[], Any], reset: Callable[[], None] | None, sync: Callable[[], None]) -> float:
    if reset is not None:
        reset()
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    dt = time.perf_counter() - t0
    del out
    return dt


def measure(
    fns: dict[str, Callable[[], Any]],
    repeat: int,
    warmup: int,
    reset: Callable[[], None] | None = None,
    sync: Callable[[], None] = lambda: None,
    max_repeat: int | None = None,
    noisy: float = NOISY,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function, interleaved in rotating order: ``repeat`` samples each,
    then more rounds (up to ``max_repeat``) while some series is noisy (max / min > ``noisy``).
    ``on_round(i)`` is called after round ``i`` (warm-up rounds included; for progress reports)."""
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    limit = max(repeat, max_repeat or repeat)
    i = 0
    while True:
        done = i - warmup
        if done >= repeat and (done >= limit or not any(spread(v) > noisy for v in samples.values())):
            return samples
        k = i % len(names)
        for name in names[k:] + names[:k]:
            dt = _timed(fns[name], reset, sync)
            if i >= warmup:
                samples[name].append(dt)
        if on_round is not None:
            on_round(i)
        i += 1


def spread(xs: list[float]) -> float:
    """max / min of a series of timings (1.0 = no noise)."""
    return max(xs) / min(xs) if xs and min(xs) > 0 else 1.0


def median_ms(xs: list[float] | None) -> float | None:
    """Median of a series of seconds, in milliseconds (None for no samples)."""
    return None if not xs else statistics.median(xs) * 1e3
