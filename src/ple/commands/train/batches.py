"""Training batches for ``ple train``: windows cut out of its token stream (read, and mapped into a
small model's vocabulary, by :mod:`ple.data.tokens`)."""

from __future__ import annotations

import torch

from ple.errors import InvalidArgumentError

__all__ = ["windows"]


def windows(tokens: torch.Tensor, batch: int, length: int, step: int) -> torch.Tensor:
    """``[batch, length]``: the ``step``-th batch of consecutive ``length``-token windows of ``tokens``
    (cycling through them)."""
    n = tokens.numel() // length
    if n < batch:
        raise InvalidArgumentError(f"{tokens.numel()} tokens hold fewer than {batch} windows of {length}")
    first = (step * batch) % n
    picks = [(first + i) % n for i in range(batch)]
    return torch.stack([tokens[p * length : (p + 1) * length] for p in picks])
