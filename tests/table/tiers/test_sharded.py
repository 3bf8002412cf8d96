"""ShardedTable across 2 and 3 gloo processes on this machine.

Each world size is launched once (subprocesses running this file as a script, rendezvous through a
``file://`` store, a 30 s collective timeout and a hard kill after WORKER_TIMEOUT_S so a hang fails
the test instead of blocking). The workers run every scenario in one fixed order and save what each
rank got (tensors, or the error type and text); the tests below rebuild the same inputs in this
process and compare with single-process lookups bit for bit.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ple.config import PLEConfig
from ple.layer import PLELayer
from ple.runtime import Batch
from ple.table import MemoryTable, MmapTable, PrefetchError
from ple.table.files.table_file import TableFileWriter, hash_layout
from ple.table.formats.blocks import nvfp4_global_scale, quantize_blocks
from ple.table.formats.quantize import quantize_global, quantize_rows
from ple.table.tiers.sharded import (
    DEFAULT_METHODS,
    IDS_MODES,
    METHODS,
    ShardedTable,
    ShardGeometryError,
    _check_fingerprints,
    _Fingerprint,
    load_sharded,
    shard_rows,
)

WORKER_TIMEOUT_S = 150
PG_TIMEOUT_S = 30
WORLDS = (2, 3)

ROWS = 1001  # odd: uneven ranges
G = 3
TOKENS = (1, 63, 129)
# (format, lookup dtype, head_dim): odd and even widths, so the all-reduce runs on int32 and on
# uint8 views of the bytes.
CASES = [
    ("fp32", torch.float32, 5),
    ("fp32", torch.bfloat16, 6),
    ("bf16", torch.bfloat16, 5),
    ("bf16", torch.float32, 8),
    ("fp16", torch.float16, 7),
    ("fp8", torch.bfloat16, 5),
    ("fp8", torch.float32, 8),
    ("fp8_row", torch.bfloat16, 6),
    ("int8_row", torch.float32, 5),
    ("int8_row", torch.float16, 6),
    ("q4_0", torch.bfloat16, 32),
    ("nvfp4", torch.float16, 32),
]
# data-parallel (per-rank ids) cases: special values, fp8, odd widths
PER_RANK_CASES = [
    ("fp32", torch.float32, 5),
    ("fp8", torch.bfloat16, 5),
    ("int8_row", torch.float16, 6),
    ("bf16", torch.float32, 7),
]
_PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAN_BITS = {torch.float32: 0x7FC00123, torch.bfloat16: 0x7FC1, torch.float16: 0x7E01}
_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


# ---------------------------------------------------------------------- inputs (both sides)
def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def special_rows(rows: int) -> list[int]:
    return [min(rows - 1, (i * rows) // 4 + i) for i in range(4)]


def make_full(fmt: str, rows: int = ROWS, D: int = 5, seed: int = 0) -> MemoryTable:
    """A full table with -0.0, inf, a NaN with a payload and a subnormal in plain formats, -0.0 and
    NaN bytes in fp8 ones, spread over rows that different ranks own."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g)
    sp = special_rows(rows)
    if fmt in _PLAIN:
        dtype = _PLAIN[fmt]
        data = x.to(dtype)
        bits = data.view(_INT_OF[data.element_size()])
        data[sp[0], 0] = -0.0
        data[sp[1], 1 % D] = float("inf")
        bits[sp[2], 2 % D] = _NAN_BITS[dtype]  # a quiet NaN with a payload
        bits[sp[3], 3 % D] = 1  # smallest subnormal
        return MemoryTable(data, None, fmt)
    if fmt in ("q4_0", "nvfp4"):  # block formats: random blocks, no special values
        gs = nvfp4_global_scale(float(x.abs().max())) if fmt == "nvfp4" else None
        return MemoryTable(
            torch.from_numpy(quantize_blocks(x, fmt, gs)), None if gs is None else torch.tensor([gs]), fmt
        )
    if fmt == "fp8":
        q, scale = quantize_global(x)
    else:
        q, scale = quantize_rows(x, fmt)
    qb = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else None
    if qb is not None:
        qb[sp[0], 0] = 0x80  # -0.0
        qb[sp[2], 2 % D] = 0x7F  # NaN
    return MemoryTable(q, scale, fmt)


def make_ids(rows: int, world: int, T: int, seed: int, noncontig: bool = False) -> torch.Tensor:
    """[T, G] ids: every range boundary, the special rows, and random rows."""
    g = torch.Generator().manual_seed(1000 + seed)
    edges = {0, rows - 1, *special_rows(rows)}
    for r in range(world):
        a, b = shard_rows(rows, world, r)
        edges |= {x for x in (a - 1, a, b - 1, b) if 0 <= x < rows}
    fill = torch.randint(0, rows, (T * G,), generator=g)
    fill[: min(len(edges), fill.numel())] = torch.tensor(sorted(edges))[: fill.numel()]
    ids = fill[torch.randperm(fill.numel(), generator=g)].view(T, G)
    if not noncontig:
        return ids
    wide = torch.randint(0, rows, (T, 2 * G), generator=g)
    wide[:, ::2] = ids
    return wide[:, ::2]


