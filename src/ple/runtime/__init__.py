"""The streaming runtime: packed step metadata (:class:`Batch`) and per-request state (:class:`Session`)."""

from .batch import DECODE, PREFILL, VERIFY, Batch, BatchError
from .host import tune_host_allocator
from .session import PrefixState, Session, SessionError, SessionStep

__all__ = [
    "Batch",
    "BatchError",
    "Session",
    "SessionError",
    "SessionStep",
    "PrefixState",
    "PREFILL",
    "DECODE",
    "VERIFY",
    "tune_host_allocator",
]
