"""The store under overlays and optimizer states (:class:`ple.table.tiers.rowstore.SlotStore`): what it reads
back is what was written, wherever a record lives, and memory holds the records used last."""

from __future__ import annotations

import os

import pytest
import torch

from ple.table.tiers.rowstore import SlotStore


@pytest.mark.parametrize("recency", [True, False])
@pytest.mark.parametrize("budget_records", [0, 1, 5, None])
def test_records_read_back_as_written_wherever_they_live(tmp_path, recency, budget_records):
    width = 3
    budget = None if budget_records is None else budget_records * width * 4
    store = SlotStore(width, memory_budget=budget, spill_dir=tmp_path, recency=recency)
    ref = torch.empty(0, width)
    g = torch.Generator().manual_seed(7)
    for _ in range(400):
        op = int(torch.randint(0, 3, (1,), generator=g))
        if op == 0 or store.count == 0:
            v = torch.randn(int(torch.randint(1, 8, (1,), generator=g)), width, generator=g)
            assert torch.equal(store.append(v), torch.arange(ref.shape[0], ref.shape[0] + v.shape[0]))
            ref = torch.cat([ref, v])
        elif op == 1:  # distinct slots, more than the frames at times
            slots = torch.randperm(store.count, generator=g)[: int(torch.randint(1, 9, (1,), generator=g))]
            v = torch.randn(slots.numel(), width, generator=g)
            store.write(slots, v)
            ref[slots] = v
        else:  # repeats allowed
            slots = torch.randint(0, store.count, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
            assert torch.equal(store.read(slots), ref[slots])
    if budget_records is None:
        assert store.spilled_slots == 0 and store.file_reads == store.file_writes == 0
    else:
        assert store.spilled_slots == store.count - min(budget_records, store.count) > 0
        assert store.memory_nbytes <= budget
    assert list(tmp_path.iterdir()) == []  # the spill file has no name
    store.close()


def test_memory_holds_the_records_used_last():
    store = SlotStore(2, memory_budget=3 * 2 * 4)  # three records in memory
    a, b, c = (store.append(torch.full((1, 2), float(i))) for i in range(3))
    assert store.read(a).tolist() == [[0.0, 0.0]] and store.file_reads == 0
    d = store.append(torch.full((1, 2), 3.0))  # b is the record used longest ago: it leaves
    assert store.file_writes == 1 and store.spilled_slots == 1
    reads = store.file_reads
    for s in (a, c, d):
        store.read(s)
    assert store.file_reads == reads  # a (read after b), c and d stayed
    assert store.read(b).tolist() == [[1.0, 1.0]] and store.file_reads == reads + 1  # b comes back...
    assert store.file_writes == 2  # ...and a, now the oldest, leaves (changed since it came: written)
    reads = store.file_reads
    store.read(a)
    assert store.file_reads == reads + 1


def test_a_record_read_back_and_unchanged_is_not_written_again():
    store = SlotStore(1, memory_budget=2 * 4)  # two records in memory
    x, y = store.append(torch.tensor([[1.0]])), store.append(torch.tensor([[2.0]]))
    z = store.append(torch.tensor([[3.0]]))  # x leaves (written)
    store.read(x)  # y leaves (written); x comes back unchanged
    store.read(y)  # z leaves (written)
    assert store.file_writes == 3
    store.append(torch.tensor([[4.0]]))  # x leaves again: the file has it already
    assert store.file_writes == 3
    store.write(y, torch.tensor([[5.0]]))  # y changed in memory
    store.read(x)  # the new record, the oldest, leaves (written: never in the file)
    assert store.file_writes == 4
    store.read(z)  # y, the oldest now, leaves: changed, so written
    assert store.file_writes == 5
    assert store.read(torch.cat([x, y, z])).tolist() == [[1.0], [5.0], [3.0]]


def test_without_recency_the_first_records_stay():
    store = SlotStore(2, memory_budget=2 * 2 * 4, recency=False)
    first = store.append(torch.zeros(2, 2))
    later = store.append(torch.ones(3, 2))
    assert store.spilled_slots == 3 and store.file_writes == 3
    store.read(later)
    reads = store.file_reads
    store.read(first)
    assert store.file_reads == reads  # never left


def _refuse_allocation(monkeypatch, code: int) -> None:
    def refuse(fd, offset, length):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", refuse)


def test_a_spill_file_without_room_raises_and_the_store_stays_as_it_was(tmp_path, monkeypatch):
    """The spill file's space is allocated before records go to it: no room raises SpillFileError
    (an OSError naming the folder) and the store keeps its records and slots; with room it goes on."""
    import errno

    from ple.table.tiers.rowstore import SpillFileError

    store = SlotStore(4, memory_budget=2 * 4 * 4, spill_dir=tmp_path)  # two records in memory
    first = torch.randn(2, 4)
    store.append(first)
    with monkeypatch.context() as m:
        _refuse_allocation(m, errno.ENOSPC)
        with pytest.raises(SpillFileError, match=f"{tmp_path}.*spill_dir=.*memory_budget=") as e:
            store.append(torch.randn(3, 4))
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path)
    assert store.count == 2 and torch.equal(store.read(torch.arange(2)), first)
    more = torch.randn(3, 4)
    assert torch.equal(store.append(more), torch.arange(2, 5))
    assert torch.equal(store.read(torch.arange(5)), torch.cat([first, more])) and store.spilled_slots == 3
    st = os.fstat(store._fd)
    assert st.st_size >= 5 * 4 * 4 and st.st_blocks * 512 >= st.st_size  # allocated, not sparse
    store.close()


def test_a_file_system_that_cannot_allocate_gets_the_zeros_written(tmp_path, monkeypatch):
    import errno

    _refuse_allocation(monkeypatch, errno.EOPNOTSUPP)
    store = SlotStore(4, memory_budget=0, spill_dir=tmp_path)
    values = torch.randn(10, 4)
    store.append(values)
    assert torch.equal(store.read(torch.arange(10)), values) and store.spilled_slots == 10
    store.close()
