"""The row-sparse gradient of a table lookup, on every tier and format.

``rows = lookup(ids [T, G], dtype) -> [T, G*head_dim]`` reads row ``ids[t, g]`` into columns
``g*head_dim .. (g+1)*head_dim`` of row ``t``; its gradient with respect to the table is, for each
distinct id, the sum of the output gradients of the positions that read it, and zero for every other
row. That depends on the ids and the output gradient only, never on where the table lives or how
its rows are stored, so one autograd function serves every tier and format.

- :func:`table_parameter` makes the handle a table's gradient is attached to: an ``nn.Parameter``
  of the table's shape ``[rows, head_dim]`` fp32 whose values are one stored zero (stride 0,
  4 bytes), so the published table's handle costs nothing. It is the layer's ``table_weight``
  (see :meth:`ple.PLELayer.forward_padded`), deliberately not among ``module.parameters()``: a
  torch optimizer for the other weights never sees it.
- :func:`lookup_with_grad` is the lookup recorded for autograd: the table's own lookup forward; in
  backward the handle's gradient is a coalesced sparse COO tensor ``[rows, head_dim]`` fp32 holding
  the distinct ids read (sorted) and their summed gradients (:func:`row_sums`): never a table-sized
  tensor. Backward calls accumulate as autograd accumulates sparse gradients (uncoalesced sums,
  coalesced by whoever reads them).
- Fused: when the handle carries a ``ple_apply`` callable (a row-sparse optimizer of ``ple.train``
  fused into the backward), backward hands it ``(rows, values)`` and the handle gets no gradient at
  all.
- :func:`recorded_lookup` is the same lookup as one operator for compiled code,
  ``torch.ops.ple.table_lookup_grad(ids, table, handle, head_dim, dtype)`` (the table by its opaque
  :class:`~ple.table.base.TableRef`, so ``torch.compile(fullgraph=True)`` traces it whole). A sparse
  gradient cannot be an output of a traced backward, so its backward is the operator
  ``ple::table_grad_record(ids, grad, handle)``, a side effect the compiler keeps: the same rows and
  sums, handed to ``ple_apply`` or accumulated on ``handle.grad`` as autograd accumulates a sparse
  gradient. Autograd itself sees no gradient for the handle: ``loss.backward()`` gives it its
  gradient as eagerly, ``torch.autograd.grad(..., handle)`` does not (use the eager call for that).

Sums are taken in fp32 in position order (token-major, heads in order, as ``index_add_`` runs), so
they are exact where the terms are and reproducible on every CPU. Nothing here runs unless the
handle requires a gradient and grad mode is on: frozen and inference calls never reach it.
"""

from __future__ import annotations

import torch
from torch import nn

from ple.errors import InvalidArgumentError, UsageError
from ple.kernels.registry import OPERATORS
from ple.table.base import Table, TableRef, lookup_through

__all__ = ["table_parameter", "lookup_with_grad", "row_sums", "recorded_lookup", "RECORDED_LOOKUP"]


