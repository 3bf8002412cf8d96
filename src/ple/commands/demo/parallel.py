"""``ple demo --ranks N --parallel {sp,etp,dp}``: the serving workload on N processes, checked bit for
bit against one process.

The command spawns N local ranks with the environment ``torchrun`` gives (or, started by
``torchrun ... -m ple.commands.cli demo --parallel MODE``, each process is one rank). Every rank builds the
same seeded layer (fp8 table with one global scale, in memory or a table file), serves a stream of
mixed steps (chunked prefill, decode, speculative verification with rejections, EOS tokens, slots
reused as requests finish, null rows) through :class:`ple.parallel.ParallelLayer`, and after every
step compares its output rows and its state pool with a one-process layer (full table) run on the
same batch in the same process: ``torch.equal`` on the bits. The ranks that share a batch ("sp",
"etp") draw it from one seed; "dp" ranks, and the data-parallel replicas of "sp" groups, draw their
own, so their step counts differ and a rank whose stream ended keeps stepping with empty batches
until every rank is done. Rank 0 prints the report; the exit status is 0 only when every rank
matched on every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ple.common.argtypes import positive_int
from ple.config import PLEConfig
from ple.errors import CommandLineError, InvalidArgumentError, PLEError
from ple.layer import PLELayer
from ple.ngram import next_ngram_context
from ple.parallel import (
    MODES,
    ParallelLayer,
    PeerFailureError,
    ProcessContext,
    agree,
    build_groups,
    collective_failures,
    init_from_env,
    launch_env,
    report_failure,
    shard_of,
    spawn_local,
    under_launcher,
)
from ple.parallel.launch import check_timeout
from ple.runtime import Batch
from ple.table import MemoryTable, Table
from ple.table.formats.quantize import quantize_global
from ple.table.tiers.sharded import METHODS, ShardedTable, load_sharded

__all__ = [
    "DEFAULT_CONFIG",
    "Options",
    "Step",
    "Workload",
    "add_arguments",
    "requested",
    "run",
]

# The published geometry scaled down 10x in width (H : HC : E : heads as published), a small table.
DEFAULT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "hc_count": 4,
    "ple_layer_ids": [2],
    "ple_embed_dim": 256,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "vocab_size": 248320,
    "ngram_vocab_size_base": 20000,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 128,
    "ple_conv_kernel_size": 4,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 248044,
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_REPORT_WAIT_S = 2.0  # how long a failed rank waits for its peers' reports (ple.parallel.guard's default)


# ---------------------------------------------------------------------------------------- arguments
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the multi-process demo (the serving demo's --requests, --slots, --num-spec,
    --chunk, --seed, --tier, --config, --layer, --workdir, --json and --output apply too)."""
    g = p.add_argument_group("several processes (ple.parallel)")
    g.add_argument("--ranks", type=positive_int, default=1, help="local processes to spawn (default 1)")
    g.add_argument(
        "--parallel",
        choices=MODES,
        help="serve the workload in this mode on --ranks processes (or on torchrun's) and check every "
        "output and state against one process: sp = token rows sharded, etp = table sharded, same batch; "
        "dp = table sharded, a batch per rank",
    )
    g.add_argument(
        "--sp-size",
        type=positive_int,
        help="sp: ranks per sequence-parallel group (default all); fewer makes data-parallel groups (TP x DP)",
    )
    g.add_argument(
        "--table-split",
        choices=["replicated", "sharded"],
        help="every rank holds the whole table, or its rows are sharded across all ranks (default: sharded, "
        "replicated for sp)",
    )
    g.add_argument("--lookup-method", choices=METHODS, help="how a sharded table combines rows (default: per mode)")
    g.add_argument("--parallel-dtype", choices=sorted(_DTYPES), default="float32", help="activation dtype")
    g.add_argument("--dist-backend", choices=["gloo", "nccl"], help="default: nccl with CUDA, else gloo")
    g.add_argument(
        "--dist-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long a collective waits for a stalled rank before every rank fails (default 60)",
    )


def requested(args: argparse.Namespace) -> bool:
    """Whether ``ple demo`` was asked to run on several processes."""
    return getattr(args, "ranks", 1) > 1 or getattr(args, "parallel", None) is not None


