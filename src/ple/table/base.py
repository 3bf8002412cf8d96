"""The ``Table`` contract shared by every storage tier.

A table maps int64 row ids to rows: ``lookup(ids [T, G], dtype) -> [T, G*head_dim]`` on the ids'
device, bit-exact with :func:`~ple.table.lookup.gather_dequant_reference` whatever the tier, and
``start_prefetch`` starts the same lookup early (see :mod:`ple.table.lookup.prefetch` for the handles).

Two levels of the contract:

- :class:`Table`, the lookup interface every tier honours (memory, memory map, pinned host, cache,
  sharded across ranks);
- :class:`StoredTable`, a table whose whole ``data [rows, head_dim]`` and ``scale`` are readable in
  this process (every tier but one sharded across ranks); code that reads rows directly (the
  differentiable lookup, a copy into another tier) asks for a ``StoredTable`` with
  :func:`require_stored`.

The lookup is also the operator ``torch.ops.ple.table_lookup(ids, table, head_dim, dtype)`` (registered
in :data:`ple.kernels.registry.OPERATORS`: the table's own lookup on every device, the reference
:func:`~ple.table.lookup.gather_dequant_reference` of its rows), where
``table`` is a :class:`TableRef`: an opaque reference that compiled and exported programs take as
an input and pass to the operator untouched, so the table (any tier, dequantization inside) is never
a graph constant, never copied, and one compiled program serves every layer of a geometry.
"""

from __future__ import annotations

import abc
import itertools
import threading
from typing import Any

import numpy as np
import torch

from ple.errors import ArgumentTypeError, InvalidArgumentError, UsageError
from ple.kernels.registry import Kernel, register
from ple.table.forks import track
from ple.table.formats.catalog import check_activation_dtype, check_ids, format_info
from ple.table.lookup import dequantize_rows_into, gather_dequant, gather_dequant_reference
from ple.table.lookup.prefetch import PrefetchEngine, PrefetchHandle
from ple.table.lookup.torch_impl import gather_rows

__all__ = ["Table", "StoredTable", "TableRef", "require_stored", "lookup_through", "with_adapters", "adapter_choice"]


class Table(abc.ABC):
    """A PLE table ``[rows, head_dim]`` in one storage format, wherever it lives: the lookup interface.

    Subclasses provide :meth:`_lookup_into` (rows of checked ids into an output buffer), ``device``
    and ``nbytes``; :meth:`lookup` and :meth:`start_prefetch` are built on them. Lookups return rows
    on the ids' device.

    Pickling (``torch.save`` of a layer, ``multiprocessing``): tables in memory pickle their tensors (a
    copy starts its own prefetch worker), a memory-mapped table its file's path (the copy maps the file
    again, with the same checks); tiers that hold reader threads, a row cache or a process group
    (:class:`~ple.table.DirectTable`, :class:`~ple.table.CachedTable`, sharded tables) refuse with
    :class:`~ple.errors.UsageError`.

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
        self._engine: PrefetchEngine | None = None
        self._engine_lock = threading.Lock()
        self._prefetch_seq = itertools.count()
        track(self)

    def _fork_locks(self) -> list[threading.Lock]:
        """The locks a fork waits for (see :mod:`ple.table.forks`); subclasses add theirs after these."""
        return [self._engine_lock]

    def _after_fork_in_child(self) -> None:  # noqa: B027 - most tiers hold nothing a fork breaks
        """Make what this table holds usable in a forked child (see :mod:`ple.table.forks`); the
        prefetch engine and the direct tier's readers see to their own threads."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the rows are stored (``cpu`` for memory maps and pinned host memory)."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of rows plus scales held by this process."""

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype rows are stored in (what the format says)."""
        return format_info(self.format).storage_dtype

    @property
    def global_scale(self) -> torch.Tensor | None:
        """``[1]`` float32: the scale of every row of a format with one global scale ("fp8", "nvfp4");
        None for the other formats."""
        return None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(format={self.format!r}, rows={self.rows}, head_dim={self.head_dim}, "
            f"device={self.device})"
        )

    # ------------------------------------------------------------------ pickling
    _unpicklable: str | None = None
    """Why a table of this kind cannot be pickled (it holds reader threads, a process group...), or None."""

    def __getstate__(self) -> dict:
        # pickled (torch.save of a layer, multiprocessing) without its prefetch worker: a copy starts its own
        if self._unpicklable is not None:
            raise UsageError(
                f"{self!r} cannot be pickled: it {self._unpicklable}. Detach it first (layer.table = None), "
                "pickle the layer, and attach the table again after loading"
            )
        state = self.__dict__.copy()
        for name in ("_engine", "_engine_lock", "_prefetch_seq"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._engine = None
        self._engine_lock = threading.Lock()
        self._prefetch_seq = itertools.count()
        track(self)

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

    def host_rows(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``[rows, head_dim]``: the rows as a lookup in ``dtype`` returns them, unchanged, when they lie in
        this process's host memory as such (a copy of row ``i`` is the lookup of id ``i``), with unit
        column stride; else None. Tiers that check their backing file on every lookup give None."""
        return None

    def start_prefetch(self, ids: torch.Tensor, dtype: torch.dtype, *, check: bool = True) -> PrefetchHandle:
        """Start ``lookup(ids, dtype)`` in the background; ``handle.wait()`` returns its rows.

        Bad ids raise here, at the start. See :mod:`ple.table.lookup.prefetch` for the buffer rules.
        """
        self._check_call(ids, dtype, check)
        with self._engine_lock:
            if self._engine is None:
                self._engine = PrefetchEngine(
                    type(self).__name__,
                    self.head_dim,
                    self._lookup_into,
                    self._gathers_on_device,
                    max(2, int(self.prefetch_depth)),
                )
            engine = self._engine
        return engine.start(ids, dtype, next(self._prefetch_seq))

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
        return False

    @abc.abstractmethod
    def _lookup_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Write the rows of (already checked) ``ids [T, G]`` into ``out [T, G*head_dim]`` on the ids' device."""


