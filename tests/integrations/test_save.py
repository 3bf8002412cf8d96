"""Round trips: ``save_pretrained`` of a patched or ple-loaded model writes the checkpoint transformers
writes (its names, the table in its format, streamed from its tier) or refuses; never ple's names."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import Qwen4ExpForCausalLM

from ple.checkpoint import checkpoint_files
from ple.errors import InvalidArgumentError, UsageError
from ple.integrations.transformers import (
    ScaledTableWarning,
    from_pretrained,
    patch,
    patched_layers,
    unpatch,
)
from ple.table import MemoryTable, Table
from ple.table.formats.quantize import quantize_global
from tests.integrations.helpers import LOGIT_ATOL, generate, prompts, tiny_config, tiny_model


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
    with pytest.warns(ScaledTableWarning):
        fp8.save_pretrained(tmp_path / "fp8")
    unpatch(fp8, materialize=True)
    for tier in ("mmap", "memory"):
        kw = {"table_dir": tmp_path / "t2"} if tier == "mmap" else {}
        loaded = from_pretrained(tmp_path / "fp8", table_tier=tier, **kw)
        with pytest.warns(ScaledTableWarning):
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


def test_load_state_dict_takes_the_experts_as_save_pretrained_writes_them(saved, tmp_path):
    """What ``save_pretrained`` writes (one key per expert, reverted from transformers' fused tensors)
    loads back onto the fused experts exactly as transformers' own conversion lays them out: the
    ``load_state_dict`` of transformers' ``Trainer`` resume; an incomplete set is an error naming its keys."""
    model, path = saved
    written = tensors(path)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in written and not any("gate_up" in k for k in written)
    reference = Qwen4ExpForCausalLM.from_pretrained(path).state_dict()  # transformers' conversion
    experts = [k for k in model.state_dict() if ".experts." in k]
    assert len(experts) == 2 * 3 and all(torch.equal(reference[k], model.state_dict()[k]) for k in experts)

    other = tiny_model(tiny_config(split_ngram_parts=4), seed=35)
    patch(other, "memory")
    try:
        assert not any(torch.equal(other.state_dict()[k], reference[k]) for k in experts)
        result = other.load_state_dict(written, strict=False)  # as Trainer loads a checkpoint
        assert result.missing_keys == [] and result.unexpected_keys == []
        after = other.state_dict()
        for k in experts:
            assert after[k].dtype == reference[k].dtype and torch.equal(after[k], reference[k]), k
        lost = "model.layers.1.mlp.experts.2.down_proj.weight"
        bad = {k: v for k, v in written.items() if k != lost}
        with pytest.raises(RuntimeError, match=re.escape(f"missing ['{lost}'] (1)")):
            other.load_state_dict(bad, strict=False)
        extra = "model.layers.1.mlp.experts.9.gate_proj.weight"  # the model has 4 experts
        bad = {**written, extra: written["model.layers.1.mlp.experts.0.gate_proj.weight"]}
        with pytest.raises(RuntimeError, match=re.escape(f"has 4 experts; missing [] (0), unexpected ['{extra}'] (1)")):
            other.load_state_dict(bad, strict=False)
        bad = dict(written)
        bad["model.layers.2.mlp.experts.1.up_proj.weight"] = bad["model.layers.2.mlp.experts.1.up_proj.weight"][:-1]
        with pytest.raises(RuntimeError, match=r"experts.1.up_proj.weight has shape \[7, 16\], expected \[8, 16\]"):
            other.load_state_dict(bad, strict=False)
    finally:
        unpatch(other)
    with pytest.raises(
        RuntimeError, match="Unexpected key.*experts.0.gate_proj.weight"
    ):  # unpatched: transformers' own
        other.load_state_dict(written)


def test_a_patched_model_keeps_its_table_file_when_another_patch_replaces_it(tmp_path):
    """``patch(..., "mmap", table_dir=same)`` for a second model renames new files over the first
    model's: the first keeps saving and unpatching the rows of the file it holds."""
    first = tiny_model(tiny_config(split_ngram_parts=4), seed=36)
    second = tiny_model(tiny_config(split_ngram_parts=4), seed=37)
    want = {k: v.clone() for k, v in first.state_dict().items()}
    want_logits = logits(first)
    patch(first, "mmap", tmp_path / "tables")  # the module's table released: only the file holds it
    assert all(w.original.ple_embedding.ngram_embedding.weight.numel() == 0 for w in patched_layers(first))
    patch(second, "mmap", tmp_path / "tables")
    assert [w.table_path for w in patched_layers(first)] == [w.table_path for w in patched_layers(second)]
    first.save_pretrained(tmp_path / "out")
    saved = tensors(tmp_path / "out")
    for i in (0, 1):
        rows = torch.cat(
            [saved[f"model.layers.{i}.ple.ple_embedding.ngram_embedding.shard_{k}.weight"] for k in range(4)]
        )
        assert torch.equal(rows, want[f"model.layers.{i}.ple.ple_embedding.ngram_embedding.weight"])
    unpatch(first)
    unpatch(second)
    got = first.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert torch.equal(logits(first), want_logits)


def test_table_file_maps_are_checked_and_outlive_the_table(tmp_path):
    """``MmapTable.map_rows``: rows (or per-row scales) of the file the table holds, each with a
    storage of its own; refused once the file was changed in place or the table closed."""
    from ple.errors import InvalidArgumentError
    from ple.table import MmapTable, TableFileError, quantize_rows

    model = tiny_model(tiny_config(split_ngram_parts=4), seed=38)
    weight = model.model.layers[0].ple.ple_embedding.ngram_embedding.weight.detach().clone()
    _, s = quantize_rows(weight, "fp8_row")
    patch(model, "mmap", tmp_path / "tables")
    table = patched_layers(model)[0].layer.table
    assert isinstance(table, MmapTable)
    rows = table.map_rows(3, 9)
    assert torch.equal(rows, weight[3:9]) and rows.untyped_storage().nbytes() == rows.nbytes
    cow = table.map_rows(copy_on_write=True)
    cow[0] += 1  # private pages: neither the file nor the table changes
    assert torch.equal(table.data[0], weight[0]) and torch.equal(table.map_rows(0, 1)[0], weight[0])
    with pytest.raises(InvalidArgumentError, match=r"rows \[5, 2\) are not within"):
        table.map_rows(5, 2)
    with pytest.raises(UsageError, match="has no per-row scales"):
        table.map_rows(0, 1, scales=True)
    unpatch(model)
    patch(model, lambda weight, layer: MemoryTable(*quantize_rows(weight, "fp8_row")))
    with pytest.warns(ScaledTableWarning, match="saved as fp8_row"):
        model.save_pretrained(tmp_path / "fp8row")
    unpatch(model, materialize=True)
    loaded = from_pretrained(tmp_path / "fp8row", table_dir=tmp_path / "t")
    table = patched_layers(loaded)[0].layer.table
    assert torch.equal(table.map_rows(7, 20, scales=True), s[7:20])
    with open(table.path, "ab") as f:  # changed in place (what ple never does)
        f.write(b"\0")
    with pytest.raises(TableFileError, match="was changed in place while mapped"):
        table.map_rows(0, 1)
    table.close()
    with pytest.raises(UsageError, match="was closed"):
        table.map_rows(0, 1)
    assert torch.equal(rows, weight[3:9])  # a map outlives the table


def test_an_fp8_model_saved_for_plain_transformers(tmp_path):
    """A model loaded from an fp8 checkpoint (the published format) saves its tables as fp8 + scale
    (ple reads that back exactly; plain transformers ignores the scale), with a warning naming the
    remedy; ``save_pretrained(..., dequantize=dtype)`` writes what plain transformers reads correctly."""
    model = tiny_model(tiny_config(split_ngram_parts=4), seed=38)

    def quantized(weight, layer):
        q, s = quantize_global(weight)
        return MemoryTable(q, s)

    patch(model, quantized)
    try:
        with pytest.warns(ScaledTableWarning, match=r"pass dequantize=torch\.bfloat16"):
            model.save_pretrained(tmp_path / "fp8")
    finally:
        unpatch(model)
    assert "save_pretrained" not in model.__dict__  # unpatch gives transformers' own method back
    loaded = from_pretrained(tmp_path / "fp8", table_dir=tmp_path / "tables")
    ids, mask = prompts(seed=38)
    want = generate(loaded, ids, mask)
    # without the remedy: a warning, and plain transformers reads other values
    with pytest.warns(
        ScaledTableWarning, match=rf"plain transformers \({re.escape(transformers.__version__)}\) ignores weight_scale"
    ):
        loaded.save_pretrained(tmp_path / "as-is")
    assert (logits(Qwen4ExpForCausalLM.from_pretrained(tmp_path / "as-is")) - logits(loaded)).abs().max() > 0.1
    # with it: no warning, no scales in the files, and plain transformers generates what ple does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded.save_pretrained(tmp_path / "plain", dequantize=torch.float32)
    saved = tensors(tmp_path / "plain")
    assert not any(k.endswith("weight_scale") for k in saved)
    assert saved["model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"].dtype == torch.float32
    assert not list(tmp_path.glob(".plain.*"))  # the staging folder is gone
    plain = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "plain")
    got = generate(plain, ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(want.logits, got.logits):
        torch.testing.assert_close(b, a, rtol=0, atol=LOGIT_ATOL)
    # bf16 tables: the scale applied in bf16, as ple's lookup does in a bf16 model
    loaded.save_pretrained(tmp_path / "plain-bf16", dequantize=torch.bfloat16)
    rows = tensors(tmp_path / "plain-bf16")["model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"]
    fp8 = tensors(tmp_path / "fp8")
    q = fp8["model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"]
    scale = fp8["model.layers.0.ple.ple_embedding.ngram_embedding.weight_scale"]
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, q.to(torch.bfloat16) * scale.to(torch.bfloat16))
    with pytest.raises(FileExistsError, match="writes a new folder"):
        loaded.save_pretrained(tmp_path / "plain", dequantize=torch.float32)
    with pytest.raises(InvalidArgumentError, match="dequantize must be torch.bfloat16"):
        loaded.save_pretrained(tmp_path / "other", dequantize=torch.int8)