@dataclasses.dataclass(frozen=True)
class Options:
    """What every rank needs to run (the parsed command line, JSON-serializable)."""

    mode: str
    ranks: int
    sp_size: int | None = None
    table_split: str | None = None
    lookup_method: str | None = None
    dtype: str = "float32"
    backend: str | None = None
    timeout_s: float = 60.0
    requests: int = 24
    slots: int = 8
    num_spec: int = 3
    chunk: int = 48
    seed: int = 0
    tier: str = "memory"
    config: str | None = None
    layer: int = 0
    workdir: str | None = None
    json: bool = False
    output: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        if args.parallel is None:
            raise CommandLineError(f"--ranks {args.ranks}: say how to split the work with --parallel {{sp,etp,dp}}")
        try:
            check_timeout(args.dist_timeout, "--dist-timeout")
        except InvalidArgumentError as e:
            raise CommandLineError(str(e)) from None
        defaults = cls(mode=args.parallel, ranks=args.ranks)
        kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}
        kw.update(
            mode=args.parallel,
            dtype=args.parallel_dtype,
            backend=args.dist_backend,
            timeout_s=float(args.dist_timeout),
            tier=getattr(args, "tier", None) or defaults.tier,
        )
        opts = cls(**kw)
        opts.check()
        return opts

    def check(self) -> None:
        if self.mode not in MODES:
            raise CommandLineError(f"--parallel {self.mode!r} is not one of {list(MODES)}")
        if self.tier not in ("memory", "mmap"):
            raise CommandLineError(f"--tier {self.tier!r}: the parallel demo keeps tables in memory or mmap")
        for name in ("requests", "slots", "chunk"):
            if getattr(self, name) < 1:
                raise CommandLineError(f"--{name} must be >= 1, got {getattr(self, name)}")

    def check_world(self, world: int) -> None:
        """Refuse what cannot run on ``world`` ranks (before any rank starts)."""
        if self.mode == "sp" and self.sp_size is not None and world % self.sp_size:
            raise CommandLineError(f"--sp-size {self.sp_size} does not divide the {world} ranks")

    def agreed(self, config: PLEConfig, sp_size: int) -> dict[str, int | str]:
        """What every rank of one run must share (compared before anything else)."""
        blob = json.dumps(config.to_dict(), sort_keys=True, default=str).encode()
        return {
            "mode": self.mode,
            "sp_size": sp_size if self.mode == "sp" else 0,
            "table_split": self.split,
            "lookup_method": self.lookup_method or "",
            "dtype": self.dtype,
            "tier": self.tier,
            "config": hashlib.sha256(blob).hexdigest(),
            "layer": self.layer,
            "seed": self.seed,
            "requests": self.requests,
            "slots": self.slots,
            "num_spec": self.num_spec,
            "chunk": self.chunk,
        }

    @property
    def split(self) -> str:
        return self.table_split or ("replicated" if self.mode == "sp" else "sharded")


# ---------------------------------------------------------------------------------------- workload
@dataclasses.dataclass
class Step:
    """One packed batch: what :meth:`ple.runtime.Batch.build` takes, the tokens and the hidden rows."""

    lens: list[int]
    slots: list[int]
    kinds: list[str]
    has_init: list[bool]
    rejected: list[int]
    context: torch.Tensor  # [R, N-1]
    tokens: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, HC*H] float32 (cast by the user)
    kept: list[int]  # tokens each request keeps (verify rows: the accepted count)

    def batch(self, pool: torch.Tensor, num_spec: int, conv_window: int) -> Batch:
        return Batch.build(
            self.lens,
            self.slots,
            self.context,
            pool,
            kinds=self.kinds,
            has_initial_state=self.has_init,
            num_rejected=self.rejected,
            num_spec=num_spec,
            conv_window=conv_window,
        )


@dataclasses.dataclass
class _Req:
    slot: int
    prompt: int
    target: int
    context: torch.Tensor
    length: int = 0
    rejected: int = 0


