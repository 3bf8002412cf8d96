"""The projections' GEMM with bf16 weights packed once for oneDNN (ple.kernels.cpu_gemm): when it is on, that it
gives F.linear's results (its bits on CPUs with AMX or AVX-512 BF16, where it is on by default), and that the packed copy
follows its weight through in-place changes, copies, pickles and device moves."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from ple import PLEConfig, PLELayer
from ple.errors import InvalidArgumentError
from ple.kernels import cpu_gemm

HAS_ONEDNN = cpu_gemm.missing() is None
needs_onednn = pytest.mark.skipif(not HAS_ONEDNN, reason="this PyTorch has no oneDNN")


def _bf16_flag() -> bool:
    """Whether /proc/cpuinfo names AMX or AVX-512 BF16 (read here, not through the module under test)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and {"amx_bf16", "avx512_bf16"} & set(line.split()) for line in f)
    except OSError:
        return False


def _same_or_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal where the packed GEMM is on by default (AMX or AVX-512 BF16: the same oneDNN kernels as
    F.linear's); elsewhere (forced on) within one bf16 rounding of the fp32 sums."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if _bf16_flag():
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize(
    "raw, want",
    [(None, "auto"), ("auto", "auto"), ("", "auto"), ("1", "on"), ("ON", "on"), ("0", "off"), (" off ", "off")],
)
def test_mode_reads_the_switch(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("PLE_PACKED_GEMM", raising=False)
    else:
        monkeypatch.setenv("PLE_PACKED_GEMM", raw)
    assert cpu_gemm.mode() == want


@pytest.mark.parametrize("raw", ["yes", "2", "packed"])
def test_a_bad_switch_is_refused_by_name(monkeypatch, raw):
    monkeypatch.setenv("PLE_PACKED_GEMM", raw)
    with pytest.raises(InvalidArgumentError, match=f"PLE_PACKED_GEMM='{raw}'"):
        cpu_gemm.mode()
    with pytest.raises(InvalidArgumentError, match="PLE_PACKED_GEMM"):
        PLELayer(_config(), dtype=torch.bfloat16)


def test_auto_packs_bf16_on_cpus_with_bf16_instructions_only(monkeypatch):
    monkeypatch.delenv("PLE_PACKED_GEMM", raising=False)
    assert cpu_gemm.packing(torch.bfloat16) == (_bf16_flag() and HAS_ONEDNN)
    assert cpu_gemm.packing(torch.float32) is False
    monkeypatch.setenv("PLE_PACKED_GEMM", "off")
    assert cpu_gemm.packing(torch.bfloat16) is False
    assert cpu_gemm.describe() == "F.linear (PLE_PACKED_GEMM=off)"


@pytest.mark.parametrize(
    "flags, packs, every_row",
    [
        ("fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni", True, True),  # AVX-512 BF16 without AMX
        ("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", True, False),
        ("fpu avx2 amx_bf16", True, False),
        ("fpu sse2 avx2 avx512f avx512_vnni avx512_fp16", False, False),  # AVX-512 without bf16
        ("fpu sse2 avx2 fma", False, False),
        ("fpu avx512_bf16x", False, False),  # a flag is a whole word
    ],
)
def test_auto_reads_the_flags_line(tmp_path, flags, packs, every_row):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert cpu_gemm._cpu_has_bf16_matmul(str(info)) is packs
    assert cpu_gemm._cpu_has_bf16_matmul(str(tmp_path / "absent")) is False
    # every row count where AVX-512 BF16 comes without AMX; MAX_ROWS with AMX and where it was forced on
    assert cpu_gemm.max_rows(str(info)) == (cpu_gemm.ALL_ROWS if every_row else cpu_gemm.MAX_ROWS)
    assert cpu_gemm.max_rows(str(tmp_path / "absent")) == cpu_gemm.MAX_ROWS


def test_describe_names_the_row_limit(monkeypatch):
    monkeypatch.setenv("PLE_PACKED_GEMM", "on" if HAS_ONEDNN else "off")
    monkeypatch.setattr(cpu_gemm, "max_rows", lambda: 255)
    assert cpu_gemm.describe() == (
        "packed oneDNN weights up to 255 rows, F.linear beyond (PLE_PACKED_GEMM=on)"
        if HAS_ONEDNN
        else "F.linear (PLE_PACKED_GEMM=off)"
    )
    monkeypatch.setattr(cpu_gemm, "max_rows", lambda: cpu_gemm.ALL_ROWS)
    if HAS_ONEDNN:
        assert cpu_gemm.describe() == "packed oneDNN weights at every row count (PLE_PACKED_GEMM=on)"


def test_on_without_onednn_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("PLE_PACKED_GEMM", "on")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(InvalidArgumentError, match="without oneDNN"):
        cpu_gemm.packing(torch.bfloat16)
    assert cpu_gemm.describe().startswith("error: PLE_PACKED_GEMM=on")
    monkeypatch.setenv("PLE_PACKED_GEMM", "auto")
    assert cpu_gemm.packing(torch.bfloat16) is False  # auto: F.linear, as on any CPU it does not take


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 100, cpu_gemm.MAX_ROWS, 300])
def test_packed_linear_gives_f_linear_results(rows):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(320, 96, generator=g) / 10).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    packed = cpu_gemm.PackedWeight(w)
    _same_or_one_rounding(cpu_gemm.linear(x, w, packed), F.linear(x, w))
    # a column-strided x is made contiguous first (oneDNN reads it otherwise)
    xt = x.t().contiguous().t()
    _same_or_one_rounding(cpu_gemm.linear(xt, w, packed), F.linear(x, w))


