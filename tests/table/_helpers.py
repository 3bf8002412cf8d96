"""Shared helpers of the table tests: random tables of every format, table files."""

from __future__ import annotations

import os
import pickle
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from ple.errors import InvalidArgumentError
from ple.table import format_info, quantize_rows
from ple.table.files.table_file import TableFileWriter
from ple.table.formats.blocks import nvfp4_global_scale, quantize_blocks
from ple.table.formats.catalog import BLOCK_FORMATS, FORMATS
from ple.table.formats.quantize import quantize_global

PLAIN = ("bf16", "fp16", "fp32")
ELEMENT = tuple(f for f in FORMATS if f not in BLOCK_FORMATS)
"""The formats of one stored element a value (any head_dim)."""
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def make_table(fmt: str, rows: int, head_dim: int, seed: int = 0, amp: float = 3.0):
    """Random ``(data [rows, head_dim], scale)`` of format ``fmt``, with rows of varied magnitude
    (block formats: ``data [rows, row_nbytes]`` uint8, ``head_dim`` a multiple of the block)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, head_dim, generator=g) * amp
    x *= torch.exp(torch.randn(rows, 1, generator=g))  # rows of different magnitudes
    if fmt in PLAIN:
        return x.to(format_info(fmt).storage_dtype), None
    if fmt in BLOCK_FORMATS:
        if fmt == "nvfp4":
            g = nvfp4_global_scale(float(x.abs().max()))
            return torch.from_numpy(quantize_blocks(x, fmt, g)), torch.tensor([g])
        return torch.from_numpy(quantize_blocks(x, fmt)), None
    if fmt == "fp8":
        return quantize_global(x)
    return quantize_rows(x, fmt)


def random_ids(rows: int, T: int, G: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, rows, (T, G), generator=g, dtype=torch.int64)


def assert_same(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    """Exact equality that also matches NaN with NaN (for inputs that overflow to inf * 0)."""
    assert a.dtype == b.dtype and a.shape == b.shape, msg
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=msg or None)


LAYOUT = {"vocab_size": 1000, "ngram_size": 3, "heads_per_ngram": 2, "seed": 1234, "ple_layer_index": 0}


def shard_parts(data, scale, shard_rows):
    rows = data.shape[0]
    for k in range(-(-rows // shard_rows)):
        a, b = k * shard_rows, min(rows, (k + 1) * shard_rows)
        s = scale[a:b] if scale is not None and scale.dim() == 2 else scale
        yield k, data[a:b], s


def write_file(path, fmt, data, scale, shard_rows, order=None, layout=LAYOUT, **kw):
    parts = list(shard_parts(data, scale, shard_rows))
    if order is not None:
        parts = [parts[i] for i in order]
    head_dim = format_info(fmt).head_dim_of(data.shape[1])
    with TableFileWriter(path, data.shape[0], head_dim, fmt, shard_rows, layout, **kw) as w:
        for k, rows, s in parts:
            w.write_shard(k, rows, s)
    return path


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def write_sparse_table_file(
    path: str | os.PathLike,
    rows: int,
    head_dim: int,
    format: str,
    layout_hash: str | dict,
    row_ids: torch.Tensor,
    row_data: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    shard_rows: int | None = None,
    force: bool = False,
) -> Path:
    """Build a sparse table file: zeros everywhere except ``row_data [n, head_dim]`` at ``row_ids [n]``.

    ``scale``: the global scale for "fp8", per-row ``[n, 1]`` for the written rows otherwise (other
    rows get scale 0). No checksums (see the module docstring). Returns the path.
    """
    with TableFileWriter(path, rows, head_dim, format, shard_rows or rows, layout_hash, force=force, sparse=True) as w:
        if format_info(format).scale_kind == "global":
            if scale is None:
                raise InvalidArgumentError(f"format {format!r} needs a global scale")
            w.set_global_scale(scale)
            w.write_rows(row_ids, row_data)
        else:
            w.write_rows(row_ids, row_data, scale)
    return Path(path)


def check_direct_cache(t) -> None:
    """A :class:`~ple.table.DirectTable`'s row cache is whole: one slot per row, each slot either free
    or held by the row it names, pinned slots counted."""
    used = t._cache_used
    held = np.nonzero(used >= 0)[0]
    rows = t._slot_of.rows()
    slots = t._slot_of.get(rows)
    assert len(t._slot_of) == held.size == rows.size, "a row was admitted twice (two slots, one index entry)"
    assert sorted(slots.tolist()) == held.tolist()
    assert (t._row_of_slot[slots] == rows).all()
    free = set(t._free[: t._nfree].tolist()) | set(range(t._fresh, t.cache_slots))
    assert t._free_slots() == len(free) and len(free) + held.size == t.cache_slots
    assert not free & set(held.tolist())
    assert int((used == np.iinfo(np.int64).max).sum()) == t.pinned_rows


FORK_DEADLINE_S = 60


def run_forked(body, out_path, deadline: float = FORK_DEADLINE_S):
    """Fork; the child runs ``body()`` and pickles its result (or its traceback) to ``out_path``;
    the parent waits at most ``deadline`` seconds and returns the result (fails on a hang or an error)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            torch.set_num_threads(1)
            result = ("ok", body())
        except BaseException:  # noqa: BLE001 - reported to the parent
            result = ("err", traceback.format_exc())
            code = 1
        try:
            with open(out_path, "wb") as f:
                pickle.dump(result, f)
        finally:
            os._exit(code)
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail(f"the forked child did not finish within {deadline} s (hung)")
    with open(out_path, "rb") as f:
        status, value = pickle.load(f)
    if status != "ok":
        pytest.fail(f"the forked child failed:\n{value}")
    return value


def uring_unavailable() -> str | None:
    """None where the direct tier's io_uring reader starts here, else the reason (for skips)."""
    from ple.kernels import native as _native
    from ple.table.tiers.direct import URING_SWITCH, UringUnavailable, _uring_off, _UringReader

    if _uring_off():
        return f"turned off: {URING_SWITCH}={os.environ[URING_SWITCH]}"
    try:
        _native.library()
    except _native.NativeUnavailable as e:
        return f"no C kernels: {e}"
    fd = os.open(__file__, os.O_RDONLY)
    try:
        _UringReader(fd, 2, False, os.fstat(fd).st_size, Path(__file__)).close()
    except UringUnavailable as e:
        return str(e)
    finally:
        os.close(fd)
    return None
