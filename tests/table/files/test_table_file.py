"""Table files: round trip in every format, atomic publication, overwrite rules, corruption detection."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ple.table
from ple.errors import UsageError
from ple.table import MemoryTable, MmapTable, TableFileError, format_info, read_table_header, verify_table_file
from ple.table.files.table_file import PARTIAL_SUFFIX, TableFileWriter, _header_digest, hash_layout
from ple.table.lookup import gather_dequant_reference
from tests.table._helpers import (
    DTYPES,
    ELEMENT,
    LAYOUT,
    flip_byte,
    make_table,
    random_ids,
    write_file,
    write_sparse_table_file,
)

SRC = str(Path(ple.table.__file__).resolve().parents[2])


@pytest.mark.parametrize("fmt", ELEMENT)
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
    from ple.table.files.table_file import TableFileWriter
    path = sys.argv[1]
    w = TableFileWriter(path, 4000, 64, "bf16", 1000, "layout-h")
    w.write_shard(2, torch.ones(1000, 64, dtype=torch.bfloat16))
    w.write_shard(0, torch.ones(1000, 64, dtype=torch.bfloat16))
    print("written", flush=True)
    signal.pause()  # the parent kills us mid-write
    """
)


def partials(path: Path) -> list[Path]:
    return sorted(path.parent.glob(path.name + "*" + PARTIAL_SUFFIX))


def test_killed_writer_leaves_only_a_refused_partial(tmp_path):
    path = tmp_path / "t.ple"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, str(path)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"written"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert not path.exists()
    (partial,) = partials(path)
    assert partial.name.startswith("t.ple.") and partial.name.endswith(PARTIAL_SUFFIX)
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
    # The next writer of the path removes the stale partial (no process holds its lock).
    write_file(path, "bf16", torch.zeros(4000, 64, dtype=torch.bfloat16), None, 1000)
    assert verify_table_file(path) == [] and partials(path) == []


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


# ---------------------------------------------------------------------- two writers, stale partials


def test_two_writers_never_mix(tmp_path):
    """Two writers of one path each own a temporary file; the published file is one writer's whole output."""
    path = tmp_path / "t.ple"
    d1, _ = make_table("bf16", 30, 4, seed=1)
    d2, _ = make_table("bf16", 30, 4, seed=2)
    w1 = TableFileWriter(path, 30, 4, "bf16", 10, LAYOUT)
    w1.write_shard(0, d1[:10])
    # a second writer without force is refused while the first is at work
    with pytest.raises(FileExistsError, match="another writer is at work"):
        TableFileWriter(path, 30, 4, "bf16", 10, LAYOUT)
    # with force it writes its own temporary file; the last to finish wins, whole
    w2 = TableFileWriter(path, 30, 4, "bf16", 10, LAYOUT, force=True)
    assert w2.partial_path != w1.partial_path and len(partials(path)) == 2
    for k in range(3):
        w2.write_shard(k, d2[10 * k : 10 * k + 10])
    w1.write_shard(2, d1[20:])
    w1.write_shard(1, d1[10:20])
    w1.close()
    assert torch.equal(MmapTable.open(path).data, d1) and verify_table_file(path) == []
    w2.close()
    assert torch.equal(MmapTable.open(path).data, d2) and verify_table_file(path) == []
    assert partials(path) == []


def test_second_writer_without_force_cannot_publish(tmp_path):
    path = tmp_path / "t.ple"
    d1, _ = make_table("fp32", 8, 3, seed=1)
    d2, _ = make_table("fp32", 8, 3, seed=2)
    w1 = TableFileWriter(path, 8, 3, "fp32", 8, LAYOUT, force=True)
    w2 = TableFileWriter(path, 8, 3, "fp32", 8, LAYOUT, force=True)
    w2.force = False  # as if it had started first, without force
    w1.write_shard(0, d1)
    w2.write_shard(0, d2)
    w1.close()
    with pytest.raises(FileExistsError, match="another writer may have published it"):
        w2.close()
    assert torch.equal(MmapTable.open(path).data, d1) and partials(path) == []


