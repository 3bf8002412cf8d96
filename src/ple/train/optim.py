"""Row-sparse optimizers for PLE tables: state only for the rows ever touched.

Each optimizer takes the gradient handles of :func:`ple.train.trainable` (any other tensor is
refused: give the model's other weights to a torch optimizer) and, per step, for each table: the
rows of its sparse gradient (coalesced: distinct rows, summed values), their trained values from the
table's overlay (a row not there yet starts from the base's fp32 lookup of it), their states, the
update, and both written back. Nothing table-sized is ever made.

Lazy semantics (those ``torch.optim.SparseAdam`` documents): a step changes only the rows in its
gradient, and only their states; a row's states are created (zeros; Adagrad's sum at
``initial_accumulator_value``) the first time it is in a gradient. The step count (bias
corrections, Adagrad's ``lr_decay``) is the table's: one per step that had a gradient for it, as
torch counts per parameter. Weight decay, where an optimizer has it, acts on the rows of the step's
gradient only: a row the step does not read is not decayed (dense ``torch.optim`` optimizers decay
every row every step).

Every update is written with the torch operations of the torch optimizer it follows, in the same
order, on the rows of the step: :class:`SparseAdam` is ``torch.optim.SparseAdam``; :class:`SGD`
(no momentum), :class:`Adagrad`, :class:`Adam` and :class:`AdamW` are ``torch.optim.SGD``,
``Adagrad``, ``Adam`` and ``AdamW`` (single-tensor, no amsgrad) applied to the rows of the step;
:class:`RowWiseAdagrad` keeps one fp32 state per row (the mean of the squared gradient, summed
over steps), as FBGEMM's exact row-wise Adagrad does.

State memory: ``memory_budget`` bytes of states per table in memory (None: all), those of the rows
used most recently; the others spill to an unnamed file in ``spill_dir`` (default: the folder of the
table's file) and come back when their rows are in a step again
(:class:`~ple.table.tiers.rowstore.SlotStore`). Where a state lives never changes its value. The spill
files' space is allocated before a step changes anything: a step that finds no room raises
:class:`~ple.table.tiers.rowstore.SpillFileError` (naming the folder) with every row, state and step count
as before it and its gradient still on the handle, so once there is room ``step()`` runs again.

Fused: ``fused=True`` applies each table's update inside ``backward()`` as its gradient is
computed (FBGEMM's fused backward): no gradient is stored on the handle and :meth:`step` has
nothing left to do for it. Every backward through a table is then one step of it.
"""

from __future__ import annotations

import math
import numbers
import os
import weakref
from collections import OrderedDict, defaultdict
from typing import Any

import torch

from ple.errors import ArgumentTypeError, InvalidArgumentError
from ple.table.tiers.rowstore import RowMap, SlotStore
from ple.train.attach import default_spill_dir, target_of
from ple.train.data_parallel import TableStep, group_of, mean_gradients, table_marker

__all__ = ["RowSparseOptimizer", "SGD", "Adagrad", "RowWiseAdagrad", "SparseAdam", "Adam", "AdamW", "CombinedOptimizer"]