@needs_onednn
def test_packed_weight_follows_its_weight():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=g).bfloat16()
    x = torch.randn(5, 32, generator=g).bfloat16()
    packed = cpu_gemm.PackedWeight(w)
    before = cpu_gemm.linear(x, w, packed)
    w.mul_(2)  # in place: the version counter moves, the next call packs again
    after = cpu_gemm.linear(x, w, packed)
    _same_or_one_rounding(after, F.linear(x, w))
    assert not torch.equal(after, before)
    other = torch.randn(64, 32, generator=g).bfloat16()  # another tensor
    _same_or_one_rounding(cpu_gemm.linear(x, other, packed), F.linear(x, other))
    # copies and pickles carry no opaque data; they pack on first use
    for clone in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        assert clone._packed is None
        _same_or_one_rounding(cpu_gemm.linear(x, other, clone), F.linear(x, other))


@pytest.mark.parametrize("limit", [cpu_gemm.MAX_ROWS, cpu_gemm.ALL_ROWS])
def test_use_packed_only_for_gradient_free_steps_within_the_limit(monkeypatch, limit):
    monkeypatch.setattr(cpu_gemm, "max_rows", lambda: limit)
    packed = cpu_gemm.PackedWeight()
    x = torch.zeros(cpu_gemm.MAX_ROWS, 4, dtype=torch.bfloat16)
    assert cpu_gemm.use_packed(x, packed)
    assert not cpu_gemm.use_packed(x, None)
    beyond = torch.zeros(cpu_gemm.MAX_ROWS + 1, 4, dtype=torch.bfloat16)
    assert cpu_gemm.use_packed(beyond, packed) is (limit == cpu_gemm.ALL_ROWS)
    xg = x.clone().requires_grad_()
    assert not cpu_gemm.use_packed(xg, packed)
    with torch.no_grad():
        assert cpu_gemm.use_packed(xg, packed)


def _config() -> PLEConfig:
    return PLEConfig(
        hidden_size=16,
        hc_count=2,
        ple_layer_ids=(1,),
        ple_embed_dim=24,
        ngram_size=3,
        heads_per_ngram=2,
        vocab_size=300,
        eos_token_id=5,
        ngram_vocab_size_base=300,
        split_ngram_parts=1,
    )


def _layer(seed: int = 0) -> PLELayer:
    layer = PLELayer(_config(), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 4)
    layer.refresh_weights()
    return layer


