"""Prefetch handles: a lookup started early, its rows collected later.

Prefetch (``start_prefetch``) starts a lookup early and returns a :class:`Prefetch` handle:

- the gather runs on a worker thread when it reads host rows (CPU tables, memory maps; torch
  releases the GIL inside ``index_select``), or on a side CUDA stream when it reads device (or
  pinned host) memory for CUDA ids;
- the handle carries a sequence number and the identity of the ids tensor it was started for:
  ``wait(ids)`` with another tensor, or with the same tensor modified in place since, raises
  :class:`PrefetchError`, as does waiting twice or waiting a released handle; a caller that derived
  the ids from other objects (the layer: its tokens, offsets and contexts) binds the handle to them
  (:meth:`PrefetchHandle.bind`) and checks them before use (:meth:`PrefetchHandle.check_bound`):
  identities and tensor versions only, so the check reads no device data;
- results land in pooled output buffers (``prefetch_depth`` per shape, 2 by default: double
  buffering). The buffer-reuse rule: a buffer goes back to the pool only through ``release()``
  (or leaving the handle's ``with`` block); a prefetch never writes a buffer whose handle was not
  released. After ``release()`` the tensor returned by ``wait()`` must not be read: copy it first
  if it is needed longer. A handle dropped without ``release()`` keeps its buffer out of the pool
  (it is freed with the caller's last reference), so forgetting ``release()`` costs allocation,
  never correctness.

In a forked child the parent's worker thread does not exist: the child's first prefetch starts one
of its own, and a handle whose lookup was still running in the parent at the fork raises
:class:`PrefetchError` when waited (its rows will never be written there); see :mod:`.forks`.
"""

from __future__ import annotations

import abc
import concurrent.futures
import threading
from collections.abc import Callable

import torch

from ple.errors import PLEError
from ple.kernels import native as _native
from ple.table.forks import track

__all__ = ["PrefetchError", "PrefetchHandle", "Prefetch"]


class PrefetchError(PLEError, RuntimeError):
    """A prefetch handle was misused: waited twice, waited after release, or for other ids."""


