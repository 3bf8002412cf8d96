"""A PLE layer across ranks, as the serving engines run it.

- :class:`ParallelLayer` serves one :class:`~ple.layer.PLELayer` in one of :data:`MODES`: ``"sp"``
  (sequence parallel: token rows sharded within a group, the conv over the whole batch on every
  rank), ``"etp"`` (the table sharded across ranks that share a batch) or ``"dp"`` (each rank its own
  batch, the table sharded across them); groups of ``"sp"`` ranks combine with data parallelism
  (:func:`build_groups`). Outputs and state pools are bit-identical to one process.
- :func:`init_from_env` joins the job ``torchrun`` (or :func:`spawn_local`) started: ``env://``
  rendezvous, gloo on CPUs, NCCL on ``cuda:LOCAL_RANK``, a bounded collective timeout;
  :func:`launch_env` reads and checks the launcher's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``.
- Failing together (:mod:`.guard`): ranks that disagree on configuration, mode, geometry or the
  step's batch raise :class:`RankMismatchError` on every rank before any data collective; a rank
  that dies or stalls makes the others raise :class:`PeerFailureError` within the timeout. The
  exchange under every agreement check is :func:`ple.common.collective.exchange_records`.

The table side lives in :mod:`ple.table.tiers.sharded` (:class:`~ple.table.ShardedTable`). Costs per mode:
docs/DISTRIBUTED.md.
"""

from __future__ import annotations

from ple.parallel.groups import Groups, build_groups
from ple.parallel.guard import PeerFailureError, RankMismatchError, agree, collective_failures, report_failure
from ple.parallel.launch import (
    BACKENDS,
    LaunchEnv,
    LaunchResult,
    ProcessContext,
    init_from_env,
    launch_env,
    spawn_local,
    under_launcher,
)
from ple.parallel.modes import MODES, ParallelLayer, batch_digest
from ple.parallel.sequence import local_ngram_ids, sequence_parallel_forward, shard_of, token_shard

__all__ = [
    "BACKENDS",
    "Groups",
    "LaunchEnv",
    "LaunchResult",
    "MODES",
    "ParallelLayer",
    "PeerFailureError",
    "ProcessContext",
    "RankMismatchError",
    "agree",
    "batch_digest",
    "build_groups",
    "collective_failures",
    "init_from_env",
    "launch_env",
    "local_ngram_ids",
    "report_failure",
    "sequence_parallel_forward",
    "shard_of",
    "spawn_local",
    "token_shard",
    "under_launcher",
]
