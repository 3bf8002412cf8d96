"""torch.compile with gradients on: the engine call of a layer whose weights require grad, the
training call (``forward_padded``) with a trainable table, and a model's training steps, each
compared with eager. aot_eager (AOTAutograd's forward and backward graphs, no Inductor) keeps the
compiles short on 2 cores; what is checked (no warning, no graph break, equal numbers) is decided
before Inductor would run."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import ple
from ple.ngram import NgramInputError
from ple.table import MemoryTable
from tests.integrations.helpers import EOS, VOCAB
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


def test_forward_padded_with_a_frozen_table_traces_whole_and_equals_eager():
    torch._dynamo.reset()
    layer = _layer(torch.float32, seed=8)
    g = torch.Generator().manual_seed(9)
    h = torch.randn(2, 5, CFG.hc_hidden_size, generator=g)
    ids = torch.randint(0, CFG.vocab_size, (2, 5), generator=g)
    got = torch.compile(layer.forward_padded, backend="aot_eager", fullgraph=True)(h, ids)
    assert torch.equal(got, layer.forward_padded(h, ids))
    bad = ids.clone()
    bad[1, 3] = CFG.vocab_size  # the compiled program's call still refuses a token outside the vocabulary
    with pytest.raises(NgramInputError, match=f"token id {CFG.vocab_size} at position 8"):
        torch.compile(layer.forward_padded, backend="aot_eager", fullgraph=True)(h, bad)


def test_compiled_forward_padded_gives_a_table_that_requires_grad_its_gradient():
    """A stored fp32 table whose data is a parameter (``patch(table_grad=True)``): the compiled call looks
    it up eagerly (one graph break) so its data gets eager's gradient, never none."""
    torch._dynamo.reset()
    layer = _layer(torch.float32, seed=10)
    data = torch.nn.Parameter(layer.table.data.clone())
    layer.set_table(MemoryTable(data))
    g = torch.Generator().manual_seed(11)
    h = torch.randn(2, 5, CFG.hc_hidden_size, generator=g)
    ids = torch.randint(0, CFG.vocab_size, (2, 5), generator=g)
    layer.forward_padded(h, ids).square().sum().backward()
    want, data.grad = data.grad.clone(), None
    assert want.abs().sum() > 0
    torch.compile(layer.forward_padded, backend="aot_eager")(h, ids).square().sum().backward()
    assert data.grad is not None and torch.allclose(data.grad, want, rtol=1e-5, atol=1e-6)


