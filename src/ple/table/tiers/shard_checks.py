"""The checks a sharded table's ranks make together: each rank's fingerprint of its shard (geometry,
format, layout hash, how ids are exchanged) compared on every rank, and the small header and digest
exchanged with each lookup so that ranks that disagree fail together, naming the field and the ranks."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ple.common.collective import differing, exchange_records, hash60, rank_list
from ple.errors import PLEError
from ple.table.base import Table
from ple.table.formats.catalog import ACTIVATION_DTYPES, FORMATS

METHODS: tuple[str, ...] = ("allreduce", "alltoall")
"""Ways of combining the ranks' rows (see the module docstring)."""


IDS_MODES: tuple[str, ...] = ("replicated", "per_rank")
"""Whether every rank looks up the same ids or its own (see the module docstring)."""


class ShardGeometryError(PLEError, ValueError):
    """The ranks of a :class:`ShardedTable` disagree on the table, or their row ranges do not tile it.

    Raised on every rank, with the same list of problems (``problems``), each naming ranks and values.
    """

    def __init__(self, problems: Sequence[str], rank: int, world_size: int) -> None:
        self.problems = list(problems)
        self.rank = rank
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"ShardedTable: the {world_size} ranks of the process group disagree on the sharded table "
            f"(raised on every rank; this is rank {rank}):\n{lines}"
        )


# ---------------------------------------------------------------------- fingerprints
# Fixed-size int64 record exchanged at construction; -1 marks "absent / invalid".
FIELDS = (
    "total_rows",
    "head_dim",
    "format",
    "layout_hash",
    "global_scale",
    "method",
    "ids_mode",
    "row_start",
    "row_stop",
    "local_rows",
    "local_errors",
)


HASH_HEX = 15  # layout hashes are compared on their first 60 bits (hash60: a digest's own prefix)


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    total_rows: int
    head_dim: int
    format: int
    layout_hash: int
    global_scale: int
    method: int
    ids_mode: int
    row_start: int
    row_stop: int
    local_rows: int
    local_errors: int

    def as_list(self) -> list[int]:
        return [getattr(self, f) for f in FIELDS]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> Fingerprint:
        return cls(*(int(v) for v in values))


def nonneg_int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else -1


def local_fingerprint(local_table, total_rows, row_start, row_stop, method, layout_hash, ids_mode):
    """``(fingerprint, problems)`` of this rank. Never raises: invalid arguments become -1 fields
    and local problems, reported collectively so every rank fails together."""
    problems: list[str] = []
    head_dim = fmt = scale_bits = local_rows = -1
    if not isinstance(local_table, Table):
        problems.append(f"local_table must be a ple.table.Table, got {type(local_table).__name__}")
    else:
        try:
            head_dim, fmt, local_rows = local_table.head_dim, FORMATS.index(local_table.format), local_table.rows
            scale = local_table.global_scale  # any tier, rows held here or not (a DirectTable's are not)
            if scale is not None:
                scale_bits = int(scale.detach().reshape(1).float().cpu().view(torch.int32)[0])
        except Exception as e:  # a table that cannot describe itself
            problems.append(f"local_table could not be inspected: {type(e).__name__}: {e}")
    if method not in METHODS:
        problems.append(f"method {method!r} is unknown; expected one of {list(METHODS)}")
    if ids_mode not in IDS_MODES:
        problems.append(f"ids {ids_mode!r} is unknown; expected one of {list(IDS_MODES)}")
    for name, v in (("row_start", row_start), ("row_stop", row_stop), ("total_rows", total_rows)):
        if nonneg_int(v) < 0:
            problems.append(f"{name} must be a non-negative integer, got {v!r}")
    hbits = -1
    if layout_hash is not None:
        if isinstance(layout_hash, str) and layout_hash:
            hbits = hash60(layout_hash)
        else:
            problems.append(f"layout_hash must be a non-empty str or a dict, got {layout_hash!r}")
    fp = Fingerprint(
        total_rows=nonneg_int(total_rows),
        head_dim=head_dim,
        format=fmt,
        layout_hash=hbits,
        global_scale=scale_bits,
        method=METHODS.index(method) if method in METHODS else -1,
        ids_mode=IDS_MODES.index(ids_mode) if ids_mode in IDS_MODES else -1,
        row_start=nonneg_int(row_start),
        row_stop=nonneg_int(row_stop),
        local_rows=local_rows,
        local_errors=len(problems),
    )
    return fp, problems


def render(field: str, v: int) -> str:
    if field == "format":
        return repr(FORMATS[v]) if 0 <= v < len(FORMATS) else "no usable table"
    if field == "method":
        return repr(METHODS[v]) if 0 <= v < len(METHODS) else "an unknown method"
    if field == "ids_mode":
        return repr(IDS_MODES[v]) if 0 <= v < len(IDS_MODES) else "an unknown ids mode"
    if field == "layout_hash":
        return "none given" if v < 0 else f"{v:0{HASH_HEX}x}..."
    if field == "global_scale":
        return "none" if v == -1 else repr(float(torch.tensor([v], dtype=torch.int32).view(torch.float32)[0]))
    return "invalid" if v < 0 else str(v)


