"""``--profile CASE``: where ple's time goes, stage by stage.

The layer and the session mark their stages as named ranges in the code
(:func:`ple.ops.library.named_range`, i.e. ``torch.profiler.record_function`` while a profiler runs;
nothing otherwise): ``ple.check`` (argument checks), ``ple.ids``, ``ple.lookup``, ``ple.gemm`` (the
key and value projections), ``ple.gate_conv`` (the fused step), and in a :class:`ple.Session` step
``ple.session.prepare`` (packing the batch) and ``ple.session.update`` (contexts, prefix states).
Each run of the case is recorded by ``torch.profiler``; the inclusive time of every range is summed
per run and the medians over runs are shown (on CUDA the ranges measure what the host waits for:
the profiler synchronizes at the end of each run only, so device work may land in a later range).
"other" is ple's time outside the ranges. A ``torch.profiler`` operator table of one run follows.
With ``--json`` the same numbers are one JSON document (:data:`SCHEMA`), the operator table a list.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from ple.commands.bench.cases import Case, Fixture
from ple.commands.bench.timing import measure, median_ms, sync_of

__all__ = ["SCHEMA", "STAGES", "profile_case", "stage_times"]

SCHEMA = "ple-bench-profile/1"

# (range name, label, parent range or None)
STAGES: tuple[tuple[str, str, str | None], ...] = (
    ("ple.session.prepare", "session: prepare", None),
    ("ple.check", "checks", None),
    ("ple.ids", "ids", None),
    ("ple.lookup", "lookup", None),
    ("ple.gemm", "gemm", None),
    ("ple.gate_conv", "gate+conv", None),
    ("ple.session.update", "session: update", None),
)


def stage_times(prof) -> dict[str, float]:
    """Seconds per range name of :data:`STAGES` in a finished ``torch.profiler`` run (inclusive CPU time)."""
    names = {s[0] for s in STAGES}
    totals: dict[str, float] = {}
    for ev in prof.events():
        if ev.name in names:
            totals[ev.name] = totals.get(ev.name, 0.0) + ev.cpu_time_total * 1e-6
    return totals


def profile_case(
    case: Case,
    fixture: Fixture,
    repeat: int,
    warmup: int,
    out=sys.stdout,
    log: Callable[[str], None] = lambda s: None,
    top: int = 15,
    as_json: bool = False,
) -> int:
    """Print the stage breakdown of ple in ``case`` (after its correctness check), as text or, with
    ``as_json``, as one JSON document; returns 1 if the check refused the case, else 0."""
    sync = sync_of(fixture.device)
    log(f"[{case.name}] building")
    prep = case.build(fixture)
    if prep.reset is not None:
        prep.reset()
    p = prep.ple()
    if prep.reset is not None:
        prep.reset()
    result = prep.check(p, prep.transformers())
    del p
    if not result.passed:
        print(f"ple bench: {case.name}: check failed, not profiled: {result.detail}", file=sys.stderr)
        return 1
    log(f"[{case.name}] check passed ({result.detail}); profiling {repeat} x")
    ref = {"transformers": prep.transformers}
    if prep.floor is not None:
        ref["floor"] = prep.floor
    ref_samples = measure(ref, repeat, warmup, prep.reset, sync)

    activities = [ProfilerActivity.CPU]
    if fixture.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    runs: list[dict[str, float]] = []
    totals: list[float] = []
    last = None
    for i in range(warmup + repeat):
        if prep.reset is not None:
            prep.reset()
        sync()
        with torch_profile(activities=activities) as prof:
            t0 = time.perf_counter()
            prep.ple()
            sync()
            dt = time.perf_counter() - t0
        last = prof
        if i >= warmup:
            runs.append(stage_times(prof))
            totals.append(dt)
    hit = [s for s in STAGES if any(s[0] in r for r in runs)]
    med = {name: statistics.median(r.get(name, 0.0) for r in runs) * 1e3 for name, _, _ in hit}
    total = statistics.median(totals) * 1e3
    other = max(0.0, total - sum(med[n] for n, _, parent in hit if parent is None))
    tokens = max(1, prep.tokens)

    floor_ms = median_ms(ref_samples.get("floor"))
    references = {k: m for k, m in ((k, median_ms(v)) for k, v in ref_samples.items()) if m is not None}
    key = "self_cuda_time_total" if fixture.device.type == "cuda" else "self_cpu_time_total"
    if as_json:
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "case": case.name,
            "shape": prep.shape,
            "tokens": prep.tokens,
            "device": str(fixture.device),
            "geometry": fixture.geometry.describe(),
            "repeat": repeat,
            "check": result.detail,
            "stages": [
                {"range": name, "label": label, "parent": parent, "median_ms": med[name]} for name, label, parent in hit
            ],
            "other_ms": other,
            "total_ms": total,
            "reference_median_ms": references,
            "operators": _top_operators(last, key, top) if last is not None else [],
        }
        print(json.dumps(doc, indent=2), file=out)
        return 0

    print(
        f"\nprofile of {case.name} ({prep.shape}, {prep.tokens} tokens) on {fixture.device}: medians of "
        f"{repeat} profiled runs (named ranges in the code); {fixture.geometry.describe()}",
        file=out,
    )
    print(f"{'stage':22s} {'ms':>10s} {'% of ple':>9s} {'us/token':>10s}", file=out)
    for name, label, parent in hit:
        shown = ("  " if parent else "") + label
        print(
            f"{shown:22s} {med[name]:10.3f} {100 * med[name] / total:8.1f}% {1e3 * med[name] / tokens:10.3f}", file=out
        )
    print(f"{'other':22s} {other:10.3f} {100 * other / total:8.1f}% {1e3 * other / tokens:10.3f}", file=out)
    print(f"{'ple total':22s} {total:10.3f} {100.0:8.1f}% {1e3 * total / tokens:10.3f}", file=out)
    for k, m in references.items():
        label = "floor (projections)" if k == "floor" else k
        print(f"{label:22s} {m:10.3f} {100 * m / total:8.1f}% {1e3 * m / tokens:10.3f}", file=out)
    if "ple.gemm" in med and floor_ms:
        print(f"gemm / floor = {med['ple.gemm'] / floor_ms:.2f}; ple / floor = {total / floor_ms:.2f}", file=out)

    if last is not None:
        print(f"\ntorch.profiler, the last run of ple, top {top} operators by {key}:", file=out)
        print(last.key_averages().table(sort_by=key, row_limit=top), file=out)
    return 0


def _top_operators(prof, key: str, top: int) -> list[dict[str, Any]]:
    """The ``top`` operators of a finished ``torch.profiler`` run by ``key`` (self time), in ms."""
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key, "calls": e.count, key.replace("_total", "_ms"): getattr(e, key) * 1e-3} for e in rows]
