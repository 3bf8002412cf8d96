"""``ple.integrations.transformers``: a patched qwen4_exp model generates what the original does."""

from __future__ import annotations

import copy
import gc
import os
from pathlib import Path

import pytest
import torch
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpTextPLELayer

from ple.config import PLEConfig
from ple.integrations.transformers import PatchedPLELayer, patch, patched_layers, unpatch
from ple.table import MemoryTable, MmapTable, read_table_header, verify_table_file
from ple.table.files.table_file import hash_layout
from tests.integrations.helpers import (
    EOS,
    LOGIT_ATOL,
    VOCAB,
    assert_same_cache,
    assert_same_generation,
    generate,
    prompts,
    tiny_config,
    tiny_model,
    tiny_multimodal_model,
)


def _table_factory(weight, layer):
    return MemoryTable(weight.clone())


@pytest.mark.parametrize("tier", ["memory", "mmap", "factory"])
def test_generate_matches_original_with_left_padding(tier, tmp_path):
    model = tiny_model()
    ids, mask = prompts()
    want = generate(model, ids, mask)
    assert want.logits[0].abs().max() > 0.3  # logits large enough for LOGIT_ATOL to mean something
    table_tier = _table_factory if tier == "factory" else tier
    patch(model, table_tier, table_dir=tmp_path if tier == "mmap" else None)
    try:
        layers = patched_layers(model)
        assert [w.layer_idx for w in layers] == [0, 1]
        if tier == "mmap":
            assert all(isinstance(w.layer.table, MmapTable) for w in layers)
            pcfg = PLEConfig.from_dict(model.config.to_dict())
            for i, w in enumerate(layers):
                assert w.table_path.parent == tmp_path and verify_table_file(w.table_path) == []
                header = read_table_header(w.table_path)
                assert header["num_shards"] == model.config.split_ngram_parts
                assert header["layout_hash"] == hash_layout({**pcfg.layout_key(), "ple_layer_index": i})
        got = generate(model, ids, mask)
    finally:
        unpatch(model)
    assert_same_generation(want, got, model)


@pytest.mark.parametrize("prompt_len", [1, 2])
def test_prompts_shorter_than_the_ngram_context_and_conv_window(prompt_len):
    model = tiny_model(seed=3)
    g = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(EOS + 1, VOCAB, (2, prompt_len), generator=g)
    want = generate(model, ids, new_tokens=12)  # 12 > conv window 9: the window fills up while decoding
    patch(model)
    try:
        got = generate(model, ids, new_tokens=12)
    finally:
        unpatch(model)
    assert_same_generation(want, got, model)


def _forward(model, ids, cache):
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, use_cache=True).logits


@pytest.mark.parametrize("record_past", [False, True])
def test_cache_handed_between_patched_and_original(record_past):
    """Chunks (prefill, continuations shorter than N-1 and than the conv window, decode, a long chunk)
    alternate between the original and the patched modules on one cache; every logit and the final
    states equal an all-original run. ``record_past`` (what assisted generation switches on) makes
    the cache keep whole histories, shorter or longer than the windows, and roll them back with
    ``crop``."""
    from transformers import DynamicCache

    model = tiny_model(seed=5)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(EOS + 1, VOCAB, (2, 22), generator=g)
    tokens[1, 9] = EOS
    steps = [(0, 4), -3, (4, 5), (5, 6), -1, (6, 8), (8, 9), -2, (9, 20), (20, 22)]
    if not record_past:
        steps = [st for st in steps if isinstance(st, tuple)]

    def fresh_cache():
        cache = DynamicCache(config=model.config)
        if record_past:
            # transformers >= 5.25 also records the linear layers' recurrent states for the last
            # `recurrent_states_to_keep` steps (and needs the count); 5.24 takes no argument.
            if hasattr(cache, "get_recurrent_states_to_keep"):
                cache.activate_past_recording(recurrent_states_to_keep=4)
            else:
                cache.activate_past_recording()
        return cache

    def run(cache, step):
        if isinstance(step, int):
            cache.crop(step)
            return None
        return _forward(model, tokens[:, step[0] : step[1]], cache)

    ref_cache = fresh_cache()
    want = [run(ref_cache, st) for st in steps]
    if record_past:
        assert ref_cache.get_conv_state(0, state_idx=2).shape[-1] > 2  # whole histories are kept
    for start_patched in (True, False):
        cache = fresh_cache()
        patched = False
        for i, st in enumerate(steps):
            if patched != ((i % 2 == 0) == start_patched):
                (unpatch if patched else patch)(model)
                patched = not patched
            got = run(cache, st)
            if got is not None:
                err = (got - want[i]).abs().max().item()
                who = "patched" if patched else "original"
                assert err <= LOGIT_ATOL, f"step {i} {st} ({who}): logits differ by {err:.3e}"
        if patched:
            unpatch(model)
        assert_same_cache(ref_cache, cache, model)


