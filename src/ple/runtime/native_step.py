"""The engine call on the CPU as direct C calls: ids, row gather, the GEMM, the fused step.

On the CPU, eagerly, :meth:`ple.PLELayer.forward` runs this instead of its operators: the C kernels the
operators would choose (``ple_ngram_ids``, ``ple_gather_rows`` for plain rows in the activation dtype
held in memory, ``ple_gate_conv``) called straight from here, with the weights' and layout's pointers
taken once when the layer's weights or table change. The operators' Python layers (records, kernel
choice, argument conversion: about a hundred calls a step) are not run; each of those costs tens of
microseconds right after the GEMM, whose weights leave every cache cold.

What is checked stays checked. An engine's call (prebuilt batches) has its shapes and dtypes checked by
the layer and its tokens and n-gram context range-checked here (``vocab_size``), as the ids operator
would; the kernels refuse offsets, slots and histories outside the pool before writing anything.
``ple.Session`` builds every operand itself (the batch from its own state, tokens it range-checked,
``hidden [T, HC*H]`` checked in the layer's dtype), so its call (the private ``_checked=False``) skips
the range check too.

The same kernels on the same operands give the same bits as the operators (tested). A table of another
tier or format is read through its own lookup (``Table.lookup(check=False)``); anything the kernels do
not take here (a column-strided hidden, a C library turned off with ``PLE_NATIVE=0``) makes
:meth:`NativeStep.__call__` return None, and the layer then runs its operators.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ple.errors import InvalidArgumentError
from ple.kernels import native as _native
from ple.kernels.registry import OPERATORS
from ple.ngram import check_token_range
from ple.ops.fused import native as fused_native
from ple.ops.records import StepMeta
from ple.table.base import lookup_built, lookup_through, with_adapters

__all__ = ["NativeStep", "eager_on_cpu", "operators_for"]

_DTYPES = {torch.bfloat16: 1, torch.float32: 0}
_GATHER_ROWS_PER_THREAD = 256  # the row gather's second thread joins from 512 rows (as the lookup's)
_KEPT_TOKENS = 256
"""Steps of up to this many tokens (decode steps, small chunks) reuse the native step's scratch buffers
(the row ids, the gathered rows and the conv inputs a step does not return); longer ones allocate theirs."""


class NativeStep:
    """One layer's CPU engine call through the C kernels (see the module). Build it with :meth:`build`
    after the layer's weights are derived; :meth:`__call__` runs one step."""

    __slots__ = (
        "_layer",
        "_lib",
        "_ids_fn",
        "_gather_fn",
        "_fused_fn",
        "_ids_args",
        "_fused_args",
        "_groups",
        "_embed",
        "_channels",
        "_dtype",
        "_eos",
        "_table",
        "_table_args",
        "_value_offset",
        "_scratch",
    )

    def __init__(self, layer) -> None:
        cfg, lay = layer.config, layer.layout
        mult, sizes, offs = layer.ngram_multipliers, layer.ngram_head_sizes, layer.ngram_head_offsets
        self._layer = weakref.ref(layer)  # the layer holds this step: no reference cycle keeps it alive
        self._lib: Any = None
        self._ids_fn: Any = None
        self._gather_fn: Any = None
        self._fused_fn: Any = None
        # ple_ngram_ids(tokens, T, starts, R, context, | order, heads_per_ngram, mult, sizes, offs, | eos, out, threads)
        self._ids_args = (mult.shape[0], lay.heads_per_ngram, mult.data_ptr(), sizes.data_ptr(), offs.data_ptr())
        self._eos = int(cfg.eos_token_id)
        self._groups = sizes.shape[0]
        self._embed = lay.embed_dim
        self._channels = cfg.hc_hidden_size
        self._dtype = layer.dtype
        taps = layer.conv_taps
        # ple_gate_conv(bf, T, | H, HC, K, dilation, | L, S, R, | eps, ..., | key_query, conv_scale, taps, ...)
        self._fused_args: tuple = (
            cfg.hidden_size,
            cfg.hc_count,
            taps.shape[0],
            cfg.ngram_size,
            float(cfg.rms_norm_eps),
            layer.gate_key_query.data_ptr(),
            layer.gate_conv_scale.data_ptr(),
            taps.data_ptr(),
        )
        self._value_offset = cfg.hc_hidden_size * (2 if layer.dtype == torch.bfloat16 else 4)  # bytes into a kv row
        self._table: Any = None
        self._table_args: tuple | None = None
        self._scratch: _Scratch | None = None

    @classmethod
    def build(cls, layer) -> NativeStep | None:
        """The native step of ``layer`` (a :class:`ple.PLELayer` whose weights are derived and on the CPU:
        the layer asks only then), or None where the kernels do not take it: an activation dtype other
        than bfloat16 and float32, more conv taps than the kernel holds. The C library is loaded (built)
        at the first call."""
        if layer.dtype not in _DTYPES or layer.conv_taps.shape[0] > fused_native.MAX_TAPS:
            return None
        return cls(layer)

    def _gather_args(self, table) -> tuple | None:
        """``(data pointer, rows, row stride in bytes, row bytes)`` for the C row gather, when ``table``
        gives its rows as a lookup in the activation dtype returns them (:meth:`Table.host_rows`); else
        None (its own lookup reads it)."""
        data = table.host_rows(self._dtype)
        if data is None:
            return None
        esize = data.element_size()
        return (data.data_ptr(), data.shape[0], data.stride(0) * esize, data.shape[1] * esize)

    def __call__(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        batch,
        add_hidden: bool,
        return_c: bool,
        vocab_size: int | None = None,
    ):
        """``hidden + v + conv`` ``[T, HC*H]`` (and the conv inputs ``[T, HC*H]`` with ``return_c``) for the
        step ``(hidden [T, HC*H], input_ids [T] int64, batch)``, with every tensor on the CPU; the state
        pool is updated in place. None (nothing computed, nothing changed) where the kernels do not take
        these operands.

        ``vocab_size``: the tokens and the n-gram context are checked to lie in ``[0, vocab_size)`` first
        (the engine call's check, as the ids operator's; a session's tokens were checked by the session).
        The kernels themselves refuse offsets, slots and histories outside the pool before any write."""
        try:
            lib = _native.library()  # PLE_NATIVE=0 takes effect at once, as for the operators
        except _native.NativeUnavailable:
            return None
        if lib is not self._lib:
            self._lib = lib
            self._ids_fn, self._gather_fn, self._fused_fn = lib.ple_ngram_ids, lib.ple_gather_rows, lib.ple_gate_conv
        qsl, ctx, pool = batch.query_start_loc, batch.ngram_context, batch.conv_state
        slots, has_init, rejected, offsets = (
            batch.slot_indices,
            batch.has_initial_state,
            batch.num_rejected,
            batch.state_offsets,
        )
        if not (
            hidden.stride(1) == 1
            and pool.dtype == self._dtype
            and pool.is_contiguous()
            and input_ids.dtype == qsl.dtype == ctx.dtype == slots.dtype == torch.int64
            and has_init.dtype == torch.bool
            and (rejected is None or rejected.dtype == torch.int64)
            and input_ids.is_contiguous()
            and qsl.is_contiguous()
            and ctx.is_contiguous()
            and slots.is_contiguous()
            and has_init.is_contiguous()
            and (rejected is None or rejected.is_contiguous())
        ):
            return None
        # the shapes the kernels index by (a session's step has them by construction): refused, never read
        tokens, requests, channels = hidden.shape[0], (qsl.shape[0] if qsl.dim() == 1 else 0) - 1, self._channels
        ring = offsets is not None
        if not (
            hidden.dim() == 2
            and hidden.shape[1] == channels
            and input_ids.shape == (tokens,)
            and ctx.shape == (requests, self._ids_args[0] - 1)
            and slots.shape == has_init.shape == (requests,)
            and (rejected is None or rejected.shape == (requests,))
            and pool.dim() == 3
            and pool.shape[2 if ring else 1] == channels
            and (not ring or offsets.shape == (pool.shape[0],))
        ):
            raise InvalidArgumentError(
                f"native step: hidden {tuple(hidden.shape)}, input_ids {tuple(input_ids.shape)}, query_start_loc "
                f"{tuple(qsl.shape)}, ngram_context {tuple(ctx.shape)}, slots {tuple(slots.shape)}, conv_state "
                f"{tuple(pool.shape)} disagree (expected hidden [T, HC*H={channels}], input_ids [T], [R] per "
                "request, a [S, C, L] pool or a [S, L, C] ring with [S] offsets)"
            )
        layer = self._layer()
        if layer is None:
            return None
        if vocab_size is not None and (
            lib.ple_first_outside(input_ids.data_ptr(), tokens, vocab_size) >= 0
            or lib.ple_first_outside(ctx.data_ptr(), ctx.numel(), vocab_size) >= 0
        ):
            check_token_range(input_ids, ctx, vocab_size)  # raises, naming the value and where it is
        table = layer.table_ref.table
        if table is not self._table:
            self._table, self._table_args = table, self._gather_args(table)
        threads, team = torch.get_num_threads(), _native.team()
        # scratch this call alone holds (a call on another thread meanwhile makes its own)
        kept, self._scratch = self._scratch, None
        scratch = kept
        if scratch is None or not scratch.fits(tokens, return_c):
            scratch = _Scratch(tokens, self._groups, self._embed, self._channels, self._dtype, return_c)
        try:
            rc = self._ids_fn(
                input_ids.data_ptr(), tokens, qsl.data_ptr(), requests, ctx.data_ptr(), *self._ids_args, self._eos,
                scratch.ids_at, threads,
            )  # fmt: skip
            if rc != 0:
                what = f"query_start_loc is not 0 .. T={tokens}, non-decreasing" if rc == -3 else f"code {rc}"
                raise InvalidArgumentError(f"ngram_ids (C kernel): {what}")
            if self._table_args is not None:
                n = tokens * self._groups
                gthreads = _native.threads_for(n, _GATHER_ROWS_PER_THREAD, threads=threads, kind=team)
                rc = self._gather_fn(*self._table_args, scratch.ids_at, n, scratch.rows_at, gthreads)
                if rc != 0:  # an id outside the table: the layout and the table disagree
                    raise InvalidArgumentError(f"table lookup (C gather): code {rc} for rows of {table!r}")
                rows = scratch.rows[:tokens]
            else:
                rows = table.lookup(scratch.ids[:tokens], self._dtype, check=False)
            if batch.adapter_indices is not None:  # the requests that name an adapter read its rows
                rows = with_adapters(layer.table_ref, scratch.ids[:tokens], rows, batch.adapter_indices, qsl)
            # the outputs first: the first PyTorch call after the GEMM would find the dispatcher's caches
            # empty (tens of microseconds); after it only attribute reads and the kernel's call remain
            out = torch.empty((tokens, self._channels), dtype=self._dtype)
            c = torch.empty((tokens, self._channels), dtype=self._dtype) if return_c else None
            kv = layer.projections(rows)  # key: its first HC*H columns, value: the H after them
            state_len = pool.shape[1] if offsets is not None else pool.shape[2]
            unit, kthreads = fused_native.launch(tokens, self._channels, threads, team)
            h, hc, k, dilation, eps, kq, cs, taps = self._fused_args
            key, kv_stride = kv.data_ptr(), kv.stride(0)
            rc = self._fused_fn(
                _DTYPES[self._dtype], tokens, h, hc, k, dilation, state_len, pool.shape[0], requests, eps,
                key, kv_stride, key + self._value_offset, kv_stride, hidden.data_ptr(), hidden.stride(0),
                kq, cs, taps, qsl.data_ptr(), slots.data_ptr(), has_init.data_ptr(),
                None if rejected is None else rejected.data_ptr(), None,
                pool.data_ptr(), None if offsets is None else offsets.data_ptr(), int(add_hidden), None, None, 0,
                out.data_ptr(), scratch.c_at if c is None else c.data_ptr(), int(bool(return_c)), unit, kthreads,
            )  # fmt: skip
            if rc != 0:
                step = StepMeta(qsl, pool, slots, has_init, rejected, offsets)
                fused_native.raise_for_code(rc, step, (k - 1) * dilation, state_len)
        finally:
            self._scratch = scratch if scratch.kept else kept
        return (out, c) if return_c else out