def _trained(tmp_path, compiled: bool):
    from ple.integrations.transformers import from_pretrained, patched_layers
    from ple.train import SparseAdam, trainable
    from tests.integrations.helpers import tiny_config, tiny_model

    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        tiny_model(tiny_config(split_ngram_parts=4, ple_embed_dim=128), seed=51).save_pretrained(ckpt)
    model = from_pretrained(ckpt, table_dir=tmp_path / ("tables_c" if compiled else "tables_e"))
    tables = SparseAdam(trainable(model), lr=0.05)
    rest = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    ids = torch.randint(EOS + 1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    model.train()
    losses = []
    for _ in range(3):
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        tables.step()
        rest.step()
        rest.zero_grad()
        losses.append(float(loss.detach()))
    rows = [w.layer.table.overlay.range(0, w.layer.table.rows) for w in patched_layers(model)]
    return losses, rows, {k: v.detach().clone() for k, v in model.named_parameters()}, model


def test_compiled_training_steps_equal_eager(tmp_path):
    torch._dynamo.reset()
    want_losses, want_rows, want_params, _ = _trained(tmp_path, compiled=False)
    got_losses, got_rows, got_params, model = _trained(tmp_path, compiled=True)
    ids = torch.randint(EOS + 1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    breaks = torch._dynamo.explain(model)(input_ids=ids, labels=ids).break_reasons
    ple_dir = os.path.dirname(ple.__file__)
    assert breaks  # transformers' own (aten.nonzero in its MoE routing), none in a PLE layer
    assert not [b.reason for b in breaks if any(f.filename.startswith(ple_dir) for f in b.user_stack)]
    assert got_losses == pytest.approx(want_losses, abs=1e-5)
    assert want_losses[-1] < want_losses[0]
    for (gi, gv), (wi, wv) in zip(got_rows, want_rows):
        assert torch.equal(gi, wi) and len(wi) > 10  # the same rows trained
        torch.testing.assert_close(gv, wv, rtol=0, atol=1e-5)
    assert got_params.keys() == want_params.keys()
    for name, w in want_params.items():
        torch.testing.assert_close(got_params[name], w, rtol=0, atol=1e-5, msg=name)


def _train_layer(compiled: str | None, fused: bool, quantized: bool, steps: int = 4):
    """``steps`` training steps of one layer whose table is trainable (SparseAdam for its rows, AdamW
    for its weights): the losses, the trained rows ``(ids, values)`` and the weights after them."""
    from ple.train import SparseAdam, trainable

    layer = _layer(torch.float32, seed=12, quantized=quantized)
    tables = SparseAdam(trainable(layer), lr=0.05, fused=fused)
    rest = torch.optim.AdamW(layer.parameters(), lr=3e-3)
    call = layer.forward_padded
    if compiled is not None:
        call = torch.compile(layer.forward_padded, backend=compiled, fullgraph=True)  # no graph break, or it raises
    g = torch.Generator().manual_seed(13)
    h = torch.randn(2, 6, CFG.hc_hidden_size, generator=g)
    ids = torch.randint(0, CFG.vocab_size, (2, 6), generator=g)
    ids[1, :3] = ids[0, :3]  # rows read more than once in a step: their gradients summed
    losses = []
    for _ in range(steps):
        loss = call(h, ids).square().mean()
        loss.backward()
        if not fused:
            assert layer.table_weight.grad is not None and layer.table_weight.grad.is_sparse
        tables.step()
        rest.step()
        rest.zero_grad()
        losses.append(float(loss.detach()))
    rows = layer.table.overlay.range(0, layer.table.rows)
    return losses, rows, {k: v.detach().clone() for k, v in layer.named_parameters()}


@pytest.mark.parametrize(
    "backend, fused, quantized",
    [("aot_eager", False, False), ("aot_eager", True, False), ("aot_eager", False, True), ("inductor", False, False)],
    ids=["step", "fused", "int8", "inductor"],  # Inductor: its graph cache keys the table reference, never pickles it
)
def test_compiled_forward_padded_with_a_trainable_table_traces_whole_and_trains_as_eagerly(backend, fused, quantized):
    torch._dynamo.reset()
    counters.clear()
    want_losses, (want_ids, want_rows), want_params = _train_layer(None, fused, quantized)
    got_losses, (got_ids, got_rows), got_params = _train_layer(backend, fused, quantized)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert got_losses == pytest.approx(want_losses, abs=1e-5) and want_losses[-1] < want_losses[0]
    assert torch.equal(got_ids, want_ids) and len(want_ids) > 20  # the same rows trained
    torch.testing.assert_close(got_rows, want_rows, rtol=0, atol=1e-5)
    for name, w in want_params.items():
        torch.testing.assert_close(got_params[name], w, rtol=0, atol=1e-5, msg=name)


def _trainer_run(tmp_path, ckpt, compiled: bool):
    """Three steps of transformers' ``Trainer`` on a model whose tables are trainable, with
    ``torch_compile=True`` (aot_eager: AOTAutograd's graphs without Inductor, short on 2 cores) or
    without: the logged losses, the trained rows and the other weights after them."""
    from transformers import Trainer, TrainingArguments

    from ple.integrations.transformers import from_pretrained, patched_layers
    from ple.train import SGD, CombinedOptimizer, trainable

    model = from_pretrained(ckpt, table_dir=tmp_path / ("tables_c" if compiled else "tables_e"))
    # SGD: the update is linear in the gradient, so the few ulps by which transformers' own layers differ
    # compiled stay ulps (Adam's first steps, m / sqrt(v), turn a gradient element near zero into +-lr
    # whatever its size: its compiled and eager updates differ by up to 7e-5 with the tables frozen)
    opt = CombinedOptimizer(SGD(trainable(model), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(EOS + 1, VOCAB, (8, 24), generator=torch.Generator().manual_seed(5))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, save_strategy="no",
        report_to=[], use_cpu=True, logging_steps=1, max_grad_norm=1.0, torch_compile=compiled,
        torch_compile_backend="aot_eager" if compiled else None,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
    trainer.train()
    assert (trainer.model_wrapped is not model) == compiled  # the compiled module trained
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rows = [w.layer.table.overlay.range(0, w.layer.table.rows) for w in patched_layers(model)]
    return losses, rows, {k: v.detach().clone() for k, v in model.named_parameters()}


def test_trainer_with_torch_compile_trains_the_tables_as_without(tmp_path):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from tests.integrations.helpers import tiny_config, tiny_model

    torch._dynamo.reset()
    counters.clear()
    ckpt = tmp_path / "ckpt"
    tiny_model(tiny_config(split_ngram_parts=4, ple_embed_dim=128), seed=54).save_pretrained(ckpt)
    want_losses, want_rows, want_params = _trainer_run(tmp_path, ckpt, compiled=False)
    got_losses, got_rows, got_params = _trainer_run(tmp_path, ckpt, compiled=True)
    assert counters["stats"]["unique_graphs"] > 0  # it did compile
    assert len(got_losses) == 3 and got_losses == pytest.approx(want_losses, abs=1e-5)
    for (gi, gv), (wi, wv) in zip(got_rows, want_rows, strict=True):
        assert torch.equal(gi, wi) and len(wi) > 20  # the same rows trained
        torch.testing.assert_close(gv, wv, rtol=0, atol=1e-5)
    for name, w in want_params.items():
        torch.testing.assert_close(got_params[name], w, rtol=0, atol=1e-5, msg=name)
