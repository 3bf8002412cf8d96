"""Argument checks shared by the gate implementations (written once, for every twin)."""

from __future__ import annotations

import torch

from ple.errors import ArgumentTypeError, InvalidArgumentError
from ple.ops.records import GateWeights

_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_gate_args(key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor, gate: GateWeights) -> tuple[int, int]:
    """Validate shapes, dtypes and devices; return ``(T, H)``."""
    hc_count = gate.hc_count
    norm_key_weight, norm_query_weight, norm_conv_weight = gate.norm_key, gate.norm_query, gate.norm_conv
    if not isinstance(hc_count, int) or hc_count < 1:
        raise InvalidArgumentError(f"gate: hc_count={hc_count!r}, expected a positive int")
    if value.dim() != 2:
        raise InvalidArgumentError(f"gate: value.shape={tuple(value.shape)}, expected [T, H]")
    tokens, hidden_size = value.shape
    width = hc_count * hidden_size
    for name, t in (("key", key), ("hidden", hidden)):
        if tuple(t.shape) != (tokens, width):
            raise InvalidArgumentError(
                f"gate: {name}.shape={tuple(t.shape)}, expected [T, HC*H] = ({tokens}, {width}) "
                f"(T={tokens}, H={hidden_size} from value, hc_count={hc_count})"
            )
    for name, t in (
        ("norm_key_weight", norm_key_weight),
        ("norm_query_weight", norm_query_weight),
        ("norm_conv_weight", norm_conv_weight),
    ):
        if tuple(t.shape) != (width,):
            raise InvalidArgumentError(f"gate: {name}.shape={tuple(t.shape)}, expected [HC*H] = ({width},)")
        if not t.is_floating_point():
            raise ArgumentTypeError(f"gate: {name}.dtype={t.dtype}, expected a floating dtype")
        if t.device != value.device:
            raise InvalidArgumentError(f"gate: {name} on {t.device}, value on {value.device}; expected one device")
    if value.dtype not in _ACT_DTYPES:
        raise ArgumentTypeError(f"gate: value.dtype={value.dtype}, expected one of float16, bfloat16, float32")
    for name, t in (("key", key), ("hidden", hidden)):
        if t.dtype != value.dtype:
            raise ArgumentTypeError(
                f"gate: {name}.dtype={t.dtype}, expected the activation dtype {value.dtype} of value"
            )
        if t.device != value.device:
            raise InvalidArgumentError(f"gate: {name} on {t.device}, value on {value.device}; expected one device")
    return tokens, hidden_size