def test_text_model_forward_without_cache():
    """A bare ``Qwen4ExpTextModel`` (no LM head) patched, run without a cache."""
    text_model = tiny_model(seed=7).model
    ids, mask = prompts(seed=7)
    with torch.no_grad():
        want = text_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        patch(text_model)
        try:
            assert len(patched_layers(text_model)) == 2
            got = text_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        finally:
            unpatch(text_model)
    assert want.abs().max() > 0.3
    torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_ATOL)


def test_multimodal_model_generates_the_same_tokens():
    """``Qwen4ExpForConditionalGeneration``: PLE config under ``text_config``, layers under ``language_model``."""
    model = tiny_multimodal_model()
    ids, mask = prompts(seed=1)
    want = generate(model, ids, mask)
    patch(model)
    try:
        assert [w.layer_idx for w in patched_layers(model)] == [0, 1]
        got = generate(model, ids, mask)
    finally:
        unpatch(model)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(want.logits, got.logits):
        torch.testing.assert_close(b, a, rtol=0, atol=LOGIT_ATOL)


def test_autograd_through_fresh_sequences():
    """Outside ``torch.no_grad()`` a fresh forward is differentiable and gives the original's gradients;
    continuing a cache with autograd is refused."""
    model = tiny_model(seed=15)
    reference = copy.deepcopy(model)
    ids, mask = prompts(seed=15)
    want = reference(input_ids=ids, attention_mask=mask).logits
    want.square().sum().backward()
    patch(model)
    try:
        out = model(input_ids=ids, attention_mask=mask)
        out.logits.square().sum().backward()
        torch.testing.assert_close(out.logits, want, rtol=0, atol=LOGIT_ATOL)
        for idx in (0, 1):
            got_ple, want_ple = model.model.layers[idx].ple.layer, reference.model.layers[idx].ple
            for got_grad, want_grad in (
                (got_ple.key_proj.grad, want_ple.key_proj.weight.grad),
                (got_ple.norm_query.grad, want_ple.norm_query.weight.grad),
                (got_ple.conv_weight.grad, want_ple.conv1d.weight.grad.reshape(got_ple.conv_weight.shape)),
            ):
                assert want_grad.abs().max() > 0
                torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad, rtol=1e-4, atol=1e-5)
        assert_same_cache(reference(input_ids=ids, attention_mask=mask).cache, out.cache, model)
        with pytest.raises(RuntimeError, match="continuing a cache with autograd"):
            model(input_ids=ids[:, :1], cache=out.cache)
    finally:
        unpatch(model)


