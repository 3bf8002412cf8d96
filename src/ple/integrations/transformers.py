"""Run transformers ``qwen4_exp`` models with ple's PLE layers, tables kept where they belong.

:func:`from_pretrained` is the user's path: it loads a ``qwen4_exp`` checkpoint with transformers
(the class its config names) while the n-gram tables are never materialized in memory (see
:mod:`ple.integrations.qwen4_exp`), then patches the model with tables from disk: table files made
once from the checkpoint and reused on every later start (see :mod:`ple.convert.folder`),
served memory-mapped (``"mmap"``), behind a cache of hot rows (``"cached"``) or read into memory
(``"memory"``, in the checkpoint's format: an fp8 table stays fp8).

:func:`patch` replaces every ``Qwen4ExpTextPLELayer`` of a model (``Qwen4ExpForCausalLM``,
``Qwen4ExpTextModel``, ``Qwen4ExpForConditionalGeneration``, ...) with a :class:`PatchedPLELayer`:
same call signature ``(hidden_states, input_ids, cache, conv_mask=None)``, same result (``v + conv``,
``[B, S, HC*H]``), same weights, computed by :class:`ple.PLELayer` over a table of the chosen tier.
:func:`unpatch` puts the original modules back (with the weights trained while patched).

Per call of shape ``[B, S]`` the patched module runs one packed batch of ``B`` requests of ``S``
tokens. The n-gram context comes from the cache's ``state_idx=2`` conv state (EOS while there is
none), the conv window from ``state_idx=1`` (the last ``(K-1)*N`` conv inputs) through a temporary
state pool ``[B, HC*H, (K-1)*N]``; both states are written back through the cache's own
``update_conv_state``, with the arguments the original module passes, so the cache holds exactly
what the original would have left there (a cache may be filled by one and continued by the other).
Left padding: the decoder has already replaced padded ids by EOS; ``conv_mask`` zeroes the padded
positions' values and conv inputs, as in the original.

Saving: a patched module's ``state_dict()`` uses transformers' names for its weights and the
checkpoint's names for its table (``ple_embedding.ngram_embedding.shard_{k}.weight``, one tensor per
shard in the table's own format, plus ``weight_scale``: one global ``[1]`` for fp8, ``[rows, 1]``
per shard for per-row formats). Memory-mapped tables are handed over as maps of the file the table
holds (:meth:`ple.MmapTable.map_rows`: the file it serves, even after another was renamed over its
name), so ``model.save_pretrained(...)`` streams them from disk and writes the checkpoint layout transformers
writes. transformers 5.24 reads an F8_E4M3 table as a plain cast and ignores ``weight_scale``: so
``save_pretrained`` of a model whose tables carry scales warns (:class:`ScaledTableWarning`), and
``save_pretrained(dst, dequantize=torch.bfloat16)`` writes the form plain transformers reads
correctly (the tables dequantized, no ``weight_scale``; :func:`dequantize_checkpoint` does the same
to a checkpoint folder). A table with trained rows on it (an adapter of ``ple.train``) is saved
merged: the base's rows with the trained rows requantized into its format, as
``ple.train.merge_model`` writes them, streamed through unnamed files in the folder being saved to
(the model keeps its adapter; see :mod:`ple.integrations.table_state`, which also says what
:func:`unpatch` gives back). A table whose rows this process cannot read (sharded across ranks)
refuses to be saved, naming what to do instead. A table being trained (``ple.train.trainable``, until
``ple.train.freeze``) is saved as its training state instead: its trained rows alone, fp32, exactly
(``...ngram_embedding.trained_ids`` / ``trained_rows``), which ``load_state_dict`` puts back on the
model's table: transformers' ``Trainer`` checkpoints and resumes exactly, and no table is written.

Training: with autograd recording (a call outside ``torch.no_grad()``), fresh sequences go through
:meth:`ple.PLELayer.forward_padded` (the differentiable reference); continuing a cache needs
``torch.no_grad()`` (as ``generate()`` runs). The projections, norms and conv weights train; the table
is not a parameter of the patched model: ``ple.train.trainable(model)`` trains it on every tier and
format with row-sparse gradients and optimizers (see :mod:`ple.train`). ``patch(..., table_grad=True)``
(``table_tier="memory"``, a bf16/fp16/fp32 table) instead makes it a parameter with the dense gradient
transformers gives it (non-zero only on the rows the batch touched).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ple.checkpoint import (
    CheckpointError,
    PreadReader,
    load_table,
    open_layer_table,
    scan_checkpoint,
    table_file_name,
    write_layer_table,
)
from ple.common.files import read_json
from ple.config import ConfigError, PLEConfig, architecture_names
from ple.convert.dequantized import dequantize_checkpoint
from ple.convert.folder import PreparedTable, default_table_dir, prepare_table, served_format
from ple.errors import ArgumentTypeError, InvalidArgumentError, UsageError
from ple.integrations.qwen4_exp import (
    TableStub,
    TransformersVersionError,
    hf_ple_class,
    require_transformers,
    tableless_load,
)
from ple.integrations.table_state import (
    TRAINED_KEYS,
    load_trained,
    staging,
    table_state,
    trained_state,
    weight_from_table,
)
from ple.layer import PLELayer
from ple.runtime.batch import PREFILL, Batch
from ple.table import CachedTable, DirectTable, MemoryTable, MmapTable, StoredTable, Table, format_info
from ple.table.files.transcode import TARGET_NAMES
from ple.table.tiers.adapted import AdaptedTable
from ple.train.attach import default_spill_dir

__all__ = [
    "from_pretrained",
    "patch",
    "unpatch",
    "patched_layers",
    "dequantize_checkpoint",
    "default_table_dir",
    "PatchedPLELayer",
    "TableStub",
    "TransformersVersionError",
    "TABLE_TIERS",
    "LOAD_TIERS",
    "DEFAULT_CACHE_ROWS",
    "ScaledTableWarning",
]

TABLE_TIERS = ("memory", "mmap")
"""The tiers :func:`patch` builds by name (any other through a table factory)."""
LOAD_TIERS = ("mmap", "cached", "memory", "direct")
"""The tiers :func:`from_pretrained` serves tables from."""
DEFAULT_CACHE_ROWS = 1 << 20
"""Rows a ``"cached"`` table keeps in memory by default (160 MB of fp8 rows at the published width)."""

#: A table factory: ``(weight [R_pad, head_dim] (the module's table), layer) -> Table``.
TableFactory = Callable[[torch.Tensor, PLELayer], Table]

# transformers' names of a PLE module's weights -> the PLELayer parameter holding them
_DENSE = {
    "key_proj.weight": "key_proj",
    "value_proj.weight": "value_proj",
    "norm_key.weight": "norm_key",
    "norm_query.weight": "norm_query",
    "norm_conv.weight": "norm_conv",
    "conv1d.weight": "conv_weight",
}
_TABLE_PREFIX = "ple_embedding.ngram_embedding."
_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


class ScaledTableWarning(UserWarning):
    """``save_pretrained`` wrote PLE tables with scales (fp8/int8 + ``weight_scale``), which ple reads
    back exactly and plain transformers (5.24) reads as a plain cast, ignoring the scales."""


def _scaled_formats(model: nn.Module) -> list[str]:
    """The formats of the patched tables of ``model`` that carry scales (one entry per such layer)."""
    out = []
    for w in patched_layers(model):
        table = w.layer.table
        if w.layer.table_weight is not None:  # being trained: its trained rows are saved, not the table
            continue
        backing = table.backing if isinstance(table, CachedTable) else table
        fmt = getattr(backing, "format", None)
        # block formats are saved dequantized (transformers has no layout for them): nothing to warn
        if fmt is not None and not format_info(fmt).blocked and format_info(fmt).scale_kind != "none":
            out.append(fmt)
    return out


def _save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *args, dequantize=None, **kwargs) -> Any:
    """transformers' ``save_pretrained`` of a patched model, plus ``dequantize``.

    ``dequantize=None`` writes each table in its own format (fp8/int8 tables with their
    ``weight_scale``: what ple loads back exactly) and warns (:class:`ScaledTableWarning`) when a
    table carries scales, since plain transformers 5.24 ignores them. ``dequantize=torch.bfloat16``
    (or ``float16``/``float32``) writes the form plain transformers reads correctly: the model is
    saved beside ``save_directory`` first, then copied by :func:`dequantize_checkpoint` (streamed,
    tables dequantized as ``q.to(dtype) * scale.to(dtype)``, ``ple_embedding_dtype`` dropped from the
    config); ``save_directory`` must then be new (or an empty folder) and ``push_to_hub`` is refused.
    """
    cls: Any = type(model)  # a transformers PreTrainedModel (patch installs this only there)
    save = cls.save_pretrained
    if dequantize is None:
        scaled = _scaled_formats(model)
        if scaled:
            warnings.warn(
                f"save_pretrained: {len(scaled)} PLE table(s) saved as {'/'.join(sorted(set(scaled)))} with their "
                "weight_scale; ple loads them back exactly, but plain transformers 5.24 ignores weight_scale and "
                "reads other values. For plain transformers pass dequantize=torch.bfloat16 (or copy the "
                "checkpoint with ple.integrations.transformers.dequantize_checkpoint)",
                ScaledTableWarning,
                stacklevel=2,
            )
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        with staging(save_directory):
            return save(model, save_directory, *args, **kwargs)
    if dequantize not in (torch.bfloat16, torch.float16, torch.float32):
        raise InvalidArgumentError(
            f"dequantize must be torch.bfloat16, torch.float16 or torch.float32 (or None), got {dequantize!r}"
        )
    if kwargs.get("push_to_hub"):
        raise InvalidArgumentError("save_pretrained: dequantize= writes a local folder; push it in a second step")
    if any(w.layer.table_weight is not None for w in patched_layers(model)):
        raise UsageError(
            "save_pretrained: dequantize= writes the tables, and this model's tables are being trained (it would "
            "save their trained rows): call ple.train.freeze(model) first"
        )
    dst = Path(save_directory)
    if dst.is_dir() and not dst.is_symlink() and not any(dst.iterdir()):
        dst.rmdir()  # an empty folder made for the copy
    if os.path.lexists(dst):
        raise FileExistsError(f"{dst} exists: save_pretrained(..., dequantize=...) writes a new folder")
    dst.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".save", dir=dst.parent))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ScaledTableWarning)
            with staging(staged):
                save(model, staged, *args, **kwargs)
        dequantize_checkpoint(staged, dst, dequantize)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return None


class PatchedPLELayer(nn.Module):
    """Drop-in for transformers' ``Qwen4ExpTextPLELayer``, backed by a :class:`ple.PLELayer`.

    Attributes:
        layer: the :class:`ple.PLELayer` (weights copied from the original module, table of any tier).
        layer_idx: the decoder layer index (the cache slot the original used).
        original: the replaced transformers module (kept for :func:`unpatch`, not a submodule).
        table_path: the table file (``"mmap"``/``"cached"`` tiers), else None.
        prepared: how :func:`from_pretrained` obtained the table file (reused, verified, converted), else None.
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
        self.register_state_dict_post_hook(_hf_state_dict)
        self.register_load_state_dict_pre_hook(_load_hf_state_dict)

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
            out, conv_input = layer.forward_padded(hidden_states, ids, mask, return_conv_input=True)
            self._store_states(cache, ids, None, conv_input.detach())
            return out
        out, conv_input = layer(
            hidden_states.reshape(b * s, width),
            ids.reshape(b * s),
            self._batch(b, s, cached_ctx, cached_conv, device),
            return_conv_input=True,
            token_mask=None if mask is None else mask.reshape(b * s),
            add_hidden=False,
        )
        self._store_states(cache, ids, cached_ctx, conv_input.view(b, s, width))
        return out.view(b, s, width)

    def _batch(self, b: int, s: int, cached_ctx, cached_conv, device) -> Batch:
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
            for hf_name, attr in _DENSE.items():
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


