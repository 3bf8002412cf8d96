"""Tables pickled (``torch.save`` of a layer, ``multiprocessing``): tensors in memory by value, a
memory-mapped file by its path (mapped and checked again), tiers with threads or ranks refused by name."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from ple.errors import UsageError
from ple.table import CachedTable, MemoryTable, MmapTable, TableFileError
from ple.table.tiers.direct import DirectTable
from tests.table._helpers import assert_same, make_table, random_ids, write_file

ROWS, HD = 3000, 40


@pytest.mark.parametrize("fmt", ["bf16", "int8_row", "q4_0"])
def test_memory_table_round_trips_with_a_fresh_prefetch_worker(fmt):
    hd = 64 if fmt == "q4_0" else HD
    data, scale = make_table(fmt, ROWS, hd)
    t = MemoryTable(data, scale, fmt)
    ids = random_ids(ROWS, 9, 3)
    want = t.lookup(ids, torch.float32)
    t.start_prefetch(ids, torch.float32).wait()  # a running prefetch worker is not pickled
    copy = pickle.loads(pickle.dumps(t))
    assert copy._engine is None and copy.format == fmt
    assert_same(copy.lookup(ids, torch.float32), want)
    assert_same(copy.start_prefetch(ids, torch.float32).wait(), want)
    t.close()
    copy.close()


def test_mmap_table_pickles_as_its_file(tmp_path, monkeypatch):
    data, scale = make_table("int8_row", ROWS, HD)
    path = write_file(tmp_path / "t.pletable", "int8_row", data, scale, shard_rows=1024)
    monkeypatch.chdir(tmp_path)
    t = MmapTable.open("t.pletable")  # a relative path: pickled as the absolute one
    t.prefetch_depth = 5
    ids = random_ids(ROWS, 9, 3)
    want = t.lookup(ids, torch.bfloat16)
    blob = pickle.dumps(t)
    assert len(blob) < 4096 < data.numel()  # the path and the header, not the rows
    monkeypatch.chdir(os.path.dirname(tmp_path))
    copy = pickle.loads(blob)
    assert isinstance(copy, MmapTable) and copy.header == t.header and copy.prefetch_depth == 5
    assert os.path.samefile(copy.path, path)
    assert_same(copy.lookup(ids, torch.bfloat16), want)
    copy.close()
    # another valid table file under that name (other rows: other checksums) is not the pickled one
    other, other_scale = make_table("int8_row", ROWS, HD, seed=9)
    write_file(tmp_path / "new.pletable", "int8_row", other, other_scale, shard_rows=1024)
    os.replace(tmp_path / "new.pletable", path)
    with pytest.raises(TableFileError, match="is not the table file that was pickled"):
        pickle.loads(blob)
    t.close()
    with pytest.raises(UsageError, match="was closed"):
        pickle.dumps(t)
    write_file(tmp_path / "t2.pletable", "int8_row", data, scale, shard_rows=1024)
    blob = pickle.dumps(MmapTable.open(tmp_path / "t2.pletable"))
    path = tmp_path / "t2.pletable"
    # reopened with the original's checks: a file cut short since is refused
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    with pytest.raises(TableFileError):
        pickle.loads(blob)


def test_tiers_with_threads_are_refused_by_name(tmp_path):
    data, scale = make_table("bf16", ROWS, HD)
    path = write_file(tmp_path / "t.pletable", "bf16", data, scale, shard_rows=1024)
    direct = DirectTable(path, reader="threads")
    cached = CachedTable(MemoryTable(data), 40)
    try:
        for table, why in ((direct, "reader threads"), (cached, "cache of rows")):
            with pytest.raises(UsageError, match=rf"{type(table).__name__}.*cannot be pickled: it .*{why}"):
                pickle.dumps(table)
    finally:
        direct.close()
        cached.close()
