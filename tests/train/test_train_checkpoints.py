"""Checkpoints of a model whose tables are being trained, and resuming from them.

- transformers' ``Trainer`` (``CombinedOptimizer(SparseAdam(tables), AdamW(rest))``, 8 steps saving every
  4, a second ``Trainer`` resumed from ``checkpoint-4``) ends where the uninterrupted run ends: the
  trained rows, SparseAdam's states and every weight bit for bit; its checkpoints hold the trained rows
  and their states, never a table. Side by side, plain transformers' own resume of the same model with
  dense tables (AdamW on the tables) is measured: it is no closer. The MoE experts are frozen on both
  sides: transformers' own resume does not restore them (``save_pretrained`` writes them one expert at a
  time, ``Trainer``'s ``load_state_dict`` expects them fused), nor a dense table (written as shards).
- The same with every weight trained, the experts included: ple's model takes the per-expert keys back
  onto its fused experts, and the resumed run ends bit for bit where the uninterrupted one ends (the
  weights, the trained rows, SparseAdam's and AdamW's states).
- ``model.state_dict()`` while the tables train: the weights and each table's trained rows exactly;
  ``load_state_dict`` of it on a fresh model puts them back (same logits); after ``freeze`` it is the
  published layout with the trained rows merged.
- A user's loop resumed from ``torch.save(model.state_dict())`` and the optimizer's state dict, and from
  an adapter with the optimizer's states (``save_adapter`` / ``load_adapter`` / ``load_optimizer_state``),
  ends where the uninterrupted loop ends, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from ple.errors import UsageError
from ple.integrations.transformers import from_pretrained, patched_layers
from ple.table.tiers.adapted import AdaptedTable
from ple.train import (
    CombinedOptimizer,
    SparseAdam,
    freeze,
    load_adapter,
    load_optimizer_state,
    save_adapter,
    trainable,
)
from tests.integrations.helpers import EOS, VOCAB, generate, tiny_config, tiny_model


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "model"
    cfg = tiny_config(split_ngram_parts=4, ple_embed_dim=64, ngram_vocab_size_base=1500)  # 6,000 rows
    tiny_model(cfg, seed=91).save_pretrained(path)
    return path


def _freeze_experts(model) -> list[torch.nn.Parameter]:
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    return [p for p in model.parameters() if p.requires_grad]


def _ple_model(ckpt, tables, freeze_experts=True):
    model = from_pretrained(ckpt, table_dir=tables)
    rest = _freeze_experts(model) if freeze_experts else [p for p in model.parameters() if p.requires_grad]
    opt = CombinedOptimizer(SparseAdam(trainable(model), lr=0.05), torch.optim.AdamW(rest, lr=3e-3))
    return model, opt


def _trained_rows(model):
    return [w.layer.table.overlay.range(0, w.layer.table.rows) for w in patched_layers(model)]


def _states(opt):
    sparse = opt.optimizers[0]
    return [sparse.row_state(p).export() for p in table_parameters_of(sparse)]


def table_parameters_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


# ---------------------------------------------------------------------------------------------- Trainer
def _trainer_run(model, opt, out, resume=None):
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(EOS + 1, VOCAB, (32, 12), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(out), max_steps=8, per_device_train_batch_size=4, save_strategy="steps", save_steps=4,
        report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched)).train(resume_from_checkpoint=resume)
    return model


def _dense_run(ckpt, out, resume=None):
    """Plain transformers: the same checkpoint, its tables dense parameters trained by AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    opt = torch.optim.AdamW(_freeze_experts(model), lr=3e-3)
    return _trainer_run(model, opt, out, resume)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_trainer_resumes_from_its_checkpoint_as_if_never_interrupted(ckpt, tmp_path):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    tables = tmp_path / "tables"
    whole, whole_opt = _ple_model(ckpt, tables)
    _trainer_run(whole, whole_opt, tmp_path / "a")
    resumed, resumed_opt = _ple_model(ckpt, tables)
    _trainer_run(resumed, resumed_opt, tmp_path / "b", resume=tmp_path / "a" / "checkpoint-4")

    for (ids_a, rows_a), (ids_b, rows_b) in zip(_trained_rows(whole), _trained_rows(resumed), strict=True):
        assert ids_a.numel() > 100 and torch.equal(ids_a, ids_b) and torch.equal(rows_a, rows_b)
    for (ids_a, s_a), (ids_b, s_b) in zip(_states(whole_opt), _states(resumed_opt), strict=True):
        assert torch.equal(ids_a, ids_b) and torch.equal(s_a, s_b)
    weights = {n: p.detach() for n, p in whole.named_parameters()}
    ple_diff = _max_diff(weights, {n: p.detach() for n, p in resumed.named_parameters()})
    assert ple_diff == 0.0

    # the checkpoint: the trained rows (fewer than a table's rows), never a table-sized tensor
    table = patched_layers(whole)[0].layer.table
    with safe_open(tmp_path / "a" / "checkpoint-4" / "model.safetensors", "pt") as f:
        table_keys = sorted(k for k in f.keys() if "ngram_embedding" in k)
        assert [k.rsplit(".", 1)[1] for k in table_keys] == ["trained_ids", "trained_rows"] * 2
        assert all(0 < f.get_slice(k).get_shape()[0] < table.rows // 4 for k in table_keys), table.rows
        assert max(f.get_slice(k).get_shape()[0] for k in f.keys()) < table.rows
    saved = torch.load(tmp_path / "a" / "checkpoint-4" / "optimizer.pt", weights_only=True)
    for i, st in saved["optimizers"][0]["state"].items():
        with safe_open(tmp_path / "a" / "checkpoint-4" / "model.safetensors", "pt") as f:
            assert torch.equal(st["rows"], f.get_tensor(table_keys[2 * i])) and st["step"] == 4

    # plain transformers' own resume of the same model with dense tables, measured side by side
    dense_whole = _dense_run(ckpt, tmp_path / "c")
    dense_resumed = _dense_run(ckpt, tmp_path / "d", resume=tmp_path / "c" / "checkpoint-4")
    dense_diff = _max_diff(
        {n: p.detach() for n, p in dense_whole.named_parameters()},
        {n: p.detach() for n, p in dense_resumed.named_parameters()},
    )
    print(f"max |uninterrupted - resumed|: ple {ple_diff:.3g}, plain transformers with dense tables {dense_diff:.3g}")
    assert ple_diff <= dense_diff


def test_trainer_resumes_every_weight_the_moe_experts_included(ckpt, tmp_path):
    """Experts trained too: the checkpoint holds them one expert at a time (transformers' save_pretrained),
    and the resumed model takes them back onto its fused experts (ple.integrations.experts), exactly."""
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    tables = tmp_path / "tables"
    whole, whole_opt = _ple_model(ckpt, tables, freeze_experts=False)
    start = {n: p.detach().clone() for n, p in whole.named_parameters() if ".experts." in n}
    assert len(start) == 2 * 3 and all(p.requires_grad for n, p in whole.named_parameters() if n in start)
    _trainer_run(whole, whole_opt, tmp_path / "a")
    with safe_open(tmp_path / "a" / "checkpoint-4" / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in f.keys()
    resumed, resumed_opt = _ple_model(ckpt, tables, freeze_experts=False)
    _trainer_run(resumed, resumed_opt, tmp_path / "b", resume=tmp_path / "a" / "checkpoint-4")

    for (ids_a, rows_a), (ids_b, rows_b) in zip(_trained_rows(whole), _trained_rows(resumed), strict=True):
        assert ids_a.numel() > 100 and torch.equal(ids_a, ids_b) and torch.equal(rows_a, rows_b)
    for (ids_a, s_a), (ids_b, s_b) in zip(_states(whole_opt), _states(resumed_opt), strict=True):
        assert torch.equal(ids_a, ids_b) and torch.equal(s_a, s_b)
    dense_a, dense_b = whole_opt.optimizers[1], resumed_opt.optimizers[1]
    for p, q in zip(table_parameters_of(dense_a), table_parameters_of(dense_b), strict=True):
        sa, sb = dense_a.state.get(p, {}), dense_b.state.get(q, {})
        assert sorted(sa) == sorted(sb) and all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)
    for (n, p), (_, q) in zip(whole.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert all(not torch.equal(start[n], p) for n, p in whole.named_parameters() if n in start)  # they trained


# ---------------------------------------------------------------------------------------------- state_dict
def _steps(model, opt, first, count):
    model.train()
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(700 + i)
        ids = torch.randint(EOS + 1, VOCAB, (4, 10), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def test_state_dict_holds_the_trained_rows_while_training_and_the_merged_tables_after(ckpt, tmp_path):
    model, opt = _ple_model(ckpt, tmp_path / "tables")
    _steps(model, opt, 0, 3)
    sd = model.state_dict()
    rows = _trained_rows(model)
    for w, (ids, values) in zip(patched_layers(model), rows, strict=True):
        base = [k for k in sd if k.startswith(f"model.layers.{w.layer_idx}.") and "ngram_embedding" in k]
        assert sorted(k.rsplit(".", 1)[1] for k in base) == ["trained_ids", "trained_rows"]
        key = next(k for k in base if k.endswith("trained_ids"))
        assert torch.equal(sd[key], ids) and torch.equal(sd[key.replace("_ids", "_rows")], values)
    torch.save(sd, tmp_path / "sd.pt")

    fresh = from_pretrained(ckpt, table_dir=tmp_path / "tables")  # not trainable: the rows come with an overlay
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    for (ids_a, rows_a), w in zip(rows, patched_layers(fresh), strict=True):
        assert isinstance(w.layer.table, AdaptedTable)
        ids_b, rows_b = w.layer.table.overlay.range(0, w.layer.table.rows)
        assert torch.equal(ids_a, ids_b) and torch.equal(rows_a, rows_b)
    prompt = torch.randint(EOS + 1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    model.eval(), fresh.eval()
    want, got = generate(model, prompt), generate(fresh, prompt)
    assert torch.equal(want.sequences, got.sequences)
    assert all(torch.equal(a, b) for a, b in zip(want.logits, got.logits, strict=True))

    model.save_pretrained(tmp_path / "training-checkpoint")  # the trained rows: not a model to load alone
    with pytest.raises(UsageError, match="is a training checkpoint .* ple.train.freeze"):
        from_pretrained(tmp_path / "training-checkpoint", table_dir=tmp_path / "tables2")

    with pytest.raises(UsageError, match="call ple.train.freeze"):
        model.save_pretrained(tmp_path / "dequantized", dequantize=torch.bfloat16)

    freeze(model)  # training done: the published layout, trained rows merged into the tables
    merged = model.state_dict()
    assert not any("trained_" in k for k in merged)
    assert sum("ngram_embedding.shard_" in k for k in merged) == 2 * 4

    bad = dict(sd)
    key = next(k for k in bad if k.endswith("trained_ids"))
    bad[key] = bad[key].clone()
    bad[key][0] = 10**9
    with pytest.raises(RuntimeError, match="ids must be sorted, distinct and in"):
        fresh.load_state_dict(bad)


def test_a_users_loop_resumes_from_its_checkpoints_as_if_never_interrupted(ckpt, tmp_path):
    tables = tmp_path / "tables"
    whole, whole_opt = _ple_model(ckpt, tables)
    _steps(whole, whole_opt, 0, 6)

    first, first_opt = _ple_model(ckpt, tables)
    _steps(first, first_opt, 0, 3)
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, tmp_path / "ck.pt")
    adapter = save_adapter(tmp_path / "ck.safetensors", first, optimizer=first_opt.optimizers[0])
    dense = {n: p.detach().clone() for n, p in first.named_parameters()}

    # from torch.save(model.state_dict()) and the optimizer's state dict
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)
    a, a_opt = _ple_model(ckpt, tables)
    a.load_state_dict(saved["model"])
    a_opt.load_state_dict(saved["opt"])
    _steps(a, a_opt, 3, 3)
    # from an adapter with the optimizer's states (the other weights and AdamW's state by hand; AdamW's
    # loaded tensors are the saved ones, which a's steps changed in place: loaded again)
    b, b_opt = _ple_model(ckpt, tables)
    load_adapter(b, adapter, dtype=torch.float32)
    load_optimizer_state(b_opt.optimizers[0], adapter)
    with torch.no_grad():
        for n, p in b.named_parameters():
            p.copy_(dense[n])
    b_opt.optimizers[1].load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=True)["opt"]["optimizers"][1])
    _steps(b, b_opt, 3, 3)

    want_rows, want_states = _trained_rows(whole), _states(whole_opt)
    for name, model, opt in (("state_dict", a, a_opt), ("adapter", b, b_opt)):
        for (ids_a, rows_a), (ids_b, rows_b) in zip(want_rows, _trained_rows(model), strict=True):
            assert torch.equal(ids_a, ids_b) and torch.equal(rows_a, rows_b), name
        for (ids_a, s_a), (ids_b, s_b) in zip(want_states, _states(opt), strict=True):
            assert torch.equal(ids_a, ids_b) and torch.equal(s_a, s_b)
        for (n, p), (_, q) in zip(whole.named_parameters(), model.named_parameters(), strict=True):
            assert torch.equal(p, q), n
