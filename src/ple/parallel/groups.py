"""Process groups of a TP x DP layout: sequence-parallel groups of consecutive ranks, one per
data-parallel replica; the table may be sharded over all of them."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from ple.errors import InvalidArgumentError, UsageError

__all__ = ["Groups", "build_groups"]


@dataclasses.dataclass(frozen=True)
class Groups:
    """This rank's groups.

    Attributes:
        world_size, rank: of the default group.
        sp_size: ranks per sequence-parallel group (1: no sequence parallelism).
        sp_group: the group of ranks ``[dp_index * sp_size, (dp_index + 1) * sp_size)``, which share
            one batch (the default group when it is the whole world).
        sp_rank: this rank's place in it (which shard of the token rows it holds).
        dp_index: which data-parallel replica (which batch) this rank serves.
    """

    world_size: int
    rank: int
    sp_size: int
    sp_group: Any
    sp_rank: int
    dp_index: int

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size


def build_groups(sp_size: int) -> Groups:
    """Split the default group into ``world_size // sp_size`` sequence-parallel groups of consecutive
    ranks. A collective: every rank calls it with the same ``sp_size`` (agree on it first)."""
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError("build_groups needs an initialized torch.distributed process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1 or world % sp_size:
        raise InvalidArgumentError(f"sp_size must be a divisor of the world size {world}, got {sp_size!r}")
    dp_index, sp_rank = divmod(rank, sp_size)
    sp_group: Any = None  # the default group
    if sp_size != world:
        for g in range(world // sp_size):  # every rank creates every group, in one order
            grp = dist.new_group(ranks=list(range(g * sp_size, (g + 1) * sp_size)))
            if g == dp_index:
                sp_group = grp
    return Groups(world, rank, sp_size, sp_group, sp_rank, dp_index)
