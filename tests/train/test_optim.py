"""The row-sparse optimizers against torch.optim, over many steps of real backward passes:
``torch.optim.SparseAdam`` and sparse ``Adagrad`` themselves; dense ``SGD``/``Adagrad`` (which
equal the lazy ones without weight decay); and dense ``SGD``/``Adagrad``/``Adam``/``AdamW`` run on
the rows of each step with those rows' states carried over (the lazy semantics, weight decay
included). States exist for the rows ever touched only; spilling, fusing into the backward and
a saved state change nothing."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ple.errors import InvalidArgumentError
from ple.train import SGD, Adagrad, Adam, AdamW, RowWiseAdagrad, SparseAdam, trainable
from tests.train._helpers import batch, dequantized, make_tier, new_layer

STEPS = 40


def _loss(out, seed):
    g = torch.Generator().manual_seed(seed)
    return (out * torch.randn(out.shape, generator=g)).sum()


def _setup(tmp_path, tier="mmap", fmt="fp8", seed=0):
    base = make_tier(tier, fmt, tmp_path, seed=seed)
    layer = new_layer(seed=seed + 1, table=base)
    for p in layer.parameters():
        p.requires_grad_(False)  # the table alone trains: the other weights stay, so both runs see one model
    return base, layer, trainable(layer)


def _run(tmp_path, make_opt, oracle, steps=STEPS, **kw):
    """Train with ``make_opt(handles)``; ``oracle(ref, grad, step)`` applies the same coalesced
    gradient to the dense fp32 copy ``ref``. Returns (our rows, oracle's rows, rows ever touched, opt)."""
    base, layer, handles = _setup(tmp_path, **kw)
    opt = make_opt(handles)
    ref = dequantized(base).clone()
    touched = torch.zeros(base.rows, dtype=torch.bool)
    skipped_then_back = 0
    last: torch.Tensor | None = None
    for i in range(steps):
        hidden, ids, attn = batch(seed=100 + i, b=2, s=8 + i % 5, mask=i % 3 == 0)
        _loss(layer.forward_padded(hidden, ids, attn), seed=i).backward()
        grad = handles[0].grad.coalesce()
        rows = grad.indices()[0]
        if last is not None:
            skipped_then_back += int((touched[rows] & ~torch.isin(rows, last)).sum())
        touched[rows] = True
        last = rows
        oracle(ref, grad.clone(), i + 1)
        opt.step()
        assert handles[0].grad is None  # used up by the step
    assert skipped_then_back > 20  # rows that sat out steps and came back: the lazy semantics matter
    got = dequantized(layer.table)
    assert opt.state_rows(handles[0]) == (int(touched.sum()) if opt.value_states + opt.row_states else 0)
    base.close()
    return got, ref, touched, opt


class _Restricted:
    """A torch optimizer applied to the rows of each step, their states carried from step to step."""

    def __init__(self, cls, keys: dict[str, float], **hp):
        self.cls, self.keys, self.hp = cls, keys, hp
        self.states: dict[str, torch.Tensor] = {}

    def __call__(self, ref, grad, step):
        rows = grad.indices()[0]
        for k, init in self.keys.items():
            self.states.setdefault(k, torch.full_like(ref, init))
        p = nn.Parameter(ref[rows].clone())
        opt = self.cls([p], **self.hp)
        opt.state[p] = {"step": torch.tensor(float(step - 1))} | {k: s[rows].clone() for k, s in self.states.items()}
        p.grad = grad.values().clone()
        opt.step()
        ref[rows] = p.detach()
        for k, s in self.states.items():
            s[rows] = opt.state[p][k]


def _dense(cls, **hp):
    holder: dict = {}

    def step(ref, grad, _step):
        if "p" not in holder:
            holder["p"] = nn.Parameter(ref.clone())
            holder["opt"] = cls([holder["p"]], **hp)
        holder["p"].grad = grad.to_dense()
        holder["opt"].step()
        ref.copy_(holder["p"].detach())

    return step


def test_sparse_adam_is_torch_sparse_adam(tmp_path):
    holder: dict = {}

    def oracle(ref, grad, step):
        if "p" not in holder:
            holder["p"] = nn.Parameter(ref.clone())
            holder["opt"] = torch.optim.SparseAdam([holder["p"]], lr=0.01, betas=(0.8, 0.99), eps=1e-6)
        holder["p"].grad = grad
        holder["opt"].step()
        ref.copy_(holder["p"].detach())

    got, ref, touched, _ = _run(tmp_path, lambda h: SparseAdam(h, lr=0.01, betas=(0.8, 0.99), eps=1e-6), oracle)
    assert torch.equal(got, ref)  # the same operations on the same rows
    start = dequantized(make_tier("mmap", "fp8", tmp_path, seed=0))
    assert torch.equal(got[~touched], start[~touched]) and not torch.equal(got[touched], start[touched])


@pytest.mark.parametrize(
    ("ours", "theirs", "keys", "hp"),
    [
        (SGD, torch.optim.SGD, {}, dict(lr=0.05, weight_decay=0.1)),
        (Adagrad, torch.optim.Adagrad, {"sum": 0.1}, dict(lr=0.05, lr_decay=0.01, weight_decay=0.1, eps=1e-9)),
        (
            Adam,
            torch.optim.Adam,
            {"exp_avg": 0.0, "exp_avg_sq": 0.0},
            dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
        ),
        (
            AdamW,
            torch.optim.AdamW,
            {"exp_avg": 0.0, "exp_avg_sq": 0.0},
            dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.5),
        ),
    ],
    ids=["sgd", "adagrad", "adam", "adamw"],
)
def test_lazy_optimizers_are_torch_optimizers_on_the_rows_of_each_step(tmp_path, ours, theirs, keys, hp):
    extra = {"initial_accumulator_value": keys["sum"]} if "sum" in keys else {}
    oracle = _Restricted(theirs, keys, **hp, **extra)
    got, ref, touched, _ = _run(tmp_path, lambda h: ours(h, **hp, **extra), oracle)
    assert torch.equal(got, ref)
    # the dense optimizer decays (and moves) rows a step does not read: not what lazy means
    dense = _dense(theirs, **hp, **extra)
    _, dense_ref, _, _ = _run(tmp_path, lambda h: ours(h, **hp, **extra), dense)
    assert not torch.equal(dense_ref, ref)


