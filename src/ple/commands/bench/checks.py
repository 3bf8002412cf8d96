"""The check a benchmark case passes before it is timed: ple's outputs against transformers'.

fp32 outputs must agree within ``FP32_TOL * (1 + max|out|)``; bf16 outputs are judged against
transformers run in fp32 on the same (bf16-representable) weights and inputs: ple's error must be at
most twice transformers' bf16 error plus ``BF16_ATOL``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BF16_ATOL", "FP32_TOL", "CheckResult", "compare_outputs", "dtype_name"]

FP32_TOL = 1e-4  # fp32: |ple - transformers| <= FP32_TOL * (1 + max|transformers|)
BF16_ATOL = 1e-3  # bf16: err(ple) <= 2 * err(transformers bf16) + BF16_ATOL, errors against fp32


@dataclasses.dataclass
class CheckResult:
    """Outcome of a case's correctness check; ``metrics`` are numbers for the JSON report."""

    passed: bool
    detail: str
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


def _max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


def _flat(out: Any) -> torch.Tensor:
    """Outputs (a tensor or a list of them) as one fp32 vector."""
    if isinstance(out, torch.Tensor):
        return out.detach().float().reshape(-1)
    return torch.cat([_flat(o) for o in out])


def compare_outputs(ple_out: Any, tf_out: Any, dtype: torch.dtype, reference: Callable[[], Any] | None) -> CheckResult:
    """The float check (see the module docstring). ``reference`` computes transformers' output in
    fp32 on the same inputs; it is only called for low-precision dtypes."""
    got, want = _flat(ple_out), _flat(tf_out)
    if got.shape != want.shape:
        return CheckResult(False, f"ple returned {got.numel()} values, transformers {want.numel()}")
    if not bool(torch.isfinite(got).all()):
        bad = int((~torch.isfinite(got)).sum())
        return CheckResult(False, f"ple output has {bad} non-finite values", {"nonfinite": bad})
    err = _max_abs(got - want)
    scale = _max_abs(want)
    metrics = {"max_abs_err_vs_transformers": err, "max_abs_transformers": scale}
    if dtype == torch.float32 or reference is None:
        bound = FP32_TOL * (1.0 + scale)
        metrics["bound"] = bound
        ok = err <= bound
        return CheckResult(ok, f"max|ple - tf| = {err:.3g} {'<=' if ok else '>'} {bound:.3g}", metrics)
    ref = _flat(reference())
    err_ple = _max_abs(got - ref)
    err_tf = _max_abs(want - ref)
    bound = 2 * err_tf + BF16_ATOL
    metrics.update({"max_abs_err_ple_vs_fp32": err_ple, "max_abs_err_tf_vs_fp32": err_tf, "bound": bound})
    ok = err_ple <= bound
    return CheckResult(
        ok,
        f"vs fp32: err(ple) = {err_ple:.3g} {'<=' if ok else '>'} 2 x err(tf {dtype_name(dtype)}) + {BF16_ATOL:g}"
        f" = {bound:.3g}",
        metrics,
    )


def dtype_name(dtype: torch.dtype | None) -> str:
    """The short name a report gives a case's dtype: ``bf16``, ``fp16``, ``fp32``, or ``int64`` for
    ``None`` (the ``ids`` case, whose outputs are integers)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", None: "int64"}[dtype]
