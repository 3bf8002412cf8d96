"""One rank of ``ple train --ranks N`` (started by :func:`ple.parallel.spawn_local`).

``python -m ple.commands.train.worker PUBLISHED TABLE_DIR ADAPTER REPORT OPTIONS_JSON``: joins the process
group (gloo), fine-tunes with the tables sharded over the ranks, and rank 0 writes the report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> int:
    from ple.commands.train.loop import Options, finetune
    from ple.common.files import write_atomically
    from ple.parallel import init_from_env

    published, table_dir, adapter, report = (Path(a) for a in argv[:4])
    opts = Options(**json.loads(argv[4]))
    torch.set_num_threads(1)
    ctx = init_from_env("gloo", timeout_s=600)
    doc = finetune(published, table_dir, adapter, opts, sharded=True)
    if ctx.rank == 0:
        write_atomically(report, json.dumps(doc).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
