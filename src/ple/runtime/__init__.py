"""The streaming runtime: packed step metadata (:class:`Batch`) and per-request state (:class:`Session`)."""

from .batch import DECODE, PREFILL, VERIFY, Batch, BatchError
from .host import tune_host_allocator
from .session import PrefixState, Session, SessionError

__all__ = [
    "Batch",
    "BatchError",
    "Session",
    "SessionError",
    "PrefixState",
    "PREFILL",
    "DECODE",
    "VERIFY",
    "tune_host_allocator",
]
