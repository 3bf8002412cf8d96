"""The layer's operations as ``torch.ops.ple`` operators, each registered once in :data:`ple.kernels.registry.OPERATORS`.

``grouped_rms_norm``, ``ngram_gate``, ``dilated_conv`` and the fused step ``gate_conv`` with its two
halves ``gate_stage`` and ``conv_stage``: each is one operator with its reference, its kernel per device
and a fake implementation (:func:`ple.kernels.registry.register`). The kernels are the twins of
:mod:`.norm`, :mod:`.gate`, :mod:`.conv` and :mod:`.fused`, which take the records
(:class:`GateWeights`, :class:`ConvWeights`, :class:`StepMeta`); an operator takes their tensors
and numbers as its schema lists them, and this module turns one into the other. On the CPU the fused
ops run the C kernel (:mod:`.fused.native`) where it takes the tensors, else the PyTorch paths; on
CUDA the Triton kernels. They declare what they mutate (the state pool, the ring offsets) and return
fresh tensors only, so ``torch.compile(fullgraph=True)`` and ``torch.export`` trace through them and
CUDA graphs can capture them. No autograd: they serve the inference-only engine call.

The fused operators and ``ngram_gate`` check on every call what shapes, dtypes and devices alone tell
(:func:`check_gate_operator`, :func:`check_conv_operator`: no device memory is read, so nothing
synchronizes) and refuse arguments that disagree with each other with a ple error, because an engine
may call the operators directly; the twins of ``grouped_rms_norm`` and ``dilated_conv`` check their
arguments themselves (:mod:`.norm.checks`, :mod:`.conv.checks`). Index
values (offsets, slots, rejected columns) are checked by the C kernel on the CPU and, with
``validate=True``, by the functions below (:meth:`ple.runtime.Batch.build` for the layer). The fake
implementations check nothing: while tracing, sizes may be symbolic (the compiled program's calls
run the checks).

:func:`grouped_rms_norm`, :func:`ngram_gate`, :func:`dilated_conv`, :func:`gate_conv`,
:func:`gate_stage` and :func:`conv_stage` call the operators with the records (``ple.ops`` exports them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ple.errors import ArgumentTypeError, InvalidArgumentError
from ple.kernels import native as _native
from ple.kernels.registry import Kernel, register
from ple.ops.conv import reference as conv_reference
from ple.ops.conv import torch_impl as conv_torch
from ple.ops.conv.checks import check_conv_args
from ple.ops.fused import composed, native
from ple.ops.fused import reference as fused_reference
from ple.ops.gate import reference as gate_reference
from ple.ops.gate import torch_impl as gate_torch
from ple.ops.gate.checks import check_gate_args
from ple.ops.norm import reference as norm_reference
from ple.ops.norm import torch_impl as norm_torch
from ple.ops.records import ConvWeights, GateWeights, StepMeta
from ple.ops.state import check_ring, engine_view

__all__ = [
    "check_conv_operator",
    "check_gate_operator",
    "conv_stage",
    "dilated_conv",
    "gate_conv",
    "gate_stage",
    "grouped_rms_norm",
    "named_range",
    "ngram_gate",
]

_NO_RANGE = contextlib.nullcontext()


def named_range(name: str):
    """A named range for profilers (``torch.profiler.record_function``) while a profiler runs; a
    shared no-op otherwise (about a microsecond) and inside code that ``torch.compile`` traces."""
    if not getattr(torch.autograd.profiler, "_is_profiler_enabled", True) or torch.compiler.is_compiling():
        return _NO_RANGE
    return torch.profiler.record_function(name)


_GATE = (
    "Tensor norm_key, Tensor norm_query, Tensor norm_conv, Tensor key_query, Tensor conv_scale, float eps, int hc_count"
)
_CONV = "Tensor conv_weight, Tensor conv_taps, int dilation"
_STEP = (
    "Tensor query_start_loc, Tensor(a!) conv_state, Tensor state_indices, Tensor has_initial_state, "
    "Tensor num_rejected, Tensor(b!) state_offsets, bool ring"
)


# ---------------------------------------------------------------------------------------------- checks


_F32 = torch.float32
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _gate_ok(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, devices: bool) -> bool:
    """Whether the gate's arguments agree (the fast pass of :func:`check_gate_operator`: a few
    attribute reads per tensor)."""
    vs = value.shape
    if len(vs) != 2 or type(hc) is not int or hc < 1 or not eps >= 0:
        return False
    tc, cc = (vs[0], hc * vs[1]), (hc * vs[1],)
    dt = value.dtype
    if dt not in _ACT_DTYPES or key.dtype != dt or hidden.dtype != dt or key.shape != tc or hidden.shape != tc:
        return False
    if nk.shape != cc or nq.shape != cc or nc.shape != cc:
        return False
    if not (nk.is_floating_point() and nq.is_floating_point() and nc.is_floating_point()):
        return False
    if kq.shape != cc or cs.shape != cc or kq.dtype != _F32 or cs.dtype != _F32:
        return False
    if not (kq.is_contiguous() and cs.is_contiguous()):
        return False
    if token_mask is not None and token_mask.shape != (vs[0],):
        return False
    if devices:
        d = value.device
        named = (
            (key, hidden, nk, nq, nc, kq, cs) if token_mask is None else (key, hidden, nk, nq, nc, kq, cs, token_mask)
        )
        return all(t.device == d for t in named)
    return True


def _conv_ok(c_like, cw, taps, dil, qsl, pool, slots, has_init, rejected, offsets, ring, devices: bool) -> bool:
    """Whether the conv's and step's arguments agree (the fast pass of :func:`check_conv_operator`)."""
    if c_like.dim() != 2 or cw.dim() != 2 or pool.dim() != 3 or qsl.dim() != 1:
        return False
    c = c_like.shape[1]
    c_out, k = cw.shape
    if c_out != c or k < 1 or type(dil) is not int or dil < 1 or not cw.is_floating_point():
        return False
    if taps.shape != (k, c) or taps.dtype != _F32 or not taps.is_contiguous():
        return False
    s, a, b = pool.shape
    channels, state_len = (b, a) if ring else (a, b)
    if channels != c or state_len < (k - 1) * dil or not pool.is_floating_point():
        return False
    rr = (qsl.shape[0] - 1,)
    if rr[0] < 0 or qsl.dtype not in _INDEX_DTYPES or slots.dtype not in _INDEX_DTYPES:
        return False
    if slots.shape != rr or has_init.shape != rr or rejected.shape != rr or has_init.dtype != torch.bool:
        return False
    if rejected.dtype not in _INDEX_DTYPES:
        return False
    if ring and (offsets.shape != (s,) or offsets.dtype != torch.int64):
        return False
    if devices:
        d = c_like.device
        named = (
            (cw, taps, qsl, pool, slots, has_init, rejected, offsets)
            if ring
            else (cw, taps, qsl, pool, slots, has_init, rejected)
        )
        return all(t.device == d for t in named)
    return True


def _factor_problem(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> str | None:
    if tuple(t.shape) != shape:
        return f"{name}.shape={tuple(t.shape)}, expected {shape}"
    if t.dtype != _F32:
        return f"{name}.dtype={t.dtype}, expected float32 (see ple.ops.records)"
    if t.device != device:
        return f"{name} is on {t.device}, the activations on {device}; expected one device"
    if not t.is_contiguous():
        return f"{name} is not contiguous (stride {tuple(t.stride())})"
    return None


def _described(tensors: dict) -> str:
    return ", ".join(
        f"{k} {v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else f"{k}={v!r}" for k, v in tensors.items()
    )


def check_gate_operator(op, key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, *, devices=True) -> None:
    """The gate's arguments of ``torch.ops.ple.gate_conv`` / ``gate_stage``, from shapes, dtypes and
    devices only: ``key, hidden [T, C]``, ``value [T, H]``, ``C = hc*H``, the norms ``[C]``, the fp32
    factors ``key_query, conv_scale [C]`` contiguous, ``token_mask [T]`` or None, ``eps >= 0``;
    raises :class:`~ple.errors.InvalidArgumentError` / :class:`~ple.errors.ArgumentTypeError`
    naming the argument. ``devices=False`` skips the device checks (the dispatcher ran the CPU
    kernel: every tensor is on the CPU)."""
    if _gate_ok(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, devices):
        return
    for name, t in (("key", key), ("value", value), ("hidden", hidden)):
        if t.dim() != 2:
            raise InvalidArgumentError(f"{op}: {name}.shape={tuple(t.shape)}, expected 2-D rows")
    try:
        check_gate_args(key, value, hidden, _gate(nk, nq, nc, kq, cs, eps, hc))
    except (InvalidArgumentError, ArgumentTypeError) as e:
        raise type(e)(f"{op}: {e}") from None
    if not eps >= 0:
        raise InvalidArgumentError(f"{op}: eps={eps!r}, expected a non-negative number")
    channels = hidden.shape[1]
    for name, t in (("key_query", kq), ("conv_scale", cs)):
        problem = _factor_problem(name, t, (channels,), value.device)
        if problem:
            raise InvalidArgumentError(f"{op}: {problem}")
    if token_mask is not None:
        raise InvalidArgumentError(
            f"{op}: token_mask is {tuple(token_mask.shape)} on {token_mask.device}, expected [T]=({value.shape[0]},) "
            f"on {value.device}"
        )
    raise InvalidArgumentError(  # pragma: no cover - the checks above name every case of the fast pass
        f"{op}: the gate's arguments disagree: {_described(dict(key=key, value=value, hidden=hidden, hc_count=hc))}"
    )


def check_conv_operator(
    op, c_like, cw, taps, dil, qsl, pool, slots, has_init, rejected, offsets, ring, *, devices=True
):
    """The conv's and step's arguments of ``torch.ops.ple.gate_conv`` / ``conv_stage``, from shapes,
    dtypes and devices only. ``c_like``: any ``[T, C]`` tensor of the activations' dtype and device.
    The pool is ``[S, C, L]``, or ``[S, L, C]`` with ``ring`` (then ``offsets`` int64 ``[S]``), with
    ``L >= (K-1)*dilation``; ``taps`` the fp32 contiguous ``[K, C]`` transpose of ``conv_weight [C, K]``;
    ``query_start_loc [R+1]``, ``state_indices``, ``has_initial_state`` (bool), ``num_rejected``
    ``[R]``. ``devices=False`` as in :func:`check_gate_operator`."""
    if _conv_ok(c_like, cw, taps, dil, qsl, pool, slots, has_init, rejected, offsets, ring, devices):
        return
    if pool.dim() != 3:
        raise InvalidArgumentError(f"{op}: conv_state.shape={tuple(pool.shape)}, expected 3-D")
    view = pool.transpose(1, 2) if ring else pool
    try:
        check_conv_args(c_like, ConvWeights(cw, dil, taps), StepMeta(qsl, view, slots, has_init, rejected), None, False)
    except (InvalidArgumentError, ArgumentTypeError) as e:
        layout = " (a ring pool is [S, L, C])" if ring else ""
        raise type(e)(f"{op}: {e}{layout}") from None
    channels, k = cw.shape
    problem = _factor_problem("conv_taps", taps, (k, channels), c_like.device)
    if problem:
        raise InvalidArgumentError(f"{op}: {problem}")
    if ring:
        raise InvalidArgumentError(
            f"{op}: state_offsets is {offsets.dtype} {tuple(offsets.shape)} on {offsets.device}, expected int64 "
            f"[S]=({pool.shape[0]},) on {pool.device}"
        )
    raise InvalidArgumentError(  # pragma: no cover - the checks above name every case of the fast pass
        f"{op}: the conv's arguments disagree: {_described(dict(conv_weight=cw, conv_state=pool, dilation=dil))}"
    )


def _check_gate_conv(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, cw, taps, dil, *rest, devices=True) -> None:
    check_gate_operator("gate_conv", key, value, hidden, nk, nq, nc, kq, cs, eps, hc, rest[7], devices=devices)
    check_conv_operator("gate_conv", hidden, cw, taps, dil, *rest[:7], devices=devices)


def _check_gate_stage(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, add_hidden, devices=True) -> None:
    check_gate_operator("gate_stage", key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, devices=devices)


def _check_ngram_gate(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, devices=True) -> None:
    check_gate_operator("ngram_gate", key, value, hidden, nk, nq, nc, kq, cs, eps, hc, None, devices=devices)


def _check_conv_stage(c, residual, cw, taps, dil, *rest, devices=True) -> None:
    if c.dim() != 2 or residual.shape != c.shape or residual.dtype != c.dtype or c.dtype not in _ACT_DTYPES:
        raise InvalidArgumentError(
            f"conv_stage: c is {c.dtype} {tuple(c.shape)}, residual {residual.dtype} {tuple(residual.shape)}; "
            "expected both [T, C] of one activation dtype (float16, bfloat16, float32)"
        )
    if devices and residual.device != c.device:
        raise InvalidArgumentError(
            f"conv_stage: c is {c.dtype} {tuple(c.shape)} on {c.device}, residual {residual.dtype} "
            f"{tuple(residual.shape)} on {residual.device}; expected both [T, C], one dtype, one device"
        )
    check_conv_operator("conv_stage", c, cw, taps, dil, *rest, devices=devices)


# ---------------------------------------------------------------------------------------------- kernels
# The operators' arguments become the twins' records here, once for every twin.


def _gate(nk, nq, nc, kq, cs, eps, hc) -> GateWeights:
    return GateWeights(nk, nq, nc, eps, hc, kq, cs)


def _step(qsl, pool, slots, has_init, rejected, offsets, ring) -> StepMeta:
    return StepMeta(qsl, pool, slots, has_init, rejected, offsets if ring else None)


def _gate_kernel(twin):
    """An ``ngram_gate`` kernel on the operator's arguments: ``twin()`` (a gate twin) on the record."""

    def ngram_gate(key, value, hidden, nk, nq, nc, kq, cs, eps, hc):
        return twin()(key, value, hidden, _gate(nk, nq, nc, kq, cs, eps, hc))

    return ngram_gate