class _RowStates:
    """An optimizer's states of one table: ``width`` fp32 values per row ever touched."""

    def __init__(self, width: int, initial: float, memory_budget: int | None, spill_dir) -> None:
        self.initial = initial
        self.map = RowMap()
        self.store = SlotStore(
            width, torch.float32, memory_budget=memory_budget, spill_dir=spill_dir, what="optimizer states of a table"
        )

    def __len__(self) -> int:
        return len(self.map)

    def slots_for(self, ids: torch.Tensor) -> torch.Tensor:
        slots = self.map.slots_of(ids)
        missing = (slots < 0).nonzero().squeeze(1)
        if missing.numel():
            new = self.store.append(torch.full((missing.numel(), self.store.width), self.initial))
            self.map.add(ids[missing], new)
            slots[missing] = new
        return slots

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [n] sorted, values [n, width])``."""
        return self.map.keys.clone(), self.store.read(self.map.slots)

    def load(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        self.map = RowMap()
        self.store.close()
        order = torch.argsort(ids)
        slots = self.store.append(values[order].to(torch.float32))
        self.map.add(ids[order].to(torch.int64), slots)


class _Fused:
    """The ``ple_apply`` a fused optimizer puts on a handle: the update, run by the lookup's backward."""

    def __init__(self, optimizer: RowSparseOptimizer, param: torch.Tensor) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._param = weakref.ref(param)

    def __call__(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        opt, param = self._optimizer(), self._param()
        if opt is None or param is None:
            raise InvalidArgumentError("the fused optimizer of this table was deleted; call ple.train.unfuse(model)")
        opt._apply(param, rows, values, opt._group_of(param))


class RowSparseOptimizer(torch.optim.Optimizer):
    """The common part of the row-sparse optimizers (see the module docstring).

    Subclasses set ``value_states`` (states of ``head_dim`` values per row), ``row_states`` (single
    values per row), ``initial_state`` and :meth:`_update`.
    """

    value_states = 0
    row_states = 0
    initial_state = 0.0
    exchanged_nbytes = 0
    """Bytes this rank received in data-parallel exchanges of the tables' gradients (:mod:`.data_parallel`)."""
    hyperparameters: dict[str, str] = {}
    """Each hyperparameter's rule: ``"positive"`` (a finite number > 0), ``"nonnegative"`` (>= 0) or
    ``"betas"`` (two numbers in [0, 1)); the constructor's arguments, every parameter group's values
    and a loaded state's are checked by it (:meth:`check_hyperparameters`)."""
    squared_states: tuple[int, int] | None = None
    """The states that are sums or averages of squares, ``(first, last + 1)`` in units of ``head_dim``
    (row states after the value states count as one unit): a loaded state must have them >= 0."""

    def __init__(
        self,
        params,
        defaults: dict[str, Any],
        *,
        memory_budget: int | None = None,
        spill_dir: str | os.PathLike | None = None,
        fused: bool = False,
    ) -> None:
        if memory_budget is not None and (
            isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 0
        ):
            raise InvalidArgumentError(f"memory_budget must be an int >= 0 (bytes) or None, got {memory_budget!r}")
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise ArgumentTypeError(f"spill_dir must be a folder's path or None, got {spill_dir!r}")
        if not isinstance(fused, bool):
            raise ArgumentTypeError(f"fused must be True or False, got {fused!r}")
        defaults = {**defaults, **self.check_hyperparameters(defaults)}
        if isinstance(params, torch.Tensor):
            raise ArgumentTypeError(
                "params must be an iterable of table handles (ple.train.trainable(model)) or of parameter "
                f"groups, got one tensor of shape {list(params.shape)}"
            )
        try:
            super().__init__(params, defaults)
        except TypeError as e:
            raise ArgumentTypeError(f"params: {e}") from None
        except ValueError as e:
            raise InvalidArgumentError(f"params: {e}") from None
        for k, group in enumerate(self.param_groups):
            group.update(self.check_hyperparameters(group, f"parameter group {k}: "))
            for p in group["params"]:
                target_of(p)
        self.memory_budget = memory_budget
        self.spill_dir = spill_dir
        self.fused = fused
        self._states: dict[torch.Tensor, _RowStates] = {}
        self._checked: dict[torch.Tensor, tuple] = {}
        """Per data-parallel table: its overlay and base (and the overlay's version) after this optimizer's
        last step of it, which the ranks checked; anything else asks for a full check (:mod:`.data_parallel`)."""
        if self.fused:
            for group in self.param_groups:
                for p in group["params"]:
                    p.ple_apply = _Fused(self, p)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """Apply each table's gradient (and clear it: the gradient is used up). Fused tables were
        updated in their backward already. A step that raises (a full spill disk:
        :class:`~ple.table.tiers.rowstore.SpillFileError`, raised before the table's rows or states change)
        leaves the gradients of the tables it did not update on their handles: make room and call
        ``step()`` again."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        taken = [(p, p.grad) for group in self.param_groups for p in group["params"] if p.grad is not None]
        updated: set[int] = set()
        try:
            plain, averaged = self._take_gradients()
            for p, rows, values, group in plain:
                self._apply(p, rows, values, group)
                updated.add(id(p))
            if averaged:
                for p, rows, values, group in self._mean_over_ranks(averaged):
                    self._apply(p, rows, values, group, averaged=True)
                    updated.add(id(p))
                for p, *_ in averaged:
                    self._checked[p] = table_marker(target_of(p))
        except BaseException:
            for p, grad in taken:
                if id(p) not in updated and p.grad is None:
                    p.grad = grad
            raise
        return loss

    def _take_gradients(self) -> tuple[list, list]:
        """The step's gradients ``(handle, rows, values, group)``, taken off the handles: those applied as
        they are, and those of tables averaged over data-parallel ranks (every such table, with no rows
        where this rank has no gradient: the ranks exchange at every step together)."""
        plain, averaged = [], []
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                dp = group_of(target_of(p))
                if grad is None:
                    if dp is not None:
                        averaged.append((p, torch.empty(0, dtype=torch.int64), torch.empty(0, p.shape[1]), group, dp))
                    continue
                if not grad.is_sparse:
                    raise InvalidArgumentError(
                        f"a table handle's gradient must be row-sparse (from the layer's lookup), got a {grad.layout} one"
                    )
                grad = grad.coalesce()
                p.grad = None
                item = (p, grad.indices()[0], grad.values().to(torch.float32), group)
                if dp is None:
                    plain.append(item)
                else:
                    averaged.append((*item, dp))
        return plain, averaged

    def _mean_over_ranks(self, averaged: list) -> list:
        """The ranks' mean gradient of each table of ``averaged`` (one exchange per process group, in
        order of first appearance: the same on every rank); tables no rank had a gradient for are left
        out (no step for them). Adds the bytes this rank received to ``self.exchanged_nbytes``."""
        out = []
        groups: list = []
        for *_, dp in averaged:
            if not any(dp is g for g in groups):
                groups.append(dp)
        for dp in groups:
            mine = [a for a in averaged if a[4] is dp]
            items = []
            for p, rows, values, group, _dp in mine:
                target = target_of(p)
                steps = int(self.state[p].get("step", 0)) if p in self.state else 0
                check = self._checked.get(p) != table_marker(target)
                states = self._states.get(p)
                export = states.export if states is not None else lambda: None
                items.append(TableStep(target, steps, rows, values, self.describe(group), check, export))
            means, exchange = mean_gradients(dp, items)
            self.exchanged_nbytes += exchange.received
            for (p, _r, _v, group, _dp), (rows, values) in zip(mine, means, strict=True):
                if rows.numel():
                    out.append((p, rows, values, group))
        return out

    def describe(self, group: dict[str, Any]) -> str:
        """What decides this optimizer's update of a table of ``group``: its class and hyperparameters."""
        values = [f"{name}={group[name]!r}" for name in self.hyperparameters]
        if self.initial_state:
            values.append(f"initial_state={self.initial_state!r}")
        return f"{type(self).__name__}({', '.join(values)})"

    def unfuse(self) -> None:
        """Stop applying updates in the backward (gradients are stored on the handles again)."""
        for group in self.param_groups:
            for p in group["params"]:
                if isinstance(getattr(p, "ple_apply", None), _Fused):
                    del p.ple_apply
        self.fused = False

    def _group_of(self, param: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise InvalidArgumentError("this table handle is not one of the optimizer's")

    def _row_states(self, p: torch.Tensor, base) -> _RowStates | None:
        width = self.value_states * p.shape[1] + self.row_states
        if width == 0:
            return None
        rs = self._states.get(p)
        if rs is None:
            spill = self.spill_dir if self.spill_dir is not None else default_spill_dir(base)
            rs = self._states[p] = _RowStates(width, self.initial_state, self.memory_budget, spill)
        return rs

    def _apply(
        self, p: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, group: dict, averaged: bool = False
    ) -> None:
        """One step of table ``p`` with the gradient ``values [U, head_dim]`` of its distinct ``rows [U]``
        (sorted); ``averaged``: already the data-parallel ranks' mean (:mod:`.data_parallel`)."""
        target = target_of(p)
        if not averaged:
            rows, values = target.gradient(rows, values)
        state = self.state[p]
        step = int(state.get("step", 0)) + 1
        for part in target.parts():
            a = int(torch.searchsorted(rows, part.start))
            b = int(torch.searchsorted(rows, part.stop))
            if a == b:
                continue
            ids = rows[a:b] - part.start
            g = values[a:b]
            base = part.base

            def first_values(new: torch.Tensor, base=base) -> torch.Tensor:
                return base.lookup(new.view(-1, 1), torch.float32)

            rs = self._row_states(p, base)
            overlay = part.overlay
            with overlay.lock:
                overlay.reserve(ids.numel())  # a full spill disk fails here, before any row or state changes
                if rs is not None:
                    rs.store.reserve(rs.store.count + ids.numel())
                slots = overlay.slots_for(ids, first_values)
                w = overlay.read(slots)
                if rs is None:
                    w, _ = self._update(w, g, None, step, group)
                else:
                    s_slots = rs.slots_for(ids)
                    w, s = self._update(w, g, rs.store.read(s_slots), step, group)
                    assert s is not None
                    rs.store.write(s_slots, s)
                overlay.write(slots, w)
                overlay.version += 1
        state["step"] = step

    def _update(
        self, w: torch.Tensor, g: torch.Tensor, s: torch.Tensor | None, step: int, group: dict
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new ``(rows [k, D], states [k, width])`` of rows ``w`` with gradient ``g`` (fp32)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ measures and state
    def row_state(self, p: torch.Tensor) -> _RowStates | None:
        """The per-row states of table ``p`` (None before its first step, or for an optimizer without any)."""
        return self._states.get(p)

    def state_rows(self, p: torch.Tensor) -> int:
        """Rows of table ``p`` that have states."""
        rs = self._states.get(p)
        return 0 if rs is None else len(rs)

    def state_nbytes(self) -> tuple[int, int]:
        """Bytes of states ``(in memory, spilled)`` over every table."""
        mem = sum(rs.store.memory_nbytes + 16 * len(rs) for rs in self._states.values())
        spilled = sum(rs.store.spilled_slots * rs.store.record_nbytes for rs in self._states.values())
        return mem, spilled

    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state``, ``param_groups``); a table's state holds ``step``, and ``rows``
        (``[n]`` ids of the table, or of the rank's rows) with their states ``values [n, width]``."""
        sd = super().state_dict()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                rs = self._states.get(p)
                if rs is not None:
                    rows, values = rs.export()
                    sd["state"].setdefault(index, {})
                    sd["state"][index]["rows"] = rows
                    sd["state"][index]["values"] = values
                index += 1
        return sd

    def check_hyperparameters(self, group: dict[str, Any], where: str = "") -> dict[str, Any]:
        """The hyperparameters of ``group`` (a constructor's defaults, a parameter group, a saved
        one) checked by the rules of :attr:`hyperparameters` (numbers as floats, betas as a tuple);
        :class:`InvalidArgumentError` or :class:`ArgumentTypeError` naming ``where``, the field and
        the value. Fields without a rule are returned as they are."""
        out = {}
        for name, rule in self.hyperparameters.items():
            if name not in group:
                raise InvalidArgumentError(f"{where}hyperparameter {name!r} is missing")
            value = group[name]
            out[name] = _check_betas(value, where) if rule == "betas" else _number(name, value, rule, where)
        return out

    def _check_loaded(self, state_dict: Any) -> None:
        """Refuse a state that is not one of this optimizer's: hyperparameters as the constructor checks
        them, step counts, and per-row states of the right shape, finite, for distinct rows of the
        table (nothing changes before every check has passed)."""
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
            raise InvalidArgumentError("an optimizer state must be a dict with 'state' (a dict) and 'param_groups'")
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise InvalidArgumentError(
                f"param_groups must be a list of {len(self.param_groups)} parameter groups, got {short_repr(groups)}"
            )
        handles: dict[Any, torch.Tensor] = {}
        for k, (saved, group) in enumerate(zip(groups, self.param_groups, strict=True)):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
                raise InvalidArgumentError(
                    f"parameter group {k} must be a dict with 'params' (a list), got {short_repr(saved)}"
                )
            if len(saved["params"]) != len(group["params"]):
                raise InvalidArgumentError(
                    f"parameter group {k} holds {len(saved['params'])} tables, the optimizer's {len(group['params'])}"
                )
            self.check_hyperparameters(saved, f"parameter group {k}: ")
            handles.update(zip(saved["params"], group["params"], strict=True))
        for key, st in state_dict["state"].items():
            where = f"the state of table {key!r}"
            if key not in handles:
                raise InvalidArgumentError(f"{where}: no parameter group holds table {key!r}")
            if not isinstance(st, dict):
                raise InvalidArgumentError(f"{where} must be a dict, got {short_repr(st)}")
            if "step" in st:
                check_step(st["step"], where)
            if ("rows" in st) != ("values" in st):
                raise InvalidArgumentError(f"{where}: 'rows' and 'values' come together")
            if "rows" in st:
                self.check_row_states(handles[key], st["rows"], st["values"], where)

    def check_row_states(self, p: torch.Tensor, ids: Any, values: Any, where: str) -> None:
        """Refuse per-row states ``values [n, width]`` of rows ``ids [n]`` of table ``p`` that this
        optimizer cannot take: not the right shape, rows repeated or outside the table (this process's
        part of it), a state that is not finite, a sum of squares below 0; the error names ``where``."""
        parts = target_of(p).parts()
        rows = parts[0].overlay.rows if parts else 0
        d = p.shape[1]
        width = self.value_states * d + self.row_states
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(f"{where}: rows must be a 1-D int64 tensor of row ids, got {short_repr(ids)}")
        n = ids.numel()
        if not isinstance(values, torch.Tensor) or not values.is_floating_point() or tuple(values.shape) != (n, width):
            raise InvalidArgumentError(
                f"{where}: values {short_repr(values)} for {n} rows, expected a float tensor [{n}, {width}]"
            )
        if n and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise InvalidArgumentError(f"{where}: row ids {int(ids.min())}..{int(ids.max())} outside [0, {rows})")
        if n > 1 and int(torch.unique(ids).numel()) != n:
            raise InvalidArgumentError(f"{where}: row ids repeat")
        states = values.to(torch.float32)
        bad = ~torch.isfinite(states)
        if bool(bad.any()):
            r, c = (int(x) for x in bad.nonzero()[0])
            raise InvalidArgumentError(f"{where}: the state of row {int(ids[r])} is {float(values[r, c])} (column {c})")
        if self.squared_states is not None:
            a, b = self.squared_states
            cols = states[:, a * d : min(b * d, width)]
            if bool((cols < 0).any()):
                r, c = (int(x) for x in (cols < 0).nonzero()[0])
                raise InvalidArgumentError(
                    f"{where}: the state of row {int(ids[r])} is {float(cols[r, c])} (column {a * d + c}), "
                    "a sum of squares must be >= 0"
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_loaded(state_dict)
        self._checked.clear()  # data-parallel ranks check what they loaded at the next step
        rows_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        plain = {"param_groups": state_dict["param_groups"], "state": {}}
        for k, st in state_dict["state"].items():
            st = dict(st)
            if "rows" in st:
                rows_of[int(k)] = (st.pop("rows"), st.pop("values"))
            plain["state"][k] = st
        super().load_state_dict(plain)
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if "step" in st:
                    st["step"] = int(st["step"])
                if index in rows_of:
                    ids, values = rows_of[index]
                    part = target_of(p).parts()
                    rs = self._row_states(p, part[0].base if part else None)
                    assert rs is not None
                    rs.load(ids, values)
                index += 1

    def close(self) -> None:
        """Drop every state (and spill file)."""
        for rs in self._states.values():
            rs.store.close()
        self._states.clear()


def short_repr(value: Any) -> str:
    """``value`` in a message: a tensor by its shape and dtype, anything else by a bounded repr."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_step(value: Any, where: str) -> int:
    """A saved step count as an int when it is an integer >= 0 (an int, an integral float, a
    one-element tensor); :class:`InvalidArgumentError` naming ``where`` and the value otherwise."""
    step = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    x = float(step) if isinstance(step, numbers.Real) and not isinstance(step, bool) else -1.0
    if not math.isfinite(x) or x < 0 or x != math.floor(x):
        raise InvalidArgumentError(f"{where}: step must be an integer >= 0, got {short_repr(value)}")
    return int(x)


def _number(name: str, value: Any, rule: str, where: str = "") -> float:
    """``value`` as a float when it is a finite real number that ``rule`` allows (``"positive"``:
    > 0; ``"nonnegative"``: >= 0); a ple error naming ``name`` and the value otherwise."""
    want = "> 0" if rule == "positive" else ">= 0"
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{where}{name} must be a finite number {want}, got {short_repr(value)}")
    x = float(value)
    if not math.isfinite(x) or x < 0 or (rule == "positive" and x == 0):
        raise InvalidArgumentError(f"{where}{name} must be a finite number {want}, got {short_repr(value)}")
    return x


def _check_betas(betas: Any, where: str = "") -> tuple[float, float]:
    """``betas`` as two floats in [0, 1) (torch's rule), else a ple error naming the value."""
    if isinstance(betas, torch.Tensor) or not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise InvalidArgumentError(f"{where}betas must be two numbers in [0, 1), got {short_repr(betas)}")
    try:
        b1, b2 = (_number(f"betas[{k}]", b, "nonnegative", where) for k, b in enumerate(betas))
    except (InvalidArgumentError, ArgumentTypeError):
        b1 = b2 = math.nan
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise InvalidArgumentError(f"{where}betas must lie in [0, 1), got {short_repr(betas)}")
    return b1, b2


class SGD(RowSparseOptimizer):
    """``w -= lr * (g + weight_decay * w)`` on the rows of the step (``torch.optim.SGD`` without
    momentum, weight decay on those rows only). No state."""

    hyperparameters = {"lr": "nonnegative", "weight_decay": "nonnegative"}

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0, **kw) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay}, **kw)

    def _update(self, w, g, s, step, group):
        lr, wd = group["lr"], group["weight_decay"]
        if wd != 0:
            g = g.add(w, alpha=wd)
        w.add_(g, alpha=-lr)
        return w, None


class Adagrad(RowSparseOptimizer):
    """``torch.optim.Adagrad`` on the rows of the step: one sum of squared gradients per value
    (starting at ``initial_accumulator_value``), ``lr / (1 + (step - 1) * lr_decay)``, weight decay
    (L2, added to the gradient) on those rows only. ``eps`` must be > 0 (torch allows 0, which makes
    a row whose gradient and sum are 0, a padded position's, 0 / 0)."""

    value_states = 1
    squared_states = (0, 1)
    hyperparameters = {"lr": "nonnegative", "lr_decay": "nonnegative", "weight_decay": "nonnegative", "eps": "positive"}

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        **kw,
    ) -> None:
        initial = _number("initial_accumulator_value", initial_accumulator_value, "nonnegative")
        defaults = {"lr": lr, "lr_decay": lr_decay, "weight_decay": weight_decay, "eps": eps}
        super().__init__(params, defaults, **kw)
        self.initial_state = initial

    def _update(self, w, g, s, step, group):
        if group["weight_decay"] != 0:
            g = g.add(w, alpha=group["weight_decay"])
        clr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
        s.addcmul_(g, g, value=1)
        std = s.sqrt().add_(group["eps"])
        w.addcdiv_(g, std, value=-clr)
        return w, s


