"""Tables across ``fork()``: what each holds is made usable again in the child.

A forked child (``os.fork``, ``multiprocessing`` with the ``fork`` start method, PyTorch's DataLoader
workers) has one thread: the reader threads of a :class:`~ple.table.DirectTable` and the prefetch
worker of any table do not exist there, and a lock another thread held at the fork would stay held
for good. Objects that hold threads or locks register here (:func:`track`) and say what to do:

- ``_fork_locks()``: their locks, in the order their code takes them; every tracked object's are
  taken before the fork (so no bookkeeping is half-done in the child's copy) and released after it,
  in the parent and in the child;
- ``_after_fork_in_child()``: drop the threads' handles (never joined or freed: they belong to the
  parent), to be started again on first use;
- optionally ``_after_fork_in_parent()``: what the parent does about what it now shares with the
  child (a spill file mapped shared: :class:`~ple.table.tiers.rowstore.SlotStore` copies it before its
  next write), run before the locks are released.

A fork waits at most for the bookkeeping in progress (the locks are held for that only, never across
a file read). Objects are tracked through weak references: tracking keeps nothing alive.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Protocol

__all__ = ["track"]


class ForkAware(Protocol):
    def _fork_locks(self) -> list[threading.Lock]: ...

    def _after_fork_in_child(self) -> None: ...


_live: dict[int, weakref.ref] = {}
_keys = iter(range(1 << 62))  # next() on a range iterator is atomic under the GIL
_held: list[threading.Lock] = []


def track(obj: ForkAware) -> None:
    """Handle ``obj`` at every later fork (until it is garbage collected)."""
    key = next(_keys)

    def forget(_: weakref.ref) -> None:
        _live.pop(key, None)

    _live[key] = weakref.ref(obj, forget)


def _tracked() -> list[ForkAware]:
    refs = list(_live.values())  # one C call: a snapshot even while other threads track objects
    return [o for o in (r() for r in refs) if o is not None]


def _before() -> None:
    objs = _tracked()
    for obj in objs:
        try:
            locks = obj._fork_locks()
        except AttributeError:  # an object still being built (its locks not made yet)
            continue
        for lock in locks:
            lock.acquire()
            _held.append(lock)
    _objects[:] = objs


def _release() -> None:
    while _held:
        _held.pop().release()


def _after_in_parent() -> None:
    try:
        for obj in _objects:
            hook = getattr(obj, "_after_fork_in_parent", None)
            if hook is not None:
                hook()
    finally:
        _release()
        _objects.clear()


def _after_in_child() -> None:
    try:
        for obj in _objects:
            obj._after_fork_in_child()
    finally:
        _release()
        _objects.clear()


_objects: list[ForkAware] = []  # the objects handled by the fork in progress (kept alive across it)

if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
