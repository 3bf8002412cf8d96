"""What ple relies on inside transformers' ``qwen4_exp`` (checked, so a changed transformers fails
loudly instead of loading a random or a whole table).

Loading without the tables (transformers 5.24): ``from_pretrained`` builds the model on the meta
device, each ``Qwen4ExpTextPLELayer`` creating its ``Qwen4ExpTextNGramEmbedding`` by the name its
module holds. For the duration of the load :func:`tableless_load` puts :class:`TablelessNGramEmbedding`
under that name (what ``transformers.monkey_patching.apply_patches`` does for a registered patch
mapping, without its walk over every transformers module on each load): its ``ngram_embedding`` is a
:class:`TableStub` (no parameter, no buffer), so the table is not in the model's state dict,
transformers never reads its checkpoint tensors, and nothing allocates or initializes it. The
table's checkpoint keys (renamed from ``shard_{k}.weight`` by transformers' ``Concatenate``
converter) would be reported as unexpected: the qwen4_exp model classes'
``_keys_to_ignore_on_load_unexpected`` gain the pattern :data:`TABLE_KEYS` meanwhile.

Only the load that asked for it is affected. The name and the class attributes are process-wide,
so both changes check a context variable that :func:`tableless_load` sets in its own thread (and
``asyncio`` task): a model another thread builds meanwhile, a plain transformers load included,
gets transformers' own ``Qwen4ExpTextNGramEmbedding`` (the replacement runs the original
constructor and becomes an instance of the original class) and the original ignore patterns. A
lock serializes ple's loads; everything is restored on exit, errors included. transformers must
build the model in the thread that called ``from_pretrained`` (5.24 does); if it did not, the
tables would be built and :func:`ple.integrations.transformers.from_pretrained`'s check after the
load (every PLE module got a stub, no table parameter exists) fails loudly.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ple.errors import PLEError, UsageError

__all__ = [
    "TABLE_KEYS",
    "TableStub",
    "TransformersVersionError",
    "require_transformers",
    "tableless_load",
    "tableless_embedding_class",
    "hf_ple_class",
    "MIN_VERSION",
]

MIN_VERSION = (5, 24)
"""The oldest transformers release whose qwen4_exp internals ple's loader was built against."""

TABLE_KEYS = r"\.ple\.ple_embedding\.ngram_embedding\.(shard_\d+\.)?weight(_scale)?$"
"""Checkpoint keys of a PLE table and its scales (what the tableless load leaves unread)."""

_EMBEDDING = "Qwen4ExpTextNGramEmbedding"
_PATCH_KEY = f"^{_EMBEDDING}$"
_LOCK = threading.RLock()
_TABLELESS: contextvars.ContextVar[bool] = contextvars.ContextVar("ple_tableless_load", default=False)


class TransformersVersionError(PLEError, RuntimeError):
    """The installed transformers lacks what ple's qwen4_exp integration needs."""


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split(".")[:2]:
        m = re.match(r"\d+", p)
        parts.append(int(m.group(0)) if m else 0)
    return tuple(parts)


def require_transformers(extra: str = "hf"):
    """The qwen4_exp modeling module, after checking transformers' version and the internals ple
    uses; raises :class:`TransformersVersionError` otherwise. ``extra``: the ple extra whose install
    the message names, the one that makes the caller work (``demo`` for ``ple demo``, ``train`` for
    ``ple train``: they need more than transformers)."""
    try:
        import transformers
    except ImportError as e:
        raise TransformersVersionError(
            f"ple's transformers integration needs transformers >= 5.24 (pip install 'ple[{extra}]')"
        ) from e
    version = getattr(transformers, "__version__", "0")
    if _version_tuple(version) < MIN_VERSION:
        raise TransformersVersionError(
            f"transformers {version} is installed; ple's qwen4_exp integration needs >= "
            f"{'.'.join(map(str, MIN_VERSION))}"
        )
    try:
        from transformers.models.qwen4_exp import modeling_qwen4_exp as mq
    except ImportError as e:
        raise TransformersVersionError(f"transformers {version} has no qwen4_exp model: {e}") from e
    missing = [n for n in (_EMBEDDING, "Qwen4ExpTextPLELayer", "Qwen4ExpPreTrainedModel") if not hasattr(mq, n)]
    if missing:
        raise TransformersVersionError(
            f"transformers {version} lacks {missing}: ple's qwen4_exp loader does not support this version"
        )
    return mq


def hf_ple_class():
    """transformers' ``Qwen4ExpTextPLELayer``."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

    return Qwen4ExpTextPLELayer


class TableStub(nn.Module):
    """Shape-only stand-in for the ``nn.Embedding(rows, head_dim)`` of a PLE table that ple serves.

    ``weight`` is a meta tensor held as a plain attribute (not a parameter or buffer): it gives the
    table's shape and the model's dtype, and ``parameters()``, ``state_dict()`` and ``.to()`` skip it.
    Calling the stub raises: while the model is patched, ple's module does the lookups.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = torch.empty(num_embeddings, embedding_dim, device="meta", dtype=dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.weight.dtype}, table not in memory"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise UsageError(
            "this PLE table was never loaded into the model (ple.integrations.transformers.from_pretrained "
            "keeps it on disk): run the model patched, or unpatch(model, materialize=True) to load it"
        )


