"""Argument checks shared by the grouped RMS norm implementations."""

from __future__ import annotations

import torch

from ple.errors import ArgumentTypeError, InvalidArgumentError

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_norm_args(x: torch.Tensor, weight: torch.Tensor, group_size: int) -> None:
    if x.dim() < 1:
        raise InvalidArgumentError(f"grouped_rms_norm: x must have a channel dimension, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ArgumentTypeError(f"grouped_rms_norm: x.dtype={x.dtype}, expected a floating dtype")
    if weight.dtype not in _FLOAT_DTYPES:
        raise ArgumentTypeError(f"grouped_rms_norm: weight.dtype={weight.dtype}, expected a floating dtype")
    channels = x.shape[-1]
    if tuple(weight.shape) != (channels,):
        raise InvalidArgumentError(
            f"grouped_rms_norm: weight.shape={tuple(weight.shape)}, expected ({channels},) to match x"
        )
    if not isinstance(group_size, int) or group_size < 1:
        raise InvalidArgumentError(f"grouped_rms_norm: group_size={group_size!r}, expected a positive int")
    if channels % group_size != 0:
        raise InvalidArgumentError(
            f"grouped_rms_norm: channels={channels} is not a multiple of group_size={group_size}"
        )
    if weight.device != x.device:
        raise InvalidArgumentError(f"grouped_rms_norm: weight on {weight.device}, x on {x.device}; expected one device")
