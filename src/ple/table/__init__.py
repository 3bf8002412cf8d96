"""PLE table storage: formats, tiers, lookup, prefetch and table files.

A table maps int64 row ids to rows of ``[rows, head_dim]``; it knows nothing about hashing.
Tiers share the :class:`Table` interface (``lookup``, ``start_prefetch``); all but the sharded one
are :class:`StoredTable` (their whole ``data``/``scale`` are readable here):

- :class:`MemoryTable` — one tensor on the CPU or an accelerator;
- :class:`PinnedHostTable` — page-locked host memory read by the accelerator (needs CUDA);
- :class:`MmapTable` — a read-only memory map of a table file (see :mod:`ple.table.table_file`);
- :class:`CachedTable` — the hottest rows of another table held in memory (see :mod:`ple.table.cache`);
- :class:`DirectTable` — a table file read with ``pread`` from a worker pool, bypassing the page
  cache, with a bounded row cache (see :mod:`ple.table.direct`);
- :class:`ShardedTable` — rows split across the ranks of a ``torch.distributed`` group (see
  :mod:`ple.table.sharded`).
"""

from .base import StoredTable, Table, require_stored
from .cache import CachedTable
from .convert import compare_with_source, convert_layer
from .direct import DirectTable
from .formats import FORMATS, IdOutOfRangeError, check_ids, format_info, infer_format
from .lookup import gather_dequant, gather_dequant_reference, gather_dequant_torch
from .memory import MemoryTable, PinnedHostTable
from .mmap import MmapTable
from .prefetch import Prefetch, PrefetchError, PrefetchHandle
from .quantize import QuantStats, dequantize, quantization_error, quantize_global, quantize_rows
from .sharded import ShardedLookupError, ShardedPrefetch, ShardedTable, ShardGeometryError, load_sharded
from .table_file import (
    TABLE_SUFFIX,
    TableFileError,
    TableFileWriter,
    hash_layout,
    read_table_header,
    verify_table_file,
    write_sparse_table_file,
)

__all__ = [
    "CachedTable",
    "DirectTable",
    "FORMATS",
    "IdOutOfRangeError",
    "MemoryTable",
    "MmapTable",
    "PinnedHostTable",
    "Prefetch",
    "PrefetchError",
    "PrefetchHandle",
    "ShardGeometryError",
    "ShardedLookupError",
    "ShardedPrefetch",
    "ShardedTable",
    "StoredTable",
    "TABLE_SUFFIX",
    "QuantStats",
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
    "load_sharded",
    "quantization_error",
    "quantize_global",
    "quantize_rows",
    "read_table_header",
    "require_stored",
    "verify_table_file",
    "write_sparse_table_file",
]
