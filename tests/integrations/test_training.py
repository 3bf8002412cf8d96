"""Training through a patched model: the table is frozen unless asked; asked, its gradient is
transformers' (non-zero exactly on the rows the batch touched); tiers that cannot train refuse."""

from __future__ import annotations

import copy

import pytest
import torch

from ple.integrations.transformers import from_pretrained, patch, patched_layers, unpatch
from tests.integrations.helpers import prompts, tiny_config, tiny_model


def _loss(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


def _touched_rows(model, ids, mask) -> dict[int, torch.Tensor]:
    """The table rows each PLE layer of an unpatched model reads for this batch (forward hook)."""
    rows = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if layer.ple is None:
            continue
        emb = layer.ple.ple_embedding.ngram_embedding
        hooks.append(
            emb.register_forward_hook(lambda m, inp, out, i=i: rows.__setitem__(i, inp[0].reshape(-1).unique()))
        )
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for h in hooks:
        h.remove()
    return rows


def test_table_gradients_match_transformers_on_the_touched_rows():
    model = tiny_model(tiny_config(split_ngram_parts=4), seed=41)
    reference = copy.deepcopy(model)
    ids, mask = prompts(seed=41)
    _loss(reference, ids, mask).backward()
    touched = _touched_rows(reference, ids, mask)
    patch(model, "memory", table_grad=True)
    try:
        names = [n for n, _ in model.named_parameters() if n.endswith("table_weight")]
        assert names == ["model.layers.0.ple.table_weight", "model.layers.1.ple.table_weight"]
        _loss(model, ids, mask).backward()
        for i, wrapper in enumerate(patched_layers(model)):
            got = wrapper.table_weight.grad
            want = reference.model.layers[i].ple.ple_embedding.ngram_embedding.weight.grad
            assert got.layout == want.layout == torch.strided
            rows = touched[i]
            nonzero = got.abs().sum(1).nonzero().flatten()  # padded positions read rows but pass no gradient
            assert torch.equal(nonzero, want.abs().sum(1).nonzero().flatten())
            assert torch.isin(nonzero, rows).all() and len(nonzero) > 10
            torch.testing.assert_close(got[rows], want[rows], rtol=1e-4, atol=1e-6)
            outside = torch.ones(len(got), dtype=torch.bool)
            outside[rows] = False
            assert outside.sum() > 0 and torch.count_nonzero(got[outside]) == 0  # nothing outside the touched rows
        # a step changes the table the original module holds (the same parameter)
        optim = torch.optim.SGD(model.parameters(), lr=1.0)
        before = reference.model.layers[0].ple.ple_embedding.ngram_embedding.weight.detach().clone()
        optim.step()
    finally:
        unpatch(model)
    after = model.model.layers[0].ple.ple_embedding.ngram_embedding.weight
    assert not torch.equal(after, before)


def test_the_table_is_frozen_by_default_and_trained_weights_survive_unpatch():
    model = tiny_model(tiny_config(split_ngram_parts=4), seed=42)
    ids, mask = prompts(seed=42)
    table = model.model.layers[0].ple.ple_embedding.ngram_embedding.weight
    before = table.detach().clone()
    key_before = model.model.layers[0].ple.key_proj.weight.detach().clone()
    patch(model)
    try:
        assert not any("ngram_embedding" in n or "table" in n for n, _ in model.named_parameters())
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        _loss(model, ids, mask).backward()
        optim.step()
        assert table.grad is None
    finally:
        unpatch(model)
    assert torch.equal(model.model.layers[0].ple.ple_embedding.ngram_embedding.weight, before)
    # the projections trained while patched are the original module's weights now
    assert not torch.equal(model.model.layers[0].ple.key_proj.weight, key_before)


def test_tiers_that_cannot_train_the_table_say_so(tmp_path):
    model = tiny_model(tiny_config(split_ngram_parts=4), seed=43)
    with pytest.raises(ValueError, match="table_grad=True needs table_tier='memory'"):
        patch(model, "mmap", table_grad=True)
    with pytest.raises(ValueError, match="table_grad=True needs table_tier='memory'"):
        patch(model, lambda w, layer: None, table_grad=True)
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        patch(model.to(torch.float64), "memory", table_grad=True)
    # a model from from_pretrained trains everything but its table (which is not in memory)
    model = tiny_model(tiny_config(split_ngram_parts=4), seed=43)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = from_pretrained(tmp_path / "ckpt", table_dir=tmp_path / "tables")
    ids, mask = prompts(seed=43)
    _loss(loaded, ids, mask).backward()
    assert loaded.model.layers[0].ple.layer.key_proj.grad.abs().max() > 0
