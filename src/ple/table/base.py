"""The ``Table`` interface shared by every storage tier, and its prefetch handles.

A table maps int64 row ids to rows: ``lookup(ids [T, G], dtype) -> [T, G*head_dim]`` on the ids'
device, bit-exact with :func:`~ple.table.lookup.gather_dequant_reference` whatever the tier.

Prefetch (``start_prefetch``) starts a lookup early and returns a :class:`Prefetch` handle:

- the gather runs on a worker thread when it reads host rows (CPU tables, memory maps; torch
  releases the GIL inside ``index_select``), or on a side CUDA stream when it reads device (or
  pinned host) memory for CUDA ids;
- the handle carries a sequence number and the identity of the ids tensor it was started for:
  ``wait(ids)`` with another tensor, or with the same tensor modified in place since, raises
  :class:`PrefetchError`, as does waiting twice or waiting a released handle;
- results land in pooled output buffers (``prefetch_depth`` per shape, 2 by default: double
  buffering). The buffer-reuse rule: a buffer goes back to the pool only through ``release()``
  (or leaving the handle's ``with`` block); a prefetch never writes a buffer whose handle was not
  released. After ``release()`` the tensor returned by ``wait()`` must not be read: copy it first
  if it is needed longer. A handle dropped without ``release()`` keeps its buffer out of the pool
  (it is freed with the caller's last reference), so forgetting ``release()`` costs allocation,
  never correctness.
"""

from __future__ import annotations

import abc
import concurrent.futures
import itertools
import threading

import torch

from ..errors import InvalidArgumentError, PLEError
from .formats import check_activation_dtype, check_ids, format_info
from .lookup import dequantize_rows_into, gather_dequant
from .lookup.torch_impl import gather_rows

__all__ = ["Table", "Prefetch", "PrefetchError"]


class PrefetchError(PLEError, RuntimeError):
    """A prefetch handle was misused: waited twice, waited after release, or for other ids."""


def check_wait(
    seq: int, live: bool, waited: bool, started_ids: torch.Tensor, ids_version: int, ids: torch.Tensor | None
) -> None:
    """Raise :class:`PrefetchError` unless a prefetch handle may be waited now (the rules every
    handle shares: once, before release, for the very ids tensor it started with, unmodified)."""
    if not live:
        raise PrefetchError(f"prefetch #{seq} was released: its rows may already be reused")
    if waited:
        raise PrefetchError(f"prefetch #{seq} was already waited: a handle is waited once")
    if ids is not None and ids is not started_ids:
        raise PrefetchError(
            f"prefetch #{seq} was started for another ids tensor "
            f"(shape {tuple(started_ids.shape)}), not the one given (shape {tuple(ids.shape)})"
        )
    if ids is not None and ids._version != ids_version:
        raise PrefetchError(f"prefetch #{seq}: its ids tensor was modified in place after the start")


class _Buffer:
    __slots__ = ("tensor", "release_event")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.release_event = None  # CUDA event recorded by release() on the consumer's stream


