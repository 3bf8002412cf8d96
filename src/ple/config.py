"""``PLEConfig``: the PLE fields of a ``qwen4_exp`` model configuration, validated."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

from .errors import PLEError
from .layout import Layout, compute_layout

__all__ = ["PLEConfig", "ConfigError", "MODEL_TYPES"]


class ConfigError(PLEError, ValueError):
    """A configuration field has a value ple cannot use; the message names field and value."""


def _bad(field: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"invalid PLE config: {field}={value!r}: {expected}")


@dataclasses.dataclass(frozen=True)
class PLEConfig:
    """PLE geometry and hashing parameters.

    ``ple_layer_ids`` are ONE-indexed decoder layers, as in the model's ``config.json``.
    ``eos_token_id`` is the single id that resets n-gram history (the first of a list).
    ``model_type`` is the top-level ``model_type`` of the ``config.json`` it was read from
    (``"qwen4_exp"``, multimodal, or ``"qwen4_exp_text"``), None when unknown; it decides the
    checkpoint key prefix of the PLE layers (:meth:`layer_prefix`), never the layout.
    """

    hidden_size: int
    eos_token_id: int
    vocab_size: int = 248320
    hc_count: int = 4
    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int = None  # type: ignore[assignment]  # None in the constructor: hidden_size
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    split_ngram_parts: int = 512
    ple_conv_kernel_size: int = 4
    seed: int = 1234
    rms_norm_eps: float = 1e-6
    ple_embedding_dtype: str | None = None
    model_type: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.ple_embed_dim is None:
            object.__setattr__(self, "ple_embed_dim", self.hidden_size)
        object.__setattr__(self, "ple_layer_ids", tuple(self.ple_layer_ids))
        self._validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PLEConfig:
        """From a ``config.json`` dict: nested ``text_config`` (multimodal) or flat."""
        if not isinstance(d, dict):
            raise ConfigError(f"invalid PLE config: expected a dict, got {type(d).__name__}")
        src = dict(d)
        model_type = src.get("model_type")
        if model_type is not None and model_type not in MODEL_TYPES:
            raise _bad("model_type", model_type, f"one of {list(MODEL_TYPES)}: ple reads qwen4_exp models")
        text = src.get("text_config")
        if isinstance(text, dict):
            merged = dict(text)
            if merged.get("eos_token_id") is None and src.get("eos_token_id") is not None:
                merged["eos_token_id"] = src["eos_token_id"]
            src = merged
        if "hidden_size" not in src:
            raise _bad("hidden_size", None, "required")
        eos = src.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            if not eos:
                raise _bad("eos_token_id", eos, "an empty list; PLE needs an end-of-sequence token")
            eos = eos[0]
        if eos is None:
            raise _bad("eos_token_id", None, "required: PLE resets its n-gram history at EOS")
        kwargs: dict[str, Any] = {"eos_token_id": eos, "model_type": model_type}
        for f in dataclasses.fields(cls):
            if f.name in ("eos_token_id", "model_type") or f.name not in src:
                continue
            value = src[f.name]
            if value is None and f.name in ("seed",):
                continue  # a null seed means the default, never 0
            kwargs[f.name] = tuple(value) if f.name == "ple_layer_ids" and value is not None else value
        if kwargs.get("ple_layer_ids") is None:
            kwargs["ple_layer_ids"] = ()
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> PLEConfig:
        """From a ``config.json`` file or a directory that holds one."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json at {p}")
        with open(p) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ple_layer_ids"] = list(self.ple_layer_ids)
        return d

    # ------------------------------------------------------------------ derived
    @property
    def num_heads(self) -> int:
        """G = (N-1) * heads_per_ngram."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int:
        return self.ple_embed_dim // self.num_heads

    @property
    def hc_hidden_size(self) -> int:
        return self.hc_count * self.hidden_size

    @property
    def conv_window(self) -> int:
        """Conv state length (K-1)*N (dilation is N)."""
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    @property
    def num_ple_layers(self) -> int:
        return max(1, len(self.ple_layer_ids))

    def layer_prefix(self, ple_layer_index: int) -> str:
        """The checkpoint key prefix of PLE layer ``ple_layer_index``: ``model.layers.{d}.ple.`` for a
        text-only model (``qwen4_exp_text``), ``model.language_model.layers.{d}.ple.`` otherwise, where
        ``d`` is its zero-based decoder layer."""
        self.layout(ple_layer_index)
        dec = self.ple_layer_ids[ple_layer_index] - 1 if self.ple_layer_ids else ple_layer_index
        stem = "model." if self.model_type == "qwen4_exp_text" else "model.language_model."
        return f"{stem}layers.{dec}.ple."

    def layout(self, ple_layer_index: int = 0) -> Layout:
        """Exact table layout of the ``ple_layer_index``-th PLE layer (0 = the first)."""
        if not isinstance(ple_layer_index, int) or ple_layer_index < 0:
            raise _bad("ple_layer_index", ple_layer_index, "a non-negative integer")
        if self.ple_layer_ids and ple_layer_index >= len(self.ple_layer_ids):
            raise _bad(
                "ple_layer_index",
                ple_layer_index,
                f"the config has {len(self.ple_layer_ids)} PLE layer(s) (ple_layer_ids={list(self.ple_layer_ids)})",
            )
        return _cached_layout(
            ple_layer_index,
            self.ngram_size,
            self.heads_per_ngram,
            self.vocab_size,
            self.seed,
            self.ngram_vocab_size_base,
            self.make_ngram_vocab_size_divisible_by,
            self.split_ngram_parts,
            self.ple_embed_dim,
        )

    def layout_key(self) -> dict[str, Any]:
        """The config fields that define every PLE layer's table layout."""
        return {
            k: getattr(self, k)
            for k in (
                "vocab_size",
                "ngram_size",
                "heads_per_ngram",
                "ngram_vocab_size_base",
                "make_ngram_vocab_size_divisible_by",
                "split_ngram_parts",
                "seed",
                "ple_embed_dim",
            )
        }

    def layout_fields(self, ple_layer_index: int) -> dict[str, Any]:
        """What identifies the table of PLE layer ``ple_layer_index``: :meth:`layout_key` plus the
        index. A table file records these fields and their hash (:func:`ple.table.hash_layout`)."""
        self.layout(ple_layer_index)  # validates the index
        return {**self.layout_key(), "ple_layer_index": ple_layer_index}

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        def pos_int(field: str, minimum: int = 1) -> None:
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise _bad(field, v, f"an integer >= {minimum}")

        for field in (
            "hidden_size",
            "vocab_size",
            "hc_count",
            "ple_embed_dim",
            "heads_per_ngram",
            "make_ngram_vocab_size_divisible_by",
            "split_ngram_parts",
        ):
            pos_int(field)
        pos_int("ngram_size", 2)
        pos_int("ple_conv_kernel_size", 1)
        pos_int("ngram_vocab_size_base", 2)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise _bad("seed", self.seed, "a non-negative integer")
        e = self.eos_token_id
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < self.vocab_size:
            raise _bad("eos_token_id", e, f"an integer in [0, vocab_size={self.vocab_size})")
        if self.ple_embed_dim % self.num_heads:
            raise _bad(
                "ple_embed_dim",
                self.ple_embed_dim,
                f"must be divisible by the number of n-gram heads (ngram_size-1)*heads_per_ngram = {self.num_heads}",
            )
        if not isinstance(self.rms_norm_eps, (int, float)) or not self.rms_norm_eps > 0:
            raise _bad("rms_norm_eps", self.rms_norm_eps, "a positive number")
        ids = self.ple_layer_ids
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 1 for i in ids):
            raise _bad("ple_layer_ids", list(ids), "one-indexed decoder layer ids (integers >= 1)")
        if len(set(ids)) != len(ids):
            raise _bad("ple_layer_ids", list(ids), "ids must be distinct")
        if self.ple_embedding_dtype is not None and self.ple_embedding_dtype not in _TABLE_DTYPES:
            raise _bad("ple_embedding_dtype", self.ple_embedding_dtype, f"one of {sorted(_TABLE_DTYPES)}")


MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
"""The ``model_type`` values of configs ple reads."""

_TABLE_DTYPES = {"bfloat16", "float16", "float32", "fp8", "float8_e4m3fn", "fp8_e4m3", "int8"}


@functools.lru_cache(maxsize=64)
def _cached_layout(*args: int) -> Layout:
    (idx, n, hpn, vocab, seed, base, div, parts, embed) = args
    return compute_layout(
        ple_layer_index=idx,
        ngram_size=n,
        heads_per_ngram=hpn,
        vocab_size=vocab,
        seed=seed,
        ngram_vocab_size_base=base,
        divisible_by=div,
        split_parts=parts,
        embed_dim=embed,
    )
