"""Host allocator tuning for CPU inference.

glibc returns every large freed block to the kernel (``munmap``) and maps a fresh one on the next
allocation, so each new activation tensor of a prefill is paid again in page faults: on a 2-core
machine that more than doubles the time of the PLE layer's elementwise passes. Keeping freed memory
in the process (as tcmalloc and jemalloc do) removes that cost.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["tune_host_allocator"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def tune_host_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 34) -> bool:
    """Make glibc keep freed blocks up to ``mmap_threshold`` bytes for reuse (process-wide).

    Returns True when applied (glibc found), False otherwise (other C libraries: nothing changes).
    Idempotent. Equivalent to starting the process with ``MALLOC_MMAP_THRESHOLD_`` and
    ``MALLOC_TRIM_THRESHOLD_`` set.
    """
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold, 2**31 - 1))) and bool(
        mallopt(_M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1))
    )
    _done = ok
    return ok
