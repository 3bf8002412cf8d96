"""``torch.ops.ple.table_lookup``: any tier through an opaque reference, equal to ``Table.lookup``."""

from __future__ import annotations

import pytest
import torch

from ple.errors import InvalidArgumentError
from ple.table import CachedTable, MemoryTable, MmapTable
from ple.table.base import TableRef
from tests.table._helpers import ELEMENT, make_table, random_ids, write_file


@pytest.mark.parametrize("fmt", ELEMENT)
def test_operator_reads_every_tier(tmp_path, fmt):
    data, scale = make_table(fmt, 97, 5, seed=1)
    mem = MemoryTable(data, scale)
    mapped = MmapTable.open(write_file(tmp_path / "t.ple", fmt, data, scale, 40))
    ids = random_ids(97, 11, 3, seed=2)
    for table in (mem, mapped, CachedTable(mapped, 20)):
        ref = TableRef(table)
        for dtype in (torch.float32, torch.bfloat16):
            got = torch.ops.ple.table_lookup(ids, ref, 5, dtype)
            assert torch.equal(got, table.lookup(ids, dtype)), (type(table).__name__, dtype)
    mapped.close()


def test_opcheck_and_an_empty_reference():
    data, scale = make_table("fp8_row", 50, 4, seed=3)
    ref = TableRef(MemoryTable(data, scale))
    ids = random_ids(50, 6, 2, seed=4)
    torch.library.opcheck(
        torch.ops.ple.table_lookup.default, (ids, ref, 4, torch.bfloat16), test_utils=("test_faketensor",)
    )
    with pytest.raises(InvalidArgumentError, match="holds no table"):
        torch.ops.ple.table_lookup(ids, TableRef(), 4, torch.bfloat16)


def test_without_opaque_types_the_table_is_called_directly(monkeypatch):
    """On a torch without opaque reference types there is no operator; eager lookups still work."""
    import ple.table.base as base

    data, scale = make_table("int8_row", 40, 3, seed=5)
    ref = TableRef(MemoryTable(data, scale))
    ids = random_ids(40, 4, 2, seed=6)
    want = torch.ops.ple.table_lookup(ids, ref, 3, torch.float32)
    monkeypatch.setattr(base, "register_opaque_type", None)
    assert torch.equal(base.lookup_through(ids, ref, 3, torch.float32), want)
    with pytest.raises(InvalidArgumentError, match="holds no table"):
        base.lookup_through(ids, TableRef(), 3, torch.float32)
