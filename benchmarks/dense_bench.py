"""A dense table of the published size on this machine's disk: written, verified, served cold through ``Session``.

    python benchmarks/dense_bench.py [--dir /tmp] [--rows 320001536] [--format q4_0] [--out dense.json]

1. **Write.** A dense table file of ``--rows`` rows (default the published 320,001,536 x 160; q4_0: 90
   bytes a row, 26.8 GiB) through :class:`ple.table.files.writer.TableFileWriter`, shard by shard (the
   published layout's 128 shards of 2,500,012 rows), every block's bytes from a deterministic
   counter-based generator (Philox keyed by ``--seed``, counter = the row: any row can be recomputed
   alone): random 4-bit codes and a finite positive fp16 block scale in ``[2^-8, 2^-6)`` (fp8: random
   bytes, a NaN byte made the largest finite one, global scale 0.01). No holes: every shard is written,
   checksummed by the writer. A progress bar gives rows/s and the time left; the write's rows/s and
   MB/s are reported.
2. **Verify.** ``ple verify FILE`` (a child process, timed; it must exit 0).
3. **The device.** Sequential 1 MiB and random 4 KiB ``O_DIRECT`` reads of the table file itself, by
   ``fio`` (libaio at depth 32, and psync from 32 threads, the better of the two is "the device"; random
   reads at depth 1 too); without ``fio`` a probe of Python threads calling ``preadv`` (which
   under-measures a fast device). Measured once at the start, and at depth 32 just before and just
   after each configuration (the better of the two is that configuration's device).
4. **Serve.** Each configuration in a child process of its own (its own peak RSS): the direct tier with
   ``memory_budget`` of each of ``--budgets-gib`` (0, 1 and 4 GiB by default; half the cache pinned with
   the rows a warm-up of real text read most, ``DirectTable.pin(hot_rows(...))``, the other half a
   running LRU cache) and the memory map (``MmapTable``), each after the file was dropped from the page
   cache (``posix_fadvise(DONTNEED)`` on the file, checked with ``mincore``: the pages of the file still
   cached are reported). One PLE layer at the published geometry (H 2560, HC 4, E 2560, N 3, 16 heads of
   160, K 4; bf16, random projection weights) over the file, through a ``Session``, on real text
   (:mod:`ple.data.realtext`): a prefill of ``--prefill-batches`` batches of R x S tokens (new requests each),
   then a decode of ``--requests`` requests (a 16-token prompt each, then ``--decode-steps`` steps of one
   token each). Each configuration reads text of its own (tokens no other configuration serves, so a
   cache of the disk or of the VM's host favours none; common n-grams recur, and every budget pins the
   same warm-up rows).

   ``--serve-readers uring native`` serves each budget once per reader (``DirectTable(reader=...)``;
   the default reader otherwise).

   Reported per configuration: cold start (the table opened, its cache pinned, the first prefill batch's
   output: the open, the pin and the first output apart too), prefill and decode tokens/s (medians over
   batches and steps), rows read from the disk per second of read time, prefill and decode apart,
   against the device's random-read rate around it (direct tier: the native pool's reads; memory map:
   pages it brought into the page cache over its lookups' time), the cache's hit rate, peak RSS
   (``VmHWM``), and what the page cache holds of the file after. Without a budget, 1,000 random rows
   are also read alone, back to back and right after a bf16 GEMM of a decode step.
   Every configuration checks lookups of its own text against rows recomputed from the generator, bit
   for bit. With a budget, the cache is then filled to the last slot (rows in file order) and the
   resident memory measured again: the budget's claim at its worst.

5. **Readers** (``--readers``, instead of 2-4). The direct tier's readers side by side with the device, on
   the same file: each of ``--reader-rounds`` rounds drops the file from the page cache (checked with
   ``mincore``), measures the device with ``fio`` at each of ``--reader-depths`` (random 4 KiB
   ``O_DIRECT`` reads, libaio and psync, the better of the two), then times ``read_rows`` of fresh
   random distinct rows for each of ``--reader-rows`` (decode-sized: 1,000 rows, a decode step's
   distinct rows at 64 requests; prefill-sized: 12,500) by each reader and depth (``uring``,
   ``native`` and, at the first depth, ``threads``; ``DirectTable(memory_budget=0)``), back to back and
   right after a bf16 GEMM of a decode step's projections (as a decode step reads: torch's OpenMP
   threads still spin then), one call of each in turn, in a rotated order (8,000 rows of calls each). Reported per reader, depth, size and order: rows/s and reads/s (medians),
   their ratio to the device at that depth in the same round (median and range over rounds), and the
   process's CPU seconds per read. One call per reader, depth and size each round is checked against
   the generator's rows, bit for bit; the page cache holds nothing of the file afterwards (checked).
   ``--rows 96000000`` gives an 8 GiB q4_0 file (a minute to write).

The table file is removed at the end unless ``--keep`` (``--reuse`` serves a kept file again without
rewriting it, after checking its geometry). ``--rows`` gives a smaller table of the same geometry (the
layout of ``ngram_vocab_size_base`` scaled down with it): what the tests run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ple import PLEConfig, Session
from ple.data import realtext
from ple.table import DirectTable, MmapTable
from ple.table.files.table_file import read_table_header
from ple.table.files.writer import TableFileWriter
from ple.table.formats.catalog import format_info
from ple.table.lookup import gather_dequant_reference
from ple.table.tiers.direct import UringUnavailable

_REPO = Path(__file__).resolve().parents[1]
PUBLISHED_ROWS = 320_001_536
PUBLISHED_BASE = 20_000_000
FORMATS = ("q4_0", "iq4_nl", "fp8")
FP8_SCALE = 0.01
WARMUP_TOKENS = 200_000


def _load_disk_bench():
    spec = importlib.util.spec_from_file_location("ple_disk_bench", Path(__file__).with_name("disk_bench.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


disk_bench = _load_disk_bench()


def config(rows: int) -> PLEConfig:
    """The published config with ``ngram_vocab_size_base`` scaled to give about ``rows`` rows (exactly
    the published 320,001,536 for that number)."""
    cfg = json.loads((_REPO / "examples" / "published-config.json").read_text())
    cfg["text_config"]["ngram_vocab_size_base"] = max(64, round(PUBLISHED_BASE * rows / PUBLISHED_ROWS))
    return PLEConfig.from_dict(cfg)


# ---------------------------------------------------------------------------------------------- rows


class RowGenerator:
    """Deterministic stored rows of a table: row ``r`` is the first ``row_nbytes`` bytes of Philox
    (key ``seed``) at counter ``r * per_row`` (each counter gives 32 bytes), then made valid for the
    format: block formats get a finite positive fp16 scale in every block, an fp8 NaN byte becomes the
    largest finite one. Any row can be computed alone (:meth:`rows_of`) or a range at once (:meth:`range`)."""

    def __init__(self, format: str, head_dim: int, seed: int) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        if sys.byteorder != "little":
            raise RuntimeError("the generator writes little-endian fp16 scales in place")
        info = format_info(format)
        self.format, self.head_dim, self.seed = format, head_dim, seed
        self.row_nbytes = info.row_nbytes(head_dim)
        self.per_row = -(-self.row_nbytes // 32)
        self.block_nbytes = info.block_nbytes if info.blocked else 0

    def _raw(self, first: int, n: int) -> np.ndarray:
        words = np.random.Philox(key=self.seed, counter=first * self.per_row).random_raw(n * 4 * self.per_row)
        return words.view(np.uint8).reshape(n, 32 * self.per_row)[:, : self.row_nbytes]

    def _fix(self, rows: np.ndarray) -> np.ndarray:
        """Valid stored rows from random bytes ``[n, row_nbytes]`` (a contiguous copy)."""
        rows = np.ascontiguousarray(rows)
        if self.block_nbytes:
            # every block starts with its fp16 scale d: exponent 7 or 8 (2^-8 <= d < 2^-6), never 0 or inf
            half = rows.view(np.uint16)
            for j in range(self.row_nbytes // self.block_nbytes):
                col = half[:, j * self.block_nbytes // 2]
                col &= 0x07FF
                col += 0x1C00
        else:
            rows[(rows & 0x7F) == 0x7F] ^= 1  # e4m3fn NaN (0x7F, 0xFF) becomes the largest finite 0x7E / 0xFE
        return rows

    def range(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)``: ``[stop - start, row_nbytes]`` uint8."""
        return self._fix(self._raw(start, stop - start))

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Rows of any ``ids [n]``: ``[n, row_nbytes]`` uint8 (one generator call per row)."""
        out = np.empty((ids.size, self.row_nbytes), dtype=np.uint8)
        for i, r in enumerate(ids.tolist()):
            out[i] = self._raw(r, 1)[0]
        return self._fix(out)

    def torch_rows(self, rows: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(rows)
        return t.view(torch.float8_e4m3fn) if self.format == "fp8" else t

    def scale(self) -> torch.Tensor | None:
        return torch.tensor([FP8_SCALE]) if self.format == "fp8" else None


def write_table(path: Path, cfg: PLEConfig, gen: RowGenerator, progress: bool = True) -> dict:
    """Write the dense table file; the write's seconds, rows/s and MB/s. The next shard is generated on a
    worker thread while the writer checksums and writes the current one."""
    from tqdm.auto import tqdm

    lay = cfg.layout(0)
    rows, shard_rows = lay.padded_rows, lay.shard_rows
    shards = -(-rows // shard_rows)
    bounds = [(k * shard_rows, min(rows, (k + 1) * shard_rows)) for k in range(shards)]
    t0 = time.perf_counter()
    bar = tqdm(total=rows, unit="row", unit_scale=True, desc=f"write {path.name}", disable=not progress)
    gen_s = 0.0

    def make(k: int) -> tuple[np.ndarray, float]:
        t = time.perf_counter()
        return gen.range(*bounds[k]), time.perf_counter() - t

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with TableFileWriter(path, rows, lay.head_dim, gen.format, shard_rows, cfg.layout_fields(0), force=True) as w:
            scale = gen.scale()
            if scale is not None:
                w.set_global_scale(scale)
            nxt = pool.submit(make, 0)
            for k in range(shards):
                data, took = nxt.result()
                gen_s += took
                if k + 1 < shards:
                    nxt = pool.submit(make, k + 1)
                w.write_shard(k, gen.torch_rows(data))
                bar.update(data.shape[0])
                del data
            t_close = time.perf_counter()
        close_s = time.perf_counter() - t_close
    bar.close()
    el = time.perf_counter() - t0
    size = path.stat().st_size
    return {
        "seconds": el,
        "rows_per_s": rows / el,
        "mb_per_s": size / el / 1e6,
        "generate_seconds": gen_s,
        "close_seconds": close_s,
        "file_bytes": size,
        "allocated_bytes": path.stat().st_blocks * 512,
    }


def verify(path: Path) -> dict:
    """``ple verify FILE`` in a child process: its seconds, rows/s, exit status and problems."""
    env = {**os.environ, "PYTHONPATH": str(_REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "ple.commands.cli", "verify", "--json", str(path)],
        capture_output=True,
        text=True,
        env=env,
    )
    el = time.perf_counter() - t0
    rows = read_table_header(path)["rows"]
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        report = {"stdout": proc.stdout[-2000:]}
    return {
        "seconds": el,
        "rows_per_s": rows / el,
        "mb_per_s": path.stat().st_size / el / 1e6,
        "exit_status": proc.returncode,
        "report": report,
        "stderr": proc.stderr[-2000:],
    }


# ---------------------------------------------------------------------------------------------- page cache


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def cached_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now (``mincore`` over a map of it, 1 GiB at a time; the map
    reads nothing)."""
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        cached = 0
        step = 1 << 30
        for off in range(0, size, step):
            n = min(step, size - off)
            addr = libc.mmap(None, n, 1, 1, fd, off)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} at {off}")
            try:
                vec = np.zeros(-(-n // page), dtype=np.uint8)
                if libc.mincore(addr, n, vec.ctypes.data) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} at {off}")
                cached += int(np.count_nonzero(vec & 1)) * page
            finally:
                libc.munmap(addr, n)
        return min(cached, size)
    finally:
        os.close(fd)


def drop_file_cache(path: Path, system: bool = False) -> dict:
    """Drop ``path`` from the page cache: ``posix_fadvise(DONTNEED)`` on the file (no privileges needed),
    and with ``system`` also ``echo 1 > /proc/sys/vm/drop_caches`` (every clean page of the machine). Returns
    the bytes cached before and after, and how."""
    before = cached_bytes(path)
    disk_bench.drop_page_cache(path)
    how = "posix_fadvise(DONTNEED)"
    if system:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            how += " + drop_caches"
        except OSError as e:
            how += f" (drop_caches refused: {e.strerror})"
    return {"cached_before": before, "cached_after": cached_bytes(path), "how": how}


# ---------------------------------------------------------------------------------------------- device


def device(path: Path, seconds: int, depths: tuple[int, ...] = (32,), sequential: bool = False) -> dict:
    """The device's random 4 KiB O_DIRECT reads/s of ``path`` per depth (``fio`` libaio and psync; the
    better is ``depth{d}``), and with ``sequential`` its 1 MiB sequential read MB/s."""
    out: dict[str, Any] = {"tool": "fio" if shutil.which("fio") else "pread probe (Python threads)"}
    for d in depths:
        disk_bench.drop_page_cache(path)
        lib = disk_bench.fio_iops(path, d, seconds)
        if lib is None:
            out[f"depth{d}"] = out[f"libaio_depth{d}"] = disk_bench.pread_iops(path, d, seconds)
            continue
        psync = disk_bench.fio_iops(path, d, seconds, "psync")
        out[f"libaio_depth{d}"], out[f"psync_depth{d}"] = lib, psync
        out[f"depth{d}"] = max(lib, psync or 0.0)
    if sequential and shutil.which("fio"):
        cmd = [
            "fio", "--name=seq", f"--filename={path}", "--rw=read", "--bs=1M", "--direct=1", "--ioengine=libaio",
            "--iodepth=8", f"--runtime={seconds}", "--time_based", "--readonly", "--output-format=json",
        ]  # fmt: skip
        res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        out["sequential_mb_per_s"] = res["jobs"][0]["read"]["bw_bytes"] / 1e6
    return out


# ---------------------------------------------------------------------------------------------- one configuration


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _text(cfg: PLEConfig, args, index: int) -> dict[str, np.ndarray]:
    """Configuration ``index``'s text (tokens no other configuration reads), after the warm-up's."""
    eos = cfg.eos_token_id
    pr, ps = args.prefill
    per_config = args.prefill_batches * pr * ps + args.requests * (16 + args.decode_steps) + 4096
    skip = args.warmup_tokens + index * per_config
    flat = realtext.token_stream(skip + per_config, eos)[skip:]
    n_pre = args.prefill_batches * pr * ps
    n_dec = args.requests * (16 + args.decode_steps)
    return {
        "prefill": flat[:n_pre].reshape(args.prefill_batches, pr, ps),
        "decode": flat[n_pre : n_pre + n_dec].reshape(args.requests, 16 + args.decode_steps),
        "check": flat[n_pre + n_dec :].reshape(16, 256),
    }


class _Timer:
    """Seconds and calls of a wrapped callable."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def _reads_alone(table: DirectTable, rows: int, seed: int, n: int = 1000, repeat: int = 15) -> dict:
    """Rows/s of reading ``n`` random rows (a decode step's worth) with ``read_rows``: back to back, and
    each right after a bf16 GEMM of a decode step's projections (``[64, 2560] x [2560, 12800]``, on
    torch's threads); medians of ``repeat``."""
    g = np.random.default_rng(seed)
    a = torch.randn(64, 2560).to(torch.bfloat16)
    b = torch.randn(2560, 12800).to(torch.bfloat16)
    out = {}
    for name in ("back_to_back", "after_gemm"):
        times = []
        for _ in range(repeat):
            ids = np.unique(g.integers(0, rows, n))
            if name == "after_gemm":
                a @ b
            t0 = time.perf_counter()
            table.read_rows(ids)
            times.append(time.perf_counter() - t0)
        out[name] = n / statistics.median(times)
    return out


def serve_one(args) -> dict:
    """One configuration, in this (fresh) process: see the module docstring, step 4."""
    from ple.ngram import fresh_context, ngram_ids

    cfg = config(args.rows)
    lay = cfg.layout(0)
    path = Path(args.path)
    kind, budget = args.serve, int(args.budget_gib * 2**30)
    gen = RowGenerator(args.format, lay.head_dim, args.seed)
    text = _text(cfg, args, args.index)
    eos = cfg.eos_token_id
    warm_ids = None
    if kind == "direct" and budget:
        warm = torch.from_numpy(realtext.token_stream(args.warmup_tokens, eos))
        warm_ids = ngram_ids(warm, torch.tensor([0, warm.numel()]), fresh_context(1, lay, eos), lay, eos)
    layer = disk_bench.make_layer(cfg)
    c = cfg.hc_hidden_size
    g = torch.Generator().manual_seed(9)
    pr, ps = args.prefill
    hidden_pool = torch.randn(max(pr * ps, args.requests * 16), c, generator=g).to(torch.bfloat16)
    res: dict[str, Any] = {"kind": kind, "budget_gib": args.budget_gib, "cached_at_start": cached_bytes(path)}
    reader = None if args.serve_reader == "default" else args.serve_reader
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here: the table, its cache and the serving, after the imports and the text
    res["rss_before_open_mib"] = _status_kb("VmRSS") / 1024

    t0 = time.perf_counter()
    fields = cfg.layout_fields(0)
    table: DirectTable | MmapTable
    if kind == "direct":
        table = DirectTable(path, fields, memory_budget=budget, reader=reader)
        res["reader"] = table.reader_kind
    else:
        table = MmapTable.open(path, fields)
    res["open_s"] = time.perf_counter() - t0
    res["pin_s"] = 0.0
    if isinstance(table, DirectTable):
        res["cache_slots"] = table.cache_slots
        if table.cache_slots and warm_ids is not None:
            tp = time.perf_counter()
            table.pin(DirectTable.hot_rows(warm_ids, table.cache_slots // 2))
            res["pin_s"] = time.perf_counter() - tp
            res["pin_rows_per_s"] = table.pinned_rows / res["pin_s"]
        res["pinned_rows"] = table.pinned_rows
        table.hits = table.misses = 0
        reads_at = table.reads
        reader = table._reader
        read_timer = _Timer(reader.read)
        reader.read = read_timer  # type: ignore[method-assign]
        rows_timer = _Timer(table.read_rows)
        table.read_rows = rows_timer  # type: ignore[method-assign]
    lookup_timer = _Timer(table._lookup_into)
    table._lookup_into = lookup_timer  # type: ignore[method-assign]
    layer.table = table

    def mark() -> tuple[float, int]:
        """Read seconds and rows read from the disk so far (direct tier)."""
        return (read_timer.seconds, table.misses) if isinstance(table, DirectTable) else (0.0, 0)

    def rate(since: tuple[float, int]) -> float:
        s, n = mark()
        return (n - since[1]) / (s - since[0]) if s > since[0] else 0.0

    def step(session: Session, toks: dict) -> torch.Tensor:
        n = sum(int(t.numel()) for t in toks.values())
        st = session.begin(toks)
        out = session.run(st, 0, hidden_pool[:n])
        session.end(st)
        return out

    # prefill: batches of new requests; the first one's output ends the cold start
    pre = text["prefill"]
    times = []
    at = mark()
    for b in range(pre.shape[0]):
        s = Session(layer, pre.shape[1])
        toks = {k: torch.from_numpy(pre[b, k].copy()) for k in range(pre.shape[1])}
        for k in toks:
            s.add(k)
        tb = time.perf_counter()
        step(s, toks)
        times.append(time.perf_counter() - tb)
        if b == 0:
            res["first_output_s"] = times[0]
            res["cold_start_s"] = time.perf_counter() - t0
    per_batch = pre.shape[1] * pre.shape[2]
    rest = times[1:] or times
    res["prefill_tokens_per_s"] = per_batch / statistics.median(rest)
    res["prefill_samples"] = [per_batch / t for t in times]
    res["prefill_rows_per_read_s"] = rate(at)

    # decode: a 16-token prompt each, then one token a step
    dec = text["decode"]
    r = dec.shape[0]
    s = Session(layer, r)
    for k in range(r):
        s.add(k)
    step(s, {k: torch.from_numpy(dec[k, :16].copy()) for k in range(r)})
    tokens_before = lookup_timer.seconds
    steps = []
    at = mark()
    for i in range(16, dec.shape[1]):
        toks = {k: torch.tensor([int(dec[k, i])]) for k in range(r)}
        td = time.perf_counter()
        step(s, toks)
        steps.append(time.perf_counter() - td)
    res["decode_tokens_per_s"] = r / statistics.median(steps)
    res["decode_mean_tokens_per_s"] = r * len(steps) / sum(steps)
    res["decode_lookup_share"] = (lookup_timer.seconds - tokens_before) / sum(steps)
    res["decode_rows_per_read_s"] = rate(at)
    res["lookup_s"] = lookup_timer.seconds
    res["peak_rss_mib"] = _status_kb("VmHWM") / 1024
    res["rss_anon_mib"] = _status_kb("RssAnon") / 1024
    res["rss_file_mib"] = _status_kb("RssFile") / 1024

    if isinstance(table, DirectTable):
        seen = table.hits + table.misses
        res["hit_rate"] = table.hits / seen if seen else 0.0
        res["rows_from_disk"] = table.misses
        res["reads"] = table.reads - reads_at
        res["read_s"] = read_timer.seconds
        res["read_rows_s"] = rows_timer.seconds
        res["rows_per_read_s"] = table.misses / read_timer.seconds if read_timer.seconds else 0.0
        res["reads_per_read_s"] = res["reads"] / read_timer.seconds if read_timer.seconds else 0.0
        res["rows_per_read_rows_s"] = table.misses / rows_timer.seconds if rows_timer.seconds else 0.0
    else:
        cached = cached_bytes(path)
        res["pages_read"] = cached // os.sysconf("SC_PAGE_SIZE")
        res["pages_per_lookup_s"] = res["pages_read"] / lookup_timer.seconds

    if isinstance(table, DirectTable) and not table.cache_slots:
        res["reads_alone"] = _reads_alone(table, lay.padded_rows, args.seed)

    # exactness at this size: lookups of text of this configuration's own against recomputed rows
    chk = torch.from_numpy(text["check"].copy())
    ids = ngram_ids(chk.reshape(-1), torch.arange(0, chk.numel() + 1, 256), fresh_context(16, lay, eos), lay, eos)
    edge = torch.tensor([[0, lay.padded_rows - 1, lay.padded_rows // 2, (1 << 32) // gen.row_nbytes % lay.padded_rows]])
    ids = torch.cat([ids, edge.repeat(1, ids.shape[1] // 4)])
    got = table.lookup(ids, torch.bfloat16)
    uniq, inv = np.unique(ids.numpy(), return_inverse=True)
    want = gather_dequant_reference(
        gen.torch_rows(gen.rows_of(uniq)),
        gen.scale(),
        torch.from_numpy(inv.reshape(ids.shape).astype(np.int64)),
        torch.bfloat16,
        format=args.format,
    )
    res["exact_rows_checked"] = int(uniq.size)
    res["exact"] = bool(torch.equal(got, want))

    if isinstance(table, DirectTable) and table.cache_slots:
        # the budget at its worst: every slot filled (rows in file order, from the first unread one)
        tf = time.perf_counter()
        start = lay.padded_rows // 3
        while table.pinned_rows < table.cache_slots:
            n = min(table.cache_slots - table.pinned_rows, 1 << 20)
            was = table.pinned_rows
            table.pin(np.arange(start, start + n, dtype=np.int64) % lay.padded_rows)
            start += n
            if table.pinned_rows == was and start > 2 * lay.padded_rows:
                break
        res["fill_s"] = time.perf_counter() - tf
        res["filled_slots"] = table.pinned_rows
        res["full_cache_rss_mib"] = _status_kb("VmRSS") / 1024
        res["full_cache_peak_rss_mib"] = _status_kb("VmHWM") / 1024
    table.close()
    return res


# ---------------------------------------------------------------------------------------------- readers


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def readers(args, path: Path, gen: RowGenerator, rows: int) -> dict:
    """Step 5 of the module docstring: the direct tier's readers beside ``fio``, in rounds."""
    depths, sizes = tuple(args.reader_depths), tuple(args.reader_rows)
    tables: dict[tuple[str, int], DirectTable] = {}
    out: dict[str, Any] = {"unavailable": {}, "depths": depths, "sizes": sizes}
    for kind in ("uring", "native", "threads"):
        for d in depths if kind != "threads" else depths[:1]:
            try:
                tables[(kind, d)] = DirectTable(path, memory_budget=0, queue_depth=d, reader=kind)
            except UringUnavailable as e:  # named in the report, not measured
                out["unavailable"][kind] = str(e)
    g = np.random.default_rng(args.seed)
    a = torch.randn(64, 2560).to(torch.bfloat16)
    b = torch.randn(2560, 12800).to(torch.bfloat16)
    samples: dict[str, list[dict]] = {}
    out["rounds"] = []
    cases = list(tables)
    for rnd in range(args.reader_rounds):
        dropped = drop_file_cache(path)
        dev = device(path, args.fio_seconds, depths=depths)
        rec: dict[str, Any] = {"device": dev, "cached_after_drop": dropped["cached_after"]}
        for n in sizes:
            calls = max(3, 8000 // n)
            # every reader, depth and order one call at a time, in a rotated order: the device's moments
            # (it moves from second to second on a shared machine) fall on all of them alike
            runs = [(c, o) for c in cases for o in ("back_to_back", "after_gemm")]
            acc = {run: {"times": [], "reads": 0, "cpu": 0.0, "rows": 0} for run in runs}
            for i in range(calls):
                k = (i + rnd) % len(runs)
                for (kind, d), order in runs[k:] + runs[:k]:
                    t, m = tables[(kind, d)], acc[((kind, d), order)]
                    ids = np.unique(g.integers(0, rows, n))
                    if order == "after_gemm":
                        a @ b
                    r0, c0 = t.reads, _cpu_s()
                    t0 = time.perf_counter()
                    data, _ = t.read_rows(ids)
                    m["times"].append(time.perf_counter() - t0)
                    m["cpu"] += _cpu_s() - c0
                    m["reads"] += t.reads - r0
                    m["rows"] += ids.size
                    if i == 0:  # the rows are the generator's, bit for bit
                        pick = ids if n <= 2000 else ids[:: n // 1000]
                        got = data.view(torch.uint8).numpy()[np.searchsorted(ids, pick)]
                        if not np.array_equal(got, gen.rows_of(pick)):
                            raise SystemExit(f"{kind} depth {d}: rows differ from the generator's")
            for ((kind, d), order), m in acc.items():
                med, per_call = statistics.median(m["times"]), m["rows"] / calls
                row = {
                    "rows_per_s": per_call / med,
                    "reads_per_s": m["reads"] / calls / med,
                    "of_device": per_call / med / dev[f"depth{d}"],
                    "cpu_us_per_read": 1e6 * m["cpu"] / max(1, m["reads"]),
                }
                samples.setdefault(f"{kind}/{d}/{n}/{order}", []).append(row)
                rec[f"{kind}/{d}/{n}/{order}"] = row
        out["rounds"].append(rec)
        print(
            f"round {rnd + 1}: device "
            + ", ".join(f"depth {d} {dev[f'depth{d}']:,.0f}/s" for d in depths)
            + "; "
            + ", ".join(
                f"{key} {v['of_device']:.2f}" for key, v in rec.items() if isinstance(v, dict) and "of_device" in v
            )
        )
    for t in tables.values():
        t.close()
    out["cached_after"] = cached_bytes(path)
    summary = {}
    for key, rows_ in samples.items():
        ratios = [r["of_device"] for r in rows_]
        summary[key] = {
            "rows_per_s": statistics.median(r["rows_per_s"] for r in rows_),
            "reads_per_s": statistics.median(r["reads_per_s"] for r in rows_),
            "of_device": statistics.median(ratios),
            "of_device_range": [min(ratios), max(ratios)],
            "rounds_at_085": sum(x >= 0.85 for x in ratios),
            "cpu_us_per_read": statistics.median(r["cpu_us_per_read"] for r in rows_),
        }
    out["summary"] = summary
    out["device_median"] = {
        f"depth{d}": statistics.median(r["device"][f"depth{d}"] for r in out["rounds"]) for d in depths
    }
    return out


def readers_report(res: dict) -> str:
    """The markdown table of a ``--readers`` run."""
    r = res["readers"]
    lines = [
        "| reader | depth | rows a call | order | rows/s | of the device (range; rounds >= 0.85) | CPU us/read |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for key, v in r["summary"].items():
        kind, d, n, order = key.split("/")
        lo, hi = v["of_device_range"]
        lines.append(
            f"| {kind} | {d} | {int(n):,} | {order.replace('_', ' ')} | {v['rows_per_s']:,.0f} | "
            f"{v['of_device']:.2f} ({lo:.2f}-{hi:.2f}; {v['rounds_at_085']}/{len(r['rounds'])}) | "
            f"{v['cpu_us_per_read']:.1f} |"
        )
    dev = ", ".join(f"depth {k[5:]} {v:,.0f}/s" for k, v in r["device_median"].items())
    lines.append(f"\ndevice (fio, random 4 KiB O_DIRECT, median of rounds): {dev}")
    for kind, why in r["unavailable"].items():
        lines.append(f"{kind}: not measured ({why})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


def _child(args, kind: str, budget_gib: float, index: int, reader: str = "default") -> dict:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--serve", kind, "--budget-gib", str(budget_gib),
        "--serve-reader", reader,
        "--index", str(index), "--path", str(args.path), "--rows", str(args.rows), "--format", args.format,
        "--seed", str(args.seed), "--requests", str(args.requests), "--decode-steps", str(args.decode_steps),
        "--prefill", *map(str, args.prefill), "--prefill-batches", str(args.prefill_batches),
        "--warmup-tokens", str(args.warmup_tokens),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(_REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"configuration {kind} {budget_gib} GiB failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cpu_isa() -> str:
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    names = [("amx_tile", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2")]
    return next((name for flag, name in names if flag in flags), "no AVX2")


def report(res: dict) -> str:
    """The markdown table of a run."""
    lines = [
        "| table | cold start (open / pin / first output) | prefill tok/s | decode tok/s | rows/s from disk, "
        "prefill / decode (% of the device) | hit rate | peak RSS | page cache after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in res["configs"]:
        name = "memory map" if c["kind"] == "mmap" else f"direct, budget {c['budget_gib']:g} GiB"
        if c["kind"] == "direct" and len({x.get("reader") for x in res["configs"] if x["kind"] == "direct"}) > 1:
            name += f" ({c['reader']})"
        dev = c["device"]["depth32"]
        if c["kind"] == "direct":
            p, d = c["prefill_rows_per_read_s"], c["decode_rows_per_read_s"]
            rows = f"{p:,.0f} / {d:,.0f} ({p / dev:.0%} / {d / dev:.0%})"
            hit = f"{c['hit_rate']:.1%}"
        else:
            rate = c["pages_per_lookup_s"]
            rows = f"{rate:,.0f} pages ({rate / dev:.0%})"
            hit = "n/a"
        start = f"{c['cold_start_s']:.2f} s ({c['open_s']:.2f} / {c['pin_s']:.1f} / {c['first_output_s']:.2f})"
        rss = f"{c['peak_rss_mib'] / 1024:.2f} GiB"
        if "full_cache_rss_mib" in c:
            rss += f" (full cache {c['full_cache_rss_mib'] / 1024:.2f})"
        lines.append(
            f"| {name} | {start} | {c['prefill_tokens_per_s']:,.0f} | {c['decode_tokens_per_s']:,.0f} | {rows} | "
            f"{hit} | {rss} | {c['cached_after'] / 2**20:,.0f} MiB |"
        )
    for c in res["configs"]:
        if "reads_alone" in c:
            r, dev = c["reads_alone"], c["device"]["depth32"]
            lines.append(
                f"\n1,000 random rows read alone (budget 0): back to back {r['back_to_back']:,.0f} rows/s "
                f"({r['back_to_back'] / dev:.0%} of the device), right after a GEMM {r['after_gemm']:,.0f} "
                f"({r['after_gemm'] / dev:.0%})"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the table file goes")
    ap.add_argument("--rows", type=int, default=PUBLISHED_ROWS, help="about this many rows (default: published)")
    ap.add_argument("--format", choices=FORMATS, default="q4_0")
    ap.add_argument("--seed", type=int, default=20260101)
    ap.add_argument("--budgets-gib", type=float, nargs="+", default=[0, 1, 4])
    ap.add_argument("--no-mmap", action="store_true", help="leave the memory map out")
    ap.add_argument("--requests", type=int, default=64, help="decode requests")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prefill", type=int, nargs=2, default=[4, 256], metavar=("R", "S"))
    ap.add_argument("--prefill-batches", type=int, default=5)
    ap.add_argument("--warmup-tokens", type=int, default=WARMUP_TOKENS, help="text whose hottest rows are pinned")
    ap.add_argument("--fio-seconds", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true", help="also write /proc/sys/vm/drop_caches (whole machine)")
    ap.add_argument("--keep", action="store_true", help="keep the table file")
    ap.add_argument("--reuse", action="store_true", help="serve an existing table file of this geometry")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--serve-readers",
        nargs="+",
        default=["default"],
        choices=("default", "uring", "native", "threads"),
        help="the direct tier's reader of each budget's configuration (one configuration per reader)",
    )
    ap.add_argument("--readers", action="store_true", help="time the direct tier's readers beside fio (step 5)")
    ap.add_argument("--reader-depths", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--reader-rows", type=int, nargs="+", default=[1000, 12500], help="rows a call")
    ap.add_argument("--reader-rounds", type=int, default=9)
    # one configuration in a child process (internal)
    ap.add_argument("--serve", choices=("direct", "mmap"), help=argparse.SUPPRESS)
    ap.add_argument("--budget-gib", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-reader", default="default", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.serve:
        print(json.dumps(serve_one(args)))
        return 0

    cfg = config(args.rows)
    lay = cfg.layout(0)
    args.path = Path(args.dir) / f"dense-{lay.padded_rows}-{args.format}.pletable"
    gen = RowGenerator(args.format, lay.head_dim, args.seed)
    res: dict[str, Any] = {
        "rows": lay.padded_rows,
        "head_dim": lay.head_dim,
        "format": args.format,
        "cpu": disk_bench.cpu_name(),
        "isa": _cpu_isa(),
        "cores": os.cpu_count(),
        "mem_total_gib": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30,
        "load_average_start": os.getloadavg(),
        "disk_free_before": shutil.disk_usage(args.dir).free,
    }
    need = lay.padded_rows * gen.row_nbytes
    print(f"table: {lay.padded_rows:,} rows x {lay.head_dim} {args.format}, {need / 2**30:.1f} GiB at {args.path}")
    try:
        if args.reuse and args.path.exists():
            head = read_table_header(args.path)
            if (head["rows"], head["format"]) != (lay.padded_rows, args.format):
                raise SystemExit(f"{args.path} is not a {args.format} table of {lay.padded_rows} rows")
            res["write"] = None
        else:
            if shutil.disk_usage(args.dir).free < need + (4 << 30):
                raise SystemExit(f"not enough room in {args.dir}: {need / 2**30:.1f} GiB + 4 GiB needed")
            res["write"] = write_table(args.path, cfg, gen, progress=not args.no_progress)
            w = res["write"]
            print(f"write: {w['seconds']:.0f} s, {w['rows_per_s']:,.0f} rows/s, {w['mb_per_s']:.0f} MB/s")
        if args.readers:
            res["readers"] = readers(args, args.path, gen, lay.padded_rows)
            print(readers_report(res))
            return 0
        disk_bench.drop_page_cache(args.path)
        res["verify"] = verify(args.path)
        v = res["verify"]
        print(f"ple verify: exit {v['exit_status']}, {v['seconds']:.0f} s, {v['rows_per_s']:,.0f} rows/s")
        if v["exit_status"] != 0:
            raise SystemExit(f"ple verify failed: {v['stderr']}")
        res["device"] = device(args.path, args.fio_seconds, depths=(32, 1), sequential=True)
        print("device:", {k: round(v) if isinstance(v, float) else v for k, v in res["device"].items()})

        plan = [("direct", b, r) for b in args.budgets_gib for r in args.serve_readers]
        plan += [] if args.no_mmap else [("mmap", 0.0, "default")]
        res["configs"] = []
        for i, (kind, budget, reader) in enumerate(plan):
            depths = (32,) if kind == "direct" else (32, 2)
            before = device(args.path, args.fio_seconds, depths=depths)
            dropped = drop_file_cache(args.path, system=args.drop_caches)
            c = _child(args, kind, budget, i, reader)
            c["cached_after"] = cached_bytes(args.path)  # before fio, which drops the file's pages
            c["load_average"] = os.getloadavg()
            after = device(args.path, args.fio_seconds, depths=depths)
            # the device is the better of its rates just before and just after (the tier's ratio errs low)
            c["device"] = {k: max(v, after[k]) if isinstance(v, float) else v for k, v in before.items()}
            c["device_before_after"], c["dropped"] = [before, after], dropped
            res["configs"].append(c)
            print(
                f"{kind} {budget:g} GiB{' ' + c['reader'] if 'reader' in c else ''}: cold start "
                f"{c['cold_start_s']:.2f} s, prefill "
                f"{c['prefill_tokens_per_s']:,.0f} tok/s, decode {c['decode_tokens_per_s']:,.0f} tok/s, "
                f"peak RSS {c['peak_rss_mib']:,.0f} MiB, exact {c['exact']}"
            )
            if not c["exact"]:
                raise SystemExit(f"{kind} {budget:g} GiB: lookups differ from the generator's rows")
        print(report(res))
    finally:
        res["load_average_end"] = os.getloadavg()
        if not args.keep:
            args.path.unlink(missing_ok=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
