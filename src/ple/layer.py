"""``PLELayer``: n-gram ids -> table lookup -> projections -> gate -> dilated conv -> new hidden.

The layer owns its weights and a table handle (any tier); it owns no per-request state. The
engine-level call takes a :class:`ple.runtime.Batch` that carries the packed metadata and the state
pool; :meth:`PLELayer.forward_padded` is the training-style call that returns what transformers'
module returns, with autograd, through the literal reference ops.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from .config import PLEConfig
from .errors import InvalidArgumentError, UsageError
from .ngram import ngram_ids
from .ops.fused import gate_conv
from .ops.gate import reference as gate_reference
from .runtime.batch import Batch
from .table import StoredTable

__all__ = ["PLELayer"]


class PLELayer(nn.Module):
    """One PLE layer.

    Args:
        config: the model's :class:`PLEConfig`.
        ple_layer_index: which PLE layer (0 = the first entry of ``ple_layer_ids``); selects the
            hash multipliers and primes.
        dtype: activation and weight dtype.
        table: a :class:`ple.table.Table` (memory, memory-mapped, pinned host, sharded); may be set
            later with :meth:`set_table` or by a loader.

    Parameters: ``key_proj [HC*H, E]``, ``value_proj [H, E]``, ``norm_key/norm_query/norm_conv
    [HC*H]``, ``conv_weight [HC*H, K]``.
    """

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
        kw = {"dtype": dtype, "device": device}
        self.key_proj = nn.Parameter(torch.zeros(c, e, **kw))
        self.value_proj = nn.Parameter(torch.zeros(h, e, **kw))
        self.norm_key = nn.Parameter(torch.zeros(c, **kw))
        self.norm_query = nn.Parameter(torch.zeros(c, **kw))
        self.norm_conv = nn.Parameter(torch.zeros(c, **kw))
        self.conv_weight = nn.Parameter(torch.zeros(c, k, **kw))
        self.table = None
        if table is not None:
            self.set_table(table)

    # ------------------------------------------------------------------ construction
    @property
    def dtype(self) -> torch.dtype:
        return self.key_proj.dtype

    def set_table(self, table) -> None:
        """Attach a table of any tier; its geometry must match the layout."""
        if table.rows != self.layout.padded_rows or table.head_dim != self.layout.head_dim:
            raise InvalidArgumentError(
                f"table is [{table.rows}, {table.head_dim}] but PLE layer {self.ple_layer_index} needs "
                f"[{self.layout.padded_rows}, {self.layout.head_dim}]"
            )
        self.table = table

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
        memory (e.g. ``MmapTable.open(...)`` of a file made by ``ple convert``).
        """
        from .checkpoint import load_ple_weights

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
        from .table import MemoryTable

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

    # ------------------------------------------------------------------ engine call
    def _require_table(self):
        if self.table is None:
            raise UsageError(f"PLE layer {self.ple_layer_index} has no table: load a checkpoint or call set_table()")
        return self.table

    def ngram_ids(self, input_ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``[T, G]`` int64 row ids of the batch (what :meth:`start_prefetch` and the lookup read)."""
        return ngram_ids(input_ids, batch.query_start_loc, batch.ngram_context, self.layout, self.config.eos_token_id)

    def start_prefetch(self, input_ids: torch.Tensor, batch: Batch):
        """Start this batch's table lookup early; pass the handle to ``forward(..., prefetched=)``."""
        return self._require_table().start_prefetch(self.ngram_ids(input_ids, batch), self.dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        batch: Batch,
        *,
        prefetched=None,
        return_conv_input: bool = False,
        token_mask: torch.Tensor | None = None,
        add_hidden: bool = True,
    ):
        """New hidden state ``hidden + v + conv``, ``[T, HC*H]``, for a packed batch.

        Args:
            hidden: ``[T, HC*H]`` layer input (activation dtype = the layer's dtype).
            input_ids: ``[T]`` tokens.
            batch: step metadata and the state pool (updated in place).
            prefetched: a handle from ``table.start_prefetch`` for these ids (skips the lookup).
            return_conv_input: also return the conv inputs ``c [T, HC*H]`` (for prefix checkpoints).
            token_mask: ``[T]`` bool/0-1, False for padding tokens: their ``v`` and conv input are
                zeroed (as transformers masks padded positions); their ids should already read EOS.
            add_hidden: False returns ``v + conv`` (what transformers' module returns) instead.
        """
        if torch.is_grad_enabled() and hidden.requires_grad:
            raise UsageError(
                "the engine call is inference-only (it updates the state pool in place); "
                "use forward_padded() for gradients"
            )
        with torch.no_grad():
            return self._forward(hidden, input_ids, batch, prefetched, return_conv_input, token_mask, add_hidden)

    def _forward(self, hidden, input_ids, batch, prefetched, return_conv_input, token_mask, add_hidden):
        cfg = self.config
        if hidden.dim() != 2 or hidden.shape[1] != cfg.hc_hidden_size:
            raise InvalidArgumentError(f"hidden must be [T, HC*H={cfg.hc_hidden_size}], got {tuple(hidden.shape)}")
        if input_ids.shape != (hidden.shape[0],):
            raise InvalidArgumentError(f"input_ids must be [T={hidden.shape[0]}], got {tuple(input_ids.shape)}")
        if hidden.dtype != self.dtype:
            raise InvalidArgumentError(f"hidden is {hidden.dtype} but the layer computes in {self.dtype}")
        if batch.num_tokens != hidden.shape[0]:
            raise InvalidArgumentError(f"batch covers {batch.num_tokens} tokens, hidden has {hidden.shape[0]}")
        if prefetched is not None:
            emb = prefetched.wait()
            kv = F.linear(emb, self._kv_weight())
            prefetched.release()
        else:
            emb = self._require_table().lookup(self.ngram_ids(input_ids, batch), self.dtype)
            kv = F.linear(emb, self._kv_weight())
        key, value = kv.split([cfg.hc_hidden_size, cfg.hidden_size], dim=1)
        return gate_conv(
            key,
            value,
            hidden,
            self.norm_key,
            self.norm_query,
            self.norm_conv,
            cfg.rms_norm_eps,
            cfg.hc_count,
            self.conv_weight,
            cfg.ngram_size,
            batch.query_start_loc,
            batch.conv_state,
            batch.slot_indices,
            batch.has_initial_state,
            batch.num_rejected,
            token_mask=token_mask,
            add_hidden=add_hidden,
            return_conv_input=return_conv_input,
        )

    def _kv_weight(self) -> torch.Tensor:
        """``[HC*H + H, E]``: key and value projections as one GEMM (cached until weights change)."""
        key = (self.key_proj._version, self.value_proj._version, self.key_proj.data_ptr(), self.value_proj.data_ptr())
        cached = getattr(self, "_kv_cache", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                w = torch.cat([self.key_proj, self.value_proj], dim=0)
            self._kv_cache = (key, w)
            return w
        return cached[1]

    # ------------------------------------------------------------------ training-style call
    def forward_padded(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        return_conv_input: bool = False,
    ):
        """What transformers' ``Qwen4ExpTextPLELayer`` returns (``v + conv``, ``[B, S, HC*H]``) for
        fresh sequences, through the literal reference ops, with autograd.

        ``attention_mask [B, S]`` (1 = token, 0 = padding, e.g. left padding): padded positions read
        as EOS for the ids and are zeroed before the conv, as transformers does.
        ``return_conv_input=True`` also returns the conv inputs ``c [B, S, HC*H]``.
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
        table = self._require_table()
        if isinstance(table, StoredTable) and table.format in ("bf16", "fp16", "fp32"):
            emb = F.embedding(ids, table.data).to(self.dtype).reshape(b * s, -1)  # differentiable w.r.t. the table
        else:
            emb = table.lookup(ids, self.dtype)
        key = F.linear(emb, self.key_proj)
        value = F.linear(emb, self.value_proj)
        v, c = gate_reference.ngram_gate(
            key,
            value,
            hidden.reshape(b * s, -1),
            self.norm_key,
            self.norm_query,
            self.norm_conv,
            cfg.rms_norm_eps,
            cfg.hc_count,
        )
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


def _divisor_of(emb) -> int:
    """The padding divisor a transformers embedding was built with (smallest power of two that fits)."""
    rows = emb.ngram_embedding.weight.shape[0]
    total = int(emb.ngram_heads_vocab_sizes.sum())
    for d in (128, 64, 32, 16, 8, 4, 2, 1):
        if rows % d == 0 and math.ceil(total / d) * d == rows:
            return d
    return 1