class PrefetchHandle(abc.ABC):
    """What every prefetch handle shares: a sequence number, the ids tensor it was started for, and the
    rules (waited once, before release, for that very ids tensor, unmodified; ``release`` is idempotent).

    Subclasses say how the rows are produced: :meth:`_collect` blocks until they are ready and returns
    them, :meth:`_drop` gives up what the handle holds (after waiting for any write in flight),
    :meth:`done` tells whether :meth:`wait` would block.

    Attributes:
        seq: sequence number, increasing per table.
        ids: the ``[T, G]`` ids tensor the prefetch was started for (the caller's object).
        dtype: activation dtype of the rows.
    """

    def __init__(self, seq: int, ids: torch.Tensor, dtype: torch.dtype) -> None:
        self.seq = seq
        self.ids = ids
        self.dtype = dtype
        self._ids_version = ids._version
        self._bound: tuple | None = None
        self._live = True
        self._waited = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "released" if not self._live else ("waited" if self._waited else "pending")
        return f"{type(self).__name__}(seq={self.seq}, ids={tuple(self.ids.shape)}, dtype={self.dtype}, {state})"

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the rows are ready (``wait`` would not block)."""

    @abc.abstractmethod
    def _collect(self) -> torch.Tensor:
        """Block until the rows are ready and return them (called once, after the checks)."""

    @abc.abstractmethod
    def _drop(self) -> None:
        """Give up what the handle holds, once no write into it is in flight (called once)."""

    def wait(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Block until the rows are ready and return them, ``[T, G*head_dim]`` on the ids' device.

        Args:
            ids: when given, must be the very tensor the prefetch was started for, unmodified;
                otherwise :class:`PrefetchError` (the rows would belong to another batch).
        """
        with self._lock:
            if not self._live:
                raise PrefetchError(f"prefetch #{self.seq} was released: its rows may already be reused")
            if self._waited:
                raise PrefetchError(f"prefetch #{self.seq} was already waited: a handle is waited once")
            if ids is not None and ids is not self.ids:
                raise PrefetchError(
                    f"prefetch #{self.seq} was started for another ids tensor "
                    f"(shape {tuple(self.ids.shape)}), not the one given (shape {tuple(ids.shape)})"
                )
            if ids is not None and ids._version != self._ids_version:
                raise PrefetchError(f"prefetch #{self.seq}: its ids tensor was modified in place after the start")
            self._waited = True
        return self._collect()

    def bind(self, *sources) -> None:
        """Record the objects the ids were computed from (tensors with their current versions)."""
        self._bound = tuple((s, s._version if isinstance(s, torch.Tensor) else None) for s in sources)

    def check_bound(self, *sources) -> None:
        """Raise :class:`PrefetchError` unless ``sources`` are the very objects given to :meth:`bind`,
        in that order, and no tensor among them was modified in place since."""
        if self._bound is None:
            raise PrefetchError(
                f"prefetch #{self.seq} was not bound to the inputs its ids came from (start it with the "
                "layer's start_prefetch), so it cannot be checked against these"
            )
        if len(sources) != len(self._bound):
            raise PrefetchError(
                f"prefetch #{self.seq}: checked against {len(sources)} objects, bound to {len(self._bound)}"
            )
        for i, (got, (want, version)) in enumerate(zip(sources, self._bound)):
            what = type(want).__name__ if not isinstance(want, torch.Tensor) else f"tensor {tuple(want.shape)}"
            if got is not want:
                raise PrefetchError(
                    f"prefetch #{self.seq} was started for other inputs: argument {i} is not the {what} its ids "
                    "were computed from (the rows would belong to another batch)"
                )
            if version is not None and got._version != version:
                raise PrefetchError(
                    f"prefetch #{self.seq}: argument {i} ({what}) was modified in place after the prefetch started"
                )

    def release(self) -> None:
        """Give up the handle (idempotent). Rows returned by ``wait`` must not be read afterwards."""
        with self._lock:
            live, self._live = self._live, False
        if live:
            self._drop()

    def __enter__(self) -> PrefetchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _Buffer:
    __slots__ = ("tensor", "release_event")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.release_event: torch.cuda.Event | None = None  # recorded by release() on the consumer's stream


class Prefetch(PrefetchHandle):
    """Handle of one lookup started by :meth:`ple.table.Table.start_prefetch` (worker thread or side
    CUDA stream); see the module docstring for the buffer rules. The tensor ``wait`` returns is a
    pooled buffer owned by this handle until ``release()``."""

    def __init__(self, engine: PrefetchEngine, seq: int, ids: torch.Tensor, dtype: torch.dtype, buf: _Buffer):
        super().__init__(seq, ids, dtype)
        self._engine = engine
        self._buf = buf
        self._forks = engine._forks  # the engine's forks so far: one more means this is a forked child
        self._future: concurrent.futures.Future | None = None
        self._event: torch.cuda.Event | None = None  # marks the side-stream gather done

    def _orphaned(self) -> bool:
        """Whether this is a forked child and the lookup was still running in the parent at the fork:
        its worker does not exist here, so the rows will never be written."""
        return self._forks != self._engine._forks and self._future is not None and not self._future.done()

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done() or self._orphaned()
        return self._event is None or self._event.query()

    def _collect(self) -> torch.Tensor:
        buf = self._buf
        if self._orphaned():
            self.release()
            raise PrefetchError(
                f"prefetch #{self.seq} was started before fork() and was still running in the parent: its rows "
                "are not written in this child process; look the ids up again here"
            )
        if self._future is not None:
            try:
                self._future.result()
            except BaseException:
                self.release()
                raise
        elif self._event is not None:
            torch.cuda.current_stream(buf.tensor.device).wait_event(self._event)
        return buf.tensor

    def _drop(self) -> None:
        buf = self._buf
        if self._orphaned():
            return  # nothing writes it here; kept out of the pool all the same
        if self._future is not None:
            concurrent.futures.wait([self._future])  # never pool a buffer still being written
        if buf.tensor.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(buf.tensor.device))
            buf.release_event = ev
        self._engine.give_back(buf)