def test_patched_module_returns_what_the_original_returns():
    """Module level, fresh sequences: ``v + conv`` of the patched module vs the original."""
    model = tiny_model(seed=9)
    original = model.model.layers[1].ple
    hidden = torch.randn(3, 5, model.config.hc_count * model.config.hidden_size)
    ids = torch.randint(0, VOCAB, (3, 5))
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    ids = torch.where(mask.bool(), ids, EOS)
    with torch.no_grad():
        want = original(hidden, ids, None, conv_mask=mask)
        patch(model)
        try:
            wrapper = model.model.layers[1].ple
            assert isinstance(wrapper, PatchedPLELayer) and wrapper.original is original
            got = wrapper(hidden, ids, None, conv_mask=mask)
            with pytest.raises(ValueError, match="input_ids must be"):
                wrapper(hidden, ids[:, :4], None)
        finally:
            unpatch(model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unpatch_restores_the_original_modules():
    model = tiny_model(seed=11)
    ids, mask = prompts(seed=11)
    originals = [layer.ple for layer in model.model.layers if layer.ple is not None]
    params = [id(p) for p in model.parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    patch(model, "mmap")  # releases the in-memory tables, which unpatch must bring back
    wrappers = patched_layers(model)
    table_dir = wrappers[0].table_path.parent
    assert table_dir.is_dir()
    for original in originals:
        assert original.ple_embedding.ngram_embedding.weight.numel() == 0
    assert not any(isinstance(m, Qwen4ExpTextPLELayer) for m in model.modules())
    patched_state = model.state_dict()  # transformers' names; the table in the checkpoint's shards
    assert "model.layers.0.ple.key_proj.weight" in patched_state
    assert "model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight" in patched_state
    del patched_state
    unpatch(model)
    assert not table_dir.exists()
    for original in originals:  # the table came back as a map of its table file, not a copy in memory
        weight = original.ple_embedding.ngram_embedding.weight
        assert ".pletable" in mapping_of(weight.data_ptr())
    assert [layer.ple for layer in model.model.layers if layer.ple is not None] == originals
    assert all(type(o) is Qwen4ExpTextPLELayer for o in originals)
    assert [id(p) for p in model.parameters()] == params
    after = model.state_dict()
    assert after.keys() == state.keys()
    for k, v in state.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.equal(got, want)
    assert patched_layers(model) == []


def test_patch_refuses_bad_arguments(tmp_path):
    model = tiny_model()
    with pytest.raises(ValueError, match="'disk'"):
        patch(model, "disk")
    with pytest.raises(ValueError, match="table_dir"):
        patch(model, "memory", table_dir=tmp_path)
    with pytest.raises(ValueError, match="nothing to unpatch"):
        unpatch(model)
    with pytest.raises(ValueError, match="table_grad=True needs table_tier='memory'"):
        patch(model, "mmap", table_grad=True)
    with pytest.raises(ValueError, match="stores the module's rows exactly"):
        patch(model, lambda w, layer: MemoryTable(w.to(torch.bfloat16)), release_weight=True)
    assert patched_layers(model) == [] and model.model.layers[0].ple.ple_embedding.ngram_embedding.weight.numel() > 0
    patch(model)
    with pytest.raises(ValueError, match="already patched"):
        patch(model)
    unpatch(model)
    plain = Qwen4ExpForCausalLM(tiny_config(ple_layer_ids=[]))
    with pytest.raises(ValueError, match="no Qwen4ExpTextPLELayer"):
        patch(plain)


def mapping_of(address: int) -> str:
    """The ``/proc/self/maps`` line of the mapping that holds ``address``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return line
    return ""


def resident_memory_bytes() -> int:
    """Resident set size of this process (``VmRSS``)."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    psutil = pytest.importorskip("psutil")
    return psutil.Process(os.getpid()).memory_info().rss


@pytest.mark.perf
def test_mmap_tier_generates_the_same_tokens_with_less_resident_memory(tmp_path):
    """~192 MB of PLE tables (two layers of ~6M rows x 4 fp32): the mmap tier frees them."""
    config = tiny_config(ngram_vocab_size_base=1_500_000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=16)
    model = tiny_model(config, seed=13, random_table=False)  # the init's normal_ table is random enough
    table_bytes = sum(
        layer.ple.ple_embedding.ngram_embedding.weight.nbytes for layer in model.model.layers if layer.ple is not None
    )
    assert table_bytes > 150e6
    ids, mask = prompts(seed=13)
    want = generate(model, ids, mask)
    gc.collect()
    rss_unpatched = resident_memory_bytes()
    patch(model, "mmap", table_dir=tmp_path)
    try:
        got = generate(model, ids, mask)
        gc.collect()
        rss_patched = resident_memory_bytes()
        files = sorted(p.name for p in tmp_path.iterdir())
        assert files == ["model.layers.0.ple.pletable", "model.layers.1.ple.pletable"]
    finally:
        unpatch(model)
    print(
        f"\nPLE tables {table_bytes / 2**20:.1f} MiB; resident memory unpatched {rss_unpatched / 2**20:.1f} MiB, "
        f"patched (mmap) {rss_patched / 2**20:.1f} MiB, saved {(rss_unpatched - rss_patched) / 2**20:.1f} MiB"
    )
    assert_same_generation(want, got, model)
    assert rss_unpatched - rss_patched >= 0.8 * table_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # a caller's table_dir is kept