def per_rank_tokens(rank: int) -> list[int]:
    """Token counts of rank ``rank``'s lookups in the per-rank scenario: different on every rank, one
    rank with none in the second, none anywhere in the third."""
    return [13 + 50 * rank, 0 if rank == 1 else 7 + 3 * rank, 0, 1 + rank]


def tiny_config(**kw) -> PLEConfig:
    base = dict(
        hidden_size=12,
        eos_token_id=7,
        vocab_size=300,
        hc_count=2,
        ple_layer_ids=(1,),
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=500,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=3,
        ple_conv_kernel_size=3,
    )
    base.update(kw)
    return PLEConfig(**base)


def make_layer(dtype: torch.dtype, seed: int = 5) -> tuple[PLELayer, MemoryTable]:
    cfg = tiny_config()
    layer = PLELayer(cfg, 0, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.5 if name.startswith(("norm", "conv")) else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    lay = layer.layout
    table = MemoryTable(torch.randn(lay.padded_rows, lay.head_dim, generator=g).to(dtype))
    return layer, table


def layer_inputs(layer: PLELayer, seed: int = 9):
    cfg = layer.config
    g = torch.Generator().manual_seed(seed)
    lens = [5, 9, 1]
    tokens = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g)
    tokens[[3, 10]] = cfg.eos_token_id
    hidden = torch.randn(sum(lens), cfg.hc_hidden_size, generator=g).to(layer.dtype)
    padded_ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=g)
    padded_hidden = torch.randn(2, 6, cfg.hc_hidden_size, generator=g).to(layer.dtype)
    return lens, tokens, hidden, padded_ids, padded_hidden


def run_layer(layer: PLELayer, seed: int = 9) -> dict[str, torch.Tensor]:
    """Engine call, engine call with a prefetched lookup, and the training-style call."""
    cfg = layer.config
    lens, tokens, hidden, padded_ids, padded_hidden = layer_inputs(layer, seed)
    ctx = torch.full((len(lens), cfg.ngram_size - 1), cfg.eos_token_id)
    res = {}
    with torch.no_grad():
        pool = layer.new_state_pool(len(lens))
        batch = Batch.build(lens, list(range(len(lens))), ctx, pool, conv_window=cfg.conv_window)
        res["out"] = layer(hidden, tokens, batch)
        res["pool"] = pool.clone()
        pool2 = layer.new_state_pool(len(lens))
        batch2 = Batch.build(lens, list(range(len(lens))), ctx, pool2, conv_window=cfg.conv_window)
        handle = layer.start_prefetch(tokens, batch2)
        res["out_prefetched"] = layer(hidden, tokens, batch2, prefetched=handle)
        res["padded"] = layer.forward_padded(padded_hidden, padded_ids)
    return res


@contextlib.contextmanager
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def write_table_file(path: Path, name: str) -> Path:
    full = make_full("int8_row", ROWS, 5, seed=77)
    with TableFileWriter(path, ROWS, 5, "int8_row", shard_rows=128, layout_hash={"name": name}) as w:
        for k in range(w.num_shards):
            a, b = w.shard_range(k)
            w.write_shard(k, full.data[a:b], full.scale[a:b])
    return path


