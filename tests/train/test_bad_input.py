"""Bad arguments and bad saved states of the row-sparse optimizers are ple errors naming the value,
checked alike in the constructors, ``load_state_dict`` and ``load_optimizer_state`` (which names
the file too); a refused state changes nothing. Whatever ``torch.optim`` refuses, ple's refuses;
``eps`` must be > 0 everywhere (torch's ``Adam`` and ``Adagrad`` accept 0, which turns a row whose
gradient is 0, a padded position's, into 0 / 0 = NaN)."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ple.errors import PLEError
from ple.table import MmapTable
from ple.train import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    AdapterFileError,
    RowWiseAdagrad,
    SparseAdam,
    load_adapter,
    load_optimizer_state,
    read_adapter,
    save_adapter,
    trainable,
)
from tests.train._helpers import batch, new_layer, write_table_file

NAN, INF = float("nan"), float("inf")
TORCH = {
    SGD: torch.optim.SGD,
    Adagrad: torch.optim.Adagrad,
    RowWiseAdagrad: torch.optim.Adagrad,
    SparseAdam: torch.optim.SparseAdam,
    Adam: torch.optim.Adam,
    AdamW: torch.optim.AdamW,
}
REFUSED_BY_TORCH = [
    (SGD, {"lr": -1.0}),
    (SGD, {"weight_decay": -0.1}),
    (Adam, {"lr": NAN}),
    (Adagrad, {"lr": -1.0}),
    (Adagrad, {"lr_decay": -1.0}),
    (Adagrad, {"weight_decay": -1.0}),
    (Adagrad, {"initial_accumulator_value": -1.0}),
    (Adagrad, {"eps": -1e-8}),
    (RowWiseAdagrad, {"eps": -1e-8}),
    (SparseAdam, {"lr": 0.0}),
    (SparseAdam, {"eps": 0.0}),
    (SparseAdam, {"betas": (1.0, 0.9)}),
    (SparseAdam, {"betas": (0.9, -0.1)}),
    (Adam, {"lr": -1.0}),
    (Adam, {"eps": -1.0}),
    (Adam, {"betas": (0.5, 1.5)}),
    (AdamW, {"weight_decay": -1.0}),
]
REFUSED_BY_PLE = [  # accepted by torch's constructor, or refused there outside ple's errors
    (Adam, {"eps": 0.0}),
    (AdamW, {"eps": 0.0}),
    (Adagrad, {"eps": 0.0}),
    (RowWiseAdagrad, {"eps": 0.0}),
    (Adagrad, {"initial_accumulator_value": NAN}),
    (Adam, {"lr": INF}),
    (SGD, {"lr": NAN}),
    (SparseAdam, {"lr": "abc"}),
    (SparseAdam, {"lr": None}),
    (SGD, {"lr": True}),
    (SparseAdam, {"betas": (0.9,)}),
    (SparseAdam, {"betas": "ab"}),
    (Adam, {"betas": 0.9}),
    (Adam, {"betas": (0.9, NAN)}),
    (SGD, {"memory_budget": -1}),
    (SGD, {"spill_dir": 5}),
    (SGD, {"fused": "yes"}),
]


@pytest.fixture(scope="module")
def table_path(tmp_path_factory):
    return write_table_file(tmp_path_factory.mktemp("bad") / "t.pletable", "fp8", seed=3)


def _layer(table_path):
    layer = new_layer(seed=1, table=MmapTable.open(table_path))
    layer.requires_grad_(False)
    return layer


def _steps(layer, opt, n=3):
    for i in range(n):
        hidden, ids, _ = batch(seed=50 + i, mask=True)  # padded positions: rows with a zero gradient
        out = layer.forward_padded(hidden, ids, batch(seed=50 + i, mask=True)[2])
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()


def _named(kw: dict) -> str:
    (name, value), *_ = kw.items()
    return re.escape(repr(value))


@pytest.mark.parametrize(("cls", "kw"), REFUSED_BY_TORCH, ids=lambda x: getattr(x, "__name__", str(x)))
def test_what_torch_refuses_ple_refuses_with_a_ple_error_naming_the_value(table_path, cls, kw):
    with pytest.raises(ValueError):
        TORCH[cls]([torch.nn.Parameter(torch.zeros(2, 2))], **kw)
    with pytest.raises(PLEError, match=_named(kw)):
        cls(trainable(_layer(table_path)), **kw)


@pytest.mark.parametrize(("cls", "kw"), REFUSED_BY_PLE, ids=lambda x: getattr(x, "__name__", str(x)))
def test_every_bad_argument_is_a_ple_error_naming_the_value(table_path, cls, kw):
    with pytest.raises(PLEError, match=_named(kw)):
        cls(trainable(_layer(table_path)), **kw)


def test_parameter_groups_and_params_are_checked_as_ple_errors(table_path):
    handles = trainable(_layer(table_path))
    with pytest.raises(PLEError, match="parameter group 0: lr must be a finite number >= 0, got 'x'"):
        Adam([{"params": handles, "lr": "x"}])
    with pytest.raises(PLEError, match="one tensor"):
        SGD(handles[0])
    with pytest.raises(PLEError, match="empty"):
        SGD([])


def test_torch_adam_with_eps_0_makes_nan_of_a_zero_gradient():
    """Why eps must be > 0: a row in the step whose gradient is 0 (a padded position) at its first step."""
    p = torch.nn.Parameter(torch.ones(1, 2))
    opt = torch.optim.Adam([p], eps=0.0)
    p.grad = torch.zeros(1, 2)
    opt.step()
    assert bool(p.isnan().all())


def _trained(table_path, cls=SparseAdam, **hp):
    layer = _layer(table_path)
    opt = cls(trainable(layer), **hp)
    _steps(layer, opt)
    return layer, opt


def _state(opt) -> dict:
    return copy.deepcopy(opt.state_dict())


def _equal_states(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for k in a["state"]:
        x, y = a["state"][k], b["state"][k]
        if x.keys() != y.keys():
            return False
        for name in x:
            if isinstance(x[name], torch.Tensor):
                if not torch.equal(x[name], y[name]):
                    return False
            elif x[name] != y[name]:
                return False
    return True


def _bad_state(kind: str, sd: dict, d: int) -> tuple[dict, str]:
    """A copy of ``sd`` broken one way, and what the error must name."""
    sd = copy.deepcopy(sd)
    st = sd["state"][0]
    g = sd["param_groups"][0]
    if kind == "nan moment":
        st["values"][1, 2] = NAN
        return sd, "is nan"
    if kind == "negative second moment":
        st["values"][0, d] = -1.0
        return sd, r"-1\.0 .*sum of squares"
    if kind == "width":
        st["values"] = st["values"][:, :d]
        return sd, f"expected a float tensor \\[{st['rows'].numel()}, {2 * d}\\]"
    if kind == "row out of range":
        st["rows"][-1] = 10**9
        return sd, "outside"
    if kind == "repeated row":
        st["rows"][1] = st["rows"][0]
        return sd, "repeat"
    if kind == "rows without values":
        del st["values"]
        return sd, "come together"
    if kind == "step":
        st["step"] = -1
        return sd, "step must be an integer >= 0, got -1"
    if kind == "lr nan":
        g["lr"] = NAN
        return sd, "lr must be a finite number > 0, got nan"
    if kind == "betas":
        g["betas"] = [1.5, 2.0]
        return sd, re.escape("betas must lie in [0, 1), got [1.5, 2.0]")
    if kind == "missing eps":
        del g["eps"]
        return sd, "'eps' is missing"
    if kind == "param_groups":
        sd["param_groups"] = 5
        return sd, "param_groups must be a list of 1 parameter groups, got 5"
    raise AssertionError(kind)


KINDS = [
    "nan moment",
    "negative second moment",
    "width",
    "row out of range",
    "repeated row",
    "rows without values",
    "step",
    "lr nan",
    "betas",
    "missing eps",
    "param_groups",
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_state_dict_is_refused_and_changes_nothing(table_path, kind):
    layer, opt = _trained(table_path, lr=0.05)
    before = _state(opt)
    bad, named = _bad_state(kind, before, layer.table.head_dim)
    with pytest.raises(PLEError, match=named):
        opt.load_state_dict(bad)
    assert _equal_states(_state(opt), before)
    opt.load_state_dict(before)  # the good one still loads
    assert _equal_states(_state(opt), before)


def _rewrite(path, out, *, metadata=None, tensors=None) -> None:
    """``path``'s adapter file again as ``out``, with metadata fields and tensors replaced."""
    with safe_open(str(path), "pt") as f:
        md = dict(f.metadata())
        ts = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has keys(), no iteration
    md.update(metadata or {})
    ts.update(tensors or {})
    save_file(ts, str(out), metadata=md)


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("nan moment", r"layer0\.state\.values: the state of row \d+ is nan"),
        ("lr nan", "parameter group 0: lr must be a finite number > 0, got nan"),
        ("betas", re.escape("parameter group 0: betas must lie in [0, 1), got (1.5, 2.0)")),
        ("param_groups", "param_groups must be a list of objects, got 5"),
        ("steps", "steps must be an object by layer, got 'x'"),
        ("step", re.escape("steps['0']: step must be an integer >= 0, got 2.5")),
    ],
)
def test_load_optimizer_state_refuses_a_bad_checkpoint_naming_the_file_and_the_value(tmp_path, table_path, kind, named):
    layer, opt = _trained(table_path, lr=0.05)
    ckpt = save_adapter(tmp_path / "ckpt.safetensors", layer, optimizer=opt)
    saved = read_adapter(ckpt).optimizer
    bad = tmp_path / "bad.safetensors"
    if kind == "nan moment":
        with safe_open(str(ckpt), "pt") as f:
            values = f.get_tensor("layer0.state.values").clone()
        values[3, 1] = NAN
        _rewrite(ckpt, bad, tensors={"layer0.state.values": values})
    else:
        saved = copy.deepcopy(saved)
        if kind == "lr nan":
            saved["param_groups"][0]["lr"] = NAN
        elif kind == "betas":
            saved["param_groups"][0]["betas"] = [1.5, 2.0]
        elif kind == "param_groups":
            saved["param_groups"] = 5
        elif kind == "steps":
            saved["steps"] = "x"
        elif kind == "step":
            saved["steps"]["0"] = 2.5
        _rewrite(ckpt, bad, metadata={"optimizer": json.dumps(saved)})

    resumed = _layer(table_path)
    load_adapter(resumed, ckpt)
    opt2 = SparseAdam(trainable(resumed), lr=0.01)
    before = _state(opt2)
    with pytest.raises(AdapterFileError, match=re.escape(str(bad)) + ".*" + named):
        load_optimizer_state(opt2, bad)
    assert _equal_states(_state(opt2), before)
    load_optimizer_state(opt2, ckpt)  # the good checkpoint resumes
    assert opt2.param_groups[0]["lr"] == 0.05 and math.isfinite(opt2.state_nbytes()[0])


