"""Real text for a small model: the built-in real-text stream mapped into the model's vocabulary.

The demo's model has a vocabulary of 1,024 ids, the real text (:mod:`ple.data.realtext`, Qwen's BPE over
Python's documentation) uses 151,644. :func:`vocabulary_map` keeps the text's structure: the most
frequent tokens of the training part get the model's ids from ``first_id`` up, in order of
frequency, every other token one shared id (``unknown``), the end of a document the model's EOS.
"""

from __future__ import annotations

import numpy as np
import torch

from ple.errors import InvalidArgumentError

__all__ = ["vocabulary_map", "real_text", "windows"]


def vocabulary_map(tokens: np.ndarray, vocab_size: int, eos_in: int, eos_out: int, first_id: int = 3) -> np.ndarray:
    """``map [max(max(tokens), eos_in) + 1]`` int64: source token -> model id (see the module
    docstring); the unknown id is ``first_id - 1``. ``tokens`` need not hold ``eos_in`` (a short
    slice of text may end before its first document does)."""
    if vocab_size <= first_id:
        raise InvalidArgumentError(f"vocab_size {vocab_size} leaves no ids from {first_id} on")
    values, counts = np.unique(tokens[tokens != eos_in], return_counts=True)
    order = np.lexsort((values, -counts))  # most frequent first, ties by id
    keep = values[order][: vocab_size - first_id]
    out = np.full(max(int(tokens.max(initial=0)), eos_in) + 1, first_id - 1, dtype=np.int64)
    out[keep] = np.arange(first_id, first_id + keep.size)
    out[eos_in] = eos_out
    return out


def real_text(train_tokens: int, eval_tokens: int, vocab_size: int, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train [train_tokens], held_out [eval_tokens])`` int64 model ids: the first tokens of the real
    text and the ones after them, mapped by the training part's :func:`vocabulary_map`."""
    from ple.data.realtext import QWEN_ENDOFTEXT, token_stream

    stream = token_stream(train_tokens + eval_tokens, QWEN_ENDOFTEXT)
    train, held = stream[:train_tokens], stream[train_tokens:]
    mapping = vocabulary_map(train, vocab_size, QWEN_ENDOFTEXT, eos)
    unknown = 2
    held = np.where(held < mapping.size, mapping[np.minimum(held, mapping.size - 1)], unknown)
    return torch.from_numpy(mapping[train]), torch.from_numpy(held)


def windows(tokens: torch.Tensor, batch: int, length: int, step: int) -> torch.Tensor:
    """``[batch, length]``: the ``step``-th batch of consecutive ``length``-token windows of ``tokens``
    (cycling through them)."""
    n = tokens.numel() // length
    if n < batch:
        raise InvalidArgumentError(f"{tokens.numel()} tokens hold fewer than {batch} windows of {length}")
    first = (step * batch) % n
    picks = [(first + i) % n for i in range(batch)]
    return torch.stack([tokens[p * length : (p + 1) * length] for p in picks])