_HOLDING_CHILD = textwrap.dedent(
    """
    import signal, sys, torch
    from ple.table.files.table_file import TableFileWriter
    w = TableFileWriter(sys.argv[1], 6, 2, "fp32", 6, "layout-h")
    print("holding", flush=True)
    signal.pause()
    """
)


def test_writer_in_another_process_is_seen(tmp_path):
    path = tmp_path / "t.ple"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen([sys.executable, "-c", _HOLDING_CHILD, str(path)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"holding"
        with pytest.raises(FileExistsError, match="another writer is at work"):
            TableFileWriter(path, 6, 2, "fp32", 6, LAYOUT)
        (theirs,) = partials(path)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    data, _ = make_table("fp32", 6, 2)
    write_file(path, "fp32", data, None, 6)  # the dead writer's file is stale now: removed
    assert not theirs.exists() and partials(path) == [] and verify_table_file(path) == []


@pytest.mark.parametrize("name", ["t.ple.partial", "t.ple.123-0123456789ab.partial"])
def test_stale_partial_symlink_is_never_followed(tmp_path, name):
    path = tmp_path / "t.ple"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / name).symlink_to(victim)
    data, scale = make_table("fp8_row", 12, 4)
    write_file(path, "fp8_row", data, scale, 5)
    assert victim.read_bytes() == b"precious"
    assert not os.path.lexists(tmp_path / name)
    assert not path.is_symlink() and path.is_file() and verify_table_file(path) == []


def test_symlink_at_the_final_path(tmp_path):
    path = tmp_path / "t.ple"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path.symlink_to(victim)
    data, _ = make_table("bf16", 6, 2)
    with pytest.raises(FileExistsError):
        write_file(path, "bf16", data, None, 6)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        write_file(tmp_path / "dangling", "bf16", data, None, 6)
    write_file(path, "bf16", data, None, 6, force=True)  # replaces the link itself
    assert victim.read_bytes() == b"precious" and not path.is_symlink()
    assert torch.equal(MmapTable.open(path).data, data)
    with pytest.raises(ValueError, match="is a folder"):
        write_file(tmp_path, "bf16", data, None, 6, force=True)


def test_removed_temporary_file_publishes_nothing(tmp_path):
    path = tmp_path / "t.ple"
    data, _ = make_table("fp16", 6, 2)
    w = TableFileWriter(path, 6, 2, "fp16", 6, LAYOUT)
    w.write_shard(0, data)
    os.unlink(w.partial_path)
    w.partial_path.write_bytes(b"someone else's file under that name")
    with pytest.raises(TableFileError, match="removed or replaced"):
        w.close()
    assert not path.exists() and w.partial_path.read_bytes() == b"someone else's file under that name"


def test_disk_full_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "t.ple"
    data, _ = make_table("fp32", 64, 8)
    real = os.pwrite

    def full(fd, buf, offset):
        if offset >= 4096:  # the header fits, the rows do not
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError) as err:
        write_file(path, "fp32", data, None, 16)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- one validator


