"""The streaming runtime: packed step metadata (:class:`Batch`) and per-request state (:class:`Session`)."""

from ple.runtime.batch import DECODE, PREFILL, VERIFY, Batch, BatchError
from ple.runtime.host import tune_host_allocator
from ple.runtime.session import PrefixState, Session, SessionError, SessionStep

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