class StoredTable(Table):
    """A table whose rows are all readable here: ``data [rows, head_dim]`` in the storage dtype and
    ``scale`` (None, ``[1]`` or ``[rows, 1]`` fp32). Lookups gather from them. For a block format
    ``data`` is ``[rows, row_nbytes]`` bytes (see :mod:`ple.table.formats.blocks`)."""

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
        return self.data.device

    @property
    def global_scale(self) -> torch.Tensor | None:
        return self.scale if format_info(self.format).scale_kind == "global" else None

    @property
    def nbytes(self) -> int:
        n = self.rows * format_info(self.format).row_nbytes(self.head_dim)
        s = self.scale
        return n + (0 if s is None else s.numel() * s.element_size())

    def _gathers_on_device(self, device: torch.device) -> bool:
        """Whether a lookup for ids on ``device`` runs there (a CUDA kernel) rather than on the host."""
        data = self.data
        return device.type == "cuda" and (data.device == device or (data.device.type == "cpu" and data.is_pinned()))

    def _lookup_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Write the rows of (already checked) ``ids [T, G]`` into ``out [T, G*head_dim]`` on the ids' device."""
        data, scale = self.data, self.scale
        dev = out.device
        if dev.type == "cpu" and scale is None and data.dtype == out.dtype and data.device.type == "cpu":
            # plain rows in the activation dtype on the host: the copy alone (what gather_dequant runs)
            gather_rows(data, ids.reshape(-1), out=out.view(-1, data.shape[1]))
            return
        if data.device == dev or self._gathers_on_device(dev):
            gather_dequant(data, scale, ids.to(dev), out.dtype, out=out, check=False, format=self.format)
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
            dequantize_rows_into(rows, srows, out.view(-1, self.head_dim), format=self.format)
        else:
            res = gather_dequant(data, scale, ids.to(data.device), out.dtype, check=False, format=self.format)
            out.copy_(res)


def require_stored(table: Table, what: str) -> StoredTable:
    """``table`` as a :class:`StoredTable`, or :class:`~ple.errors.ArgumentTypeError` saying that ``what``
    needs rows readable in this process (a table sharded across ranks has none)."""
    if not isinstance(table, StoredTable):
        raise ArgumentTypeError(
            f"{what} reads the table's rows directly, which a {type(table).__name__} does not hold in this "
            "process (only lookup() is available)"
        )
    return table


