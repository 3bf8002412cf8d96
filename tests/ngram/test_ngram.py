import random

import pytest
import torch

import ple.kernels.native as native_build
import ple.ngram as ngram_pkg
from ple.config import PLEConfig
from ple.ngram import NgramInputError, fresh_context, native, next_ngram_context, ngram_ids, reference, torch_impl
from tests.conftest import hf_config, load_golden, ple_config_from_hf


def _golden_cases():
    for case in load_golden("ngram_ids.json"):
        for i, rq in enumerate(case["requests"]):
            yield pytest.param(case, rq, id=f"{case['config']['name']}-{i}")


@pytest.mark.parametrize("case, request_", list(_golden_cases()))
@pytest.mark.parametrize("impl", ["checked", "reference", "torch", "native"])
def test_golden_ids(case, request_, impl):
    c = dict(case["config"])
    idx = c.pop("ple_layer_index")
    c.pop("name")
    cfg = PLEConfig(hidden_size=c["ple_embed_dim"], eos_token_id=case["eos_token_id"], **c)
    lay = cfg.layout(idx)
    x = torch.tensor(request_["tokens"])
    q = torch.tensor([0, len(x)])
    ctx = fresh_context(1, lay, cfg.eos_token_id)
    fn = {"checked": ngram_ids, "reference": reference.ngram_ids, "torch": torch_impl.ngram_ids}.get(impl)
    if impl == "native":
        if not native_build.available():
            pytest.fail("the C kernel does not build here")
        fn = native.ngram_ids
    assert torch.equal(fn(x, q, ctx, lay, cfg.eos_token_id), torch.tensor(request_["ids"], dtype=torch.int64))
    # the same request split into every two-chunk split gives the same ids
    for cut in range(1, len(x)):
        a = ngram_ids(x[:cut], torch.tensor([0, cut]), ctx, lay, cfg.eos_token_id)
        ctx2 = next_ngram_context(x[:cut], torch.tensor([0, cut]), ctx)
        b = ngram_ids(x[cut:], torch.tensor([0, len(x) - cut]), ctx2, lay, cfg.eos_token_id)
        assert torch.equal(torch.cat([a, b]), torch.tensor(request_["ids"]))


def _hf_ids(emb, tokens: torch.Tensor) -> torch.Tensor:
    """Ids transformers' Qwen4ExpTextNGramEmbedding passes to its embedding, one request, one shot."""
    seen = []
    orig = emb.ngram_embedding.forward

    def spy(ids):
        seen.append(ids.clone())
        return orig(ids)

    emb.ngram_embedding.forward = spy
    try:
        emb(tokens.view(1, -1), None)
    finally:
        emb.ngram_embedding.forward = orig
    return seen[0][0]


def _random_stream(rng: random.Random, n: int, vocab: int, eos: int) -> list[int]:
    out = []
    for _ in range(n):
        r = rng.random()
        out.append(eos if r < 0.15 else rng.randrange(vocab))
    if n and rng.random() < 0.3:
        out[0] = eos
    if n > 3 and rng.random() < 0.3:
        out[1:3] = [eos, eos]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_matches_transformers_packed_and_chunked(seed):
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    rng = random.Random(seed)
    n = rng.randint(2, 5)
    hpn = rng.randint(1, 8)
    n_layers = rng.randint(1, 3)
    idx = rng.randrange(n_layers)
    g = (n - 1) * hpn
    hf = hf_config(
        ngram_size=n,
        heads_per_ngram=hpn,
        hidden_size=g * 2,
        ple_embed_dim=g * 2,
        ple_layer_ids=list(range(1, n_layers + 1)),
        vocab_size=rng.choice([50, 300, 248320]),
        eos_token_id=rng.choice([0, 3, 42]),
        seed=rng.randrange(10**6),
        ngram_vocab_size_base=rng.choice([97, 1000, 12345]),
    )
    cfg = ple_config_from_hf(hf)
    lay = cfg.layout(idx)
    emb = Qwen4ExpTextNGramEmbedding(hf, hf.ple_embed_dim, idx, idx)
    eos = cfg.eos_token_id
    streams = [_random_stream(rng, rng.randint(1, 30), cfg.vocab_size, eos) for _ in range(rng.randint(1, 6))]
    want = [_hf_ids(emb, torch.tensor(s)) for s in streams]
    # split every stream into chunks; process chunk rounds as packed batches
    cuts = []
    for s in streams:
        pts = sorted(rng.sample(range(1, len(s)), k=min(len(s) - 1, rng.randint(0, 4)))) if len(s) > 1 else []
        cuts.append([0, *pts, len(s)])
    got = [[] for _ in streams]
    ctx = {i: fresh_context(1, lay, eos)[0] for i in range(len(streams))}
    dtype = rng.choice([torch.int32, torch.int64])
    rnd = 0
    while True:
        live = [i for i in range(len(streams)) if rnd + 1 < len(cuts[i])]
        if not live:
            break
        chunks = [streams[i][cuts[i][rnd] : cuts[i][rnd + 1]] for i in live]
        x = torch.tensor([t for c in chunks for t in c], dtype=dtype)
        q = torch.tensor([0, *torch.tensor([len(c) for c in chunks]).cumsum(0).tolist()], dtype=dtype)
        c = torch.stack([ctx[i] for i in live]).to(dtype)
        fast = ngram_ids(x, q, c, lay, eos)
        ref = reference.ngram_ids(x, q, c, lay, eos)
        assert fast.dtype == torch.int64 and torch.equal(fast, ref)
        nxt = next_ngram_context(x, q, c)
        assert torch.equal(nxt, reference.next_ngram_context(x, q, c))
        for j, i in enumerate(live):
            got[i].append(fast[q[j] : q[j + 1]])
            ctx[i] = nxt[j]
        rnd += 1
    for i in range(len(streams)):
        assert torch.equal(torch.cat(got[i]), want[i]), f"stream {i}"


