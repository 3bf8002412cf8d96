"""argparse value types shared by the ``ple`` subcommands: a bad value is a usage error (exit 2) that
names the value and the range (values judged against the data, once read, raise
:class:`~ple.errors.CommandLineError`: exit 2 too). Integers (here and in token lists) are read by :func:`parse_int`."""

from __future__ import annotations

import argparse
import re

import torch

__all__ = [
    "positive_int",
    "non_negative_int",
    "int_between",
    "integer",
    "positive_float",
    "byte_size",
    "SIZE_UNITS",
    "shown_size",
    "device",
    "parse_int",
    "shown",
]

MAX_INT_DIGITS = 1000
"""Most digits :func:`parse_int` reads (far beyond any id or count; Python's own limit is 4300)."""

_ASCII_INT = re.compile(rf"-?[0-9]{{1,{MAX_INT_DIGITS}}}")


def parse_int(text: str) -> int | None:
    """The integer ``text`` spells in ASCII digits with an optional leading ``-`` and nothing else; None
    for anything else ``int()`` would also take (``"+5"``, ``"1_0"``, ``" 5"``, digits of other
    scripts such as ``"٣"``) or refuse, and for more than :data:`MAX_INT_DIGITS` digits."""
    return int(text) if _ASCII_INT.fullmatch(text) else None


def shown(text: str, limit: int = 60) -> str:
    """``repr(text)`` for a message, a long one cut short."""
    r = repr(text)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def _int_at_least(text: str, lo: int) -> int:
    v = integer(text)
    if v < lo:
        raise argparse.ArgumentTypeError(f"{v} is out of range: expected an integer >= {lo}")
    return v


def integer(text: str) -> int:
    """An integer in ASCII digits, optionally negative (:func:`parse_int`)."""
    v = parse_int(text)
    if v is None:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def int_between(lo: int, hi: int):
    """An argparse type: an integer in ``[lo, hi]`` (a bound on what a run can hold, named when hit)."""

    def check(text: str) -> int:
        v = integer(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is out of range: expected an integer in [{lo:,}, {hi:,}]")
        return v

    check.__name__ = f"integer in [{lo}, {hi}]"
    return check


def positive_float(text: str) -> float:
    """A finite number > 0 (``0.05``, ``3e-3``)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"{shown(text)} is out of range: expected a finite number > 0")
    return v


SIZE_UNITS = {
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
"""The units :func:`byte_size` reads (case aside): bytes, decimal (KB = 1000 B) and binary (KiB = 1024 B)."""

_SIZE = re.compile(r"([0-9]{1,30}(?:\.[0-9]{1,30})?) ?([A-Za-z]{1,3})")


def byte_size(text: str) -> int:
    """A size in bytes with its unit, the one convention of every ``ple`` option that takes a size
    (``--memory-budget``): ``64MiB``, ``1GiB``, ``512MB``, ``1.5KiB``, ``65536B`` (units:
    :data:`SIZE_UNITS`, case aside). A bare number is refused, but ``0`` (which needs none): ``64``
    would be 64 bytes to one reader and 64 MB to another."""
    t = text.strip()
    if t == "0":
        return 0
    m = _SIZE.fullmatch(t)
    units = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
    if m is None:
        if parse_int(t) is not None or _SIZE.fullmatch(t + "B") is not None:
            raise argparse.ArgumentTypeError(
                f"{shown(text)} has no unit: give a size with its unit, e.g. {t}MiB, {t}KiB or {t}B ({units})"
            )
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a size: expected e.g. 64MiB, 1GiB, 512MB ({units})")
    number, unit = m.groups()
    factor = SIZE_UNITS.get(unit.upper())
    if factor is None:
        raise argparse.ArgumentTypeError(f"{shown(text)}: unknown unit {unit!r}, expected one of {units}")
    whole, _, frac = number.partition(".")
    scaled = int(whole) * factor + (int(frac) * factor) // 10 ** len(frac) if frac else int(whole) * factor
    if frac and (int(frac) * factor) % 10 ** len(frac):
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a whole number of bytes")
    return scaled


def shown_size(n: int) -> str:
    """``n`` bytes as :func:`byte_size` reads them back, in the largest binary unit that holds it whole:
    ``64MiB``, ``1536B``."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % SIZE_UNITS[unit.upper()] == 0:
            return f"{n // SIZE_UNITS[unit.upper()]}{unit}"
    return f"{n}B"


def device(text: str) -> torch.device:
    """A torch device name (``cpu``, ``cuda``, ``cuda:1``); whether this machine has it is the
    command's check (a missing GPU is a problem of the environment, exit status 1, not of the command
    line)."""
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: ple runs on cpu or cuda devices")
    return dev