# ---------------------------------------------------------------------------------------------- operator

try:  # opaque reference objects (torch >= 2.10): the table passes through compiled code untouched
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:  # pragma: no cover - older torch: the operator still runs eagerly
    OpaqueBase = object  # type: ignore[assignment,misc]
    register_opaque_type = None  # type: ignore[assignment]


class TableRef(OpaqueBase):
    """A mutable reference to a :class:`Table` (or None until one is set), handed to
    ``torch.ops.ple.table_lookup``. Compiled and exported programs hold the reference, not the
    table: assigning ``ref.table`` switches what they read, without recompiling. ``adapters``: the
    named adapters served over the table (:class:`ple.table.tiers.named.NamedAdapters`, or None),
    which a lookup given ``adapter_indices`` reads per sequence."""

    def __init__(self, table: Table | None = None) -> None:
        self.table = table
        self.adapters: Any = None  # ple.table.tiers.named.NamedAdapters (a higher module: not imported here)

    def __repr__(self) -> str:
        return f"TableRef({self.table!r})"


def adapter_choice(adapter_indices, query_start_loc, tokens: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The sequences' adapters ``[R]`` and token starts ``[R+1]`` as host int64 arrays, checked against
    each other and the lookup's ``tokens`` ids: ``adapter_indices`` int64 ``[R]``, each -1 (the default)
    or an adapter's index; ``query_start_loc`` int64 ``[R+1]`` from 0 to ``tokens``, non-decreasing.
    None when no sequence names an adapter. :class:`InvalidArgumentError` naming what disagrees."""
    for name, t in (("adapter_indices", adapter_indices), ("query_start_loc", query_start_loc)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
            raise InvalidArgumentError(f"table_lookup: {name} must be a 1-D int64 tensor, got {got}")
    r = adapter_indices.shape[0]
    if query_start_loc.shape[0] != r + 1:
        raise InvalidArgumentError(
            f"table_lookup: {r} adapter indices need query_start_loc of {r + 1} offsets, got {query_start_loc.shape[0]}"
        )
    chosen = adapter_indices.to("cpu").numpy()
    if not r or int(chosen.max()) < 0:
        return None
    if int(chosen.min()) < -1:
        raise InvalidArgumentError(
            f"table_lookup: adapter index {int(chosen.min())} (an adapter's index, or -1 for the default)"
        )
    starts = query_start_loc.to("cpu").numpy()
    if starts[0] != 0 or starts[-1] != tokens or bool((np.diff(starts) < 0).any()):
        raise InvalidArgumentError(
            f"table_lookup: query_start_loc {starts.tolist()} must run from 0 to the {tokens} ids' tokens, non-decreasing"
        )
    return chosen, starts


def with_adapters(
    ref: TableRef, ids: torch.Tensor, rows: torch.Tensor, adapter_indices, query_start_loc
) -> torch.Tensor:
    """``rows [T, G*D]`` read for ``ids [T, G]`` from ``ref.table``, with the named adapters' rows put in
    place for the sequences ``adapter_indices [R]`` (-1: none) names (``query_start_loc [R+1]`` says
    which tokens are whose; both checked by :func:`adapter_choice`); ``rows`` itself when no sequence
    names one."""
    if adapter_indices is None:
        return rows
    choice = adapter_choice(adapter_indices, query_start_loc, ids.shape[0])
    if choice is None:
        return rows
    named = ref.adapters
    if named is None:
        raise InvalidArgumentError(
            f"table_lookup: adapter index {int(choice[0].max())} names an adapter, but the table serves none"
        )
    named.apply(ref.table, ids, rows, *choice)
    return rows


def _lookup_reference(
    ids: torch.Tensor, ref: TableRef, head_dim: int, dtype: torch.dtype, adapter_indices=None, query_start_loc=None
) -> torch.Tensor:
    """The literal lookup of a table whose rows are readable here (a :class:`StoredTable`), the named
    adapters' rows put in place (:func:`with_adapters`)."""
    table = require_stored(ref.table, "the reference lookup")  # type: ignore[arg-type]
    rows = gather_dequant_reference(table.data, table.scale, ids, dtype, format=table.format)
    return with_adapters(ref, ids, rows, adapter_indices, query_start_loc)


def _lookup_fake(
    ids: torch.Tensor, ref, head_dim: int, dtype: torch.dtype, adapter_indices=None, query_start_loc=None
) -> torch.Tensor:
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise InvalidArgumentError(f"table_lookup: ids must be int64 [T, G], got {ids.dtype} {tuple(ids.shape)}")
    return ids.new_empty((ids.shape[0], ids.shape[1] * head_dim), dtype=dtype)


def _lookup_checked(
    ids: torch.Tensor, ref: TableRef, head_dim: int, dtype: torch.dtype, adapter_indices=None, query_start_loc=None
) -> torch.Tensor:
    """The operator's work: ``head_dim`` must be the table's, ``ids`` int64 ``[T, G]``; ids in host
    memory are also checked against the table's rows (no synchronization), ids on an accelerator
    are not read. With ``adapter_indices [R]`` (and ``query_start_loc [R+1]``), the sequences that
    name an adapter read its rows (:func:`with_adapters`)."""
    table = ref.table
    if table is None:
        raise InvalidArgumentError("table_lookup: the TableRef holds no table")
    if head_dim != table.head_dim:
        raise InvalidArgumentError(f"table_lookup: head_dim={head_dim}, but the table's rows are {table.head_dim} wide")
    if isinstance(ids, torch.Tensor) and ids.device.type == "cpu" and ids.dim() == 2 and ids.dtype == torch.int64:
        n = ids.numel()
        if n:
            if n <= 64:  # a decode step's few ids: a list is the cheapest pass
                flat = ids.reshape(-1).tolist()
                lo, hi = min(flat), max(flat)
            else:
                lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or hi >= table.rows:
                check_ids(ids, table.rows)  # raises, naming the id and where it is
    if adapter_indices is not None:  # checked before the table is read
        adapter_choice(adapter_indices, query_start_loc, ids.shape[0])
    return with_adapters(ref, ids, table.lookup(ids, dtype, check=False), adapter_indices, query_start_loc)


if register_opaque_type is not None:
    # hoist: Inductor's FX graph cache keys a reference by its type alone (it is an input of the program,
    # never baked in), rather than pickling the table it holds (a whole table; a trainable one refuses)
    register_opaque_type(TableRef, typ="reference", hoist=True)
    register(
        f"table_lookup(Tensor ids, {TableRef.__module__}.TableRef table, int head_dim, ScalarType dtype, "
        "Tensor? adapter_indices=None, Tensor? query_start_loc=None) -> Tensor",
        reference=_lookup_reference,
        kernels=(Kernel("table", "cpu", _lookup_checked), Kernel("table", "cuda", _lookup_checked)),
        fake=_lookup_fake,
    )


def lookup_built(
    ids: torch.Tensor, ref: TableRef, head_dim: int, dtype: torch.dtype, adapter_indices=None, query_start_loc=None
) -> torch.Tensor:
    """The lookup of ids a layer's own kernel computed from its layout (so inside the table's rows,
    which the layer checked against that layout when it took the table): the operator's work without
    its checks, for ``ple.Session``'s steps (which checked that the layer holds a table)."""
    table = ref.table
    assert table is not None
    return with_adapters(ref, ids, table.lookup(ids, dtype, check=False), adapter_indices, query_start_loc)


def lookup_through(
    ids: torch.Tensor, ref: TableRef, head_dim: int, dtype: torch.dtype, adapter_indices=None, query_start_loc=None
) -> torch.Tensor:
    """``torch.ops.ple.table_lookup(ids, ref, head_dim, dtype, adapter_indices, query_start_loc)``; on a
    torch without opaque reference types the operator does not exist and the table is called directly
    (eager only)."""
    if register_opaque_type is not None:
        if adapter_indices is None:
            return torch.ops.ple.table_lookup(ids, ref, head_dim, dtype)
        return torch.ops.ple.table_lookup(ids, ref, head_dim, dtype, adapter_indices, query_start_loc)
    return _lookup_checked(ids, ref, head_dim, dtype, adapter_indices, query_start_loc)