class PrefetchEngine:
    """Worker thread, side streams and output-buffer pool of one table.

    The engine knows the table only through what it is given: ``owner`` (the table's name, for
    errors), ``head_dim`` (rows are ``[T, G*head_dim]``), ``lookup_into(ids, out)`` (writes the rows
    of checked ``ids [T, G]`` into ``out``) and ``gathers_on_device(device)`` (whether a lookup for
    ids on ``device`` runs there, on a side stream, rather than on the host worker).
    """

    def __init__(
        self,
        owner: str,
        head_dim: int,
        lookup_into: Callable[[torch.Tensor, torch.Tensor], None],
        gathers_on_device: Callable[[torch.device], bool],
        depth: int,
    ) -> None:
        self.owner = owner
        self.head_dim = head_dim
        self.lookup_into = lookup_into
        self.gathers_on_device = gathers_on_device
        self.depth = depth
        self._lock = threading.Lock()
        self._free: dict[tuple, list[_Buffer]] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._closed = False
        self._forks = 0  # forks this engine went through (as the child)
        track(self)

    def _fork_locks(self) -> list[threading.Lock]:
        return [self._lock]

    def _after_fork_in_child(self) -> None:
        # the parent's worker does not run here: a new one on the next prefetch; lookups the parent's
        # worker had not finished are refused by their handles
        self._executor = None
        self._streams = {}
        self._forks += 1

    def take(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> _Buffer:
        key = (shape, dtype, device)
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        buf = _Buffer(torch.empty(shape, dtype=dtype, device=device))
        if device.type == "cuda":
            buf.tensor.record_stream(self._stream(device))
        return buf

    def give_back(self, buf: _Buffer) -> None:
        t = buf.tensor
        key = (tuple(t.shape), t.dtype, t.device)
        with self._lock:
            free = self._free.setdefault(key, [])
            if len(free) < self.depth and not self._closed:
                free.append(buf)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            return self._streams[device]

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise PrefetchError(f"{self.owner} is closed: no new prefetch")
            if self._executor is None:
                # the worker's gathers run on it alone: the model's work has the other cores
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="ple-prefetch", initializer=_native.background_thread
                )
            return self._executor

    def start(self, ids: torch.Tensor, dtype: torch.dtype, seq: int) -> Prefetch:
        """Start the lookup of checked ``ids [T, G]``; ``seq`` is the handle's sequence number."""
        T, G = ids.shape
        device = ids.device
        buf = self.take((T, G * self.head_dim), dtype, device)
        handle = Prefetch(self, seq, ids, dtype, buf)
        snapshot = ids.clone()  # the caller may reuse its ids tensor; the gather reads this copy
        if self.gathers_on_device(device):
            cur = torch.cuda.current_stream(device)
            side = self._stream(device)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                if buf.release_event is not None:
                    side.wait_event(buf.release_event)
                self.lookup_into(snapshot, buf.tensor)
                ev = torch.cuda.Event()
                ev.record(side)
            snapshot.record_stream(side)
            handle._event = ev
            return handle
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        handle._future = self._pool().submit(self._run_on_host, snapshot, buf, ready)
        return handle

    def _run_on_host(self, ids: torch.Tensor, buf: _Buffer, ready) -> None:
        if buf.tensor.device.type != "cuda":
            self.lookup_into(ids, buf.tensor)
            return
        side = self._stream(buf.tensor.device)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            if buf.release_event is not None:
                side.wait_event(buf.release_event)
            self.lookup_into(ids, buf.tensor)
        side.synchronize()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._free.clear()
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