@needs_onednn
def test_layer_projections_take_the_packed_weight_and_follow_changes(monkeypatch):
    monkeypatch.setenv("PLE_PACKED_GEMM", "on")
    monkeypatch.setattr(cpu_gemm, "max_rows", lambda: cpu_gemm.MAX_ROWS)  # as on a CPU with AMX
    layer = _layer()
    assert layer._kv_packed is not None
    g = torch.Generator().manual_seed(9)
    for rows in (1, 9, cpu_gemm.MAX_ROWS, cpu_gemm.MAX_ROWS + 1, 300):
        emb = torch.randn(rows, 24, generator=g).bfloat16()
        _same_or_one_rounding(layer.projections(emb), F.linear(emb, layer.kv_weight))
    calls = []
    real = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    emb = torch.randn(cpu_gemm.MAX_ROWS + 1, 24, generator=g).bfloat16()
    layer.projections(emb[:3])
    layer.projections(emb)
    assert calls == [3]  # the packed GEMM for the small step only
    monkeypatch.setattr(cpu_gemm, "max_rows", lambda: cpu_gemm.ALL_ROWS)  # as with AVX-512 BF16 alone
    _same_or_one_rounding(layer.projections(emb), F.linear(emb, layer.kv_weight))
    assert calls == [3, cpu_gemm.MAX_ROWS + 1]
    # the parameters change in place: the derived weight and its packed copy follow
    with torch.no_grad():
        layer.key_proj.mul_(-1)
    layer.refresh_weights()
    _same_or_one_rounding(layer.projections(emb[:4]), F.linear(emb[:4], layer.kv_weight))
    # a copy of the layer packs its own weight
    twin = copy.deepcopy(layer)
    _same_or_one_rounding(twin.projections(emb[:4]), layer.projections(emb[:4]))
    with torch.no_grad():
        twin.value_proj.zero_()
    twin.refresh_weights()
    assert torch.count_nonzero(twin.projections(emb[:4])[:, 32:]) == 0
    assert torch.count_nonzero(layer.projections(emb[:4])[:, 32:]) > 0


@needs_onednn
def test_a_packing_layer_compiles_whole(monkeypatch):
    """fullgraph=True over a layer whose eager steps take the packed weight: the traced call decides
    for F.linear before it reads this CPU's row limit (:func:`max_rows` reads /proc/cpuinfo, which
    would break the graph)."""
    from torch._dynamo.utils import counters

    from ple.runtime import Batch
    from ple.table import MemoryTable

    monkeypatch.setenv("PLE_PACKED_GEMM", "on")
    layer = _layer(seed=5)
    g = torch.Generator().manual_seed(6)
    layer.set_table(MemoryTable(torch.randn(layer.layout.padded_rows, layer.layout.head_dim, generator=g).bfloat16()))
    assert layer._kv_packed is not None
    torch._dynamo.reset()
    counters.clear()

    @torch.compile(backend="eager", fullgraph=True)
    def engine(layer, hidden, ids, batch):
        return layer(hidden, ids, batch)

    for tokens in (3, 300):
        ctx = torch.randint(0, 300, (1, 2), generator=g)
        pools = [layer.new_state_pool(2), layer.new_state_pool(2)]
        batches = [Batch.build([tokens], [1], ctx, pool) for pool in pools]
        hidden = torch.randn(tokens, 32, generator=g).bfloat16()
        ids = torch.randint(0, 300, (tokens,), generator=g)
        with torch.no_grad():
            want = layer(hidden, ids, batches[0])
            got = engine(layer, hidden, ids, batches[1])
        _same_or_one_rounding(got, want)
    assert not counters["graph_break"], dict(counters["graph_break"])


@needs_onednn
def test_a_change_of_the_norms_does_not_pack_again(monkeypatch):
    monkeypatch.setenv("PLE_PACKED_GEMM", "on")
    layer = _layer()
    packs = []
    real = cpu_gemm.PackedWeight.pack
    monkeypatch.setattr(cpu_gemm.PackedWeight, "pack", lambda self, w: packs.append(w.shape) or real(self, w))
    emb = torch.randn(3, 24).bfloat16()
    want = layer.projections(emb)
    with torch.no_grad():
        layer.norm_key.add_(1.0)
    layer._follow_params(layer._param_stamp())  # what the eager call runs when a parameter changed
    assert packs == []
    assert torch.equal(layer.projections(emb), want)
    with torch.no_grad():
        layer.key_proj.mul_(-1.0)
    layer._follow_params(layer._param_stamp())
    assert packs == [layer.kv_weight.shape]
    _same_or_one_rounding(layer.projections(emb), F.linear(emb, layer.kv_weight))
    layer.refresh_weights()  # an explicit refresh recomputes kv_weight: packed again
    assert len(packs) == 2


@needs_onednn
def test_layer_packs_only_bf16_on_the_cpu(monkeypatch):
    monkeypatch.setenv("PLE_PACKED_GEMM", "on")
    layer = _layer()
    assert layer._kv_packed is not None
    layer.float()
    assert layer._kv_packed is None
    layer.bfloat16()
    assert layer._kv_packed is not None
    monkeypatch.setenv("PLE_PACKED_GEMM", "off")
    assert _layer()._kv_packed is None


