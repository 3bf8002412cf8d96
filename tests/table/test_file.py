"""Table files: round trip in every format, atomic publication, overwrite rules, corruption detection."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ple.table
from ple.errors import UsageError
from ple.table import (
    FORMATS,
    MemoryTable,
    MmapTable,
    TableFileError,
    TableFileWriter,
    format_info,
    gather_dequant_reference,
    hash_layout,
    read_table_header,
    verify_table_file,
    write_sparse_table_file,
)
from ple.table.file import PARTIAL_SUFFIX

from ._helpers import DTYPES, LAYOUT, flip_byte, make_table, random_ids, write_file

SRC = str(Path(ple.table.__file__).resolve().parents[2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_every_format(tmp_path, fmt):
    rows, D, S = 103, 9, 25  # 5 shards, the last one short
    data, scale = make_table(fmt, rows, D, seed=11)
    path = write_file(tmp_path / "t.ple", fmt, data, scale, S, order=[3, 0, 4, 2, 1])
    assert not Path(str(path) + PARTIAL_SUFFIX).exists()
    table = MmapTable.open(path, expected_layout_hash=hash_layout(LAYOUT))
    assert (table.format, table.rows, table.head_dim) == (fmt, rows, D)
    assert table.data.dtype == format_info(fmt).storage_dtype
    assert torch.equal(table.data.view(torch.uint8), data.view(torch.uint8))
    if scale is None:
        assert table.scale is None
    else:
        assert torch.equal(table.scale, scale.float().reshape(table.scale.shape))
    assert table.nbytes == MemoryTable(data, scale).nbytes
    ids = random_ids(rows, 17, 5)
    for dtype in DTYPES:
        assert torch.equal(table.lookup(ids, dtype), gather_dequant_reference(data, scale, ids, dtype))
    assert verify_table_file(path) == []
    header = read_table_header(path)
    assert header["complete"] is True and header["num_shards"] == 5 and header["layout"] == LAYOUT
    assert header["data_offset"] % 4096 == 0 and header["scale"]["offset"] % 4096 == 0
    assert len(header["checksum"]["shards"]) == 5
    assert os.path.getsize(path) == header["file_nbytes"]


def test_layout_hash_mismatch_and_forms(tmp_path):
    data, scale = make_table("fp8", 10, 4)
    path = write_file(tmp_path / "t.ple", "fp8", data, scale, 4)
    MmapTable.open(path, expected_layout_hash=dict(reversed(list(LAYOUT.items()))))  # dict order is irrelevant
    with pytest.raises(TableFileError, match="layout hash .* does not match"):
        MmapTable.open(path, expected_layout_hash={**LAYOUT, "seed": 0})


def test_refuses_overwrite_without_force(tmp_path):
    d1, s1 = make_table("bf16", 10, 4, seed=1)
    d2, s2 = make_table("bf16", 10, 4, seed=2)
    path = write_file(tmp_path / "t.ple", "bf16", d1, s1, 5)
    with pytest.raises(FileExistsError, match="force=True"):
        TableFileWriter(path, 10, 4, "bf16", 5, LAYOUT)
    assert torch.equal(MmapTable.open(path).data, d1)
    write_file(path, "bf16", d2, s2, 5, force=True)
    assert torch.equal(MmapTable.open(path).data, d2)


def test_file_appearing_during_write_is_not_replaced(tmp_path):
    data, _ = make_table("fp32", 6, 3)
    path = tmp_path / "t.ple"
    w = TableFileWriter(path, 6, 3, "fp32", 6, LAYOUT)
    w.write_shard(0, data)
    path.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        w.close()
    assert path.read_bytes() == b"someone else's"
    assert not Path(str(path) + PARTIAL_SUFFIX).exists()


def test_missing_shard_or_scale_publishes_nothing(tmp_path):
    data, scale = make_table("int8_row", 30, 4)
    path = tmp_path / "t.ple"
    w = TableFileWriter(path, 30, 4, "int8_row", 10, LAYOUT)
    w.write_shard(2, data[20:], scale[20:])
    w.write_shard(0, data[:10], scale[:10])
    with pytest.raises(ValueError, match=r"1 of 3 shards were never written \(1\)"):
        w.close()
    assert not path.exists() and not Path(str(path) + PARTIAL_SUFFIX).exists()
    d8, s8 = make_table("fp8", 10, 4)
    w = TableFileWriter(path, 10, 4, "fp8", 10, LAYOUT)
    w.write_shard(0, d8)
    with pytest.raises(ValueError, match="needs a global scale"):
        w.close()
    assert not path.exists()


def test_exception_inside_writer_publishes_nothing(tmp_path):
    data, _ = make_table("fp16", 20, 4)
    path = tmp_path / "t.ple"
    with pytest.raises(RuntimeError, match="boom"):
        with TableFileWriter(path, 20, 4, "fp16", 10, LAYOUT) as w:
            w.write_shard(0, data[:10])
            raise RuntimeError("boom")
    assert not path.exists() and not Path(str(path) + PARTIAL_SUFFIX).exists()


def test_writer_refuses_bad_shards(tmp_path):
    data, scale = make_table("fp8_row", 20, 4)
    w = TableFileWriter(tmp_path / "t.ple", 20, 4, "fp8_row", 8, LAYOUT)
    with pytest.raises(ValueError, match=r"shard 1 \(rows \[8, 16\)\): expected rows of shape \[8, 4\]"):
        w.write_shard(1, data[:7], scale[:7])
    with pytest.raises(ValueError, match="stores torch.float8_e4m3fn, got rows of dtype torch.float32"):
        w.write_shard(1, data[8:16].float(), scale[8:16])
    with pytest.raises(ValueError, match=r"needs a float per-row scale \[8, 1\]"):
        w.write_shard(1, data[8:16])
    w.write_shard(1, data[8:16], scale[8:16])
    with pytest.raises(ValueError, match="already written"):
        w.write_shard(1, data[8:16], scale[8:16])
    w.write_shard(7, data[:0], scale[:0])  # an empty shard past the end is fine
    with pytest.raises(ValueError, match="past the table"):
        w.write_shard(7, data[:1], scale[:1])
    with pytest.raises(ValueError, match="sparse"):
        w.write_rows(torch.tensor([0]), data[:1], scale[:1])
    w.abort()
    with pytest.raises(ValueError, match="must not end with"):
        TableFileWriter(tmp_path / ("x.ple" + PARTIAL_SUFFIX), 20, 4, "fp8_row", 8, LAYOUT)


def test_global_scale_must_agree(tmp_path):
    data, scale = make_table("fp8", 20, 4)
    w = TableFileWriter(tmp_path / "t.ple", 20, 4, "fp8", 10, LAYOUT)
    w.write_shard(0, data[:10], scale)
    with pytest.raises(ValueError, match="disagrees"):
        w.write_shard(1, data[10:], scale * 2)
    w.write_shard(1, data[10:], scale.clone())
    w.close()
    assert float(MmapTable.open(w.path).scale[0]) == float(scale[0])


_CRASH_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    from ple.table import TableFileWriter
    path = sys.argv[1]
    w = TableFileWriter(path, 4000, 64, "bf16", 1000, "layout-h")
    w.write_shard(2, torch.ones(1000, 64, dtype=torch.bfloat16))
    w.write_shard(0, torch.ones(1000, 64, dtype=torch.bfloat16))
    print("written", flush=True)
    signal.pause()  # the parent kills us mid-write
    """
)


