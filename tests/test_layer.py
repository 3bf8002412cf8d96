import random

import pytest
import torch

from ple.layer import PLELayer
from ple.runtime import Batch, BatchError
from ple.table import MemoryTable
from tests.conftest import hf_config, hf_ple_layer


def _random_hf(seed: int, dtype=torch.float32):
    rng = random.Random(seed)
    hc = rng.randint(2, 4)
    n = rng.randint(2, 4)
    k = rng.randint(2, 4)
    hpn = rng.randint(1, 3)
    g = (n - 1) * hpn
    h = rng.choice([10, 14, 18, 22])  # not powers of two
    e = g * rng.randint(1, 3)
    n_layers = rng.randint(1, 2)
    idx = rng.randrange(n_layers)
    hf = hf_config(
        hidden_size=h,
        hc_count=hc,
        ngram_size=n,
        heads_per_ngram=hpn,
        ple_embed_dim=e,
        ple_conv_kernel_size=k,
        ple_layer_ids=list(range(1, n_layers + 1)),
        vocab_size=rng.choice([60, 300]),
        eos_token_id=rng.choice([0, 5]),
        seed=rng.randrange(10**5),
    )
    mod = hf_ple_layer(hf, idx, seed=seed, dtype=dtype)
    return hf, mod, rng


