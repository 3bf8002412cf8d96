"""Hostile files under ple's library API: temporary files at names others can predict, table files
changed or damaged on disk, scales that do not survive the cast to float32, a native library cache
holding something else. Each case fails with an error ple raises on purpose (or is repaired), never
with a stray traceback, a followed link or a clobbered file."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

import ple.convert.dequantized as deq
from ple.commands.demo import synthesize_checkpoint
from ple.common.files import partial_dir, sweep_partial_dirs, write_atomically
from ple.config import PLEConfig
from ple.convert.dequantized import dequantize_checkpoint
from ple.convert.folder import RECORD_SUFFIX, prepare_table

SMALL = dict(
    hidden_size=16,
    hc_count=2,
    ple_layer_ids=(1,),
    ple_embed_dim=16,
    ngram_size=3,
    heads_per_ngram=2,
    vocab_size=300,
    ngram_vocab_size_base=300,
    make_ngram_vocab_size_divisible_by=64,
    split_ngram_parts=3,
    eos_token_id=2,
)


# ---------------------------------------------------------------------------------------------- atomic writes


def _plant_link(at: Path, victim: Path) -> None:
    victim.write_text("precious")
    at.symlink_to(victim)


def test_write_atomically_follows_no_link_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "a.json"
    _plant_link(tmp_path / "a.json.partial", tmp_path / "victim")  # the old fixed temporary name
    write_atomically(target, b"new")
    assert target.read_bytes() == b"new" and (tmp_path / "victim").read_text() == "precious"
    # a link at the name itself is replaced, never written through
    target.unlink()
    _plant_link(target, tmp_path / "victim2")
    write_atomically(target, b"newer")
    assert not target.is_symlink() and target.read_bytes() == b"newer"
    assert (tmp_path / "victim2").read_text() == "precious"

    def fail(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, b"lost")
    assert target.read_bytes() == b"newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "a.json.partial", "victim", "victim2"]


def test_partial_dirs_are_private_to_their_writer_and_swept_once_it_died(tmp_path):
    """Each writer builds in a folder of its own, locked while it works; the next writer removes the
    folders no process holds (a writer killed mid-way), older than a minute, and nothing else."""
    out = tmp_path / "out"
    old = time.time() - 3600
    dead = tmp_path / "out.4242-0123456789ab.partial"  # a killed writer's folder, an hour old
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "shard.safetensors").write_bytes(b"x" * 100)
    os.utime(dead, (old, old))
    young = tmp_path / "out.4243-0123456789ab.partial"  # just made: its writer may not have locked it yet
    young.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "out.4244-0123456789ab.partial").symlink_to(victim)
    other = tmp_path / "outer.4245-0123456789ab.partial"  # another name's folder
    other.mkdir()
    os.utime(other, (old, old))
    with partial_dir(out) as a:
        assert not dead.exists() and young.is_dir() and victim.is_dir() and other.is_dir()
        assert not (tmp_path / "out.4244-0123456789ab.partial").exists()
        os.utime(a, (old, old))  # old, but its writer is at work: never swept
        with partial_dir(out) as b:
            assert a != b and a.is_dir() and b.is_dir()
            assert a.name.endswith(".partial") and a.name.startswith("out.")
        assert sweep_partial_dirs(out) == [] and a.is_dir()
    with pytest.raises(RuntimeError, match="failed"):
        with partial_dir(out) as c:
            (c / "half").write_bytes(b"half")
            raise RuntimeError("failed")
    assert not c.exists()


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return synthesize_checkpoint(PLEConfig(**SMALL), tmp_path_factory.mktemp("src") / "src", seed=3, files=2)


def test_table_record_is_not_written_through_a_planted_link(fp8_checkpoint, tmp_path):
    from ple.checkpoint import check_checkpoint, table_file_name

    cfg = PLEConfig.from_pretrained(fp8_checkpoint)
    (entry,) = check_checkpoint(fp8_checkpoint, cfg).layers
    folder = tmp_path / "tables"
    folder.mkdir()
    record = folder / (table_file_name(entry.prefix) + RECORD_SUFFIX)
    _plant_link(record.with_name(record.name + ".partial"), tmp_path / "victim")  # the old fixed temporary name
    prepared = prepare_table(entry, cfg, folder)
    prepared.table.close()
    assert prepared.action == "converted"
    assert (tmp_path / "victim").read_text() == "precious"
    assert json.loads(record.read_text())["checkpoint"] == str(fp8_checkpoint.resolve())


def test_dequantize_ignores_a_link_at_the_old_temporary_name(fp8_checkpoint, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    (tmp_path / "dst.partial").symlink_to(victim, target_is_directory=True)
    dst = dequantize_checkpoint(fp8_checkpoint, tmp_path / "dst")
    assert sorted(p.name for p in victim.iterdir()) == ["keep"] and (victim / "keep").read_text() == "precious"
    assert (dst / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "dst.partial", "victim"]


def test_concurrent_dequantize_writers_do_not_clobber(fp8_checkpoint, tmp_path, monkeypatch):
    """A second writer that starts and finishes while the first is mid-way: the second's copy is
    published whole, the first raises FileExistsError and leaves nothing behind."""
    from ple.checkpoint import load_ple_weights

    dst = tmp_path / "dst"
    real = deq._dequantize_file
    calls = []

    def interleaved(reader, h, out, *a, **k):
        calls.append(out)
        if len(calls) == 1:  # the first writer, before its first file: another writer runs to the end
            monkeypatch.setattr(deq, "_dequantize_file", real)
            dequantize_checkpoint(fp8_checkpoint, dst)
        return real(reader, h, out, *a, **k)

    monkeypatch.setattr(deq, "_dequantize_file", interleaved)
    with pytest.raises(FileExistsError, match="another writer finished first"):
        dequantize_checkpoint(fp8_checkpoint, dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
    cfg = PLEConfig.from_pretrained(dst)
    want = load_ple_weights(fp8_checkpoint, cfg)[0].table
    got = load_ple_weights(dst, cfg)[0].table
    assert torch.equal(got.data, want.data.to(torch.bfloat16) * want.scale.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------- native library cache

_ONE_KERNEL_C = "int ple_gate_conv(void) { return 0; }\n"  # ple_ngram_ids is missing
_BOTH_KERNELS_C = _ONE_KERNEL_C + (
    "int ple_ngram_ids(void) { return 0; }\n"
    "int ple_quant_lookup(void) { return 0; }\n"
    "int ple_gather_rows(void) { return 0; }\n"
    "int ple_gather_lut(void) { return 0; }\n"
    "long long ple_overlay_rows(void) { return 0; }\n"
    # the instruction-set entry points (the loader sets "auto" through ple_set_isa: 0 = done)
    "int ple_isa_available(int isa) { return isa == 0; }\n"
    "int ple_set_isa(int isa) { (void)isa; return 0; }\n"
    "int ple_current_isa(void) { return 0; }\n"
    # the fused kernel's prefetch plan (the loader sets "auto": -1)
    "int ple_set_prefetch_lines(long long lines) { (void)lines; return 0; }\n"
    "long long ple_prefetch_lines(void) { return 0; }\n"
    "int ple_set_decode_tiles(int on) { (void)on; return 0; }\n"
    "int ple_decode_tiles(void) { return 1; }\n"
    "long long ple_tile_rows(void) { return 0; }\n"
    "int ple_team_kind(void) { return 0; }\n"
    "void ple_team_after_fork(void) {}\n"
    # the session's per-slot arrays
    "int ple_slots_read(void) { return 0; }\n"
    "void ple_slots_advance(void) {}\n"
    "long long ple_first_outside(void) { return -1; }\n"
    "int ple_gate_conv_backward(void) { return 0; }\n"
    # the direct tier's reader
    "int ple_reader_new(void) { return 0; }\n"
    "int ple_reader_read(void) { return 0; }\n"
    "int ple_reader_reads(void) { return 0; }\n"
    "void ple_reader_free(void) {}\n"
    "int ple_uring_compiled(void) { return 0; }\n"
    "int ple_uring_new(void) { return 0; }\n"
    "int ple_uring_read(void) { return 0; }\n"
    "void ple_uring_free(void) {}\n"
    # the table conversion kernels
    "int ple_encode_rows(void) { return 0; }\n"
    "long long ple_first_nonfinite(void) { return 0; }\n"
    # ple eval's passes
    "int ple_eval_reference(void) { return 0; }\n"
    "int ple_eval_compare(void) { return 0; }\n"
)


@pytest.fixture
def libraries(tmp_path) -> tuple[Path, Path]:
    """Two shared libraries: one exporting only ple_gate_conv, one exporting every name the loader
    checks (nothing calls the kernels here). Needs a C compiler."""
    import shutil
    import subprocess

    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler to build the planted library with")
    out = []
    for name, code in (("one", _ONE_KERNEL_C), ("both", _BOTH_KERNELS_C)):
        (tmp_path / f"{name}.c").write_text(code)
        lib = tmp_path / f"{name}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / f"{name}.c")], check=True, timeout=120)
        out.append(lib)
    return out[0], out[1]


def _copying_compiler(tmp_path: Path, library: Path) -> Path:
    """A stand-in for ``$CC`` whose every build is a copy of ``library`` (builds take no time)."""
    cc = tmp_path / "copy-cc"
    cc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "copy cc 1"; exit 0; fi\n'
        'while [ "$#" -gt 0 ]; do if [ "$1" = "-o" ]; then cp "' + str(library) + '" "$2"; exit $?; fi; shift; done\n'
        "exit 1\n"
    )
    cc.chmod(0o755)
    return cc


@pytest.fixture
def native_state(monkeypatch, tmp_path):
    """A clean build state with its own cache folder."""
    import ple.kernels.native as native_build

    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PLE_NATIVE", raising=False)
    for name, value in (("_lib", None), ("_error", None), ("_warned", False), ("_library_file", None)):
        monkeypatch.setattr(native_build, name, value)
    return native_build


def test_cached_library_lacking_a_kernel_is_rebuilt(native_state, libraries, tmp_path, monkeypatch):
    """A library in the cache that matches its record but lacks a kernel (another build under the
    same name) is a broken cache: rebuilt, never an AttributeError."""
    import hashlib

    one, both = libraries
    monkeypatch.setenv("CC", str(_copying_compiler(tmp_path, both)))
    native_state.library()
    (cached,) = (tmp_path / "cache").glob("*.so")
    planted = one.read_bytes()
    cached.write_bytes(planted)
    Path(str(cached) + ".sha256").write_text(f"{hashlib.sha256(planted).hexdigest()} {len(planted)}\n")
    monkeypatch.setattr(native_state, "_lib", None)
    lib = native_state.library()
    assert lib.ple_ngram_ids.argtypes and lib.ple_gate_conv.argtypes
    assert cached.read_bytes() == both.read_bytes()  # repaired


def test_fresh_build_lacking_a_kernel_is_a_failed_build(native_state, libraries, tmp_path, monkeypatch):
    """A compiler whose library lacks a kernel: the build failed (NativeUnavailable naming the kernel;
    available() warns once and ple falls back to its PyTorch paths), and nothing is cached."""
    import warnings

    monkeypatch.setenv("CC", str(_copying_compiler(tmp_path, libraries[0])))
    with pytest.raises(native_state.NativeUnavailable, match="lacks the kernel ple_ngram_ids"):
        native_state.library()
    monkeypatch.setattr(native_state, "_error", None)
    with pytest.warns(RuntimeWarning, match="lacks the kernel ple_ngram_ids"):
        assert not native_state.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native_state.available()
    assert not list((tmp_path / "cache").glob("*.so"))


# ---------------------------------------------------------------------------------------------- scales


@pytest.mark.parametrize(
    "fmt, value, shown",
    [
        ("int8_row", 1e39, "1e+39 (inf as float32)"),
        ("fp8_row", 1e-50, "1e-50 (0.0 as float32)"),
        ("fp8", 1e39, "1e+39 (inf as float32)"),
        ("int8_row", float("nan"), "nan"),
    ],
)
def test_scales_are_checked_as_float32(fmt, value, shown):
    """A float64 scale is checked after the cast to the float32 a table keeps: 1e39 (inf) and 1e-50
    (zero) are refused by value, never served as inf or zero rows."""
    from ple.errors import InvalidArgumentError
    from ple.table import MemoryTable

    storage = torch.int8 if fmt == "int8_row" else torch.float8_e4m3fn
    data = torch.ones(4, 3, dtype=storage)
    shape = (1,) if fmt == "fp8" else (4, 1)
    scale = torch.full(shape, 0.5, dtype=torch.float64)
    scale.view(-1)[-1] = value
    row = "" if fmt == "fp8" else " of row 3"
    with pytest.raises(InvalidArgumentError, match=re.escape(f"'{fmt}' table: the scale{row} is {shown}, not a")):
        MemoryTable(data, scale, fmt)


def test_other_float_scales_are_kept_as_float32():
    from ple.table import MemoryTable

    data = torch.randint(-127, 128, (5, 3), dtype=torch.int8)
    scale = torch.rand(5, 1, dtype=torch.float64) + 0.25
    table = MemoryTable(data, scale.to(torch.bfloat16), "int8_row")
    assert table.scale.dtype == torch.float32 and torch.equal(table.scale, scale.to(torch.bfloat16).float())
    ids = torch.tensor([[0, 4], [2, 2]])
    want = (data[ids.reshape(-1)].float() * scale.to(torch.bfloat16).float()[ids.reshape(-1)]).reshape(2, 6)
    assert torch.equal(table.lookup(ids, torch.float32), want)


def _row_scale_file(path: Path, rows: int = 10, sparse: bool = False) -> Path:
    from ple.table.files.writer import TableFileWriter
    from tests.table._helpers import write_sparse_table_file

    data = torch.randint(-127, 128, (rows, 4), dtype=torch.int8)
    scale = torch.rand(rows, 1) + 0.5
    if sparse:
        return write_sparse_table_file(path, rows, 4, "int8_row", "h", torch.tensor([1, 7]), data[:2], scale[:2])
    with TableFileWriter(path, rows, 4, "int8_row", 4, "h") as w:
        for k in range(3):
            a, b = w.shard_range(k)
            w.write_shard(k, data[a:b], scale[a:b])
    return path


def _poke_scale(path: Path, row: int, value: float) -> None:
    import struct

    from ple.table import read_table_header

    offset = read_table_header(path)["scale"]["offset"] + 4 * row
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<f", value))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.5])
def test_mapped_per_row_scales_are_checked_at_open(tmp_path, value):
    """A damaged per-row scale is refused when the file is opened (one pass over the scales), never
    served as NaN, infinite, zero or negated rows."""
    from ple.table import MmapTable, TableFileError

    path = _row_scale_file(tmp_path / "t.pletable")
    MmapTable.open(path).close()
    _poke_scale(path, 9, value)
    with pytest.raises(TableFileError, match=re.escape(f"the per-row scale of row 9 is {value}, not a positive")):
        MmapTable.open(path)


def test_sparse_files_may_hold_zero_scales_but_no_damaged_ones(tmp_path):
    """Unwritten rows of a sparse file have scale 0 (they read as zeros); NaN is still refused."""
    from ple.table import MmapTable, TableFileError

    path = _row_scale_file(tmp_path / "s.pletable", sparse=True)
    table = MmapTable.open(path)
    rows = table.lookup(torch.tensor([[0, 1]]), torch.float32)
    table.close()
    assert torch.equal(rows[0, :4], torch.zeros(4)) and rows[0, 4:].abs().sum() > 0
    _poke_scale(path, 3, float("nan"))
    with pytest.raises(TableFileError, match="the per-row scale of row 3 is nan, not a finite number >= 0"):
        MmapTable.open(path)


# ---------------------------------------------------------------------------------------------- sharded table files


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (ShardedTable needs one)."""
    import datetime

    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'rendezvous'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fp32_table_file(path: Path, rows: int = 12) -> tuple[Path, torch.Tensor]:
    from ple.table.files.writer import TableFileWriter

    data = torch.randn(rows, 4)
    with TableFileWriter(path, rows, 4, "fp32", rows, "h") as w:
        w.write_shard(0, data, None)
    return path, data


