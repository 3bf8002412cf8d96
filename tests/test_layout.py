import re
import time

import pytest

from ple.config import ConfigError, PLEConfig
from ple.layout import is_prime, nth_prime_after, splitmix64
from tests.conftest import load_golden


def _cfg_from_golden(c: dict) -> tuple[PLEConfig, int]:
    c = dict(c)
    idx = c.pop("ple_layer_index")
    c.pop("name")
    return PLEConfig(hidden_size=c["ple_embed_dim"], eos_token_id=0, **c), idx


@pytest.mark.parametrize("case", load_golden("layout.json"), ids=lambda c: c["config"]["name"])
def test_layout_matches_golden(case):
    cfg, idx = _cfg_from_golden(case["config"])
    lay = cfg.layout(idx)
    assert list(lay.multipliers) == case["layer_multipliers"]
    assert list(lay.head_sizes) == case["ngram_heads_vocab_sizes"]
    assert list(lay.head_offsets) == case["ngram_heads_offsets"]
    assert lay.rows == case["total_rows"]
    assert lay.padded_rows == case["padded_rows"]
    assert lay.shard_rows == case["shard_rows"]
    assert lay.head_dim == case["head_dim"]


def _published_layout_3():
    from ple.layout import compute_layout

    return compute_layout(
        ple_layer_index=3,
        ngram_size=3,
        heads_per_ngram=8,
        vocab_size=248320,
        seed=1234,
        ngram_vocab_size_base=20_000_000,
        divisible_by=128,
        split_parts=128,
        embed_dim=2560,
    )


@pytest.mark.perf
def test_published_layout_is_fast():
    t0 = time.perf_counter()
    _published_layout_3()
    assert time.perf_counter() - t0 < 1.0


def test_published_layout(published_config):
    lay = _published_layout_3()
    assert len(lay.head_sizes) == 16 and all(is_prime(p) for p in lay.head_sizes)
    lay0 = published_config.layout(0)
    assert lay0.padded_rows == 320_001_536 and lay0.rows == 320_001_446


def test_layout_matches_transformers_buffers():
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    from tests.conftest import hf_config, ple_config_from_hf

    hf = hf_config(ngram_size=4, heads_per_ngram=3, hidden_size=36, ple_layer_ids=[1, 2, 3], seed=99)
    cfg = ple_config_from_hf(hf)
    for idx in range(3):
        emb = Qwen4ExpTextNGramEmbedding(hf, hf.ple_embed_dim, idx, idx)
        lay = cfg.layout(idx)
        assert emb.layer_multipliers.tolist() == list(lay.multipliers)
        assert emb.ngram_heads_vocab_sizes.tolist() == list(lay.head_sizes)
        assert emb.ngram_heads_offsets.tolist() == list(lay.head_offsets)
        assert emb.ngram_embedding.weight.shape == (lay.padded_rows, lay.head_dim)


def test_primality_edge_cases():
    small = [n for n in range(200) if is_prime(n)]
    assert small[:10] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29] and len(small) == 46
    assert is_prime((1 << 61) - 1) and not is_prime((1 << 61) + 1)
    assert not is_prime(3215031751)  # strong pseudoprime to bases 2, 3, 5, 7
    assert is_prime(18446744073709551557)  # largest prime below 2^64
    assert nth_prime_after(19_999_999, 1) == 20_000_003
    assert splitmix64(0) == 0xE220A8397B1DCDAF


def test_config_defaults_and_forms(tmp_path):
    flat = {"hidden_size": 64, "eos_token_id": [5, 6], "ple_layer_ids": [2], "heads_per_ngram": 4}
    cfg = PLEConfig.from_dict(flat)
    assert cfg.seed == 1234 and cfg.eos_token_id == 5 and cfg.ple_embed_dim == 64 and cfg.ngram_size == 3
    nested = {"model_type": "qwen4_exp", "text_config": dict(flat, seed=None)}
    assert PLEConfig.from_dict(nested) == cfg
    (tmp_path / "config.json").write_text(
        '{"text_config": {"hidden_size": 64, "eos_token_id": 5, "heads_per_ngram": 4}}'
    )
    assert PLEConfig.from_pretrained(tmp_path).hidden_size == 64
    assert PLEConfig.from_pretrained(tmp_path / "config.json").eos_token_id == 5


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"ple_embed_dim": 30}, "ple_embed_dim"),
        ({"ngram_size": 1}, "ngram_size"),
        ({"eos_token_id": None}, "eos_token_id"),
        ({"eos_token_id": []}, "eos_token_id"),
        ({"eos_token_id": 10**9}, "eos_token_id"),
        ({"hc_count": 0}, "hc_count"),
        ({"ple_layer_ids": [0]}, "ple_layer_ids"),
        ({"heads_per_ngram": -1}, "heads_per_ngram"),
        ({"ple_embedding_dtype": "int3"}, "ple_embedding_dtype"),
    ],
)
def test_config_validation_names_field(kw, field):
    d = {"hidden_size": 64, "eos_token_id": 5, "heads_per_ngram": 4}
    d.update(kw)
    with pytest.raises(ConfigError) as e:
        PLEConfig.from_dict(d)
    assert field in str(e.value)
    if kw.get(field) not in (None, []):
        assert repr(kw[field]) in str(e.value) or str(kw[field]) in str(e.value)


