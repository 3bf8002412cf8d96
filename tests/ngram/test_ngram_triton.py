"""The Triton n-gram id kernel against the literal reference, exactly: natively on a CUDA device,
otherwise on CPU tensors under the Triton interpreter (set up by tests/conftest.py)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from ple.config import PLEConfig
from ple.ngram import fresh_context, reference
from tests.conftest import TRITON_DEVICE, TRITON_INTERPRETED, load_golden

pytest.importorskip("triton")

_POISON = -(2**62) + 12345


# ---------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _poisoned_empty():
    """Make ``torch.empty`` return poisoned memory, so an element the kernel leaves unwritten fails."""
    orig = torch.empty

    def empty(*args, **kwargs):
        t = orig(*args, **kwargs)
        if t.dtype in (torch.int32, torch.int64):
            t.fill_(_POISON if t.dtype == torch.int64 else -(2**31))
        elif t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = orig


def _i64(v: int) -> int:
    """Python int -> its int64 two's complement value."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def _strided(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view holding the same values as ``t`` (1-D: every other element; 2-D: a transpose)."""
    if t.dim() == 1:
        base = torch.full((2 * t.shape[0] + 1,), -1, dtype=t.dtype)
        view = base[1::2]
    else:
        view = torch.full((t.shape[1], t.shape[0]), -1, dtype=t.dtype).t()
    view.copy_(t)
    return view


def _check(x, q, ctx, lay, eos, device, strided=False):
    """Triton ids and next context on ``device`` equal the reference's, exactly."""
    from ple.ngram import triton_impl

    want = reference.ngram_ids(x, q, ctx, lay, eos)
    want_ctx = reference.next_ngram_context(x, q, ctx)
    args = [x, q, ctx]
    if strided:
        args = [_strided(a) for a in args]
        assert args[0].numel() < 2 or not args[0].is_contiguous()
    args = [a.to(device) for a in args]
    with _poisoned_empty():
        got = triton_impl.ngram_ids(*args, lay, eos)
        got_ctx = triton_impl.next_ngram_context(*args)
    assert got.dtype == torch.int64 and got.device.type == device, (got.dtype, got.device)
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    got = got.cpu()
    if not torch.equal(got, want):
        bad = torch.nonzero(got != want)[0].tolist()
        raise AssertionError(f"ids differ at [t, g] = {bad}: got {int(got[tuple(bad)])}, want {int(want[tuple(bad)])}")
    assert got_ctx.dtype == torch.int64 and torch.equal(got_ctx.cpu(), want_ctx), (got_ctx.tolist(), want_ctx.tolist())
    return got


def _stream(rng: random.Random, n: int, vocab: int, eos: int, p_eos: float = 0.2) -> list[int]:
    return [eos if rng.random() < p_eos else rng.randrange(vocab) for _ in range(n)]


