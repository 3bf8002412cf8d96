"""``PLELayer``: n-gram ids -> table lookup -> projections -> gate -> dilated conv -> new hidden.

The layer owns its weights and a table reference (any tier); it owns no per-request state. The
engine call ``layer(hidden, input_ids, batch)`` takes a :class:`ple.runtime.Batch` that carries the
packed metadata and the state pool; :meth:`PLELayer.forward_padded` is the training-style call that
returns what transformers' module returns, with autograd, through the literal reference ops.

The engine call is the hot path of a serving engine, written for ``torch.compile(fullgraph=True)``,
``torch.export`` and CUDA graphs: the ids, the lookup and the fused step are ``torch.ops.ple``
operators (eagerly on the CPU their CPU functions are called without the dispatcher, see
:func:`ple.runtime.native_step.operators_for`); checks run outside compiled code and read only shapes, dtypes and host-side
values (never device data: no host synchronization); the weights the kernels read (the key and value
projections as one ``[HC*H + H, E]`` matrix, the gate's and the conv's fp32 factors) are buffers
derived when weights load or change; the table is an opaque reference (never a graph constant).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from ple.config import PLEConfig
from ple.errors import InvalidArgumentError, UsageError
from ple.kernels import cpu_gemm
from ple.ngram import layout_tensors, ngram_ids
from ple.ops import library as ops_library
from ple.ops.gate import reference as gate_reference
from ple.ops.padded_grad import gate_conv_padded
from ple.ops.records import ConvWeights, GateWeights, derive_conv_taps, derive_gate_factors
from ple.runtime.batch import Batch
from ple.runtime.native_step import NativeStep, eager_on_cpu, operators_for
from ple.table import StoredTable
from ple.table.base import TableRef, lookup_through, with_adapters
from ple.table.files.table_file import hash_layout
from ple.table.grad import RECORDED_LOOKUP, lookup_with_grad, recorded_lookup

__all__ = ["PLELayer"]

_PARAMS = ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv_weight")
_DERIVED = (
    "kv_weight",
    "gate_key_query",
    "gate_conv_scale",
    "conv_taps",
    "ngram_multipliers",
    "ngram_head_sizes",
    "ngram_head_offsets",
)
"""The buffers :meth:`PLELayer.refresh_weights` derives from the parameters and the layout (not saved)."""

# Rows of a CPU GEMM in fp32 are identical whatever the other rows only when the row count is a
# multiple of this (measured on AVX-512 + AMX with 1-16 threads: other small counts take tail
# kernels that sum in another order). bf16 rows were identical at every count tried.
_ROW_BLOCK = 4

# the fused operator's state offsets for the engine layout (unread there)
_NO_OFFSETS = torch.empty(0, dtype=torch.int64)
_GRAD_ALREADY_OFF = contextlib.nullcontext()  # entering no_grad costs tens of microseconds a step


class PLELayer(nn.Module):
    """One PLE layer.

    Args:
        config: the model's :class:`PLEConfig`.
        ple_layer_index: which PLE layer (0 = the first entry of ``ple_layer_ids``); selects the
            hash multipliers and primes.
        dtype: activation and weight dtype.
        table: a :class:`ple.table.Table` (memory, memory-mapped, pinned host, sharded, cached); may
            be set later with :meth:`set_table` or by a loader.

    Parameters: ``key_proj [HC*H, E]``, ``value_proj [H, E]``, ``norm_key/norm_query/norm_conv
    [HC*H]``, ``conv_weight [HC*H, K]``. Derived buffers (not saved): ``kv_weight [HC*H + H, E]``,
    ``gate_key_query``, ``gate_conv_scale`` ``[HC*H]`` fp32, ``conv_taps [K, HC*H]`` fp32, and the
    layout's ``ngram_multipliers [N]``, ``ngram_head_sizes``, ``ngram_head_offsets`` ``[G]`` int64.
    They follow in-place changes of the parameters on the next eager call (``kv_weight`` and its packed
    copy only when a projection changed) and at once through :meth:`refresh_weights` (everything; also
    after changes through ``.data``, which no version counter sees); code compiled with
    ``torch.compile`` reads them as they are, so call :meth:`refresh_weights` after changing weights
    under a compiled program. A layer pickles (``torch.save``, ``multiprocessing``) with its table when
    the table does (see :class:`ple.table.Table`), and may be built and run inside
    ``torch.inference_mode()``: its parameters and buffers are plain tensors there too.
    """

    written_backward: bool = True
    """fp32 training calls of :meth:`forward_padded` run the gate and conv as one autograd node with a
    written-out backward (:mod:`ple.ops.padded_grad`: the same gradients within fp32 rounding, a few
    dozen operations instead of about a hundred); False: autograd through the reference ops."""

    kv_weight: torch.Tensor
    gate_key_query: torch.Tensor
    gate_conv_scale: torch.Tensor
    conv_taps: torch.Tensor
    ngram_multipliers: torch.Tensor
    ngram_head_sizes: torch.Tensor
    ngram_head_offsets: torch.Tensor

    def __init__(
        self,
        config: PLEConfig,
        ple_layer_index: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        table=None,
    ):
        super().__init__()
        self.config = config
        self.ple_layer_index = ple_layer_index
        self.layout = config.layout(ple_layer_index)
        c, h, e, k = config.hc_hidden_size, config.hidden_size, config.ple_embed_dim, config.ple_conv_kernel_size
        self._kv_widths = (c, h)  # the key and value columns of the projections' result
        # plain tensors even inside torch.inference_mode(): the derived buffers follow the parameters'
        # version counters, which inference tensors do not have
        with torch.inference_mode(False):
            self.key_proj = nn.Parameter(torch.zeros(c, e, dtype=dtype, device=device))
            self.value_proj = nn.Parameter(torch.zeros(h, e, dtype=dtype, device=device))
            self.norm_key = nn.Parameter(torch.zeros(c, dtype=dtype, device=device))
            self.norm_query = nn.Parameter(torch.zeros(c, dtype=dtype, device=device))
            self.norm_conv = nn.Parameter(torch.zeros(c, dtype=dtype, device=device))
            self.conv_weight = nn.Parameter(torch.zeros(c, k, dtype=dtype, device=device))
        self._table_ref = TableRef()
        self._table_data_grad = False  # set_table: a stored fp table whose data requires grad
        self._table_weight: tuple[nn.Parameter | None] = (None,)
        self._seen: tuple = ()
        self.refresh_weights()
        if table is not None:
            self.set_table(table)

    # ------------------------------------------------------------------ construction
    @property
    def dtype(self) -> torch.dtype:
        return self.key_proj.dtype

    @property
    def table(self):
        """The attached :class:`ple.table.Table` (None until one is set)."""
        return self._table_ref.table

    @table.setter
    def table(self, table) -> None:
        if table is None:
            self._table_ref.table = None
            self._table_data_grad = False
        else:
            self.set_table(table)

    def set_table(self, table) -> None:
        """Attach a table of any tier.

        Its geometry must match the layout. A table that carries a layout hash (a memory-mapped
        table file, a sharded or cached table over one) must carry this layer's
        (``hash_layout(config.layout_fields(ple_layer_index))``): a table of another PLE layer with
        the same row count is refused. Tiers without one (tensors in memory) are taken on their
        geometry: the caller vouches for their rows.
        """
        if table.rows != self.layout.padded_rows or table.head_dim != self.layout.head_dim:
            raise InvalidArgumentError(
                f"table is [{table.rows}, {table.head_dim}] but PLE layer {self.ple_layer_index} needs "
                f"[{self.layout.padded_rows}, {self.layout.head_dim}]"
            )
        carried = _carried_layout_hash(table)
        if carried is not None:
            want = hash_layout(self.config.layout_fields(self.ple_layer_index))
            if carried != want:
                raise InvalidArgumentError(
                    f"table {table!r} was built for another layout (layout hash {carried[:16]}...) than PLE "
                    f"layer {self.ple_layer_index} of this config ({want[:16]}...): a table of another layer "
                    "or model"
                )
        self._table_ref.table = table
        self._table_data_grad = (
            isinstance(table, StoredTable) and table.format in ("bf16", "fp16", "fp32") and table.data.requires_grad
        )

    @property
    def table_weight(self) -> nn.Parameter | None:
        """The table's gradient handle (None: the table is frozen, the default).

        An ``nn.Parameter`` of the table's shape ``[rows, head_dim]`` fp32 holding one stored zero
        (:func:`ple.table.grad.table_parameter`), kept out of :meth:`parameters` and the state
        dict. While it requires a gradient, :meth:`forward_padded` records the lookup for autograd and
        ``backward()`` gives it the row-sparse gradient (a sparse COO tensor: the distinct rows read and
        their summed gradients) on every tier and format; the engine call never reads it.
        ``ple.train.trainable`` sets it (:meth:`set_table_weight`), with an overlay the optimizers write
        trained rows to."""
        return self._table_weight[0]

    def set_table_weight(self, weight: nn.Parameter | None) -> None:
        """Set :attr:`table_weight` (a ``[rows, head_dim]`` handle, or None to freeze the table)."""
        if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() != 2):
            raise InvalidArgumentError(f"table_weight must be a [rows, head_dim] parameter or None, got {weight!r}")
        self._table_weight = (weight,)  # a tuple: not registered as a parameter

    @property
    def table_ref(self) -> TableRef:
        """The reference the lookup operator reads (the same object for the layer's lifetime)."""
        return self._table_ref

    def load_weights(self, weights) -> None:
        """Take a :class:`ple.checkpoint.PLEWeights` (all tensors already validated)."""
        if weights.layout != self.layout:
            raise InvalidArgumentError(
                f"weights are for PLE layer {weights.ple_layer_index} with a different layout than this layer's "
                f"(ple_layer_index={self.ple_layer_index})"
            )
        with torch.no_grad():
            for name in ("key_proj", "value_proj", "norm_key", "norm_query", "norm_conv"):
                getattr(self, name).copy_(getattr(weights, name))
            self.conv_weight.copy_(weights.conv1d)
        self.refresh_weights()
        self.set_table(weights.table)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike,
        config: PLEConfig | None = None,
        ple_layer_index: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        progress: bool = False,
        table=None,
    ) -> PLELayer:
        """Load one PLE layer from a safetensors checkpoint (file, directory or index).

        ``table``: a table of any tier to use instead of reading the checkpoint's table into
        memory (e.g. ``MmapTable.open(...)`` of a file made by ``ple convert``); checked as
        :meth:`set_table` checks it.
        """
        from ple.checkpoint import load_ple_weights

        if config is None:
            config = PLEConfig.from_pretrained(path if os.path.isdir(path) else os.path.dirname(path))
        weights = load_ple_weights(
            path, config, layers=[ple_layer_index], device=device, progress=progress, with_table=table is None
        )[ple_layer_index]
        layer = cls(config, ple_layer_index, dtype=dtype, device=device)
        if table is not None:
            weights.table = table
        layer.load_weights(weights)
        return layer

    @classmethod
    def from_transformers(cls, module, config: PLEConfig | None = None) -> PLELayer:
        """Copy a transformers ``Qwen4ExpTextPLELayer`` (weights and table) into a ple layer.

        The table is shared with the module (no copy) as a plain in-memory table.
        """
        from ple.table import MemoryTable

        emb = module.ple_embedding
        if config is None:
            config = PLEConfig(
                hidden_size=module.hidden_size,
                eos_token_id=int(emb.eos_token_id),
                vocab_size=emb.unigram_vocab_size,
                hc_count=module.hc_count,
                ple_embed_dim=emb.ngram_heads * emb.ngram_embedding.weight.shape[1],
                ngram_size=emb.ngram_size,
                heads_per_ngram=emb.heads_per_ngram,
                ngram_vocab_size_base=emb.ngram_vocab_size_base,
                make_ngram_vocab_size_divisible_by=_divisor_of(emb),
                ple_conv_kernel_size=module.conv1d.weight.shape[-1],
                seed=emb.seed,
                rms_norm_eps=module.norm_key.eps,
                ple_layer_ids=tuple(range(1, emb.ple_layer_index + 2)),
            )
        idx = emb.ple_layer_index
        dtype = module.key_proj.weight.dtype
        layer = cls(config, idx, dtype=dtype, device=module.key_proj.weight.device)
        lay = layer.layout
        for name, buf, want in (
            ("layer_multipliers", emb.layer_multipliers, lay.multipliers),
            ("ngram_heads_vocab_sizes", emb.ngram_heads_vocab_sizes, lay.head_sizes),
            ("ngram_heads_offsets", emb.ngram_heads_offsets, lay.head_offsets),
        ):
            if tuple(buf.tolist()) != tuple(want):
                raise InvalidArgumentError(
                    f"module buffer {name} = {buf.tolist()} differs from the layout's {list(want)}"
                )
        with torch.no_grad():
            layer.key_proj.copy_(module.key_proj.weight)
            layer.value_proj.copy_(module.value_proj.weight)
            layer.norm_key.copy_(module.norm_key.weight)
            layer.norm_query.copy_(module.norm_query.weight)
            layer.norm_conv.copy_(module.norm_conv.weight)
            layer.conv_weight.copy_(module.conv1d.weight.reshape(config.hc_hidden_size, -1))
        layer.refresh_weights()
        layer.set_table(MemoryTable(emb.ngram_embedding.weight.data))
        return layer

    def new_state_pool(self, slots: int, num_spec: int = 0, device=None) -> torch.Tensor:
        """A zeroed conv state pool ``[slots, HC*H, (K-1)*N + num_spec]`` in the layer's dtype."""
        return torch.zeros(
            slots,
            self.config.hc_hidden_size,
            self.config.conv_window + num_spec,
            dtype=self.dtype,
            device=self.key_proj.device if device is None else device,
        )

    def new_ring_pool(self, slots: int, num_spec: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed conv state pool in the ring layout: ``(pool [slots, (K-1)*N + num_spec, HC*H]``, ``offsets
        [slots]`` int64 zeros``)``, for :meth:`ple.runtime.Batch.build` as ``conv_state=pool,
        state_offsets=offsets`` (the step updates both in place).

        A slot holds the same columns as in :meth:`new_state_pool`'s layout, one ``[HC*H]`` row per column,
        column ``j`` of slot ``s`` in row ``(offsets[s] + j) % L``: a decode step writes one row per request
        instead of moving every channel's whole window (for 64 requests at the published geometry in
        bf16, 1.3 MB written instead of 11.8 MB read and written). :func:`ple.ops.state.ring_to_engine` and
        :func:`~ple.ops.state.engine_to_ring` convert between the two exactly."""
        dev = self.key_proj.device if device is None else device
        width = self.config.conv_window + num_spec
        pool = torch.zeros(slots, width, self.config.hc_hidden_size, dtype=self.dtype, device=dev)
        return pool, torch.zeros(slots, dtype=torch.int64, device=dev)

    # ------------------------------------------------------------------ derived weights
    def _param_stamp(self) -> tuple:
        # read directly: nn.Module.__getattr__ per name cost a few microseconds a call
        ps: dict[str, torch.Tensor] = self._parameters  # type: ignore[assignment]
        try:
            return tuple((p._version, p.data_ptr(), p.dtype, p.device) for p in [ps[n] for n in _PARAMS])
        except RuntimeError:  # an inference tensor has no version counter
            bad = [n for n in _PARAMS if ps[n].is_inference()]
            if not bad:
                raise
            raise UsageError(
                f"parameters {bad} are inference tensors (assigned inside torch.inference_mode()): the layer "
                "cannot tell when they change in place; copy values into its parameters "
                "(layer.key_proj.copy_(w)) or assign plain tensors"
            ) from None

    def refresh_weights(self) -> None:
        """Recompute the derived buffers (``kv_weight``, the gate's and conv's fp32 factors, the
        layout tensors) from the parameters, in place when their shapes and dtypes allow (so compiled
        programs that read them see the new values)."""
        with torch.inference_mode(False):  # plain buffers even inside inference mode (later copies into them)
            self._refresh_weights(keep_kv=False)

    def _follow_params(self, stamp: tuple) -> None:
        """What the eager call runs when the parameters' stamp changed: :meth:`refresh_weights`, except that
        ``kv_weight`` (and its packed copy) stays when neither projection changed (a norm or the conv did)."""
        kv = self._buffers.get("kv_weight")
        keep_kv = kv is not None and not kv.is_inference() and stamp[:2] == self._seen[:2]
        with torch.inference_mode(False):
            self._refresh_weights(keep_kv=keep_kv)

    def _refresh_weights(self, keep_kv: bool) -> None:
        with torch.no_grad():
            kv = self.kv_weight if keep_kv else torch.cat([self.key_proj.detach(), self.value_proj.detach()], dim=0)
            kq, cs = derive_gate_factors(self.norm_key, self.norm_query, self.norm_conv)
            taps = derive_conv_taps(self.conv_weight)
            dev = self.key_proj.device
            lay = layout_tensors(self.layout, dev)
        for name, value in (
            *((("kv_weight", kv),) if not keep_kv else ()),
            ("gate_key_query", kq),
            ("gate_conv_scale", cs),
            ("conv_taps", taps),
            ("ngram_multipliers", lay[0]),
            ("ngram_head_sizes", lay[1]),
            ("ngram_head_offsets", lay[2]),
        ):
            old = self._buffers.get(name)
            if (
                old is not None
                and old.shape == value.shape
                and old.dtype == value.dtype
                and old.device == value.device
                and not old.is_inference()
            ):
                with torch.no_grad():
                    old.copy_(value)
            else:
                self.register_buffer(name, value.clone(), persistent=False)
        cfg = self.config
        # the fused operator's weight arguments in its schema's order, for the eager engine call
        self._fused_args = (
            self.norm_key,
            self.norm_query,
            self.norm_conv,
            self.gate_key_query,
            self.gate_conv_scale,
            cfg.rms_norm_eps,
            cfg.hc_count,
            self.conv_weight,
            self.conv_taps,
            cfg.ngram_size,
        )
        derived = (self.kv_weight, self.ngram_multipliers, self.ngram_head_sizes, self.ngram_head_offsets)
        self._on_cpu = all(t.device.type == "cpu" for t in (*self._fused_args[:5], *self._fused_args[7:9], *derived))
        # the projections' weight packed for the CPU's GEMM (ple.kernels.cpu_gemm), or None (F.linear)
        kv_packed: cpu_gemm.PackedWeight | None = None
        if self.kv_weight.device.type == "cpu" and cpu_gemm.packing(self.kv_weight.dtype):
            kv_packed = getattr(self, "_kv_packed", None) or cpu_gemm.PackedWeight()
            kv_packed.get(self.kv_weight)  # packs unless this very weight is packed already
        self._kv_packed = kv_packed
        self._native_step: NativeStep | None = NativeStep.build(self) if self._on_cpu else None
        self._seen = self._param_stamp()

    def _apply(self, fn, recurse=True):
        with torch.inference_mode(False):  # .to() inside inference mode: plain tensors still (see __init__)
            out = super()._apply(fn, recurse)
        self.refresh_weights()  # .to(dtype) converts buffers too; the factors stay fp32
        return out

    def __getstate__(self) -> dict:
        # pickling (torch.save(layer), multiprocessing, deepcopy) leaves out what unpickling derives again
        # (refresh_weights): the native step (a weak reference to this layer, pointers into its buffers)
        # and the derived buffers (kv_weight alone is as large as the projections)
        state = super().__getstate__()  # nn.Module's: without a compiled call of this very module
        state["_native_step"] = state["_fused_args"] = None
        state["_table_weight"] = (None,)  # a copy's table is frozen until it is made trainable again
        state["_buffers"] = {k: v for k, v in state["_buffers"].items() if k not in _DERIVED}
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("_table_weight", (None,))
        super().__setstate__(state)
        with torch.inference_mode(False):  # a copy made inside inference mode: plain parameters (see __init__)
            for name, p in self._parameters.items():
                if p is not None and p.is_inference():
                    self._parameters[name] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        self.refresh_weights()

    @property
    def gate_weights(self) -> GateWeights:
        """The gate's record (parameters and derived factors; no copy)."""
        cfg = self.config
        return GateWeights(
            self.norm_key,
            self.norm_query,
            self.norm_conv,
            cfg.rms_norm_eps,
            cfg.hc_count,
            self.gate_key_query,
            self.gate_conv_scale,
        )

    @property
    def conv_weights(self) -> ConvWeights:
        """The conv's record (parameters and derived taps; no copy)."""
        return ConvWeights(self.conv_weight, self.config.ngram_size, self.conv_taps)

    # ------------------------------------------------------------------ engine call
    def _require_table(self):
        if self._table_ref.table is None:
            raise UsageError(f"PLE layer {self.ple_layer_index} has no table: load a checkpoint or call set_table()")
        return self._table_ref.table

    def ngram_ids(self, input_ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``[T, G]`` int64 row ids of the batch (what :meth:`start_prefetch` and the lookup read); checked."""
        return ngram_ids(input_ids, batch.query_start_loc, batch.ngram_context, self.layout, self.config.eos_token_id)

    def start_prefetch(self, input_ids: torch.Tensor, batch: Batch):
        """Start this batch's table lookup early; pass the handle to ``forward(..., prefetched=)``.

        The handle is bound to this layer, ``input_ids`` and the batch's offsets and contexts (the
        tensor objects, unmodified): the engine call refuses it for anything else."""
        table = self._require_table()
        handle = table.start_prefetch(self.ngram_ids(input_ids, batch), self.dtype)
        handle.bind(self, input_ids, batch.query_start_loc, batch.ngram_context)
        return handle

    def project(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value projections of table rows ``emb [T, E]`` as one GEMM: ``(key [T, HC*H],
        value [T, H])``, views of :meth:`projections`' ``[T, HC*H + H]`` result."""
        key, value = self.projections(emb).split_with_sizes(self._kv_widths, 1)  # both views in one call
        return key, value

    def projections(self, emb: torch.Tensor) -> torch.Tensor:
        """``[T, HC*H + H]``: the key (first ``HC*H`` columns) and value projections of table rows
        ``emb [T, E]``, one GEMM.

        Each output row is its own input row's projection, whatever the other rows. Whether its last
        bits also match the whole batch's GEMM is the CPU's GEMM's choice: on the CPU an fp32 (or fp16)
        GEMM is padded with zero rows to a multiple of 4 rows, where PyTorch's GEMM on an AMD EPYC (AVX2,
        AVX-512) no longer depends on the row count (a decode step's GEMM reads the weights either way;
        bf16 needs no padding there); on an Intel Xeon with AMX, GEMMs of a few rows (fp32 on one
        thread, bf16 on one or four) are blocked otherwise and can differ from it in the last bit, so
        sequence parallelism (:mod:`ple.parallel.sequence`) projects the whole batch's rows on every rank.

        A bf16 GEMM on the CPU of at most :func:`ple.kernels.cpu_gemm.max_rows` rows (any number with AVX-512
        BF16 and no AMX, else 255) multiplies with a copy of the weight packed once for oneDNN where
        ``PLE_PACKED_GEMM`` has it on (by default on CPUs with AMX or AVX-512 BF16): 1.25-1.8 x faster
        with AMX, 1.04-1.3 x with AVX-512 BF16 alone, with ``F.linear``'s bits.
        """
        w = self.kv_weight
        if not isinstance(emb, torch.Tensor) or emb.dim() != 2 or emb.shape[1] != w.shape[1] or emb.dtype != w.dtype:
            raise InvalidArgumentError(
                f"emb must be [T, E={w.shape[1]}] {w.dtype}, got {tuple(getattr(emb, 'shape', ()))} "
                f"{getattr(emb, 'dtype', type(emb).__name__)}"
            )
        tokens = emb.shape[0]
        packed = self._kv_packed
        if packed is not None and emb.device.type == "cpu" and cpu_gemm.use_packed(emb, packed):
            return cpu_gemm.linear(emb, w, packed)
        if emb.device.type == "cpu" and emb.dtype != torch.bfloat16:
            # traced code pads whatever T is (a branch on T would specialize an unbacked size)
            if torch.compiler.is_compiling() or tokens % _ROW_BLOCK:
                emb = F.pad(emb, (0, 0, 0, (-tokens) % _ROW_BLOCK))
            return F.linear(emb, w)[:tokens]
        return F.linear(emb, w)

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        batch: Batch,
        *,
        prefetched=None,
        rows: torch.Tensor | None = None,
        return_conv_input: bool = False,
        token_mask: torch.Tensor | None = None,
        add_hidden: bool = True,
        _checked: bool = True,
    ):
        """New hidden state ``hidden + v + conv``, ``[T, HC*H]``, for a packed batch.

        Args:
            hidden: ``[T, HC*H]`` layer input (activation dtype = the layer's dtype).
            input_ids: ``[T]`` tokens.
            batch: step metadata and the state pool (updated in place), from :meth:`Batch.build`
                (validated there; here only shapes and dtypes are checked, never device values).
            prefetched: a handle from :meth:`start_prefetch` for these ids and this batch (skips the
                lookup; waited and released here, so not inside compiled code: pass ``rows`` there).
            rows: the table rows ``[T, G*head_dim]`` of these ids, already looked up.
            return_conv_input: also return the conv inputs ``c [T, HC*H]`` (for prefix states).
            token_mask: ``[T]`` bool/0-1, False for padding tokens: their ``v`` and conv input are
                zeroed (as transformers masks padded positions); their ids should already read EOS.
            add_hidden: False returns ``v + conv`` (what transformers' module returns) instead.
        """
        if torch.is_grad_enabled() and hidden.requires_grad:
            raise UsageError(
                "the engine call is inference-only (it updates the state pool in place); "
                "use forward_padded() for gradients"
            )
        if torch.compiler.is_compiling():
            if prefetched is not None:
                raise UsageError("wait a prefetch handle outside compiled code and pass its rows as rows=")
            # no torch.no_grad() here: a compiled graph that raises inside one (a refused token) would leave
            # grad mode off; the operators are not differentiable, so the output records nothing anyway
            return self._step(hidden, input_ids, batch, rows, token_mask, add_hidden, return_conv_input)
        # _checked=False: ple.Session's call only. It built every operand itself from inputs it checked
        # (its batch from its own state, range-checked tokens, hidden [T, HC*H] in the layer's dtype), so
        # the argument checks and the operators' checks on the CPU are skipped; devices are still looked
        # at (anything off the CPU goes through the checked operators) and changed weights picked up.
        if _checked:
            with ops_library.named_range("ple.check"):
                self._check_call(hidden, input_ids, batch, rows, token_mask)
        if prefetched is not None and rows is not None:
            raise InvalidArgumentError("give prefetched= or rows=, not both")
        stamp = self._param_stamp()
        if self._seen != stamp:
            self._follow_params(stamp)
        if prefetched is not None:
            prefetched.check_bound(self, input_ids, batch.query_start_loc, batch.ngram_context)
            rows = prefetched.wait()
            if batch.adapter_indices is not None:  # the prefetch read the layer's table: named adapters on top
                rows = with_adapters(
                    self._table_ref, prefetched.ids, rows, batch.adapter_indices, batch.query_start_loc
                )
        elif rows is None:
            self._require_table()
        try:
            with torch.no_grad() if torch.is_grad_enabled() else _GRAD_ALREADY_OFF:
                return self._step(
                    hidden, input_ids, batch, rows, token_mask, add_hidden, return_conv_input, bool(_checked)
                )
        finally:
            if prefetched is not None:
                prefetched.release()

    def _check_call(self, hidden, input_ids, batch, rows, token_mask) -> None:
        """Shapes, dtypes and host-side counts only (no device values: nothing synchronizes)."""
        cfg = self.config
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[1] != cfg.hc_hidden_size:
            raise InvalidArgumentError(
                f"hidden must be [T, HC*H={cfg.hc_hidden_size}], got {tuple(getattr(hidden, 'shape', ()))}"
            )
        tokens = hidden.shape[0]
        if not isinstance(input_ids, torch.Tensor) or input_ids.shape != (tokens,):
            raise InvalidArgumentError(f"input_ids must be [T={tokens}], got {tuple(getattr(input_ids, 'shape', ()))}")
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise InvalidArgumentError(f"input_ids must be int32 or int64, got {input_ids.dtype}")
        if hidden.dtype != self.dtype:
            raise InvalidArgumentError(f"hidden is {hidden.dtype} but the layer computes in {self.dtype}")
        if not isinstance(batch, Batch):
            raise InvalidArgumentError(f"batch must be a ple.runtime.Batch, got {type(batch).__name__}")
        batch.check_for(hidden, cfg.hc_hidden_size, cfg.ngram_size - 1)
        if rows is not None and (rows.shape != (tokens, self.layout.embed_dim) or rows.dtype != self.dtype):
            raise InvalidArgumentError(
                f"rows must be [T, E] = ({tokens}, {self.layout.embed_dim}) {self.dtype}, got "
                f"{tuple(rows.shape)} {rows.dtype}"
            )
        if rows is not None and batch.adapter_indices is not None:
            raise InvalidArgumentError(
                "rows= are used as given, but the batch names adapters per request (adapter_indices): let the "
                "layer read its table (or prefetch with start_prefetch)"
            )
        if token_mask is not None and token_mask.shape != (tokens,):
            raise InvalidArgumentError(f"token_mask must be [T={tokens}], got {tuple(token_mask.shape)}")

    def _step(self, hidden, input_ids, batch, rows, token_mask, add_hidden, return_conv_input, checked=True):
        """The hot path: operators only, no host synchronization (``torch.compile``-able); ``checked=False``
        runs the CPU kernels without the operators' checks (``ple.Session``'s calls, see :meth:`forward`)."""
        eager_cpu = eager_on_cpu(self, hidden, input_ids, batch, token_mask)
        if eager_cpu and rows is None and token_mask is None and self._native_step is not None:
            # the C kernels called directly (None: they do not take these operands). A checked call (an
            # engine's) has its shapes and dtypes checked; its tokens are range-checked there, and the
            # kernels refuse offsets, slots and histories outside the pool, as the operators would
            vocab = self.config.vocab_size if checked else None
            got = self._native_step(hidden, input_ids, batch, add_hidden, return_conv_input, vocab)
            if got is not None:
                return got
        ids_op, lookup_op, fused_op = operators_for(eager_cpu, checked)
        if rows is None:
            with ops_library.named_range("ple.ids"):
                ids = ids_op(
                    input_ids,
                    batch.query_start_loc,
                    batch.ngram_context,
                    self.ngram_multipliers,
                    self.ngram_head_sizes,
                    self.ngram_head_offsets,
                    self.layout.heads_per_ngram,
                    self.config.eos_token_id,
                    self.config.vocab_size,  # token values checked where they are in host memory
                )
            with ops_library.named_range("ple.lookup"):
                if batch.adapter_indices is None:
                    rows = lookup_op(ids, self._table_ref, self.layout.head_dim, hidden.dtype)
                else:  # the sequences that name an adapter read its rows
                    rows = lookup_op(
                        ids, self._table_ref, self.layout.head_dim, hidden.dtype, batch.adapter_indices,
                        batch.query_start_loc,
                    )  # fmt: skip
        with ops_library.named_range("ple.gemm"):
            key, value = self.project(rows)
        with ops_library.named_range("ple.gate_conv"):
            if torch.compiler.is_compiling():
                return ops_library.gate_conv(
                    key,
                    value,
                    hidden,
                    self.gate_weights,
                    self.conv_weights,
                    batch.step_meta(),
                    token_mask=token_mask,
                    add_hidden=add_hidden,
                    return_conv_input=return_conv_input,
                    validate=False,
                )
            # eagerly the operator takes the arguments kept since the weights last changed (no records)
            offsets = batch.state_offsets
            ring = offsets is not None
            out, c = fused_op(
                key, value, hidden, *self._fused_args, batch.query_start_loc, batch.conv_state, batch.slot_indices,
                batch.has_initial_state, batch.num_rejected, offsets if ring else _NO_OFFSETS, ring, token_mask,
                add_hidden, return_conv_input,
            )  # fmt: skip
            return (out, c) if return_conv_input else out

    # ------------------------------------------------------------------ training-style call
    @torch.compiler.disable
    def _padded_lookup(self, ids: torch.Tensor, weight: nn.Parameter | None) -> torch.Tensor:
        """The rows of ``ids [B*S, G]`` for :meth:`forward_padded`, recorded for autograd: the row-sparse
        gradient of a trainable table's handle, or ``F.embedding``'s of a stored fp table's data. Under
        ``torch.compile`` it runs eagerly (one graph break) for a stored fp table's data only: compiled
        code takes a trainable table's lookup whole (``torch.ops.ple.table_lookup_grad``)."""
        table = self._require_table()
        if weight is not None and weight.requires_grad and torch.is_grad_enabled():
            return lookup_with_grad(table, ids, self.dtype, weight)  # the table's row-sparse gradient
        if isinstance(table, StoredTable) and table.format in ("bf16", "fp16", "fp32"):
            return (
                F.embedding(ids, table.data).to(self.dtype).reshape(ids.shape[0], -1)
            )  # differentiable w.r.t. the table
        return table.lookup(ids, self.dtype)

    def _table_records_grad(self, weight: nn.Parameter | None) -> bool:
        """Whether compiled code must record this call's lookup for autograd: a trainable table's
        handle (the lookup operator whose backward records its row-sparse gradient), or a stored fp
        table whose data required grad when it was set (``patch(table_grad=True)``: looked up eagerly,
        one graph break), in grad mode. Read from plain attributes: compiled code cannot look inside
        the table reference."""
        if not torch.is_grad_enabled():
            return False
        return (weight is not None and weight.requires_grad) or self._table_data_grad

    def _gate_conv_grad(self) -> bool:
        return any(p.requires_grad for p in (self.norm_key, self.norm_query, self.norm_conv, self.conv_weight))

    def forward_padded(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        return_conv_input: bool = False,
        adapter_indices: torch.Tensor | None = None,
    ):
        """What transformers' ``Qwen4ExpTextPLELayer`` returns (``v + conv``, ``[B, S, HC*H]``) for
        fresh sequences, through the literal reference ops, with autograd (recording an fp32 step, the
        gate and conv are one node with a written-out backward: see :attr:`written_backward`).

        ``attention_mask [B, S]`` (1 = token, 0 = padding, e.g. left padding): padded positions read
        as EOS for the ids and are zeroed before the conv, as transformers does.
        ``return_conv_input=True`` also returns the conv inputs ``c [B, S, HC*H]``.
        ``adapter_indices [B]`` int64: the named adapter each row reads (-1: the default; see
        :class:`ple.runtime.Batch`), for a table that records no gradient.
        """
        cfg = self.config
        b, s, width = hidden.shape
        if width != cfg.hc_hidden_size or input_ids.shape != (b, s):
            raise InvalidArgumentError(
                f"hidden must be [B, S, {cfg.hc_hidden_size}] and input_ids [B, S]; got {tuple(hidden.shape)}, "
                f"{tuple(input_ids.shape)}"
            )
        ids_in = input_ids.long()
        if attention_mask is not None:
            ids_in = torch.where(attention_mask.bool(), ids_in, cfg.eos_token_id)
        flat = ids_in.reshape(-1)
        qsl = torch.arange(0, b * s + 1, s, dtype=torch.int64, device=flat.device)
        ctx = torch.full((b, cfg.ngram_size - 1), cfg.eos_token_id, dtype=torch.int64, device=flat.device)
        ids = ngram_ids(flat, qsl, ctx, self.layout, cfg.eos_token_id)
        weight = self._table_weight[0]
        if adapter_indices is not None and self._table_records_grad(weight):
            raise UsageError("named adapters are served, not trained: freeze the table (or run under torch.no_grad())")
        if torch.compiler.is_compiling() and not self._table_records_grad(weight):
            # the table by reference
            emb = lookup_through(
                ids, self._table_ref, self.layout.head_dim, self.dtype, adapter_indices,
                None if adapter_indices is None else qsl,
            )  # fmt: skip
        elif torch.compiler.is_compiling() and RECORDED_LOOKUP and weight is not None and weight.requires_grad:
            # one node; its backward gives the handle the row-sparse gradient, as the eager lookup does
            emb = recorded_lookup(ids, self._table_ref, weight, self.layout.head_dim, self.dtype)
        else:
            emb = self._padded_lookup(ids, weight)
            if adapter_indices is not None:
                emb = with_adapters(self._table_ref, ids, emb, adapter_indices, qsl)
        key = F.linear(emb, self.key_proj)
        value = F.linear(emb, self.value_proj)
        if (
            self.written_backward
            and torch.is_grad_enabled()
            and key.dtype == value.dtype == hidden.dtype == torch.float32
            and (key.requires_grad or value.requires_grad or hidden.requires_grad or self._gate_conv_grad())
        ):
            out, c = gate_conv_padded(
                key, value, hidden.reshape(b * s, -1), self.gate_weights, self.conv_weight, cfg.ngram_size, (b, s),
                attention_mask,
            )  # fmt: skip
            return (out, c) if return_conv_input else out
        v, c = gate_reference.ngram_gate(key, value, hidden.reshape(b * s, -1), self.gate_weights)
        v = v.reshape(b, s, -1)
        c = c.reshape(b, s, -1)
        if attention_mask is not None:
            m = attention_mask[:, :, None]
            v = (v * m).to(v.dtype)
            c = (c * m).to(c.dtype)
        window = cfg.conv_window
        x = F.pad(c.transpose(1, 2), (window, 0))
        conv = F.conv1d(x, self.conv_weight.unsqueeze(1), groups=cfg.hc_hidden_size, dilation=cfg.ngram_size)
        out = v + F.silu(conv).transpose(1, 2)
        return (out, c) if return_conv_input else out


def _carried_layout_hash(table) -> str | None:
    """The layout hash a table carries (its own, or its backing table's), or None."""
    seen = 0
    while table is not None and seen < 8:
        h = getattr(table, "layout_hash", None)
        if isinstance(h, str) and h:
            return h
        table = getattr(table, "backing", None)
        seen += 1
    return None


def _divisor_of(emb) -> int:
    """The padding divisor a transformers embedding was built with (smallest power of two that fits)."""
    rows = emb.ngram_embedding.weight.shape[0]
    total = int(emb.ngram_heads_vocab_sizes.sum())
    for d in (128, 64, 32, 16, 8, 4, 2, 1):
        if rows % d == 0 and math.ceil(total / d) * d == rows:
            return d
    return 1
