"""One rank of the data-parallel training tests (started by ``ple.parallel.spawn_local``).

``python ddp_worker.py CKPT TABLES OUT CASE``: the tiny ``qwen4_exp`` checkpoint loaded with
``from_pretrained`` (its tables memory-mapped from ``TABLES``), wrapped in
``torch.nn.parallel.DistributedDataParallel``, its tables trained by ``SparseAdam`` and the other
weights by ``torch.optim.AdamW``, each rank its own batches (:func:`rank_batch`), as a user writes it.
Each case of :data:`CASES` writes ``OUT/<case>-rank<r>.safetensors`` (the trained rows and the
optimizer's states) and ``OUT/<case>-rank<r>.pt`` (the other weights); ``CASE`` ``all`` runs every
case, ``refusals`` prints what each rank gets (its error, or "not refused") in each case of :data:`REFUSALS`:
ranks that disagree on the step count, the learning rate, the optimizer's class, the table's format
or an adapter loaded midway (the bf16 copy on one rank), optimizer states loaded midway (other ones on
rank 1), then the same adapter loaded on every rank
(agreeing: trains on, writing ``OUT/agree-rank<r>.safetensors``), then a fused optimizer. The adapters
are ``adapter-fp32.safetensors`` and ``adapter-bf16.safetensors`` beside ``TABLES``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ple.integrations.transformers import from_pretrained  # noqa: E402
from ple.train import Adagrad, SparseAdam, load_adapter, save_adapter, trainable  # noqa: E402
from tests.integrations.helpers import EOS, VOCAB  # noqa: E402

# case: (steps, backwards per step, model dtype)
CASES = {"plain": (3, 1, torch.float32), "accumulate": (2, 2, torch.float32), "bf16": (2, 1, torch.bfloat16)}
LR_TABLE, LR_REST = 0.05, 3e-3
REFUSALS = ("mismatch", "lr", "class", "format", "adapter", "states", "agree", "fused")


def rank_batch(step: int, rank: int, micro: int = 0, b: int = 2, s: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 100 * step + 10 * rank + micro)
    return torch.randint(EOS + 1, VOCAB, (b, s), generator=g)


def load(ckpt, tables, dtype=torch.float32, **kw):
    model = from_pretrained(ckpt, table_dir=tables, dtype=dtype)
    model.train()
    opt = SparseAdam(trainable(model), lr=LR_TABLE, **kw)
    rest = torch.optim.AdamW(model.parameters(), lr=LR_REST)
    return model, opt, rest


def run_case(ckpt, tables, out: Path, case: str, rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    steps, micro, dtype = CASES[case]
    model, opt, rest = load(ckpt, tables, dtype)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)  # the tiny MoE leaves experts unused
    for step in range(steps):
        for m in range(micro):
            ids = rank_batch(step, rank, m)
            if m < micro - 1:
                with ddp.no_sync():
                    (ddp(input_ids=ids, labels=ids).loss / micro).backward()
            else:
                (ddp(input_ids=ids, labels=ids).loss / micro).backward()
        opt.step()
        rest.step()
        rest.zero_grad()
    save_adapter(out / f"{case}-rank{rank}.safetensors", model, optimizer=opt)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"{case}-rank{rank}.pt")
    print(f"rank {rank} {case} exchanged {opt.exchanged_nbytes} bytes", flush=True)


def refusal(ckpt, tables, out: Path, case: str, rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = from_pretrained(ckpt, table_dir=tables, table_format="fp8" if case == "format" and rank == 1 else None)
    model.train()
    if case == "class" and rank == 0:
        opt = Adagrad(trainable(model), lr=LR_TABLE)
    else:
        lr = 2 * LR_TABLE if case == "lr" and rank == 1 else LR_TABLE
        opt = SparseAdam(trainable(model), lr=lr, fused=case == "fused")
    rest = torch.optim.AdamW(model.parameters(), lr=LR_REST)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)  # the tiny MoE leaves experts unused
    ids = rank_batch(0, rank)
    try:
        if case == "mismatch" and rank == 0:  # rank 0 trained a step alone before: its table is ahead
            trainable(model, data_parallel=False)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            rest.zero_grad()
            trainable(model)
        if case in ("adapter", "agree"):  # a step together, then each rank loads an adapter
            ddp(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            copy = "bf16" if case == "adapter" and rank == 1 else "fp32"
            load_adapter(model, Path(tables).parent / f"adapter-{copy}.safetensors", dtype=torch.float32)
            trainable(model)
        if case == "states":  # a step together, then each rank loads a state: rank 1's moments doubled
            ddp(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            state = opt.state_dict()
            state["state"][0]["values"] *= 1 + rank
            opt.load_state_dict(state)
        ddp(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    except Exception as e:  # noqa: BLE001 - reported for the test to judge
        print(f"rank {rank} {case} refused: {type(e).__name__}: {e}", flush=True)
        return
    save_adapter(out / f"{case}-rank{rank}.safetensors", model, optimizer=opt)
    print(f"rank {rank} {case} not refused", flush=True)


def main() -> None:
    from ple.parallel import init_from_env

    ckpt, tables, out, case = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    ctx = init_from_env("gloo", timeout_s=60)
    if case in CASES:
        run_case(ckpt, tables, out, case, ctx.rank)
    elif case == "all":
        for name in CASES:
            run_case(ckpt, tables, out, name, ctx.rank)
    else:  # "refusals"
        for name in REFUSALS:
            refusal(ckpt, tables, out, name, ctx.rank)


if __name__ == "__main__":
    main()