def test_empty_requests_and_batch():
    cfg = PLEConfig(hidden_size=8, eos_token_id=1, vocab_size=50, heads_per_ngram=2, ngram_vocab_size_base=100)
    lay = cfg.layout(0)
    x = torch.tensor([5, 6, 7])
    q = torch.tensor([0, 0, 3, 3])
    ctx = torch.tensor([[2, 3], [1, 1], [4, 4]])
    out = ngram_ids(x, q, ctx, lay, 1)
    assert out.shape == (3, 4)
    assert torch.equal(out, reference.ngram_ids(x, q, ctx, lay, 1))
    nxt = next_ngram_context(x, q, ctx)
    assert nxt.tolist() == [[2, 3], [6, 7], [4, 4]]
    empty = ngram_ids(torch.zeros(0, dtype=torch.long), torch.tensor([0]), torch.zeros(0, 2, dtype=torch.long), lay, 1)
    assert empty.shape == (0, 4)


def test_published_geometry_wraps_like_int64():
    cfg = PLEConfig(hidden_size=2560, hc_count=4, eos_token_id=248044, split_ngram_parts=128)
    lay = cfg.layout(0)
    x = torch.tensor([248319, 248318, 0, 248044, 1, 200000, 248319])
    q = torch.tensor([0, 7])
    ctx = fresh_context(1, lay, 248044)
    a = torch_impl.ngram_ids(x, q, ctx, lay, 248044)
    assert torch.equal(a, reference.ngram_ids(x, q, ctx, lay, 248044))
    assert int(a.min()) >= 0 and int(a.max()) < lay.rows


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda x, q, c: (x.float(), q, c), "input_ids must be int32 or int64"),
        (lambda x, q, c: (x, q.float(), c), "query_start_loc must be int32 or int64"),
        (lambda x, q, c: (x.view(1, -1), q, c), r"input_ids must be 1-D"),
        (lambda x, q, c: (x, q + 1, c), "must start at 0"),
        (lambda x, q, c: (x, torch.tensor([0, 3, 2, 6]), c), "decreases at request 1: 3 -> 2"),
        (lambda x, q, c: (x, torch.tensor([0, 2, 4, 5]), c), "must end at T=6"),
        (lambda x, q, c: (x, q, c[:, :1]), r"shape \[R, N-1\] = \[3, 2\]"),
        (lambda x, q, c: (x, q, c[:2]), r"shape \[R, N-1\] = \[3, 2\]"),
        (
            lambda x, q, c: (torch.tensor([1, 2, 3, 50, 4, 5]), q, c),
            r"token id 50 at position 3 \(request 1, offset 1\)",
        ),
        (
            lambda x, q, c: (torch.tensor([1, 2, 3, 4, 5, -1]), q, c),
            r"token id -1 at position 5 \(request 2, offset 1\)",
        ),
        (lambda x, q, c: (x, q, torch.tensor([[1, 1], [1, 99], [1, 1]])), r"ngram_context\[1, 1\] = 99 \(request 1\)"),
    ],
)
def test_checked_entry_refuses(mutate, match):
    cfg = PLEConfig(hidden_size=8, eos_token_id=1, vocab_size=50, heads_per_ngram=2, ngram_vocab_size_base=100)
    lay = cfg.layout(0)
    x = torch.tensor([1, 2, 3, 4, 5, 6])
    q = torch.tensor([0, 2, 4, 6])
    c = fresh_context(3, lay, 1)
    with pytest.raises(NgramInputError, match=match):
        ngram_ids(*mutate(x, q, c), lay, 1)