def _packed(chunks: list[list[int]], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([t for c in chunks for t in c], dtype=dtype)
    q = torch.tensor([0, *torch.tensor([len(c) for c in chunks], dtype=torch.int64).cumsum(0).tolist()], dtype=dtype)
    return x, q


def _small_cfg(**kw) -> PLEConfig:
    base = dict(eos_token_id=1, vocab_size=50, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=100)
    base.update(kw)
    base["hidden_size"] = 2 * (base["ngram_size"] - 1) * base["heads_per_ngram"]
    return PLEConfig(**base)


# ---------------------------------------------------------------------------------------------- cases
# Each case takes the device ("cpu" under the interpreter, or "cuda") and raises on a mismatch.


def _golden_case(config_name: str):
    def case(device):
        from ple.ngram import triton_impl

        (entry,) = [c for c in load_golden("ngram_ids.json") if c["config"]["name"] == config_name]
        c = dict(entry["config"])
        idx = c.pop("ple_layer_index")
        c.pop("name")
        eos = entry["eos_token_id"]
        lay = PLEConfig(hidden_size=c["ple_embed_dim"], eos_token_id=eos, **c).layout(idx)
        streams = [rq["tokens"] for rq in entry["requests"]]
        wants = [torch.tensor(rq["ids"], dtype=torch.int64) for rq in entry["requests"]]
        # each request alone, then all of them packed into one batch
        for s, w in zip(streams, wants):
            x, q = _packed([s], torch.int64)
            assert torch.equal(_check(x, q, fresh_context(1, lay, eos), lay, eos, device), w)
        x, q = _packed(streams, torch.int32)
        got = _check(x, q, fresh_context(len(streams), lay, eos).int(), lay, eos, device, strided=True)
        assert torch.equal(got, torch.cat(wants))
        # streamed in two rounds, the context carried by the Triton next_ngram_context
        rng = random.Random(config_name)
        cuts = [rng.randint(0, len(s)) for s in streams]
        ctx = fresh_context(len(streams), lay, eos)
        x1, q1 = _packed([s[:k] for s, k in zip(streams, cuts)], torch.int64)
        x2, q2 = _packed([s[k:] for s, k in zip(streams, cuts)], torch.int64)
        a = _check(x1, q1, ctx, lay, eos, device)
        ctx2 = triton_impl.next_ngram_context(x1.to(device), q1.to(device), ctx.to(device))
        b = _check(x2, q2, ctx2.cpu(), lay, eos, device)
        for i in range(len(streams)):
            both = torch.cat([a[int(q1[i]) : int(q1[i + 1])], b[int(q2[i]) : int(q2[i + 1])]])
            assert torch.equal(both, wants[i]), f"request {i} split at {cuts[i]}"

    return case


def _random_case(seed: int):
    def case(device):
        rng = random.Random(seed)
        n = rng.randint(2, 5)
        hpn = rng.randint(1, 8)
        vocab = rng.choice([50, 1000, 248320])
        eos = rng.choice([0, 1, vocab - 1, rng.randrange(vocab)])
        n_layers = rng.randint(1, 3)
        cfg = PLEConfig(
            hidden_size=(n - 1) * hpn * 2,
            eos_token_id=eos,
            vocab_size=vocab,
            ngram_size=n,
            heads_per_ngram=hpn,
            ple_layer_ids=tuple(range(1, n_layers + 1)),
            ngram_vocab_size_base=rng.choice([2, 97, 12345, 20_000_000]),
            seed=rng.randrange(10**6),
        )
        lay = cfg.layout(rng.randrange(n_layers))
        r_total = rng.randint(1, 7)
        lengths = [rng.choice([0, 1, 2, n - 1, n, rng.randint(0, 40)]) for _ in range(r_total)]
        chunks = [_stream(rng, k, vocab, eos, p_eos=rng.choice([0.0, 0.2, 0.6])) for k in lengths]
        dtype = rng.choice([torch.int32, torch.int64])
        x, q = _packed(chunks, dtype)
        ctx = torch.tensor([_stream(rng, n - 1, vocab, eos, p_eos=0.4) for _ in range(r_total)], dtype=dtype)
        ctx = ctx.reshape(r_total, n - 1)
        _check(x, q, ctx, lay, eos, device, strided=seed % 3 == 0)

    return case


def _eos_placements(device):
    cfg = _small_cfg(ngram_size=4, heads_per_ngram=3)
    lay, eos = cfg.layout(0), 1
    chunks = [
        [1, 5, 6, 7, 8],  # EOS first
        [5, 6, 7, 8, 1],  # EOS last
        [5, 1, 1, 6, 7, 1, 1, 1, 8, 9],  # consecutive EOS
        [1, 1, 1, 1],  # only EOS
        [9],  # one token after a context ending in EOS
        [2, 3],  # EOS in the middle of the context
        [4, 1, 4],
    ]
    ctx = torch.tensor([[1, 1, 1], [2, 3, 4], [2, 1, 3], [1, 1, 1], [6, 7, 1], [5, 1, 6], [1, 8, 9]])
    for dtype in (torch.int32, torch.int64):
        x, q = _packed(chunks, dtype)
        _check(x, q, ctx.to(dtype), lay, eos, device)


def _empty_requests(device):
    cfg = _small_cfg()
    lay, eos = cfg.layout(0), 1
    # empty requests before, between and after non-empty ones; their context must come back unchanged
    x, q = _packed([[], [5, 6, 7], [], [], [8], []], torch.int64)
    ctx = torch.tensor([[2, 3], [1, 1], [4, 4], [7, 1], [9, 2], [3, 3]])
    _check(x, q, ctx, lay, eos, device)
    # a batch with no tokens at all, and one with no requests
    _check(torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0, 0]), ctx[:2], lay, eos, device)
    _check(torch.zeros(0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32), ctx[:0], lay, eos, device)


