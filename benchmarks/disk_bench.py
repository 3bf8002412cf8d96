"""The table on disk, cold, on real text: device IOPS, tiers' rows/s, Session tokens/s, lookahead, budget.

    python benchmarks/disk_bench.py [--dir /tmp] [--base 500000] [--out disk.json] [--plot disk.png]

One PLE layer at the published geometry (H 2560, HC 4, E 2560, N 3, 16 heads of 160 fp8 bytes) with
a reduced ``ngram_vocab_size_base`` (500,000: 8 M rows, a 1.28 GB table file written to ``--dir``
and removed at the end). Tokens are real text (:mod:`ple.data.realtext`: Qwen's BPE over Python's docs),
requests consecutive pieces of it. "Cold" means the file is dropped from the page cache
(``posix_fadvise(DONTNEED)``, a memory map reopened) before every step, so no tier reads a cached
page; the direct tier never fills the page cache. Every tier's outputs are compared with the
in-memory table's, bit for bit.

1. Device and tiers side by side, in rounds (``--rounds``, 5): each round measures, per depth (32
   and 64), the device's random 4 KiB ``O_DIRECT`` reads/s with ``fio`` (libaio at that depth, and
   psync from that many threads; the device's rate is the better of the two; without fio a pread
   probe of Python threads) and right after it the direct tier's cold rows/s at that depth, for a
   decode step (64 requests x 16 heads, ~850 distinct rows) and a prefill batch (4 x 256 tokens);
   then the memory map, cold, and the direct tier with its Python-thread reader (``reader=
   "threads"``, depth 32). Rows/s are a step's distinct rows over the time of its lookup (reads,
   gather and dequantization; the rows read alone, ``read_rows``, too); each round's ratio to the
   device is taken against the ``fio`` run just before, and the report gives medians over rounds.
   These lookups run on one torch thread (``--lookup-threads``).
   The machine is shared: the device's rate moves from run to run, hence the pairing.
2. Session tokens/s: decode (64 requests, one token each per step) and prefill (4 x 256 tokens),
   for the table in memory, memory-mapped cold, direct cold, and direct cold with lookahead plus
   simulated model work equal to the cold read time between ``begin`` and the layer (work that
   does not use the CPU, as on an accelerator: ``time.sleep``); medians of ``--session-rounds``
   rounds, each running every table once in a rotated order.
3. Lookahead: exposed read time as a share of the cold read time for simulated work of 0.5x, 1x
   and 2x the read time (``sleep``, and a bf16 GEMM loop on the CPU, which competes with the reads
   for the two cores here).
4. Budget: the direct tier with ``memory_budget`` from 0 up, half its cache holding the rows a
   100k-token warm-up of real text read most (``pin``), the other half a running LRU cache, then
   decode (64 requests x 32 steps) on the text that follows: hit rate, lookup tokens/s, and the
   tokens/s of the same decode through a ``Session`` (the layer's compute included); medians over
   ``--budget-rounds`` rounds of new text, budgets in a rotated order, the caches running on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ple import PLEConfig, PLELayer, Session
from ple.data import realtext
from ple.table import DirectTable, MemoryTable, MmapTable
from ple.table.files.writer import TableFileWriter
from ple.table.tiers.direct import BLOCK

_REPO = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM = 16, 160


def config(base: int) -> PLEConfig:
    cfg = json.loads((_REPO / "examples" / "published-config.json").read_text())
    cfg["text_config"]["ngram_vocab_size_base"] = base
    return PLEConfig.from_dict(cfg)


def build_file(path: Path, cfg: PLEConfig, shard_rows: int = 1 << 20) -> None:
    lay = cfg.layout(0)
    g = torch.Generator().manual_seed(0)
    with TableFileWriter(path, lay.padded_rows, lay.head_dim, "fp8", shard_rows, cfg.layout_fields(0), force=True) as w:
        w.set_global_scale(torch.tensor([0.01]))
        for k in range(-(-lay.padded_rows // shard_rows)):
            n = min(lay.padded_rows, (k + 1) * shard_rows) - k * shard_rows
            b = torch.randint(0, 0x7E, (n, lay.head_dim), generator=g, dtype=torch.uint8)  # finite fp8
            w.write_shard(k, b.view(torch.float8_e4m3fn))


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- device


def fio_iops(path: Path, depth: int, seconds: int, engine: str = "libaio") -> float | None:
    """Random 4 KiB O_DIRECT reads/s of ``path`` by ``fio``: ``libaio`` (one thread keeping ``depth``
    reads in flight) or ``psync`` (``depth`` threads of blocking preads, the direct tier's own way).
    None without fio."""
    if shutil.which("fio") is None:
        return None
    cmd = [
        "fio", "--name=probe", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
        f"--runtime={seconds}", "--time_based", "--readonly", "--output-format=json",
    ]  # fmt: skip
    if engine == "libaio":
        cmd += ["--ioengine=libaio", f"--iodepth={depth}"]
    else:
        cmd += ["--ioengine=psync", f"--numjobs={depth}", "--thread", "--group_reporting"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)["jobs"][0]["read"]["iops"])


def pread_iops(path: Path, depth: int, seconds: float) -> float:
    """Random 4 KiB O_DIRECT preads from ``depth`` threads (each its own aligned buffer)."""
    import mmap

    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    stop = time.perf_counter() + seconds
    counts = [0] * depth

    def work(k: int) -> None:
        buf = mmap.mmap(-1, BLOCK)
        rng = np.random.default_rng(k)
        offs = (rng.integers(0, size // BLOCK, 1 << 16) * BLOCK).tolist()
        n = 0
        while time.perf_counter() < stop:
            os.preadv(fd, [buf], offs[n & 0xFFFF])
            n += 1
        counts[k] = n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(k,)) for k in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    el = time.perf_counter() - t0
    os.close(fd)
    return sum(counts) / el


# ---------------------------------------------------------------------------------------------- tiers


class Tier:
    """Opens a table of one kind, cold before every step when asked."""

    def __init__(
        self, kind: str, path: Path, mem: MemoryTable, depth: int = 32, budget: int = 0, reader: str | None = None
    ):
        self.kind, self.path, self.mem, self.depth, self.budget = kind, path, mem, depth, budget
        self.reader = reader
        self.table = self._open()

    def _open(self):
        if self.kind == "memory":
            return self.mem
        if self.kind == "mmap":
            return MmapTable.open(self.path)
        return DirectTable(self.path, memory_budget=self.budget, queue_depth=self.depth, reader=self.reader)

    def cold(self) -> None:
        """Nothing of the file in the page cache (a memory map is reopened: its pages are dropped)."""
        if self.kind == "mmap":
            self.table.close()
            drop_page_cache(self.path)
            self.table = self._open()
        elif self.kind == "direct":
            drop_page_cache(self.path)

    def close(self) -> None:
        if self.kind != "memory":
            self.table.close()


def step_ids(cfg: PLEConfig, tokens: np.ndarray) -> torch.Tensor:
    """``[R*S, G]`` ids of ``R`` fresh requests of ``S`` tokens (``tokens [R, S]``)."""
    from ple.ngram import fresh_context, ngram_ids

    lay = cfg.layout(0)
    r, s = tokens.shape
    qsl = torch.arange(0, r * s + 1, s)
    return ngram_ids(
        torch.from_numpy(tokens.reshape(-1).copy()), qsl, fresh_context(r, lay, cfg.eos_token_id), lay, cfg.eos_token_id
    )


def decode_step_ids(cfg: PLEConfig, tokens: np.ndarray) -> list[torch.Tensor]:
    """The ``[R, G]`` ids of each decode step of ``R`` requests reading ``tokens [R, S]`` from a fresh
    start: step ``k`` is every request's token ``k`` with its real context (the tokens before it)."""
    r, s = tokens.shape
    ids = step_ids(cfg, tokens).reshape(r, s, -1)
    return [ids[:, k].contiguous() for k in range(s)]


def cold_lookup_times(tier: Tier, batches: list[torch.Tensor], refs: list[torch.Tensor], what: str) -> list[float]:
    """Seconds of each lookup of ``batches`` with nothing of the file cached before it; each result is
    checked against ``refs`` (``what`` names the tier in the failure)."""
    times = []
    for ids, ref in zip(batches, refs):
        tier.cold()
        t0 = time.perf_counter()
        out = tier.table.lookup(ids, torch.bfloat16)
        times.append(time.perf_counter() - t0)
        assert torch.equal(out, ref), f"{what}: rows differ from the in-memory table's"
    return times


def rows_per_second(
    tier: Tier, batches: list[torch.Tensor], refs: list[torch.Tensor], read_batches: list[torch.Tensor] | None = None
) -> dict:
    """A tier's cold rows/s over ``batches`` (each checked against ``refs``): a step's distinct rows
    over its lookup's time; with ``read_batches`` (direct tier), also over the time of reading
    those batches' rows alone (``read_rows``)."""
    times = cold_lookup_times(tier, batches, refs, tier.kind)
    rows = sum(int(np.unique(ids.numpy()).size) for ids in batches)
    read_times, read_rows = [], 0
    for ids in read_batches or []:
        distinct = np.unique(ids.numpy())
        tier.cold()
        t0 = time.perf_counter()
        tier.table.read_rows(distinct)
        read_times.append(time.perf_counter() - t0)
        read_rows += distinct.size
    n = rows / len(times)
    res = {
        "rows_per_batch": n,
        "ms_per_batch": 1e3 * statistics.median(times),
        "rows_per_s": n / statistics.median(times),
    }
    if read_times:
        res["read_rows_per_s"] = read_rows / len(read_times) / statistics.median(read_times)
    return res


# ---------------------------------------------------------------------------------------------- session


def make_layer(cfg: PLEConfig) -> PLELayer:
    layer = PLELayer(cfg, 0, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.3 if name.startswith("norm") else (0.5 if name == "conv_weight" else p.shape[-1] ** -0.5)
            p.copy_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))
    layer.refresh_weights()
    return layer