class Workload:
    """A seeded stream of serving steps over ``slots`` state slots: requests arrive until ``requests``
    have been served; each step every live request sends a prefill chunk (at most ``chunk`` tokens),
    one decode token, or (after its prompt, with ``num_spec``) a speculative chunk of 1..1+num_spec
    tokens of which a random number is kept; tokens are EOS with probability ``eos_p``; some steps
    carry a null row (slot -1); a finished request's slot goes to the next one.

    ``counts`` records what the stream covered (for tests that must not pass vacuously).
    """

    def __init__(
        self,
        config: PLEConfig,
        *,
        seed: int,
        requests: int,
        slots: int,
        num_spec: int,
        chunk: int,
        eos_p: float = 0.05,
        null_p: float = 0.1,
        prompt: tuple[int, int] = (4, 120),
        gen: tuple[int, int] = (2, 24),
    ) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.slots, self.num_spec, self.chunk = slots, num_spec, chunk
        self.eos_p, self.null_p = eos_p, null_p
        self.waiting = [(self.rng.randint(*prompt), self.rng.randint(*gen)) for _ in range(requests)]
        self.live: list[_Req] = []
        self.free = list(range(slots))
        self.used_slots: set[int] = set()
        self._order: list[_Req | None] = []
        self.counts = dict.fromkeys(
            ("steps", "tokens", "prefill_first", "prefill_continued", "decode", "verify", "rejected", "eos",
             "slot_reuse", "null_rows", "finished"),
            0,
        )  # fmt: skip

    @property
    def done(self) -> bool:
        return not self.waiting and not self.live

    def _token(self) -> int:
        cfg = self.config
        if self.rng.random() < self.eos_p:
            self.counts["eos"] += 1
            return cfg.eos_token_id
        return self.rng.randrange(cfg.vocab_size)

    def next_step(self) -> Step:
        """The next batch (empty once the stream is done); call :meth:`advance` after running it."""
        cfg = self.config
        while self.waiting and self.free:
            p, g = self.waiting.pop(0)
            slot = self.free.pop(self.rng.randrange(len(self.free)))
            if slot in self.used_slots:
                self.counts["slot_reuse"] += 1
            self.used_slots.add(slot)
            ctx = torch.full((cfg.ngram_size - 1,), cfg.eos_token_id, dtype=torch.int64)
            self.live.append(_Req(slot, p, p + g, ctx))
        lens, slots, kinds, has_init, rejected, ctxs, toks, kept = [], [], [], [], [], [], [], []
        rows = list(self.live)
        self.rng.shuffle(rows)
        self._order = list(rows)
        for r in rows:
            if r.length < r.prompt:
                n, kind, k = min(self.chunk, r.prompt - r.length), "prefill", None
                self.counts["prefill_continued" if r.length else "prefill_first"] += 1
            elif self.num_spec and self.rng.random() < 0.5:
                n, kind = self.rng.randint(1, 1 + self.num_spec), "verify"
                k = self.rng.randint(1, n)
                self.counts["verify"] += 1
                self.counts["rejected"] += n - k
            else:
                n, kind, k = 1, "decode", None
                self.counts["decode"] += 1
            lens.append(n)
            slots.append(r.slot)
            kinds.append(kind)
            has_init.append(r.length > 0)
            rejected.append(r.rejected)
            ctxs.append(r.context)
            toks += [self._token() for _ in range(n)]
            kept.append(n if k is None else k)
        if self.rng.random() < self.null_p:  # a padding row the engine skips (no slot, no state)
            n = self.rng.randint(1, 3)
            pos = self.rng.randint(0, len(lens))
            lens.insert(pos, n)
            slots.insert(pos, -1)
            kinds.insert(pos, "prefill")
            has_init.insert(pos, False)
            rejected.insert(pos, 0)
            ctxs.insert(pos, torch.full((cfg.ngram_size - 1,), cfg.eos_token_id, dtype=torch.int64))
            toks_pos = sum(lens[:pos])
            toks[toks_pos:toks_pos] = [self._token() for _ in range(n)]
            kept.insert(pos, n)
            self._order.insert(pos, None)
            self.counts["null_rows"] += 1
        T = len(toks)
        self.counts["steps"] += 1
        self.counts["tokens"] += T
        return Step(
            lens,
            slots,
            kinds,
            has_init,
            rejected,
            torch.stack(ctxs) if ctxs else torch.zeros(0, cfg.ngram_size - 1, dtype=torch.int64),
            torch.tensor(toks, dtype=torch.int64),
            torch.randn(T, cfg.hc_hidden_size, generator=self.gen),
            kept,
        )

    def advance(self, step: Step) -> None:
        """Account for a step that ran: contexts of the kept tokens, rejected counts, finished requests."""
        a = 0
        for req, n, k in zip(self._order, step.lens, step.kept):
            toks = step.tokens[a : a + n].cpu()
            a += n
            if req is None:
                continue
            req.context = next_ngram_context(toks[:k], torch.tensor([0, k]), req.context.view(1, -1))[0]
            req.length += k
            req.rejected = n - k
            if req.length >= req.target:
                self.live.remove(req)
                self.free.append(req.slot)
                self.counts["finished"] += 1