def _hf_state_dict(module: PatchedPLELayer, state_dict: dict, prefix: str, local_metadata) -> None:
    """``state_dict`` post-hook: transformers' names for the weights, the checkpoint's for the table."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]
    layer = module.layer
    for name, value in module.original.state_dict().items():
        if name.startswith(_TABLE_PREFIX):
            continue
        if name in _DENSE:
            value = getattr(layer, _DENSE[name]).detach().reshape(value.shape)
        state_dict[prefix + name] = value
    if layer.table is None:
        raise UsageError(f"PLE layer {layer.ple_layer_index} has no table: there is nothing to save")
    if layer.table_weight is not None:  # being trained: the training state (the trained rows)
        state_dict.update(trained_state(layer, prefix + _TABLE_PREFIX))
        return
    state_dict.update(table_state(layer.table, layer, prefix + _TABLE_PREFIX))


def _load_hf_state_dict(
    module: PatchedPLELayer, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """``load_state_dict`` pre-hook: accept transformers' names (what ``state_dict()`` gives).

    Table tensors load into an in-memory table of the same format (or the ``table_grad`` parameter);
    a memory-mapped or cached table is read-only here and reports an error instead."""
    layer = module.layer
    for hf_name, attr in _DENSE.items():
        if prefix + hf_name in state_dict:
            state_dict[prefix + "layer." + attr] = state_dict.pop(prefix + hf_name).reshape(getattr(layer, attr).shape)
    lay = layer.layout
    want = {
        "layer_multipliers": lay.multipliers,
        "ngram_heads_vocab_sizes": lay.head_sizes,
        "ngram_heads_offsets": lay.head_offsets,
    }
    for name in _BUFFERS:
        got = state_dict.pop(prefix + "ple_embedding." + name, None)
        if got is not None and tuple(int(v) for v in got.reshape(-1).tolist()) != tuple(want[name]):
            error_msgs.append(
                f"{prefix}ple_embedding.{name} = {got.tolist()}, but PLE layer {layer.ple_layer_index}'s layout has {list(want[name])}"
            )
    trained = [state_dict.pop(prefix + _TABLE_PREFIX + k, None) for k in TRAINED_KEYS]
    if trained[0] is not None or trained[1] is not None:
        error = "missing trained_ids or trained_rows" if trained[0] is None or trained[1] is None else None
        error = error or load_trained(layer, trained[0], trained[1], default_spill_dir(layer.table))
        if error is not None:
            error_msgs.append(f"{prefix}{_TABLE_PREFIX}{TRAINED_KEYS[0]}: {error}")
    keys = [k for k in state_dict if k.startswith(prefix + _TABLE_PREFIX)]
    if not keys:
        return
    given = {k[len(prefix + _TABLE_PREFIX) :]: state_dict.pop(k) for k in keys}
    try:
        data, scale = _assemble_table(given, lay)
    except InvalidArgumentError as e:
        error_msgs.append(f"{prefix}{_TABLE_PREFIX}*: {e}")
        return
    if "table_weight" in module._parameters:
        state_dict[prefix + "table_weight"] = data
        return
    table = layer.table
    if not isinstance(table, MemoryTable) or table.data.dtype != data.dtype or (scale is None) != (table.scale is None):
        error_msgs.append(
            f"{prefix}{_TABLE_PREFIX}*: cannot load {data.dtype} table rows into PLE layer {layer.ple_layer_index}'s "
            f"{type(table).__name__} ({None if table is None else table.format}); load the checkpoint with "
            "ple.integrations.transformers.from_pretrained instead"
        )
        return
    with torch.no_grad():
        table.data.copy_(data)
        if scale is not None and table.scale is not None:
            table.scale.copy_(scale.reshape(table.scale.shape))


def _assemble_table(given: dict[str, torch.Tensor], lay) -> tuple[torch.Tensor, torch.Tensor | None]:
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


# ---------------------------------------------------------------------------------------------- patch
def _children_of_type(model: nn.Module, cls) -> list[tuple[str, nn.Module, str, Any]]:
    """``(qualified name, parent, attribute, child)`` for every child of type ``cls``."""
    found = []
    for name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if isinstance(child, cls):
                found.append((f"{name}.{child_name}" if name else child_name, parent, child_name, child))
    return found


def patched_layers(model: nn.Module) -> list[PatchedPLELayer]:
    """The :class:`PatchedPLELayer` modules of a patched model, in module order."""
    return [c for _, _, _, c in _children_of_type(model, PatchedPLELayer)]


def _model_ple_config(model: nn.Module) -> PLEConfig | None:
    """The model's PLE config (exact divisor and shard count), or None when it has no usable config."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return None
    try:
        config = PLEConfig.from_dict(cfg.to_dict())
    except (ConfigError, TypeError):
        return None
    return config if config.ple_layer_ids else None


