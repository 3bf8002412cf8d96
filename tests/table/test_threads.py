"""Lookups from many threads at once: every tier returns the reference's bytes, whatever the format.

Several threads of an engine look rows up at once (request workers, the lookahead worker, a tokenizer
thread warming a cache). Each tier below is hammered by threads that start together and look up ids
with a hot head (so the row caches hit, miss the same rows at the same time, admit and evict), some
through ``start_prefetch``; every result is compared byte for byte with
:func:`~ple.table.lookup.gather_dequant_reference` of the table's rows, and the caches' bookkeeping
(one slot per row, statistics that add up) is checked afterwards.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from ple.table import FORMATS, CachedTable, DirectTable, MemoryTable, MmapTable, PinnedHostTable
from ple.table.lookup import gather_dequant_reference
from ple.table.tiers.direct import SLOT_OVERHEAD
from tests.table._helpers import check_direct_cache, make_table, uring_unavailable, write_file

ROWS, HD = 2048, 64  # 64 values: whole blocks of every block format
HOT = 48  # rows most lookups read


def _ids(seed: int, T: int = 24, G: int = 4) -> torch.Tensor:
    """``[T, G]`` ids, two thirds from the ``HOT`` first rows (every thread misses and admits them at
    the start), the rest anywhere (the caches evict)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ROWS, (T, G), generator=g)
    hot = torch.rand(T, G, generator=g) < 2 / 3
    return torch.where(hot, torch.randint(0, HOT, (T, G), generator=g), ids)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per format: ``(path, data, scale)`` of a table file of ``ROWS x HD``."""
    folder = tmp_path_factory.mktemp("threads")
    made = {}
    for fmt in FORMATS:
        data, scale = make_table(fmt, ROWS, HD, seed=7)
        made[fmt] = (write_file(folder / f"{fmt}.pletable", fmt, data, scale, shard_rows=1024), data, scale)
    return made


def _direct_budget(fmt: str, slots: int) -> int:
    """A DirectTable ``memory_budget`` of ``slots`` cache slots for rows of ``fmt``."""
    from ple.table import format_info

    info = format_info(fmt)
    return slots * (info.row_nbytes(HD) + (4 if info.scale_kind == "row" else 0) + SLOT_OVERHEAD)


TIERS = (
    "memory",
    "pinned",
    "mmap",
    "cached-evicting",
    "cached-whole",
    "direct-0",
    "direct-evicting",
    "direct-whole",
    "direct-threads-evicting",
    "direct-uring-evicting",
)


def _open(tier: str, fmt: str, files):
    path, data, scale = files[fmt]
    if tier == "memory":
        return MemoryTable(data, scale, fmt)
    if tier == "pinned":
        if not torch.cuda.is_available():
            pytest.skip("PinnedHostTable needs CUDA")
        return PinnedHostTable(data, scale, fmt)
    if tier == "mmap":
        return MmapTable.open(path)
    if tier == "cached-evicting":  # 40 rows, rebuilt after every lookup: admissions race lookups
        return CachedTable(MmapTable.open(path), 40, refresh_every=1)
    if tier == "cached-whole":
        return CachedTable(MmapTable.open(path), ROWS, refresh_every=3)
    if tier == "direct-0":
        return DirectTable(path, memory_budget=0, queue_depth=4)
    if tier == "direct-evicting":  # fewer slots than the hot rows plus one lookup's others
        return DirectTable(path, memory_budget=_direct_budget(fmt, 40), queue_depth=4, reader="native")
    if tier == "direct-whole":
        return DirectTable(path, memory_budget=_direct_budget(fmt, ROWS), queue_depth=4)
    if tier == "direct-uring-evicting":
        why = uring_unavailable()
        if why:
            pytest.skip(f"io_uring unavailable here: {why}")
        return DirectTable(path, memory_budget=_direct_budget(fmt, 40), queue_depth=4, reader="uring")
    if tier == "direct-threads-evicting":
        return DirectTable(path, memory_budget=_direct_budget(fmt, 40), queue_depth=4, reader="threads")
    raise AssertionError(tier)


def _hammer(
    table, threads: int, lookups: int, *, pin: bool = False
) -> list[tuple[torch.Tensor, torch.dtype, torch.Tensor]]:
    """``threads`` threads, started together, each doing ``lookups`` lookups (every third through a
    prefetch; with ``pin``, thread 0 first pins the hot rows). Returns ``(ids, dtype, rows)`` of every
    lookup; re-raises the first exception a thread met."""
    start = threading.Barrier(threads)
    results: list[list] = [[] for _ in range(threads)]
    failures: list[BaseException] = []

    def work(k: int) -> None:
        try:
            start.wait()
            if pin and k == 0:
                table.pin(torch.arange(HOT // 2))
            for i in range(lookups):
                ids = _ids(1000 * k + i)
                dtype = (torch.bfloat16, torch.float32, torch.float16)[(k + i) % 3]
                if i % 3 == 2:
                    with table.start_prefetch(ids, dtype) as h:
                        rows = h.wait(ids).clone()
                else:
                    rows = table.lookup(ids, dtype)
                results[k].append((ids, dtype, rows))
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            failures.append(e)
            start.abort()

    workers = [threading.Thread(target=work, args=(k,), name=f"lookup-{k}") for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a lookup thread did not finish within 120 s (hang?)"
    if failures:
        raise failures[0]
    return [r for rs in results for r in rs]


def _check_rows(got, fmt: str, data, scale, what: str) -> None:
    """Every lookup's rows, byte for byte, against the reference (of every row at once: it
    dequantizes each value alone, so the rows of a lookup are those rows of the whole table's)."""
    every = torch.arange(ROWS).view(-1, 1)
    full = {dt: gather_dequant_reference(data, scale, every, dt, format=fmt) for dt in {dt for _, dt, _ in got}}
    for ids, dtype, rows in got:
        want = full[dtype].index_select(0, ids.reshape(-1)).reshape(rows.shape)
        assert _same_bytes(rows, want), f"{what} {fmt} {dtype}: rows differ from the reference"


