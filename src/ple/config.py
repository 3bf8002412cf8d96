"""``PLEConfig``: the PLE fields of a ``qwen4_exp`` model configuration, validated.

Every field is checked for its type and range when a config is made (:class:`ConfigError` names
the field, the value and what is expected). Integer fields are bounded (:data:`LIMITS`) so that the
layout arithmetic stays exact in int64 and takes bounded time and memory: the table's row ids and
byte offsets fit an int64, the layout computes at most ``MAX_HEAD_PRIMES`` primes, and the loops
over shards, heads and n-gram orders stay short. The published model is far inside every bound.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Any

from ple.common.files import read_json
from ple.errors import PLEError
from ple.layout import Layout, compute_layout

__all__ = ["PLEConfig", "ConfigError", "MODEL_TYPES", "LIMITS", "MAX_HEADS", "MAX_HEAD_PRIMES", "architecture_names"]

LIMITS: dict[str, tuple[int, int, str]] = {
    "hidden_size": (1, 1 << 20, "a dimension of the hidden state"),
    "hc_count": (1, 1 << 10, "hidden copies; hc_count * hidden_size is a dimension"),
    "ple_embed_dim": (1, 1 << 20, "rows are ple_embed_dim / heads wide; it bounds the table's bytes"),
    "vocab_size": (1, (1 << 31) - 1, "token ids are int32 or int64 tensors: the vocabulary fits int32"),
    "ngram_size": (2, 64, "the C kernels hash n-grams of 2..64 tokens"),
    "heads_per_ngram": (1, 1024, "heads of one n-gram order"),
    "ngram_vocab_size_base": (2, 1 << 40, "head sizes are primes from here: rows and byte offsets fit int64"),
    "make_ngram_vocab_size_divisible_by": (1, 1 << 20, "padding rows"),
    "split_ngram_parts": (1, 1 << 20, "checkpoints and conversions walk every shard"),
    "ple_conv_kernel_size": (1, 1024, "conv taps; the conv window is (taps - 1) * ngram_size"),
    "seed": (0, (1 << 64) - 1, "the hash multipliers are derived from it modulo 2^64"),
}
"""``field: (minimum, maximum, why)`` for every integer field of :class:`PLEConfig`."""

MAX_HEADS = 1024
"""Most n-gram heads one PLE layer may have: ``(ngram_size - 1) * heads_per_ngram``."""

MAX_HEAD_PRIMES = 8192
"""Most heads over all PLE layers, ``len(ple_layer_ids) * heads``: the layout of PLE layer ``i``
takes the primes of every head of layers ``0..i``."""

MAX_PLE_LAYER_ID = 1 << 20
"""Largest (one-indexed) decoder layer id in ``ple_layer_ids``."""

_MAX_CONFIG_BYTES = 16 << 20


class ConfigError(PLEError, ValueError):
    """A configuration field has a value ple cannot use; the message names field and value."""


def _bad(field: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"invalid PLE config: {field}={value!r}: {expected}")


def architecture_names(doc: Any) -> list[str]:
    """The model classes a ``config.json`` document names in ``architectures``, as a list: none when
    the field is absent or null, ``[name]`` for a single string (a hand-written config; never read
    letter by letter), the list itself for a list of non-empty strings. Anything else is a
    :class:`ConfigError` naming the value."""
    value = doc.get("architectures") if isinstance(doc, dict) else None
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"config.json: architectures={value!r}: expected a class name or a list of class names")
    return list(value)


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
        if model_type is not None and (not isinstance(model_type, str) or model_type not in MODEL_TYPES):
            raise _bad("model_type", model_type, f"one of {list(MODEL_TYPES)}: ple reads qwen4_exp models")
        text = src.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise _bad("text_config", text, "a JSON object (the text model's fields)")
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
            if any(isinstance(e, bool) or not isinstance(e, int) for e in eos):
                raise _bad("eos_token_id", list(eos), "integer token ids")
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
            if f.name == "ple_layer_ids" and value is not None:
                if not isinstance(value, (list, tuple)):
                    raise _bad("ple_layer_ids", value, "a list of one-indexed decoder layer ids")
                value = tuple(value)
            kwargs[f.name] = value
        if kwargs.get("ple_layer_ids") is None:
            kwargs["ple_layer_ids"] = ()
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> PLEConfig:
        """From a ``config.json`` file or a directory that holds one."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise FileNotFoundError(f"no config.json at {p}")
        return cls.from_dict(read_json(p, "config", _MAX_CONFIG_BYTES, ConfigError))

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
        if isinstance(ple_layer_index, bool) or not isinstance(ple_layer_index, int) or ple_layer_index < 0:
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
        index. A table file records these fields and their hash (:func:`ple.table.files.table_file.hash_layout`)."""
        self.layout(ple_layer_index)  # validates the index
        return {**self.layout_key(), "ple_layer_index": ple_layer_index}

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        def bounded_int(field: str) -> None:
            v = getattr(self, field)
            lo, hi, why = LIMITS[field]
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise _bad(field, v, f"an integer >= {lo}")
            if v > hi:
                raise _bad(field, v, f"at most {hi} ({why})")

        for field in LIMITS:
            bounded_int(field)
        e = self.eos_token_id
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < self.vocab_size:
            raise _bad("eos_token_id", e, f"an integer in [0, vocab_size={self.vocab_size})")
        if self.num_heads > MAX_HEADS:
            raise _bad(
                "heads_per_ngram",
                self.heads_per_ngram,
                f"(ngram_size-1)*heads_per_ngram = {self.num_heads} heads, at most {MAX_HEADS}",
            )
        if self.ple_embed_dim % self.num_heads:
            raise _bad(
                "ple_embed_dim",
                self.ple_embed_dim,
                f"must be divisible by the number of n-gram heads (ngram_size-1)*heads_per_ngram = {self.num_heads}",
            )
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
            raise _bad("rms_norm_eps", eps, "a positive finite number")
        ids = self.ple_layer_ids
        if any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= MAX_PLE_LAYER_ID for i in ids):
            raise _bad(
                "ple_layer_ids", list(ids), f"one-indexed decoder layer ids (integers in [1, {MAX_PLE_LAYER_ID}])"
            )
        if len(set(ids)) != len(ids):
            raise _bad("ple_layer_ids", list(ids), "ids must be distinct")
        if len(ids) * self.num_heads > MAX_HEAD_PRIMES:
            raise _bad(
                "ple_layer_ids",
                f"{len(ids)} layers",
                f"{len(ids)} PLE layers x {self.num_heads} heads = {len(ids) * self.num_heads} head primes, "
                f"at most {MAX_HEAD_PRIMES}",
            )
        dt = self.ple_embedding_dtype
        if dt is not None and (not isinstance(dt, str) or dt not in _TABLE_DTYPES):
            raise _bad("ple_embedding_dtype", dt, f"one of {sorted(_TABLE_DTYPES)}")


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