def _hf_oneshot(mod, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hidden + mod(hidden[None], tokens[None], None)[0]


def _stream(rng, n, vocab, eos):
    return torch.tensor([eos if rng.random() < 0.15 else rng.randrange(vocab) for _ in range(n)])


@pytest.mark.parametrize("seed", range(6))
def test_packed_prefill_matches_transformers_fp32(seed):
    hf, mod, rng = _random_hf(seed)
    layer = PLELayer.from_transformers(mod)
    cfg = layer.config
    lens = [rng.randint(1, 20) for _ in range(rng.randint(1, 5))]
    toks = [_stream(rng, n, cfg.vocab_size, cfg.eos_token_id) for n in lens]
    hid = [torch.randn(n, cfg.hc_hidden_size) for n in lens]
    pool = layer.new_state_pool(len(lens) + 2)
    batch = Batch.build(
        lens,
        list(range(len(lens))),
        torch.full((len(lens), cfg.ngram_size - 1), cfg.eos_token_id),
        pool,
        conv_window=cfg.conv_window,
    )
    out = layer(torch.cat(hid), torch.cat(toks), batch)
    start = 0
    for h, t in zip(hid, toks):
        want = _hf_oneshot(mod, h, t)
        got = out[start : start + len(t)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        start += len(t)


@pytest.mark.parametrize("seed", range(3))
def test_bf16_error_rule(seed):
    """bf16: error vs an fp64 computation <= 2 x the error of transformers' bf16 eager + 1e-3."""
    hf, mod32, rng = _random_hf(100 + seed)
    mod64 = hf_ple_layer(hf, mod32.ple_embedding.ple_layer_index, seed=100 + seed, dtype=torch.float64)
    mod16 = hf_ple_layer(hf, mod32.ple_embedding.ple_layer_index, seed=100 + seed, dtype=torch.bfloat16)
    layer = PLELayer.from_transformers(mod16)
    cfg = layer.config
    n = rng.randint(20, 40)
    t = _stream(rng, n, cfg.vocab_size, cfg.eos_token_id)
    h = torch.randn(n, cfg.hc_hidden_size, dtype=torch.float64)
    exact = _hf_oneshot(mod64, h, t)
    hf16 = _hf_oneshot(mod16, h.bfloat16(), t).double()
    pool = layer.new_state_pool(1)
    batch = Batch.build([n], [0], torch.full((1, cfg.ngram_size - 1), cfg.eos_token_id), pool)
    ours = layer(h.bfloat16(), t, batch).double()
    assert ours.dtype == torch.float64
    err_ref = (hf16 - exact).abs().max().item()
    err_ours = (ours - exact).abs().max().item()
    assert err_ours <= 2 * err_ref + 1e-3, (err_ours, err_ref)


@pytest.mark.parametrize("seed", range(3))
def test_forward_padded_and_gradients_match_transformers(seed):
    hf, mod, rng = _random_hf(200 + seed)
    mod64 = mod  # fp32: both sides run the same reference arithmetic
    layer = PLELayer.from_transformers(mod64)
    layer.table.data.requires_grad_(False)
    cfg = layer.config
    b, s = 3, rng.randint(5, 12)
    ids = torch.stack([_stream(rng, s, cfg.vocab_size, cfg.eos_token_id) for _ in range(b)])
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    mask[2, :4] = 0
    h1 = torch.randn(b, s, cfg.hc_hidden_size, dtype=torch.float32, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    ours = layer.forward_padded(h1, ids, attention_mask=mask)
    # transformers' decoder feeds its PLE ids with padding replaced by EOS and masks the conv input
    hf_ids = torch.where(mask.bool(), ids, cfg.eos_token_id)
    theirs = mod64(h2, hf_ids, None, conv_mask=mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(ours)
    ours.backward(g)
    theirs.backward(g)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-5)
    pairs = [
        (layer.key_proj, mod64.key_proj.weight),
        (layer.value_proj, mod64.value_proj.weight),
        (layer.norm_key, mod64.norm_key.weight),
        (layer.norm_query, mod64.norm_query.weight),
        (layer.norm_conv, mod64.norm_conv.weight),
    ]
    for ours_p, theirs_p in pairs:
        torch.testing.assert_close(ours_p.grad, theirs_p.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.conv_weight.grad, mod64.conv1d.weight.grad.squeeze(1), rtol=1e-5, atol=1e-5)


def test_table_gradient_through_forward_padded():
    hf, mod, rng = _random_hf(7)
    layer = PLELayer.from_transformers(mod)
    table = layer.table.data.detach().clone().requires_grad_(True)
    layer.set_table(MemoryTable(table))
    cfg = layer.config
    ids = _stream(rng, 9, cfg.vocab_size, cfg.eos_token_id)[None]
    h = torch.randn(1, 9, cfg.hc_hidden_size)
    layer.forward_padded(h, ids).sum().backward()
    mod.zero_grad()
    mod(h, ids, None).sum().backward()
    grad = mod.ple_embedding.ngram_embedding.weight.grad
    assert grad.abs().sum() > 0
    torch.testing.assert_close(table.grad, grad, rtol=1e-5, atol=1e-5)


def test_engine_call_validation():
    hf, mod, rng = _random_hf(3)
    layer = PLELayer.from_transformers(mod)
    cfg = layer.config
    pool = layer.new_state_pool(4, num_spec=2)
    ctx = torch.full((2, cfg.ngram_size - 1), cfg.eos_token_id)
    with pytest.raises(BatchError, match="slot 1 is used by requests 0 and 1"):
        Batch.build([2, 3], [1, 1], ctx, pool, num_spec=2)
    with pytest.raises(BatchError, match=r"slot index 9 outside \[-1, 4\)"):
        Batch.build([2, 3], [0, 9], ctx, pool, num_spec=2)
    with pytest.raises(BatchError, match=r"verify row has 1..1\+num_spec = 1..3 tokens, got 4"):
        Batch.build([2, 4], [0, 1], ctx, pool, kinds=["prefill", "verify"], num_spec=2)
    with pytest.raises(BatchError, match="decode row has exactly 1 token, got 2"):
        Batch.build([2, 1], [0, 1], ctx, pool, kinds=["decode", "decode"], num_spec=2)
    with pytest.raises(BatchError, match="accepted count 5 outside 1..previous verify length 3"):
        Batch.build([1, 1], [0, 1], ctx, pool, num_accepted=[None, 5], prev_query_lens=[None, 3], num_spec=2)
    with pytest.raises(BatchError, match=r"window is 3\d* columns|window is \d+ columns"):
        Batch.build([1, 1], [0, 1], ctx, pool, num_spec=0, conv_window=cfg.conv_window)
    batch = Batch.build([2, 3], [0, 1], ctx, pool, num_spec=2)
    with pytest.raises(ValueError, match="batch covers 5 tokens, hidden has 4"):
        layer(torch.zeros(4, cfg.hc_hidden_size), torch.zeros(4, dtype=torch.long), batch)
    with pytest.raises(ValueError, match=r"hidden must be \[T, HC\*H="):
        layer(torch.zeros(5, 3), torch.zeros(5, dtype=torch.long), batch)


def test_null_slot_row_is_skipped():
    hf, mod, rng = _random_hf(4)
    layer = PLELayer.from_transformers(mod)
    cfg = layer.config
    pool = layer.new_state_pool(2)
    pool.normal_()
    before = pool.clone()
    t = _stream(rng, 5, cfg.vocab_size, cfg.eos_token_id)
    h = torch.randn(5, cfg.hc_hidden_size)
    batch = Batch.build([5], [-1], torch.full((1, cfg.ngram_size - 1), cfg.eos_token_id), pool)
    out = layer(h, t, batch)
    assert torch.equal(pool, before)
    # no conv: hidden + v, where v + conv = transformers' output with a zero conv weight
    with torch.no_grad():
        mod.conv1d.weight.zero_()
    torch.testing.assert_close(out, _hf_oneshot(mod, h, t), rtol=1e-5, atol=1e-5)


def test_prefetched_lookup_gives_the_same_output():
    hf, mod, rng = _random_hf(11)
    layer = PLELayer.from_transformers(mod)
    cfg = layer.config
    lens = [3, 7, 1]
    toks = torch.cat([_stream(rng, n, cfg.vocab_size, cfg.eos_token_id) for n in lens])
    h = torch.randn(sum(lens), cfg.hc_hidden_size)
    ctx = torch.full((3, cfg.ngram_size - 1), cfg.eos_token_id)
    outs = []
    for use_prefetch in (False, True):
        batch = Batch.build(lens, [0, 1, 2], ctx, layer.new_state_pool(3))
        handle = layer.start_prefetch(toks, batch) if use_prefetch else None
        outs.append(layer(h, toks, batch, prefetched=handle))
    assert torch.equal(outs[0], outs[1])


def test_engine_call_is_inference_only():
    hf, mod, rng = _random_hf(5)
    layer = PLELayer.from_transformers(mod)
    cfg = layer.config
    batch = Batch.build([3], [0], torch.full((1, cfg.ngram_size - 1), cfg.eos_token_id), layer.new_state_pool(1))
    h = torch.randn(3, cfg.hc_hidden_size, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        layer(h, torch.tensor([1, 2, 3]), batch)
    out = layer(h.detach(), torch.tensor([1, 2, 3]), batch)  # parameters require grad: still fine
    assert not out.requires_grad


def test_engine_verify_then_accepted_count_selects_the_window():
    """Driving the engine call directly: prefill, a verify row of 1+3 tokens of which 2 are
    accepted, then a decode row whose batch carries the accepted count: outputs of kept tokens equal
    the one-shot computation over the kept history."""
    hf, mod, rng = _random_hf(21)
    layer = PLELayer.from_transformers(mod)
    cfg = layer.config
    num_spec = 3
    pool = layer.new_state_pool(2, num_spec=num_spec)
    pool[1].normal_()  # another request's slot: must stay untouched
    other = pool[1].clone()
    eos = cfg.eos_token_id
    prompt = _stream(rng, 7, cfg.vocab_size, eos)
    draft = _stream(rng, 4, cfg.vocab_size, eos)
    nxt = _stream(rng, 1, cfg.vocab_size, eos)
    h_prompt, h_draft, h_next = (torch.randn(n, cfg.hc_hidden_size) for n in (7, 4, 1))
    kw = dict(num_spec=num_spec, conv_window=cfg.conv_window)
    ctx = torch.full((1, cfg.ngram_size - 1), eos)
    out1 = layer(h_prompt, prompt, Batch.build([7], [0], ctx, pool, **kw))
    ctx = ple_next_context(prompt, ctx)
    out2 = layer(h_draft, draft, Batch.build([4], [0], ctx, pool, kinds=["verify"], **kw))
    kept = 2
    ctx = ple_next_context(draft[:kept], ctx)
    batch = Batch.build([1], [0], ctx, pool, kinds=["decode"], num_accepted=[kept], prev_query_lens=[4], **kw)
    assert batch.num_rejected.tolist() == [2]
    out3 = layer(h_next, nxt, batch)
    hist_h = torch.cat([h_prompt, h_draft[:kept], h_next])
    hist_t = torch.cat([prompt, draft[:kept], nxt])
    want = _hf_oneshot(mod, hist_h, hist_t)
    got = torch.cat([out1, out2[:kept], out3])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[1], other)


def ple_next_context(tokens, ctx):
    from ple import next_ngram_context

    return next_ngram_context(tokens, torch.tensor([0, len(tokens)]), ctx)


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_project_rows_do_not_depend_on_the_other_rows(dtype, threads):
    """Each row of PLELayer.project is its own row's projection whatever rows it is computed with (what a
    rank that projects only its own rows relies on), within one rounding of the dtype: whether the last
    bits agree is the CPU's GEMM's choice (PyTorch on an AMD EPYC: equal once fp32 is padded to 4 rows;
    an Intel Xeon with AMX blocks small GEMMs otherwise), so only the values are compared exactly enough
    to catch a wrong, shifted or padded row."""
    from ple.config import PLEConfig

    cfg = PLEConfig(
        hidden_size=160, hc_count=4, ple_embed_dim=640, ngram_size=3, heads_per_ngram=2, vocab_size=100, eos_token_id=1
    )
    layer = PLELayer(cfg, 0, dtype=dtype)
    g = torch.Generator().manual_seed(threads)
    with torch.no_grad():
        layer.key_proj.copy_(torch.randn(layer.key_proj.shape, generator=g) / 25)
        layer.value_proj.copy_(torch.randn(layer.value_proj.shape, generator=g) / 25)
    layer.refresh_weights()
    emb = torch.randn(70, cfg.ple_embed_dim, generator=g).to(dtype)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        key, value = layer.project(emb)
        assert key.shape == (70, cfg.hc_hidden_size) and value.shape == (70, cfg.hidden_size)
        tol = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-2}
        for a, b in [(0, 1), (0, 2), (4, 7), (5, 10), (9, 20), (1, 18), (3, 70), (69, 70)]:
            k, v = layer.project(emb[a:b])
            assert k.shape == (b - a, cfg.hc_hidden_size) and v.shape == (b - a, cfg.hidden_size)
            torch.testing.assert_close(k, key[a:b], **tol, msg=f"rows {a}:{b}")
            torch.testing.assert_close(v, value[a:b], **tol, msg=f"rows {a}:{b}")
            # each row against the same GEMM of that row alone: a row taken from another input row is
            # off by the rows' difference (order 1), far outside the tolerance
            for r in (a, b - 1):
                kr, vr = layer.project(emb[r : r + 1])
                torch.testing.assert_close(k[r - a : r - a + 1], kr, **tol, msg=f"row {r} of {a}:{b}")
                torch.testing.assert_close(v[r - a : r - a + 1], vr, **tol, msg=f"row {r} of {a}:{b}")
    finally:
        torch.set_num_threads(saved)


def test_engine_call_projects_through_projections(monkeypatch):
    # one GEMM of every row of the step, through the one seam both the C path and the operators take
    hf, mod, rng = _random_hf(12)
    layer = PLELayer.from_transformers(mod)
    cfg = layer.config
    calls = []
    real = layer.projections
    monkeypatch.setattr(layer, "projections", lambda emb: calls.append(emb.shape) or real(emb))
    batch = Batch.build([3, 2], [0, 1], torch.full((2, cfg.ngram_size - 1), cfg.eos_token_id), layer.new_state_pool(2))
    layer(torch.randn(5, cfg.hc_hidden_size), _stream(rng, 5, cfg.vocab_size, cfg.eos_token_id), batch)
    assert calls == [(5, layer.layout.embed_dim)]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(query_lens=[True, 2]), "query length True must be a non-negative int"),
        (dict(query_lens=[2.0, 2]), "query length 2.0 must be a non-negative int"),
        (dict(slot_indices=[True, 1]), r"slot index True outside \[-1, 4\)"),
        (dict(num_rejected=[0.0, 0]), "num_rejected 0.0 must be an int"),
        (dict(has_initial_state=[1, 0]), "has_initial_state 1 must be a bool"),
        (dict(ngram_context=torch.zeros(2, 2)), "ngram_context must be an int32/int64 tensor, got torch.float32"),
        (dict(num_spec=1.0), "num_spec must be a non-negative int, got 1.0"),
        (dict(vocab_size=10, ngram_context=torch.tensor([[1, 2], [3, 10]])), r"token 10, outside \[0, vocab_size=10\)"),
    ],
)
def test_batch_refuses_converted_values(kwargs, match):
    args = dict(
        query_lens=[2, 2],
        slot_indices=[0, 1],
        ngram_context=torch.zeros(2, 2, dtype=torch.long),
        conv_state=torch.zeros(4, 6, 9),
    )
    args.update(kwargs)
    with pytest.raises(BatchError, match=match):
        Batch.build(
            args.pop("query_lens"), args.pop("slot_indices"), args.pop("ngram_context"), args.pop("conv_state"), **args
        )