def check_fingerprints(fps: Sequence[Fingerprint]) -> list[str]:
    """Problems with the ranks' fingerprints; empty when they describe one table tiled by the ranges."""
    problems: list[str] = []
    failed = [r for r, fp in enumerate(fps) if fp.local_errors]
    if failed:
        problems.append(f"{rank_list(failed)} could not describe their shard (invalid arguments, listed on that rank)")
    live = [(r, fp) for r, fp in enumerate(fps) if not fp.local_errors]
    for field in ("total_rows", "head_dim", "format", "layout_hash", "global_scale", "method", "ids_mode"):
        parts = differing({r: getattr(fp, field) for r, fp in live}, functools.partial(render, field))
        if parts is not None:
            problems.append(f"{field} differs across ranks ({parts})")
    if failed:
        return problems  # the ranges cannot be judged with a rank missing
    total = fps[0].total_rows
    ranges_ok = all(fp.total_rows == total for fp in fps) and total >= 0
    owned: list[tuple[int, int, int]] = []
    for r, fp in enumerate(fps):
        a, b = fp.row_start, fp.row_stop
        if a < 0 or b < a or (total >= 0 and b > total):
            problems.append(
                f"rank {r}: row range [{render('row_start', a)}, {render('row_stop', b)}) is not a range within "
                f"[0, total_rows={render('total_rows', fp.total_rows)})"
            )
            ranges_ok = False
            continue
        if fp.local_rows >= 0 and fp.local_rows != b - a:
            problems.append(
                f"rank {r}: its local table has {fp.local_rows} rows but its row range [{a}, {b}) has {b - a}"
            )
        if b > a:
            owned.append((a, b, r))
    if not ranges_ok:
        return problems
    owned.sort()
    cursor = 0
    prev: tuple[int, int, int] | None = None  # the range reaching furthest so far
    for a, b, r in owned:
        if a > cursor:
            after = "the start of the table" if prev is None else f"rank {prev[2]}'s [{prev[0]}, {prev[1]})"
            problems.append(
                f"rows [{cursor}, {a}) are owned by no rank (a gap between {after} and rank {r}'s [{a}, {b}))"
            )
        elif a < cursor and prev is not None:
            problems.append(
                f"rank {prev[2]}'s rows [{prev[0]}, {prev[1]}) and rank {r}'s rows [{a}, {b}) overlap on "
                f"[{a}, {min(cursor, b)})"
            )
        if b > cursor:
            cursor, prev = b, (a, b, r)
    if cursor < total:
        where = "no rank owns any row" if prev is None else f"after rank {prev[2]}'s [{prev[0]}, {prev[1]})"
        problems.append(f"rows [{cursor}, {total}) are owned by no rank ({where})")
    return problems


# ---------------------------------------------------------------------- helpers
def exchange_fingerprints(group, mine: Fingerprint, device: torch.device | None) -> list[Fingerprint]:
    """Every rank's fingerprint (the same list on every rank: every rank reaches the same verdict)."""
    records = exchange_records(mine.as_list(), what="ShardedTable: construction", group=group, device=device)
    return [Fingerprint.from_list(r) for r in records]


def fail_with_peers(group, problem: str) -> NoReturn:
    """Take part in the construction exchange with a failed fingerprint, then raise: the peers
    reach the same exchange and raise too, instead of waiting for this rank forever."""
    failed = Fingerprint.from_list([-1] * (len(FIELDS) - 1) + [1])  # every field invalid, one local error
    fps = exchange_fingerprints(group, failed, None)
    rank = dist.get_rank(group)
    raise ShardGeometryError([f"rank {rank} (this rank): {problem}"] + check_fingerprints(fps), rank, len(fps))


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as int32 (uint8 when their count is not a multiple of 4): an
    integer SUM over these is a bitwise OR when at most one rank has non-zero bits per position."""
    flat = t.reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    return flat.view(torch.int32) if nbytes % 4 == 0 else flat.view(torch.uint8)


def dtype_code(dtype: torch.dtype) -> int:
    return ACTIVATION_DTYPES.index(dtype)


@dataclasses.dataclass(frozen=True)
class Header:
    """What one rank says about a lookup before any row moves (exchanged as int64; -1 = invalid)."""

    number: int  # how many lookups this rank made on the table before this one
    table: int  # which table of the group (tables are built collectively, so in one order everywhere)
    tokens: int
    heads: int
    dtype: int  # index into ACTIVATION_DTYPES
    bad: int  # 1 when an id lies outside the table
    digest: int  # of replicated ids, with verify_ids
    stale: int  # 1 when this rank's table file was changed in place (or closed): its rows cannot be served
    counts: tuple[int, ...]  # alltoall: ids this rank sends to each rank

    @classmethod
    def from_list(cls, v: Sequence[int]) -> Header:
        n, k, t, g, d, b, h, s = (int(x) for x in v[:8])
        return cls(n, k, t, g, d, b, h, s, tuple(int(x) for x in v[8:]))


def lookup_problem(ids: Any, dtype: Any) -> str | None:
    """Why ``(ids, dtype)`` cannot be looked up on this rank (None when they can)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.int64:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        return f"row ids must be a 2-D int64 tensor [T, G], got {shape} {getattr(ids, 'dtype', '')}".rstrip()
    if dtype not in ACTIVATION_DTYPES:
        return f"lookup dtype must be one of {list(ACTIVATION_DTYPES)}, got {dtype}"
    return None


def digest(flat: torch.Tensor) -> torch.Tensor:
    """An order-sensitive int64 digest of ids (wrapping arithmetic): equal ids give equal digests."""
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    weights = torch.arange(1, 2 * flat.numel() + 1, 2, dtype=torch.int64, device=flat.device)
    return ((flat * GOLDEN + 1) * weights).sum()


GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # 2**64 / phi as a signed int64
