"""A table file changed in place under a :class:`CachedTable` is refused as the memory map refuses it:
a truncation raises :class:`TableFileError` instead of killing the process with SIGBUS, an overwrite
raises instead of serving stale cached rows (hits included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ple.table import CachedTable, MmapTable, TableFileError
from tests.table._helpers import make_table, random_ids, write_file

ROWS, HEAD_DIM = 300, 8


def _cached(tmp_path: Path, fmt: str = "bf16") -> tuple[CachedTable, Path, torch.Tensor]:
    data, scale = make_table(fmt, ROWS, HEAD_DIM, seed=1)
    path = write_file(tmp_path / "t.pletable", fmt, data, scale, 64)
    cached = CachedTable(MmapTable.open(path), ROWS, policy="static")
    ids = random_ids(ROWS, 9, 3, seed=2)
    cached.warm(ids)
    assert cached.cached_rows == len(torch.unique(ids))
    return cached, path, ids


@pytest.mark.parametrize("fmt", ["bf16", "int8_row"])
def test_an_overwrite_in_place_is_refused_even_for_cached_rows(tmp_path, fmt):
    cached, path, ids = _cached(tmp_path, fmt)
    before = cached.lookup(ids, torch.float32)
    assert cached.misses == 0  # every row served from the cache
    other, oscale = make_table(fmt, ROWS, HEAD_DIM, seed=9)
    write_file(tmp_path / "other.pletable", fmt, other, oscale, 64)
    with open(path, "r+b") as f:  # cp other.pletable t.pletable: same size, other rows
        f.write((tmp_path / "other.pletable").read_bytes())
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    for call in (
        lambda: cached.lookup(ids, torch.float32),
        lambda: cached.start_prefetch(ids, torch.float32).wait(),
        lambda: cached.refresh(),
        cached.check_file,
    ):
        with pytest.raises(TableFileError, match="was changed in place while mapped"):
            call()
    assert before.abs().max() > 0
    cached.close()


_TRUNCATE = r"""
import os, sys, torch
from ple.table import CachedTable, MmapTable, TableFileError
path = sys.argv[1]
cached = CachedTable(MmapTable.open(path), 16, policy="static")
cached.warm(torch.tensor([[1, 2]]))
os.truncate(path, 4096)  # rows past the first page are gone: touching them would be SIGBUS
try:
    cached.lookup(torch.tensor([[250, 299]]), torch.float32)  # misses, read from the map
except TableFileError as e:
    print("refused:", e)
    sys.exit(0)
print("served")
sys.exit(3)
"""


def test_a_truncation_is_refused_not_a_sigbus(tmp_path):
    data, _ = make_table("fp32", ROWS, HEAD_DIM, seed=3)
    path = write_file(tmp_path / "t.pletable", "fp32", data, None, 64)
    res = subprocess.run([sys.executable, "-c", _TRUNCATE, str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"exit {res.returncode} (negative: killed by a signal): {res.stdout}{res.stderr}"
    assert "refused:" in res.stdout and "changed in place" in res.stdout
