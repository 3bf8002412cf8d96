"""The table on disk, cold, on real text: device IOPS, tiers' rows/s, Session tokens/s, lookahead, budget.

    PYTHONPATH=src python bench/disk_bench.py [--dir /tmp] [--base 500000] [--out disk.json] [--plot disk.png]

One PLE layer at the published geometry (H 2560, HC 4, E 2560, N 3, 16 heads of 160 fp8 bytes) with
a reduced ``ngram_vocab_size_base`` (500,000: 8 M rows, a 1.28 GB table file written to ``--dir``
and removed at the end). Tokens are real text (:mod:`ple.realtext`: Qwen's BPE over Python's docs),
requests consecutive pieces of it. "Cold" means the file is dropped from the page cache
(``posix_fadvise(DONTNEED)``, a memory map reopened) before every step, so no tier reads a cached
page; the direct tier never fills the page cache. Every tier's outputs are compared with the
in-memory table's, bit for bit.

1. Device: random 4 KiB reads of the table file with ``O_DIRECT``, by ``fio`` (libaio, depth 32 and
   64) when installed, and by a pread probe (threads, the direct tier's mechanism, same depths).
2. Rows/s, cold: a decode step's distinct rows (64 requests x 16 heads) and a prefill batch's, by
   the memory map and by the direct tier at depth 32 and 64.
3. Session tokens/s: decode (64 requests, one token each per step) and prefill (4 x 256 tokens),
   for the table in memory, memory-mapped cold, direct cold, and direct cold with lookahead plus
   simulated model work equal to the cold read time between ``begin`` and the layer (work that
   does not use the CPU, as on an accelerator: ``time.sleep``).
4. Lookahead: exposed read time as a share of the cold read time for simulated work of 0.5x, 1x
   and 2x the read time (``sleep``, and a bf16 GEMM loop on the CPU, which competes with the reads
   for the two cores here).
5. Budget: the direct tier with ``memory_budget`` from 0 up, half its cache holding the rows a
   100k-token warm-up of real text read most (``pin``), the other half a running LRU cache, then
   decode (64 requests x 32 steps) on the text that follows: hit rate and lookup tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
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

from ple import PLEConfig, PLELayer, Session, realtext
from ple.table import DirectTable, MemoryTable, MmapTable
from ple.table.direct import BLOCK
from ple.table.table_file import TableFileWriter

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


def fio_iops(path: Path, depth: int, seconds: int) -> float | None:
    if shutil.which("fio") is None:
        return None
    cmd = [
        "fio", "--name=probe", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
        "--ioengine=libaio", f"--iodepth={depth}", f"--runtime={seconds}", "--time_based",
        "--readonly", "--output-format=json",
    ]  # fmt: skip
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

    def __init__(self, kind: str, path: Path, mem: MemoryTable, depth: int = 32, budget: int = 0):
        self.kind, self.path, self.mem, self.depth, self.budget = kind, path, mem, depth, budget
        self.table = self._open()

    def _open(self):
        if self.kind == "memory":
            return self.mem
        if self.kind == "mmap":
            return MmapTable.open(self.path)
        return DirectTable(self.path, memory_budget=self.budget, queue_depth=self.depth)

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


def rows_per_second(tier: Tier, batches: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    times, rows = [], 0
    for ids, ref in zip(batches, refs):
        tier.cold()
        t0 = time.perf_counter()
        out = tier.table.lookup(ids, torch.bfloat16)
        times.append(time.perf_counter() - t0)
        assert torch.equal(out, ref), f"{tier.kind}: rows differ from the in-memory table's"
        rows += int(torch.unique(ids).numel())
    return {
        "rows_per_s": rows / sum(times),
        "rows_per_batch": rows / len(times),
        "ms_per_batch": 1e3 * statistics.median(times),
        "rows_per_s_median_batch": rows / len(times) / statistics.median(times),
    }


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


def read_time(tier: Tier, ids: torch.Tensor) -> float:
    times = []
    for _ in range(3):
        tier.cold()
        t0 = time.perf_counter()
        tier.table.lookup(ids, torch.bfloat16)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def exposed_share(layer, tier: Tier, toks: dict, read_s: float, work_s: float, kind: str, repeat: int = 5) -> float:
    """The read time left exposed: after ``begin`` (which starts the cold reads) and the simulated
    work, how long the layer still has to wait for its rows (polled), over the cold read time;
    median of ``repeat``."""
    c = layer.config.hc_hidden_size
    n = len(toks)
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
    for _ in range(repeat):
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
    ap.add_argument("--fio-seconds", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    ap.add_argument("--plot", default=None, help="write the budget plot (PNG)")
    args = ap.parse_args(argv)

    cfg = config(args.base)
    lay = cfg.layout(0)
    eos = cfg.eos_token_id
    workdir = Path(tempfile.mkdtemp(prefix="ple-disk-", dir=args.dir))
    path = workdir / "layer0.pletable"
    res: dict = {"rows": lay.padded_rows, "file_bytes": None, "tokens": "real text (ple.realtext)"}
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

        # 1. device
        dev = {}
        for d in args.depths:
            drop_page_cache(path)
            dev[f"fio_depth{d}"] = fio_iops(path, d, args.fio_seconds)
            dev[f"pread_depth{d}"] = pread_iops(path, d, args.fio_seconds)
        res["device_iops"] = dev
        print("device, random 4 KiB reads/s:", {k: None if v is None else round(v) for k, v in dev.items()})

        # 2. rows/s
        R = args.requests
        text = realtext.requests(R, 64, eos)
        decode_batches = [step_ids(cfg, text[:, k : k + 1]) for k in range(8, 14)]
        pr, ps = args.prefill
        prefill_batches = [step_ids(cfg, realtext.requests(pr, ps, eos, skip=100_000 + k * pr * ps)) for k in range(3)]
        rows = {}
        for name, batches in (("decode", decode_batches), ("prefill", prefill_batches)):
            refs = [mem.lookup(b, torch.bfloat16) for b in batches]
            for kind, depth in [("mmap", 0)] + [("direct", d) for d in args.depths]:
                tier = Tier(kind, path, mem, depth=max(depth, 1))
                key = f"{name}_{kind}" + (f"_depth{depth}" if depth else "")
                rows[key] = rows_per_second(tier, batches, refs)
                tier.close()
                r = rows[key]
                print(
                    f"{key}: {r['rows_per_s']:,.0f} rows/s over all batches, {r['rows_per_s_median_batch']:,.0f} in the "
                    f"median batch ({r['rows_per_batch']:,.0f} rows, {r['ms_per_batch']:.1f} ms)"
                )
        res["rows"] = rows

        # 3. session tokens/s
        layer = make_layer(cfg)
        prompts = realtext.requests(R, 16, eos, skip=200_000)
        steps = realtext.requests(args.decode_steps, R, eos, skip=220_000)
        pre_prompts = realtext.requests(pr, ps, eos, skip=240_000)
        direct = Tier("direct", path, mem)
        read_s = read_time(direct, decode_batches[0])
        sess: dict = {"decode_read_ms": read_s * 1e3}
        ref_outs: dict = {}
        for name, lookahead, work in (
            ("memory", False, 0.0),
            ("mmap_cold", False, 0.0),
            ("direct_cold", False, 0.0),
            ("direct_cold_lookahead", True, read_s),
        ):
            kind = name.split("_")[0]
            row = {}
            for phase, (p, st, chunk) in {
                "decode": (prompts, steps, False),
                "prefill": (pre_prompts, np.zeros((0, pr), dtype=np.int64), True),
            }.items():
                tier = Tier(kind, path, mem)
                tps, outs = serve(layer, tier, p, st, lookahead, work, chunk)
                tier.close()
                if name == "memory":
                    ref_outs[phase] = outs
                else:
                    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs[phase])), f"{name} {phase} differs"
                row[f"{phase}_tokens_per_s"] = tps
            sess[name] = row
            print(
                f"session {name}: decode {row['decode_tokens_per_s']:,.0f} tok/s, prefill {row['prefill_tokens_per_s']:,.0f} tok/s"
            )
        res["session"] = sess

        # 4. lookahead exposed share
        toks = {k: torch.tensor([int(steps[0, k])]) for k in range(R)}
        ids = step_ids(cfg, steps[:1].T.copy())
        read_s = read_time(direct, ids)
        look = {"read_ms": read_s * 1e3}
        for kind in ("sleep", "gemm"):
            for f in (0.5, 1.0, 2.0):
                share = exposed_share(layer, direct, toks, read_s, f * read_s, kind)
                look[f"{kind}_{f}x"] = share
                print(f"lookahead, {kind} work {f}x the reads: {share:.1%} of the read time exposed")
        res["lookahead"] = look
        direct.close()

        # 5. budget
        warm = realtext.token_stream(300_000, eos)[200_000:]  # the text just before the measured one
        warm_ids = step_ids(cfg, warm.reshape(1, -1))
        later = realtext.requests(R, 32, eos, skip=300_000)
        budget_rows = []
        for mb in args.budgets_mb:
            tier = Tier("direct", path, mem, budget=int(mb * 2**20))
            t = tier.table
            # half the cache holds the warm-up's hottest rows for good, the other half is a running LRU
            pinned = t.pin(DirectTable.hot_rows(warm_ids, t.cache_slots // 2)) if t.cache_slots else 0
            t.hits = t.misses = 0
            times = []
            for k in range(later.shape[1]):
                ids = step_ids(cfg, later[:, k : k + 1])
                tier.cold()
                t0 = time.perf_counter()
                t.lookup(ids, torch.bfloat16)
                times.append(time.perf_counter() - t0)
            hit = t.hits / max(1, t.hits + t.misses)
            budget_rows.append(
                {"budget_mb": mb, "pinned_rows": pinned, "hit_rate": hit, "tokens_per_s": R / statistics.median(times)}
            )
            tier.close()
            print(
                f"budget {mb:g} MB: {pinned:,} rows pinned, hit rate {hit:.1%}, {budget_rows[-1]['tokens_per_s']:,.0f} tok/s (lookup only)"
            )
        res["budget"] = budget_rows
        if args.plot:
            plot_budget(budget_rows, Path(args.plot))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def plot_budget(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [max(r["budget_mb"], 0.5) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(x, [r["tokens_per_s"] for r in rows], "o-", color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("memory budget, MB (0 plotted at 0.5)")
    ax.set_ylabel("decode lookups, tokens/s (cold disk)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(x, [100 * r["hit_rate"] for r in rows], "s--", color="tab:red")
    ax2.set_ylabel("row cache hit rate, %", color="tab:red")
    ax.set_title("Direct tier: hot rows of real text in memory, the rest from disk")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
