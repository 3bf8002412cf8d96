"""The ``torch.ops.ple`` operators are public entry points: called with arguments that disagree with each
other (shapes, dtypes, devices) they refuse with a ple error, never corrupt memory or return garbage.

The fuzz test drives every operator with mutated arguments in a child process, so a crash (an abort
of the C allocator, a segfault) is a failed test, not a dead test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ple.config import PLEConfig
from ple.errors import PLEError
from ple.ngram import NgramInputError, layout_tensors
from ple.ops import library  # noqa: F401  (registers the fused operators)
from ple.table import MemoryTable
from ple.table.base import TableRef

# ---------------------------------------------------------------------------------------------- valid calls

_CFG = PLEConfig(hidden_size=8, vocab_size=300, eos_token_id=7, heads_per_ngram=2, ngram_size=4, ple_embed_dim=12)
T, R, H, HC, K, DIL, L, S = 5, 2, 4, 2, 3, 2, 6, 3  # tokens, requests, hidden, streams, taps, dilation, state, slots
C = H * HC


def ngram_args() -> list:
    lay = _CFG.layout(0)
    g = torch.Generator().manual_seed(0)
    mult, sizes, offs = layout_tensors(lay, torch.device("cpu"))
    return [
        torch.randint(0, 300, (T,), generator=g),
        torch.tensor([0, 2, T]),
        torch.randint(0, 300, (R, lay.ngram_size - 1), generator=g),
        mult.clone(),
        sizes.clone(),
        offs.clone(),
        lay.heads_per_ngram,
        _CFG.eos_token_id,
        _CFG.vocab_size,
    ]


def _gate_part(g: torch.Generator) -> list:
    nk, nq, nc = (0.1 * torch.randn(C, generator=g) for _ in range(3))
    return [
        torch.randn(T, C, generator=g),  # key
        torch.randn(T, H, generator=g),  # value
        torch.randn(T, C, generator=g),  # hidden
        nk,
        nq,
        nc,
        ((1 + nk) * (1 + nq)).contiguous(),  # key_query
        (1 + nc).contiguous(),  # conv_scale
        1e-6,
        HC,
    ]


def _conv_part(g: torch.Generator) -> list:
    w = torch.randn(C, K, generator=g)
    return [w, w.t().contiguous(), DIL]


def _step_part(g: torch.Generator) -> list:
    return [
        torch.tensor([0, 2, T]),  # query_start_loc
        torch.randn(S, C, L, generator=g),  # conv_state
        torch.tensor([1, -1]),  # state_indices
        torch.tensor([True, False]),  # has_initial_state
        torch.zeros(R, dtype=torch.int64),  # num_rejected
        torch.zeros(0, dtype=torch.int64),  # state_offsets (no ring)
        False,
    ]


def gate_conv_args() -> list:
    g = torch.Generator().manual_seed(1)
    return [*_gate_part(g), *_conv_part(g), *_step_part(g), torch.ones(T, dtype=torch.bool), True, True]


def gate_stage_args() -> list:
    g = torch.Generator().manual_seed(2)
    return [*_gate_part(g), None, True]


def conv_stage_args() -> list:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(T, C, generator=g), torch.randn(T, C, generator=g), *_conv_part(g), *_step_part(g)]


def table_lookup_args() -> list:
    g = torch.Generator().manual_seed(4)
    table = MemoryTable(torch.randn(40, 6, generator=g).bfloat16())
    return [torch.randint(0, 40, (T, 3), generator=g), TableRef(table), 6, torch.float32]


VALID = {
    "ngram_ids": ngram_args,
    "gate_conv": gate_conv_args,
    "gate_stage": gate_stage_args,
    "conv_stage": conv_stage_args,
    "table_lookup": table_lookup_args,
}


def call(op: str, args: list):
    return getattr(torch.ops.ple, op)(*args)


@pytest.mark.parametrize("op", sorted(VALID))
def test_valid_calls_run(op):
    call(op, VALID[op]())


# ---------------------------------------------------------------------------------------------- the reported cases


def _with(args: list, i: int, value) -> list:
    out = list(args)
    out[i] = value
    return out


def test_ngram_ids_refuses_head_tensors_shorter_than_the_layout():
    args = ngram_args()
    for i in (4, 5):  # head_sizes, head_offsets: the C kernel read past them
        with pytest.raises(NgramInputError, match="entries, expected \\(N-1\\)\\*heads_per_ngram"):
            call("ngram_ids", _with(args, i, args[i][:-2]))


def test_ngram_ids_refuses_int32_layout_tensors():
    args = ngram_args()
    for i in (3, 4, 5):
        with pytest.raises(NgramInputError, match="must be int64"):
            call("ngram_ids", _with(args, i, args[i].int()))


def test_ngram_ids_refuses_fewer_context_rows_than_requests():
    args = ngram_args()
    with pytest.raises(NgramInputError, match="ngram_context.shape=\\(1, 3\\), expected \\[R, N-1\\] = \\(2, 3\\)"):
        call("ngram_ids", _with(args, 2, args[2][:1]))


def test_gate_conv_refuses_a_pool_of_fewer_channels():
    args = gate_conv_args()
    pool = args[14]
    with pytest.raises(PLEError, match="conv_state.shape=\\(3, 4, 6\\), expected \\[S, C, L\\] with C=8"):
        call("gate_conv", _with(args, 14, pool[:, : C // 2].contiguous()))


def test_gate_conv_refuses_fewer_key_rows_than_hidden_rows():
    args = gate_conv_args()
    with pytest.raises(PLEError, match="key.shape=\\(3, 8\\), expected \\[T, HC\\*H\\] = \\(5, 8\\)"):
        call("gate_conv", _with(args, 0, args[0][:3]))


def test_fused_operators_refuse_factors_that_disagree():
    args = gate_conv_args()
    with pytest.raises(PLEError, match="key_query.dtype=torch.bfloat16, expected float32"):
        call("gate_conv", _with(args, 6, args[6].bfloat16()))
    with pytest.raises(PLEError, match="conv_taps.shape=\\(2, 8\\), expected \\(3, 8\\)"):
        call("gate_conv", _with(args, 11, args[11][:2]))
    cargs = conv_stage_args()
    with pytest.raises(PLEError, match="conv_stage: c is"):
        call("conv_stage", _with(cargs, 1, cargs[1][:2]))


def test_table_lookup_refuses_a_head_dim_other_than_the_tables():
    args = table_lookup_args()
    with pytest.raises(PLEError, match="head_dim=5, but the table's rows are 6 wide"):
        call("table_lookup", _with(args, 2, 5))
    with pytest.raises(PLEError, match="out of range"):  # host ids are read: no synchronization
        call("table_lookup", _with(args, 0, args[0] + 40))


# ---------------------------------------------------------------------------------------------- token ids >= vocab_size


def _layer_and_batch():
    from ple.layer import PLELayer
    from ple.runtime import Batch

    cfg = PLEConfig(
        hidden_size=16,
        hc_count=4,
        ple_embed_dim=32,
        ngram_size=3,
        heads_per_ngram=2,
        vocab_size=50,
        eos_token_id=1,
        ngram_vocab_size_base=500,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=4,
    )
    torch.manual_seed(0)
    layer = PLELayer(cfg, 0, dtype=torch.float32)
    layer.set_table(MemoryTable(torch.randn(layer.layout.padded_rows, layer.layout.head_dim)))
    pool = torch.zeros(2, cfg.hc_hidden_size, cfg.conv_window)
    batch = Batch.build([3], [0], torch.full((1, cfg.ngram_size - 1), 1), pool, has_initial_state=[False])
    return layer, batch


def test_compiled_and_eager_engine_calls_agree_on_a_token_outside_the_vocabulary():
    """Host tokens are checked inside the id operator, so the compiled call refuses what eager refuses."""
    layer, batch = _layer_and_batch()
    hidden = torch.randn(3, layer.config.hc_hidden_size)
    good = torch.tensor([3, 4, 5])
    bad = torch.tensor([3, 50, 5])

    def step(h, ids):
        return layer(h, ids, batch)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    compiled(hidden, good)  # traced once on good tokens
    for fn in (step, compiled):
        with pytest.raises(NgramInputError, match="token id 50 at position 1 .* outside \\[0, vocab_size=50\\)"):
            fn(hidden, bad)
    assert torch.is_grad_enabled()  # the compiled call that raised left grad mode as it was


# ---------------------------------------------------------------------------------------------- fuzz

_FUZZ = r"""
import sys, traceback
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from ple.errors import PLEError
from tests.kernels.test_operator_checks import VALID, call

