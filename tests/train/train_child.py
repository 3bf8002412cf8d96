"""A training run in a child process (for the kill-and-resume test): trains the table of one PLE
layer over a table file, saving a checkpoint every few steps.

``python train_child.py TABLE CHECKPOINT STEPS EVERY [resume]``: prints ``saved <step>`` after each
save. With ``resume`` it starts from CHECKPOINT (rows and optimizer state) at the step it recorded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tests package (tests.train._helpers)

from ple.table import MmapTable  # noqa: E402
from ple.train import AdamW, load_adapter, load_optimizer_state, read_adapter, save_adapter, trainable  # noqa: E402
from tests.train._helpers import batch, new_layer  # noqa: E402


def main() -> None:
    table, ckpt, steps, every = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    layer = new_layer(seed=5, table=MmapTable.open(table))
    for p in layer.parameters():
        p.requires_grad_(False)
    start = 0
    if len(sys.argv) > 5 and sys.argv[5] == "resume":
        file = read_adapter(ckpt)
        load_adapter(layer, file, dtype=torch.float32)
        start = int(file.meta["step"])
    opt = AdamW(trainable(layer), lr=0.02, weight_decay=0.1)
    if start:
        load_optimizer_state(opt, ckpt)
    for step in range(start, steps):
        hidden, ids, _ = batch(seed=1000 + step, b=4, s=32)
        out = layer.forward_padded(hidden, ids)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        if (step + 1) % every == 0 or step + 1 == steps:
            save_adapter(ckpt, layer, optimizer=opt, meta={"step": step + 1})
            print(f"saved {step + 1}", flush=True)


if __name__ == "__main__":
    main()
