"""The streaming runtime: packed step metadata (:class:`Batch`) and per-request state (:class:`Session`)."""

from ple.runtime.batch import DECODE, PREFILL, VERIFY, Batch, BatchError
from ple.runtime.host import tune_host_allocator
from ple.runtime.requests import PrefixState, SessionError, SessionStep
from ple.runtime.session import Session

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