def _write_mmap_table(layer: PLELayer, weight: torch.Tensor, path: Path) -> MmapTable:
    """The module's table as a table file at ``path`` (one shard at a time), mapped."""
    lay = layer.layout

    def shards():
        for k in range(lay.split_parts):
            start, stop = lay.shard_range(k)
            if start < stop:
                yield k, weight[start:stop].detach().cpu(), None

    write_layer_table(shards(), path, layer.config, layer.ple_layer_index, force=True)
    return open_layer_table(path, layer.config, layer.ple_layer_index)


def _check_lossless(table: Table, weight: torch.Tensor, what: str) -> None:
    if not isinstance(table, StoredTable) or table.scale is not None or table.storage_dtype != weight.dtype:
        raise InvalidArgumentError(
            f"{what}: release_weight needs a table that stores the module's rows exactly "
            f"({weight.dtype}, no scale), got a {table.format!r} table; the original could not be restored"
        )


def _require_module(model: Any, fn: str) -> None:
    if not isinstance(model, nn.Module):
        shown = repr(model)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ArgumentTypeError(
            f"{fn}() takes a loaded model (a torch.nn.Module), got {type(model).__name__} {shown}; "
            "for a model folder or Hub id use ple.integrations.transformers.from_pretrained(path)"
        )


