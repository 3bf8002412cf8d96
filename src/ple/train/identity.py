"""What a trained table sits on: the table under an adapter, and the table file it was read from.

Kept apart from :mod:`ple.train.adapter` (which writes it into adapter files) so that the data-parallel
checks (:mod:`ple.train.data_parallel`) compare the same identity without importing the adapter code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ple.checkpoint.classify import table_identity
from ple.errors import PLEError
from ple.table import Table
from ple.table.files.table_file import read_table_header
from ple.table.tiers.adapted import AdaptedTable

__all__ = ["base_of", "base_identity"]


def base_of(table: Table) -> Table:
    """The table under an adapter (the table itself when it has none)."""
    return table.base if isinstance(table, AdaptedTable) else table


def base_identity(table: Table) -> dict[str, Any] | None:
    """The table file under ``table`` (through caches): ``{"file", "format", "header_checksum",
    "identity"}``; the header checksum covers every shard's checksum, so it names the rows exactly, and
    the identity what the table was made from (:func:`ple.checkpoint.classify.table_identity`: what a
    merge checks). None for a table not read from a table file."""
    at: Any = base_of(table)
    for _ in range(8):
        path = getattr(at, "path", None)
        if isinstance(path, (str, os.PathLike)):
            header = getattr(at, "header", None)
            try:
                header = header if isinstance(header, dict) else read_table_header(path)
            except (OSError, PLEError):
                return None
            return {
                "file": str(Path(path).resolve()),
                "format": header["format"],
                "header_checksum": header["header_checksum"],
                "identity": table_identity(path, header).to_json(),
            }
        at = getattr(at, "backing", None)
        if at is None:
            return None
    return None