@pytest.mark.parametrize("field", ["layers", "optimizer", "user"])
def test_adapter_metadata_nested_deeper_than_the_recursion_limit_is_refused(tmp_path, table_path, field):
    layer, opt = _trained(table_path, lr=0.05)
    ckpt = save_adapter(tmp_path / "ckpt.safetensors", layer, optimizer=opt, meta={"step": 3})
    bad = tmp_path / "deep.safetensors"
    _rewrite(ckpt, bad, metadata={field: "[" * 100_000 + "]" * 100_000})
    with pytest.raises(AdapterFileError, match=f"{re.escape(str(bad))}: the adapter metadata '{field}' .*nested"):
        read_adapter(bad)
    with pytest.raises(AdapterFileError):
        load_adapter(_layer(table_path), bad)


@pytest.mark.parametrize("broken", ["table part", "torch part"])
def test_a_combined_state_with_one_bad_part_is_refused_before_any_part_loads(table_path, broken):
    """CombinedOptimizer checks every part before loading one: a bad table state, after the torch
    optimizer's, leaves the torch state as it was; a torch state of other parameter groups, after the
    table's, leaves the table's."""
    from ple.train import CombinedOptimizer

    layer = _layer(table_path)
    other = torch.nn.Parameter(torch.ones(3))
    tables = SparseAdam(trainable(layer), lr=0.05)
    rest = torch.optim.AdamW([other], lr=0.1)
    parts = [rest, tables] if broken == "table part" else [tables, rest]  # the good part loads first
    combined = CombinedOptimizer(*parts)
    t, r = parts.index(tables), parts.index(rest)
    for i in range(2):
        _steps(layer, tables, n=1)
        (other * (i + 1)).sum().backward()
        rest.step()
        rest.zero_grad()
    good = copy.deepcopy(combined.state_dict())
    bad = copy.deepcopy(good)
    if broken == "table part":
        bad["optimizers"][t]["param_groups"][0]["lr"] = NAN
        named = "lr must be a finite number > 0, got nan"
        bad["optimizers"][r]["param_groups"][0]["lr"] = 0.5
    else:
        bad["optimizers"][r]["param_groups"][0]["params"] = [0, 1]
        named = rf"optimizer {r} .*AdamW.* \[1\] parameters, the saved state \[2\]"
        bad["optimizers"][t]["param_groups"][0]["lr"] = 0.5
    with pytest.raises(PLEError, match=named):
        combined.load_state_dict(bad)
    assert _equal_states(_state(tables), good["optimizers"][t])
    assert float(rest.state[other]["step"]) == 2.0 and rest.param_groups[0]["lr"] == 0.1
    combined.load_state_dict(good)
    assert _equal_states(_state(tables), good["optimizers"][t])
