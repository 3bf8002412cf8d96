"""Time per step of each parallel mode on 1, 2, 4 ... local gloo processes (docs/DISTRIBUTED.md).

``python -m ple.commands.bench.parallel [--ranks 1,2,4] [--threads 1] [--output FILE]`` spawns each world
size once per mode with :func:`ple.parallel.spawn_local`; every rank builds the published layer
geometry (H 2560, HC 4, E 2560, 16 heads of 160, N 3, K 4) with a smaller fp8 table (``--base``
rows per head, default 65,536: about 1.05 M rows) and times fixed steps, each after a barrier, as the
slowest rank's wall time: a prefill step (``--prefill`` tokens, two requests), a decode step
(``--decode`` requests of one token, with state) and, for the table methods, lookups alone with
per-rank ids (``--lookup`` tokens per rank, imbalanced: rank r has ``T * (1 - r / (2W))``) by the
all-to-all, by the all-gather + reduce-scatter, and by the engines' all-gather + all-reduce that
keeps one's own slot; with replicated ids (the same ``--lookup`` tokens on every rank), by the
all-reduce and by the all-to-all. Medians of ``--reps`` repetitions after one warm-up, in milliseconds.

Modes: "plain" is the layer alone (no collectives); "sp" shards token rows (table replicated); "sp+table" also
shards the table (per-rank ids, all-to-all); "etp" shards the table over ranks that share the batch
(all-reduce); "dp" gives each rank its own batch of the same shape (table sharded, all-to-all).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ple.commands.report import check_destinations
from ple.common.files import write_atomically
from ple.config import PLEConfig
from ple.errors import InvalidArgumentError
from ple.layer import PLELayer
from ple.parallel import ParallelLayer, init_from_env, shard_of, spawn_local
from ple.runtime.batch import Batch
from ple.table import MemoryTable
from ple.table.formats.quantize import quantize_global
from ple.table.tiers.sharded import ShardedTable

__all__ = ["main"]

MODES = ("plain", "sp", "sp+table", "etp", "dp")


def _config(base: int) -> PLEConfig:
    return PLEConfig(
        hidden_size=2560,
        hc_count=4,
        ple_embed_dim=2560,
        ngram_size=3,
        heads_per_ngram=8,
        ple_conv_kernel_size=4,
        ngram_vocab_size_base=base,
        make_ngram_vocab_size_divisible_by=128,
        split_ngram_parts=8,
        eos_token_id=248044,
        ple_layer_ids=(2,),
    )


def _layer(cfg: PLEConfig) -> tuple[PLELayer, MemoryTable]:
    layer = PLELayer(cfg, 0, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if name.startswith(("norm", "conv")) else 0.02))
    lay = layer.layout
    rows, scale = quantize_global(torch.randn(lay.padded_rows, lay.head_dim, generator=g) * 0.05)
    return layer, MemoryTable(rows, scale, "fp8")


def _steps(prefill: int, decode: int) -> dict[str, tuple[list[int], list[bool]]]:
    return {
        "prefill": ([prefill // 2, prefill - prefill // 2], [False, False]),
        "decode": ([1] * decode, [True] * decode),
    }


def _time(fn, reps: int) -> float:
    times = []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(mine))
    return 1e3 * statistics.median(times)


def _worker(spec: dict[str, Any]) -> None:
    torch.set_num_threads(spec["threads"])
    ctx = init_from_env("gloo", 600.0)
    W, rank = ctx.world_size, ctx.rank
    cfg = _config(spec["base"])
    layer, full = _layer(cfg)
    mode = spec["mode"]
    res: dict[str, float] = {}
    if mode in ("sp+table", "dp"):
        layer.set_table(ShardedTable.from_full(full, ids="per_rank", method="alltoall"))
    elif mode == "etp":
        layer.set_table(ShardedTable.from_full(full, method="allreduce"))
    else:
        layer.set_table(full)
    player: Any = layer if mode == "plain" else ParallelLayer(layer, mode.removesuffix("+table"), context=ctx)
    g = torch.Generator().manual_seed(1 + (rank if mode == "dp" else 0))
    for name, (lens, init) in _steps(spec["prefill"], spec["decode"]).items():
        T, R = sum(lens), len(lens)
        pool = layer.new_state_pool(R)
        tokens = torch.randint(0, cfg.vocab_size, (T,), generator=g)
        hidden = torch.randn(T, cfg.hc_hidden_size, generator=g)
        ctx_ids = torch.randint(0, cfg.vocab_size, (R, cfg.ngram_size - 1), generator=g)
        mine = shard_of(hidden, W, rank) if mode.startswith("sp") else hidden

        def step(lens=lens, init=init, pool=pool, tokens=tokens, mine=mine, ctx_ids=ctx_ids) -> None:
            batch = Batch.build(lens, list(range(len(lens))), ctx_ids, pool, has_initial_state=init)
            player(mine, tokens, batch)

        res[name] = _time(step, spec["reps"])
    if spec["lookups"] and mode == "etp":
        g_same = torch.Generator().manual_seed(7)
        ids = torch.randint(0, full.rows, (spec["lookup"], layer.layout.num_heads), generator=g_same)
        for m in ("allreduce", "alltoall"):
            table = ShardedTable.from_full(full, method=m)
            res[f"lookup replicated {m}"] = _time(lambda t=table: t.lookup(ids, torch.bfloat16), spec["reps"])
    if spec["lookups"] and mode == "dp":
        T = max(1, int(spec["lookup"] * (1 - rank / (2 * W))))
        ids = torch.randint(0, full.rows, (T, layer.layout.num_heads), generator=g)
        tables = {m: ShardedTable.from_full(full, ids="per_rank", method=m) for m in ("alltoall", "allreduce")}
        res["lookup alltoall"] = _time(lambda: tables["alltoall"].lookup(ids, torch.bfloat16), spec["reps"])
        res["lookup allgather+reduce_scatter"] = _time(
            lambda: tables["allreduce"].lookup(ids, torch.bfloat16), spec["reps"]
        )
        res["lookup allgather+allreduce (engines)"] = _time(
            lambda: _engines_lookup(tables["allreduce"], ids, torch.bfloat16), spec["reps"]
        )
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(res))
    dist.destroy_process_group()


def _engines_lookup(table: ShardedTable, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The engines' per-rank lookup: all-gather the counts and the ids padded to the largest count,
    fill the rows this rank owns for every rank's ids, all-reduce the bits, keep one's own slot."""
    W, me = table.world_size, table.rank
    T, G = ids.shape
    D = table.head_dim
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
    dist.all_gather(counts, torch.tensor([T]))
    pad = -(-max(int(c) for c in counts) // 4) * 4
    mine = torch.full((pad * G,), -1, dtype=torch.int64)
    mine[: T * G] = ids.reshape(-1)
    every = torch.empty(W, pad * G, dtype=torch.int64)
    dist.all_gather(list(every.unbind(0)), mine)
    flat = every.view(-1)
    a, b = table.row_start, table.row_stop
    rows = torch.zeros(flat.numel(), D, dtype=dtype)
    pos = ((flat >= a) & (flat < b)).nonzero().squeeze(1)
    if pos.numel():
        rows.index_copy_(0, pos, table.local_table.lookup((flat[pos] - a).view(-1, 1), dtype, check=False))
    dist.all_reduce(rows.view(-1).view(torch.int32))
    return rows.view(W, pad * G * D)[me, : T * G * D].view(T, G * D)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ple.commands.bench.parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4", help="world sizes, comma-separated (default 1,2,4)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"modes, comma-separated (default {','.join(MODES)})")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--base", type=int, default=65536, help="rows per n-gram head (default 65,536)")
    ap.add_argument("--prefill", type=int, default=256, help="tokens of the prefill step (default 256)")
    ap.add_argument("--decode", type=int, default=32, help="requests of the decode step (default 32)")
    ap.add_argument("--lookup", type=int, default=1024, help="tokens per rank of the lookup timing (default 1024)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    ap.add_argument("--output", help="write the results as JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(json.loads(Path(args.worker).read_text()))
        return 0
    try:
        check_destinations([("--output", args.output)], [])  # before the work, not after it
    except InvalidArgumentError as e:
        ap.error(str(e))
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ple-bench-parallel-") as tmp:
        for W in (int(x) for x in args.ranks.split(",")):
            for mode in args.modes.split(","):
                spec = {
                    "mode": mode,
                    "threads": args.threads,
                    "base": args.base,
                    "prefill": args.prefill,
                    "decode": args.decode,
                    "lookup": args.lookup,
                    "lookups": True,
                    "reps": args.reps,
                    "out": str(Path(tmp) / f"{mode}-{W}.json"),
                }
                path = Path(tmp) / f"spec-{mode}-{W}.json"
                path.write_text(json.dumps(spec))
                argv_w = [sys.executable, "-m", "ple.commands.bench.parallel", "--worker", str(path)]
                res = spawn_local(argv_w, W, deadline_s=3600, grace_s=60)
                if not res.ok:
                    print(f"{mode} on {W} ranks failed: {res.returncodes}", file=sys.stderr)
                    return 1
                results.setdefault(mode, {})[str(W)] = json.loads(Path(spec["out"]).read_text())
                print(f"{mode:9s} W={W}: {results[mode][str(W)]}", file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))  # first: a failed write keeps the results on stdout
    if args.output:
        write_atomically(args.output, json.dumps(results, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
