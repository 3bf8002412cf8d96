"""ple: the PLE layer (hashed n-gram memory) of qwen4_exp models.

Levels: n-gram semantics (:mod:`ple.ngram`), table storage and lookup (:mod:`ple.table`), the
layer and its streaming runtime (:mod:`ple.layer`, :mod:`ple.runtime`).
"""

from .checkpoint import CheckpointError, PLEWeights, load_ple_weights, scan_checkpoint
from .config import ConfigError, PLEConfig
from .errors import PLEError
from .layer import PLELayer
from .layout import Layout
from .ngram import NgramInputError, fresh_context, next_ngram_context, ngram_ids
from .runtime import Batch, BatchError, PrefixState, Session, SessionError, tune_host_allocator
from .table import CachedTable, MemoryTable, MmapTable, PinnedHostTable, ShardedTable, StoredTable, Table

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
    "ShardedTable",
]
