"""The published geometry: a sparse 320,001,536 x 160 fp8 table file (51 GB logical) served by MmapTable.

Only the rows the ids address are written (the rest of the file is a hole that reads as zeros),
the sparse writer computes no checksums, and the test checks every looked-up row exactly while
peak resident memory stays far below the table size.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from ple.table import MmapTable
from ple.table.files.table_file import hash_layout
from ple.table.lookup import gather_dequant_reference
from tests.table._helpers import write_sparse_table_file

pytestmark = [pytest.mark.scale, pytest.mark.perf]  # asserts peak memory and wall time

ROWS = 320_001_536  # R_pad of the published layout
HEAD_DIM = 160
HEADS = 16
SHARD_ROWS = 2_500_012
SCALE = 0.0123
RSS_LIMIT = 2 << 30


def scale_ids() -> torch.Tensor:
    """``[T, 16]`` row ids to serve: the n-gram ids of seeded token streams (64 requests of 64
    tokens, EOS in places) at the published geometry, plus one row of edge ids (first row, last
    row, a row past 2^31 bytes)."""
    from ple.config import PLEConfig
    from ple.ngram import fresh_context, ngram_ids

    cfg = PLEConfig(hidden_size=2560, hc_count=4, eos_token_id=248044, split_ngram_parts=128, ple_layer_ids=(2,))
    lay = cfg.layout(0)
    assert lay.padded_rows == ROWS and lay.head_dim == HEAD_DIM
    g = torch.Generator().manual_seed(20260101)
    tokens = torch.randint(0, cfg.vocab_size, (64 * 64,), generator=g)
    tokens[torch.randint(0, tokens.numel(), (200,), generator=g)] = cfg.eos_token_id
    qsl = torch.arange(0, 64 * 64 + 1, 64)
    ids = ngram_ids(tokens, qsl, fresh_context(64, lay, cfg.eos_token_id), lay, cfg.eos_token_id)
    edge = torch.tensor([[0, ROWS - 1, 2**31 // HEAD_DIM + 1, ROWS // 2] * (HEADS // 4)])
    return torch.cat([edge, ids])


def row_bytes(ids: torch.Tensor) -> torch.Tensor:
    """Deterministic fp8 row contents for ``ids [n]``: ``[n, HEAD_DIM]``, no NaN byte patterns."""
    cols = torch.arange(HEAD_DIM, dtype=torch.int64)
    v = (ids.reshape(-1, 1) * 1103515245 + cols * 12345 + 7) % 251
    v = torch.where((v & 0x7F) == 0x7F, v - 1, v)
    return v.to(torch.uint8).view(torch.float8_e4m3fn)


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def test_published_geometry_sparse_mmap(tmp_path, published_config):
    layout = published_config.layout(0)
    assert (layout.padded_rows, layout.head_dim, layout.num_heads, layout.shard_rows) == (
        ROWS,
        HEAD_DIM,
        HEADS,
        SHARD_ROWS,
    )
    layout_hash = hash_layout({**published_config.layout_key(), "ple_layer_index": 0})
    t0 = time.perf_counter()
    reset = _reset_peak_rss()
    ids = scale_ids()
    # Written rows: every id except those of the last 256 tokens, which must read as zeros.
    written = torch.unique(ids[:-256].reshape(-1))
    written_set = set(written.tolist())
    path = tmp_path / "published.ple"
    write_sparse_table_file(
        path,
        ROWS,
        HEAD_DIM,
        "fp8",
        layout_hash,
        written,
        row_bytes(written),
        torch.tensor([SCALE]),
        shard_rows=SHARD_ROWS,
    )
    t_write = time.perf_counter() - t0
    st = os.stat(path)
    assert st.st_size >= ROWS * HEAD_DIM  # 51.2 GB logical
    assert st.st_blocks * 512 < 2 << 30  # a few hundred MB really written

    table = MmapTable.open(path, expected_layout_hash=layout_hash)
    assert (table.rows, table.head_dim, table.format) == (ROWS, HEAD_DIM, "fp8")
    t1 = time.perf_counter()
    out = table.lookup(ids, torch.bfloat16)
    t_lookup = time.perf_counter() - t1
    h = table.start_prefetch(ids, torch.float32)
    out32 = h.wait(ids).clone()
    h.release()
    table.close()

    flat = ids.reshape(-1)
    raw = row_bytes(flat)
    unwritten = torch.tensor([int(i) not in written_set for i in flat.tolist()])
    raw.view(torch.uint8)[unwritten] = 0
    assert int(unwritten.sum()) > 0
    dense = raw  # the expected rows, in lookup order: look them up with ids 0..n-1
    local = torch.arange(flat.numel()).reshape(ids.shape)
    scale = torch.tensor([SCALE])
    assert torch.equal(out, gather_dequant_reference(dense, scale, local, torch.bfloat16))
    assert torch.equal(out32, gather_dequant_reference(dense, scale, local, torch.float32))

    hwm_kb, anon_kb = _status_kb("VmHWM"), _status_kb("RssAnon")
    elapsed = time.perf_counter() - t0
    print(
        f"\nscale test: {ROWS} x {HEAD_DIM} fp8 ({ROWS * HEAD_DIM / 1e9:.1f} GB logical, "
        f"{st.st_blocks * 512 / 1e6:.0f} MB on disk), {written.numel()} rows written in {t_write:.1f} s, "
        f"lookup of {flat.numel()} rows {t_lookup * 1e3:.0f} ms, total {elapsed:.1f} s; "
        f"peak RSS (VmHWM{'' if reset else ', whole session'}) {hwm_kb / 1024:.0f} MiB, "
        f"RssAnon {anon_kb / 1024:.0f} MiB"
    )
    if hwm_kb is not None and reset:
        assert hwm_kb * 1024 < RSS_LIMIT
    assert elapsed < 120
