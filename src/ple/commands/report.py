"""What several ``ple`` subcommands share: how they report (one JSON document, sizes, long values,
progress bars) and the arguments they have in common (``--json``, a table format, lists, PLE layer
indexes, the words for a GGUF path)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ple.config import PLEConfig
from ple.errors import CommandLineError, InvalidArgumentError
from ple.table.formats.catalog import accepted_names, format_argument

__all__ = [
    "GGUF_FILE",
    "LIST_SEPARATOR",
    "add_format_argument",
    "add_json_argument",
    "check_layer_index",
    "emit_json",
    "human",
    "layer_index_help",
    "short",
    "show_progress",
]

LIST_SEPARATOR = re.compile(r"[,\s]+")
"""Between the entries of a list given as one value (``3,17,248044``, ``"0 1"``): commas or spaces."""

GGUF_FILE = "GGUF file (model.gguf, or any part of a -0000k-of-0000N.gguf split set)"
"""A GGUF model, in the help of a path argument (``inspect``, ``convert``)."""


def add_json_argument(p: argparse.ArgumentParser) -> None:
    """``--json``: the same flag, with the same help, on every command that has it."""
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of the text report")


def add_format_argument(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    """``flag FORMAT``: a table format, by any of its names (:func:`ple.table.formats.catalog.format_argument`);
    ``{names}`` in ``help`` stands for the list of them."""
    p.add_argument(flag, type=format_argument, metavar="FORMAT", help=help.format(names=accepted_names()))


def show_progress() -> bool:
    """Progress bars only when someone watches: stderr is a terminal."""
    return sys.stderr.isatty()


def emit_json(doc: Any) -> None:
    print(json.dumps(doc, indent=1))


def human(n: float) -> str:
    """Bytes in binary units, as the README's tables give them (``47.7 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def short(v: Any) -> str:
    """A value as text, cut to 120 characters (a GGUF key's long list)."""
    text = str(v)
    return text if len(text) <= 120 else text[:117] + "..."


def layer_index_help(cfg: PLEConfig) -> str:
    """What the PLE layer indexes of ``cfg`` are, for a message refusing one."""
    ids = list(cfg.ple_layer_ids)
    if not ids:
        return "the config has no ple_layer_ids"
    pairs = ", ".join(f"{i} (decoder layer {d - 1}, ple_layer_ids[{i}] = {d})" for i, d in enumerate(ids))
    return f"PLE layer indexes are positions in ple_layer_ids: {pairs}"


def check_layer_index(cfg: PLEConfig, idx: int) -> None:
    """``--layer idx`` names a PLE layer of ``cfg``, or the command line is wrong (exit status 2)."""
    if not 0 <= idx < cfg.num_ple_layers:
        raise CommandLineError(f"--layer {idx}: no such PLE layer; {layer_index_help(cfg)}")


def check_destinations(
    outputs: Iterable[tuple[str, str | os.PathLike | None]], inputs: Iterable[str | os.PathLike]
) -> None:
    """Refuse, before any work, an output a command could not write at its end or must not write:
    ``outputs`` as ``(flag, path)`` (None: not given), ``inputs`` the files and folders the command
    reads. A path is refused (:class:`InvalidArgumentError`, exit 1, naming the flag and the path)
    when it is a folder, when its folder is missing, not a folder or not writable, when it names one
    of the inputs or an existing file inside an input folder (a checkpoint's weights, its config:
    never written over), or when two outputs name the same file."""
    given = [(flag, Path(path)) for flag, path in outputs if path is not None]
    sources = [Path(p).resolve() for p in inputs]
    seen: dict[Path, str] = {}
    for flag, path in given:
        where = path.resolve()
        if where in seen:
            raise InvalidArgumentError(f"{flag} {path}: the same file as {seen[where]}")
        seen[where] = flag
        if path.is_dir():
            raise InvalidArgumentError(f"{flag} {path}: is a folder, expected a file name")
        folder = path.parent
        if not folder.is_dir():
            what = "does not exist" if not folder.exists() else "is not a folder"
            raise InvalidArgumentError(f"{flag} {path}: its folder {folder} {what}")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise InvalidArgumentError(f"{flag} {path}: its folder {folder} is not writable")
        for src in sources:
            if where == src or (where.exists() and src.is_dir() and src in where.parents):
                raise InvalidArgumentError(f"{flag} {path}: one of the command's inputs ({src}); give another file")