def test_killed_writer_leaves_only_a_refused_partial(tmp_path):
    path = tmp_path / "t.ple"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, str(path)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"written"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    partial = Path(str(path) + PARTIAL_SUFFIX)
    assert not path.exists()
    assert partial.exists()
    with pytest.raises(FileNotFoundError):
        MmapTable.open(path)
    with pytest.raises(TableFileError, match="unfinished"):
        MmapTable.open(partial)
    # Even under the final name, its header says incomplete.
    renamed = tmp_path / "renamed.ple"
    os.link(partial, renamed)
    with pytest.raises(TableFileError, match="incomplete"):
        MmapTable.open(renamed)
    assert any("incomplete" in p for p in verify_table_file(renamed))
    # A new writer replaces the stale partial.
    write_file(path, "bf16", torch.zeros(4000, 64, dtype=torch.bfloat16), None, 1000)
    assert verify_table_file(path) == []


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8_row"])
def test_flipped_byte_reported_with_shard_and_rows(tmp_path, fmt):
    rows, D, S = 50, 6, 12
    data, scale = make_table(fmt, rows, D, seed=4)
    path = write_file(tmp_path / "t.ple", fmt, data, scale, S)
    h = read_table_header(path)
    row = 30  # shard 2, rows [24, 36)
    flip_byte(path, h["data_offset"] + row * h["row_nbytes"] + 3)
    problems = verify_table_file(path)
    assert len(problems) == 1 and "shard 2 (rows [24, 36))" in problems[0], problems
    flip_byte(path, h["data_offset"] + row * h["row_nbytes"] + 3)  # restore
    assert verify_table_file(path) == []
    if fmt == "int8_row":
        flip_byte(path, h["scale"]["offset"] + 4 * 49)  # scale of the last row: shard 4
        problems = verify_table_file(path)
        assert len(problems) == 1 and "shard 4 (rows [48, 50))" in problems[0], problems
    if fmt == "fp8":
        flip_byte(path, h["scale"]["offset"] + 1)
        assert any("global scale" in p for p in verify_table_file(path))


