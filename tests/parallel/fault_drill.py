"""A test-only launcher of ``ple demo --parallel``: one rank fails on purpose at a given step.

    python fault_drill.py KIND:RANK:STEP demo --ranks N --parallel MODE ...
    python -m torch.distributed.run ... fault_drill.py KIND:RANK:STEP demo --parallel MODE ...

At step STEP (counted from 0, empty steps included) rank RANK dies (``die``: exit status 17, no
cleanup), sleeps far past the collective timeout (``stall``) or raises an ``InvalidArgumentError``
(``raise``), just before its layer call; the other ranks are then inside that step's collectives.
Ranks spawned by ``--ranks N`` start through this file too, so each carries the fault.
"""

from __future__ import annotations

import os
import sys
import time

import ple.commands.demo.parallel as demo_parallel
from ple.commands.cli import main
from ple.errors import InvalidArgumentError

KINDS = ("die", "stall", "raise")
STALL_S = 3600.0  # far past any timeout a test gives: the demo kills the rank after its grace period


def parse(text: str) -> tuple[str, int, int]:
    """``"KIND:RANK:STEP"`` -> ``(kind, rank, step)``."""
    kind, rank, step = text.split(":")
    if kind not in KINDS or int(rank) < 0 or int(step) < 0:
        raise ValueError(f"fault {text!r}: KIND is one of {list(KINDS)}, RANK and STEP >= 0")
    return kind, int(rank), int(step)


def install(fault: str) -> None:
    """Make this process's ranks carry ``fault``: its layer calls, and the ranks it spawns."""
    kind, rank, at = parse(fault)

    class FaultyLayer(demo_parallel.ParallelLayer):
        steps = 0

        def __call__(self, *args, **kwargs):
            step, FaultyLayer.steps = FaultyLayer.steps, FaultyLayer.steps + 1
            if self.context.rank == rank and step == at:
                if kind == "die":
                    os._exit(17)
                if kind == "stall":
                    time.sleep(STALL_S)
                raise InvalidArgumentError(f"fault {fault}: rank {rank} raised at step {step} as asked")
            return super().__call__(*args, **kwargs)

    spawn = demo_parallel.spawn_local

    def spawn_with_fault(argv, *args, **kwargs):
        spec = argv[-1]  # the options file every spawned rank reads
        return spawn([sys.executable, __file__, "--rank", fault, spec], *args, **kwargs)

    demo_parallel.ParallelLayer = FaultyLayer
    demo_parallel.spawn_local = spawn_with_fault


if __name__ == "__main__":
    if sys.argv[1] == "--rank":  # a rank spawned by the drill: [--rank, FAULT, OPTIONS.json]
        install(sys.argv[2])
        sys.exit(demo_parallel.rank_main(sys.argv[3:]))
    install(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
