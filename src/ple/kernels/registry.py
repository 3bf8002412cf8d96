"""The ``torch.ops.ple`` operators, each registered once: schema, reference, kernel per device, fake.

Every operation of the layer's hot path is one operator of the ``ple`` library, registered by the
module that owns its computation (``ple.ngram``: ``ngram_ids``; ``ple.table.base``:
``table_lookup``; ``ple.ops.library``: the norm, the gate, the conv and the fused step) through
:func:`register`, which keeps the entry in :data:`OPERATORS`::

    OPERATORS["gate_conv"] = Operator(
        name="gate_conv", schema="gate_conv(Tensor key, ...) -> (Tensor, Tensor)",
        reference=<the literal definition>, check=<shapes, dtypes, devices>, fake=<output shapes>,
        kernels=(Kernel("native", "cpu", ..., takes=...), Kernel("torch", "cpu", ...), Kernel("triton", "cuda", ...)),
    )

Every kernel and the reference take the operator's arguments as its schema lists them. A device's
function, the one the dispatcher calls (:meth:`Operator.on` gives it to Python callers that skip the
dispatcher), is ``check`` and then the device's first kernel whose ``takes`` accepts the arguments
(the last kernel of a device takes everything). The operators are not differentiable: their outputs never
require grad (the ``Autograd`` key falls through), as the inference-only engine call that runs them
needs; the training path (:meth:`ple.PLELayer.forward_padded`) runs differentiable PyTorch code (compiled,
its trainable table's lookup is ``ple::table_lookup_grad`` of :mod:`ple.table.grad`, a differentiable
operator outside this registry). Registration uses the low-level ``Library.define`` +
``impl`` per device, which dispatches in a few microseconds (``torch.library.custom_op`` costs
15-25 us a call, too much for a decode step); no other Python layer is added per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ple.errors import InvalidArgumentError

__all__ = ["DEVICES", "Kernel", "OPERATORS", "Operator", "register"]

DEVICES = ("cpu", "cuda")
"""The devices the operators have kernels for (the dispatch keys ``CPU`` and ``CUDA``)."""

_LIB = torch.library.Library("ple", "FRAGMENT")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One implementation of an operator on one device.

    Attributes:
        name: what it is (``"native"``: the C kernel, ``"torch"``, ``"triton"``, ...).
        device: ``"cpu"`` or ``"cuda"``.
        fn: the implementation, called with the operator's arguments (checked).
        takes: whether it takes these arguments (the C kernel: some dtypes and layouts); None: all.
        needs: the package it needs besides torch (``"triton"``), or None.
    """

    name: str
    device: str
    fn: Callable[..., Any]
    takes: Callable[..., bool] | None = None
    needs: str | None = None


@dataclasses.dataclass(frozen=True)
class Operator:
    """A registered ``torch.ops.ple`` operator (see the module docstring)."""

    name: str
    schema: str
    reference: Callable[..., Any]
    kernels: tuple[Kernel, ...]
    fake: Callable[..., Any]
    check: Callable[..., None] | None
    impls: dict[str, Callable[..., Any]]
    kernel_impls: dict[str, Callable[..., Any]]

    def on(self, device: torch.device) -> Callable[..., Any]:
        """The function the dispatcher runs for tensors on ``device``: checks, then the kernel."""
        impl = self.impls.get(device.type)
        if impl is None:
            raise InvalidArgumentError(
                f"{self.name}: tensors on {device}, expected one of {', '.join(DEVICES)} (the operator's kernels)"
            )
        return impl

    def kernel_on(self, device: torch.device) -> Callable[..., Any]:
        """:meth:`on` without the check: the kernel it would choose for these arguments. Only for a
        caller that built every operand itself from checked inputs (``ple.Session``'s steps)."""
        impl = self.kernel_impls.get(device.type)
        return self.on(device) if impl is None else impl  # on() raises for a device without kernels


OPERATORS: dict[str, Operator] = {}
"""Every registered operator by name (``ple.ngram``, ``ple.table`` and ``ple.ops`` register theirs on import)."""


