"""Failing together: agreement checks before data collectives, and clear errors when a peer is gone.

- :func:`agree` exchanges a few named values (ints or short strings) over a group and raises
  :class:`RankMismatchError` on *every* rank when they differ, naming each field and each rank's
  value. It runs before any collective whose shapes depend on those values, so disagreeing ranks
  never reach a collective that would abort or hang; the exchange is
  :func:`ple.common.collective.exchange_records` (a small all-gather of the lengths, then of the values).
- :func:`collective_failures` turns a failed collective (a peer that died closes its connections; a
  peer that stalls past the group's timeout makes the wait time out) into a
  :class:`PeerFailureError` saying what this rank was doing, how long it waited, and, through the
  rendezvous store, which ranks reported the failure too and which did not (those died or stalled).
- :func:`report_failure` lets a rank that is about to leave with an error of its own say so, for
  the peers' messages.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ple.common.collective import RankMismatchError, differing, exchange_records, hash60, rank_list
from ple.errors import ArgumentTypeError, InvalidArgumentError, PLEError
from ple.parallel.launch import ProcessContext

__all__ = ["PeerFailureError", "RankMismatchError", "agree", "collective_failures", "report_failure"]

_KEY = "ple/failed/"
_STR_WORDS = 4  # a string field travels as its first 32 UTF-8 bytes plus a hash of all of it


class PeerFailureError(PLEError, RuntimeError):
    """A collective failed because another rank died, raised, or stalled past the group's timeout."""