DTYPES = [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.uint8]
op = sys.argv[1]
examples = int(sys.argv[2])


def mutate(value, kind, k, dtype, rnd):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return [0, -1, 1, 2, 3, 1 << 40, value + k][k % 7]
    if isinstance(value, float):
        return [-1.0, float("nan"), float("inf"), 0.0][k % 4]
    if not isinstance(value, torch.Tensor):
        return value
    if kind == "dtype":
        return value.to(dtype)
    shape = list(value.shape)
    if kind == "grow" or kind == "shrink":
        if not shape:
            shape = [k]
        d = k % len(shape)
        shape[d] = max(0, shape[d] + (k % 3 + 1) * (1 if kind == "grow" else -1))
    elif kind == "rank":
        shape = shape + [k % 3 + 1] if k % 2 else shape[1:]
    elif kind == "empty":
        shape = [0] + shape[1:]
    elif kind == "strided":
        return value.unsqueeze(-1).expand(*value.shape, 2)[..., 0] if value.dim() else value
    g = torch.Generator().manual_seed(rnd)
    if value.is_floating_point():
        return torch.randn(shape, generator=g).to(value.dtype)
    if value.dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    return torch.randint(-1, 8, shape, generator=g).to(value.dtype)


mutation = st.tuples(
    st.integers(0, 40),
    st.sampled_from(["dtype", "grow", "shrink", "rank", "empty", "strided", "none"]),
    st.integers(0, 1000),
    st.sampled_from(DTYPES),
    st.integers(0, 1 << 30),
)


@settings(max_examples=examples, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(mutation, min_size=1, max_size=3))
def fuzz(mutations):
    args = VALID[op]()
    for i, kind, k, dtype, rnd in mutations:
        i %= len(args)
        if kind != "none":
            args[i] = mutate(args[i], kind, k, dtype, rnd)
    try:
        call(op, args)
    except PLEError:
        pass
    except Exception:
        desc = [(type(a).__name__, getattr(a, "dtype", a) if not isinstance(a, torch.Tensor) else (a.dtype, tuple(a.shape))) for a in args]
        print(f"{op}: a non-ple error for {mutations}: {desc}", file=sys.stderr)
        raise


fuzz()
print(f"{op}: ok")
"""


@pytest.mark.parametrize("op", sorted(VALID))
def test_fuzzed_arguments_never_crash_and_are_refused_with_ple_errors(op):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(
        [sys.executable, "-c", _FUZZ, op, "300"], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, f"exit {res.returncode} (negative: killed by a signal)\n{res.stderr[-4000:]}"
    assert f"{op}: ok" in res.stdout