def patch(
    model: nn.Module,
    table_tier: str | TableFactory = "memory",
    table_dir: str | os.PathLike | None = None,
    *,
    release_weight: bool | None = None,
    table_grad: bool = False,
) -> nn.Module:
    """Replace every ``Qwen4ExpTextPLELayer`` of ``model`` by a :class:`PatchedPLELayer` (in place).

    Args:
        model: a transformers ``qwen4_exp`` model (or any module containing PLE modules). Patch
            after moving the model to its device and dtype.
        table_tier: ``"memory"`` shares the module's table tensor (no copy); ``"mmap"`` writes the
            table to a table file (layout hash of the layer's config) and reads it through a
            memory map; a callable ``(weight [R_pad, head_dim], layer) -> Table`` builds any tier.
        table_dir: where ``"mmap"`` writes ``<module name>.pletable`` files (replacing existing
            ones); None uses a temporary directory removed by :func:`unpatch`.
        release_weight: free the module's in-memory table after building the new one, so that
            resident memory goes down (default: True for ``"mmap"``, False otherwise). The table
            must store the rows exactly; :func:`unpatch` maps them back from the table file
            (copy-on-write) instead of reading them into memory.
        table_grad: train the table: ``"memory"`` tier and a bf16/fp16/fp32 table only. The module's
            table parameter becomes the patched module's ``table_weight`` parameter and receives
            transformers' gradient. Default: the table is frozen (not a parameter of the patched model).

    Returns:
        ``model`` (patched in place).
    """
    _require_module(model, "patch")
    if isinstance(table_tier, str):
        if table_tier not in TABLE_TIERS:
            raise InvalidArgumentError(
                f"table_tier must be one of {list(TABLE_TIERS)} or a Table factory, got {table_tier!r}"
            )
    elif not callable(table_tier):
        raise ArgumentTypeError(f"table_tier must be a str or a callable (weight, layer) -> Table, got {table_tier!r}")
    if table_dir is not None and table_tier != "mmap":
        raise InvalidArgumentError(f"table_dir is for table_tier='mmap', got table_tier={table_tier!r}")
    if table_grad and table_tier != "memory":
        raise InvalidArgumentError(
            f"table_grad=True needs table_tier='memory' (the table as a parameter in memory); got table_tier={table_tier!r}: "
            "a memory-mapped, cached or factory-built table cannot take gradients"
        )
    if patched_layers(model):
        raise InvalidArgumentError("model is already patched: call unpatch(model) first")
    found = _children_of_type(model, hf_ple_class())
    if not found:
        raise InvalidArgumentError(f"{type(model).__name__} has no Qwen4ExpTextPLELayer module (ple_layer_ids empty?)")
    release = table_tier == "mmap" if release_weight is None else bool(release_weight)
    config = _model_ple_config(model)
    for qualname, _, _, module in found:
        table_module = module.ple_embedding.ngram_embedding
        if isinstance(table_module, TableStub) and (isinstance(table_tier, str) or release):
            raise InvalidArgumentError(
                f"{qualname} has no table in memory (loaded by from_pretrained): patch it with a table factory"
            )
        if table_grad and table_module.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise InvalidArgumentError(
                f"{qualname}: table_grad=True needs a bf16/fp16/fp32 table, got {table_module.weight.dtype}"
            )

    tmp = None
    out_dir = None
    if table_tier == "mmap":
        if table_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="ple-tables-")
            out_dir = Path(tmp.name)
        else:
            out_dir = Path(table_dir)
            out_dir.mkdir(parents=True, exist_ok=True)

    done: list[tuple[nn.Module, str, PatchedPLELayer]] = []
    try:
        for qualname, parent, attr, module in found:
            layer = PLELayer.from_transformers(module, config)
            param = module.ple_embedding.ngram_embedding.weight
            weight = param.detach()
            path = None
            table: Table
            if table_tier == "memory":
                table = MemoryTable(param if table_grad else weight)
            elif table_tier == "mmap":
                assert out_dir is not None
                path = out_dir / table_file_name(qualname)
                table = _write_mmap_table(layer, weight, path)
            else:
                assert callable(table_tier)
                table = table_tier(weight, layer)
                if not isinstance(table, Table):
                    raise ArgumentTypeError(f"the table factory returned {type(table).__name__}, expected a ple Table")
            layer.set_table(table)
            wrapper = PatchedPLELayer(layer, module.layer_idx, module, table_path=path)
            if table_grad:
                wrapper.table_weight = param
            if release:
                _check_lossless(table, weight, qualname)
                wrapper._released_weight = (param, param.device)
                del weight
                with torch.no_grad():
                    param.data = param.data.new_empty((0, param.shape[1]))
            setattr(parent, attr, wrapper)
            done.append((parent, attr, wrapper))
    except BaseException:
        for parent, attr, wrapper in reversed(done):
            setattr(parent, attr, wrapper._undo())
        if tmp is not None:
            tmp.cleanup()
        raise
    if done:
        done[0][2]._table_dir = tmp  # removed once, by the first wrapper unpatched
    if callable(getattr(type(model), "save_pretrained", None)):
        # on the instance: ``model.save_pretrained(..., dequantize=...)``, and the warning for scaled tables
        model.__dict__["save_pretrained"] = types.MethodType(_save_pretrained, model)
    return model


