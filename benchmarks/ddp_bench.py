"""Training a replicated table with data parallelism: a step at 1 and N processes, and what the ranks
exchange for the table.

    python benchmarks/ddp_bench.py [--ranks 1 2] [--tokens 512] [--steps 5] [--threads 1]
        [--format fp8] [--dir /tmp] [--out ddp_bench.json]

Each rank: one PLE layer at the published geometry (``train_bench.py``'s: fp32 weights and activations,
random weights, a sparse table file of the published size, memory-mapped) wrapped in
``DistributedDataParallel`` (gloo on 127.0.0.1), its table trained by ``SparseAdam`` (the ranks'
row-sparse gradients averaged at each step, :mod:`ple.train.data_parallel`) and its other weights by
``AdamW``; ``--tokens`` real-text tokens per rank and step, each rank its own text. Per step: the wall
time of the whole step (forward, backward with DDP's all-reduce of the other weights, both optimizer
steps), the time of the table's exchange inside it (``mean_gradients``: the all-gathers and the
rank-ordered sum), and the bytes a rank received in it; beside them the size of the other weights,
which DDP all-reduces every step. Medians over ``--steps`` steps after two warm-up
steps, the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_bench  # noqa: E402

WARMUP = 2


def child(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import ple.train as pt
    import ple.train.optim as optim
    from ple.parallel import init_from_env
    from ple.table import MmapTable

    torch.set_num_threads(args.threads)
    ctx = init_from_env("gloo", timeout_s=600)
    cfg = train_bench.config()
    layer = train_bench.layer_over(MmapTable.open(args.table), cfg, seed=0)

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, hidden, tokens):
            return self.layer.forward_padded(hidden, tokens)

    model = DistributedDataParallel(Step())
    tables = pt.SparseAdam(pt.trainable(layer), lr=1e-3)
    rest = torch.optim.AdamW(layer.parameters(), lr=1e-4)
    count = WARMUP + args.steps
    batches = train_bench.text_batches(cfg, count, args.tokens, skip=ctx.rank * count)
    hidden = [
        torch.randn(1, args.tokens, cfg.hc_hidden_size, generator=torch.Generator().manual_seed(1000 * ctx.rank + i))
        for i in range(count)
    ]
    exchange_s: list[float] = []
    inner = optim.mean_gradients

    def timed_exchange(*a, **kw):
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            exchange_s.append(time.perf_counter() - t)

    optim.mean_gradients = timed_exchange  # type: ignore[assignment]
    steps, exchanges, nbytes = [], [], []
    for i in range(count):
        dist.barrier()
        before, seen = tables.exchanged_nbytes, len(exchange_s)
        t = time.perf_counter()
        model(hidden[i], batches[i]).sum().backward()
        tables.step()
        rest.step()
        rest.zero_grad()
        steps.append(time.perf_counter() - t)
        exchanges.append(sum(exchange_s[seen:]))
        nbytes.append(tables.exchanged_nbytes - before)
    out = {
        "rank": ctx.rank,
        "step_ms": 1e3 * statistics.median(steps[WARMUP:]),
        "exchange_ms": 1e3 * statistics.median(exchanges[WARMUP:]),
        "received_bytes_per_step": statistics.median(nbytes[WARMUP:]),
        "rows_trained": len(layer.table.overlay),
        "dense_bytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
    }
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def run(args, path: Path, ranks: int) -> dict:
    from ple.parallel import spawn_local

    argv = [sys.executable, __file__, "--child", "--table", str(path), "--tokens", str(args.tokens)]
    argv += ["--steps", str(args.steps), "--threads", str(args.threads)]
    env = {"PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(train_bench.ROOT / "src")) if p)}
    res = spawn_local(argv, ranks, deadline_s=args.deadline, grace_s=30, capture=True, env=env)
    if not res.ok:
        raise SystemExit(f"{ranks} rank(s) failed:\n" + "\n".join(o[-2000:] for o in res.outputs))
    per_rank = [json.loads(line[7:]) for o in res.outputs for line in o.splitlines() if line.startswith("RESULT ")]
    slowest = max(per_rank, key=lambda r: r["step_ms"])
    return {
        "ranks": ranks,
        "step_ms": slowest["step_ms"],
        "exchange_ms": max(r["exchange_ms"] for r in per_rank),
        "exchange_share": max(r["exchange_ms"] for r in per_rank) / slowest["step_ms"],
        "received_bytes_per_step": max(r["received_bytes_per_step"] for r in per_rank),
        "tokens_per_step": ranks * args.tokens,
        "dense_allreduce_bytes": per_rank[0]["dense_bytes"] if ranks > 1 else 0,
        "per_rank": per_rank,
    }


def report(res: dict) -> str:
    lines = [
        f"machine: {res['machine'].get('cpu_model')} ({res['isa']}), {res['machine'].get('cores')} cores; "
        f"T = {res['tokens']} tokens per rank, {res['threads']} torch thread(s) per rank, gloo on 127.0.0.1",
        "| processes | step ms (slowest rank) | tokens/s (all ranks) | table exchange ms | share of the step "
        "| table bytes received per rank and step | DDP's all-reduce of the other weights, bytes |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["runs"]:
        lines.append(
            f"| {r['ranks']} | {r['step_ms']:,.0f} | {1e3 * r['tokens_per_step'] / r['step_ms']:,.0f} "
            f"| {r['exchange_ms']:.1f} | {100 * r['exchange_share']:.1f} % | {r['received_bytes_per_step']:,.0f} "
            f"| {r['dense_allreduce_bytes']:,} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=512, help="real-text tokens per rank and step")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after two warm-up steps)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--format", default="fp8", choices=["fp8", "q4_0", "bf16"])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the sparse table file goes")
    ap.add_argument("--deadline", type=float, default=540, help="seconds a run of the ranks may take")
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--table", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    from ple.commands.bench.runner import machine_info, versions

    cfg = train_bench.config()
    path = Path(args.dir) / f"ddp-bench-{args.format}-{os.getpid()}.pletable"
    res: dict = {"machine": machine_info(), "isa": train_bench.cpu_isa(), "versions": versions()}
    res.update(tokens=args.tokens, threads=args.threads, runs=[])
    try:
        train_bench.sparse_table(path, cfg, args.format)
        for ranks in args.ranks:
            res["runs"].append(run(args, path, ranks))
    finally:
        path.unlink(missing_ok=True)
    print(report(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