def edit_header(path: Path, mutate, *, fix_checksum: bool = True) -> None:
    """Change a table file's header in place (``mutate(header)``); re-sign it unless told not to."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[8:16], "little")
    header = json.loads(raw[16 : 16 + n])
    room = header["data_offset"] - 16
    mutate(header)
    if fix_checksum:
        header["header_checksum"] = _header_digest(header)
    blob = json.dumps(header, indent=1).encode()
    assert len(blob) <= room
    raw[8:16] = len(blob).to_bytes(8, "little")
    raw[16 : 16 + room] = blob + b" " * (room - len(blob))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: h["scale"].__setitem__("kind", "global"),
        lambda h: h.__setitem__("format", "fp8"),
        lambda h: h.__setitem__("storage_dtype", "float8_e4m3fn"),
        lambda h: h.__setitem__("head_dim", 2),
        lambda h: h["checksum"].__setitem__("shards", []),
        lambda h: h.__setitem__("sparse", True),
        lambda h: h.__setitem__("layout_hash", "another"),
    ],
    ids=["scale_kind", "format", "storage_dtype", "head_dim", "no_checksums", "sparse", "layout_hash"],
)
def test_changed_header_is_detected(tmp_path, mutate):
    data, scale = make_table("int8_row", 20, 4)
    path = write_file(tmp_path / "t.ple", "int8_row", data, scale, 8)
    edit_header(path, mutate, fix_checksum=False)
    with pytest.raises(TableFileError, match="header checksum mismatch"):
        MmapTable.open(path)
    assert verify_table_file(path) == [f"{path}: header checksum mismatch: the header was changed or damaged"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h: h.__setitem__("data_offset", 4096 * 0 + 16), "'data_offset' is 16, expected an integer in"),
        (lambda h: h["scale"].__setitem__("offset", h["data_offset"]), "'scale.offset'"),
        (lambda h: h.__setitem__("head_dim", 2), "'row_nbytes' is 4, expected 2"),
        (lambda h: h.update(rows=2000, data_nbytes=8000, num_shards=250), "'scale.offset' is 8192"),
        (lambda h: h.update(file_nbytes=h["file_nbytes"] + 4096), "'file_nbytes'"),
        (lambda h: h["scale"].update(offset=h["scale"]["offset"] + 4096), "'file_nbytes'"),
        (lambda h: h.__setitem__("rows", 21), "'data_nbytes' is 80, expected 84"),
        (lambda h: h["scale"].__setitem__("kind", "global"), "'scale.kind' is 'global', expected 'row'"),
        (lambda h: h.__setitem__("format", "fp8_row"), "'storage_dtype' is 'int8', expected 'float8_e4m3fn'"),
        (lambda h: h["checksum"].__setitem__("shards", []), "expected a list of 3 checksums"),
        (lambda h: h.__setitem__("num_shards", 2), "'num_shards' is 2, expected 3"),
        (lambda h: h.__setitem__("shard_rows", 10), "'num_shards' is 3, expected 2"),
        (lambda h: h.__setitem__("rows", "20"), "'rows' is '20', expected an integer"),
        (lambda h: h.__setitem__("rows", 2**70), "'rows' is 1180591620717411303424, expected an integer in"),
        (lambda h: h.__setitem__("scale", None), "'scale' is None, expected a JSON object"),
        (lambda h: h.pop("checksum"), "'checksum' is '<missing>'"),
        (lambda h: h.__setitem__("format", ["fp8"]), "'format' is ['fp8'], expected one of"),
        (lambda h: h["layout"].__setitem__("seed", 0), "'layout'"),
        (lambda h: h.__setitem__("version", 1), "version 1 was written by an older ple"),
        (lambda h: h.__setitem__("version", 3), "version 3, this reader knows 2"),
    ],
)
def test_inconsistent_header_is_refused(tmp_path, mutate, message):
    """Headers that are signed (the checksum matches) but do not add up: refused by open and verify alike."""
    data, scale = make_table("int8_row", 20, 4)
    path = write_file(tmp_path / "t.ple", "int8_row", data, scale, 8)
    edit_header(path, mutate)
    with pytest.raises(TableFileError) as err:
        MmapTable.open(path)
    assert message in str(err.value)
    assert verify_table_file(path) == [str(err.value)]
    with pytest.raises(TableFileError):
        read_table_header(path)


def _leaves(d: dict, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))


_BAD_VALUES = [None, "x", -1, 0, 2**70, 1.5, True, [], {}, [1, 2, 3], "0" * 32]


@pytest.mark.parametrize("fmt", ["fp8", "int8_row"])
def test_no_header_field_breaks_a_reader(tmp_path, fmt):
    """Every field, set to every odd value (signed, so only the validator stands in the way): the
    readers raise TableFileError or serve exactly the original rows; never another exception."""
    data, scale = make_table(fmt, 20, 4)
    good = write_file(tmp_path / "good.ple", fmt, data, scale, 8).read_bytes()
    header = read_table_header(tmp_path / "good.ple")
    ids = random_ids(20, 5, 3)
    want = gather_dequant_reference(data, scale, ids, torch.float32)
    path = tmp_path / "t.ple"
    cases = 0
    for keys in _leaves(header):
        if keys == ("header_checksum",):
            continue
        for value in [*_BAD_VALUES, "<delete>"]:

            def mutate(h, keys=keys, value=value):
                for k in keys[:-1]:
                    h = h[k]
                if value == "<delete>":
                    del h[keys[-1]]
                else:
                    h[keys[-1]] = value

            path.write_bytes(good)
            edit_header(path, mutate)
            problems = verify_table_file(path)
            try:
                table = MmapTable.open(path)
            except TableFileError:
                assert problems, (keys, value)
            else:
                assert torch.equal(table.lookup(ids, torch.float32), want), (keys, value)
                table.close()
            cases += 1
    assert cases > 200


def test_resigned_header_of_another_geometry_fails_verify(tmp_path):
    """A header re-signed with a consistent but other geometry (head_dim 2 instead of 4) opens, but
    every shard's checksum disagrees: verify says so."""
    data, scale = make_table("int8_row", 20, 4)
    path = write_file(tmp_path / "t.ple", "int8_row", data, scale, 8)
    edit_header(path, lambda h: h.update(head_dim=2, row_nbytes=2, data_nbytes=40))
    assert MmapTable.open(path).head_dim == 2
    problems = verify_table_file(path)
    assert len(problems) == 3 and all("checksum mismatch" in p for p in problems)