def _conv_kernel(twin):
    """A ``dilated_conv`` kernel on the operator's arguments: ``twin()`` (a conv twin) on the records."""

    def dilated_conv(c, residual, cw, taps, dil, qsl, pool, slots, has_init, rejected, validate):
        step = StepMeta(qsl, pool, slots, has_init, rejected)
        return twin()(c, ConvWeights(cw, dil, taps), step, residual, validate=validate)

    return dilated_conv


def _fused_kernels(twins):
    """``gate_conv``, ``gate_stage`` and ``conv_stage`` kernels on the operators' arguments, running
    the functions of ``twins()`` (:mod:`.fused.reference` or a :class:`.fused.composed.Composed`)."""

    def gate_conv(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, cw, taps, dil, *rest):
        token_mask, add_hidden, _ = rest[7:]
        gate, conv, step = _gate(nk, nq, nc, kq, cs, eps, hc), ConvWeights(cw, dil, taps), _step(*rest[:7])
        options = dict(token_mask=token_mask, add_hidden=add_hidden, return_conv_input=True, validate=False)
        return twins().gate_conv(key, value, hidden, gate, conv, step, **options)

    def gate_stage(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, add_hidden):
        gate = _gate(nk, nq, nc, kq, cs, eps, hc)
        return twins().gate_stage(key, value, hidden, gate, token_mask=token_mask, add_hidden=add_hidden)

    def conv_stage(c, residual, cw, taps, dil, *step):
        return twins().conv_stage(c, residual, ConvWeights(cw, dil, taps), _step(*step), validate=False)

    return gate_conv, gate_stage, conv_stage


