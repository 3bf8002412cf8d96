"""ple: the PLE layer (hashed n-gram memory) of qwen4_exp models.

Levels: n-gram semantics (:mod:`ple.ngram`), table storage and lookup (:mod:`ple.table`), the
layer and its streaming runtime (:mod:`ple.layer`, :mod:`ple.runtime`).
"""

from .checkpoint import CheckpointError, load_ple_weights, scan_checkpoint
from .config import ConfigError, PLEConfig
from .layout import Layout
from .ngram import NgramInputError, fresh_context, next_ngram_context, ngram_ids

__version__ = "0.1.0"

__all__ = [
    "PLEConfig",
    "ConfigError",
    "Layout",
    "ngram_ids",
    "next_ngram_context",
    "fresh_context",
    "NgramInputError",
    "load_ple_weights",
    "scan_checkpoint",
    "CheckpointError",
]