def test_use_packed_never_for_traced_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    packed = cpu_gemm.PackedWeight()
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(4, 4, dtype=torch.bfloat16))
        assert not cpu_gemm.use_packed(x, packed)


@needs_onednn
def test_session_steps_on_the_packed_weight_match_f_linear_steps(monkeypatch):
    """A bf16 Session (prefill chunks, then decode steps) on the packed weight gives the outputs and states
    of the same steps on F.linear: bit for bit on CPUs with AMX or AVX-512 BF16, within one rounding elsewhere."""
    from ple import Session
    from ple.table import MemoryTable

    def run(packed: bool):
        monkeypatch.setenv("PLE_PACKED_GEMM", "on" if packed else "off")
        layer = _layer(seed=5)
        assert (layer._kv_packed is not None) == packed
        g = torch.Generator().manual_seed(6)
        rows = layer.layout.padded_rows
        layer.set_table(MemoryTable((torch.randn(rows, layer.layout.head_dim, generator=g) / 3).bfloat16()))
        session = Session(layer, 3)
        for r in range(3):
            session.add(r)
        outs = []
        c = layer.config.hc_hidden_size
        for lens in ([5, 2, 7], [1, 1, 1], [1, 1, 1], [3, 1, 1]):
            inputs = {
                r: (torch.randn(n, c, generator=g).bfloat16(), torch.randint(0, 300, (n,), generator=g))
                for r, n in enumerate(lens)
            }
            outs.append(session.step(inputs))
        return outs, session.conv_state.clone()

    (outs_p, state_p), (outs_f, state_f) = run(True), run(False)
    for a, b in zip(outs_p, outs_f):
        for r in a:
            _same_or_one_rounding(a[r], b[r])
    _same_or_one_rounding(state_p, state_f)


@needs_onednn
def test_derivatives_and_a_disabled_onednn_take_f_linear(monkeypatch):
    """Forward-mode derivatives (torch.func.jvp, dual tensors) and reverse ones get F.linear's, and so
    does every call while torch.backends.mkldnn is turned off."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import grad, jvp

    monkeypatch.setenv("PLE_PACKED_GEMM", "on")
    layer = _layer(seed=2)
    g = torch.Generator().manual_seed(8)
    emb = torch.randn(3, 24, generator=g).bfloat16()
    tangent = torch.ones_like(emb)
    _, got = jvp(layer.projections, (emb,), (tangent,))
    _, want = jvp(lambda e: F.linear(e, layer.kv_weight), (emb,), (tangent,))
    assert torch.equal(got, want) and torch.count_nonzero(got) > 0
    with fwAD.dual_level():
        out = layer.projections(fwAD.make_dual(emb, tangent))
        assert torch.equal(fwAD.unpack_dual(out).tangent, want)
    g_got = grad(lambda e: layer.projections(e).float().sum())(emb)
    g_want = grad(lambda e: F.linear(e, layer.kv_weight).float().sum())(emb)
    assert torch.equal(g_got, g_want)
    packed = layer._kv_packed
    assert cpu_gemm.use_packed(emb, packed)
    torch._C._set_mkldnn_enabled(False)  # what torch.backends.mkldnn.flags(enabled=False) sets
    try:
        assert not cpu_gemm.use_packed(emb, packed)
    finally:
        torch._C._set_mkldnn_enabled(True)
    assert cpu_gemm.use_packed(emb, packed)


def test_linear_refuses_operands_that_disagree():
    packed = cpu_gemm.PackedWeight()
    w = torch.zeros(8, 4, dtype=torch.bfloat16)
    for x, weight in (
        (torch.zeros(3, 5, dtype=torch.bfloat16), w),  # K differs
        (torch.zeros(3, 4), w),  # fp32 rows
        (torch.zeros(3, 4, dtype=torch.bfloat16), w.float()),  # fp32 weight
        (torch.zeros(4, dtype=torch.bfloat16), w),  # 1-D
    ):
        with pytest.raises(InvalidArgumentError, match="cpu_gemm.linear takes x"):
            cpu_gemm.linear(x, weight, packed)
    assert packed._packed is None  # refused before anything was packed