@pytest.mark.parametrize(
    ("ours", "theirs", "hp"),
    [
        (SGD, torch.optim.SGD, dict(lr=0.05)),
        (Adagrad, torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-9)),
    ],
    ids=["sgd", "adagrad"],
)
def test_without_weight_decay_sgd_and_adagrad_are_the_dense_torch_optimizers(tmp_path, ours, theirs, hp):
    got, ref, touched, _ = _run(tmp_path, lambda h: ours(h, **hp), _dense(theirs, **hp), tier="direct", fmt="q4_0")
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    start = dequantized(make_tier("mmap", "q4_0", tmp_path, seed=0))
    assert torch.equal(got[~touched], start[~touched])


def test_adagrad_is_torch_adagrad_with_sparse_gradients(tmp_path):
    holder: dict = {}

    def oracle(ref, grad, step):
        if "p" not in holder:
            holder["p"] = nn.Parameter(ref.clone())
            holder["opt"] = torch.optim.Adagrad([holder["p"]], lr=0.05, lr_decay=0.01)
        holder["p"].grad = grad
        holder["opt"].step()
        ref.copy_(holder["p"].detach())

    got, ref, _, _ = _run(tmp_path, lambda h: Adagrad(h, lr=0.05, lr_decay=0.01), oracle, tier="cached", fmt="bf16")
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_row_wise_adagrad_keeps_one_state_per_row(tmp_path):
    lr, eps, wd = 0.05, 1e-8, 0.01
    state: dict[int, float] = {}

    def oracle(ref, grad, step):
        for row, g in zip(grad.indices()[0].tolist(), grad.values(), strict=True):
            w = ref[row].double()
            g = g.double() + wd * w
            state[row] = state.get(row, 0.0) + float((g * g).mean())
            ref[row] = (w - lr * g / (math.sqrt(state[row]) + eps)).float()

    got, ref, touched, opt = _run(tmp_path, lambda h: RowWiseAdagrad(h, lr=lr, eps=eps, weight_decay=wd), oracle)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert opt.state_nbytes()[0] <= 64 * 1024  # one fp32 per row (+ the id map), not one per value


