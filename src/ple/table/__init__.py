"""PLE table storage: formats, tiers, lookup, prefetch and table files.

A table maps int64 row ids to rows of ``[rows, head_dim]``; it knows nothing about hashing.
Tiers share the :class:`Table` interface (``lookup``, ``start_prefetch``):

- :class:`MemoryTable` — one tensor on the CPU or an accelerator;
- :class:`PinnedHostTable` — page-locked host memory read by the accelerator (needs CUDA);
- :class:`MmapTable` — a read-only memory map of a table file (see :mod:`ple.table.file`);
- :class:`CachedTable` — the hottest rows of another table held in memory (see :mod:`ple.table.cache`).
"""

from .base import Prefetch, PrefetchError, Table
from .cache import CachedTable
from .convert import compare_with_source, convert_layer
from .file import (
    MmapTable,
    TableFileError,
    TableFileWriter,
    hash_layout,
    read_table_header,
    verify_table_file,
    write_sparse_table_file,
)
from .formats import FORMATS, IdOutOfRangeError, check_ids, format_info, infer_format
from .lookup import gather_dequant, gather_dequant_reference, gather_dequant_torch
from .memory import MemoryTable, PinnedHostTable
from .quantize import QuantError, dequantize, quantization_error, quantize_global, quantize_rows

__all__ = [
    "CachedTable",
    "FORMATS",
    "IdOutOfRangeError",
    "MemoryTable",
    "MmapTable",
    "PinnedHostTable",
    "Prefetch",
    "PrefetchError",
    "QuantError",
    "Table",
    "TableFileError",
    "TableFileWriter",
    "check_ids",
    "compare_with_source",
    "convert_layer",
    "dequantize",
    "format_info",
    "gather_dequant",
    "gather_dequant_reference",
    "gather_dequant_torch",
    "hash_layout",
    "infer_format",
    "quantization_error",
    "quantize_global",
    "quantize_rows",
    "read_table_header",
    "verify_table_file",
    "write_sparse_table_file",
]