class RowWiseAdagrad(RowSparseOptimizer):
    """Adagrad with one fp32 state per row (FBGEMM's exact row-wise Adagrad): ``s += mean(g**2)``
    over the row, ``w -= lr * g / (sqrt(s) + eps)``; weight decay (L2) on the rows of the step.
    A 160-wide row's state is 4 bytes instead of Adagrad's 640."""

    row_states = 1
    squared_states = (0, 1)
    hyperparameters = {"lr": "nonnegative", "weight_decay": "nonnegative", "eps": "positive"}

    def __init__(self, params, lr: float = 1e-2, weight_decay: float = 0.0, eps: float = 1e-8, **kw) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "eps": eps}, **kw)

    def _update(self, w, g, s, step, group):
        if group["weight_decay"] != 0:
            g = g.add(w, alpha=group["weight_decay"])
        s.add_(g.square().mean(dim=1, keepdim=True))
        w.addcdiv_(g, s.sqrt().add_(group["eps"]), value=-group["lr"])
        return w, s


class SparseAdam(RowSparseOptimizer):
    """``torch.optim.SparseAdam``: lazy Adam, the moments and rows of the step's rows only, bias
    corrections from the table's step count; no weight decay (see :class:`AdamW`). ``lr`` and ``eps``
    must be > 0, as torch's requires."""

    value_states = 2
    squared_states = (1, 2)
    hyperparameters = {"lr": "positive", "betas": "betas", "eps": "positive"}

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, **kw) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps}, **kw)

    def _update(self, w, g, s, step, group):
        d = w.shape[1]
        b1, b2 = group["betas"]
        m_old, v_old = s[:, :d].clone(), s[:, d:].clone()
        m_upd = g.sub(m_old).mul_(1 - b1)
        s[:, :d] = m_old + m_upd
        v_upd = g.pow(2).sub_(v_old).mul_(1 - b2)
        s[:, d:] = v_old + v_upd
        numer = m_upd.add_(m_old)
        denom = v_upd.add_(v_old).sqrt_().add_(group["eps"])
        bias_correction1 = 1 - b1**step
        bias_correction2 = 1 - b2**step
        step_size = group["lr"] * math.sqrt(bias_correction2) / bias_correction1
        w.add_(-step_size * numer.div_(denom))
        return w, s