def unpatch(model: nn.Module, *, materialize: bool = False) -> nn.Module:
    """Put the original ``Qwen4ExpTextPLELayer`` modules back (the same objects), with the weights
    as trained while patched. A released table, or a table that was never in memory (a model from
    :func:`from_pretrained`), comes back as a copy-on-write map of its table file when the file stores
    the rows in the module's dtype; otherwise (an fp8 table, another dtype) it is dequantized into
    memory only with ``materialize=True``, and :class:`UsageError` says so before anything changes.
    Table files in a caller's folder are kept; a temporary directory is removed. Returns ``model``."""
    _require_module(model, "unpatch")
    found = _children_of_type(model, PatchedPLELayer)
    if not found:
        raise InvalidArgumentError(f"{type(model).__name__} has no patched PLE layer: nothing to unpatch")
    steps = [(parent, attr, wrapper._restore_plan(materialize)) for _, parent, attr, wrapper in found]
    for parent, attr, step in steps:
        setattr(parent, attr, step())
    for _, _, _, wrapper in found:  # after every table is mapped back (a map outlives its file's name)
        if wrapper._table_dir is not None:
            wrapper._table_dir.cleanup()
            wrapper._table_dir = None
    saver = model.__dict__.get("save_pretrained")
    if isinstance(saver, types.MethodType) and saver.__func__ is _save_pretrained:
        del model.__dict__["save_pretrained"]
    return model