# ---------------------------------------------------------------------------------------- the layer
def build_layer(config: PLEConfig, index: int, dtype: torch.dtype, seed: int) -> tuple[PLELayer, MemoryTable]:
    """A layer with seeded weights and its full fp8 table with one global scale (the published format)."""
    layer = PLELayer(config, index, dtype=dtype)
    g = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.3 if name.startswith(("norm", "conv")) else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    lay = layer.layout
    rows, gscale = quantize_global(torch.randn(lay.padded_rows, lay.head_dim, generator=g) * 0.05)
    return layer, MemoryTable(rows, gscale, "fp8")


def _table_file(full: MemoryTable, config: PLEConfig, index: int, path: Path) -> Path:
    from ple.checkpoint import write_layer_table

    lay = config.layout(index)
    assert full.scale is not None
    shards = (
        (k, full.data[a:b], full.scale) for k, (a, b) in enumerate(lay.shard_range(s) for s in range(lay.split_parts))
    )
    write_layer_table(shards, path, config, index, force=True)
    return path


def _tables(
    opts: Options, config: PLEConfig, full: MemoryTable, ctx: ProcessContext, work: Path
) -> tuple[Table, Table]:
    """``(reference table, this rank's table)``: a memory tier lives on the rank's device, a table
    file stays mapped (lookups return rows on the ids' device)."""
    from ple.checkpoint import open_layer_table, table_file_name

    ids = "replicated" if opts.mode == "etp" else "per_rank"
    dev = ctx.device
    if opts.tier == "mmap":
        path = _table_file(full, config, opts.layer, work / table_file_name(f"ple_layer_{opts.layer}.rank{ctx.rank}"))
        ref = open_layer_table(path, config, opts.layer)
        if opts.split == "sharded":
            return ref, load_sharded(path, None, opts.lookup_method, ids=ids)
        return ref, open_layer_table(path, config, opts.layer)
    if dev.type != "cpu":
        full = MemoryTable(full.data.to(dev), None if full.scale is None else full.scale.to(dev), full.format)
    if opts.split == "sharded":
        return full, ShardedTable.from_full(full, None, opts.lookup_method, ids=ids, device=dev)
    return full, full


# ---------------------------------------------------------------------------------------- one rank
def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def serve_rank(opts: Options, ctx: ProcessContext, work: Path, *, scratch: bool = False) -> dict[str, Any]:
    """Run this rank's share of the workload; returns its counts and timings.

    ``work``: where the "mmap" tier writes its table file. ``scratch=True``: ``work`` is this rank's own
    temporary folder and is removed as soon as the tables are open (a memory map outlives its file),
    so a rank that dies or is killed later leaves nothing behind."""
    config = PLEConfig.from_pretrained(opts.config) if opts.config else PLEConfig.from_dict(DEFAULT_CONFIG)
    if not 0 <= opts.layer < config.num_ple_layers:
        raise CommandLineError(f"--layer {opts.layer}: the config has {config.num_ple_layers} PLE layer(s)")
    sp_size = opts.sp_size or ctx.world_size
    what = "ple demo: the run's options"
    with collective_failures(what, ctx):
        agree(opts.agreed(config, sp_size), what, None, ctx.device)
    dtype = _DTYPES[opts.dtype]
    layer, full = build_layer(config, opts.layer, dtype, opts.seed)
    dev = ctx.device
    layer.to(dev)
    ref = PLELayer(config, opts.layer, dtype=dtype, device=dev)
    ref.load_state_dict(layer.state_dict())
    with collective_failures("building the tables", ctx):
        ref_table, table = _tables(opts, config, full, ctx, work)
    if scratch:
        shutil.rmtree(work, ignore_errors=True)
    ref.set_table(ref_table)
    layer.set_table(table)
    if opts.mode == "sp":
        with collective_failures("building the sequence-parallel groups", ctx):
            groups = build_groups(sp_size)
        group, stream = groups.sp_group, groups.dp_index
    else:
        group, stream = None, (0 if opts.mode == "etp" else ctx.rank)
    player = ParallelLayer(layer, opts.mode, group, context=ctx)
    wl = Workload(
        config,
        seed=opts.seed * 1000 + stream,
        requests=opts.requests,
        slots=opts.slots,
        num_spec=opts.num_spec,
        chunk=opts.chunk,
    )
    pool = layer.new_state_pool(opts.slots, opts.num_spec)
    ref_pool = ref.new_state_pool(opts.slots, opts.num_spec)
    stats: dict[str, Any] = {"steps": 0, "tokens": 0, "rows": 0, "empty_steps": 0, "bad_rows": 0, "bad_pools": 0}
    stats["times"] = []
    flag = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    step_no = 0
    while True:
        flag.fill_(0 if wl.done else 1)
        with collective_failures(f"step {step_no}: does any rank have work left", ctx):
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if not int(flag.item()):
            break
        st = wl.next_step() if not wl.done else _empty_step(config)
        hidden = st.hidden.to(device=dev, dtype=dtype)
        st.tokens, st.context = st.tokens.to(dev), st.context.to(dev)
        start, stop, _ = player.shard(hidden.shape[0])
        mine = shard_of(hidden, player.group_size, player.group_rank) if opts.mode == "sp" else hidden
        t0 = time.perf_counter()
        out = player(mine, st.tokens, st.batch(pool, opts.num_spec, config.conv_window))
        stats["times"].append(time.perf_counter() - t0)
        want = ref(hidden, st.tokens, st.batch(ref_pool, opts.num_spec, config.conv_window))
        n = stop - start
        stats["rows"] += n
        stats["empty_steps"] += n == 0
        if not _same_bits(out[:n], want[start:stop]):
            stats["bad_rows"] += int((out[:n] != want[start:stop]).any(dim=1).sum()) or n
        if not _same_bits(pool, ref_pool):
            stats["bad_pools"] += 1
            ref_pool.copy_(pool)  # keep comparing the next steps from the same state
        if st.lens:
            wl.advance(st)
        stats["steps"] += 1
        stats["tokens"] += int(st.tokens.numel())
        step_no += 1
    stats["coverage"] = wl.counts
    return stats