def test_version_1_file_is_refused_with_a_way_out(tmp_path):
    data, _ = make_table("bf16", 10, 4)
    path = write_file(tmp_path / "t.ple", "bf16", data, None, 5)

    def as_v1(h):
        h["version"] = 1
        del h["header_checksum"]

    edit_header(path, as_v1, fix_checksum=False)
    with pytest.raises(TableFileError, match=r"version 1 was written by an older ple .*convert the table again"):
        MmapTable.open(path)


def test_empty_checksum_list_and_a_flipped_byte_is_not_ok(tmp_path):
    data, _ = make_table("bf16", 30, 4)
    path = write_file(tmp_path / "t.ple", "bf16", data, None, 10)
    h = read_table_header(path)
    flip_byte(path, h["data_offset"] + 5)
    edit_header(path, lambda h: h["checksum"].__setitem__("shards", []), fix_checksum=False)
    assert verify_table_file(path) != []
    edit_header(path, lambda h: h["checksum"].__setitem__("shards", []))
    (problem,) = verify_table_file(path)
    assert "a list of 3 checksums" in problem


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_global_scale_in_a_file(tmp_path, value):
    data, scale = make_table("fp8", 10, 4)
    path = write_file(tmp_path / "t.ple", "fp8", data, scale, 5)
    h = read_table_header(path)
    with open(path, "r+b") as f:
        f.seek(h["scale"]["offset"])
        f.write(struct.pack("<f", value))
    with pytest.raises(TableFileError, match="not a positive finite number"):
        MmapTable.open(path)
    assert verify_table_file(path) != []


@pytest.mark.parametrize("value", [0.0, -2.0, float("nan"), float("inf")])
def test_writer_refuses_bad_scales(tmp_path, value):
    data, scale = make_table("int8_row", 10, 4)
    bad = scale.clone()
    bad[7] = value
    with pytest.raises(ValueError, match=f"shard 1 .*the scale of row 7 is {value}, not a positive finite number"):
        write_file(tmp_path / "t.ple", "int8_row", data, bad, 5)
    assert list(tmp_path.iterdir()) == []
    d8, s8 = make_table("fp8", 10, 4)
    with pytest.raises(ValueError, match=f"the global scale: the scale is {value}"):
        write_file(tmp_path / "t.ple", "fp8", d8, torch.tensor([value]), 5)
    assert list(tmp_path.iterdir()) == []