@pytest.mark.parametrize("seed", range(8))
def test_native_kernel_matches_torch_and_reference(seed):
    """Random geometries (N 2-4), packed batches crossing the kernel's 4096-token work chunks, empty
    requests, EOS in tokens and contexts, int32 and int64 inputs, any thread count."""
    rng = random.Random(seed)
    n = rng.choice([2, 3, 4])
    cfg = PLEConfig(
        hidden_size=8 * (n - 1) * 2,
        eos_token_id=3,
        vocab_size=rng.choice([50, 70000, 248320]),
        ngram_size=n,
        heads_per_ngram=rng.choice([1, 2, 3]),
        ngram_vocab_size_base=rng.choice([97, 20_000_000]),
        ple_embed_dim=(n - 1) * 6,
    )
    lay = cfg.layout(rng.randrange(2))
    lens = [rng.choice([0, 1, 2, 5, 700, 3000]) for _ in range(rng.randint(1, 7))]
    q = torch.tensor([0, *lens]).cumsum(0)
    x = torch.tensor(_random_stream(rng, sum(lens), cfg.vocab_size, 3), dtype=torch.int64)
    ctx = torch.tensor([[rng.choice([3, rng.randrange(cfg.vocab_size)]) for _ in range(n - 1)] for _ in lens])
    if seed % 2:
        x, q, ctx = x.int(), q.int(), ctx.int()
    want = torch_impl.ngram_ids(x, q, ctx, lay, 3)
    for threads in (1, 2, 5):
        assert torch.equal(native.ngram_ids(x, q, ctx, lay, 3, threads=threads), want)
    small = min(len(x), 40)
    q_small = torch.tensor([0, small])
    assert torch.equal(
        native.ngram_ids(x[:small], q_small, ctx[:1], lay, 3), reference.ngram_ids(x[:small], q_small, ctx[:1], lay, 3)
    )


def test_native_kernel_extreme_hashes():
    """Tokens 0 and vocab-1 with the published multipliers: hashes of both signs near the int64 limits."""
    cfg = PLEConfig(hidden_size=2560, hc_count=4, eos_token_id=248044, split_ngram_parts=128)
    lay = cfg.layout(0)
    x = torch.tensor([0, 248319, 248319, 0, 0, 248319, 248044, 248318, 1, 248319] * 50)
    q = torch.tensor([0, len(x)])
    ctx = torch.tensor([[248319, 0]])
    assert torch.equal(native.ngram_ids(x, q, ctx, lay, 248044), reference.ngram_ids(x, q, ctx, lay, 248044))


def test_checked_entry_runs_the_kernel_on_cpu(monkeypatch):
    calls = []
    real = native.ids_from_tensors
    monkeypatch.setattr(native, "ids_from_tensors", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = PLEConfig(hidden_size=8, eos_token_id=1, vocab_size=50, heads_per_ngram=2, ngram_vocab_size_base=100)
    lay = cfg.layout(0)
    x, q, ctx = torch.tensor([5, 6, 7]), torch.tensor([0, 3]), torch.tensor([[2, 3]])
    assert torch.equal(ngram_pkg.ngram_ids(x, q, ctx, lay, 1), reference.ngram_ids(x, q, ctx, lay, 1))
    assert calls == [1]
    monkeypatch.setenv("PLE_NATIVE", "0")  # turned off: the torch path, same ids
    assert torch.equal(ngram_pkg.ngram_ids(x, q, ctx, lay, 1), reference.ngram_ids(x, q, ctx, lay, 1))
    assert calls == [1]


def test_native_kernel_refuses_bad_offsets_even_unchecked():
    cfg = PLEConfig(hidden_size=8, eos_token_id=1, vocab_size=50, heads_per_ngram=2, ngram_vocab_size_base=100)
    lay = cfg.layout(0)
    x, ctx = torch.tensor([5, 6, 7]), torch.tensor([[2, 3], [2, 3]])
    for q in (torch.tensor([0, 2, 1]), torch.tensor([0, 1, 5]), torch.tensor([1, 2, 3])):
        with pytest.raises(ValueError, match="query_start_loc is not 0 .. T=3"):
            native.ngram_ids(x, q, ctx, lay, 1)


def test_operator_matches_the_checked_entry_point_and_passes_opcheck():
    from ple.ngram import layout_tensors

    cfg = PLEConfig(hidden_size=8, vocab_size=300, eos_token_id=7, heads_per_ngram=2, ngram_size=4, ple_embed_dim=12)
    lay = cfg.layout(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (23,), generator=g)
    tokens[5] = 7
    qsl = torch.tensor([0, 4, 4, 23])
    ctx = torch.randint(0, 300, (3, 3), generator=g)
    mult, sizes, offs = layout_tensors(lay, torch.device("cpu"))
    args = (tokens, qsl, ctx, mult, sizes, offs, lay.heads_per_ngram, cfg.eos_token_id)
    assert torch.equal(torch.ops.ple.ngram_ids(*args), ngram_ids(tokens, qsl, ctx, lay, cfg.eos_token_id))
    torch.library.opcheck(torch.ops.ple.ngram_ids.default, args)
