"""Joining a process group the way ``torchrun`` starts one, and starting N local ranks like it.

:func:`init_from_env` reads the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
checked by :func:`launch_env`; ``MASTER_ADDR``, ``MASTER_PORT``: ``torchrun``, or
:func:`spawn_local`), rendezvouses through ``env://`` and initializes the default group with a
bounded collective timeout: gloo on CPUs, NCCL on GPUs with this process's device
``cuda:LOCAL_RANK``. It keeps the rendezvous store so that a failed collective can tell which ranks
are still there (:mod:`ple.parallel.guard`).

:func:`spawn_local` runs one command as N local ranks with that environment, waits for all of them
within a deadline, and kills what is left once one rank failed and a grace period passed.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ple.common.argtypes import parse_int, shown
from ple.errors import InvalidArgumentError, UsageError

__all__ = [
    "BACKENDS",
    "LaunchEnv",
    "LaunchResult",
    "ProcessContext",
    "RendezvousError",
    "check_timeout",
    "init_from_env",
    "launch_env",
    "local_rank_limit",
    "spawn_local",
    "under_launcher",
]

BACKENDS: tuple[str, ...] = ("gloo", "nccl")
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MIN_TIMEOUT_S = 0.01
"""The shortest collective timeout taken (the stores count in milliseconds)."""
MAX_TIMEOUT_S = 7 * 86400.0
"""The longest collective timeout taken (a week: anything longer is a rank that never answers)."""
_MAX_RANK = 2**31 - 1  # torch.distributed keeps ranks and world sizes in 32-bit ints
_RANK_BYTES = 512 << 20  # memory a local rank takes at least (an interpreter with torch imported)


class RendezvousError(UsageError):
    """The ranks could not form their process group: a peer never arrived within the timeout, or the
    rendezvous address cannot be used."""


def check_timeout(value: Any, what: str = "timeout_s") -> float:
    """``value`` as a collective timeout in seconds: a finite number in
    [:data:`MIN_TIMEOUT_S`, :data:`MAX_TIMEOUT_S`]; :class:`~ple.errors.InvalidArgumentError` naming
    ``what`` otherwise (``inf``, ``nan``, ``0``, ``1e-9``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{what} must be a number of seconds, got {value!r}")
    if not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        raise InvalidArgumentError(
            f"{what} must be between {MIN_TIMEOUT_S} and {MAX_TIMEOUT_S:.0f} seconds (a week), got {value!r}"
        )
    return float(value)


def local_rank_limit() -> tuple[int, str]:
    """How many local ranks this machine can run, and why: four per CPU this process may use, and no
    more than its available memory holds at :data:`_RANK_BYTES` per rank (each rank is a Python
    process with torch imported)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    limit, why = 4 * cpus, f"4 per CPU, {cpus} CPU(s)"
    available = _available_memory()
    if available is not None and available // _RANK_BYTES < limit:
        limit = max(1, available // _RANK_BYTES)
        why = f"{available / 2**30:.1f} GiB of memory available, {_RANK_BYTES >> 20} MiB per rank"
    return limit, why


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclasses.dataclass(frozen=True)
class ProcessContext:
    """This process's place in the default process group.

    Attributes:
        rank, world_size, local_rank: as the launcher set them.
        backend: "gloo" or "nccl".
        device: where this rank computes (``cpu``, or ``cuda:LOCAL_RANK`` with NCCL).
        timeout_s: the collective timeout the group was built with.
        store: the rendezvous store (None when the group was built elsewhere).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    timeout_s: float
    store: Any = None

    @classmethod
    def of_default_group(cls, timeout_s: float, store: Any = None) -> ProcessContext:
        """Describe a default group someone else initialized (no store: failures are reported without
        the peers' state)."""
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("no torch.distributed process group is initialized")
        backend = str(dist.get_backend()).lower()
        local = _env_int("LOCAL_RANK", 0, default=0)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return cls(dist.get_rank(), dist.get_world_size(), local, backend, device, float(timeout_s), store)


def under_launcher() -> bool:
    """Whether this process was started by a launcher (its environment names a rank and a world)."""
    return all(k in os.environ for k in _ENV)


def _env_int(name: str, lo: int, default: int | None = None) -> int:
    """The launcher's integer ``name`` (>= ``lo``); ``default`` when it is unset (None: required)."""
    text = os.environ.get(name)
    if text is None:
        if default is not None:
            return default
        raise UsageError(
            f"environment variable {name} is not set: start this process with torchrun or `ple demo --ranks N`"
        )
    v = parse_int(text)
    if v is None:
        raise InvalidArgumentError(f"environment variable {name}={shown(text)} is not an integer")
    if v < lo:
        raise InvalidArgumentError(f"environment variable {name}={v} must be >= {lo}")
    if v > _MAX_RANK:
        raise InvalidArgumentError(
            f"environment variable {name}={v} must be between {lo} and {_MAX_RANK} (torch.distributed's 32-bit ranks)"
        )
    return v


class LaunchEnv(NamedTuple):
    """What the launcher says about this process: ``rank`` of ``world_size``, and ``local_rank`` on
    this machine (which GPU it uses)."""

    rank: int
    world_size: int
    local_rank: int


def launch_env() -> LaunchEnv:
    """``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (default 0) from the launcher's environment, checked:
    :class:`~ple.errors.UsageError` when ``RANK`` or ``WORLD_SIZE`` is unset,
    :class:`~ple.errors.InvalidArgumentError` naming the variable and its value when one is not an
    integer, is negative (``WORLD_SIZE`` < 1) or ``RANK`` is not below ``WORLD_SIZE``."""
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local = _env_int("LOCAL_RANK", 0, default=0)
    if rank >= world:
        raise InvalidArgumentError(f"RANK={rank} is not below WORLD_SIZE={world}")
    return LaunchEnv(rank, world, local)


def init_from_env(backend: str | None = None, timeout_s: float = 60.0) -> ProcessContext:
    """Initialize the default process group from the launcher's environment (``env://``).

    Args:
        backend: "gloo", "nccl", or None: NCCL when CUDA is available, gloo otherwise.
        timeout_s: how long a collective (and the rendezvous) waits for the slowest rank before it
            fails; a rank that died fails its peers at once (the connection closes).

    With NCCL the device is ``cuda:LOCAL_RANK`` (set as the current device before the group is
    built). NCCL reports a timeout through its watchdog, which by default ends the process
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING``); gloo raises in the calling thread.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend {backend!r} is not one of {list(BACKENDS)}")
    timeout_s = check_timeout(timeout_s)
    if dist.is_initialized():
        raise UsageError("a default process group is already initialized in this process")
    rank, world, local = launch_env()
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise UsageError(f"environment variable {name} is not set: start this process with torchrun")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise UsageError("backend 'nccl' needs CUDA, which this process does not have")
        if local >= torch.cuda.device_count():
            raise InvalidArgumentError(f"LOCAL_RANK={local} but this machine has {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        # env:// through the public rendezvous (it joins torchrun's agent store when there is one)
        store, rank, world = next(iter(dist.rendezvous("env://", rank, world, timeout=timeout)))
        store.set_timeout(timeout)
        kw: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)
    except (RuntimeError, ValueError, OSError) as e:  # torch's DistError family derives from RuntimeError
        if dist.is_initialized():
            dist.destroy_process_group()
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RendezvousError(
            f"rank {rank} of {world}: the process group at {where} did not form within {timeout_s:g} s "
            f"(a peer that never started, or a wrong MASTER_ADDR/MASTER_PORT): {type(e).__name__}: {first[:200]}"
        ) from e
    return ProcessContext(rank, world, local, backend, device, float(timeout_s), store)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class LaunchResult:
    """How the ranks of :func:`spawn_local` ended: ``returncodes[r]`` (negative: killed by that signal),
    ``killed`` (ranks ended by the launcher), ``seconds`` (wall time), ``outputs[r]`` (captured text
    when ``capture=True``)."""

    returncodes: list[int]
    killed: list[int]
    seconds: float
    outputs: list[str]

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)


def rank_threads(ranks: int) -> int:
    """Each of ``ranks`` local processes' share of the cores this process may run on (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks)


def spawn_local(
    argv: Sequence[str],
    ranks: int,
    *,
    deadline_s: float,
    grace_s: float,
    env: Mapping[str, str] | None = None,
    capture: bool = False,
) -> LaunchResult:
    """Run ``argv`` as ``ranks`` local processes with the environment ``torchrun`` would give them
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free
    ``MASTER_PORT``), plus ``env``. Each rank gets its share of this process's cores as
    ``OMP_NUM_THREADS`` (at least 1), unless ``env`` or the environment sets it: ranks that each start
    a thread per core would oversubscribe the machine (``torchrun`` sets it to 1 for several ranks).

    Waits for every rank. Once one rank has failed, the others have ``grace_s`` seconds to end on
    their own (they should: their collectives fail); whatever is left after that, or after
    ``deadline_s`` in all, is killed (SIGKILL) and listed in ``killed``. ``capture=True`` collects
    each rank's stdout and stderr as text instead of passing them through.
    """
    if ranks < 1:
        raise InvalidArgumentError(f"ranks must be >= 1, got {ranks}")
    limit, why = local_rank_limit()
    if ranks > limit:
        raise InvalidArgumentError(
            f"{ranks} local ranks: this machine runs at most {limit} ({why}); start fewer, or spread the "
            "ranks over machines with torchrun"
        )
    base = dict(os.environ)
    base.update(env or {})
    if "OMP_NUM_THREADS" not in base:
        base["OMP_NUM_THREADS"] = str(rank_threads(ranks))
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(ranks),
    )
    out_files = []
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    try:
        for r in range(ranks):
            penv = dict(base, RANK=str(r), LOCAL_RANK=str(r))
            if capture:
                f = tempfile.TemporaryFile(mode="w+")
                out_files.append(f)
                procs.append(subprocess.Popen(list(argv), env=penv, stdout=f, stderr=subprocess.STDOUT, text=True))
            else:
                procs.append(subprocess.Popen(list(argv), env=penv))
        killed: list[int] = []
        first_failure: float | None = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now
            over_deadline = now - t0 > deadline_s
            over_grace = first_failure is not None and now - first_failure > grace_s
            if over_deadline or over_grace:
                for r, p in enumerate(procs):
                    if p.poll() is None:
                        p.send_signal(signal.SIGKILL)
                        killed.append(r)
                for p in procs:
                    p.wait()
                break
            time.sleep(0.05)
        outputs = []
        for f in out_files:
            f.seek(0)
            outputs.append(f.read())
        return LaunchResult([int(p.returncode) for p in procs], killed, time.monotonic() - t0, outputs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in out_files:
            f.close()
