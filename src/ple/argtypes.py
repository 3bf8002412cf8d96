"""argparse value types shared by the ``ple`` subcommands: a bad value is a usage error (exit 2) that
names the value and the range."""

from __future__ import annotations

import argparse

import torch

__all__ = ["positive_int", "non_negative_int", "device"]


def _int_at_least(text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"{v} is out of range: expected an integer >= {lo}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def device(text: str) -> torch.device:
    """A torch device name this machine has (``cpu``, ``cuda``, ``cuda:1``)."""
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: ple runs on cpu or cuda devices")
    return dev
