"""One rank of transformers' ``Trainer`` training the tables with several processes (started by
``accelerate launch --num_processes N --cpu`` or ``torchrun``), written as a user writes it: the model
made trainable, ``CombinedOptimizer(SparseAdam(tables), AdamW(rest))`` given to ``Trainer``.

``python trainer_worker.py CKPT TABLES OUT``: trains :data:`STEPS` steps of :data:`BATCH` rows per rank
and writes ``OUT/rank<r>.safetensors`` (the trained rows and SparseAdam's states), ``OUT/rank<r>.pt``
(the other weights, and the batches this rank trained on, in order)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ple.integrations.transformers import from_pretrained  # noqa: E402
from ple.train import CombinedOptimizer, SparseAdam, save_adapter, trainable  # noqa: E402
from tests.integrations.helpers import EOS, VOCAB  # noqa: E402

STEPS, BATCH, ROWS = 3, 2, 12
LR_TABLE, LR_REST = 0.05, 3e-3


def dataset(ranks: int) -> list[dict]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(EOS + 1, VOCAB, (STEPS * BATCH * ranks, ROWS), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def optimizer(model) -> CombinedOptimizer:
    return CombinedOptimizer(
        SparseAdam(trainable(model), lr=LR_TABLE), torch.optim.AdamW(model.parameters(), lr=LR_REST)
    )


def main() -> None:
    from transformers import Trainer, TrainingArguments, default_data_collator

    ckpt, tables, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    model = from_pretrained(ckpt, table_dir=tables)
    opt = optimizer(model)
    args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=STEPS, per_device_train_batch_size=BATCH, save_strategy="no",
        report_to=[], use_cpu=True, max_grad_norm=0.0, ddp_find_unused_parameters=True, disable_tqdm=True,
    )  # fmt: skip
    seen: list[torch.Tensor] = []

    def collate(rows):
        batch = default_data_collator(rows)
        seen.append(batch["input_ids"].clone())
        return batch

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset(args.world_size), data_collator=collate, optimizers=(opt, sched)
    )
    trainer.train()
    rank = args.process_index
    save_adapter(out / f"rank{rank}.safetensors", model, optimizer=opt.optimizers[0])
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"weights": weights, "batches": seen[:STEPS]}, out / f"rank{rank}.pt")
    print(f"rank {rank} of {args.world_size}: {opt.optimizers[0].exchanged_nbytes} bytes exchanged", flush=True)


if __name__ == "__main__":
    main()
