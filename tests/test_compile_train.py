"""torch.compile with gradients on: the engine call of a layer whose weights require grad, the
training call (``forward_padded``) with a trainable table, and a model's training steps, each
compared with eager. aot_eager (AOTAutograd's forward and backward graphs, no Inductor) keeps the
compiles short on 2 cores; what is checked (no warning, no graph break, equal numbers) is decided
before Inductor would run."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from tests.test_compile import CFG, _layer, _step

pytestmark = pytest.mark.slow


def test_compiled_engine_call_with_weights_that_require_grad_warns_nothing_and_records_nothing():
    torch._dynamo.reset()
    counters.clear()
    layer = _layer(torch.float32, seed=4)
    assert all(p.requires_grad for p in layer.parameters())
    eager_pool, compiled_pool = layer.new_state_pool(4), layer.new_state_pool(4)
    h, ids, be = _step(layer, [3, 2], [0, 1], [False, False], eager_pool, seed=5)
    _, _, bc = _step(layer, [3, 2], [0, 1], [False, False], compiled_pool, seed=5)
    want = layer(h, ids, be)
    engine = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the autograd fallback's "silently incorrect behavior" warning
        got = engine(h, ids, bc)
    assert not got.requires_grad and got.grad_fn is None  # as eagerly: the engine call records nothing
    assert torch.equal(got, want) and torch.equal(compiled_pool, eager_pool)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_the_operators_outputs_never_require_grad():
    layer = _layer(torch.float32, seed=6)
    pool = layer.new_state_pool(4)
    h, ids, b = _step(layer, [4], [0], [False], pool, seed=7)
    with torch.no_grad():
        rows = layer.table.lookup(layer_ids(layer, ids, b), torch.float32)
    key, value = (x.detach().requires_grad_(True) for x in layer.project(rows))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = torch.ops.ple.gate_conv(
            key, value, h.requires_grad_(True), *layer._fused_args, b.query_start_loc, b.conv_state,
            b.slot_indices, b.has_initial_state, b.num_rejected, torch.empty(0, dtype=torch.int64), False, None,
            True, False,
        )[0]  # fmt: skip
    assert not out.requires_grad


def layer_ids(layer, ids, batch):
    return torch.ops.ple.ngram_ids(
        ids, batch.query_start_loc, batch.ngram_context, layer.ngram_multipliers, layer.ngram_head_sizes,
        layer.ngram_head_offsets, layer.layout.heads_per_ngram, CFG.eos_token_id, CFG.vocab_size,
    )  # fmt: skip