def test_fused_spilled_and_resumed_runs_equal_the_plain_run(tmp_path):
    hp = dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.2)

    def train(opt_kw, steps, handles_opt=None, start=0, layer_base=None):
        base, layer, handles = layer_base or _setup(tmp_path, tier="memory", fmt="int8_row")
        opt = handles_opt or AdamW(handles, **hp, **opt_kw)
        for i in range(start, start + steps):
            hidden, ids, _ = batch(seed=300 + i, s=10)
            _loss(layer.forward_padded(hidden, ids), seed=i).backward()
            assert (handles[0].grad is None) == opt.fused  # fused: no gradient is ever stored
            opt.step()
        return (base, layer, handles), opt

    (base, layer, h), plain = train({}, 20)
    want = dequantized(layer.table)
    (_, fl, fh), fused = train({"fused": True}, 20)
    assert torch.equal(dequantized(fl.table), want)
    spill = tmp_path / "spill"
    spill.mkdir()
    (_, sl, sh), spilled = train({"memory_budget": 4096, "spill_dir": spill}, 20)
    assert torch.equal(dequantized(sl.table), want)
    mem, out = spilled.state_nbytes()
    assert out > mem > 0 and list(spill.iterdir()) == []
    # save after 8 steps; a new optimizer loads the state and runs the other 12
    trio, first = train({}, 8)
    saved = first.state_dict()
    assert set(saved["state"][0]) == {"step", "rows", "values"} and saved["state"][0]["step"] == 8
    second = AdamW(trio[2], **hp)
    second.load_state_dict(saved)
    trio, _ = train({}, 12, handles_opt=second, start=8, layer_base=trio)
    assert torch.equal(dequantized(trio[1].table), want)
    assert plain.state_rows(h[0]) == spilled.state_rows(sh[0]) == len(layer.table.overlay)


def test_optimizers_refuse_what_is_not_a_table_handle(tmp_path):
    _, layer, handles = _setup(tmp_path, tier="memory", fmt="fp32")
    with pytest.raises(InvalidArgumentError, match="torch optimizer"):
        SGD([layer.key_proj])
    with pytest.raises(InvalidArgumentError, match="betas"):
        SparseAdam(handles, betas=(1.0, 0.9))
    with pytest.raises(InvalidArgumentError, match="lr"):
        SGD(handles, lr=float("nan"))
    opt = SGD(handles)
    handles[0].grad = torch.zeros(handles[0].shape)
    with pytest.raises(InvalidArgumentError, match="row-sparse"):
        opt.step()


def test_rows_and_states_spill_beside_the_table_file_by_default(tmp_path, monkeypatch):
    import tempfile

    from ple.table import MmapTable
    from tests.train._helpers import write_table_file

    folder = tmp_path / "tables"
    folder.mkdir()
    path = write_table_file(folder / "t.pletable", "fp8", seed=3)
    layer = new_layer(seed=2, table=MmapTable.open(path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "nowhere"))  # a spill there would fail
    opt = SparseAdam(trainable(layer, memory_budget=256), lr=0.05, memory_budget=256)
    hidden, ids, _ = batch(seed=4)
    _loss(layer.forward_padded(hidden, ids), seed=0).backward()
    opt.step()
    assert layer.table.overlay.spilled_rows > 0 and opt.state_nbytes()[1] > 0
    assert [p.name for p in folder.iterdir()] == ["t.pletable"]  # unnamed files: nothing left beside it


def test_rows_and_states_that_leave_memory_and_come_back_train_to_the_same_bits(tmp_path):
    """Budgets far below the rows touched: the recently used rows and states stay in memory, the
    others go to the spill files and come back when read again; every row and state equals the
    unspilled run's, bit for bit."""

    def run(budget_rows):
        base = make_tier("mmap", "fp8", tmp_path, seed=5)
        layer = new_layer(seed=6, table=base)
        layer.requires_grad_(False)
        width = base.head_dim
        kw = {} if budget_rows is None else {"spill_dir": tmp_path}
        handles = trainable(layer, memory_budget=None if budget_rows is None else budget_rows * width * 4, **kw)
        opt = SparseAdam(handles, lr=0.05, memory_budget=None if budget_rows is None else budget_rows * width * 8, **kw)
        for i in range(STEPS):
            hidden, ids, _ = batch(seed=700 + i, b=2, s=10)
            _loss(layer.forward_padded(hidden, ids), seed=i).backward()
            opt.step()
        overlay = layer.table.overlay
        ids = overlay.ids()
        return ids, overlay.get(ids)[1], opt.row_state(handles[0]).export(), overlay, opt.row_state(handles[0]).store

    ids, rows, states, _, _ = run(None)
    s_ids, s_rows, s_states, overlay, store = run(25)
    assert ids.numel() > 8 * 25
    assert torch.equal(ids, s_ids) and torch.equal(rows, s_rows)
    assert torch.equal(states[0], s_states[0]) and torch.equal(states[1], s_states[1])
    assert overlay.spill_traffic[0] > 0 and store.file_reads > 0  # rows and states came back from the files