def _triton_gate():
    from ple.ops.gate import triton_impl

    return triton_impl.ngram_gate


def _triton_conv():
    from ple.ops.conv import triton_impl

    return triton_impl.dilated_conv


def _triton_norm(x, weight, group_size, eps):
    from ple.ops.norm import triton_impl

    return triton_impl.grouped_rms_norm(x, weight, group_size, eps)


def _native_ok(ref: torch.Tensor, pool: torch.Tensor, taps: int, *rows: torch.Tensor) -> bool:
    return native.unsupported_reason(ref, pool, taps, *rows) is None and _native.available()


def _mask(token_mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if token_mask is None else (token_mask != 0).contiguous()


def _gate_conv_native(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, cw, taps, dil, *rest):
    step = native.kernel_step(_step(*rest[:7]))
    token_mask, add_hidden, all_c = rest[7:]
    gate, conv = _gate(nk, nq, nc, kq, cs, eps, hc), ConvWeights(cw, dil, taps)
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    c = torch.empty_like(out)
    native.run(key, value, hidden, gate, conv, step, _mask(token_mask), add_hidden, None, None, out, c, all_c)
    return out, c


def _gate_stage_native(key, value, hidden, nk, nq, nc, kq, cs, eps, hc, token_mask, add_hidden):
    gate = _gate(nk, nq, nc, kq, cs, eps, hc)
    return native.gate_stage_unchecked(key, value, hidden, gate, _mask(token_mask), add_hidden)


def _conv_stage_native(c, residual, cw, taps, dil, *rest):
    step, conv = native.kernel_step(_step(*rest)), ConvWeights(cw, dil, taps)
    out = torch.empty_like(c, memory_format=torch.contiguous_format)
    native.run(None, None, None, None, conv, step, None, False, c.contiguous(), residual, out, None, False)
    return out


def _rows_like(t: torch.Tensor, *rest) -> torch.Tensor:
    return t.new_empty(t.shape)


def _two_like(key, value, hidden, *rest) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden.new_empty(hidden.shape), hidden.new_empty(hidden.shape)


_REFERENCE, _TORCH, _TRITON = (
    _fused_kernels(lambda: fused_reference),
    _fused_kernels(lambda: composed.TORCH),
    _fused_kernels(composed.triton),
)

register(
    "grouped_rms_norm(Tensor x, Tensor weight, int group_size, float eps) -> Tensor",
    reference=norm_reference.grouped_rms_norm,
    kernels=(
        Kernel("torch", "cpu", norm_torch.grouped_rms_norm),
        Kernel("triton", "cuda", _triton_norm, needs="triton"),
    ),
    fake=_rows_like,
)
register(
    f"ngram_gate(Tensor key, Tensor value, Tensor hidden, {_GATE}) -> (Tensor, Tensor)",
    reference=_gate_kernel(lambda: gate_reference.ngram_gate),
    kernels=(
        Kernel("torch", "cpu", _gate_kernel(lambda: gate_torch.ngram_gate)),
        Kernel("triton", "cuda", _gate_kernel(_triton_gate), needs="triton"),
    ),
    fake=_two_like,
    check=_check_ngram_gate,
)
register(
    f"dilated_conv(Tensor c, Tensor? residual, {_CONV}, Tensor query_start_loc, Tensor(a!) conv_state, "
    "Tensor state_indices, Tensor has_initial_state, Tensor? num_rejected, bool validate) -> Tensor",
    reference=_conv_kernel(lambda: conv_reference.dilated_conv),
    kernels=(
        Kernel("torch", "cpu", _conv_kernel(lambda: conv_torch.dilated_conv)),
        Kernel("triton", "cuda", _conv_kernel(_triton_conv), needs="triton"),
    ),
    fake=_rows_like,
)


def _register_fused(schema: str, i: int, native_fn: Callable, takes: Callable, check: Callable, fake: Callable) -> None:
    """A fused operator: the C kernel where it ``takes`` the tensors, else the PyTorch paths; Triton on CUDA."""
    register(
        schema,
        reference=_REFERENCE[i],
        kernels=(
            Kernel("native", "cpu", native_fn, takes=takes),
            Kernel("torch", "cpu", _TORCH[i]),
            Kernel("triton", "cuda", _TRITON[i], needs="triton"),
        ),
        fake=fake,
        check=check,
    )


_register_fused(
    f"gate_conv(Tensor key, Tensor value, Tensor hidden, {_GATE}, {_CONV}, {_STEP}, Tensor? token_mask, "
    "bool add_hidden, bool all_conv_inputs) -> (Tensor, Tensor)",
    0,
    _gate_conv_native,
    lambda key, value, hidden, *a: _native_ok(value, a[11], a[8].shape[0], key, hidden),
    _check_gate_conv,
    _two_like,
)
_register_fused(
    f"gate_stage(Tensor key, Tensor value, Tensor hidden, {_GATE}, Tensor? token_mask, bool add_hidden) "
    "-> (Tensor, Tensor)",
    1,
    _gate_stage_native,
    lambda key, value, hidden, *a: _native_ok(value, value.new_empty(1, 1, 1), 1, key, hidden),
    _check_gate_stage,
    _two_like,
)
_register_fused(
    f"conv_stage(Tensor c, Tensor residual, {_CONV}, {_STEP}) -> Tensor",
    2,
    _conv_stage_native,
    lambda c, residual, cw, taps, dil, qsl, pool, *a: _native_ok(c, pool, taps.shape[0], residual),
    _check_conv_stage,
    _rows_like,
)


# ---------------------------------------------------------------------------------------------- the operators on records


def _gate_args(gate: GateWeights) -> tuple:
    return (gate.norm_key, gate.norm_query, gate.norm_conv, gate.key_query, gate.conv_scale, gate.eps, gate.hc_count)


def _step_args(step: StepMeta) -> tuple:
    rejected = step.num_rejected
    if rejected is None:
        rejected = torch.zeros_like(step.state_indices)
    ring = step.state_offsets is not None
    offsets = step.state_offsets if ring else step.state_indices.new_empty(0)
    return (step.query_start_loc, step.conv_state, step.state_indices, step.has_initial_state, rejected, offsets, ring)


def _check_values(c_like: torch.Tensor, conv: ConvWeights, step: StepMeta, residual=None) -> None:
    """Index values of the step (offsets, slot range and uniqueness, ``num_rejected`` range): a host
    synchronization on an accelerator."""
    check_ring(step)
    check_conv_args(c_like, conv, engine_view(step), residual, True)


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """``torch.ops.ple.grouped_rms_norm``: ``x [..., C]`` with ``weight [C]`` over groups of
    ``group_size``, ``[..., C]`` in ``x.dtype``; see :func:`ple.ops.norm.reference.grouped_rms_norm`.
    A ``group_size`` that is not an int or an ``eps`` that is not a real number is refused with a
    ple error naming it (the operator's schema would raise a bare ``RuntimeError``)."""
    if type(group_size) is not int:
        raise ArgumentTypeError(f"grouped_rms_norm: group_size={group_size!r}, expected a positive int")
    if type(eps) not in (float, int):
        raise ArgumentTypeError(f"grouped_rms_norm: eps={eps!r}, expected a float")
    return torch.ops.ple.grouped_rms_norm(x, weight, group_size, eps)


def ngram_gate(
    key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor, gate: GateWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.ple.ngram_gate`` on a record: ``(v, c)``, both ``[T, HC*H]``, from ``key [T, HC*H]``,
    ``value [T, H]`` and the layer input ``hidden [T, HC*H]``; see :func:`ple.ops.gate.reference.ngram_gate`."""
    return torch.ops.ple.ngram_gate(key, value, hidden, *_gate_args(gate))


def dilated_conv(
    c: torch.Tensor, conv: ConvWeights, step: StepMeta, residual: torch.Tensor | None = None, *, validate: bool = True
) -> torch.Tensor:
    """``torch.ops.ple.dilated_conv`` on records: ``residual + silu(conv(c))`` ``[T, C]``; updates the
    pool ``[S, C, L]`` in place; see :func:`ple.ops.conv.reference.dilated_conv`."""
    s = step
    return torch.ops.ple.dilated_conv(
        c, residual, conv.weight, conv.taps, conv.dilation, s.query_start_loc, s.conv_state, s.state_indices,
        s.has_initial_state, s.num_rejected, validate,
    )  # fmt: skip


def gate_conv(
    key, value, hidden, gate, conv, step, *, token_mask=None, add_hidden=True, return_conv_input=False, validate=True
):
    """``torch.ops.ple.gate_conv`` on records: ``out [T, HC*H]``, or ``(out, c)`` with
    ``return_conv_input``; updates the state pool in place. See :func:`ple.ops.fused.reference.gate_conv`;
    ``validate`` checks the step's index values first (the operator checks shapes, dtypes and devices)."""
    if validate:
        _check_values(hidden, conv, step)
    out, c = torch.ops.ple.gate_conv(
        key, value, hidden, *_gate_args(gate), conv.weight, conv.taps, conv.dilation, *_step_args(step),
        token_mask, add_hidden, return_conv_input,
    )  # fmt: skip
    return (out, c) if return_conv_input else out


def gate_stage(key, value, hidden, gate, *, token_mask=None, add_hidden=True) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.ple.gate_stage`` on a record: ``(residual, c)``; see :func:`ple.ops.fused.reference.gate_stage`."""
    return torch.ops.ple.gate_stage(key, value, hidden, *_gate_args(gate), token_mask, add_hidden)


def conv_stage(
    c: torch.Tensor, residual: torch.Tensor, conv: ConvWeights, step: StepMeta, *, validate: bool = True
) -> torch.Tensor:
    """``torch.ops.ple.conv_stage`` on records: ``residual + silu(conv(c))``; see
    :func:`ple.ops.fused.reference.conv_stage` (``validate`` as in :func:`gate_conv`)."""
    if validate:
        _check_values(c, conv, step, residual)
    return torch.ops.ple.conv_stage(c, residual, conv.weight, conv.taps, conv.dilation, *_step_args(step))
