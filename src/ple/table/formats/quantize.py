"""Quantizers for table rows and their error statistics.

Per-row quantization (``quantize_rows``) scales each row by its absolute maximum: ``scale =
absmax / qmax`` (qmax = 448 for fp8 e4m3, 127 for int8; an all-zero row gets scale 1), then
``q = x / scale`` cast to fp8 (round to nearest even, the torch cast) or rounded to the nearest
integer for int8 (symmetric, ``[-127, 127]``). The global variant (``quantize_global``) uses one
absmax for the whole tensor. Math is fp32.

Error statistics compare ``x`` with the fp32 dequantization ``q.float() * scale``:
``max_rel`` = max over rows of ``max|err_row| / max|x_row|`` (all-zero rows count 0), and
``rms_rel`` = ``sqrt(sum err^2 / sum x^2)`` over all elements.
"""

from __future__ import annotations

import dataclasses

import torch

from ple.errors import InvalidArgumentError

__all__ = ["quantize_rows", "quantize_global", "dequantize", "quantization_error", "QuantStats", "RowStats"]

_QMAX = {"fp8": 448.0, "int8": 127.0}


def _check_input(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InvalidArgumentError(f"expected a floating point [n, D] tensor to quantize, got {shape}")
    xf = x.float()
    finite = torch.isfinite(xf)
    if not bool(finite.all()):
        r, c = (int(v) for v in (~finite).nonzero()[0])
        raise InvalidArgumentError(f"cannot quantize a non-finite value {float(xf[r, c])} at row {r}, column {c}")
    return xf


def _cast(y: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "fp8":
        return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch.round(y).clamp(-127.0, 127.0).to(torch.int8)


def quantize_rows(x: torch.Tensor, to: str = "fp8_row") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax quantization.

    Args:
        x: ``[n, D]`` floating point rows.
        to: "fp8_row" (float8 e4m3, max 448) or "int8_row" (symmetric int8, round to nearest).

    Returns:
        ``(q [n, D], scale [n, 1] fp32)`` with ``x ~= q.float() * scale``.
    """
    if to not in ("fp8_row", "int8_row"):
        raise InvalidArgumentError(f"quantize_rows: to must be 'fp8_row' or 'int8_row', got {to!r}")
    kind = "fp8" if to == "fp8_row" else "int8"
    xf = _check_input(x)
    amax = xf.abs().amax(dim=1, keepdim=True) if xf.shape[1] else xf.new_zeros(xf.shape[0], 1)
    scale = torch.where(amax > 0, amax / _QMAX[kind], torch.ones_like(amax))
    return _cast(xf / scale, kind), scale


def quantize_global(x: torch.Tensor, to: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """Global absmax quantization to float8 e4m3: ``(q [n, D], scale [1] fp32)``."""
    if to != "fp8":
        raise InvalidArgumentError(f"quantize_global: to must be 'fp8', got {to!r}")
    xf = _check_input(x)
    amax = xf.abs().max() if xf.numel() else xf.new_zeros(())
    scale = (amax / 448.0 if amax > 0 else torch.ones_like(amax)).reshape(1)
    return _cast(xf / scale, "fp8"), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.to(dtype) * scale.to(dtype)``, ``q.to(dtype)`` when ``scale`` is None."""
    if scale is None:
        return q.to(dtype)
    return q.to(dtype) * scale.to(dtype)


@dataclasses.dataclass
class RowStats:
    """Per-row error sums of one block of rows (fp64): ``err_sq``, ``ref_sq``, ``max_rel`` — all ``[n]``."""

    err_sq: torch.Tensor
    ref_sq: torch.Tensor
    max_rel: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, approx: torch.Tensor) -> RowStats:
        """Errors of ``approx`` against ``x`` (both ``[n, D]``)."""
        xf, af = x.double(), approx.double()
        err = af - xf
        if xf.shape[1] == 0:
            z = xf.new_zeros(xf.shape[0])
            return cls(z, z.clone(), z.clone())
        amax = xf.abs().amax(dim=1)
        emax = err.abs().amax(dim=1)
        max_rel = torch.where(amax > 0, emax / torch.where(amax > 0, amax, 1.0), torch.zeros_like(amax))
        return cls((err * err).sum(dim=1), (xf * xf).sum(dim=1), max_rel)


@dataclasses.dataclass
class QuantStats:
    """Relative quantization error: ``max_rel`` (max over rows of max|err|/max|x|), ``rms_rel``
    (sqrt(sum err^2 / sum x^2)), over ``rows`` rows."""

    max_rel: float = 0.0
    rms_rel: float = 0.0
    rows: int = 0
    _err_sq: float = dataclasses.field(default=0.0, repr=False)
    _ref_sq: float = dataclasses.field(default=0.0, repr=False)

    def add(self, e: RowStats, start: int = 0, stop: int | None = None) -> None:
        """Accumulate rows ``[start, stop)`` of ``e``."""
        stop = e.err_sq.shape[0] if stop is None else stop
        if stop <= start:
            return
        self._err_sq += float(e.err_sq[start:stop].sum())
        self._ref_sq += float(e.ref_sq[start:stop].sum())
        self.max_rel = max(self.max_rel, float(e.max_rel[start:stop].max()))
        self.rows += stop - start
        self.rms_rel = (self._err_sq / self._ref_sq) ** 0.5 if self._ref_sq > 0 else 0.0

    def add_sums(self, err_sq: float, ref_sq: float, max_rel: float, rows: int) -> None:
        """Accumulate rows summarized by :meth:`sums`."""
        if rows <= 0:
            return
        self._err_sq += err_sq
        self._ref_sq += ref_sq
        self.max_rel = max(self.max_rel, max_rel)
        self.rows += rows
        self.rms_rel = (self._err_sq / self._ref_sq) ** 0.5 if self._ref_sq > 0 else 0.0

    def sums(self) -> list:
        """``[sum err^2, sum x^2, max_rel, rows]``: what :meth:`add_sums` takes (a JSON-able record)."""
        return [self._err_sq, self._ref_sq, self.max_rel, self.rows]

    def to_dict(self) -> dict:
        return {"max_rel": self.max_rel, "rms_rel": self.rms_rel, "rows": self.rows}


def quantization_error(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None) -> QuantStats:
    """Error of ``(q, scale)`` against ``x [n, D]``, dequantized in fp32."""
    e = QuantStats()
    e.add(RowStats.of(x, dequantize(q, scale, torch.float32)))
    return e
