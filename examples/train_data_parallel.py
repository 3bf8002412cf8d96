"""Fine-tune a qwen4_exp model's PLE tables and other weights with several processes:

    torchrun --standalone --nproc_per_node 2 examples/train_data_parallel.py path/to/model out

Each process loads the model with its tables on disk and trains on its own batches (transformers'
``Trainer``, which wraps the model in ``DistributedDataParallel``); at each step ple averages the
tables' row-sparse gradients over the processes, as DDP averages the other weights', so every process
keeps the same trained rows. Checkpoints (``out/checkpoint-N``) hold the trained rows and the optimizer
states, never a table: ``trainer.train(resume_from_checkpoint=True)`` continues exactly. Replace the
random token ids with your data.
"""

import sys

import torch
from transformers import Trainer, TrainingArguments

import ple.integrations.transformers as ple_hf
import ple.train

model_path, out = sys.argv[1], sys.argv[2]
model = ple_hf.from_pretrained(model_path)  # tables memory-mapped from disk, never written
tables = ple.train.SparseAdam(ple.train.trainable(model), lr=0.05)
rest = torch.optim.AdamW(model.parameters(), lr=1e-4)
opt = ple.train.CombinedOptimizer(tables, rest)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
ids = torch.randint(6, model.config.vocab_size, (64, 32), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row} for row in ids]  # your token ids here
args = TrainingArguments(
    out,
    max_steps=4,
    per_device_train_batch_size=4,
    save_steps=2,
    logging_steps=1,  # the loss of every step, printed by the first process
    report_to=[],
    use_cpu=not torch.cuda.is_available(),
    ddp_find_unused_parameters=True,  # a MoE model leaves some experts out of a batch
)
trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
trainer.train()
if trainer.is_world_process_zero():
    ple.train.save_adapter(f"{out}/adapter.safetensors", model, optimizer=tables)
    ple.train.freeze(model)  # training done: save_pretrained writes the tables, trained rows merged
    model.save_pretrained(f"{out}/tuned")
trainer.accelerator.wait_for_everyone()  # every process waits for the saves, then leaves its group
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()  # a group left alive can abort a process at exit