def test_truncated_and_foreign_files(tmp_path):
    data, scale = make_table("fp32", 20, 4)
    path = write_file(tmp_path / "t.ple", "fp32", data, scale, 10)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(TableFileError, match="header says"):
        MmapTable.open(path)
    assert any("bytes, its header says" in p for p in verify_table_file(path))
    junk = tmp_path / "junk.ple"
    junk.write_bytes(b"not a table at all")
    with pytest.raises(TableFileError, match="bad magic"):
        MmapTable.open(junk)
    assert "bad magic" in verify_table_file(junk)[0]


def test_header_is_json_with_geometry(tmp_path):
    data, scale = make_table("fp8_row", 20, 4)
    path = write_file(tmp_path / "t.ple", "fp8_row", data, scale, 10)
    raw = path.read_bytes()
    assert raw[:8] == b"PLETABLE"
    n = int.from_bytes(raw[8:16], "little")
    header = json.loads(raw[16 : 16 + n])
    assert header["format"] == "fp8_row" and header["rows"] == 20 and header["head_dim"] == 4
    assert header["storage_dtype"] == "float8_e4m3fn" and header["scale"]["kind"] == "row"
    assert header["layout_hash"] == hash_layout(LAYOUT) and header["sparse"] is False


@pytest.mark.parametrize("fmt", ["fp8", "int8_row", "bf16"])
def test_sparse_file(tmp_path, fmt):
    rows, D = 1000, 8
    data, scale = make_table(fmt, 3, D)
    ids = torch.tensor([999, 0, 500])
    row_scale = scale if fmt == "fp8" else (None if scale is None else scale)
    path = write_sparse_table_file(tmp_path / "s.ple", rows, D, fmt, "h", ids, data, row_scale)
    table = MmapTable.open(path)
    assert table.sparse
    q = torch.tensor([[500, 999], [0, 1]])
    full = torch.zeros(rows, D, dtype=data.dtype)
    full[ids] = data
    full_scale = scale
    if scale is not None and scale.dim() == 2:
        full_scale = torch.zeros(rows, 1)
        full_scale[ids] = scale
    assert torch.equal(table.lookup(q, torch.float32), gather_dequant_reference(full, full_scale, q, torch.float32))
    assert any("no checksums" in p for p in verify_table_file(path))
    with pytest.raises(ValueError, match=r"row id 1000 is out of range"):
        write_sparse_table_file(tmp_path / "s2.ple", rows, D, fmt, "h", torch.tensor([1000, 0, 1]), data, row_scale)
    assert not (tmp_path / "s2.ple").exists()


def test_closed_mmap_table_refuses_lookups(tmp_path):
    data, scale = make_table("fp8_row", 20, 4)
    table = MmapTable.open(write_file(tmp_path / "t.ple", "fp8_row", data, scale, 10))
    ids = random_ids(20, 3, 2)
    table.lookup(ids, torch.float32)
    table.close()
    assert "MmapTable" in repr(table)
    with pytest.raises(UsageError, match="closed"):
        table.lookup(ids, torch.float32)