def test_a_table_of_another_layer_is_refused(tmp_path):
    from ple.config import PLEConfig
    from ple.errors import InvalidArgumentError
    from ple.table import CachedTable, MmapTable
    from tests.table._helpers import write_file

    cfg = PLEConfig(
        hidden_size=8,
        vocab_size=300,
        eos_token_id=7,
        heads_per_ngram=2,
        ngram_size=3,
        ple_embed_dim=8,
        ngram_vocab_size_base=600,
        make_ngram_vocab_size_divisible_by=128,
        ple_layer_ids=(1, 2),
    )
    rows, head_dim = cfg.layout(0).padded_rows, cfg.layout(0).head_dim
    assert cfg.layout(1).padded_rows == rows  # same geometry, other hashing
    data = torch.randn(rows, head_dim).bfloat16()
    path = write_file(tmp_path / "layer1.pletable", "bf16", data, None, 1000, layout=cfg.layout_fields(1))
    table = MmapTable.open(path)
    for tier in (table, CachedTable(table, 10)):
        with pytest.raises(InvalidArgumentError, match="built for another layout"):
            PLELayer(cfg, 0, table=tier)
        layer = PLELayer(cfg, 1, table=tier)  # its own layer takes it
        assert layer.table is tier
    PLELayer(cfg, 0, table=MemoryTable(data))  # no layout hash: taken on its geometry
    table.close()