def _run(tier: str, fmt: str, files, threads: int, lookups: int) -> None:
    _, data, scale = files[fmt]
    table = _open(tier, fmt, files)
    pin = isinstance(table, DirectTable) and table.cache_slots > 0
    try:
        got = _hammer(table, threads, lookups, pin=pin)
        assert len(got) == threads * lookups
        _check_rows(got, fmt, data, scale, tier)
        if isinstance(table, DirectTable):
            check_direct_cache(table)
            if not pin:
                distinct = sum(int(torch.unique(ids).numel()) for ids, _, _ in got)
                assert table.hits + table.misses == distinct, "hits and misses lost updates"
        if isinstance(table, CachedTable):
            assert table.hits + table.misses == sum(ids.numel() for ids, _, _ in got)
            assert table.cached_rows <= table.capacity_rows
            assert bool((table.cached_ids.diff() > 0).all()), "the cache's index is not sorted and distinct"
    finally:
        table.close()


@pytest.mark.parametrize(
    ("tier", "fmt"),
    [(t, "fp8_row") for t in TIERS]
    + [(t, f) for t in ("direct-evicting", "cached-evicting") for f in FORMATS if f != "fp8_row"],
)
def test_lookups_from_eight_threads_equal_the_reference(files, tier, fmt):
    """Every tier with a per-row-scale format; the tiers whose caches evict with every format."""
    _run(tier, fmt, files, threads=8, lookups=4)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tier", TIERS)
def test_lookups_from_many_threads_equal_the_reference_long(files, tier, fmt):
    _run(tier, fmt, files, threads=16, lookups=12)


@pytest.fixture
def one_rank_group(tmp_path):
    """A process group of this process alone (gloo), destroyed afterwards."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        yield None
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", ["allreduce", "alltoall"])
def test_sharded_lookups_of_one_process_from_eight_threads(files, one_rank_group, method):
    """A table sharded over a group of one process, its rows in a DirectTable that evicts: lookups
    from 8 threads at once (the collectives of one rank need no order across ranks)."""
    from ple.table import ShardedTable

    fmt = "fp8_row"
    path, data, scale = files[fmt]
    local = DirectTable(path, memory_budget=_direct_budget(fmt, 40), queue_depth=4)
    table = ShardedTable(local, 0, ROWS, ROWS, method=method)
    try:
        _check_rows(_hammer(table, 8, 4), fmt, data, scale, f"sharded {method}")
        check_direct_cache(local)
    finally:
        table.close()
