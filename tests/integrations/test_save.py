"""Round trips: ``save_pretrained`` of a patched or ple-loaded model writes the checkpoint transformers
writes (its names, the table in its format, streamed from its tier) or refuses; never ple's names."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen4ExpForCausalLM

from ple.errors import UsageError
from ple.integrations.checkpoints import checkpoint_files
from ple.integrations.transformers import from_pretrained, patch, patched_layers, unpatch
from ple.table import MemoryTable, Table, quantize_global

from .helpers import LOGIT_ATOL, prompts, tiny_config, tiny_model


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in checkpoint_files(folder):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def assert_same_checkpoint(a, b) -> None:
    """Same names, dtypes and bytes."""
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb)
    for k, v in ta.items():
        assert tb[k].dtype == v.dtype and tb[k].shape == v.shape, k
        assert torch.equal(tb[k].view(torch.uint8), v.view(torch.uint8)), k


def logits(model) -> torch.Tensor:
    ids, mask = prompts(seed=31)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model (tables in 4 shards) and what plain transformers saves of it."""
    model = tiny_model(tiny_config(split_ngram_parts=4), seed=31)
    path = tmp_path_factory.mktemp("plain") / "ckpt"
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("tier", ["memory", "mmap"])
def test_a_patched_model_saves_what_transformers_saves(saved, tier, tmp_path):
    model, reference = saved
    want = logits(model)
    patch(model, tier)
    try:
        model.save_pretrained(tmp_path / "out")
    finally:
        unpatch(model)
    assert_same_checkpoint(reference, tmp_path / "out")
    assert torch.equal(logits(Qwen4ExpForCausalLM.from_pretrained(tmp_path / "out")), want)


def test_tables_stream_from_their_files_and_honour_max_shard_size(saved, tmp_path):
    """A ple-loaded model's tables go to the checkpoint as maps of the table files (one per shard, so
    transformers can split them across files)."""
    model, reference = saved
    loaded = from_pretrained(reference, table_dir=tmp_path / "tables")
    state = loaded.state_dict()
    shard = state["model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight"]
    assert shard.untyped_storage().nbytes() == shard.nbytes  # a storage of its own
    table_bytes = sum(v.nbytes for k, v in state.items() if "ngram_embedding" in k)
    del state
    limit = table_bytes // 6
    loaded.save_pretrained(tmp_path / "out", max_shard_size=limit)
    files = checkpoint_files(tmp_path / "out")
    assert len(files) >= 4
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert (
        len(
            {
                index[f"model.layers.{i}.ple.ple_embedding.ngram_embedding.shard_{k}.weight"]
                for i in (0, 1)
                for k in range(4)
            }
        )
        >= 3
    )
    assert_same_checkpoint(reference, tmp_path / "out")
    assert torch.equal(logits(Qwen4ExpForCausalLM.from_pretrained(tmp_path / "out")), logits(model))


def test_a_ple_loaded_model_keeps_dtype_and_format(tmp_path):
    """bf16 tables stay bf16; an fp8 table with its global scale is written back as it was read."""
    bf16 = tiny_model(tiny_config(split_ngram_parts=4), seed=32).to(torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16")
    loaded = from_pretrained(tmp_path / "bf16", table_dir=tmp_path / "t1")
    assert {w.layer.table.format for w in patched_layers(loaded)} == {"bf16"}
    loaded.save_pretrained(tmp_path / "bf16-again")
    assert_same_checkpoint(tmp_path / "bf16", tmp_path / "bf16-again")

    fp8 = tiny_model(tiny_config(split_ngram_parts=4), seed=33)
    patch(fp8, lambda weight, layer: MemoryTable(*quantize_global(weight)))
    fp8.save_pretrained(tmp_path / "fp8")
    unpatch(fp8, materialize=True)
    for tier in ("mmap", "memory"):
        kw = {"table_dir": tmp_path / "t2"} if tier == "mmap" else {}
        loaded = from_pretrained(tmp_path / "fp8", table_tier=tier, **kw)
        loaded.save_pretrained(tmp_path / f"fp8-{tier}")
        assert_same_checkpoint(tmp_path / "fp8", tmp_path / f"fp8-{tier}")


class _RemoteTable(Table):
    """A table whose rows live elsewhere (as on other ranks): lookups only."""

    def __init__(self, inner: MemoryTable):
        super().__init__(inner.format, inner.rows, inner.head_dim)
        self.inner = inner

    @property
    def device(self):
        return self.inner.device

    @property
    def nbytes(self):
        return 0

    def _lookup_into(self, ids, out):
        self.inner._lookup_into(ids, out)


def test_a_table_this_process_cannot_read_refuses_to_be_saved(tmp_path):
    model = tiny_model(tiny_config(split_ngram_parts=4), seed=34)
    patch(model, lambda weight, layer: _RemoteTable(MemoryTable(weight.clone())))
    with pytest.raises(UsageError, match="cannot be saved from here"):
        model.save_pretrained(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.safetensors")) if (tmp_path / "out").exists() else True


def test_load_state_dict_takes_transformers_names(saved, tmp_path):
    model, _ = saved
    other = tiny_model(tiny_config(split_ngram_parts=4), seed=35)
    patch(other, "memory")
    try:
        other.load_state_dict(model.state_dict())  # transformers' names, the whole table
        torch.testing.assert_close(logits(other), logits(model), rtol=0, atol=LOGIT_ATOL)
        other.load_state_dict(other.state_dict())  # the patched module's own names (table in shards)
    finally:
        unpatch(other)
    assert torch.equal(logits(other), logits(model))
    patch(other, "mmap")
    try:
        with pytest.raises(RuntimeError, match="cannot load .* table rows into PLE layer 0's MmapTable"):
            other.load_state_dict(model.state_dict())
    finally:
        unpatch(other)