def serve(
    layer: PLELayer,
    tier: Tier,
    prompts: np.ndarray,
    steps: np.ndarray,
    lookahead: bool,
    work_s: float,
    chunk: bool,
) -> tuple[float, list[torch.Tensor]]:
    """Prefill ``prompts [R, P]`` (timed when ``chunk``), then decode ``steps [S, R]``; the timed
    part's tokens/s and its outputs. Simulated model work of ``work_s`` seconds (sleep) runs
    between ``begin`` and the layer."""
    layer.table = tier.table
    r = prompts.shape[0]
    c = layer.config.hc_hidden_size
    s = Session(layer, r, lookahead=lookahead)
    for k in range(r):
        s.add(k)
    g = torch.Generator().manual_seed(9)
    outs: list[torch.Tensor] = []
    timed = 0.0
    tokens = 0
    schedule = [{k: torch.from_numpy(prompts[k].copy()) for k in range(r)}]
    schedule += [{k: torch.tensor([int(steps[i, k])]) for k in range(r)} for i in range(steps.shape[0])]
    for i, toks in enumerate(schedule):
        n = sum(int(t.numel()) for t in toks.values())
        hidden = torch.randn(n, c, generator=g).to(torch.bfloat16)
        tier.cold()
        layer.table = tier.table  # a cold memory map is a new map
        t0 = time.perf_counter()
        st = s.begin(toks)
        if work_s:
            time.sleep(work_s)
        out = s.run(st, 0, hidden)
        s.end(st)
        el = time.perf_counter() - t0
        if (i == 0) == chunk:
            timed += el - work_s
            tokens += n
            outs.append(out)
    return tokens / timed, outs


