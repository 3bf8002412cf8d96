"""The module ple puts in place of transformers' ``Qwen4ExpTextPLELayer``: :class:`PatchedPLELayer`.

Same call signature ``(hidden_states, input_ids, cache, conv_mask=None)``, same result (``v + conv``,
``[B, S, HC*H]``) and same weights, computed by :class:`ple.PLELayer` over a table of any tier; its
state dict uses transformers' names for the weights and the checkpoint's names for the table (see
:mod:`ple.integrations.transformers` for how models are patched, loaded and saved).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ple.convert.folder import PreparedTable
from ple.errors import InvalidArgumentError, UsageError
from ple.integrations.qwen4_exp import (
    TableStub,
)
from ple.integrations.row_adapters import current_row_adapters
from ple.integrations.table_state import (
    TRAINED_KEYS,
    load_trained,
    table_state,
    trained_state,
    weight_from_table,
)
from ple.layer import PLELayer
from ple.runtime.batch import PREFILL, Batch
from ple.table import MemoryTable
from ple.table.tiers.adapted import AdaptedTable
from ple.train.attach import default_spill_dir

# transformers' names of a PLE module's weights -> the PLELayer parameter holding them
DENSE = {
    "key_proj.weight": "key_proj",
    "value_proj.weight": "value_proj",
    "norm_key.weight": "norm_key",
    "norm_query.weight": "norm_query",
    "norm_conv.weight": "norm_conv",
    "conv1d.weight": "conv_weight",
}


TABLE_PREFIX = "ple_embedding.ngram_embedding."


BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


class PatchedPLELayer(nn.Module):
    """Drop-in for transformers' ``Qwen4ExpTextPLELayer``, backed by a :class:`ple.PLELayer`.

    Attributes:
        layer: the :class:`ple.PLELayer` (weights copied from the original module, table of any tier).
        layer_idx: the decoder layer index (the cache slot the original used).
        original: the replaced transformers module (kept for :func:`~ple.integrations.transformers.unpatch`, not a submodule).
        table_path: the table file (``"mmap"``/``"cached"`` tiers), else None.
        prepared: how :func:`~ple.integrations.transformers.from_pretrained` obtained the table file (reused, verified, converted), else None.
        table_weight: the table parameter when patched with ``table_grad=True`` (else not set).
    """

    def __init__(self, layer: PLELayer, layer_idx: int, original: nn.Module, table_path: Path | None = None):
        super().__init__()
        self.layer = layer
        self.layer_idx = layer_idx
        self.table_path = table_path
        self.prepared: PreparedTable | None = None
        # A plain tuple keeps the original out of parameters(), state_dict() and .to().
        self._original = (original,)
        self._released_weight: tuple[nn.Parameter, torch.device] | None = None
        self._table_dir: tempfile.TemporaryDirectory | None = None
        self.register_state_dict_post_hook(hf_state_dict)
        self.register_load_state_dict_pre_hook(load_hf_state_dict)

    @property
    def original(self) -> nn.Module:
        return self._original[0]

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, ple_layer_index={self.layer.ple_layer_index}, table={self.layer.table!r}"

    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        cache=None,
        conv_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """``v + conv`` ``[B, S, HC*H]`` for ``hidden_states [B, S, HC*H]`` and ``input_ids [B, S]``.

        ``cache``: a transformers ``Cache`` (read and updated as the original module does) or None
        (fresh sequences, nothing stored). ``conv_mask [B, S]``: 1 = token, 0 = padding.
        ``kwargs``: what the decoder layer passes on to every submodule (``output_router_logits``,
        ``position_ids``, ...; transformers >= 5.25 passes them to this module too); the layer
        needs none of them and ignores them.

        With autograd recording (a call outside ``torch.no_grad()``), fresh sequences run through
        :meth:`ple.PLELayer.forward_padded` (the differentiable reference ops); continuing a cache
        with autograd is refused.
        """
        layer = self.layer
        cfg = layer.config
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != cfg.hc_hidden_size:
            raise InvalidArgumentError(
                f"hidden_states must be [B, S, HC*H={cfg.hc_hidden_size}], got {tuple(hidden_states.shape)}"
            )
        b, s, width = hidden_states.shape
        if input_ids is None or tuple(input_ids.shape) != (b, s):
            got = None if input_ids is None else tuple(input_ids.shape)
            raise InvalidArgumentError(f"input_ids must be [B, S] = [{b}, {s}] (the PLE token ids), got {got}")
        if conv_mask is not None and tuple(conv_mask.shape) != (b, s):
            raise InvalidArgumentError(f"conv_mask must be [B, S] = [{b}, {s}], got {tuple(conv_mask.shape)}")
        if s == 0:
            return hidden_states.new_zeros(b, 0, width)
        device = hidden_states.device
        ids = input_ids.long().to(device)
        chosen = current_row_adapters()  # ple_adapters= of the model call: an adapter per row
        if chosen is not None and chosen.shape[0] != b:
            raise InvalidArgumentError(f"ple_adapters names {chosen.shape[0]} rows, but the batch has {b}")
        mask = None if conv_mask is None else conv_mask.to(device)

        # Read both states before anything is written (update_conv_state writes in place).
        cached_ctx = cache.get_conv_state(self.layer_idx, state_idx=2) if cache is not None else None
        cached_conv = cache.get_conv_state(self.layer_idx, state_idx=1) if cache is not None else None
        trained_table = layer.table_weight is not None and layer.table_weight.requires_grad
        if torch.is_grad_enabled() and (
            hidden_states.requires_grad or trained_table or any(p.requires_grad for p in layer.parameters())
        ):
            if cached_ctx is not None or cached_conv is not None:
                raise UsageError(
                    f"PLE layer {self.layer_idx}: continuing a cache with autograd is not supported by the patched "
                    "module; run under torch.no_grad() (generate() does) or unpatch the model"
                )
            out, conv_input = layer.forward_padded(
                hidden_states, ids, mask, return_conv_input=True, adapter_indices=chosen
            )
            self._store_states(cache, ids, None, conv_input.detach())
            return out
        out, conv_input = layer(
            hidden_states.reshape(b * s, width),
            ids.reshape(b * s),
            self._batch(b, s, cached_ctx, cached_conv, device, chosen),
            return_conv_input=True,
            token_mask=None if mask is None else mask.reshape(b * s),
            add_hidden=False,
        )
        self._store_states(cache, ids, cached_ctx, conv_input.view(b, s, width))
        return out.view(b, s, width)

    def _batch(self, b: int, s: int, cached_ctx, cached_conv, device, adapters=None) -> Batch:
        """``B`` requests of ``S`` tokens, slot ``r`` = row ``r`` of a temporary pool filled from the cache."""
        cfg = self.layer.config
        n_ctx = cfg.ngram_size - 1
        window = cfg.conv_window
        context = torch.full((b, n_ctx), cfg.eos_token_id, dtype=torch.int64, device=device)
        if cached_ctx is not None and n_ctx:
            # The cache may hold more (while recording the past) or, after a crop, fewer than N-1
            # ids; positions before the history read as EOS either way.
            tail = cached_ctx[..., -n_ctx:].to(device=device, dtype=torch.int64)
            context[:, n_ctx - tail.shape[-1] :] = tail
        pool = self.layer.new_state_pool(b, device=device)
        if cached_conv is not None:
            tail = cached_conv[..., -window:]
            pool[:, :, window - tail.shape[-1] :] = tail.to(device=device, dtype=pool.dtype)
        return Batch.build(
            [s] * b,
            list(range(b)),
            context,
            pool,
            kinds=[PREFILL] * b,
            has_initial_state=[cached_conv is not None] * b,
            conv_window=window,
            device=device,
            adapter_indices=None if adapters is None else adapters.tolist(),
        )

    def _store_states(self, cache, ids: torch.Tensor, cached_ctx, conv_input: torch.Tensor) -> None:
        """Write what the original module writes: the n-gram ids (state 2) and the conv inputs (state 1)."""
        if cache is None:
            return
        cfg = self.layer.config
        n_ctx = cfg.ngram_size - 1
        s = ids.shape[1]
        to_cache = ids
        if cached_ctx is None and s < n_ctx:
            # Qwen4ExpTextNGramEmbedding pads a fresh cache's ids with EOS (update_conv_state would use 0).
            to_cache = nn.functional.pad(ids, (n_ctx - s, 0), value=cfg.eos_token_id)
        cache.update_conv_state(to_cache, self.layer_idx, state_idx=2, conv_kernel_size=n_ctx)
        # Qwen4ExpTextPLELayer._short_conv: the (masked) conv inputs as [B, HC*H, S].
        cache.update_conv_state(
            conv_input.transpose(1, 2), self.layer_idx, state_idx=1, conv_kernel_size=cfg.conv_window
        )

    # ------------------------------------------------------------------ unpatch
    def _restore_plan(self, materialize: bool) -> Callable[[], nn.Module]:
        """Check that the original can get its table back; return the step that does it."""
        emb: Any = self.original.ple_embedding
        stub = isinstance(emb.ngram_embedding, TableStub)
        if not stub and self._released_weight is None:
            return self._finish
        if stub:
            want_dtype, device = emb.ngram_embedding.weight.dtype, self.layer.key_proj.device
        else:
            assert self._released_weight is not None
            want_dtype, device = self._released_weight[0].dtype, self._released_weight[1]
        weight = weight_from_table(self.layer.table, want_dtype, device, materialize, self.layer_idx)

        def restore() -> nn.Module:
            w = weight()
            if stub:
                e = nn.Embedding(w.shape[0], w.shape[1], device="meta", dtype=w.dtype)
                e.weight = nn.Parameter(w)
                emb.ngram_embedding = e
            else:
                assert self._released_weight is not None
                with torch.no_grad():
                    self._released_weight[0].data = w
                self._released_weight = None
            return self._finish()

        return restore

    def _undo(self) -> nn.Module:
        """Undo a patch that failed part way: a released table comes back from its exact copy."""
        if self._released_weight is not None:
            param, device = self._released_weight
            restore = weight_from_table(self.layer.table, param.dtype, device, False, self.layer_idx)
            with torch.no_grad():
                param.data = restore()
            self._released_weight = None
        return self._finish()

    def _finish(self) -> nn.Module:
        """Hand the (possibly trained) weights back to the original, drop this module's table."""
        original = self.original
        with torch.no_grad():
            for hf_name, attr in DENSE.items():
                target = original.get_parameter(hf_name)
                target.data = getattr(self.layer, attr).detach().reshape(target.shape)
        table = self.layer.table
        if table is not None:
            table.close()
            if isinstance(table, AdaptedTable):  # its base and trained rows go with it
                table.base.close()
                table.overlay.close()
        self.layer.table = None
        return original