def register(
    schema: str,
    *,
    reference: Callable[..., Any],
    kernels: tuple[Kernel, ...],
    fake: Callable[..., Any],
    check: Callable[..., None] | None = None,
) -> Operator:
    """Define ``ple::<name>`` from ``schema``, register each device's function and ``fake``, and
    record the operator in :data:`OPERATORS`.

    ``check(*args, devices=...)`` runs before the kernel (``devices=False`` on the CPU, where every
    tensor argument is on the CPU). Each device has one or two kernels; with two, the first says
    what it ``takes`` and the second takes the rest.
    """
    name = schema.split("(", 1)[0]
    if name in OPERATORS:
        raise InvalidArgumentError(f"operator ple::{name} is registered twice")
    impls, kernel_impls = {}, {}
    for device in DEVICES:
        mine = tuple(k for k in kernels if k.device == device)
        if not mine:
            continue
        if len(mine) > 2 or mine[-1].takes is not None or (len(mine) == 2 and mine[0].takes is None):
            raise InvalidArgumentError(
                f"ple::{name} on {device}: expected a kernel that takes everything, after at most one that "
                f"takes some arguments; got {[k.name for k in mine]}"
            )
        impls[device] = _device_function(mine, check, device != "cpu")
        kernel_impls[device] = _device_function(mine, None, device != "cpu")
    _LIB.define(schema)
    for device, impl in impls.items():
        _LIB.impl(name, impl, device.upper())
    # not differentiable: the outputs carry no gradient, whatever their inputs (no autograd warning, and
    # tracing with inputs that require grad records no backward through the operator)
    _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"ple::{name}", _one_device_fake(name, schema, fake), lib=_LIB)
    op = Operator(name, schema, reference, tuple(kernels), fake, check, impls, kernel_impls)
    OPERATORS[name] = op
    return op


def _parameter_names(schema: str) -> list[str]:
    """The names of a schema's parameters, in order (``"f(Tensor x, int n=1) -> Tensor"``: x, n)."""
    inside = schema[schema.index("(") + 1 : schema.rindex(") ->")]
    return [p.split("=", 1)[0].split()[-1] for p in inside.split(", ")]


def _one_device_fake(name: str, schema: str, fake: Callable[..., Any]) -> Callable[..., Any]:
    """``fake`` behind a check of the tensors' devices.

    The dispatcher runs the fake (the ``Meta`` kernel) whenever one tensor argument is on the meta
    device, even when the others are on the CPU: it would return tensors of no meaning on the CPU, or
    leave an output it should write untouched. Meta tensors beside tensors on a real device are
    refused, naming each tensor's device. While tracing (fake tensors report their real devices)
    and for tensors all on meta (shapes only) the fake runs."""
    names = _parameter_names(schema)

    def checked_fake(*args, **kwargs):
        named = [(n, a) for n, a in zip(names, args)] + list(kwargs.items())
        tensors = [(n, a) for n, a in named if isinstance(a, torch.Tensor)]
        devices = {a.device.type for _, a in tensors}
        if "meta" in devices and len(devices) > 1:
            where = ", ".join(f"{n} on {a.device}" for n, a in tensors)
            raise InvalidArgumentError(
                f"{name}: operands on different devices ({where}): every tensor must be on one device "
                "(tensors on the meta device hold no data to compute with)"
            )
        return fake(*args, **kwargs)

    return checked_fake


def _device_function(kernels: tuple[Kernel, ...], check, devices: bool) -> Callable[..., Any]:
    general = kernels[-1].fn
    if len(kernels) == 1:
        if check is None:
            return general

        def checked(*args):
            check(*args, devices=devices)
            return general(*args)

        return checked
    special, takes = kernels[0].fn, kernels[0].takes
    assert takes is not None

    def chosen(*args):
        if check is not None:
            check(*args, devices=devices)
        return special(*args) if takes(*args) else general(*args)

    return chosen
