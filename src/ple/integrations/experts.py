"""Per-expert checkpoint keys back onto transformers' fused MoE experts (``Qwen4ExpTextExperts``).

transformers holds a layer's experts fused (``...mlp.experts.gate_up_proj [E, 2*I, H]``,
``...mlp.experts.down_proj [E, H, I]``) and writes them one expert at a time
(``...mlp.experts.{e}.gate_proj.weight [I, H]``, ``up_proj.weight [I, H]``, ``down_proj.weight [H, I]``:
its weight conversion for ``qwen4_exp``, reverted by ``save_pretrained``). ``Trainer``'s resume (and
any ``model.load_state_dict(load_file(...))`` of such a folder) loads that file without the conversion.
:func:`accept_per_expert_keys` registers a ``load_state_dict`` pre-hook on every experts module of a
model that lays per-expert keys out as transformers' conversion does,
``gate_up_proj[e] = cat(gate_proj[e], up_proj[e])`` and ``down_proj[e] = down_proj[e]``, so they load
exactly; an incomplete or inconsistent set of per-expert keys is an error naming them, never skipped.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

_PER_EXPERT = re.compile(r"(\d+)\.(gate|up|down)_proj\.weight")
_HANDLE = "_ple_per_expert_hook"


def hf_experts_class() -> type | None:
    """transformers' ``Qwen4ExpTextExperts`` (None when this transformers has none)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp

    return getattr(modeling_qwen4_exp, "Qwen4ExpTextExperts", None)


def accept_per_expert_keys(model: nn.Module) -> int:
    """Register :func:`load_per_expert` on every experts module of ``model`` (once); the count of modules."""
    cls = hf_experts_class()
    if cls is None:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, cls):
            if getattr(module, _HANDLE, None) is None:
                setattr(module, _HANDLE, module.register_load_state_dict_pre_hook(load_per_expert))
            count += 1
    return count


def remove_per_expert_hooks(model: nn.Module) -> None:
    """Undo :func:`accept_per_expert_keys`."""
    for module in model.modules():
        handle: RemovableHandle | None = module.__dict__.pop(_HANDLE, None)
        if handle is not None:
            handle.remove()


def load_per_expert(
    module: Any, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """``load_state_dict`` pre-hook: ``prefix{e}.{gate,up,down}_proj.weight`` -> ``prefix{gate_up,down}_proj``."""
    given: dict[tuple[int, str], str] = {}
    for key in state_dict:
        if key.startswith(prefix):
            m = _PER_EXPERT.fullmatch(key[len(prefix) :])
            if m:
                given[(int(m.group(1)), m.group(2))] = key
    if not given:
        return
    tensors = {k: state_dict.pop(key) for k, key in given.items()}
    error = _check(module, tensors, prefix, state_dict)
    if error is not None:
        error_msgs.append(f"{prefix}{{e}}.{{gate,up,down}}_proj.weight: {error}")
        return
    n = module.gate_up_proj.shape[0]
    state_dict[prefix + "gate_up_proj"] = torch.stack(
        [torch.cat([tensors[(e, "gate")], tensors[(e, "up")]], dim=0) for e in range(n)]
    )
    state_dict[prefix + "down_proj"] = torch.stack([tensors[(e, "down")] for e in range(n)])


def _check(module: Any, tensors: dict[tuple[int, str], torch.Tensor], prefix: str, state_dict) -> str | None:
    """Why ``tensors`` (per-expert weights) cannot be fused into ``module``'s parameters, else None."""
    fused = [prefix + k for k in ("gate_up_proj", "down_proj") if prefix + k in state_dict]
    if fused:
        return f"given both per-expert keys and the fused {fused}"
    if getattr(module, "is_transposed", False):
        return "this experts module holds its weights transposed; ple lays out only transformers' default layout"
    n, two_i, h = module.gate_up_proj.shape
    want = {(e, p) for e in range(n) for p in ("gate", "up", "down")}
    lost = sorted(want - tensors.keys())
    extra = sorted(tensors.keys() - want)
    if lost or extra:
        return (
            f"the model has {n} experts; missing {_names(prefix, lost)} ({len(lost)}), "
            f"unexpected {_names(prefix, extra)} ({len(extra)})"
        )
    shapes = {"gate": (two_i // 2, h), "up": (two_i // 2, h), "down": tuple(module.down_proj.shape[1:])}
    for (e, p), t in sorted(tensors.items()):
        if tuple(t.shape) != shapes[p]:
            return f"{prefix}{e}.{p}_proj.weight has shape {list(t.shape)}, expected {list(shapes[p])}"
    return None


def _names(prefix: str, keys: list[tuple[int, str]]) -> list[str]:
    """The first keys' names (for a message)."""
    return [f"{prefix}{e}.{p}_proj.weight" for e, p in keys[:6]]
