"""PLE table storage: formats, tiers, lookup, prefetch and table files.

A table maps int64 row ids to rows of ``[rows, head_dim]``; it knows nothing about hashing.
Tiers share the :class:`Table` interface (``lookup``, ``start_prefetch``); all but the sharded one
are :class:`StoredTable` (their whole ``data``/``scale`` are readable here):

- :class:`MemoryTable` — one tensor on the CPU or an accelerator;
- :class:`PinnedHostTable` — page-locked host memory read by the accelerator (needs CUDA);
- :class:`MmapTable` — a read-only memory map of a table file (see :mod:`ple.table.files.table_file`);
- :class:`CachedTable` — the hottest rows of another table held in memory (see :mod:`ple.table.tiers.cache`);
- :class:`DirectTable` — a table file read with direct reads (an io_uring, else a ``pread`` pool),
  bypassing the page cache, with a bounded row cache (see :mod:`ple.table.tiers.direct`);
- :class:`ShardedTable` — rows split across the ranks of a ``torch.distributed`` group (see
  :mod:`ple.table.tiers.sharded`).

The names below are what a user of the tiers needs; the rest (lookup twins, prefetch, conversion,
the table file writer, quantizers) is imported from its module.
"""

from ple.table.base import StoredTable, Table
from ple.table.files.table_file import TABLE_SUFFIX, TableFileError, read_table_header
from ple.table.files.verify import verify_table_file
from ple.table.formats.catalog import FORMATS, IdOutOfRangeError, format_info
from ple.table.formats.quantize import dequantize, quantize_rows
from ple.table.lookup.prefetch import PrefetchError
from ple.table.tiers.cache import CachedTable
from ple.table.tiers.direct import DirectTable, UringUnavailable
from ple.table.tiers.memory import MemoryTable, PinnedHostTable
from ple.table.tiers.mmap import MmapTable
from ple.table.tiers.sharded import ShardedLookupError, ShardedTable, ShardGeometryError

__all__ = [
    "CachedTable",
    "DirectTable",
    "FORMATS",
    "IdOutOfRangeError",
    "MemoryTable",
    "MmapTable",
    "PinnedHostTable",
    "PrefetchError",
    "ShardGeometryError",
    "ShardedLookupError",
    "ShardedTable",
    "StoredTable",
    "TABLE_SUFFIX",
    "Table",
    "TableFileError",
    "UringUnavailable",
    "dequantize",
    "format_info",
    "quantize_rows",
    "read_table_header",
    "verify_table_file",
]
