"""One rank of the sharded training test (started by ``ple.parallel.spawn_local``).

``python sharded_worker.py TABLE OUT STEPS``: trains the table file's rows sharded over the ranks
(``load_sharded``), in four runs: replicated ids with SGD and with SparseAdam (every rank the same
batches), per-rank ids with SGD and with SparseAdam (each rank its own batches); each run saves one
adapter file
(``OUT/<run>.safetensors``, written by rank 0)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ple.parallel import init_from_env  # noqa: E402
from ple.table.tiers.sharded import load_sharded  # noqa: E402
from ple.train import SGD, SparseAdam, save_sharded_adapter, trainable  # noqa: E402
from tests.train._helpers import batch, new_layer  # noqa: E402

RUNS = {
    "etp-sgd": ("replicated", SGD, {"lr": 0.5}),
    "etp-adam": ("replicated", SparseAdam, {"lr": 0.05}),
    "dp-sgd": ("per_rank", SGD, {"lr": 0.5}),
    "dp-adam": ("per_rank", SparseAdam, {"lr": 0.05}),
}


def rank_batch(step: int, rank: int, per_rank: bool):
    return batch(seed=500 + step * 10 + (rank if per_rank else 0), b=2, s=12)


def loss_of(out: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    return (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(step * 10 + rank))).sum()


def main() -> None:
    table_path, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    ctx = init_from_env("gloo", timeout_s=60)
    for name, (ids, cls, hp) in RUNS.items():
        table = load_sharded(table_path, ids=ids)
        layer = new_layer(seed=9, table=table)
        for p in layer.parameters():
            p.requires_grad_(False)
        opt = cls(trainable(layer), **hp)
        per_rank = ids == "per_rank"
        for step in range(steps):
            hidden, tokens, _ = rank_batch(step, ctx.rank, per_rank)
            loss_of(layer.forward_padded(hidden, tokens), step, ctx.rank if per_rank else 0).backward()
            opt.step()
        save_sharded_adapter(out / f"{name}.safetensors", layer, optimizer=opt)
        print(f"rank {ctx.rank} {name} rows {table.row_start}..{table.row_stop}", flush=True)


if __name__ == "__main__":
    main()
