"""The engine call under torch.compile (Inductor, fullgraph) and torch.export, on the CPU.

What is asserted: no graph break (fullgraph=True, and dynamo's counter stays empty); one compiled
program for every token count T >= 1 and request count R when the batch dimensions are marked
unbacked (the bound: 1 compile), and for several layers of one geometry; outputs and states equal
to eager bit for bit (the same kernels run: the ops are opaque to Inductor and its GEMM is ATen's);
an exported program reproduces eager at other sizes and holds the table only by reference.
Inductor compiles take seconds on 2 cores, so there are few of these tests.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from ple.config import PLEConfig
from ple.layer import PLELayer
from ple.runtime import Batch
from ple.table import MemoryTable, quantize_rows

pytestmark = pytest.mark.slow

CFG = PLEConfig(
    hidden_size=16,
    hc_count=4,
    ple_embed_dim=32,
    ngram_size=3,
    heads_per_ngram=2,
    vocab_size=1000,
    eos_token_id=7,
    ngram_vocab_size_base=5000,
    make_ngram_vocab_size_divisible_by=16,
    split_ngram_parts=4,
    ple_layer_ids=(1, 2),
)


def _layer(dtype, index=0, seed=0, quantized=False) -> PLELayer:
    g = torch.Generator().manual_seed(seed)
    layer = PLELayer(CFG, index, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    lay = layer.layout
    rows = torch.randn(lay.padded_rows, lay.head_dim, generator=g)
    layer.set_table(MemoryTable(*quantize_rows(rows, "int8_row")) if quantized else MemoryTable(rows.to(dtype)))
    return layer


def _step(layer, lens, slots, has_init, pool, seed):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, CFG.vocab_size, (len(lens), CFG.ngram_size - 1), generator=g)
    batch = Batch.build(lens, slots, ctx, pool, has_initial_state=has_init)
    tokens = sum(lens)
    hidden = torch.randn(tokens, CFG.hc_hidden_size, generator=g).to(layer.dtype)
    ids = torch.randint(0, CFG.vocab_size, (tokens,), generator=g)
    return hidden, ids, batch


def _mark_unbacked(hidden, ids, batch):
    for t in (hidden, ids, batch.query_start_loc, batch.slot_indices, batch.has_initial_state, batch.ngram_context):
        torch._dynamo.decorators.mark_unbacked(t, 0)
    torch._dynamo.decorators.mark_unbacked(batch.num_rejected, 0)


# (lens, slots, has_initial_state): T in {1, 2, 3, 7, 64, 100}, R in {1, 2, 3}, decode and prefill
STEPS = [
    ([1], [0], [False]),
    ([2], [1], [False]),
    ([3], [2], [False]),
    ([4, 3], [0, 3], [True, False]),
    ([64], [4], [False]),
    ([1, 1, 98], [0, 1, 5], [True, True, False]),
    ([1, 1], [0, 1], [True, True]),
]


def test_compiled_engine_call_one_program_no_breaks_equal_to_eager():
    torch._dynamo.reset()
    counters.clear()
    layers = [_layer(torch.float32, 0, seed=1), _layer(torch.float32, 1, seed=2, quantized=True)]
    cnt = CompileCounterWithBackend("inductor")

    @torch.compile(backend=cnt, fullgraph=True)
    def engine(layer, hidden, ids, batch):
        return layer(hidden, ids, batch, return_conv_input=True)

    pools = {id(layer): (layer.new_state_pool(8), layer.new_state_pool(8)) for layer in layers}
    for i, (lens, slots, init) in enumerate(STEPS):
        for layer in layers:
            eager_pool, compiled_pool = pools[id(layer)]
            h, ids, be = _step(layer, lens, slots, init, eager_pool, seed=10 + i)
            _, _, bc = _step(layer, lens, slots, init, compiled_pool, seed=10 + i)
            _mark_unbacked(h, ids, bc)
            want, want_c = layer(h, ids, be, return_conv_input=True)
            with torch.no_grad():
                got, got_c = engine(layer, h, ids, bc)
            assert torch.equal(got, want) and torch.equal(got_c, want_c), (i, layer.ple_layer_index)
            assert torch.equal(compiled_pool, eager_pool), (i, layer.ple_layer_index)
    assert cnt.frame_count == 1, cnt.frame_count  # every T, R and both layers: one program
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the table is swapped through the reference: the same program reads the new rows
    layer = layers[0]
    table = layer.table
    layer.set_table(MemoryTable(table.data * 2))
    eager_pool, compiled_pool = pools[id(layer)]
    h, ids, be = _step(layer, [3], [6], [False], eager_pool, seed=99)
    _, _, bc = _step(layer, [3], [6], [False], compiled_pool, seed=99)
    _mark_unbacked(h, ids, bc)
    with torch.no_grad():
        got, _ = engine(layer, h, ids, bc)
    assert torch.equal(got, layer(h, ids, be)) and cnt.frame_count == 1


def test_exported_engine_call_reproduces_eager_and_holds_the_table_by_reference():
    from torch.export import Dim

    layer = _layer(torch.bfloat16, 0, seed=3).eval()
    pool = layer.new_state_pool(8)
    h, ids, b = _step(layer, [5, 3], [0, 1], [False, False], pool, seed=0)
    t, r = Dim("T", min=1, max=1 << 20), Dim("R", min=1, max=4096)
    shapes = {
        "hidden": {0: t},
        "input_ids": {0: t},
        "batch": [{0: r + 1}, {0: r}, {0: r}, {0: r}, {0: r}, None, None, None],
    }
    with torch.no_grad():
        ep = torch.export.export(layer, (h, ids, b), dynamic_shapes=shapes)
    kinds = {s.kind.name for s in ep.graph_signature.input_specs}
    assert "CUSTOM_OBJ" in kinds  # the TableRef
    table_numel = layer.table.data.numel()
    assert all(getattr(c, "numel", lambda: 0)() < table_numel for c in ep.constants.values())
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"ple.ngram_ids.default", "ple.table_lookup.default", "ple.gate_conv.default"} <= targets
    module = ep.module()
    eager_pool, exported_pool = layer.new_state_pool(8), layer.new_state_pool(8)
    for i, (lens, slots, init) in enumerate(STEPS):
        h, ids, be = _step(layer, lens, slots, init, eager_pool, seed=20 + i)
        _, _, bx = _step(layer, lens, slots, init, exported_pool, seed=20 + i)
        want = layer(h, ids, be)
        with torch.no_grad():
            got = module(h, ids, bx)
        assert torch.equal(got, want) and torch.equal(exported_pool, eager_pool), i
