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

Sums are taken in fp32 in position order (token-major, heads in order, as ``index_add_`` runs), so
they are exact where the terms are and reproducible on every CPU. Nothing here runs unless the
handle requires a gradient and grad mode is on: frozen and inference calls never reach it.
"""

from __future__ import annotations

import torch
from torch import nn

from ple.errors import InvalidArgumentError
from ple.table.base import Table

__all__ = ["table_parameter", "lookup_with_grad", "row_sums"]


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
        weight = ctx.weight
        rows, values = row_sums(ids, grad_out, weight.shape[1])
        apply = getattr(weight, "ple_apply", None)
        if apply is not None:
            apply(rows, values)
            return None, None, None, None
        grad = torch.sparse_coo_tensor(
            rows.unsqueeze(0), values, tuple(weight.shape), is_coalesced=True, check_invariants=False
        )
        return None, grad, None, None


def lookup_with_grad(table: Table, ids: torch.Tensor, dtype: torch.dtype, weight: nn.Parameter) -> torch.Tensor:
    """``table.lookup(ids [T, G], dtype)`` recorded for autograd: ``weight`` (from
    :func:`table_parameter`, the table's shape) receives the row-sparse gradient (see the module
    docstring)."""
    if tuple(weight.shape) != (table.rows, table.head_dim):
        raise InvalidArgumentError(
            f"the gradient handle is {list(weight.shape)}, the table [{table.rows}, {table.head_dim}]"
        )
    return _SparseLookup.apply(ids, weight, table, dtype)