def _change_in_place(path: Path) -> None:
    """Write into the file itself (what ``cp new old`` does), with a new modification time."""
    from ple.table import read_table_header

    offset = read_table_header(path)["data_offset"]
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\x00" * 16)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_load_sharded_without_device_checks_its_file_like_mmap(one_rank_group, tmp_path):
    """``load_sharded(device=None)`` serves the mapped rows and, like MmapTable, refuses to serve them
    once the file was changed in place (it used to serve the changed rows silently)."""
    from ple.errors import UsageError
    from ple.table import TableFileError
    from ple.table.tiers.sharded import load_sharded

    path, data = _fp32_table_file(tmp_path / "t.pletable")
    ids = torch.tensor([[0, 5], [11, 0]])
    table = load_sharded(path)
    assert torch.equal(table.lookup(ids, torch.float32), data[ids.reshape(-1)].reshape(2, 8))
    _change_in_place(path)
    with pytest.raises(TableFileError, match="was changed in place while mapped"):
        table.lookup(ids, torch.float32)
    with pytest.raises(TableFileError, match="was changed in place while mapped"):
        table.start_prefetch(ids, torch.float32)
    table.close()
    with pytest.raises(UsageError, match="was closed"):
        table.local_table.check_file()


def test_load_sharded_to_a_device_reads_the_rows_once(one_rank_group, tmp_path):
    """With a device the rows are read into memory at load: a later change of the file is not served."""
    from ple.table.tiers.sharded import load_sharded

    path, data = _fp32_table_file(tmp_path / "t.pletable")
    table = load_sharded(path, device="cpu")
    _change_in_place(path)
    ids = torch.tensor([[0, 5], [11, 0]])
    assert torch.equal(table.lookup(ids, torch.float32), data[ids.reshape(-1)].reshape(2, 8))


def test_scale_rows_limits_the_scale_check_to_the_rows_served(tmp_path):
    """``scale_rows`` limits the open's scale check to the rows a process serves (``load_sharded``:
    each rank its own, tests/table/test_sharded.py)."""
    from ple.table import MmapTable, TableFileError

    path = _row_scale_file(tmp_path / "t.pletable")
    _poke_scale(path, 9, float("nan"))
    MmapTable.open(path, scale_rows=(0, 9)).close()
    with pytest.raises(TableFileError, match="the per-row scale of row 9 is nan"):
        MmapTable.open(path, scale_rows=(5, 10))
    with pytest.raises(TableFileError, match=re.escape("rows [5, 11) are not within [0, 10)")):
        MmapTable.open(path, scale_rows=(5, 11))
