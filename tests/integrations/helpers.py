"""Shared pieces of the transformers integration tests: a tiny qwen4_exp model, prompts, comparisons."""

from __future__ import annotations

import torch
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM

from ple.integrations.demo_model import randomize_ple_weights

EOS = 5
VOCAB = 97
LOGIT_ATOL = 1e-4  # logits are O(1) (initializer_range 0.1); the PLE moves them by O(1)


def tiny_config(**kw) -> Qwen4ExpTextConfig:
    """Three decoder layers (linear, linear, indexed attention), PLE on both linear ones."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "linear_attention", "indexed_attention"],
        hc_count=2,
        hc_lowrank=4,
        ple_layer_ids=[1, 2],
        ple_embed_dim=16,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=3,
        eos_token_id=EOS,
        pad_token_id=0,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=8,
        indexer_budget=8,
        indexer_compress_ratio=4,
        initializer_range=0.1,
    )
    base.update(kw)
    return Qwen4ExpTextConfig(**base)


def tiny_model(config: Qwen4ExpTextConfig | None = None, seed: int = 0, random_table: bool = True):
    """A random-weight model whose PLE weights are all non-trivial (conv and norms init to zero)."""
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(config or tiny_config()).eval()
    randomize_ple_weights(model, seed + 1, table=random_table)
    return model


def tiny_multimodal_model(text_config: Qwen4ExpTextConfig | None = None, seed: int = 0):
    """A random-weight ``Qwen4ExpForConditionalGeneration`` (a one-block vision tower) around
    ``text_config`` (default :func:`tiny_config`): PLE config under ``text_config``, layers under
    ``model.language_model``; PLE weights as :func:`tiny_model` gives them."""
    from transformers import Qwen4ExpConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForConditionalGeneration

    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=16,
        num_heads=2,
        out_hidden_size=16,
        patch_size=4,
        num_position_embeddings=16,
    )
    config = Qwen4ExpConfig(
        text_config=(text_config or tiny_config()).to_dict(),
        vision_config=vision,
        image_token_id=90,
        video_token_id=91,
        vision_start_token_id=92,
        vision_end_token_id=93,
    )
    torch.manual_seed(seed)
    model = Qwen4ExpForConditionalGeneration(config).eval()
    randomize_ple_weights(model, seed + 1, table=True)
    return model


def prompts(seed: int = 0):
    """Three prompts of lengths 7, 4 and 2, left-padded; the first holds an EOS."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(EOS + 1, VOCAB, (3, 7), generator=g)
    ids[0, 3] = EOS
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    ids[mask == 0] = 0
    return ids, mask


def generate(model, ids, mask=None, new_tokens=6):
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )


def ple_layer_indices(model) -> list[int]:
    return [i - 1 for i in model.config.ple_layer_ids]


def assert_same_cache(want, got, model):
    """The PLE states of two caches: n-gram context exactly, conv window to fp32 tolerance."""
    for layer_idx in ple_layer_indices(model):
        ctx_w, ctx_g = want.get_conv_state(layer_idx, state_idx=2), got.get_conv_state(layer_idx, state_idx=2)
        assert ctx_g.dtype == ctx_w.dtype == torch.int64
        assert torch.equal(ctx_g, ctx_w), f"layer {layer_idx}: n-gram context {ctx_g.tolist()} != {ctx_w.tolist()}"
        conv_w, conv_g = want.get_conv_state(layer_idx, state_idx=1), got.get_conv_state(layer_idx, state_idx=1)
        assert conv_g.shape == conv_w.shape and conv_g.dtype == conv_w.dtype
        torch.testing.assert_close(conv_g, conv_w, rtol=1e-5, atol=1e-5)


def assert_same_generation(want, got, model):
    assert torch.equal(got.sequences, want.sequences), f"{got.sequences.tolist()} != {want.sequences.tolist()}"
    assert len(got.logits) == len(want.logits)
    for step, (a, b) in enumerate(zip(want.logits, got.logits)):
        err = (a - b).abs().max().item()
        assert err <= LOGIT_ATOL, f"step {step}: logits differ by {err:.3e}"
    assert_same_cache(want.cache, got.cache, model)