def table_parameter(rows: int, head_dim: int) -> nn.Parameter:
    """A gradient handle of shape ``[rows, head_dim]`` fp32 on the CPU, one stored zero (stride 0)."""
    for name, v in (("rows", rows), ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
    return nn.Parameter(torch.zeros((), dtype=torch.float32).expand(rows, head_dim))


def row_sums(ids: torch.Tensor, grad: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [U], values [U, head_dim])`` on the CPU: the distinct ``ids [T, G]`` sorted, and for each
    the fp32 sum of the ``grad [T, G*head_dim]`` slices of the positions that read it, in position order."""
    flat = ids.reshape(-1).cpu()
    g = grad.reshape(-1, head_dim).to(device="cpu", dtype=torch.float32)
    rows, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    values = torch.zeros(rows.numel(), head_dim, dtype=torch.float32).index_add_(0, inverse, g)
    return rows, values


class _SparseLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, table: Table, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return table.lookup(ids, dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        return None, _handle_gradient(ids, grad_out, ctx.weight), None, None


def _handle_gradient(ids: torch.Tensor, grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The handle's gradient of a lookup of ``ids`` whose output's gradient is ``grad_out``: the sparse
    COO tensor of :func:`row_sums`, or None once a fused optimizer (``weight.ple_apply``) applied it."""
    rows, values = row_sums(ids, grad_out, weight.shape[1])
    apply = getattr(weight, "ple_apply", None)
    if apply is not None:
        apply(rows, values)
        return None
    return torch.sparse_coo_tensor(
        rows.unsqueeze(0), values, tuple(weight.shape), is_coalesced=True, check_invariants=False
    )


def _check_handle(weight: torch.Tensor, table: Table) -> None:
    if tuple(weight.shape) != (table.rows, table.head_dim):
        raise InvalidArgumentError(
            f"the gradient handle is {list(weight.shape)}, the table [{table.rows}, {table.head_dim}]"
        )


def lookup_with_grad(table: Table, ids: torch.Tensor, dtype: torch.dtype, weight: nn.Parameter) -> torch.Tensor:
    """``table.lookup(ids [T, G], dtype)`` recorded for autograd: ``weight`` (from
    :func:`table_parameter`, the table's shape) receives the row-sparse gradient (see the module
    docstring)."""
    _check_handle(weight, table)
    return _SparseLookup.apply(ids, weight, table, dtype)


# ---------------------------------------------------------------------------------------------- operator

RECORDED_LOOKUP = "table_lookup" in OPERATORS
"""Whether :func:`recorded_lookup` exists (a torch with opaque reference types: 2.10 and later)."""

_REF = f"{TableRef.__module__}.TableRef"


def _lookup_grad(ids: torch.Tensor, table: TableRef, handle: torch.Tensor, head_dim: int, dtype: torch.dtype):
    if table.table is not None:
        _check_handle(handle, table.table)
    return lookup_through(ids, table, head_dim, dtype)  # refuses a reference holding no table


def _lookup_grad_fake(ids: torch.Tensor, table, handle: torch.Tensor, head_dim: int, dtype: torch.dtype):
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise InvalidArgumentError(f"table_lookup_grad: ids must be int64 [T, G], got {ids.dtype} {tuple(ids.shape)}")
    if handle.dim() != 2 or handle.shape[1] != head_dim:
        raise InvalidArgumentError(
            f"table_lookup_grad: the gradient handle is {list(handle.shape)}, rows {head_dim} wide"
        )
    return ids.new_empty((ids.shape[0], ids.shape[1] * head_dim), dtype=dtype)


def _record(ids: torch.Tensor, grad: torch.Tensor, handle: torch.Tensor) -> None:
    """The backward of ``table_lookup_grad``: the handle's gradient, accumulated as autograd would."""
    if not isinstance(handle, nn.Parameter):
        # a compiler that handed backward a copy or view of the handle: its gradient would be lost
        raise UsageError(
            f"table_grad_record: the gradient handle reached the backward as a {type(handle).__name__}, not the "
            "table's handle (nn.Parameter); this compiler cannot record the table's gradient: train eagerly"
        )
    g = _handle_gradient(ids, grad, handle)
    if g is not None:
        with torch.no_grad():
            handle.grad = g if handle.grad is None else handle.grad + g


def _setup(ctx, inputs, output) -> None:
    ids, _table, handle, _head_dim, _dtype = inputs
    ctx.save_for_backward(ids, handle)


def _backward(ctx, grad: torch.Tensor):
    ids, handle = ctx.saved_tensors
    torch.ops.ple.table_grad_record(ids, grad, handle)
    return None, None, None, None, None


if RECORDED_LOOKUP:
    _op = torch.library.custom_op(
        "ple::table_lookup_grad",
        mutates_args=(),
        schema=f"(Tensor ids, {_REF} table, Tensor handle, int head_dim, ScalarType dtype) -> Tensor",
    )(_lookup_grad)
    _op.register_fake(_lookup_grad_fake)
    _op.register_autograd(_backward, setup_context=_setup)
    _rec = torch.library.custom_op(
        "ple::table_grad_record", mutates_args=(), schema="(Tensor ids, Tensor grad, Tensor handle) -> ()"
    )(_record)
    _rec.register_fake(lambda ids, grad, handle: None)
    torch.fx.node.has_side_effect(torch.ops.ple.table_grad_record.default)  # no output: kept all the same


def recorded_lookup(
    ids: torch.Tensor, table: TableRef, handle: nn.Parameter, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """``torch.ops.ple.table_lookup_grad``: the referenced table's lookup of ``ids [T, G]`` whose backward
    gives ``handle`` the row-sparse gradient of :func:`lookup_with_grad` (see the module docstring)."""
    if not RECORDED_LOOKUP:
        raise UsageError("recorded_lookup needs a torch with opaque reference types (2.10 or later)")
    return torch.ops.ple.table_lookup_grad(ids, table, handle, head_dim, dtype)