# ---------------------------------------------------------------------- agreement
def _encode(value: int | str, name: str = "value", what: str = "agree") -> list[int]:
    """A field's value as ``2 + _STR_WORDS`` int64 words; refuses (naming the field and the value)
    anything but an int64 ``int`` or a ``str``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ArgumentTypeError(f"{what}: field {name!r} is {shown} ({type(value).__name__}), expected an int or a str")
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise InvalidArgumentError(f"{what}: field {name!r} is {value}, outside the int64 range")
        return [0, value] + [0] * _STR_WORDS
    raw = value.encode()
    head = raw[: 8 * _STR_WORDS].ljust(8 * _STR_WORDS, b"\0")
    words = [int.from_bytes(head[8 * i : 8 * i + 8], "little", signed=True) for i in range(_STR_WORDS)]
    return [1 if len(raw) <= 8 * _STR_WORDS else 2, hash60(raw)] + words


def _decode(row: Sequence[int]) -> str:
    kind, value, *words = row
    if kind == 0:
        return str(value)
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words).rstrip(b"\0")
    text = raw.decode(errors="replace")
    return repr(text) if kind == 1 else f"{text!r}... (hash {value:015x})"


def agree(
    fields: Mapping[str, int | str],
    what: str,
    group: Any = None,
    device: torch.device | str = "cpu",
    *,
    same_fields: bool = False,
) -> None:
    """Check that every rank of ``group`` passes the same ``fields``; raise on every rank if not.

    ``what`` names the check in the message (e.g. "PLE layer 0, sequence parallel: configuration").
    The field names are part of the exchange (ranks checking different things disagree too).
    ``device``: where the exchange runs (CPU for gloo, the rank's GPU for an NCCL-only group).
    ``same_fields=True``: every rank is known to check the same field names (fixed by code and
    settings the ranks already agreed on), which spares the exchange of record lengths
    (:func:`ple.common.collective.exchange_records`): one collective instead of two.
    """
    names = list(fields)
    width = 2 + _STR_WORDS
    record = [len(names), hash60("\0".join(names).encode())] + [0] * _STR_WORDS
    for n in names:
        record += _encode(fields[n], n, what)
    everyone = exchange_records(record, what=what, group=group, device=device, same_length=same_fields)
    world, me = len(everyone), dist.get_rank(group)
    if differing([e[:width] for e in everyone]) is not None:
        raise RankMismatchError(
            f"{what}: the {world} ranks check different sets of fields (different ple versions or code paths?) "
            f"(raised on every rank before any data collective; this is rank {me})",
            ["fields"],
        )
    differ = []
    lines = []
    for i, name in enumerate(names, start=1):
        # equal (kind, value or hash) means equal words too: group by the whole encoding
        by_rank = differing([e[i * width : (i + 1) * width] for e in everyone], _decode)
        if by_rank is not None:
            differ.append(name)
            lines.append(f"  - {name}: {by_rank}")
    if differ:
        body = "\n".join(lines)
        raise RankMismatchError(
            f"{what}: the {world} ranks disagree on {', '.join(differ)} (raised on every rank before any data "
            f"collective; this is rank {me}):\n{body}",
            differ,
        )


# ---------------------------------------------------------------------- failures
def _is_collective_failure(e: BaseException) -> bool:
    if isinstance(e, PLEError):
        return False
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out")
    )


def report_failure(context: ProcessContext | None, reason: str) -> None:
    """Tell the peers, through the rendezvous store, that this rank is leaving because of ``reason``
    (best effort: nothing happens without a store or when it is gone)."""
    if context is None or context.store is None:
        return
    with contextlib.suppress(Exception):
        context.store.set(f"{_KEY}{context.rank}", reason[:500])


def _peer_reports(context: ProcessContext, wait_s: float) -> tuple[dict[int, str], list[int], str | None]:
    """``(reports, silent, problem)``: what the other ranks wrote to the store within ``wait_s`` seconds,
    the ranks that wrote nothing, and why the store could not be read (None when it could)."""
    store = context.store
    others = [r for r in range(context.world_size) if r != context.rank]
    reports: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    try:
        while True:
            for r in others:
                if r not in reports and store.check([f"{_KEY}{r}"]):
                    reports[r] = store.get(f"{_KEY}{r}").decode(errors="replace")
            if len(reports) == len(others) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except Exception as e:  # the store is hosted by rank 0 (or torchrun's agent): it may be gone
        return reports, [r for r in others if r not in reports], f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return reports, [r for r in others if r not in reports], None


@contextlib.contextmanager
def collective_failures(what: str, context: ProcessContext | None, *, report_wait_s: float = 2.0) -> Iterator[None]:
    """Run collectives; turn a backend failure into :class:`PeerFailureError` (other errors pass).

    ``what`` says what this rank was doing ("PLE layer 0, step 17: all-gather of the conv inputs").
    With a ``context`` that holds the rendezvous store, this rank reports the failure there and
    waits up to ``report_wait_s`` seconds for the peers' reports, to name the ranks that did not
    report (they died or stalled) and what those that did were doing.
    """
    t0 = time.monotonic()
    try:
        yield
    except Exception as e:
        if not _is_collective_failure(e):
            raise
        waited = time.monotonic() - t0
        text = str(e)
        timeout = f"{context.timeout_s:g} s" if context is not None else "the group's"
        if "Timed out" in text or "timed out" in text:
            cause = f"a peer did not take part within {timeout} timeout (it stalled or waits elsewhere)"
        elif "closed" in text or "reset" in text or "Broken pipe" in text:
            cause = "a peer closed its connection (it died or left with an error)"
        else:
            cause = "the collective failed"
        me = f"rank {context.rank} of {context.world_size}" if context is not None else "this rank"
        lines = [f"{me}: {what} failed after {waited:.1f} s: {cause}."]
        if context is not None and context.store is not None:
            report_failure(context, f"saw a failed collective in {what}")
            reports, silent, problem = _peer_reports(context, min(report_wait_s, context.timeout_s))
            for r, msg in sorted(reports.items()):
                lines.append(f"  rank {r}: {msg}")
            if silent:
                lines.append(f"  {rank_list(silent)}: no report (died, or still stalled)")
            if problem:
                lines.append(f"  (the rendezvous store could not be read: {problem}; its host, rank 0, may be gone)")
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        lines.append(f"  backend: {first[:300]}")
        raise PeerFailureError("\n".join(lines)) from e