def test_prefetch_handle_is_checked_against_its_inputs():
    from ple.table import PrefetchError

    hf, mod, rng = _random_hf(13)
    layer = PLELayer.from_transformers(mod)
    other = PLELayer.from_transformers(mod)
    cfg = layer.config
    ctx = torch.full((2, cfg.ngram_size - 1), cfg.eos_token_id)
    pool = layer.new_state_pool(2)
    batch = Batch.build([3, 2], [0, 1], ctx, pool)
    batch2 = Batch.build([3, 2], [0, 1], ctx.clone(), pool)
    toks = _stream(rng, 5, cfg.vocab_size, cfg.eos_token_id)
    toks2 = toks.clone()
    toks2[0] = (toks2[0] + 1) % cfg.vocab_size
    h = torch.randn(5, cfg.hc_hidden_size)
    handle = layer.start_prefetch(toks, batch)
    for args, match in (
        ((h, toks2, batch), "started for other inputs"),
        ((h, toks, batch2), "started for other inputs"),
    ):
        with pytest.raises(PrefetchError, match=match):
            layer(*args, prefetched=handle)
    with pytest.raises(PrefetchError, match="started for other inputs"):
        other(h, toks, batch, prefetched=handle)
    assert torch.equal(pool, torch.zeros_like(pool))  # nothing ran
    out = layer(h, toks, batch, prefetched=handle)  # the right inputs: taken
    pool.zero_()
    assert torch.equal(out, layer(h, toks, batch))
    handle = layer.start_prefetch(toks, batch)
    toks.add_(0)  # modified in place (same values, new version)
    with pytest.raises(PrefetchError, match="modified in place"):
        layer(h, toks, batch, prefetched=handle)
    handle.release()
    unbound = layer.table.start_prefetch(layer.ngram_ids(toks, batch), layer.dtype)
    with pytest.raises(PrefetchError, match="not bound"):
        layer(h, toks, batch, prefetched=unbound)
    unbound.release()


