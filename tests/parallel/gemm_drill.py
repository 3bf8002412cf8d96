"""A test-only launcher of ``ple demo``: every process (the spawner and each rank it spawns) multiplies
with a GEMM whose bits depend on its row count, as a CPU's GEMM library may choose its blocking by
the number of rows (seen on an Intel Xeon with AMX: an fp32 GEMM of a shard's rows differs from the
whole batch's in the last bit).

    python gemm_drill.py demo --ranks N --parallel MODE ...

``F.linear`` of ``M`` rows adds the products of the first ``M % 3 + 1`` inner columns last, to the
rounded product of the others: the rows of GEMMs of different row counts differ in their last bits,
while one row count always gives the same bits.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import ple.commands.demo.parallel as demo_parallel
from ple.commands.cli import main

_linear = F.linear


def row_count_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose summation order depends on the number of rows of ``x``."""
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    p = rows % 3 + 1  # the first p columns of the inner dimension are added last
    return _linear(x[..., p:], w[:, p:], b) + _linear(x[..., :p], w[:, :p])


def install() -> None:
    """This process multiplies with :func:`row_count_linear`, and so do the ranks it spawns."""
    F.linear = row_count_linear
    spawn = demo_parallel.spawn_local

    def spawn_with_drill(argv, *args, **kwargs):
        return spawn([sys.executable, __file__, "--rank", argv[-1]], *args, **kwargs)

    demo_parallel.spawn_local = spawn_with_drill


if __name__ == "__main__":
    install()
    if sys.argv[1] == "--rank":  # a rank spawned by the drill: [--rank, OPTIONS.json]
        sys.exit(demo_parallel.rank_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