# ---------------------------------------------------------------------- worker side
def _worker_scenarios(rank: int, world: int, files: Path):
    """Yield (key, thunk) in one fixed order; every rank runs them all (each is collective)."""
    last = world - 1

    def lookups(fmt, dtype, D, method):
        def run():
            table = ShardedTable.from_full(make_full(fmt, ROWS, D), method=method)
            res = {}
            for T in TOKENS:
                res[T] = table.lookup(make_ids(ROWS, world, T, seed=T), dtype)
            res["noncontig"] = table.lookup(make_ids(ROWS, world, 63, seed=63, noncontig=True), dtype)
            return res

        return run

    for fmt, dtype, D in CASES:
        for method in METHODS:
            yield f"lookups/{fmt}/{_dt(dtype)}/D{D}/{method}", lookups(fmt, dtype, D, method)

    def prefetch(method):
        table = ShardedTable.from_full(make_full("fp8", ROWS, 5), method=method)
        ids = make_ids(ROWS, world, 63, seed=3)
        h = table.start_prefetch(ids, torch.bfloat16)
        with h:
            rows = h.wait(ids).clone()
            try:
                h.wait(ids)
                twice = "no error"
            except PrefetchError as e:
                twice = str(e)
        other = table.start_prefetch(ids, torch.bfloat16)
        try:
            other.wait(ids.clone())
            wrong = "no error"
        except PrefetchError as e:
            wrong = str(e)
        other.release()
        return {"rows": rows, "twice": twice, "wrong": wrong, "done": h.done()}

    for method in METHODS:
        yield f"prefetch/{method}", lambda m=method: prefetch(m)

    def permuted(method):
        # rank r owns the range shard_rows gives rank world-1-r; blocks of 64 rows.
        full = make_full("bf16", ROWS, 5)
        rr = shard_rows(ROWS, world, world - 1 - rank, align=64)
        table = ShardedTable.from_full(full, method=method, row_range=rr)
        return {"ranges": table.ranges, "rows": table.lookup(make_ids(ROWS, world, 63, seed=8), torch.bfloat16)}

    for method in METHODS:
        yield f"permuted/{method}", lambda m=method: permuted(m)

    def tiny(method):
        # 2 rows over 2-3 ranks: a rank with an empty range; and an empty lookup.
        table = ShardedTable.from_full(make_full("fp32", 2, 4), method=method)
        ids = torch.tensor([[0, 1, 1], [1, 0, 0]])
        return {
            "rows": table.lookup(ids, torch.float32),
            "empty": table.lookup(torch.empty(0, G, dtype=torch.int64), torch.float32),
            "local_rows": table.local_table.rows,
        }

    for method in METHODS:
        yield f"tiny/{method}", lambda m=method: tiny(m)

    def per_rank(fmt, dtype, D, method):
        # Data-parallel batches: each rank its own ids and token count, one rank with none; then a
        # step where no rank has a token, then a prefetch.
        table = ShardedTable.from_full(make_full(fmt, ROWS, D), method=method, ids="per_rank")
        res = {}
        for step, T in enumerate(per_rank_tokens(rank)):
            res[step] = table.lookup(make_ids(ROWS, world, T, seed=500 + 10 * rank + step), dtype)
        ids = make_ids(ROWS, world, 5 + rank, seed=7)
        with table.start_prefetch(ids, dtype) as h:
            res["prefetch"] = h.wait(ids).clone()
        return res

    for fmt, dtype, D in PER_RANK_CASES:
        for method in METHODS:
            yield f"per_rank/{fmt}/{_dt(dtype)}/{method}", lambda f=fmt, d=dtype, D=D, m=method: per_rank(f, d, D, m)

    def layer(dtype, method):
        lay, full = make_layer(dtype)
        lay.set_table(ShardedTable.from_full(full, method=method))
        return run_layer(lay)

    for dtype in (torch.float32, torch.bfloat16):
        for method in METHODS:
            yield f"layer/{_dt(dtype)}/{method}", lambda d=dtype, m=method: layer(d, m)

    def table_file(method, device):
        table = load_sharded(files / "a.table", method=method, device=device, align=128)
        return {"rows": table.lookup(make_ids(ROWS, world, 129, seed=4), torch.float32), "range": table.ranges[rank]}

    for method in METHODS:
        for device in (None, "cpu"):
            yield f"file/{method}/{device}", lambda m=method, d=device: table_file(m, d)

    # ---- construction errors: the last rank deviates; every rank must raise
    def geometry(kind):
        full = make_full("fp32", ROWS, 5)
        a, b = shard_rows(ROWS, world, rank)
        kw: dict = {}
        local, total = full, ROWS
        if rank == last:
            if kind == "head_dim":
                local = make_full("fp32", ROWS, 6)
            elif kind == "format":
                local = make_full("bf16", ROWS, 5)
            elif kind == "overlap":
                a -= 5
            elif kind == "gap":
                a += 3
            elif kind == "total_rows":
                total = ROWS + 16
            elif kind == "method":
                kw["method"] = "nope"
            elif kind == "ids_mode":
                kw["ids"] = "per_rank"
            elif kind == "layout":
                kw["layout_hash"] = hash_layout(tiny_config(seed=99).layout_key())
        if kind == "layout" and rank != last:
            kw["layout_hash"] = hash_layout(tiny_config().layout_key())
        if kind == "bad_range" and rank == last:
            return repr(ShardedTable.from_full(full, row_range=(a, ROWS + 5)))
        if kind == "file":
            return repr(load_sharded(files / ("b.table" if rank == last else "a.table")))
        piece = MemoryTable(local.data[a:b].clone(), None, local.format)
        return repr(ShardedTable(piece, a, b, total, **kw))

    for kind in (
        "head_dim",
        "format",
        "overlap",
        "gap",
        "total_rows",
        "method",
        "ids_mode",
        "layout",
        "bad_range",
        "file",
    ):
        yield f"geometry/{kind}", lambda k=kind: geometry(k)

    # ---- lookup-time errors raised on every rank
    def bad_id():
        table = ShardedTable.from_full(make_full("fp32", ROWS, 5), method="alltoall")
        ids = make_ids(ROWS, world, 9, seed=rank)
        if rank == last:
            ids[4, 1] = ROWS
        return table.lookup(ids, torch.float32)

    def ids_differ():
        table = ShardedTable.from_full(make_full("fp32", ROWS, 5), method="allreduce", verify_ids=True)
        same = table.lookup(make_ids(ROWS, world, 9, seed=1), torch.float32)  # replicated: passes
        try:
            table.lookup(make_ids(ROWS, world, 9, seed=2 if rank == last else 1), torch.float32)
            err = None
        except ValueError as e:
            err = str(e)
        return {"same": same, "err": err}

    def dtype_differs(method, ids_mode):
        table = ShardedTable.from_full(make_full("fp32", ROWS, 5), method=method, ids=ids_mode)
        return table.lookup(make_ids(ROWS, world, 9, seed=1), torch.bfloat16 if rank == last else torch.float32)

    def tokens_differ():
        # replicated ids and the all-reduce: the buffers would differ in size
        table = ShardedTable.from_full(make_full("fp32", ROWS, 5), method="allreduce")
        return table.lookup(make_ids(ROWS, world, 9 + (rank == last), seed=1), torch.float32)

    def heads_differ(method):
        table = ShardedTable.from_full(make_full("fp32", ROWS, 5), method=method, ids="per_rank")
        return table.lookup(make_ids(ROWS, world, 9, seed=1)[:, : 2 if rank == last else 3], torch.float32)

    def invalid_ids():
        table = ShardedTable.from_full(make_full("fp32", ROWS, 5), ids="per_rank")
        ids = make_ids(ROWS, world, 9, seed=1)
        return table.lookup(ids.reshape(-1) if rank == last else ids, torch.float32)

    def tables_swapped():
        # two tables of one group (two layers) looked up in another order on the last rank
        one = ShardedTable.from_full(make_full("fp32", ROWS, 5))
        two = ShardedTable.from_full(make_full("fp32", ROWS, 5, seed=1))
        first, second = (two, one) if rank == last else (one, two)
        ids = make_ids(ROWS, world, 9, seed=1)
        return [first.lookup(ids, torch.float32), second.lookup(ids, torch.float32)]

    def file_changed(method):
        # each rank maps its own copy of the file; the last rank's copy is written into in place
        own = files / f"own-{method}-{rank}.table"
        own.write_bytes((files / "a.table").read_bytes())
        table = load_sharded(own, method=method)
        first = table.lookup(make_ids(ROWS, world, 9, seed=1), torch.float32)
        if rank == last:
            st = own.stat()
            with open(own, "r+b") as f:
                f.seek(st.st_size - 4)
                f.write(b"\x00\x00\x80\x3f")  # the last per-row scale, now 1.0
            os.utime(own, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        try:
            table.lookup(make_ids(ROWS, world, 9, seed=1), torch.float32)
            err = None
        except Exception as e:
            err = (type(e).__name__, str(e))
        return {"first": first, "err": err}

    def damaged_scale_of_the_last_rank():
        # every rank maps its own copy, each with the last row's scale (the last rank's row) damaged
        own = files / f"nan-scale-{rank}.table"
        data = bytearray((files / "a.table").read_bytes())
        data[-4:] = b"\x00\x00\xc0\x7f"  # NaN
        own.write_bytes(bytes(data))
        try:
            load_sharded(own)
        except Exception as e:
            return (type(e).__name__, str(e))
        return None

    yield "errors/bad_id", bad_id
    yield "errors/damaged_scale_of_the_last_rank", damaged_scale_of_the_last_rank
    for method in METHODS:
        yield f"errors/file_changed/{method}", lambda m=method: file_changed(m)
    yield "errors/ids_differ", ids_differ
    for method in METHODS:
        for ids_mode in IDS_MODES:
            yield f"errors/dtype_differs/{method}/{ids_mode}", lambda m=method, i=ids_mode: dtype_differs(m, i)
        yield f"errors/heads_differ/{method}", lambda m=method: heads_differ(m)
    yield "errors/tokens_differ", tokens_differ
    yield "errors/invalid_ids", invalid_ids
    yield "errors/tables_swapped", tables_swapped

    def after_errors():
        table = ShardedTable.from_full(make_full("fp32", ROWS, 5))
        per_rank = ShardedTable.from_full(make_full("fp32", ROWS, 5), ids="per_rank")
        return {
            "method": table.method,
            "per_rank_method": per_rank.method,
            "rows": table.lookup(make_ids(ROWS, world, 63, seed=11), torch.float32),
        }

    yield "after_errors", after_errors

    def pickled():
        # a sharded table (of memory, of a file) and a rank's mapped rows refuse to pickle, on every
        # rank alike and without a collective; the tables still serve lookups afterwards
        import pickle

        memory = ShardedTable.from_full(make_full("fp32", ROWS, 5))
        mapped = load_sharded(files / "a.table")
        refusals = {}
        for name, obj in (("memory", memory), ("file", mapped), ("mapped rows", mapped.local_table)):
            try:
                pickle.dumps(obj)
                refusals[name] = None
            except Exception as e:
                refusals[name] = (type(e).__name__, str(e))
        ids = make_ids(ROWS, world, 9, seed=3)
        return {
            "refusals": refusals,
            "memory": memory.lookup(ids, torch.float32),
            "file": mapped.lookup(ids, torch.float32),
        }

    yield "pickled", pickled


def _worker_main(rank: int, world: int, init_file: str, files: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    results = {}
    for key, thunk in _worker_scenarios(rank, world, Path(files)):
        try:
            results[key] = ("ok", thunk())
        except Exception as e:
            results[key] = ("err", type(e).__name__, str(e))
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


# ---------------------------------------------------------------------- launcher / fixtures
def _launch(world: int, tmp: Path) -> list[dict]:
    files = tmp / "files"
    files.mkdir()
    write_table_file(files / "a.table", "A")
    write_table_file(files / "b.table", "B")
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[3] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), str(world), str(tmp / "rendezvous"), str(files), str(tmp)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                pytest.fail(f"world {world}: a worker did not finish within {WORKER_TIMEOUT_S} s (hang?)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        if p.returncode != 0 or not (tmp / f"rank{r}.pt").is_file():
            pytest.fail(f"world {world}: rank {r} exited with {p.returncode}:\n{logs[r][-4000:]}")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def world(request, tmp_path_factory):
    results = _launch(request.param, tmp_path_factory.mktemp(f"world{request.param}"))
    return request.param, results


def ok(results: list[dict], key: str) -> list:
    """Each rank's value for ``key``; fails with the rank's error when one raised."""
    vals = []
    for r, res in enumerate(results):
        entry = res[key]
        if entry[0] != "ok":
            pytest.fail(f"{key}: rank {r} raised {entry[1]}: {entry[2]}")
        vals.append(entry[1])
    return vals


def errors(results: list[dict], key: str) -> list[tuple[str, str]]:
    out = []
    for r, res in enumerate(results):
        entry = res[key]
        assert entry[0] == "err", f"{key}: rank {r} did not raise (got {entry[1]!r})"
        out.append((entry[1], entry[2]))
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (torch.equal, plus -0.0 vs 0.0 and NaN payloads)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    it = _INT_OF[a.element_size()]
    return torch.equal(a.contiguous().view(it), b.contiguous().view(it))


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    if not same_bits(got, want):
        it = _INT_OF[got.element_size()]
        bad = (got.contiguous().view(it) != want.contiguous().view(it)).nonzero()
        t, c = (int(v) for v in bad[0])
        raise AssertionError(f"{what}: {len(bad)} elements differ, first at [{t}, {c}]: {got[t, c]} vs {want[t, c]}")


# ---------------------------------------------------------------------- tests: lookups
def test_inputs_carry_the_hard_values():
    """The tables really hold -0.0, NaN payloads and subnormals, so a float reduction would fail."""
    t = make_full("fp32")
    bits = t.data.view(torch.int32)
    assert (bits == torch.tensor(-0.0).view(torch.int32)).any()
    assert (bits == 0x7FC00123).any() and (bits == 1).any()
    rows = t.lookup(make_ids(ROWS, 2, 129, seed=129), torch.float32)
    assert (rows.view(torch.int32) == torch.tensor(-0.0).view(torch.int32)).any()
    assert (rows.view(torch.int32) == 0x7FC00123).any()
    # what +0.0 filling and a float sum would have produced: -0.0 becomes +0.0
    assert not same_bits(rows + torch.zeros_like(rows), rows)
    assert same_bits(rows + torch.full_like(rows, -0.0), rows)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fmt,dtype,D", CASES, ids=[f"{f}-{_dt(d)}-D{D}" for f, d, D in CASES])
def test_lookup_matches_single_process(world, fmt, dtype, D, method):
    w, results = world
    full = make_full(fmt, ROWS, D)
    got = ok(results, f"lookups/{fmt}/{_dt(dtype)}/D{D}/{method}")
    for T in TOKENS:
        want = full.lookup(make_ids(ROWS, w, T, seed=T), dtype)
        assert want.isnan().any() or fmt in ("int8_row", "q4_0", "nvfp4") or T == 1
        for r in range(w):
            assert_same_bits(got[r][T], want, f"rank {r}, T={T}")
            assert torch.equal(got[r][T].nan_to_num(), want.nan_to_num())
    want = full.lookup(make_ids(ROWS, w, 63, seed=63, noncontig=True), dtype)
    for r in range(w):
        assert_same_bits(got[r]["noncontig"], want, f"rank {r}, non-contiguous ids")


@pytest.mark.parametrize("method", METHODS)
def test_prefetch(world, method):
    w, results = world
    want = make_full("fp8", ROWS, 5).lookup(make_ids(ROWS, w, 63, seed=3), torch.bfloat16)
    for r, res in enumerate(ok(results, f"prefetch/{method}")):
        assert_same_bits(res["rows"], want, f"rank {r}")
        assert "already waited" in res["twice"]
        assert "another ids tensor" in res["wrong"]
        assert res["done"] is True


@pytest.mark.parametrize("method", METHODS)
def test_ranges_in_any_rank_order_and_aligned(world, method):
    w, results = world
    want = make_full("bf16", ROWS, 5).lookup(make_ids(ROWS, w, 63, seed=8), torch.bfloat16)
    for r, res in enumerate(ok(results, f"permuted/{method}")):
        assert res["ranges"] == [shard_rows(ROWS, w, w - 1 - k, align=64) for k in range(w)]
        assert_same_bits(res["rows"], want, f"rank {r}")


@pytest.mark.parametrize("method", METHODS)
def test_empty_shard_and_empty_lookup(world, method):
    w, results = world
    full = make_full("fp32", 2, 4)
    want = full.lookup(torch.tensor([[0, 1, 1], [1, 0, 0]]), torch.float32)
    res = ok(results, f"tiny/{method}")
    assert [x["local_rows"] for x in res] == [shard_rows(2, w, r)[1] - shard_rows(2, w, r)[0] for r in range(w)]
    assert 0 in [x["local_rows"] for x in res] or w == 2
    for r, x in enumerate(res):
        assert_same_bits(x["rows"], want, f"rank {r}")
        assert x["empty"].shape == (0, G * 4)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fmt,dtype,D", PER_RANK_CASES, ids=[f"{f}-{_dt(d)}-D{D}" for f, d, D in PER_RANK_CASES])
def test_per_rank_ids_each_rank_gets_its_own_rows(world, fmt, dtype, D, method):
    """Data-parallel batches: different token counts per rank, a rank with none, a step with none."""
    w, results = world
    full = make_full(fmt, ROWS, D)
    for r, got in enumerate(ok(results, f"per_rank/{fmt}/{_dt(dtype)}/{method}")):
        for step, T in enumerate(per_rank_tokens(r)):
            want = full.lookup(make_ids(ROWS, w, T, seed=500 + 10 * r + step), dtype)
            assert_same_bits(got[step], want, f"rank {r}, step {step} ({T} tokens)")
        assert_same_bits(got["prefetch"], full.lookup(make_ids(ROWS, w, 5 + r, seed=7), dtype), f"rank {r}, prefetch")


@pytest.mark.parametrize("method", METHODS)
def test_table_file_shards(world, method, tmp_path):
    w, results = world
    path = write_table_file(tmp_path / "a.table", "A")
    want = MmapTable.open(path).lookup(make_ids(ROWS, w, 129, seed=4), torch.float32)
    for device in (None, "cpu"):
        res = ok(results, f"file/{method}/{device}")
        for r, x in enumerate(res):
            assert x["range"] == shard_rows(ROWS, w, r, align=128)
            assert_same_bits(x["rows"], want, f"rank {r}, device {device}")


# ---------------------------------------------------------------------- tests: the layer
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dt)
def test_layer_forward_matches_single_process(world, dtype, method):
    w, results = world
    layer, full = make_layer(dtype)
    layer.set_table(full)
    with one_thread():
        want = run_layer(layer)
    for r, got in enumerate(ok(results, f"layer/{_dt(dtype)}/{method}")):
        for name in ("out", "pool", "out_prefetched", "padded"):
            assert got[name].dtype == dtype
            assert torch.equal(got[name], want[name]), f"rank {r}: {name}"
            assert_same_bits(
                got[name].reshape(-1, got[name].shape[-1]), want[name].reshape(-1, want[name].shape[-1]), name
            )


# ---------------------------------------------------------------------- tests: errors on every rank
def _all_geometry_errors(results, kind) -> list[str]:
    errs = errors(results, f"geometry/{kind}")
    for r, (typ, _) in enumerate(errs):
        assert typ == "ShardGeometryError", (r, typ, errs[r][1])
    for r, (_, msg) in enumerate(errs):
        assert f"this is rank {r}" in msg
    return [m for _, m in errs]


def test_geometry_head_dim_differs(world):
    w, results = world
    others = "rank 0" if w == 2 else "ranks 0, 1"
    for msg in _all_geometry_errors(results, "head_dim"):
        assert f"head_dim differs across ranks ({others}: 5; rank {w - 1}: 6)" in msg


def test_geometry_format_differs(world):
    w, results = world
    others = "rank 0" if w == 2 else "ranks 0, 1"
    for msg in _all_geometry_errors(results, "format"):
        assert f"format differs across ranks ({others}: 'fp32'; rank {w - 1}: 'bf16')" in msg


def test_geometry_overlap(world):
    w, results = world
    pa, pb = shard_rows(ROWS, w, w - 2)
    a, b = shard_rows(ROWS, w, w - 1)
    for msg in _all_geometry_errors(results, "overlap"):
        assert (
            f"rank {w - 2}'s rows [{pa}, {pb}) and rank {w - 1}'s rows [{a - 5}, {b}) overlap on [{a - 5}, {a})" in msg
        )
        assert f"rank {w - 1}: its local table has {b - a + 5} rows" not in msg  # the slice matched its range


def test_geometry_gap(world):
    w, results = world
    a, b = shard_rows(ROWS, w, w - 1)
    for msg in _all_geometry_errors(results, "gap"):
        assert f"rows [{a}, {a + 3}) are owned by no rank" in msg
        assert f"rank {w - 1}'s [{a + 3}, {b})" in msg


def test_geometry_total_rows_differs(world):
    w, results = world
    for msg in _all_geometry_errors(results, "total_rows"):
        assert "total_rows differs across ranks" in msg and f"rank {w - 1}: {ROWS + 16}" in msg


def test_geometry_ids_mode_differs(world):
    w, results = world
    others = "rank 0" if w == 2 else "ranks 0, 1"
    for msg in _all_geometry_errors(results, "ids_mode"):
        assert f"ids_mode differs across ranks ({others}: 'replicated'; rank {w - 1}: 'per_rank')" in msg


def test_geometry_config_differs(world):
    """A rank whose table was built for another config (another seed): its layout hash differs."""
    w, results = world
    mine = hash_layout(tiny_config().layout_key())[:15]
    theirs = hash_layout(tiny_config(seed=99).layout_key())[:15]
    for msg in _all_geometry_errors(results, "layout"):
        assert "layout_hash differs across ranks" in msg
        assert mine in msg and f"rank {w - 1}: {theirs}..." in msg


def test_geometry_bad_argument_on_one_rank(world):
    w, results = world
    msgs = _all_geometry_errors(results, "method")
    for r, msg in enumerate(msgs):
        assert f"rank {w - 1} could not describe their shard" in msg
        assert ("method 'nope' is unknown" in msg) == (r == w - 1)


def test_geometry_bad_range_fails_before_the_exchange_on_one_rank(world):
    w, results = world
    msgs = _all_geometry_errors(results, "bad_range")
    for r, msg in enumerate(msgs):
        assert f"rank {w - 1} could not describe their shard" in msg
        assert ("is not within the table's [0, 1001)" in msg) == (r == w - 1)


def test_geometry_different_table_files(world):
    w, results = world
    for msg in _all_geometry_errors(results, "file"):
        assert "layout_hash differs across ranks" in msg and f"rank {w - 1}: " in msg


def test_bad_id_on_one_rank_raises_everywhere(world):
    w, results = world
    errs = errors(results, "errors/bad_id")
    for r, (typ, msg) in enumerate(errs):
        if r == w - 1:
            assert typ == "IdOutOfRangeError" and f"row id {ROWS} at (token 4, head 1)" in msg
        else:
            assert typ == "ShardedLookupError" and f"rank {w - 1} looked up row ids outside [0, {ROWS})" in msg


@pytest.mark.parametrize("method", METHODS)
def test_table_file_changed_on_one_rank_raises_everywhere(world, method, tmp_path):
    """load_sharded(device=None) maps the file: when one rank's file is written into in place, every
    rank raises before any row moves (that rank names its file), instead of serving changed rows."""
    w, results = world
    want = MmapTable.open(write_table_file(tmp_path / "a.table", "A")).lookup(
        make_ids(ROWS, w, 9, seed=1), torch.float32
    )
    for r, res in enumerate(ok(results, f"errors/file_changed/{method}")):
        assert_same_bits(res["first"], want, f"rank {r}, before the change")
        typ, msg = res["err"]
        if r == w - 1:
            assert typ == "TableFileError" and f"own-{method}-{r}.table was changed in place while mapped" in msg
        else:
            assert (
                typ == "ShardedLookupError"
                and f"rank {w - 1} cannot serve rows: the local table file was changed" in msg
            )


def test_each_rank_checks_the_scales_of_its_own_rows(world):
    """load_sharded checks the per-row scales of each rank's own rows only: a damaged scale of the
    last rank's rows is refused there, and the other ranks fail with it (not for their own open)."""
    w, results = world
    for r, res in enumerate(ok(results, "errors/damaged_scale_of_the_last_rank")):
        typ, msg = res
        assert typ == "ShardGeometryError" and "(this rank)" not in msg.replace(f"rank {w - 1} (this rank)", ""), msg
        if r == w - 1:
            assert f"rank {r} (this rank): could not open its shard" in msg
            assert f"the per-row scale of row {ROWS - 1} is nan" in msg
        else:
            assert f"rank {w - 1} could not describe their shard" in msg and "could not open" not in msg, msg


def test_verify_ids_catches_unreplicated_batch(world):
    w, results = world
    want = make_full("fp32", ROWS, 5).lookup(make_ids(ROWS, w, 9, seed=1), torch.float32)
    for r, res in enumerate(ok(results, "errors/ids_differ")):
        assert_same_bits(res["same"], want, f"rank {r}, replicated ids")
        assert res["err"] is not None, f"rank {r} did not raise"
        assert "ranks looked up different ids" in res["err"] and f"this is rank {r}" in res["err"]


def _lookup_errors(results, key: str) -> list[str]:
    """Every rank raised ShardedLookupError with the same text but for the rank it names."""
    errs = errors(results, key)
    for r, (typ, msg) in enumerate(errs):
        assert typ == "ShardedLookupError", (r, typ, msg)
        assert f"before any row moved; this is rank {r})" in msg
    return [m for _, m in errs]


@pytest.mark.parametrize("ids_mode", IDS_MODES)
@pytest.mark.parametrize("method", METHODS)
def test_dtype_mismatch_raises_everywhere(world, method, ids_mode):
    """Different lookup dtypes used to abort one process inside the collective library (all-reduce)."""
    w, results = world
    for msg in _lookup_errors(results, f"errors/dtype_differs/{method}/{ids_mode}"):
        assert "different lookup dtypes" in msg and f"rank {w - 1}: torch.bfloat16" in msg
        assert "rank 0: torch.float32" in msg


def test_token_count_mismatch_with_replicated_ids_raises_everywhere(world):
    w, results = world
    for msg in _lookup_errors(results, "errors/tokens_differ"):
        assert "different numbers of tokens (rank 0: 9; " in msg and f"rank {w - 1}: 10)" in msg
        assert "ids='per_rank'" in msg


@pytest.mark.parametrize("method", METHODS)
def test_head_count_mismatch_raises_everywhere(world, method):
    w, results = world
    for msg in _lookup_errors(results, f"errors/heads_differ/{method}"):
        assert "different numbers of heads G (rank 0: 3; " in msg and f"rank {w - 1}: 2)" in msg


def test_invalid_ids_on_one_rank_raise_everywhere(world):
    w, results = world
    for r, msg in enumerate(_lookup_errors(results, "errors/invalid_ids")):
        assert f"rank {w - 1} passed invalid arguments" in msg
        assert ("row ids must be a 2-D int64 tensor [T, G], got (27,)" in msg) == (r == w - 1)


def test_tables_looked_up_in_another_order_raise_everywhere(world):
    w, results = world
    for msg in _lookup_errors(results, "errors/tables_swapped"):
        assert "ranks are at different lookups" in msg
        seen = dict(re.findall(r"rank (\d+): table (\d+), lookup 0", msg))
        assert len(seen) == w and seen["0"] != seen[str(w - 1)], msg


def test_group_still_works_after_errors(world):
    w, results = world
    want = make_full("fp32", ROWS, 5).lookup(make_ids(ROWS, w, 63, seed=11), torch.float32)
    for r, res in enumerate(ok(results, "after_errors")):
        assert res["method"] == DEFAULT_METHODS["replicated"] == "allreduce"
        assert res["per_rank_method"] == DEFAULT_METHODS["per_rank"] == "alltoall"
        assert_same_bits(res["rows"], want, f"rank {r}")


def test_sharded_tables_refuse_to_pickle_and_serve_on(world, tmp_path):
    w, results = world
    ids = make_ids(ROWS, w, 9, seed=3)
    want = make_full("fp32", ROWS, 5).lookup(ids, torch.float32)
    want_file = MmapTable.open(write_table_file(tmp_path / "a.table", "A")).lookup(ids, torch.float32)
    for r, res in enumerate(ok(results, "pickled")):
        why = {
            "memory": "serves its rows through a process group",
            "file": "serves its rows through a process group",
            "mapped rows": "maps one rank's rows of a table file",
        }
        for name, reason in why.items():
            got = res["refusals"][name]
            assert got is not None, f"rank {r}: the {name} table pickled"
            assert got[0] == "UsageError" and reason in got[1] and "layer.table = None" in got[1], (r, got)
        assert_same_bits(res["memory"], want, f"rank {r}")
        assert_same_bits(res["file"], want_file, f"rank {r}")


# ---------------------------------------------------------------------- single-process tests
@pytest.mark.parametrize("total", [0, 1, 2, 7, 1001, 320_001_536])
@pytest.mark.parametrize("ws", [1, 2, 3, 8])
@pytest.mark.parametrize("align", [1, 64, 2_500_012])
def test_shard_rows_tile_and_balance(total, ws, align):
    ranges = [shard_rows(total, ws, r, align=align) for r in range(ws)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(ws - 1))
    sizes = [b - a for a, b in ranges]
    assert all(s >= 0 for s in sizes)
    assert all(a % align == 0 or a == total for a, _ in ranges)
    full = [s for s in sizes if s and s % align == 0]
    assert not full or max(full) - min(full) <= align


def test_shard_rows_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank must be an integer in \\[0, world_size=2\\), got 2"):
        shard_rows(10, 2, 2)
    with pytest.raises(ValueError, match="align must be an integer >= 1, got 0"):
        shard_rows(10, 2, 0, align=0)


def _fp(a, b, total=100, head_dim=8, fmt=0, local_rows=None, **kw):
    return _Fingerprint(
        total_rows=total,
        head_dim=head_dim,
        format=fmt,
        layout_hash=kw.get("layout_hash", -1),
        global_scale=kw.get("global_scale", -1),
        method=0,
        ids_mode=0,
        row_start=a,
        row_stop=b,
        local_rows=b - a if local_rows is None else local_rows,
        local_errors=kw.get("local_errors", 0),
    )


def test_fingerprint_check_messages():
    assert _check_fingerprints([_fp(0, 50), _fp(50, 100)]) == []
    assert _check_fingerprints([_fp(50, 100), _fp(0, 50), _fp(7, 7)]) == []  # any order, empty range
    assert _check_fingerprints([_fp(0, 40), _fp(50, 100)]) == [
        "rows [40, 50) are owned by no rank (a gap between rank 0's [0, 40) and rank 1's [50, 100))"
    ]
    assert _check_fingerprints([_fp(0, 60), _fp(50, 90)]) == [
        "rank 0's rows [0, 60) and rank 1's rows [50, 90) overlap on [50, 60)",
        "rows [90, 100) are owned by no rank (after rank 1's [50, 90))",
    ]
    assert _check_fingerprints([_fp(0, 50), _fp(50, 100, local_rows=49)]) == [
        "rank 1: its local table has 49 rows but its row range [50, 100) has 50"
    ]
    assert _check_fingerprints([_fp(0, 50), _fp(50, 120)]) == [
        "rank 1: row range [50, 120) is not a range within [0, total_rows=100)"
    ]
    scale_a = int(torch.tensor([0.5]).view(torch.int32))
    scale_b = int(torch.tensor([0.25]).view(torch.int32))
    msgs = _check_fingerprints([_fp(0, 50, global_scale=scale_a), _fp(50, 100, global_scale=scale_b)])
    assert msgs == ["global_scale differs across ranks (rank 0: 0.5; rank 1: 0.25)"]


def test_needs_a_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="needs an initialized torch.distributed process group"):
        ShardedTable(make_full("fp32", 10, 4), 0, 10, 10)


def test_geometry_error_lists_problems():
    e = ShardGeometryError(["a", "b"], rank=1, world_size=3)
    assert e.problems == ["a", "b"] and "3 ranks" in str(e) and "this is rank 1" in str(e)
    assert isinstance(e, ValueError)


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "--worker":
    _worker_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
