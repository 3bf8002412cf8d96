"""Shared pieces of the training tests: a small layer, tables of every tier and format, batches."""

from __future__ import annotations

from pathlib import Path

import torch

from ple.config import PLEConfig
from ple.layer import PLELayer
from ple.table import CachedTable, DirectTable, MemoryTable, MmapTable
from ple.table.files.table_file import TableFileWriter, hash_layout
from ple.table.formats.catalog import FORMATS
from tests.table._helpers import make_table

CFG = PLEConfig(
    hidden_size=16,
    hc_count=2,
    ple_embed_dim=128,  # head_dim 32: whole blocks for the block formats
    ngram_size=3,
    heads_per_ngram=2,
    vocab_size=200,
    eos_token_id=5,
    ngram_vocab_size_base=300,
    make_ngram_vocab_size_divisible_by=16,
    split_ngram_parts=3,
    ple_conv_kernel_size=4,
    ple_layer_ids=(1, 2),
)
TIERS = ("memory", "mmap", "direct", "cached")


def layer_weights(layer: PLELayer, seed: int) -> PLELayer:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    layer.refresh_weights()
    return layer


def new_layer(seed: int = 0, index: int = 0, dtype=torch.float32, table=None) -> PLELayer:
    return layer_weights(PLELayer(CFG, index, dtype=dtype, table=table), seed)


def table_data(fmt: str, index: int = 0, seed: int = 0):
    lay = CFG.layout(index)
    return make_table(fmt, lay.padded_rows, lay.head_dim, seed=seed, amp=0.5)


def write_table_file(path: Path, fmt: str, index: int = 0, seed: int = 0) -> Path:
    lay = CFG.layout(index)
    data, scale = table_data(fmt, index, seed)
    shard = lay.shard_rows
    with TableFileWriter(path, lay.padded_rows, lay.head_dim, fmt, shard, hash_layout(CFG.layout_fields(index))) as w:
        for k in range(-(-lay.padded_rows // shard)):
            a, b = k * shard, min(lay.padded_rows, (k + 1) * shard)
            w.write_shard(k, data[a:b], scale[a:b] if scale is not None and scale.dim() == 2 else scale)
    return path


def make_tier(tier: str, fmt: str, folder: Path, index: int = 0, seed: int = 0):
    """A table of PLE layer ``index`` of :data:`CFG` in format ``fmt`` on tier ``tier``."""
    if tier == "memory":
        data, scale = table_data(fmt, index, seed)
        return MemoryTable(data, scale, format=fmt)
    path = folder / f"t-{fmt}-{index}-{seed}.pletable"
    if not path.exists():
        write_table_file(path, fmt, index, seed)
    if tier == "mmap":
        return MmapTable.open(path)
    if tier == "direct":
        return DirectTable(path, memory_budget=1 << 16, direct=False, reader="threads", queue_depth=2)
    if tier == "cached":
        return CachedTable(MmapTable.open(path), 64)
    raise ValueError(tier)


def dequantized(table) -> torch.Tensor:
    """``[rows, head_dim]`` fp32: every row as the table's fp32 lookup gives it."""
    return table.lookup(torch.arange(table.rows).view(-1, 1), torch.float32)


def batch(seed: int, b: int = 2, s: int = 12, mask: bool = False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (b, s), generator=g)
    hidden = torch.randn(b, s, CFG.hc_hidden_size, generator=g)
    attn = None
    if mask:
        attn = torch.ones(b, s, dtype=torch.int64)
        attn[0, :3] = 0  # left padding
    return hidden, ids, attn


ALL_FORMATS = FORMATS