def test_engine_call_refuses_tokens_outside_the_vocabulary_on_the_cpu():
    from ple.ngram import NgramInputError

    hf, mod, rng = _random_hf(14)
    layer = PLELayer.from_transformers(mod)
    cfg = layer.config
    pool = layer.new_state_pool(1)
    batch = Batch.build([3], [0], torch.full((1, cfg.ngram_size - 1), cfg.eos_token_id), pool)
    with pytest.raises(NgramInputError, match=f"token id {cfg.vocab_size} at position 1 is outside"):
        layer(torch.randn(3, cfg.hc_hidden_size), torch.tensor([1, cfg.vocab_size, 2]), batch)
    bad_ctx = Batch.build([3], [0], torch.full((1, cfg.ngram_size - 1), -1), pool)
    with pytest.raises(NgramInputError, match=r"ngram_context\[0, 0\] = -1"):
        layer(torch.randn(3, cfg.hc_hidden_size), torch.tensor([1, 2, 2]), bad_ctx)
    assert torch.equal(pool, torch.zeros_like(pool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_call_without_the_dispatcher_equals_the_operators(dtype):
    """Eagerly on the CPU the engine call runs the operators' CPU functions directly; under a profiler
    (and in compiled code, other devices, tensor subclasses) the torch.ops.ple operators; the session's
    unchecked call runs the C kernels from the layer's NativeStep, or without it the kernels through the
    operators' registry. All give the same outputs and states, bit for bit, and refuse the same tokens."""
    import ple.runtime.native_step as layer_module
    from ple.ngram import NgramInputError

    hf, mod, rng = _random_hf(21, dtype)
    layer = PLELayer.from_transformers(mod)
    cfg = layer.config
    lens = [4, 1, 6]
    toks = torch.cat([_stream(rng, n, cfg.vocab_size, cfg.eos_token_id) for n in lens])
    h = torch.randn(sum(lens), cfg.hc_hidden_size).to(dtype)
    ctx = torch.full((3, cfg.ngram_size - 1), cfg.eos_token_id)
    start = layer.new_state_pool(3)
    start.normal_()

    def operators(checked=True):
        eager = layer_module.eager_on_cpu(layer, h, toks, Batch.build(lens, [0, 1, 2], ctx, start), None)
        return layer_module.operators_for(eager, checked)

    direct = operators()
    assert direct[2] is not torch.ops.ple.gate_conv  # the CPU function, not the operator
    with pytest.MonkeyPatch.context() as mp:  # a torch without the dispatch-mode count: the operators
        mp.setattr(layer_module, "_DISPATCH_STACK", None)
        via = operators()
        assert via[0] is torch.ops.ple.ngram_ids and via[2] is torch.ops.ple.gate_conv
    with torch._subclasses.fake_tensor.FakeTensorMode():  # a dispatch mode: the operators
        via = operators()
        assert via[2] is torch.ops.ple.gate_conv
    bare = operators(False)
    assert bare[2] is not direct[2] and bare[2] is not torch.ops.ple.gate_conv  # the kernel without its check
    native_calls = []
    real_step = layer._native_step
    assert real_step is not None

    def counted(*args):
        got = real_step(*args)
        native_calls.append(got is not None)
        return got

    outs, pools = [], []
    ways = ("direct", "profiled", "unchecked", "unchecked-operators")
    for way in ways:
        pool = start.clone()
        batch = Batch.build(lens, [0, 1, 2], ctx, pool, has_initial_state=[True, True, False])
        if way == "profiled":
            with torch.profiler.profile() as prof:
                outs.append(layer(h, toks, batch, return_conv_input=True))
            names = {e.name for e in prof.events()}
            assert {"ple::ngram_ids", "ple::table_lookup", "ple::gate_conv"} <= names
        else:
            # unchecked: the C kernels called directly (NativeStep); unchecked-operators: without it
            layer._native_step = counted if way == "unchecked" else None
            try:
                outs.append(layer(h, toks, batch, return_conv_input=True, _checked=way == "direct"))
            finally:
                layer._native_step = real_step
        pools.append(pool)
    assert native_calls == [True]  # the native step ran once, for the unchecked way, and took the operands
    for k in range(1, len(ways)):
        assert torch.equal(outs[0][0], outs[k][0]) and torch.equal(outs[0][1], outs[k][1]), ways[k]
        assert torch.equal(pools[0], pools[k]), ways[k]
    assert not torch.equal(pools[0], start)
    bad = toks.clone()
    bad[2] = cfg.vocab_size
    with pytest.raises(NgramInputError, match=f"token id {cfg.vocab_size} at position 2"):
        layer(h, bad, Batch.build(lens, [0, 1, 2], ctx, start.clone()))


def test_projections_refuse_rows_of_another_width_or_dtype():
    from ple.errors import InvalidArgumentError

    hf, mod, _ = _random_hf(3, torch.float32)
    layer = PLELayer.from_transformers(mod)
    e = layer.config.ple_embed_dim
    key, value = layer.project(torch.randn(3, e))
    assert key.shape == (3, layer.config.hc_hidden_size) and value.shape == (3, layer.config.hidden_size)
    for bad, what in ((torch.randn(3, e + 1), rf"\(3, {e + 1}\)"), (torch.randn(3, e).double(), "float64")):
        with pytest.raises(InvalidArgumentError, match=what):
            layer.projections(bad)
