"""Shared fixtures: golden vectors, transformers reference modules, small configs, and where the
Triton kernels run.

Triton kernels run natively on a CUDA device; without one they run on CPU tensors under the Triton
interpreter. ``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined, that is when ple
imports a ``triton_impl`` module, so it is set here, before any test module is imported: every
Triton test then runs in this process on :data:`TRITON_DEVICE`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from ple.config import PLEConfig

if not torch.cuda.is_available():
    _defined = sorted(m for m in sys.modules if m.startswith("ple.") and m.endswith(".triton_impl"))
    assert not _defined, f"Triton kernels were defined before TRITON_INTERPRET was set: {_defined}"
    os.environ["TRITON_INTERPRET"] = "1"

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""The device of the Triton tests' tensors: the GPU, or the CPU under the interpreter."""
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
"""Test vectors made by transformers' qwen4_exp: exact layouts (``layout.json``) and n-gram ids of
token streams with EOS where it matters (``ngram_ids.json``)."""


SMALL = dict(
    hidden_size=32,
    hc_count=2,
    ple_layer_ids=(2, 3),
    ple_embed_dim=32,
    ngram_size=3,
    heads_per_ngram=2,
    vocab_size=500,
    ngram_vocab_size_base=700,
    make_ngram_vocab_size_divisible_by=64,
    split_ngram_parts=7,
    eos_token_id=2,
)
"""PLE fields of a small two-layer model for synthesized checkpoints (``ple.commands.demo.synthesize_checkpoint``)."""


def load_golden(name: str):
    with open(GOLDEN / name) as f:
        return json.load(f)


def hf_config(**kw):
    """A transformers ``Qwen4ExpTextConfig`` for a tiny model carrying PLE on its first layer."""
    from transformers import Qwen4ExpTextConfig

    base = dict(
        hidden_size=24,
        hc_count=2,
        ple_layer_ids=[1],
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=500,
        vocab_size=300,
        eos_token_id=7,
        num_hidden_layers=1,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=3,
    )
    base.update(kw)
    if "ple_embed_dim" not in base:
        base["ple_embed_dim"] = base["hidden_size"]
    if max(base["ple_layer_ids"], default=0) > base["num_hidden_layers"]:
        base["num_hidden_layers"] = max(base["ple_layer_ids"])
    return Qwen4ExpTextConfig(**base)


def ple_config_from_hf(hf_cfg) -> PLEConfig:
    return PLEConfig.from_dict(hf_cfg.to_dict())


def hf_ple_layer(hf_cfg, ple_layer_index: int = 0, seed: int = 0, dtype=torch.float32):
    """A transformers ``Qwen4ExpTextPLELayer`` with random (non-zero) weights, conv included."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

    torch.manual_seed(seed)
    layer_idx = hf_cfg.ple_layer_ids[ple_layer_index] - 1
    mod = Qwen4ExpTextPLELayer(hf_cfg, layer_idx, ple_layer_index)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            if name.endswith("ngram_embedding.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.startswith("norm_"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name == "conv1d.weight":
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return mod.to(dtype).eval()


@pytest.fixture(scope="session")
def published_config() -> PLEConfig:
    return PLEConfig(
        hidden_size=2560,
        hc_count=4,
        ple_layer_ids=(2,),
        ple_embed_dim=2560,
        ngram_size=3,
        heads_per_ngram=8,
        vocab_size=248320,
        eos_token_id=248044,
        split_ngram_parts=128,
    )