class Adam(RowSparseOptimizer):
    """``torch.optim.Adam`` (``AdamW`` with ``decoupled=True``) on the rows of the step: moments of
    those rows only, bias corrections from the table's step count; weight decay (Adam: L2 added to
    the gradient; AdamW: ``w *= 1 - lr * weight_decay``) on those rows only. ``eps`` must be > 0
    (torch allows 0, which makes a row whose gradient is 0 at its first step, a padded position's,
    0 / 0)."""

    value_states = 2
    squared_states = (1, 2)
    decoupled = False
    hyperparameters = {"lr": "nonnegative", "betas": "betas", "eps": "positive", "weight_decay": "nonnegative"}

    def __init__(
        self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, **kw
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, **kw)

    def _update(self, w, g, s, step, group):
        d = w.shape[1]
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        if wd != 0:
            if self.decoupled:
                w.mul_(1 - lr * wd)
            else:
                g = g.add(w, alpha=wd)
        m, v = s[:, :d], s[:, d:]
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bias_correction1 = 1 - b1**step
        bias_correction2 = 1 - b2**step
        step_size = lr / bias_correction1
        denom = (v.sqrt() / bias_correction2**0.5).add_(group["eps"])
        w.addcdiv_(m, denom, value=-step_size)
        return w, s


