"""Fine-tuning a ``from_pretrained`` model whose tables stay on disk: ple's optimizer for the tables,
a torch optimizer for the other weights, the table files untouched; the trained rows served back
through ``from_pretrained(..., table_adapter=PATH)``, or merged and saved in the published layout."""

from __future__ import annotations

import hashlib

import pytest
import torch

from ple.integrations.transformers import from_pretrained, patched_layers
from ple.table.tiers.adapted import AdaptedTable
from ple.train import SparseAdam, merge_model, save_adapter, table_parameters, trainable
from tests.integrations.helpers import EOS, VOCAB, generate, tiny_config, tiny_model


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _checkpoint(tmp_path, seed=51):
    path = tmp_path / "ckpt"
    tiny_model(tiny_config(split_ngram_parts=4, ple_embed_dim=128), seed=seed).save_pretrained(
        path
    )  # head_dim 32: q8_0 blocks
    return path


def _text(seed=0, b=4, s=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(EOS + 1, VOCAB, (b, s), generator=g)


def _sha_tables(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.pletable"))}


@pytest.mark.parametrize("tier", ["mmap", "direct"])
def test_a_from_pretrained_model_fine_tunes_with_its_tables_on_disk(tmp_path, tier):
    ckpt = _checkpoint(tmp_path)
    model = from_pretrained(ckpt, table_dir=tmp_path / "tables", table_tier=tier, table_format="q8_0")
    before = _sha_tables(tmp_path / "tables")
    handles = trainable(model)
    assert len(handles) == 2 and not any(p is h for p in model.parameters() for h in handles)
    tables = SparseAdam(handles, lr=0.05)
    rest = torch.optim.AdamW(model.parameters(), lr=3e-3)  # any torch optimizer: the handles are not there
    ids = _text()
    losses = []
    model.train()
    for _ in range(15):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        tables.step()
        rest.step()
        rest.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses
    assert _sha_tables(tmp_path / "tables") == before  # the table files are never written
    for w in patched_layers(model):
        assert isinstance(w.layer.table, AdaptedTable) and len(w.layer.table.overlay) > 20


def test_the_tables_train_alone_in_a_frozen_model(tmp_path):
    model = from_pretrained(_checkpoint(tmp_path), table_dir=tmp_path / "tables")
    model.requires_grad_(False)  # nothing else records a graph: the table's handle asks for one
    opt = SparseAdam(trainable(model), lr=0.1)
    ids = _text(seed=1)
    first = None
    for _ in range(12):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(h.grad is not None for h in table_parameters(model))
        opt.step()
        first = float(loss.detach()) if first is None else first
    assert float(loss.detach()) < first


def test_an_adapter_is_served_by_from_pretrained_and_merged_into_the_published_layout(tmp_path):
    ckpt = _checkpoint(tmp_path, seed=52)
    model = from_pretrained(ckpt, table_dir=tmp_path / "tables", table_format="q8_0")
    opt = SparseAdam(trainable(model), lr=0.05)
    ids = _text(seed=2)
    for _ in range(5):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    adapter = save_adapter(tmp_path / "adapter.safetensors", model)
    prompt = _text(seed=3, b=2, s=6)
    model.eval()
    want = generate(model, prompt)

    served = from_pretrained(ckpt, table_dir=tmp_path / "tables", table_format="q8_0", table_adapter=adapter)
    got = generate(served, prompt)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(want.logits, got.logits, strict=True):
        assert torch.equal(a, b)  # the same rows, the same computation
    plain = generate(from_pretrained(ckpt, table_dir=tmp_path / "tables", table_format="q8_0"), prompt)
    assert not all(torch.equal(a, b) for a, b in zip(plain.logits, want.logits, strict=True))

    # merged: q8_0 table files with the trained rows requantized, saved in the published layout
    merged = merge_model(served, tmp_path / "merged-tables")
    assert [p.name for p in merged] == sorted(p.name for p in merged) and len(merged) == 2
    assert not any(isinstance(w.layer.table, AdaptedTable) for w in patched_layers(served))
    after_merge = generate(served, prompt)
    served.save_pretrained(tmp_path / "saved")
    reloaded = from_pretrained(tmp_path / "saved", table_dir=tmp_path / "tables2")
    again = generate(reloaded, prompt)
    assert torch.equal(again.sequences, after_merge.sequences)
    for a, b in zip(after_merge.logits, again.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # the merge rounds the trained rows to q8_0 once: close to the adapter's model
    for a, b in zip(want.logits, after_merge.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0.1)


def _combined(model):
    from ple.train import CombinedOptimizer

    return CombinedOptimizer(SparseAdam(trainable(model), lr=0.05), torch.optim.AdamW(model.parameters(), lr=3e-3))


def test_one_optimizer_for_tables_and_weights_drives_a_scheduler_and_resumes(tmp_path):
    ckpt = _checkpoint(tmp_path, seed=53)

    def run(steps, state=None):
        model = from_pretrained(ckpt, table_dir=tmp_path / "tables")
        opt = _combined(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        if state is not None:  # resume: the weights, the trained rows, both optimizers, the schedule
            from ple.train import load_adapter

            with torch.no_grad():
                for p, q in zip(model.parameters(), state[3], strict=True):
                    p.copy_(q)
            load_adapter(model, state[2])
            opt.load_state_dict(state[0])
            sched.load_state_dict(state[1])
        model.train()
        for i in range(steps):
            ids = _text(seed=10 + i + (0 if state is None else 3))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        return model, opt, sched

    model, opt, sched = run(6)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05 / 7, 3e-3 / 7])  # one schedule for both
    model3, opt3, sched3 = run(3)
    path = save_adapter(tmp_path / "a.safetensors", model3)
    state = (opt3.state_dict(), sched3.state_dict(), path, [p.detach().clone() for p in model3.parameters()])
    resumed, _, _ = run(3, state)
    for a, b in zip(patched_layers(model), patched_layers(resumed), strict=True):
        assert torch.equal(a.layer.table.overlay.ids(), b.layer.table.overlay.ids())
    for (n, p), (_, q) in zip(model.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    for a, b in zip(patched_layers(model), patched_layers(resumed), strict=True):
        ids = a.layer.table.overlay.ids()
        assert torch.equal(a.layer.table.overlay.get(ids)[1], b.layer.table.overlay.get(ids)[1])


def test_transformers_trainer_fine_tunes_the_tables_on_disk(tmp_path):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from transformers import Trainer, TrainingArguments

    model = from_pretrained(_checkpoint(tmp_path, seed=54), table_dir=tmp_path / "tables")
    opt = _combined(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ids = _text(seed=5, b=8)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=12, per_device_train_batch_size=8, save_strategy="no",
        report_to=[], use_cpu=True, logging_steps=1, max_grad_norm=1.0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    assert all(len(w.layer.table.overlay) > 20 for w in patched_layers(model))