class _Scratch:
    """A step's buffers that never leave it: the row ids ``[T, G]`` int64, the gathered rows ``[T, E]``
    and the conv inputs ``[T, HC*H]`` of a step that does not return them (the kernel writes the rows
    a state update reads there), with their addresses. Kept by the native step between calls when made
    for at most :data:`_KEPT_TOKENS` tokens (room for twice the step, up to that many)."""

    __slots__ = ("tokens", "kept", "ids", "rows", "c", "ids_at", "rows_at", "c_at")

    def __init__(self, tokens: int, groups: int, embed: int, channels: int, dtype: torch.dtype, return_c: bool):
        self.kept = tokens <= _KEPT_TOKENS
        self.tokens = n = min(_KEPT_TOKENS, 2 * tokens) if self.kept else tokens
        self.ids = torch.empty((n, groups), dtype=torch.int64)
        self.rows = torch.empty((n, embed), dtype=dtype)
        self.c = None if return_c else torch.empty((n, channels), dtype=dtype)
        self.ids_at, self.rows_at = self.ids.data_ptr(), self.rows.data_ptr()
        self.c_at = 0 if self.c is None else self.c.data_ptr()

    def fits(self, tokens: int, return_c: bool) -> bool:
        """Whether a step of ``tokens`` tokens can use these buffers."""
        return tokens <= self.tokens and (return_c or self.c is not None)


