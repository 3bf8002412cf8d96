"""``ple_adapters=``: a patched transformers model serving a named adapter per batch row.

``model(input_ids=..., ple_adapters=["legal", None, "medical"])`` and ``model.generate(...,
ple_adapters=[...])`` take one adapter name per batch row (None: the model's default adapter, or the
base table where there is none), as PEFT's ``adapter_names`` does for LoRA; the names are those of
``ple.train.load_adapter(model, path, name=...)``. Each row's logits and generated tokens are those of
the same batch on a model that serves that row's adapter as its default.

:func:`accept_row_adapters` registers, on the model, a forward pre-hook that takes ``ple_adapters``
out of the call's keyword arguments and checks it (a list of another length than the batch, or an
unknown name, is an :class:`InvalidArgumentError` naming it), and wraps ``generate`` (whose beams and
returned sequences repeat each input row); the patched PLE modules read the rows' adapter indices
(:func:`current_row_adapters`) for the duration of the call.
"""

from __future__ import annotations

import contextvars
import threading
import types
from typing import Any

import torch
from torch import nn

from ple.errors import InvalidArgumentError
from ple.table.tiers.named import DEFAULT_ADAPTER
from ple.train.serve import adapter_index

__all__ = ["accept_row_adapters", "current_row_adapters", "remove_row_adapters"]

_ROWS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("ple_row_adapters", default=None)
_HANDLES = "_ple_row_adapter_hooks"
_ACTIVE = 0
"""Calls with ``ple_adapters`` under way in the process (any thread): while none is, the patched modules
do not read the context variable (which compiled code cannot trace)."""
_COUNT = threading.Lock()
_CALLS = threading.local()


def current_row_adapters() -> torch.Tensor | None:
    """``[B]`` int64: the adapter index of each row of the model call under way (-1: the default), or None."""
    if not _ACTIVE:  # a plain global read: traced by torch.compile without a graph break
        return None
    return _ROWS.get()


def _enter(indices: torch.Tensor) -> contextvars.Token:
    global _ACTIVE
    with _COUNT:
        _ACTIVE += 1
    return _ROWS.set(indices)


def _leave(token: contextvars.Token) -> None:
    global _ACTIVE
    _ROWS.reset(token)
    with _COUNT:
        _ACTIVE -= 1


def _batch_rows(args: tuple, kwargs: dict[str, Any]) -> int | None:
    for key in ("input_ids", "inputs_embeds"):
        t = kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0])
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
        return int(args[0].shape[0])
    return None


def resolve(model: nn.Module, names, rows: int | None) -> torch.Tensor:
    """``[len(names)]`` int64 indices of ``names`` (one per row; None: -1), checked against ``rows``."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)):
        raise InvalidArgumentError(
            f"ple_adapters must be a list with one adapter name (or None) per batch row, got {names!r}"
        )
    if rows is not None and len(names) != rows:
        raise InvalidArgumentError(f"ple_adapters names {len(names)} rows, but the batch has {rows}: {list(names)!r}")
    out = []
    for name in names:
        if name is None:
            out.append(DEFAULT_ADAPTER)
        elif not isinstance(name, str):
            raise InvalidArgumentError(f"ple_adapters holds {name!r}: each entry is an adapter's name or None")
        else:
            out.append(adapter_index(model, name))
    return torch.tensor(out, dtype=torch.int64)


def _calls() -> list:
    """This thread's model calls under way, innermost last: the context token each set, or None."""
    stack = getattr(_CALLS, "stack", None)
    if stack is None:
        stack = _CALLS.stack = []
    return stack


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
    stack = _calls()
    stack.append(None)  # first: the forward hook pops one entry a call, even when this hook raises
    if "ple_adapters" not in kwargs:
        return None
    names = kwargs.pop("ple_adapters")
    if names is not None:
        stack[-1] = _enter(resolve(module, names, _batch_rows(args, kwargs)))
    return args, kwargs


def _post_hook(module: nn.Module, args, kwargs, output):
    stack = _calls()
    token = stack.pop() if stack else None
    if token is not None:
        _leave(token)
    return None


def _generate(self: nn.Module, *args, ple_adapters=None, **kwargs):
    original: Any = type(self).generate  # type: ignore[attr-defined]
    if ple_adapters is None:
        return original(self, *args, **kwargs)
    indices = resolve(self, ple_adapters, _batch_rows(args, kwargs))
    config = kwargs.get("generation_config") or getattr(self, "generation_config", None)
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    returned = kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1
    repeat = max(int(beams), int(returned))  # transformers expands each row this many times, in place
    token = _enter(indices.repeat_interleave(repeat) if repeat > 1 else indices)
    try:
        return original(self, *args, **kwargs)
    finally:
        _leave(token)


def accept_row_adapters(model: nn.Module) -> None:
    """Let ``model`` (patched) take ``ple_adapters=`` in its calls and in ``generate`` (see the module)."""
    if _HANDLES in model.__dict__:
        return
    model.__dict__[_HANDLES] = (
        model.register_forward_pre_hook(_pre_hook, with_kwargs=True),
        model.register_forward_hook(_post_hook, with_kwargs=True, always_call=True),
    )
    if callable(getattr(type(model), "generate", None)):
        model.__dict__["generate"] = types.MethodType(_generate, model)


def remove_row_adapters(model: nn.Module) -> None:
    """Undo :func:`accept_row_adapters`."""
    for handle in model.__dict__.pop(_HANDLES, ()):
        handle.remove()
    gen = model.__dict__.get("generate")
    if isinstance(gen, types.MethodType) and gen.__func__ is _generate:
        del model.__dict__["generate"]