def _empty_step(config: PLEConfig) -> Step:
    k = config.ngram_size - 1
    return Step(
        [], [], [], [], [], torch.zeros(0, k, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, config.hc_hidden_size), [],
    )  # fmt: skip


def worker(opts: Options) -> int:
    """One rank: join the job, serve, gather every rank's results at rank 0, report. Exit status."""
    ctx = init_from_env(opts.backend, opts.timeout_s)
    if opts.workdir:  # the user's, or the spawner's folder (it removes it)
        work, scratch = Path(opts.workdir), False
    else:  # a rank of a launcher's job: a folder of its own, removed as soon as possible
        work, scratch = Path(tempfile.mkdtemp(prefix=f"ple-parallel-{ctx.rank}-")), True
    try:
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            stats = serve_rank(opts, ctx, work, scratch=scratch)
        except Exception as e:
            _fail(ctx, e)
            return 1
        mine = torch.tensor(
            [
                stats["steps"],
                stats["tokens"],
                stats["rows"],
                stats["bad_rows"],
                stats["bad_pools"],
                sum(stats["times"]),
                statistics.median(stats["times"]) if stats["times"] else 0.0,
            ],
            dtype=torch.float64,
            device=ctx.device,
        )
        every = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        try:
            with collective_failures("gathering the results", ctx):
                torch.distributed.all_gather(every, mine)
        except Exception as e:
            _fail(ctx, e)
            return 1
        per_rank = [dict(zip(_RESULT_FIELDS, t.cpu().tolist())) for t in every]
        ok = all(r["bad_rows"] == 0 and r["bad_pools"] == 0 for r in per_rank) and sum(r["rows"] for r in per_rank) > 0
        if ctx.rank == 0:
            _report(opts, ctx, per_rank, stats["coverage"], ok, time.perf_counter() - t0)
        return 0 if ok else 1
    finally:
        if scratch:
            shutil.rmtree(work, ignore_errors=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _fail(ctx: ProcessContext, e: Exception) -> None:
    """Say why this rank stops, to the peers (through the store) and on stderr."""
    if not isinstance(e, PeerFailureError):
        report_failure(ctx, f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    text = str(e) if isinstance(e, PeerFailureError) else f"rank {ctx.rank}: {type(e).__name__}: {e}"
    print(f"ple demo: {text}", file=sys.stderr, flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # close the connections: peers waiting on this rank fail now
    if ctx.rank == 0:  # rank 0 hosts the rendezvous store: stay while the peers read the reports
        time.sleep(_REPORT_WAIT_S + 1.0)


_RESULT_FIELDS = ("steps", "tokens", "rows", "bad_rows", "bad_pools", "seconds", "median_step_seconds")


def _report(opts: Options, ctx: ProcessContext, per_rank: list[dict], coverage: dict, ok: bool, wall: float) -> None:
    res = {
        "mode": opts.mode,
        "ranks": ctx.world_size,
        "backend": ctx.backend,
        "sp_size": (opts.sp_size or ctx.world_size) if opts.mode == "sp" else None,
        "table": f"{opts.split} ({opts.tier})",
        "dtype": opts.dtype,
        "per_rank": per_rank,
        "rank0_coverage": coverage,
        "ok": ok,
        "wall_seconds": wall,
    }
    if opts.output:
        Path(opts.output).write_text(json.dumps(res, indent=1))
    if opts.json:
        print(json.dumps(res, indent=1))
        return
    sp = f", sequence-parallel groups of {res['sp_size']}" if opts.mode == "sp" else ""
    print(f"mode   : {opts.mode} on {ctx.world_size} {ctx.backend} rank(s){sp}; table {res['table']}; {opts.dtype}")
    print("| rank | steps | tokens | rows checked | rows differing | pools differing | median step ms |")
    print("|-----:|------:|-------:|-------------:|---------------:|----------------:|---------------:|")
    for r, x in enumerate(per_rank):
        print(
            f"| {r:4d} | {int(x['steps']):5d} | {int(x['tokens']):6d} | {int(x['rows']):12d} | "
            f"{int(x['bad_rows']):14d} | {int(x['bad_pools']):15d} | {1e3 * x['median_step_seconds']:14.2f} |"
        )
    cov = ", ".join(f"{k} {v}" for k, v in coverage.items() if k not in ("steps", "tokens"))
    print(f"rank 0's stream: {cov}")
    print(
        "check: every rank's output rows and state pool equal one process's, bit for bit, on every step"
        if ok
        else "check FAILED: some rows or state pools differ from one process (see the table)"
    )


# ---------------------------------------------------------------------------------------- launching
def run(args: argparse.Namespace) -> int:
    """``ple demo --parallel MODE``: a rank of torchrun's job, or spawn ``--ranks`` local ranks.

    Spawned ranks write their files (the "mmap" tier's table file) in a folder of this process's
    temporary folder (or ``--workdir``), removed here however the ranks end (a rank that dies, or
    is killed after the grace period, cleans nothing itself). A rank of a launcher's job without
    ``--workdir`` removes its own temporary folder once its tables are open."""
    opts = Options.from_args(args)
    if under_launcher():
        world = launch_env().world_size
        if opts.ranks not in (1, world):
            raise CommandLineError(f"--ranks {opts.ranks}, but the launcher started {world} ranks (WORLD_SIZE)")
        opts.check_world(world)
        return worker(opts)
    opts.check_world(opts.ranks)
    if opts.workdir:  # the rule of every --workdir, checked here once for the ranks
        from ple.integrations.demo_model import new_workdir

        new_workdir(opts.workdir, "ple demo", "its ranks' table files")
    with tempfile.TemporaryDirectory(prefix="ple-parallel-") as tmp:
        spec = Path(tmp) / "options.json"
        ranks_opts = opts if opts.workdir else dataclasses.replace(opts, workdir=str(Path(tmp) / "ranks"))
        spec.write_text(json.dumps(dataclasses.asdict(ranks_opts)))
        argv = [sys.executable, "-c", _RANK_CODE, str(spec)]
        # a failed rank makes the others fail within the collective timeout (plus the peers' reports)
        grace = opts.timeout_s + 2 * _REPORT_WAIT_S + 3.0
        res = spawn_local(argv, opts.ranks, deadline_s=max(600.0, 4 * grace), grace_s=grace)
    if res.ok:
        return 0
    failed = [f"rank {r}: exit {c}" for r, c in enumerate(res.returncodes) if c != 0]
    killed = f"; killed after the grace period: {res.killed}" if res.killed else ""
    print(f"ple demo: {len(failed)} of {opts.ranks} ranks failed ({', '.join(failed)}){killed}", file=sys.stderr)
    return 1


def rank_main(argv: list[str]) -> int:
    """Entry point of a spawned rank: ``argv = [OPTIONS.json]`` (what :func:`run` wrote)."""
    opts = Options(**json.loads(Path(argv[0]).read_text()))
    try:
        return worker(opts)
    except PLEError as e:  # joining the group failed (a peer that never started): one line, as the command says it
        print(f"ple demo: rank {os.environ.get('RANK', '?')}: {e}", file=sys.stderr, flush=True)
        return 1


_RANK_CODE = "import sys; from ple.commands.demo.parallel import rank_main; sys.exit(rank_main(sys.argv[1:]))"