class Prefetch:
    """Handle of one started lookup; see the module docstring for the rules.

    Attributes:
        seq: sequence number, increasing per table.
        ids: the ``[T, G]`` ids tensor the prefetch was started for (the caller's object).
        dtype: activation dtype of the rows.
    """

    def __init__(self, engine: _PrefetchEngine, seq: int, ids: torch.Tensor, dtype: torch.dtype, buf: _Buffer):
        self._engine = engine
        self.seq = seq
        self.ids = ids
        self.dtype = dtype
        self._ids_version = ids._version
        self._buf: _Buffer | None = buf
        self._future: concurrent.futures.Future | None = None
        self._event = None  # CUDA event marking the side-stream gather done
        self._waited = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "released" if self._buf is None else ("waited" if self._waited else "pending")
        return f"Prefetch(seq={self.seq}, ids={tuple(self.ids.shape)}, dtype={self.dtype}, {state})"

    def done(self) -> bool:
        """Whether the rows are ready (``wait`` would not block)."""
        if self._future is not None:
            return self._future.done()
        return self._event is None or self._event.query()

    def wait(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Block until the rows are ready and return them, ``[T, G*head_dim]`` on the ids' device.

        Args:
            ids: when given, must be the very tensor the prefetch was started for, unmodified;
                otherwise :class:`PrefetchError` (the rows would belong to another batch).

        The returned tensor is a pooled buffer owned by this handle until ``release()``.
        """
        with self._lock:
            check_wait(self.seq, self._buf is not None, self._waited, self.ids, self._ids_version, ids)
            self._waited = True
            buf = self._buf
        if self._future is not None:
            try:
                self._future.result()
            except BaseException:
                self.release()
                raise
        elif self._event is not None:
            torch.cuda.current_stream(buf.tensor.device).wait_event(self._event)
        return buf.tensor

    def release(self) -> None:
        """Give the output buffer back to the pool (idempotent). Rows from ``wait`` become invalid."""
        with self._lock:
            buf, self._buf = self._buf, None
        if buf is None:
            return
        if self._future is not None:
            concurrent.futures.wait([self._future])  # never pool a buffer still being written
        if buf.tensor.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(buf.tensor.device))
            buf.release_event = ev
        self._engine.give_back(buf)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _PrefetchEngine:
    """Worker thread, side streams and output-buffer pool of one table."""

    def __init__(self, table: Table, depth: int) -> None:
        self.table = table
        self.depth = depth
        self._lock = threading.Lock()
        self._free: dict[tuple, list[_Buffer]] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._closed = False

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
                raise PrefetchError(f"{type(self.table).__name__} is closed: no new prefetch")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ple-prefetch")
            return self._executor

    def start(self, ids: torch.Tensor, dtype: torch.dtype) -> Prefetch:
        table = self.table
        T, G = ids.shape
        device = ids.device
        buf = self.take((T, G * table.head_dim), dtype, device)
        handle = Prefetch(self, next(table._prefetch_seq), ids, dtype, buf)
        snapshot = ids.clone()  # the caller may reuse its ids tensor; the gather reads this copy
        if table._gathers_on_device(device):
            cur = torch.cuda.current_stream(device)
            side = self._stream(device)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                if buf.release_event is not None:
                    side.wait_event(buf.release_event)
                table._lookup_into(snapshot, buf.tensor)
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
            self.table._lookup_into(ids, buf.tensor)
            return
        side = self._stream(buf.tensor.device)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            if buf.release_event is not None:
                side.wait_event(buf.release_event)
            self.table._lookup_into(ids, buf.tensor)
        side.synchronize()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._free.clear()
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


class Table(abc.ABC):
    """A PLE table ``[rows, head_dim]`` in one storage format, wherever it lives.

    Subclasses provide ``data`` (``[rows, head_dim]``, storage dtype) and ``scale`` (None, ``[1]``
    or ``[rows, 1]``). Lookups return rows on the ids' device.

    Attributes:
        format: format name ("bf16", "fp16", "fp32", "fp8", "fp8_row", "int8_row").
        rows: number of rows (``R_pad``).
        head_dim: width of one row.
        prefetch_depth: output buffers kept per shape for prefetches (>= 2).
    """

    format: str
    rows: int
    head_dim: int
    prefetch_depth: int = 2

    def __init__(self, format: str, rows: int, head_dim: int) -> None:
        format_info(format)
        self.format = format
        self.rows = int(rows)
        self.head_dim = int(head_dim)
        self._engine: _PrefetchEngine | None = None
        self._engine_lock = threading.Lock()
        self._prefetch_seq = itertools.count()

    # ------------------------------------------------------------------ storage
    @property
    @abc.abstractmethod
    def data(self) -> torch.Tensor:
        """``[rows, head_dim]`` rows in the storage dtype."""

    @property
    @abc.abstractmethod
    def scale(self) -> torch.Tensor | None:
        """None (plain), ``[1]`` fp32 (global) or ``[rows, 1]`` fp32 (per row)."""

    @property
    def device(self) -> torch.device:
        """Where the rows are stored (``cpu`` for memory maps and pinned host memory)."""
        return self.data.device

    @property
    def storage_dtype(self) -> torch.dtype:
        return format_info(self.format).storage_dtype

    @property
    def nbytes(self) -> int:
        """Bytes of rows plus scales."""
        n = self.rows * self.head_dim * format_info(self.format).itemsize
        s = self.scale
        return n + (0 if s is None else s.numel() * s.element_size())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(format={self.format!r}, rows={self.rows}, head_dim={self.head_dim}, "
            f"device={self.device})"
        )

    # ------------------------------------------------------------------ lookup
    def lookup(self, ids: torch.Tensor, dtype: torch.dtype, *, check: bool = True) -> torch.Tensor:
        """Rows for ``ids [T, G]`` int64, dequantized: ``[T, G*head_dim]`` in ``dtype`` on the ids' device.

        ``check`` verifies ids lie in ``[0, rows)`` (:class:`~ple.table.IdOutOfRangeError` names the
        id and its (token, head)); on an accelerator the check synchronizes with the host.
        """
        self._check_call(ids, dtype, check)
        T, G = ids.shape
        out = torch.empty(T, G * self.head_dim, dtype=dtype, device=ids.device)
        self._lookup_into(ids, out)
        return out

    def start_prefetch(self, ids: torch.Tensor, dtype: torch.dtype, *, check: bool = True) -> Prefetch:
        """Start ``lookup(ids, dtype)`` in the background; ``handle.wait()`` returns its rows.

        Bad ids raise here, at the start. See the module docstring for the buffer rules.
        """
        self._check_call(ids, dtype, check)
        with self._engine_lock:
            if self._engine is None:
                self._engine = _PrefetchEngine(self, max(2, int(self.prefetch_depth)))
            engine = self._engine
        return engine.start(ids, dtype)

    def close(self) -> None:
        """Stop the prefetch worker (pending prefetches finish first)."""
        with self._engine_lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def _check_call(self, ids: torch.Tensor, dtype: torch.dtype, check: bool) -> None:
        check_activation_dtype(dtype)
        if check:
            check_ids(ids, self.rows)
        elif not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.int64:
            raise InvalidArgumentError(f"row ids must be a 2-D int64 tensor [T, G], got {getattr(ids, 'shape', ids)}")

    def _gathers_on_device(self, device: torch.device) -> bool:
        """Whether a lookup for ids on ``device`` runs there (a CUDA kernel) rather than on the host."""
        data = self.data
        return device.type == "cuda" and (data.device == device or (data.device.type == "cpu" and data.is_pinned()))

    def _lookup_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Write the rows of (already checked) ``ids [T, G]`` into ``out [T, G*head_dim]`` on the ids' device."""
        data, scale = self.data, self.scale
        dev = out.device
        if data.device == dev or self._gathers_on_device(dev):
            gather_dequant(data, scale, ids.to(dev), out.dtype, out=out, check=False)
        elif data.device.type == "cpu":
            # Host rows for device ids: gather the (narrow) stored rows on the host, ship them,
            # dequantize on the device.
            flat = ids.reshape(-1).cpu()
            rows = gather_rows(data, flat).to(dev)
            if scale is None:
                srows = None
            elif scale.dim() == 2:
                srows = scale.index_select(0, flat).to(dev)
            else:
                srows = scale.to(dev)
            dequantize_rows_into(rows, srows, out.view(-1, self.head_dim))
        else:
            res = gather_dequant(data, scale, ids.to(data.device), out.dtype, check=False)
            out.copy_(res)
