"""Every ``torch.ops.ple`` operator through its registry entry (``ple.kernels.registry.OPERATORS``): each
registered kernel this machine can run against the operator's reference (Triton kernels under the
interpreter without a CUDA device, see tests/conftest.py), the dispatcher running the kernel the
entry chooses, and the fake implementations under ``torch.library.opcheck``."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from ple.config import PLEConfig
from ple.kernels.registry import DEVICES, OPERATORS
from ple.ngram import layout_tensors
from ple.ops import library
from ple.ops.state import engine_to_ring, ring_to_engine
from ple.table import MemoryTable
from ple.table.base import TableRef
from ple.table.formats.quantize import quantize_rows
from tests.conftest import TRITON_DEVICE
from tests.ops._helpers import DTYPE_TOL, random_conv_batch, random_fused_step
from tests.table._helpers import make_table, random_ids

NAMES = {"ngram_ids", "table_lookup", "gather_dequant", "grouped_rms_norm", "ngram_gate", "dilated_conv"}
NAMES |= {"gate_conv", "gate_stage", "conv_stage"}
HAS_TRITON = importlib.util.find_spec("triton") is not None
SEEDS = range(3)


def _runs_here(kernel) -> str | None:
    """The device this machine runs ``kernel`` on, or None: CPU kernels on the CPU; CUDA kernels on
    a CUDA device, or Triton ones on CPU tensors under the interpreter."""
    if kernel.device == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    return TRITON_DEVICE if kernel.needs == "triton" and HAS_TRITON else None


CASES = [(op.name, k) for op in OPERATORS.values() for k in op.kernels if _runs_here(k)]


def _params(schema: str) -> list[str]:
    return schema[schema.index("(") + 1 : schema.rindex(") ->")].split(", ")


def _mutated(schema: str) -> list[int]:
    """Positions of the arguments the operator writes (``Tensor(a!)``)."""
    return [i for i, p in enumerate(_params(schema)) if "!" in p]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ngram_ids(seed, device):
    cfg = PLEConfig(hidden_size=8, vocab_size=300, eos_token_id=7, heads_per_ngram=2, ngram_size=4, ple_embed_dim=12)
    lay = cfg.layout(0)
    tokens = torch.randint(0, 300, (23,), generator=_gen(seed))
    tokens[5 + seed] = 7  # an EOS inside a request
    ctx = torch.randint(0, 300, (3, 3), generator=_gen(seed + 1))
    qsl = torch.tensor([0, 4, 4 + seed, 23])
    dev = torch.device(device)
    return (tokens.to(dev), qsl.to(dev), ctx.to(dev), *layout_tensors(lay, dev), lay.heads_per_ngram, 7, 300)


def _table_lookup(seed, device):
    rows = torch.randn(50, 12, generator=_gen(seed))
    if seed == 0:
        table = MemoryTable(rows.to(torch.bfloat16).to(device))
    else:
        q, scale = quantize_rows(rows, "fp8_row" if seed == 1 else "int8_row")
        table = MemoryTable(q.to(device), scale.to(device))
    ids = torch.randint(0, 50, (7, 3), generator=_gen(seed + 1)).to(device)
    return (ids, TableRef(table), 12, torch.bfloat16)


def _gather_dequant(seed, device):
    fmt = ("bf16", "fp8_row", "q4_0")[seed]
    data, scale = make_table(fmt, 40, 64, seed=seed)
    ids = random_ids(40, 5, 3, seed=seed + 1).to(device)
    out = torch.full((5, 3 * 64), float("nan"), dtype=torch.bfloat16, device=device)
    return (data.to(device), None if scale is None else scale.to(device), ids, torch.bfloat16, out, True, fmt)


def _grouped_rms_norm(seed, device):
    x = torch.randn(5, 24, generator=_gen(seed)).to(device)
    w = (0.3 * torch.randn(24, generator=_gen(seed + 1))).to(device)
    return (x, w, (8, 12, 24)[seed], 1e-6)


def _fused(seed, device):
    step = random_fused_step(seed, dtype=torch.float32, hidden_size=8, hc=2, device=device)
    meta = step["step"]
    if seed == 2:  # the ring layout of the state pool
        pool, offsets = engine_to_ring(meta.conv_state)
        meta = dataclasses.replace(meta, conv_state=pool, state_offsets=offsets)
    conv = step["conv"]
    return step, library._gate_args(step["gate"]), (conv.weight, conv.taps, conv.dilation), library._step_args(meta)


def _ngram_gate(seed, device):
    step, gate, _, _ = _fused(seed, device)
    return (step["key"], step["value"], step["hidden"], *gate)


def _dilated_conv(seed, device):
    b = random_conv_batch(seed, channels=6, num_slots=5, device=device)
    taps = b["weight"].float().t().contiguous()
    step = (b["query_start_loc"], b["conv_state"], b["state_indices"], b["has_initial_state"], b["num_rejected"])
    return (b["c"], b["residual"], b["weight"], taps, b["dilation"], *step, True)


def _gate_conv(seed, device):
    step, gate, conv, meta = _fused(seed, device)
    key, value, hidden = step["key"], step["value"], step["hidden"]
    return (key, value, hidden, *gate, *conv, *meta, step["token_mask"], step["add_hidden"], True)


def _gate_stage(seed, device):
    step, gate, _, _ = _fused(seed, device)
    return (step["key"], step["value"], step["hidden"], *gate, step["token_mask"], step["add_hidden"])


def _conv_stage(seed, device):
    step, _, conv, meta = _fused(seed, device)
    c = torch.randn(step["hidden"].shape, generator=_gen(seed)).to(device)
    return (c, step["hidden"].clone(), *conv, *meta)


SAMPLES = {
    "ngram_ids": _ngram_ids,
    "table_lookup": _table_lookup,
    "gather_dequant": _gather_dequant,
    "grouped_rms_norm": _grouped_rms_norm,
    "ngram_gate": _ngram_gate,
    "dilated_conv": _dilated_conv,
    "gate_conv": _gate_conv,
    "gate_stage": _gate_stage,
    "conv_stage": _conv_stage,
}
EXACT = {"ngram_ids", "table_lookup", "gather_dequant"}  # integers, and rows decoded exactly by every tier


def _results(name: str, out, args) -> list[torch.Tensor]:
    """The outputs and the arguments the operator writes, on the CPU; a ring pool as the engine
    layout it stands for (kernels may rotate a ring differently)."""
    outs = list(out) if isinstance(out, tuple) else [] if out is None else [out]
    params = _params(OPERATORS[name].schema)
    written = [args[i] for i in _mutated(OPERATORS[name].schema)]
    if "bool ring" in params and args[params.index("bool ring")]:
        pool, offsets = written
        written = [ring_to_engine(pool, offsets)]
    return [t.cpu() for t in outs + written]


def _compare(name: str, got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if name in EXACT or not a.is_floating_point():
            assert torch.equal(a, b), f"{what}: result {i} differs"
        else:
            torch.testing.assert_close(a, b, **DTYPE_TOL[torch.float32], msg=lambda m, i=i: f"{what}: result {i}: {m}")


def test_the_registry_holds_every_operator():
    assert set(OPERATORS) == NAMES
    for op in OPERATORS.values():
        assert op.name == op.schema.split("(")[0] and hasattr(torch.ops.ple, op.name)
        assert callable(op.reference) and callable(op.fake)
        for device in DEVICES:  # a kernel for every device, the last one taking everything
            mine = [k for k in op.kernels if k.device == device]
            assert mine and mine[-1].takes is None, (op.name, device)
    assert set(SAMPLES) == NAMES


@pytest.mark.parametrize("name, kernel", CASES, ids=[f"{n}-{k.name}-{k.device}" for n, k in CASES])
def test_kernel_matches_the_reference(name, kernel):
    op = OPERATORS[name]
    device = _runs_here(kernel)
    taken = 0
    for seed in SEEDS:
        args = SAMPLES[name](seed, device)
        if kernel.takes is not None and not kernel.takes(*args):
            continue  # a sample for the other kernel of the device
        taken += 1
        if op.check is not None:
            op.check(*args, devices=True)
        want = _results(name, op.reference(*args), args)
        args = SAMPLES[name](seed, device)
        got = _results(name, kernel.fn(*args), args)
        _compare(name, got, want, f"{name} {kernel.name} on {device} vs reference (sample {seed})")
    assert taken, f"no sample is one {kernel.name} takes"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(NAMES))
def test_the_cpu_operator_runs_the_kernel_its_entry_chooses(name, seed):
    op = OPERATORS[name]
    args = SAMPLES[name](seed, "cpu")
    kernel = next(k for k in op.kernels if k.device == "cpu" and (k.takes is None or k.takes(*args)))
    want = _results(name, kernel.fn(*args), args)
    args = SAMPLES[name](seed, "cpu")
    got = _results(name, getattr(torch.ops.ple, name)(*args), args)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{name}: result {i} is not the {kernel.name} kernel's"
    args = SAMPLES[name](seed, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(_results(name, op.on(torch.device("cpu"))(*args), args), want))
    args = SAMPLES[name](seed, "cpu")  # the same kernel without the check
    assert all(torch.equal(a, b) for a, b in zip(_results(name, op.kernel_on(torch.device("cpu"))(*args), args), want))


def test_kernel_on_skips_the_check_and_on_runs_it():
    op = OPERATORS["ngram_ids"]
    args = list(SAMPLES["ngram_ids"](0, "cpu"))
    tokens = args[0].clone()
    tokens[1] = 10**6  # outside the vocabulary: the check refuses it, the id kernel hashes it all the same
    args[0] = tokens
    with pytest.raises(ValueError, match="1000000"):
        op.on(torch.device("cpu"))(*args)
    ids = op.kernel_on(torch.device("cpu"))(*args)
    assert ids.shape[0] == tokens.shape[0]


def test_a_device_without_kernels_is_refused():
    with pytest.raises(ValueError, match=r"grouped_rms_norm: tensors on meta, expected one of cpu, cuda"):
        OPERATORS["grouped_rms_norm"].on(torch.device("meta"))
    with pytest.raises(ValueError, match=r"grouped_rms_norm: tensors on meta, expected one of cpu, cuda"):
        OPERATORS["grouped_rms_norm"].kernel_on(torch.device("meta"))


# table references are opaque (tests/test_compile.py); the gather writes a given tensor (no fake outputs)
@pytest.mark.parametrize("name", sorted(NAMES - {"table_lookup", "gather_dequant"}))
def test_fake_implementations(name):
    torch.library.opcheck(getattr(torch.ops.ple, name).default, SAMPLES[name](1, "cpu"))
