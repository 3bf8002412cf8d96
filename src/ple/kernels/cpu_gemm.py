"""The projections' GEMM on the CPU with the weights packed once: oneDNN's blocked layout for bf16.

``F.linear`` on a bf16 CPU tensor hands oneDNN the weight in PyTorch's row-major layout, and oneDNN
reorders it into the blocked layout its matrix kernels read, on every call: for the published
projections (``[12800, 2560]`` bf16, 65.5 MB) a decode step copies the weight once more before it
multiplies. :class:`PackedWeight` keeps one reordered copy (as large as the weight) and :func:`linear`
multiplies with it (``torch.ops.mkldnn._linear_pointwise``, the call PyTorch's own compiler emits for
frozen CPU linears). Measured with two threads, ``[rows, 2560]`` by the published weight, in rotation
with other work, ``F.linear`` -> packed:

- an Intel Xeon with AMX: one row 3.1 -> 2.5 ms, 64 rows 4.8 -> 3.2 (4.3 -> 2.4 back to back), 192
  rows 8.7 -> 5.8; from 256 rows on as fast (2,048 rows: the packed one up to 5 % slower), so steps
  of at most :data:`MAX_ROWS` rows take it there;
- an AMD EPYC with AVX-512 BF16 and no AMX: one row 2.6 -> 2.0 ms, 64 rows 6.6 -> 6.0, 128 rows 12.0
  -> 10.9, then 4-6 % faster up to 4,096 rows (2,048 rows: 180 -> 173 ms), so there every step takes
  it (:func:`max_rows`).

Its results have ``F.linear``'s bits on both (the same oneDNN kernels; measured from 1 to 2,048 rows
on the Xeon and to 4,096 on the EPYC, tested up to 300).

When it is on (``PLE_PACKED_GEMM``, read at each packing):

- ``auto`` (the default): on CPUs with bf16 instructions (AMX tiles or AVX-512 BF16 dot products: the
  ``amx_bf16`` or ``avx512_bf16`` flag), where it was measured; not elsewhere (unmeasured there);
- ``1``/``on``: wherever PyTorch has oneDNN (an error names what is missing where it has not);
- ``0``/``off``: never (``F.linear`` for every step).

Only bf16 weights are packed: fp32 goes through another library (MKL) in ``F.linear``, whose bits
oneDNN's do not match.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.autograd.forward_ad as _forward_ad

from ple.errors import InvalidArgumentError

__all__ = [
    "ALL_ROWS",
    "AUTO_FLAGS",
    "MAX_ROWS",
    "PackedWeight",
    "describe",
    "linear",
    "max_rows",
    "missing",
    "mode",
    "packing",
    "use_packed",
]

MAX_ROWS = 255
"""The most rows a GEMM takes the packed weight for on CPUs with AMX (beyond, ``F.linear``: as fast or
faster); :func:`max_rows` gives this CPU's limit."""

_HINT = 64
"""The row count the packed layout is chosen for (a decode step's; its results match ``F.linear``'s
for every row count, where the layout chosen for one row differs from them at 64 and 256 rows)."""

_MODES = {"auto": "auto", "": "auto", "1": "on", "on": "on", "0": "off", "off": "off"}


def mode() -> str:
    """``PLE_PACKED_GEMM`` as ``"auto"``, ``"on"`` or ``"off"``; a value outside those is refused by name."""
    raw = os.environ.get("PLE_PACKED_GEMM", "auto")
    got = _MODES.get(raw.strip().lower())
    if got is None:
        raise InvalidArgumentError(f"PLE_PACKED_GEMM={raw!r}: give auto, 1/on or 0/off")
    return got


AUTO_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags (Linux ``/proc/cpuinfo``) under which ``auto`` packs: either is enough."""

ALL_ROWS = sys.maxsize
""":func:`max_rows` where every row count takes the packed weight."""


@functools.lru_cache(maxsize=4)
def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The words of the first ``flags`` line of ``cpuinfo`` (none where it cannot be read)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _cpu_has_bf16_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU reports bf16 instructions: one of :data:`AUTO_FLAGS` in ``cpuinfo``."""
    return not _cpu_flags(cpuinfo).isdisjoint(AUTO_FLAGS)


@functools.lru_cache(maxsize=4)
def max_rows(cpuinfo: str = "/proc/cpuinfo") -> int:
    """The most rows a GEMM takes the packed weight for on this CPU (when packing is on at all).

    :data:`MAX_ROWS` on CPUs with AMX (beyond, ``F.linear`` is as fast or faster there) and on CPUs
    without bf16 instructions (forced on; unmeasured); :data:`ALL_ROWS` on CPUs with AVX-512 BF16 and no
    AMX, where the packed weight measured faster at every row count (1.1-1.3 x up to 128 rows, 4-6 %
    from 200 to 4,096 rows, with ``F.linear``'s bits)."""
    flags = _cpu_flags(cpuinfo)
    return ALL_ROWS if "avx512_bf16" in flags and "amx_bf16" not in flags else MAX_ROWS