# ---------------------------------------------------------------------------------------------- loading
_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies")


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return 1 <= len(parts) <= 2 and all(p and p not in (".", "..") for p in parts) and not path.startswith("~")


def _local_checkpoint(path: str | os.PathLike, kwargs: dict[str, Any]) -> Path:
    """A local model folder for ``path``: the folder itself, or a Hub snapshot (downloaded or cached)."""
    p = Path(path)
    if p.is_dir():
        return p
    if p.exists() or not _looks_like_hub_id(str(path)):
        raise FileNotFoundError(f"{path}: not a model folder (a folder with config.json and safetensors weights)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise FileNotFoundError(f"{path}: no such folder, and huggingface_hub is not installed") from e
    hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
    try:
        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"], **hub))
    except Exception as e:
        raise FileNotFoundError(f"{path}: no such folder, and the Hub snapshot could not be had: {e}") from e


def _model_class(root: Path, mq):
    import transformers

    doc = read_json(root / "config.json", "config", 64 << 20, ConfigError)
    names = architecture_names(doc)
    if not names:
        return transformers.AutoModelForCausalLM
    arch = names[0]
    cls = getattr(transformers, arch, None)
    if not isinstance(cls, type) or not issubclass(cls, mq.Qwen4ExpPreTrainedModel):
        raise InvalidArgumentError(
            f"{root}/config.json names architecture {arch!r}, not a transformers qwen4_exp model"
        )
    return cls


def _check_tableless(model: nn.Module, info: dict, config: PLEConfig) -> None:
    """Fail loudly if transformers did not build the model the way the tableless load expects."""
    import transformers

    found = _children_of_type(model, hf_ple_class())
    tables = [n for n, _ in model.named_parameters() if n.endswith("ngram_embedding.weight")]
    stubs = [m for _, _, _, m in found if isinstance(m.ple_embedding.ngram_embedding, TableStub)]
    if tables or len(stubs) != len(found) or len(found) != config.num_ple_layers:
        raise TransformersVersionError(
            f"transformers {transformers.__version__} did not build the PLE tables the way ple's loader expects "
            f"({len(found)} PLE modules, {len(stubs)} without a table, table parameters {tables[:2]}); "
            "refusing to run with a table it may have allocated or initialized at random"
        )
    bad = sorted(
        k
        for k in [
            *info.get("missing_keys", []),
            *(m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys", [])),
        ]
        if ".ple." in k
    )
    if bad:
        raise CheckpointError([f"PLE weight {k} was not loaded from the checkpoint" for k in bad])


def from_pretrained(
    path: str | os.PathLike,
    *,
    table_dir: str | os.PathLike | None = None,
    table_tier: str = "mmap",
    table_cache_rows: int | None = None,
    memory_budget: int | None = None,
    progress: bool | None = None,
    table_format: str | None = None,
    table_adapter: str | os.PathLike | None = None,
    **kwargs,
) -> Any:
    """Load a transformers ``qwen4_exp`` model whose PLE tables stay on disk (never in memory).

    transformers builds the model (the class its ``config.json`` names; ``kwargs`` go to its
    ``from_pretrained``: ``dtype``, ``device_map``, ...) and loads every weight but the n-gram
    tables, whose checkpoint tensors it never reads; the model comes back patched with ple's PLE
    layers (:func:`patch`), tables served from ``table_tier``.

    Args:
        path: a local model folder, or a Hub id (fetched with ``huggingface_hub.snapshot_download``;
            the Hub arguments in ``kwargs`` apply).
        table_dir: where the table files live (see :mod:`ple.convert.folder`): made once,
            streamed shard by shard from the checkpoint, reused while the checkpoint is unchanged.
            One folder per checkpoint (a table of another checkpoint folder is never replaced:
            :class:`InvalidArgumentError`). Default: ``$PLE_CACHE_DIR/tables/<folder name>-<hash of
            its path>`` (``PLE_CACHE_DIR`` defaults to ``$XDG_CACHE_HOME/ple``, else ``~/.cache/ple``).
        table_tier: ``"mmap"`` (rows read from the page cache on demand), ``"cached"`` (the hottest
            ``table_cache_rows`` rows kept in memory on the model's device, in front of the map) or
            ``"memory"`` (the table read into memory in the checkpoint's format; no table files).
        table_cache_rows: rows of the ``"cached"`` tier, an int >= 1 (default :data:`DEFAULT_CACHE_ROWS`);
            checked before anything is converted or loaded.
        memory_budget: ``table_tier="direct"`` (rows read from the table files with ``pread``,
            bypassing the page cache, :class:`ple.table.DirectTable`): bytes of rows each table keeps
            in memory, an int >= 0 (default 64 MiB). A direct table cannot give its rows back to
            transformers (``unpatch``, ``save_pretrained``).
        progress: progress bars while converting (default: when stderr is a terminal).
        table_format: serve a copy of each table in this format ("q4_0", "q5_1", "iq4_nl", "nvfp4",
            ... any name ``ple convert --to`` takes; docs/FORMATS.md weighs them), made once in
            ``table_dir`` and reused like the checkpoint-format files (the file ``ple convert --to``
            wrote there for this checkpoint is found and served); None (default) serves the
            checkpoint's own format. A table file is served only in the format asked for (read from
            its header): one of another format is refused, naming both. Tiers "mmap", "cached" and
            "direct".
        table_adapter: an adapter file of trained rows (``ple.train.save_adapter``) served on top of
            the tables (any tier and format; the table files stay untouched): see
            ``ple.train.load_adapter``, which also swaps or removes it later.

    Returns:
        The patched model (and transformers' loading info when ``output_loading_info=True``). Each
        :class:`PatchedPLELayer` tells how its table file was obtained (``prepared``).

    Raises:
        CheckpointError: the checkpoint's PLE tensors are missing, misshapen or inconsistent.
        TransformersVersionError: transformers is missing, too old, or built the model unexpectedly.
    """
    mq = require_transformers()
    if table_tier not in LOAD_TIERS:
        raise InvalidArgumentError(f"table_tier must be one of {list(LOAD_TIERS)}, got {table_tier!r}")
    if table_tier == "memory" and table_dir is not None:
        raise InvalidArgumentError(
            "table_dir is for the table-file tiers (mmap, cached, direct); 'memory' reads the checkpoint"
        )
    if table_format is not None and table_tier == "memory":
        raise InvalidArgumentError(
            "table_format is for the table-file tiers (mmap, cached, direct); 'memory' reads the checkpoint"
        )
    if table_format is not None and table_format not in TARGET_NAMES:
        raise InvalidArgumentError(f"table_format must be one of {list(TARGET_NAMES)}, got {table_format!r}")
    for name, value, tier, least, unit, hint in (
        ("memory_budget", memory_budget, "direct", 0, "bytes", ""),
        (
            "table_cache_rows",
            table_cache_rows,
            "cached",
            1,
            "rows kept in memory",
            "; for no cache use table_tier='mmap'",
        ),
    ):
        if value is None:
            continue
        if table_tier != tier:
            raise InvalidArgumentError(f"{name} is for table_tier={tier!r}, got table_tier={table_tier!r}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(f"{name} must be an int ({unit}), got {value!r}")
        if value < least:
            raise InvalidArgumentError(f"{name} must be >= {least}, got {value}{hint}")
    refused = sorted(k for k in ("state_dict", "gguf_file", "from_tf", "from_flax", "key_mapping") if k in kwargs)
    if refused:
        raise InvalidArgumentError(f"from_pretrained: {refused} cannot be combined with ple's table loading")
    want_info = bool(kwargs.pop("output_loading_info", False))
    root = _local_checkpoint(path, kwargs)
    config = PLEConfig.from_pretrained(root)
    if not config.ple_layer_ids:
        raise InvalidArgumentError(f"{root}: the config has no PLE layers; load it with transformers directly")
    scan = scan_checkpoint(root, config)
    if any(p.endswith(f".{TRAINED_KEYS[0]}") for p in scan.all_problems):
        raise UsageError(
            f"{root} is a training checkpoint (saved while the PLE tables were being trained: their trained rows, "
            "not the tables): load the base model with from_pretrained, then model.load_state_dict of this "
            "checkpoint's weights (or resume with Trainer(resume_from_checkpoint=...)); to save the tables "
            "themselves, call ple.train.freeze(model) before save_pretrained"
        )
    if scan.all_problems:
        raise CheckpointError(scan.all_problems)
    show = sys.stderr.isatty() if progress is None else bool(progress)
    adapter = None
    if table_adapter is not None:
        from ple.train.adapter import read_adapter

        adapter = read_adapter(table_adapter)  # checked before any table is made
    cls = _model_class(root, mq)
    if table_tier != "memory":
        for e in scan.layers:  # every layer's rows fit the format asked for, before any file is made
            served_format(e, config, table_format)
    prepared: dict[int, PreparedTable] = {}
    try:
        if table_tier != "memory":
            folder = Path(table_dir) if table_dir is not None else default_table_dir(root)
            for e in scan.layers:
                # opened while checked: the file served is the file checked, whatever replaces it later
                prepared[e.ple_layer_index] = prepare_table(e, config, folder, progress=show, table_format=table_format)
        entries = {e.ple_layer_index: e for e in scan.layers}
        with tableless_load():
            model, info = cls.from_pretrained(root, output_loading_info=True, **kwargs)
        _check_tableless(model, info, config)

        def factory(weight: torch.Tensor, layer: PLELayer) -> Table:
            idx = layer.ple_layer_index
            device = layer.key_proj.device
            if table_tier == "memory":
                # the loader's own checks: shapes and dtypes as scanned, every scale positive and finite
                with PreadReader() as reader:
                    return load_table(entries[idx], reader, device=device)
            mapped = prepared[idx].table
            assert mapped is not None
            if table_tier == "cached":
                rows = DEFAULT_CACHE_ROWS if table_cache_rows is None else table_cache_rows
                return CachedTable(mapped, rows, device=device)
            if table_tier == "direct":
                path = prepared[idx].path
                direct = DirectTable(
                    path, mapped.layout_hash, memory_budget=64 << 20 if memory_budget is None else memory_budget
                )
                if not mapped.same_file(path):  # the file checked is the file served
                    direct.close()
                    raise InvalidArgumentError(f"{path} was replaced while it was opened: load again")
                mapped.close()
                return direct
            return mapped

        patch(model, factory)
        if adapter is not None:
            from ple.train.adapter import load_adapter

            load_adapter(model, adapter)
    except BaseException:
        for made in prepared.values():
            if made.table is not None:
                made.table.close()
        raise
    for wrapper in patched_layers(model):
        p = prepared.get(wrapper.layer.ple_layer_index)
        wrapper.prepared = p
        wrapper.table_path = None if p is None else p.path
    return (model, info) if want_info else model