def test_layout_index_out_of_range():
    cfg = PLEConfig.from_dict({"hidden_size": 64, "eos_token_id": 5, "heads_per_ngram": 4, "ple_layer_ids": [2]})
    with pytest.raises(ConfigError, match="ple_layer_index"):
        cfg.layout(1)


def test_config_bounds_accept_their_edges_and_name_the_limit():
    """Each bound holds at its edge (the layout is computed, exactly) and refuses one past it, naming the limit."""
    from ple.config import LIMITS, MAX_HEAD_PRIMES, MAX_HEADS

    base = {"hidden_size": 64, "eos_token_id": 5, "heads_per_ngram": 1, "ngram_size": 2, "ple_embed_dim": 64}
    edge = PLEConfig.from_dict({**base, "ngram_size": 64, "ple_embed_dim": 63})
    assert len(edge.layout(0).multipliers) == 64
    heads = PLEConfig.from_dict({**base, "heads_per_ngram": MAX_HEADS, "ple_embed_dim": MAX_HEADS})
    assert heads.layout(0).num_heads == MAX_HEADS
    big = PLEConfig.from_dict({**base, "ngram_vocab_size_base": LIMITS["ngram_vocab_size_base"][1]})
    lay = big.layout(0)
    assert lay.head_sizes[0] > 1 << 40 and is_prime(lay.head_sizes[0])
    assert lay.padded_rows * lay.head_dim * 4 < 1 << 63  # bytes of the table fit an int64
    for field, (_, hi, why) in LIMITS.items():
        if field in ("seed",):
            continue
        with pytest.raises(ConfigError, match=re.escape(f"{field}={hi + 1}: at most {hi} ({why})")):
            PLEConfig.from_dict({**base, field: hi + 1})
    with pytest.raises(ConfigError, match=f"at most {(1 << 64) - 1}"):
        PLEConfig.from_dict({**base, "seed": 1 << 64})
    layers = list(range(1, MAX_HEAD_PRIMES + 2))
    with pytest.raises(ConfigError, match=f"= {MAX_HEAD_PRIMES + 1} head primes, at most {MAX_HEAD_PRIMES}"):
        PLEConfig.from_dict({**base, "ple_layer_ids": layers})
    with pytest.raises(ConfigError, match="ple_layer_index=True"):
        PLEConfig.from_dict(base).layout(True)


def test_layouts_of_many_layers_share_one_prime_run(monkeypatch):
    """Layouts computed in any order equal the direct computation; all layers of a config cost one pass."""
    import ple.layout
    from ple.layout import _primes_after, compute_layout

    cfg = PLEConfig.from_dict(
        {"hidden_size": 64, "eos_token_id": 5, "heads_per_ngram": 2, "ple_layer_ids": list(range(1, 41)), "seed": 3}
    )
    for idx in (39, 0, 17, 38, 1):
        lay = cfg.layout(idx)
        g = lay.num_heads
        assert list(lay.head_sizes) == _primes_after(cfg.ngram_vocab_size_base - 1, (idx + 1) * g)[idx * g :]
    found = []
    monkeypatch.setattr(ple.layout, "_primes_after", lambda start, n: found.append(n) or _primes_after(start, n))
    kw = dict(ngram_size=2, heads_per_ngram=1, vocab_size=1000, seed=1, divisible_by=1, split_parts=1, embed_dim=8)
    for idx in range(2000):
        compute_layout(ple_layer_index=idx, ngram_vocab_size_base=(1 << 40) + 7, **kw)
    assert sum(found) == 2000  # each prime found once, not 2000 * 2001 / 2 times
