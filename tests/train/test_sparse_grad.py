"""The table's row-sparse gradient through ``PLELayer.forward_padded``, on every tier and format:
the distinct rows read and their summed gradients, equal to the dense gradient of the same rows
(today's memory-tier gradient, of a dequantized copy), zero elsewhere by construction; frozen and
inference calls record nothing; the adapted table serves exact rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ple.layer
from ple.ngram import ngram_ids
from ple.runtime import Batch
from ple.table import MemoryTable
from ple.table.formats.catalog import FORMATS
from ple.table.tiers.adapted import AdaptedTable, RowOverlay
from ple.train import freeze, table_parameters, trainable
from tests.train._helpers import CFG, TIERS, batch, dequantized, make_tier, new_layer


def _ids_read(layer, ids, attn):
    """The row ids ``forward_padded`` reads for ``ids [B, S]`` (as it computes them)."""
    b, s = ids.shape
    if attn is not None:
        ids = torch.where(attn.bool(), ids, CFG.eos_token_id)
    qsl = torch.arange(0, b * s + 1, s, dtype=torch.int64)
    ctx = torch.full((b, CFG.ngram_size - 1), CFG.eos_token_id, dtype=torch.int64)
    return ngram_ids(ids.reshape(-1), qsl, ctx, layer.layout, CFG.eos_token_id)


def _loss(out, seed=7):
    g = torch.Generator().manual_seed(seed)
    return (out * torch.randn(out.shape, generator=g)).sum()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tier", TIERS)
def test_sparse_gradient_equals_the_dense_one_on_every_tier_and_format(tmp_path, tier, fmt):
    table = make_tier(tier, fmt, tmp_path, seed=3)
    layer = new_layer(seed=1, table=table)
    dense_table = nn.Parameter(dequantized(table))
    reference = new_layer(seed=1, table=MemoryTable(dense_table))
    (handle,) = trainable(layer)
    assert handle is layer.table_weight and handle.requires_grad
    assert handle.untyped_storage().nbytes() == 4  # one stored zero, whatever the table's size
    assert not any(p is handle for p in layer.parameters()) and "table_weight" not in layer.state_dict()

    hidden, ids, attn = batch(seed=5, mask=True)
    out = layer.forward_padded(hidden, ids, attn)
    want = reference.forward_padded(hidden, ids, attn)
    assert torch.equal(out, want)  # the fp32 lookup of every tier is the dequantized copy's rows
    _loss(out).backward()
    _loss(want).backward()

    grad = handle.grad
    assert grad.is_sparse and grad.dtype == torch.float32 and grad.shape == handle.shape
    read = _ids_read(layer, ids, attn).reshape(-1)
    rows, counts = torch.unique(read, return_counts=True)
    assert torch.equal(grad._indices()[0], rows)  # every row read, each once, sorted; nothing else stored
    grad = grad.coalesce()
    dense = dense_table.grad
    assert torch.count_nonzero(dense.abs().sum(1)[~torch.isin(torch.arange(table.rows), rows)]) == 0
    torch.testing.assert_close(grad.values(), dense[rows], rtol=1e-5, atol=1e-6)
    once = counts == 1
    assert once.sum() > 10
    assert torch.equal(grad.values()[once], dense[rows[once]])  # one term: the same bits
    for name, p in layer.named_parameters():  # the other weights' gradients are unchanged
        assert torch.equal(p.grad, reference.get_parameter(name).grad), name
    table.close()


def test_sums_are_taken_in_position_order_and_accumulate_over_backward_calls():
    layer = new_layer(seed=2, table=MemoryTable(torch.randn(CFG.layout(0).padded_rows, CFG.layout(0).head_dim)))
    (handle,) = trainable(layer)
    hidden, ids, _ = batch(seed=6, b=3, s=20)
    ids[:, :] = ids[0, :4].repeat(15)[:20]  # few distinct n-grams: rows read many times
    out = layer.forward_padded(hidden, ids)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * grad_out).sum().backward()
    first = handle.grad.coalesce()
    # the literal sum, in position order, of the lookup's output gradient per distinct id
    read = _ids_read(layer, ids, None).reshape(-1)
    rows = torch.unique(read)
    assert torch.equal(first.indices()[0], rows)
    # a second backward adds to the first (autograd's accumulation of sparse gradients)
    layer.forward_padded(hidden, ids).mul(grad_out).sum().backward()
    both = handle.grad.coalesce()
    assert torch.equal(both.indices()[0], rows)
    torch.testing.assert_close(both.values(), 2 * first.values(), rtol=1e-6, atol=0)


def test_row_sums_are_the_position_ordered_sum():
    from ple.table.grad import row_sums

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (50, 3), generator=g)
    # magnitudes that make the order of a sum show in its bits
    grad = torch.randn(50, 3 * 4, generator=g) * torch.logspace(-6, 6, 50).unsqueeze(1)
    rows, values = row_sums(ids, grad, 4)
    flat, per = ids.reshape(-1), grad.reshape(-1, 4)
    for r, row in enumerate(rows.tolist()):
        want = torch.zeros(4)
        for i in (flat == row).nonzero().flatten().tolist():
            want = want + per[i]
        assert torch.equal(values[r], want), row


def test_frozen_and_inference_calls_never_record_the_lookup(monkeypatch):
    lay = CFG.layout(0)
    base = MemoryTable(torch.randn(lay.padded_rows, lay.head_dim))
    layer = new_layer(seed=3, table=base)
    hidden, ids, _ = batch(seed=8)
    before = layer.forward_padded(hidden, ids).detach()
    trainable(layer)
    calls = []
    real = ple.layer.lookup_with_grad
    monkeypatch.setattr(ple.layer, "lookup_with_grad", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        out = layer.forward_padded(hidden, ids)
    assert out.grad_fn is None and not calls
    assert torch.equal(out, before)  # an empty overlay serves the base's rows
    with torch.inference_mode():
        layer.forward_padded(hidden, ids)
    assert not calls
    layer.table_weight.requires_grad_(False)  # frozen table: the plain lookup
    layer.forward_padded(hidden, ids).sum().backward()
    assert not calls and layer.table_weight.grad is None
    layer.table_weight.requires_grad_(True)
    layer.forward_padded(hidden, ids).sum().backward()
    assert calls == [1] and layer.table_weight.grad is not None
    freeze(layer)
    assert layer.table_weight is None and table_parameters(layer) == []
    # the engine call of a trainable layer is inference: no graph, the adapted rows
    trainable(layer)
    pool = layer.new_state_pool(2)
    flat = ids.reshape(-1)
    b = Batch.build([12, 12], [0, 1], torch.full((2, 2), CFG.eos_token_id), pool)
    got = layer(hidden.reshape(24, -1), flat, b)
    assert got.grad_fn is None and len(calls) == 1


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8_row", "q4_0", "nvfp4"])
@pytest.mark.parametrize("tier", TIERS)
def test_adapted_lookups_are_the_base_rows_but_the_overlay_rows(tmp_path, tier, fmt):
    base = make_tier(tier, fmt, tmp_path, seed=4)
    overlay = RowOverlay(base.rows, base.head_dim)
    g = torch.Generator().manual_seed(9)
    held = torch.randperm(base.rows, generator=g)[:40]
    values = torch.randn(40, base.head_dim, generator=g)
    overlay.put(held, values)
    table = AdaptedTable(base, overlay)
    ids = torch.randint(0, base.rows, (64, 4), generator=g)
    ids[0] = held[:4]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = table.lookup(ids, dtype).view(-1, base.head_dim)
        want = base.lookup(ids, dtype).view(-1, base.head_dim)
        flat = ids.reshape(-1)
        mine = torch.isin(flat, held)
        assert mine.sum() >= 4
        assert torch.equal(got[~mine], want[~mine])
        pos = torch.searchsorted(torch.sort(held).values, flat[mine])
        assert torch.equal(got[mine], values[torch.argsort(held)][pos].to(dtype))
        assert torch.equal(table.start_prefetch(ids, dtype).wait().view(-1, base.head_dim), got)
    base.close()


def test_an_overlay_that_outgrows_its_budget_spills_and_reads_back_the_same(tmp_path):
    lay = CFG.layout(0)
    width = lay.head_dim
    overlay = RowOverlay(lay.padded_rows, width, memory_budget=10 * width * 4, spill_dir=tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(lay.padded_rows, generator=g)[:300]
    values = torch.randn(300, width, generator=g)
    overlay.put(ids[:7], values[:7])
    overlay.put(ids[7:], values[7:])
    assert overlay.spilled_rows == 290 and overlay.nbytes < 300 * width * 4
    assert list(tmp_path.iterdir()) == []  # the spill file has no name
    where, got = overlay.get(ids)
    assert torch.equal(where, torch.arange(300)) and torch.equal(got, values)
    overlay.put(ids[::3], -values[::3])
    where, got = overlay.get(ids[::3])
    assert torch.equal(got, -values[::3])
    overlay.close()


@pytest.mark.slow
def test_compiled_engine_call_serves_adapters_through_the_reference_without_recompiling():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    lay = CFG.layout(0)
    base = MemoryTable(torch.randn(lay.padded_rows, lay.head_dim, generator=torch.Generator().manual_seed(2)))
    layer = new_layer(seed=4, table=base)
    cnt = CompileCounterWithBackend("inductor")

    @torch.compile(backend=cnt, fullgraph=True)
    def engine(layer, hidden, ids, batch):
        return layer(hidden, ids, batch)

    hidden, ids, _ = batch(seed=11, b=1, s=16)
    h, flat = hidden.reshape(16, -1), ids.reshape(-1)

    def run(fn):
        pool = layer.new_state_pool(1)
        b = Batch.build([16], [0], torch.full((1, 2), CFG.eos_token_id), pool)
        with torch.no_grad():
            return fn(layer, h, flat, b)

    plain = run(engine)
    assert torch.equal(plain, run(lambda *a: a[0](*a[1:])))
    for seed in (1, 2):  # two adapters, swapped under the compiled program
        overlay = RowOverlay(lay.padded_rows, lay.head_dim)
        overlay.put(torch.arange(0, lay.padded_rows, 2), torch.randn(lay.padded_rows // 2, lay.head_dim) * seed)
        layer.set_table(AdaptedTable(base, overlay))
        got = run(engine)
        assert torch.equal(got, run(lambda *a: a[0](*a[1:]))) and not torch.equal(got, plain)
    layer.set_table(base)  # removed: the base's rows again
    assert torch.equal(run(engine), plain)
    assert cnt.frame_count == 1 and not counters["graph_break"]