def test_per_row_scale_damage_is_named_by_verify(tmp_path):
    """A per-row scale of zero with the shard checksum recomputed: verify still refuses the value."""
    data, scale = make_table("int8_row", 20, 4)
    path = write_file(tmp_path / "t.ple", "int8_row", data, scale, 8)
    h = read_table_header(path)
    with open(path, "r+b") as f:
        f.seek(h["scale"]["offset"] + 4 * 9)
        f.write(struct.pack("<f", 0.0))
        f.seek(h["data_offset"] + 8 * h["row_nbytes"])
        rows = f.read(8 * h["row_nbytes"])
        f.seek(h["scale"]["offset"] + 4 * 8)
        scales = f.read(32)
    digest = hashlib.blake2b(rows + scales, digest_size=16).hexdigest()
    edit_header(path, lambda hh: hh["checksum"]["shards"].__setitem__(1, digest))
    (problem,) = verify_table_file(path)
    assert "shard 1 (rows [8, 16)): the per-row scale of row 9 is 0.0, not a positive finite number" in problem


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_non_regular_table_path_is_refused_at_once(tmp_path, kind):
    path = tmp_path / "t.pletable"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    what = "a FIFO" if kind == "fifo" else "a folder"
    with pytest.raises(TableFileError, match=f"is {what}, not a regular file"):
        MmapTable.open(path)
    with pytest.raises(TableFileError, match=f"is {what}, not a regular file"):
        read_table_header(path)
    assert verify_table_file(path) == [f"table file {path} is {what}, not a regular file"]


# ---------------------------------------------------------------------- a mapped file changed in place

_CHANGED_CHILD = textwrap.dedent(
    """
    import os, sys, torch
    from ple.table import MmapTable, TableFileError
    for path, how in zip(sys.argv[1::2], sys.argv[2::2]):
        t = MmapTable.open(path)
        ids = torch.tensor([[0, 99], [50, 7]])
        before = t.lookup(ids, torch.float32)
        if how == "truncate":
            os.truncate(path, 4096)
        else:
            with open(path, "r+b") as f:  # a copy over it: same size, other rows, a new modification time
                f.seek(t.header["data_offset"])
                f.write(bytes(4 * 100))
        try:
            t.lookup(ids, torch.float32)
        except TableFileError as e:
            print(how, "refused:", e, flush=True)
        else:
            print(how, "served", flush=True)
    """
)


def test_mapped_file_changed_in_place_is_refused(tmp_path):
    """Without the check a truncated map dies of SIGBUS and an overwritten one serves other rows."""
    data, _ = make_table("fp32", 100, 4)
    args = []
    for how in ("truncate", "overwrite"):
        path = write_file(tmp_path / f"{how}.ple", "fp32", data, None, 50)
        old = time.time() - 3600
        os.utime(path, (old, old))  # a change now moves the modification time, whatever the clock's granularity
        args += [str(path), how]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", _CHANGED_CHILD, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    for line, how in zip(lines, ("truncate", "overwrite")):
        assert line.startswith(f"{how} refused:") and "changed in place while mapped" in line


def test_mapped_file_replaced_by_rename_keeps_serving(tmp_path):
    d1, _ = make_table("bf16", 40, 4, seed=1)
    d2, _ = make_table("bf16", 40, 4, seed=2)
    path = write_file(tmp_path / "t.ple", "bf16", d1, None, 20)
    table = MmapTable.open(path)
    write_file(path, "bf16", d2, None, 20, force=True)
    ids = random_ids(40, 6, 3)
    assert torch.equal(table.lookup(ids, torch.float32), gather_dequant_reference(d1, None, ids, torch.float32))
    table.check_file()
    assert torch.equal(MmapTable.open(path).data, d2)
    table.close()
    with pytest.raises(UsageError, match="closed"):
        table.check_file()