def missing() -> str | None:
    """What this PyTorch lacks for packed weights (None: nothing)."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch is built without oneDNN (torch.backends.mkldnn.is_available() is False)"
    ops = torch.ops.mkldnn
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        try:
            getattr(ops, name)
        except (AttributeError, RuntimeError):
            return f"this PyTorch has no torch.ops.mkldnn.{name}"
    return None


def packing(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` on the CPU are packed now (:func:`mode`, the CPU, this PyTorch).
    Raises where ``PLE_PACKED_GEMM`` asks for packing this PyTorch cannot do."""
    m = mode()
    if m == "off" or dtype != torch.bfloat16:
        return False
    if m == "auto" and not _cpu_has_bf16_matmul():
        return False
    lacking = missing()
    if lacking is None:
        return True
    if m == "on":
        raise InvalidArgumentError(f"PLE_PACKED_GEMM=on: {lacking}")
    return False


def describe() -> str:
    """One line for benchmark records: which GEMM the bf16 projections run on the CPU."""
    try:
        on = packing(torch.bfloat16)
    except InvalidArgumentError as e:
        return f"error: {e}"
    if on:
        limit = max_rows()
        if limit == ALL_ROWS:
            return f"packed oneDNN weights at every row count (PLE_PACKED_GEMM={mode()})"
        return f"packed oneDNN weights up to {limit} rows, F.linear beyond (PLE_PACKED_GEMM={mode()})"
    return f"F.linear (PLE_PACKED_GEMM={mode()})"


class PackedWeight:
    """A CPU weight ``[N, K]`` reordered once into oneDNN's blocked layout, for :func:`linear`.

    It follows its source: :meth:`get` packs again when the weight tensor has changed since (another
    tensor, or an in-place write: its version counter). Copies and pickles of a module holding one
    carry no packed data (oneDNN's opaque tensors have no storage to copy); they pack on first use.
    """

    __slots__ = ("_packed", "_key")

    def __init__(self, weight: torch.Tensor | None = None) -> None:
        self._packed: torch.Tensor | None = None
        self._key: tuple | None = None
        if weight is not None:
            self.pack(weight)

    @staticmethod
    def _key_of(w: torch.Tensor) -> tuple:
        try:
            version = w._version
        except RuntimeError:  # an inference tensor keeps no version: only pack() follows its changes
            version = -1
        return (w.data_ptr(), version, tuple(w.shape), w.dtype)

    def pack(self, weight: torch.Tensor) -> None:
        """Pack ``weight`` (a 2-D bf16 CPU tensor) now."""
        key = self._key_of(weight)  # before: a write during the packing leaves the copy stale, not unseen
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _HINT)
        self._key = key

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight``, packed now if it is not current."""
        if self._packed is None or self._key_of(weight) != self._key:
            self.pack(weight)
        assert self._packed is not None
        return self._packed

    def __deepcopy__(self, memo) -> PackedWeight:
        return PackedWeight()

    def __reduce__(self):
        return (PackedWeight, ())


def linear(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """``F.linear(x, weight)`` ``[T, N]`` for ``x [T, K]`` with the packed copy of ``weight [N, K]``
    (the caller chose it: :func:`use_packed`). A column-strided ``x`` is copied to rows first: its
    results are those of ``F.linear`` of that copy (oneDNN reads the strided one otherwise)."""
    if not (
        x.dim() == 2
        and weight.dim() == 2
        and x.shape[1] == weight.shape[1]
        and x.dtype == weight.dtype == torch.bfloat16
        and x.device.type == weight.device.type == "cpu"
    ):
        raise InvalidArgumentError(
            f"cpu_gemm.linear takes x [T, K] and weight [N, K], both bf16 on the CPU; got x {tuple(x.shape)} "
            f"{x.dtype} on {x.device}, weight {tuple(weight.shape)} {weight.dtype} on {weight.device}"
        )
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, packed.get(weight), None, "none", [], "")


def use_packed(x: torch.Tensor, packed: PackedWeight | None) -> bool:
    """Whether :func:`linear` takes ``x``: at most :func:`max_rows` rows, eager, no derivative asked for,
    oneDNN on.

    Traced code (compiled or exported) takes ``F.linear`` whatever the row count, without a guard on
    it; so do inputs that need a gradient, forward-mode derivatives (``torch.func.jvp``, dual tensors:
    the packed operator has no derivative formula) and functorch transforms, and every call while
    ``torch.backends.mkldnn`` is turned off (``F.linear`` then runs another library)."""
    return (
        packed is not None
        and not torch.compiler.is_compiling()  # first: traced code reads nothing more here (no guard on T)
        and not _is_exporting()
        and type(x) is torch.Tensor
        and x.shape[0] <= max_rows()
        and not (x.requires_grad and torch.is_grad_enabled())
        and _forward_ad._current_level < 0
        and not _is_functorch_wrapped(x)
        and torch._C._get_mkldnn_enabled()  # torch.backends.mkldnn.enabled, read without its property
    )


def _no(_x=None) -> bool:
    return False


_is_exporting = getattr(torch.compiler, "is_exporting", _no)  # PyTorch < 2.7 has none (FakeTensors are refused)
_is_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", _no)
