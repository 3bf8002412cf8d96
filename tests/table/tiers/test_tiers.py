"""Tier-specific behaviour: pinned host tables (CUDA only), accelerator tables, device placement."""

from __future__ import annotations

import pytest
import torch

from ple.table import MemoryTable, PinnedHostTable, Table
from ple.table.lookup import gather_dequant_reference
from tests.table._helpers import DTYPES, ELEMENT, make_table, random_ids

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_pinned_table_without_cuda_names_the_missing_cuda():
    data, scale = make_table("fp8", 10, 4)
    with pytest.raises(RuntimeError, match=r"PinnedHostTable needs CUDA.*torch.cuda.is_available\(\) is False"):
        PinnedHostTable(data, scale)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        PinnedHostTable.empty(10, 4, "fp8")


def test_every_tier_is_a_table():
    assert issubclass(MemoryTable, Table) and issubclass(PinnedHostTable, Table)
    with pytest.raises(TypeError):
        Table("bf16", 1, 1)  # abstract


@needs_cuda
@pytest.mark.parametrize("fmt", ELEMENT)
def test_pinned_and_device_tables_exact(fmt):
    data, scale = make_table(fmt, 1000, 160, seed=2)
    ids = random_ids(1000, 129, 16)
    tables = [PinnedHostTable(data, scale), MemoryTable(data.cuda(), None if scale is None else scale.cuda())]
    assert tables[0].data.is_pinned() and tables[0].device == torch.device("cpu")
    for table in tables + [MemoryTable(data, scale)]:
        for dtype in DTYPES:
            ref = gather_dequant_reference(data, scale, ids, dtype)
            assert torch.equal(table.lookup(ids.cuda(), dtype).cpu(), ref)
            assert torch.equal(table.lookup(ids, dtype), ref)
            h = table.start_prefetch(ids.cuda(), dtype)
            assert torch.equal(h.wait().cpu(), ref)
            h.release()
        table.close()


def test_host_rows_are_given_only_where_a_lookup_returns_them_unchanged(tmp_path):
    """`host_rows(dtype)`: a memory table's plain rows of that dtype (each row equal to the lookup of its
    id); None for another dtype, scaled rows, and a mapped file (whose lookups check the file)."""
    from ple.table import MmapTable
    from tests.table._helpers import write_file

    data, _ = make_table("bf16", 64, 16)
    table = MemoryTable(data)
    rows = table.host_rows(torch.bfloat16)
    assert rows is data
    ids = random_ids(64, 5, 3)
    assert torch.equal(table.lookup(ids, torch.bfloat16), rows[ids.reshape(-1)].reshape(5, 48))
    assert table.host_rows(torch.float32) is None
    fp8, scale = make_table("fp8", 64, 16)
    assert MemoryTable(fp8, scale).host_rows(torch.bfloat16) is None
    mapped = MmapTable.open(write_file(tmp_path / "t.ple", "bf16", data, None, 32))
    assert mapped.host_rows(torch.bfloat16) is None

    class Counting(MemoryTable):  # a subclass that looks up its own way: its lookups are the rows
        def _lookup_into(self, ids, out):
            super()._lookup_into(ids, out)

    assert Counting(data).host_rows(torch.bfloat16) is None
