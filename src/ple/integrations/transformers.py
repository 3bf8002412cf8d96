"""Run a transformers ``qwen4_exp`` model with ple's PLE layers, keeping transformers' own cache.

:func:`patch` replaces every ``Qwen4ExpTextPLELayer`` of a model (``Qwen4ExpForCausalLM``,
``Qwen4ExpTextModel``, ``Qwen4ExpForConditionalGeneration``, ...) with a :class:`PatchedPLELayer`:
same call signature ``(hidden_states, input_ids, cache, conv_mask=None)``, same result (``v + conv``,
``[B, S, HC*H]``), same weights, computed by :class:`ple.PLELayer` over a table of the chosen tier.
:func:`unpatch` puts the original modules back.

Per call of shape ``[B, S]`` the patched module runs one packed batch of ``B`` requests of ``S``
tokens. The n-gram context comes from the cache's ``state_idx=2`` conv state (EOS while there is
none), the conv window from ``state_idx=1`` (the last ``(K-1)*N`` conv inputs) through a temporary
state pool ``[B, HC*H, (K-1)*N]``; both states are written back through the cache's own
``update_conv_state``, with the arguments the original module passes, so the cache holds exactly
what the original would have left there (a cache may be filled by one and continued by the other).
Left padding: the decoder has already replaced padded ids by EOS; ``conv_mask`` zeroes the padded
positions' values and conv inputs, as in the original.

With autograd recording, fresh sequences go through :meth:`ple.PLELayer.forward_padded` (the
differentiable reference); continuing a cache needs ``torch.no_grad()`` (as ``generate()`` runs).
Patch after placing the model on its device; unpatch before saving it (the patched modules' state
dict keys are ple's, and the ``"mmap"`` tier releases the in-memory tables).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import open_layer_table, write_layer_table
from ..config import ConfigError, PLEConfig
from ..errors import ArgumentTypeError, InvalidArgumentError, UsageError
from ..layer import PLELayer
from ..runtime.batch import PREFILL, Batch
from ..table import TABLE_SUFFIX, MmapTable, Table

__all__ = ["patch", "unpatch", "patched_layers", "PatchedPLELayer", "TABLE_TIERS"]

TABLE_TIERS = ("memory", "mmap")

#: A table factory: ``(weight [R_pad, head_dim] (the module's table), layer) -> Table``.
TableFactory = Callable[[torch.Tensor, PLELayer], Table]


def _hf_ple_class():
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

    return Qwen4ExpTextPLELayer


class PatchedPLELayer(nn.Module):
    """Drop-in for transformers' ``Qwen4ExpTextPLELayer``, backed by a :class:`ple.PLELayer`.

    Attributes:
        layer: the :class:`ple.PLELayer` (weights copied from the original module, table of any tier).
        layer_idx: the decoder layer index (the cache slot the original used).
        original: the replaced transformers module (kept for :func:`unpatch`, not a submodule).
        table_path: the table file (``"mmap"`` tier), else None.
    """

    def __init__(self, layer: PLELayer, layer_idx: int, original: nn.Module, table_path: Path | None = None):
        super().__init__()
        self.layer = layer
        self.layer_idx = layer_idx
        self.table_path = table_path
        # A plain tuple keeps the original out of parameters(), state_dict() and .to().
        self._original = (original,)
        self._released_weight: tuple[nn.Parameter, torch.device] | None = None
        self._table_dir: tempfile.TemporaryDirectory | None = None

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
    ) -> torch.Tensor:
        """``v + conv`` ``[B, S, HC*H]`` for ``hidden_states [B, S, HC*H]`` and ``input_ids [B, S]``.

        ``cache``: a transformers ``Cache`` (read and updated as the original module does) or None
        (fresh sequences, nothing stored). ``conv_mask [B, S]``: 1 = token, 0 = padding.

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
        if torch.is_grad_enabled() and (
            hidden_states.requires_grad or any(p.requires_grad for p in layer.parameters())
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
    def _restore_original(self) -> nn.Module:
        """Give the original its table back (when it was released) and drop this module's table."""
        if self._released_weight is not None:
            param, device = self._released_weight
            table = self.layer.table
            with torch.no_grad():
                param.data = table.data.to(device=device, copy=True)
            self._released_weight = None
        if self.layer.table is not None:
            self.layer.table.close()
        self.layer.table = None
        if self._table_dir is not None:
            self._table_dir.cleanup()
            self._table_dir = None
        return self.original


def _children_of_type(model: nn.Module, cls) -> list[tuple[str, nn.Module, str, nn.Module]]:
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
    if table.scale is not None or table.storage_dtype != weight.dtype:
        raise InvalidArgumentError(
            f"{what}: release_weight needs a table that stores the module's rows exactly "
            f"({weight.dtype}, no scale), got a {table.format!r} table; the original could not be restored"
        )


def patch(
    model: nn.Module,
    table_tier: str | TableFactory = "memory",
    table_dir: str | os.PathLike | None = None,
    *,
    release_weight: bool | None = None,
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
            must store the rows exactly; :func:`unpatch` reads them back from it.

    Returns:
        ``model`` (patched in place).
    """
    if isinstance(table_tier, str):
        if table_tier not in TABLE_TIERS:
            raise InvalidArgumentError(
                f"table_tier must be one of {list(TABLE_TIERS)} or a Table factory, got {table_tier!r}"
            )
    elif not callable(table_tier):
        raise ArgumentTypeError(f"table_tier must be a str or a callable (weight, layer) -> Table, got {table_tier!r}")
    if table_dir is not None and table_tier != "mmap":
        raise InvalidArgumentError(f"table_dir is for table_tier='mmap', got table_tier={table_tier!r}")
    if patched_layers(model):
        raise InvalidArgumentError("model is already patched: call unpatch(model) first")
    found = _children_of_type(model, _hf_ple_class())
    if not found:
        raise InvalidArgumentError(f"{type(model).__name__} has no Qwen4ExpTextPLELayer module (ple_layer_ids empty?)")
    release = table_tier == "mmap" if release_weight is None else bool(release_weight)
    config = _model_ple_config(model)

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
            if table_tier == "memory":
                pass  # from_transformers already shares the weight as a MemoryTable
            elif table_tier == "mmap":
                path = out_dir / f"{qualname}{TABLE_SUFFIX}"
                layer.set_table(_write_mmap_table(layer, weight, path))
            else:
                table = table_tier(weight, layer)
                if not isinstance(table, Table):
                    raise ArgumentTypeError(f"the table factory returned {type(table).__name__}, expected a ple Table")
                layer.set_table(table)
            wrapper = PatchedPLELayer(layer, module.layer_idx, module, table_path=path)
            if release:
                _check_lossless(layer.table, weight, qualname)
                wrapper._released_weight = (param, param.device)
                del weight
                with torch.no_grad():
                    param.data = param.data.new_empty((0, param.shape[1]))
            setattr(parent, attr, wrapper)
            done.append((parent, attr, wrapper))
    except BaseException:
        for parent, attr, wrapper in reversed(done):
            setattr(parent, attr, wrapper._restore_original())
        if tmp is not None:
            tmp.cleanup()
        raise
    if done:
        done[0][2]._table_dir = tmp  # removed once, by the first wrapper unpatched
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Put the original ``Qwen4ExpTextPLELayer`` modules back (the same objects, with their weights;
    a released table is read back from the ple table). Table files in a caller's ``table_dir`` are
    kept; a temporary directory is removed. Returns ``model``."""
    found = _children_of_type(model, PatchedPLELayer)
    if not found:
        raise InvalidArgumentError(f"{type(model).__name__} has no patched PLE layer: nothing to unpatch")
    for _, parent, attr, wrapper in found:
        setattr(parent, attr, wrapper._restore_original())
    return model