class AdamW(Adam):
    """``torch.optim.AdamW`` on the rows of the step (see :class:`Adam`); ``weight_decay`` 1e-2 by
    default, decoupled, on the rows of the step only."""

    decoupled = True

    def __init__(
        self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, **kw
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one: ple's for the tables, a torch optimizer for the other
    weights. ``param_groups`` are the optimizers' own group dicts, in order, so a learning-rate
    scheduler (``torch.optim.lr_scheduler``) or a training loop that expects one optimizer
    (transformers' ``Trainer(optimizers=(combined, scheduler))``) drives all of them; ``step`` and
    ``zero_grad`` run each; the state dict holds each one's."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise InvalidArgumentError(
                f"CombinedOptimizer takes torch optimizers, got {[type(o).__name__ for o in optimizers]}"
            )
        self.optimizers = list(optimizers)
        self.defaults: dict[str, Any] = {}
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self.state = defaultdict(dict)
        for o in self.optimizers:
            self.state.update(o.state)
        for hooks in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, hooks, OrderedDict())

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise InvalidArgumentError(f"a CombinedOptimizer state of {len(self.optimizers)} optimizers was expected")
        for i, (o, sd) in enumerate(zip(self.optimizers, saved, strict=True)):  # every part checked before any loads
            if isinstance(o, RowSparseOptimizer):
                o._check_loaded(sd)
                continue
            groups = sd.get("param_groups") if isinstance(sd, dict) else None
            sizes = [len(g["params"]) if isinstance(g, dict) and "params" in g else None for g in groups or []]
            if not isinstance(groups, list) or sizes != [len(g["params"]) for g in o.param_groups]:
                raise InvalidArgumentError(
                    f"optimizer {i} of this CombinedOptimizer ({type(o).__name__}) has parameter groups of "
                    f"{[len(g['params']) for g in o.param_groups]} parameters, the saved state {sizes or short_repr(groups)}"
                )
        for o, sd in zip(self.optimizers, saved, strict=True):
            o.load_state_dict(sd)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
