"""Host tables that ple allocates are advised onto 2 MiB pages (transparent huge pages)."""

from __future__ import annotations

import sys

import pytest
import torch

from ple.table import MemoryTable
from ple.table.tiers.memory import advise_huge_pages


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_an_empty_host_table_is_advised_onto_huge_pages_before_it_is_filled():
    table = MemoryTable.empty(40_000, 160, "bf16")  # 12.8 MB
    data = table.data
    first_huge = -(-data.data_ptr() // (2 << 20)) * (2 << 20)
    if not advise_huge_pages(data):
        pytest.skip("this kernel has no transparent huge pages")
    assert "hg" in _vm_flags(first_huge)  # the kernel holds the advice for the table's memory
    rows = torch.randn(40_000, 160).to(torch.bfloat16)
    data.copy_(rows)
    ids = torch.randint(0, 40_000, (5, 3))
    assert torch.equal(table.lookup(ids, torch.bfloat16), rows[ids.reshape(-1)].reshape(5, 480))


def test_memory_without_a_whole_huge_page_or_off_the_host_is_left_alone():
    from ple.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="takes a tensor, got ndarray"):
        advise_huge_pages(torch.empty(4).numpy())
    assert advise_huge_pages(torch.empty(1000)) is False  # 4 KB: no whole 2 MiB page
    assert advise_huge_pages(torch.empty(1 << 22, device="meta")) is False
    t = torch.arange(3 << 20, dtype=torch.float32)
    advise_huge_pages(t)
    assert torch.equal(t, torch.arange(3 << 20, dtype=torch.float32))  # values never change
