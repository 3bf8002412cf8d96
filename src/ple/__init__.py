"""ple: the PLE layer (hashed n-gram memory) of qwen4_exp models.

Levels: n-gram semantics (:mod:`ple.ngram`), table storage and lookup (:mod:`ple.table`), the
layer and its streaming runtime (:mod:`ple.layer`, :mod:`ple.runtime`).

``import ple`` itself is light (it does not import torch, so ``ple --version`` answers at once): the
names below are imported on first use. Using one of them, or importing a submodule, loads what it
needs; the ``torch.ops.ple`` operators are registered (each once, in :data:`ple.kernels.registry.OPERATORS`)
by the modules that define them (:mod:`ple.ngram`, :mod:`ple.table`, :mod:`ple.ops`), which ``ple.PLELayer``, ``ple.Session``,
``ple.ngram_ids`` and the tables import: an engine that calls the operators directly imports those
(or uses one of these names) first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ple.checkpoint import CheckpointError, PLEWeights, load_ple_weights, scan_checkpoint
    from ple.config import ConfigError, PLEConfig
    from ple.errors import PLEError
    from ple.layer import PLELayer
    from ple.layout import Layout
    from ple.ngram import NgramInputError, fresh_context, next_ngram_context, ngram_ids
    from ple.runtime import Batch, BatchError, PrefixState, Session, SessionError, tune_host_allocator
    from ple.table import (
        CachedTable,
        DirectTable,
        MemoryTable,
        MmapTable,
        PinnedHostTable,
        ShardedTable,
        StoredTable,
        Table,
    )

__version__ = "0.2.0"
"""The package version (the only place it is written; ``pyproject.toml`` reads it from here)."""

__all__ = [
    "PLEError",
    "PLEConfig",
    "ConfigError",
    "Layout",
    "ngram_ids",
    "next_ngram_context",
    "fresh_context",
    "NgramInputError",
    "load_ple_weights",
    "scan_checkpoint",
    "PLEWeights",
    "CheckpointError",
    "PLELayer",
    "Batch",
    "BatchError",
    "Session",
    "SessionError",
    "PrefixState",
    "tune_host_allocator",
    "Table",
    "StoredTable",
    "MemoryTable",
    "MmapTable",
    "PinnedHostTable",
    "CachedTable",
    "DirectTable",
    "ShardedTable",
]

_WHERE = {
    "CheckpointError": ".checkpoint",
    "PLEWeights": ".checkpoint",
    "load_ple_weights": ".checkpoint",
    "scan_checkpoint": ".checkpoint",
    "ConfigError": ".config",
    "PLEConfig": ".config",
    "PLEError": ".errors",
    "PLELayer": ".layer",
    "Layout": ".layout",
    "NgramInputError": ".ngram",
    "fresh_context": ".ngram",
    "next_ngram_context": ".ngram",
    "ngram_ids": ".ngram",
    "Batch": ".runtime",
    "BatchError": ".runtime",
    "PrefixState": ".runtime",
    "Session": ".runtime",
    "SessionError": ".runtime",
    "tune_host_allocator": ".runtime",
    "CachedTable": ".table",
    "DirectTable": ".table",
    "MemoryTable": ".table",
    "MmapTable": ".table",
    "PinnedHostTable": ".table",
    "ShardedTable": ".table",
    "StoredTable": ".table",
    "Table": ".table",
}
"""The module each public name comes from (imported on first use)."""


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'ple' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
