"""``--profile CASE``: where ple's time goes, stage by stage.

The stages are timed where the layer calls them: for the duration of the profile the functions
the layer reaches through module attributes (``ngram_ids``, ``F.linear``, ``gate_conv``, the
table's ``lookup``) are wrapped by timers (synchronizing the device around
each call), and restored afterwards. Sub-stages (input validation; the C kernel, or the PyTorch gate and conv) are
shown indented and are already counted in their stage. "other" is what the layer spends outside
the stages (argument checks, splits, the residual add). A ``torch.profiler`` table of one run
follows, for the operator-level view.
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from .cases import Case, Fixture
from .timing import measure, median_ms, sync_of

__all__ = ["StageTimer", "profile_case"]

STAGES = ("ids", "lookup", "gemm", "gate+conv")

# (module, attribute, stage, parent stage or None): what the timers wrap when the module is loaded.
_HOOKS = (
    ("ple.layer", "ngram_ids", "ids", None),
    ("ple.ngram", "ngram_ids", "ids", None),
    ("ple.layer", "gate_conv", "gate+conv", None),
    ("ple.ngram", "check_ngram_inputs", "ids: validate", "ids"),
    ("ple.ngram.native", "ngram_ids", "ids: compute", "ids"),
    ("ple.ngram.torch_impl", "ngram_ids", "ids: compute", "ids"),
    ("ple.ngram.triton_impl", "ngram_ids", "ids: compute", "ids"),
    ("ple.ops.fused.native", "gate_conv", "C kernel", "gate+conv"),
    ("ple.ops.gate.torch_impl", "ngram_gate", "gate (PyTorch)", "gate+conv"),
    ("ple.ops.conv.torch_impl", "dilated_conv", "conv (PyTorch)", "gate+conv"),
    ("ple.ops.gate.triton_impl", "ngram_gate", "gate (Triton)", "gate+conv"),
    ("ple.ops.conv.triton_impl", "dilated_conv", "conv (Triton)", "gate+conv"),
)


class StageTimer:
    """Accumulates inclusive wall time per stage name; ``wrap`` makes a timed twin of a function."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.totals: dict[str, float] = {}
        self.parents: dict[str, str | None] = {}

    def wrap(self, name: str, fn: Callable, parent: str | None = None) -> Callable:
        self.parents.setdefault(name, parent)

        def timed(*args, **kwargs):
            self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

        timed.__wrapped__ = fn
        return timed

    def reset(self) -> None:
        self.totals = {}


@contextlib.contextmanager
def _patched(timer: StageTimer, layer) -> Any:
    saved: list[tuple[Any, str, Any]] = []
    try:
        for mod_name, attr, stage, parent in _HOOKS:
            mod = sys.modules.get(mod_name)
            if mod is None:  # e.g. the Triton twins on a CPU run
                continue
            if not hasattr(mod, attr):
                raise RuntimeError(f"profile hook {mod_name}.{attr} no longer exists: update _HOOKS")
            fn = getattr(mod, attr)
            saved.append((mod, attr, fn))
            setattr(mod, attr, timer.wrap(stage, fn, parent))
        layer_mod = sys.modules.get("ple.layer")
        if layer_mod is not None and hasattr(layer_mod, "F"):
            f_orig = layer_mod.F
            proxy = types.SimpleNamespace(**{k: getattr(f_orig, k) for k in dir(f_orig) if not k.startswith("__")})
            proxy.linear = timer.wrap("gemm", f_orig.linear)
            saved.append((layer_mod, "F", f_orig))
            layer_mod.F = proxy
        table = getattr(layer, "table", None)
        if table is not None:
            saved.append((table, "lookup", None))
            table.lookup = timer.wrap("lookup", type(table).lookup.__get__(table))
            saved.append((table, "_check_call", None))
            table._check_call = timer.wrap("lookup: validate", type(table)._check_call.__get__(table), "lookup")
        yield
    finally:
        for obj, attr, fn in reversed(saved):
            if fn is None:
                delattr(obj, attr)  # instance attribute over the class's method
            else:
                setattr(obj, attr, fn)


def profile_case(
    case: Case,
    fixture: Fixture,
    repeat: int,
    warmup: int,
    out=sys.stdout,
    log: Callable[[str], None] = lambda s: None,
    top: int = 15,
) -> int:
    """Print the stage breakdown of ple in ``case`` (after its correctness check); 1 if refused."""

    importlib.import_module("ple.layer")
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

    timer = StageTimer(sync)
    runs: list[dict[str, float]] = []
    totals: list[float] = []
    with _patched(timer, prep.layer):
        for i in range(warmup + repeat):
            if prep.reset is not None:
                prep.reset()
            timer.reset()
            sync()
            t0 = time.perf_counter()
            prep.ple()
            sync()
            dt = time.perf_counter() - t0
            if i >= warmup:
                runs.append(dict(timer.totals))
                totals.append(dt)
    hit = {n for r in runs for n in r}
    names = [n for n in dict.fromkeys([*STAGES, *timer.parents]) if n in hit]
    med = {n: statistics.median(r.get(n, 0.0) for r in runs) * 1e3 for n in names}
    total = statistics.median(totals) * 1e3
    top_level = [n for n in names if timer.parents.get(n) is None]
    other = max(0.0, total - sum(med[n] for n in top_level))

    print(
        f"\nprofile of {case.name} ({prep.shape}, {prep.tokens} tokens) on {fixture.device}: medians of "
        f"{repeat} runs (timers synchronize around every stage)",
        file=out,
    )
    print(f"{'stage':22s} {'ms':>10s} {'% of ple':>9s} {'us/token':>10s}", file=out)
    ordered = [m for n in top_level for m in (n, *(c for c in names if timer.parents.get(c) == n))]
    for n in ordered:
        label = ("  " if timer.parents[n] else "") + n
        print(f"{label:22s} {med[n]:10.3f} {100 * med[n] / total:8.1f}% {1e3 * med[n] / prep.tokens:10.3f}", file=out)
    print(f"{'other':22s} {other:10.3f} {100 * other / total:8.1f}% {1e3 * other / prep.tokens:10.3f}", file=out)
    print(f"{'ple total':22s} {total:10.3f} {100.0:8.1f}% {1e3 * total / prep.tokens:10.3f}", file=out)
    for k, v in ref_samples.items():
        m = median_ms(v)
        label = "floor (projections)" if k == "floor" else k
        print(f"{label:22s} {m:10.3f} {100 * m / total:8.1f}% {1e3 * m / prep.tokens:10.3f}", file=out)
    if "gemm" in med and "floor" in ref_samples:
        print(
            f"gemm / floor = {med['gemm'] / median_ms(ref_samples['floor']):.2f}; "
            f"ple / floor = {total / median_ms(ref_samples['floor']):.2f}",
            file=out,
        )

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if fixture.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    if prep.reset is not None:
        prep.reset()
    with torch_profile(activities=activities) as prof:
        prep.ple()
        sync()
    key = "self_cuda_time_total" if fixture.device.type == "cuda" else "self_cpu_time_total"
    print(f"\ntorch.profiler, one run of ple, top {top} operators by {key}:", file=out)
    print(prof.key_averages().table(sort_by=key, row_limit=top), file=out)
    return 0