def _many_blocks_and_requests(device):
    # T spans several token blocks (odd sizes) and R needs a deep binary search
    rng = random.Random(7)
    cfg = _small_cfg(ngram_size=3, heads_per_ngram=3, vocab_size=300, eos_token_id=7)
    lay, eos = cfg.layout(0), 7
    for lengths in ([129], [63, 1, 2, 0, 129], [rng.choice([0, 1, 2, 3]) for _ in range(133)]):
        chunks = [_stream(rng, k, 300, eos, 0.1) for k in lengths]
        x, q = _packed(chunks, torch.int64)
        ctx = torch.tensor([_stream(rng, 2, 300, eos, 0.3) for _ in lengths])
        _check(x, q, ctx, lay, eos, device)


def _published_geometry(device):
    cfg = PLEConfig(hidden_size=2560, hc_count=4, ple_layer_ids=(2,), eos_token_id=248044, split_ngram_parts=128)
    lay, eos = cfg.layout(0), 248044
    chunks = [[248319, 248318, 0, eos, 1, 200000, 248319], [248319] * 5, [eos, 248317, eos, eos, 248319]]
    ctx = torch.tensor([[eos, eos], [248319, 248318], [248000, eos]])
    for dtype in (torch.int32, torch.int64):
        x, q = _packed(chunks, dtype)
        got = _check(x, q, ctx.to(dtype), lay, eos, device)
        assert int(got.min()) >= 0 and int(got.max()) < lay.rows


def _unchecked_out_of_range(device):
    # the unchecked kernel still follows the reference's integer rules on ids outside the vocabulary:
    # products wrap in int64 and negative hashes take the floor modulo
    cfg = PLEConfig(hidden_size=2560, hc_count=4, eos_token_id=248044, split_ngram_parts=128)
    lay, eos = cfg.layout(0), 248044
    big = [2**40 + 3, -5, 2**62 + 1, -(2**63), 2**63 - 1, 248319, eos, 3, -(2**40)]
    x, q = _packed([big, big[::-1]], torch.int64)
    ctx = torch.tensor([[-7, 2**50], [eos, -1]])
    m0, m1 = lay.multipliers[:2]
    hashes = [_i64(_i64(y[0] * m0) ^ _i64(y[1] * m1)) for y in reference.ngram_tokens(big, 3, eos)]
    assert min(hashes) < 0
    _check(x, q, ctx, lay, eos, device)


def _detects_wrong_results(device):
    # the comparison can fail: a different EOS id or a different layer gives different ids
    from ple.ngram import triton_impl

    cfg = _small_cfg(ple_layer_ids=(1, 2))
    x, q = _packed([[5, 1, 6, 7], [1, 8]], torch.int64)
    ctx = torch.tensor([[2, 3], [4, 1]])
    want = reference.ngram_ids(x, q, ctx, cfg.layout(0), 1)
    dev = [a.to(device) for a in (x, q, ctx)]
    assert not torch.equal(triton_impl.ngram_ids(*dev, cfg.layout(0), 2).cpu(), want)
    assert not torch.equal(triton_impl.ngram_ids(*dev, cfg.layout(1), 1).cpu(), want)
    assert torch.equal(triton_impl.ngram_ids(*dev, cfg.layout(0), 1).cpu(), want)


_CASES = {
    "golden-four-gram-small": _golden_case("four-gram-small"),
    "golden-bigram-tiny": _golden_case("bigram-tiny"),
    **{f"random-{s}": _random_case(s) for s in range(12)},
    "eos-placements": _eos_placements,
    "empty-requests": _empty_requests,
    "many-blocks-and-requests": _many_blocks_and_requests,
    "published-geometry": _published_geometry,
    "unchecked-out-of-range": _unchecked_out_of_range,
    "detects-wrong-results": _detects_wrong_results,
}


# ---------------------------------------------------------------------------------------------- tests


def test_kernel_runs_natively_or_interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    from ple.ngram import triton_impl

    kernels = [getattr(triton_impl, k) for k in dir(triton_impl) if k.endswith("_kernel")]
    assert kernels
    assert all(isinstance(k, InterpretedFunction) == TRITON_INTERPRETED for k in kernels), kernels


@pytest.mark.parametrize("name", list(_CASES))
def test_triton_ngram_ids(name):
    _CASES[name](TRITON_DEVICE)