def read_time(tier: Tier, batches: list[torch.Tensor]) -> float:
    """The median cold lookup time of ``batches`` (each read once: rows not read before)."""
    times = []
    for ids in batches:
        tier.cold()
        t0 = time.perf_counter()
        tier.table.lookup(ids, torch.bfloat16)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def exposed_share(layer, tier: Tier, steps: list[dict], read_s: float, work_s: float, kind: str) -> float:
    """The read time left exposed: after ``begin`` (which starts the cold reads) and the simulated
    work, how long the layer still has to wait for its rows (polled), over the cold read time;
    median over ``steps`` (one decode step's tokens each, by request: every repeat reads new rows)."""
    c = layer.config.hc_hidden_size
    n = len(steps[0])
    hidden = torch.randn(n, c).to(torch.bfloat16)
    a = torch.randn(256, 2560, dtype=torch.bfloat16)
    b = torch.randn(2560, 2560, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    for _ in range(3):
        a @ b
    gemm_s = (time.perf_counter() - t0) / 3

    def work() -> None:
        if kind == "sleep":
            time.sleep(work_s)
        else:
            for _ in range(max(1, round(work_s / gemm_s))):
                a @ b

    exposed = []
    for toks in steps:
        tier.cold()
        layer.table = tier.table
        s = Session(layer, n, lookahead=True)
        for k in toks:
            s.add(k)
        st = s.begin(toks)
        work()
        t0 = time.perf_counter()
        assert st.lookups is not None
        while not st.lookups[0].done():
            time.sleep(1e-4)
        exposed.append(time.perf_counter() - t0)
        s.run(st, 0, hidden)
        s.end(st)
    return statistics.median(exposed) / read_s


# ---------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the table file goes (removed after)")
    ap.add_argument("--base", type=int, default=500_000, help="ngram_vocab_size_base (rows per head)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--prefill", type=int, nargs=2, default=[4, 256], metavar=("R", "S"))
    ap.add_argument("--depths", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--budgets-mb", type=float, nargs="+", default=[0, 4, 16, 64, 256])
    ap.add_argument("--fio-seconds", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of device + tier measurements (medians)")
    ap.add_argument("--session-rounds", type=int, default=3, help="rounds of the Session runs (medians)")
    ap.add_argument("--budget-rounds", type=int, default=3, help="rounds of new text per budget (medians)")
    ap.add_argument("--lookup-threads", type=int, default=1, help="torch threads of the rows/s lookups (step 1)")
    ap.add_argument("--decode-batches", type=int, default=12, help="decode steps timed per tier and round")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--plot", default=None, help="write the budget plot (PNG)")
    args = ap.parse_args(argv)

    cfg = config(args.base)
    lay = cfg.layout(0)
    eos = cfg.eos_token_id
    workdir = Path(tempfile.mkdtemp(prefix="ple-disk-", dir=args.dir))
    path = workdir / "layer0.pletable"
    res: dict = {
        "rows": lay.padded_rows,
        "file_bytes": None,
        "tokens": "real text (ple.data.realtext)",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "load_average_start": os.getloadavg(),
    }
    try:
        t0 = time.perf_counter()
        build_file(path, cfg)
        res["file_bytes"] = os.path.getsize(path)
        print(
            f"table file: {lay.padded_rows:,} rows, {res['file_bytes'] / 1e9:.2f} GB ({time.perf_counter() - t0:.0f} s)"
        )
        mapped = MmapTable.open(path)
        mem = MemoryTable(mapped.data.clone(), mapped.scale.clone(), "fp8")
        mapped.close()

        # 1. device and tiers, side by side in rounds. Every measurement reads text of its own (rows
        # no earlier measurement read: a disk's own cache, or the host's under a VM, favours none)
        R = args.requests
        pr, ps = args.prefill
        pos = 0

        def fresh() -> tuple[dict, dict]:
            """The next decode steps and prefill batches of unread text, and the rows they look up."""
            nonlocal pos
            text = realtext.requests(R, 8 + args.decode_batches, eos, skip=pos)
            pos += text.size
            batches = {
                "decode": decode_step_ids(cfg, text)[8:],
                "prefill": [step_ids(cfg, realtext.requests(pr, ps, eos, skip=pos + k * pr * ps)) for k in range(3)],
            }
            pos += 3 * pr * ps
            assert pos <= 200_000, "section 1 reads the first 200,000 tokens; the others read later text"
            return batches, {name: [mem.lookup(b, torch.bfloat16) for b in bs] for name, bs in batches.items()}

        tiers = {f"direct_depth{d}": Tier("direct", path, mem, depth=d) for d in args.depths}
        tiers["direct_threads_depth32"] = Tier("direct", path, mem, depth=32, reader="threads")
        assert all(t.table.reader_kind in ("uring", "native") for k, t in tiers.items() if "threads" not in k)
        rounds: list[dict] = []
        # the lookups' gather and dequantization on one torch thread: on a 2-core machine shared with
        # other processes, torch's two-thread gather waits for the busy core (see docs/PERFORMANCE.md)
        threads = torch.get_num_threads()
        torch.set_num_threads(args.lookup_threads)
        for rnd in range(args.rounds):
            got: dict = {}
            for d in args.depths:
                drop_page_cache(path)
                # the device at this depth two ways; the tier is held to the better one
                iops = fio_iops(path, d, args.fio_seconds)
                got[f"fio_libaio_depth{d}"] = iops if iops is not None else pread_iops(path, d, args.fio_seconds)
                drop_page_cache(path)
                iops = fio_iops(path, d, args.fio_seconds, "psync")
                got[f"fio_psync_depth{d}"] = iops if iops is not None else got[f"fio_libaio_depth{d}"]
                got[f"fio_depth{d}"] = max(got[f"fio_libaio_depth{d}"], got[f"fio_psync_depth{d}"])
                (phases, refs), (reads, _) = fresh(), fresh()
                for name in phases:
                    got[f"{name}_direct_depth{d}"] = rows_per_second(
                        tiers[f"direct_depth{d}"], phases[name], refs[name], reads[name]
                    )
            (phases, refs), (reads, _) = fresh(), fresh()
            for name in phases:
                got[f"{name}_direct_threads_depth32"] = rows_per_second(
                    tiers["direct_threads_depth32"], phases[name], refs[name], reads[name]
                )
            phases, refs = fresh()
            for name in phases:
                mm = Tier("mmap", path, mem)
                got[f"{name}_mmap"] = rows_per_second(mm, phases[name], refs[name])
                mm.close()
            rounds.append(got)
            print(
                f"round {rnd + 1}: "
                + ", ".join(
                    f"{k} {v:,.0f}" if not isinstance(v, dict) else f"{k} {v['rows_per_s']:,.0f}"
                    for k, v in got.items()
                )
            )
        torch.set_num_threads(threads)
        for t in tiers.values():
            t.close()
        summary: dict = {
            "rounds": rounds,
            "device": "fio" if shutil.which("fio") else "pread probe",
            "lookup_torch_threads": args.lookup_threads,
        }
        for key in rounds[0]:
            if key.startswith("fio"):
                summary[key] = statistics.median(r[key] for r in rounds)
                continue
            for field in ("rows_per_s", "read_rows_per_s", "rows_per_batch", "ms_per_batch"):
                if field in rounds[0][key]:
                    summary[f"{key}_{field}"] = statistics.median(r[key][field] for r in rounds)
            depth = int(key.rsplit("depth", 1)[1]) if "depth" in key else 32
            for field in ("rows_per_s", "read_rows_per_s"):
                if field in rounds[0][key]:
                    summary[f"{key}_{field}_of_device"] = statistics.median(
                        r[key][field] / r[f"fio_depth{depth}"] for r in rounds
                    )
        res["device_and_tiers"] = summary
        for key, v in summary.items():
            if key != "rounds":
                print(f"{key}: {v:.3f}" if isinstance(v, float) and v < 10 else f"{key}: {v}")

        # 2. session tokens/s
        layer = make_layer(cfg)
        direct = Tier("direct", path, mem)
        read_s = read_time(direct, fresh()[0]["decode"][:3])
        sess: dict = {"decode_read_ms": read_s * 1e3}
        setups = [
            ("memory", False, 0.0),
            ("mmap_cold", False, 0.0),
            ("direct_cold", False, 0.0),
            ("direct_cold_lookahead", True, read_s),
        ]
        samples: dict = {(name, phase): [] for name, _, _ in setups for phase in ("decode", "prefill")}
        spos = 200_000
        for rnd in range(args.session_rounds):
            # every round runs each table once, in a rotated order (drift hits all alike), each on text
            # of its own (rows no earlier run read), checked against the in-memory table on that text
            for name, lookahead, work in setups[rnd % 4 :] + setups[: rnd % 4]:
                prompts = realtext.requests(R, 16, eos, skip=spos)
                steps = realtext.requests(args.decode_steps, R, eos, skip=spos + R * 16)
                pre_prompts = realtext.requests(pr, ps, eos, skip=spos + R * (16 + args.decode_steps))
                spos += R * (16 + args.decode_steps) + pr * ps
                assert spos <= 260_000, "section 2 reads tokens 200,000 to 260,000"
                kind = name.split("_")[0]
                phases_s = {
                    "decode": (prompts, steps, False),
                    "prefill": (pre_prompts, np.zeros((0, pr), dtype=np.int64), True),
                }
                for phase, (p, st, chunk) in phases_s.items():
                    tier = Tier(kind, path, mem)
                    tps, outs = serve(layer, tier, p, st, lookahead, work, chunk)
                    tier.close()
                    if kind != "memory":
                        ref = serve(layer, Tier("memory", path, mem), p, st, False, 0.0, chunk)[1]
                        assert all(torch.equal(a, b) for a, b in zip(outs, ref)), f"{name} {phase} differs"
                    samples[(name, phase)].append(tps)
        for name, _, _ in setups:
            row = {f"{ph}_tokens_per_s": statistics.median(samples[(name, ph)]) for ph in ("decode", "prefill")}
            row["samples"] = {ph: samples[(name, ph)] for ph in ("decode", "prefill")}
            sess[name] = row
            print(
                f"session {name}: decode {row['decode_tokens_per_s']:,.0f} tok/s, prefill "
                f"{row['prefill_tokens_per_s']:,.0f} tok/s (medians of {args.session_rounds})"
            )
        res["session"] = sess

        # 3. lookahead exposed share
        # fresh requests, one token each: every step's rows unread before (3 for the read time, 5 a case)
        look_text = realtext.requests(33, R, eos, skip=260_000)
        look_steps = [{k: torch.tensor([int(row[k])]) for k in range(R)} for row in look_text]
        read_s = read_time(direct, [step_ids(cfg, look_text[i : i + 1].T.copy()) for i in range(3)])
        look = {"read_ms": read_s * 1e3}
        case = 0
        for kind in ("sleep", "gemm"):
            for f in (0.5, 1.0, 2.0):
                share = exposed_share(layer, direct, look_steps[3 + 5 * case : 8 + 5 * case], read_s, f * read_s, kind)
                case += 1
                look[f"{kind}_{f}x"] = share
                print(f"lookahead, {kind} work {f}x the reads: {share:.1%} of the read time exposed")
        res["lookahead"] = look
        direct.close()

        # 4. budget: per budget two tables (one for lookups alone, one for a Session), each pinned
        # once; rounds of new text in a rotated order, the running caches carried from round to round
        warm = realtext.token_stream(300_000, eos)[200_000:]  # the text just before the measured one
        warm_ids = step_ids(cfg, warm.reshape(1, -1))
        btiers: dict = {}
        for mb in args.budgets_mb:
            for part in ("lookups", "session"):
                tier = Tier("direct", path, mem, budget=int(mb * 2**20))
                t = tier.table
                # half the cache holds the warm-up's hottest rows for good, the other half is a running LRU
                if t.cache_slots:
                    t.pin(DirectTable.hot_rows(warm_ids, t.cache_slots // 2))
                t.hits = t.misses = 0
                btiers[(mb, part)] = tier
        bsamples: dict = {(mb, part): [] for mb in args.budgets_mb for part in ("lookups", "session")}
        mem_tier = Tier("memory", path, mem)
        for rnd in range(args.budget_rounds):
            # 8 tokens of prompt, 32 steps; the lookups read other text than the Session (unread rows)
            later = realtext.requests(R, 40, eos, skip=300_000 + rnd * R * 40)
            other = realtext.requests(R, 40, eos, skip=300_000 + (args.budget_rounds + rnd) * R * 40)
            later_steps = decode_step_ids(cfg, other)[8:]
            later_refs = [mem.lookup(ids, torch.bfloat16) for ids in later_steps]
            _, ref_outs_budget = serve(layer, mem_tier, later[:, :8], later[:, 8:].T.copy(), False, 0.0, False)
            k = rnd % len(args.budgets_mb)
            for mb in args.budgets_mb[k:] + args.budgets_mb[:k]:
                tier = btiers[(mb, "session")]
                tps, outs = serve(layer, tier, later[:, :8], later[:, 8:].T.copy(), False, 0.0, False)
                assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs_budget)), f"budget {mb}: outputs differ"
                bsamples[(mb, "session")].append(tps)
                times = cold_lookup_times(btiers[(mb, "lookups")], later_steps, later_refs, f"budget {mb}")
                bsamples[(mb, "lookups")].append(R / statistics.median(times))
        budget_rows = []
        for mb in args.budgets_mb:
            t = btiers[(mb, "lookups")].table
            row = {
                "budget_mb": mb,
                "pinned_rows": t.pinned_rows,
                "hit_rate": t.hits / max(1, t.hits + t.misses),
                "tokens_per_s": statistics.median(bsamples[(mb, "lookups")]),
                "session_tokens_per_s": statistics.median(bsamples[(mb, "session")]),
                "samples": {"lookups": bsamples[(mb, "lookups")], "session": bsamples[(mb, "session")]},
            }
            budget_rows.append(row)
            print(
                f"budget {mb:g} MB: {row['pinned_rows']:,} rows pinned, hit rate {row['hit_rate']:.1%}, "
                f"{row['tokens_per_s']:,.0f} tok/s (lookups), {row['session_tokens_per_s']:,.0f} tok/s (Session decode)"
            )
        for tier in btiers.values():
            tier.close()
        res["budget"] = budget_rows
        if args.plot:
            plot_budget(budget_rows, Path(args.plot))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res["load_average_end"] = os.getloadavg()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def plot_budget(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [max(r["budget_mb"], 0.5) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(x, [r["tokens_per_s"] for r in rows], "o-", color="tab:blue", label="lookups alone")
    ax.plot(
        x,
        [r["session_tokens_per_s"] for r in rows],
        "^-",
        color="tab:green",
        label="Session decode (layer compute too)",
    )
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("memory budget, MB (0 plotted at 0.5)")
    ax.set_ylabel("decode tokens/s, cold disk")
    ax2 = ax.twinx()
    ax2.plot(x, [100 * r["hit_rate"] for r in rows], "s--", color="tab:red", label="row cache hit rate")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("row cache hit rate, %", color="tab:red")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [str(h.get_label()) for h in lines], loc="lower right", fontsize=8)
    ax.set_title(
        "Direct tier, real text, published geometry (64 requests):\nhot rows in memory, the rest from disk", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