def hf_state_dict(module: PatchedPLELayer, state_dict: dict, prefix: str, local_metadata) -> None:
    """``state_dict`` post-hook: transformers' names for the weights, the checkpoint's for the table."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]
    layer = module.layer
    for name, value in module.original.state_dict().items():
        if name.startswith(TABLE_PREFIX):
            continue
        if name in DENSE:
            value = getattr(layer, DENSE[name]).detach().reshape(value.shape)
        state_dict[prefix + name] = value
    if layer.table is None:
        raise UsageError(f"PLE layer {layer.ple_layer_index} has no table: there is nothing to save")
    if layer.table_weight is not None:  # being trained: the training state (the trained rows)
        state_dict.update(trained_state(layer, prefix + TABLE_PREFIX))
        return
    state_dict.update(table_state(layer.table, layer, prefix + TABLE_PREFIX))


def load_hf_state_dict(
    module: PatchedPLELayer, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """``load_state_dict`` pre-hook: accept transformers' names (what ``state_dict()`` gives).

    Table tensors load into an in-memory table of the same format (or the ``table_grad`` parameter);
    a memory-mapped or cached table is read-only here and reports an error instead."""
    layer = module.layer
    for hf_name, attr in DENSE.items():
        if prefix + hf_name in state_dict:
            state_dict[prefix + "layer." + attr] = state_dict.pop(prefix + hf_name).reshape(getattr(layer, attr).shape)
    lay = layer.layout
    want = {
        "layer_multipliers": lay.multipliers,
        "ngram_heads_vocab_sizes": lay.head_sizes,
        "ngram_heads_offsets": lay.head_offsets,
    }
    for name in BUFFERS:
        got = state_dict.pop(prefix + "ple_embedding." + name, None)
        if got is not None and tuple(int(v) for v in got.reshape(-1).tolist()) != tuple(want[name]):
            error_msgs.append(
                f"{prefix}ple_embedding.{name} = {got.tolist()}, but PLE layer {layer.ple_layer_index}'s layout has {list(want[name])}"
            )
    trained = [state_dict.pop(prefix + TABLE_PREFIX + k, None) for k in TRAINED_KEYS]
    if trained[0] is not None or trained[1] is not None:
        error = "missing trained_ids or trained_rows" if trained[0] is None or trained[1] is None else None
        error = error or load_trained(layer, trained[0], trained[1], default_spill_dir(layer.table))
        if error is not None:
            error_msgs.append(f"{prefix}{TABLE_PREFIX}{TRAINED_KEYS[0]}: {error}")
    keys = [k for k in state_dict if k.startswith(prefix + TABLE_PREFIX)]
    if not keys:
        return
    given = {k[len(prefix + TABLE_PREFIX) :]: state_dict.pop(k) for k in keys}
    try:
        data, scale = assemble_table(given, lay)
    except InvalidArgumentError as e:
        error_msgs.append(f"{prefix}{TABLE_PREFIX}*: {e}")
        return
    if "table_weight" in module._parameters:
        state_dict[prefix + "table_weight"] = data
        return
    table = layer.table
    if not isinstance(table, MemoryTable) or table.data.dtype != data.dtype or (scale is None) != (table.scale is None):
        error_msgs.append(
            f"{prefix}{TABLE_PREFIX}*: cannot load {data.dtype} table rows into PLE layer {layer.ple_layer_index}'s "
            f"{type(table).__name__} ({None if table is None else table.format}); load the checkpoint with "
            "ple.integrations.transformers.from_pretrained instead"
        )
        return
    with torch.no_grad():
        table.data.copy_(data)
        if scale is not None and table.scale is not None:
            table.scale.copy_(scale.reshape(table.scale.shape))


def assemble_table(given: dict[str, torch.Tensor], lay) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows [R_pad, head_dim], scale)`` from a table in transformers' or the checkpoint's names."""
    if "weight" in given:
        data = given["weight"]
    else:
        try:
            data = torch.cat([given[f"shard_{k}.weight"] for k in range(lay.split_parts)])
        except KeyError as e:
            raise InvalidArgumentError(f"table shard {e.args[0]} is missing") from None
    if tuple(data.shape) != (lay.padded_rows, lay.head_dim):
        raise InvalidArgumentError(f"table of shape {list(data.shape)}, expected [{lay.padded_rows}, {lay.head_dim}]")
    scale = given.get("weight_scale")
    if scale is None and "shard_0.weight_scale" in given:
        scale = torch.cat([given[f"shard_{k}.weight_scale"] for k in range(lay.split_parts)])
    return data, scale