# ---------------------------------------------------------------------------------------------- the operators
_CPU = torch.device("cpu")
_DISPATCH_STACK = getattr(torch._C, "_len_torch_dispatch_stack", None)


def _dispatch_modes() -> int:
    """How many dispatch modes are active (fake tensors, tracing); a torch without the count is
    taken to have one, so the engine call then always goes through the operators."""
    return 1 if _DISPATCH_STACK is None else _DISPATCH_STACK()


def eager_on_cpu(layer, hidden: torch.Tensor, input_ids: torch.Tensor, batch, token_mask) -> bool:
    """Whether the engine call runs eagerly with every operand on the CPU: plain tensors, no profiler,
    no dispatch mode, not compiling (so the operators' CPU functions may be called directly)."""
    return not (
        torch.compiler.is_compiling()
        or type(hidden) is not torch.Tensor
        or hidden.device.type != "cpu"
        or not layer._on_cpu
        or input_ids.device.type != "cpu"
        or batch.ngram_context.device.type != "cpu"
        or batch.slot_indices.device.type != "cpu"
        or batch.has_initial_state.device.type != "cpu"
        or (batch.num_rejected is not None and batch.num_rejected.device.type != "cpu")
        or (batch.state_offsets is not None and batch.state_offsets.device.type != "cpu")
        or (token_mask is not None and token_mask.device.type != "cpu")
        or getattr(torch.autograd.profiler, "_is_profiler_enabled", True)
        or _dispatch_modes()
        or "table_lookup" not in OPERATORS
    )


def operators_for(eager_cpu: bool, checked: bool = True) -> tuple:
    """The ids, lookup and fused operators as the engine call runs them.

    Eagerly with every operand on the CPU (``eager_cpu``, see :func:`eager_on_cpu`; the CPU functions'
    checks skip the devices): the functions the dispatcher would run for CPU tensors
    (:meth:`ple.kernels.registry.Operator.on`: the same checks and kernels, without the dispatcher's few
    microseconds per call), or with ``checked=False`` the kernels alone
    (:meth:`~ple.kernels.registry.Operator.kernel_on`, :func:`~ple.table.base.lookup_built`). Otherwise the
    ``torch.ops.ple`` operators themselves (compiled and exported code, other devices, tensor
    subclasses, profiles that show each operator)."""
    if not eager_cpu:
        return torch.ops.ple.ngram_ids, lookup_through, torch.ops.ple.gate_conv
    if not checked:
        return OPERATORS["ngram_ids"].kernel_on(_CPU), lookup_built, OPERATORS["gate_conv"].kernel_on(_CPU)
    return OPERATORS["ngram_ids"].on(_CPU), OPERATORS["table_lookup"].on(_CPU), OPERATORS["gate_conv"].on(_CPU)
