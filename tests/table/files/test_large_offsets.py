"""Row offsets past 2^31 and 2^32 bytes: every file tier reads the rows written there.

The published table in a 4-bit block format is 28.8 GB of rows (320,001,536 x 90 bytes); a row id
times the row size, a span's offset, or a pointer into a map truncated to 32 bits would read another
row. A sparse q4_0 file of 48 million rows (4.3 GB logical, a few MB on disk) puts its last rows past
2^32 bytes; rows written there (and around 2^31) come back bit for bit through the memory map, the
direct tier's two readers, and a cache in front of the direct tier, against the ``gguf`` package's
dequantization of the same blocks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ple.table import DirectTable, MmapTable
from ple.table.lookup import gather_dequant_reference
from tests.table._helpers import LAYOUT, write_sparse_table_file

ROWS = 48_000_000  # x 90 bytes = 4.32 GB of rows: the last 275,000 lie past 2^32 bytes
HEAD_DIM = 160
ROW_NBYTES = 90


def _blocks(ids: np.ndarray) -> np.ndarray:
    """Valid q4_0 rows for ``ids``: ``[n, 90]`` bytes, each block a finite fp16 scale and codes from the id."""
    g = np.random.default_rng(7)
    rows = g.integers(0, 256, (ids.size, ROW_NBYTES), dtype=np.uint8)
    half = rows.view(np.uint16)
    for j in range(5):
        half[:, 9 * j] = 0x2000 + (ids % 1024).astype(np.uint16)  # 2^-7 .. : finite, positive, one per id
    return rows


def _ids() -> torch.Tensor:
    """``[T, 16]``: rows past 2^32 bytes (the last row, rows whose 4 KiB span crosses 2^32), around
    2^31 bytes, the first rows, and unwritten rows between them (holes: zeros)."""
    at32 = (1 << 32) // ROW_NBYTES
    at31 = (1 << 31) // ROW_NBYTES
    picks = [0, 1, at31 - 1, at31, at31 + 1, at32 - 2, at32 - 1, at32, at32 + 1, at32 + 45, ROWS - 46, ROWS - 1]
    holes = [5, at31 + 1000, at32 + 1000, ROWS - 1000]
    ids = torch.tensor(picks + holes, dtype=torch.int64)
    return torch.stack([ids, ids.flip(0), ids.roll(3), ids.roll(7)])


@pytest.fixture(scope="module")
def sparse_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "q4.pletable"
    ids = _ids()
    written = torch.unique(ids[0, :12])
    rows = _blocks(written.numpy())
    write_sparse_table_file(path, ROWS, HEAD_DIM, "q4_0", LAYOUT, written, torch.from_numpy(rows), shard_rows=1 << 22)
    st = os.stat(path)
    assert st.st_size > (1 << 32) + 4096 and st.st_blocks * 512 < 64 << 20  # 4.3 GB logical, little on disk
    return path, dict(zip(written.tolist(), rows))


def _expected(ids: torch.Tensor, written: dict) -> torch.Tensor:
    """The rows of ``ids`` as the ``gguf`` package dequantizes their blocks (holes: zeros), fp32 ``[T, G*160]``."""
    flat = ids.reshape(-1).tolist()
    blocks = np.stack([written.get(r, np.zeros(ROW_NBYTES, dtype=np.uint8)) for r in flat])
    values = gguf_dequantize(blocks, GGMLQuantizationType.Q4_0).astype(np.float32)
    return torch.from_numpy(values).reshape(ids.shape[0], -1)


def _tiers(path):
    yield "mmap", MmapTable.open(path, LAYOUT)
    for reader in ("native", "threads"):
        yield f"direct {reader}", DirectTable(path, LAYOUT, reader=reader)
        yield f"direct {reader}, cached", DirectTable(path, LAYOUT, reader=reader, memory_budget=64 << 10)


def test_rows_past_4_gib_read_back_on_every_file_tier(sparse_file):
    path, written = sparse_file
    ids = _ids()
    want = _expected(ids, written)
    assert want.abs().sum() > 0
    for name, table in _tiers(path):
        try:
            for _ in range(2):  # the second time from the cache, where there is one
                got = table.lookup(ids, torch.float32)
                assert torch.equal(got, want), name
            bf = table.lookup(ids, torch.bfloat16)
            local = torch.arange(ids.numel()).reshape(ids.shape)
            raw = torch.from_numpy(np.stack([written.get(r, np.zeros(90, np.uint8)) for r in ids.reshape(-1).tolist()]))
            assert torch.equal(bf, gather_dequant_reference(raw, None, local, torch.bfloat16, format="q4_0")), name
        finally:
            table.close()