_CLASS_CACHE: dict[type, type] = {}


def tableless_embedding_class() -> type:
    """A subclass of transformers' ``Qwen4ExpTextNGramEmbedding`` whose table is a :class:`TableStub`."""
    mq = require_transformers()
    base = getattr(mq, _EMBEDDING)
    if base in _CLASS_CACHE:
        return _CLASS_CACHE[base]
    if getattr(base, "_ple_tableless", False):  # a failed load left the replacement in place
        base = base.__mro__[1]

    class TablelessNGramEmbedding(base):  # type: ignore[misc, valid-type]
        """``Qwen4ExpTextNGramEmbedding`` with its table replaced by a :class:`TableStub`, inside
        :func:`tableless_load`'s context; elsewhere (another thread's load) the original, unchanged."""

        _ple_tableless = True

        def __init__(self, *args, **kwargs):
            # the arguments of Qwen4ExpTextNGramEmbedding: (config, embedding_dim, layer_idx, ple_layer_index)
            if not _TABLELESS.get():
                # a build outside ple's load (another thread) while the name is swapped: the original
                base.__init__(self, *args, **kwargs)
                self.__class__ = base
                return
            # Built on meta, so that the table is not allocated even outside from_pretrained.
            with torch.device("meta"):
                super().__init__(*args, **kwargs)
            emb = self._modules.pop("ngram_embedding")
            assert emb is not None
            self.add_module("ngram_embedding", TableStub(emb.num_embeddings, emb.embedding_dim, emb.weight.dtype))
            # the three small hash buffers, rebuilt where the rest of the model is built (they are
            # loaded from the checkpoint, or initialized by _init_weights)
            dev = torch.get_default_device()
            for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
                buf = getattr(self, name)
                setattr(self, name, nn.Buffer(torch.zeros(buf.shape, dtype=buf.dtype, device=dev)))

    TablelessNGramEmbedding.__qualname__ = TablelessNGramEmbedding.__name__
    _CLASS_CACHE[base] = TablelessNGramEmbedding
    return TablelessNGramEmbedding


class _IgnoreTableKeys:
    """A class's ``_keys_to_ignore_on_load_unexpected`` while a tableless load runs: the class's
    own value, plus :data:`TABLE_KEYS` when read in the tableless load's context (transformers reads
    it while building the model, in ``post_init``, and keeps a copy on the instance)."""

    def __init__(self, value: Any):
        self.value = value

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if not _TABLELESS.get():
            return self.value
        return [*list(self.value or []), TABLE_KEYS]


def _model_classes(mq: Any) -> list[type]:
    base = mq.Qwen4ExpPreTrainedModel
    return [c for c in vars(mq).values() if isinstance(c, type) and issubclass(c, base)]


@contextlib.contextmanager
def tableless_load() -> Iterator[type]:
    """Within this block, in this thread, transformers builds qwen4_exp models without PLE tables and
    ignores their checkpoint keys; other threads' builds are unaffected (see the module docstring).
    Serialized by a lock; restored on exit."""
    mq = require_transformers()
    replacement = tableless_embedding_class()
    with _LOCK:
        original = getattr(mq, _EMBEDDING)
        if getattr(original, "_ple_tableless", False):
            original = original.__mro__[1]
        holders = [
            m
            for m in list(sys.modules.values())
            if getattr(m, "__name__", "").startswith("transformers") and getattr(m, _EMBEDDING, None) is original
        ]
        saved: list[tuple[type, bool, Any]] = []
        for cls in _model_classes(mq):
            if "_keys_to_ignore_on_load_unexpected" in vars(cls) or cls is mq.Qwen4ExpPreTrainedModel:
                present = "_keys_to_ignore_on_load_unexpected" in vars(cls)
                current = vars(cls).get("_keys_to_ignore_on_load_unexpected")
                saved.append((cls, present, current))
                inner = current.value if isinstance(current, _IgnoreTableKeys) else current  # a nested load
                setattr(cls, "_keys_to_ignore_on_load_unexpected", _IgnoreTableKeys(inner))  # noqa: B010
        token = _TABLELESS.set(True)
        try:
            for m in holders:
                setattr(m, _EMBEDDING, replacement)
            yield replacement
        finally:
            _TABLELESS.reset(token)
            for m in holders:
                setattr(m, _EMBEDDING, original)
            for cls, present, value in saved:
                if present:
                    setattr(cls, "_keys_to_ignore_on_load_unexpected", value)  # noqa: B010
                else:
                    delattr(cls, "_keys_to_ignore_on_load_unexpected")
