"""A session's engine call on the CPU through NativeStep (direct C calls) gives the bits of the
operators' path, for every kind of step, state layout, table and dtype; where the kernels do not take
the operands it steps aside and the operators run."""

import random

import pytest
import torch

from ple.kernels import native as _native
from ple.runtime import Session
from ple.runtime.native_step import NativeStep
from ple.table import MemoryTable
from tests.runtime.test_session import _layer, _schedule

pytestmark = pytest.mark.skipif(not _native.available(), reason="the C kernels do not build here")


class _Spy:
    """Stands in for a layer's native step: counts the calls it took and the ones it stepped aside from."""

    def __init__(self, real):
        self.real, self.took, self.declined = real, 0, 0

    def __call__(self, *args):
        got = self.real(*args)
        if got is None:
            self.declined += 1
        else:
            self.took += 1
        return got


def _fp8_table(table) -> MemoryTable:
    data = table.data.float()
    scale = data.abs().max() / 448.0
    return MemoryTable((data / scale).to(torch.float8_e4m3fn), torch.tensor([scale.item()]))


def _run_both(layer, layout, steps, dtype, seed=3):
    """The same schedule through two sessions, one with the layer's native step and one without; returns
    (outputs, pools, prefix states) of each and the spy."""
    spy = _Spy(layer._native_step)
    rng = random.Random(seed)
    sessions = [Session(layer, 4, num_spec=2, prefix_every=3, state_layout=layout) for _ in range(2)]
    for s in sessions:
        for rid in "abc":
            s.add(rid)
    got: list[list] = [[], []]
    real = layer._native_step
    try:
        for inputs, spec, kept in _schedule(rng, layer.config, "abc", steps, 2):
            inputs = {r: (h.to(dtype), t) for r, (h, t) in inputs.items()}
            for k, s in enumerate(sessions):
                layer._native_step = spy if k == 0 else None
                got[k].append(s.step(inputs, speculative=spec))
                for r, n in kept.items():
                    s.accept(r, n)
    finally:
        layer._native_step = real
    states = [{r: s.prefix_states(r) for r in "abc"} for s in sessions]
    return got, [s.conv_state for s in sessions], states, spy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["ring", "engine"])
@pytest.mark.parametrize("table", ["plain", "fp8"])
def test_native_steps_equal_the_operators_bit_for_bit(dtype, layout, table):
    """Prefill chunks, decode tokens, speculative chunks with rejections and prefix states: the native
    step (the C gather for plain rows in memory, the table's own lookup for fp8 rows) gives exactly the
    outputs, pools and prefix states of the operators' path, and it took every step."""
    layer = _layer(1).to(dtype)
    plain = layer.table
    try:
        if table == "fp8":
            layer.set_table(_fp8_table(plain))
        got, pools, states, spy = _run_both(layer, layout, 10, dtype)
        assert spy.took == 10 and spy.declined == 0
        for a, b in zip(*got):
            assert a.keys() == b.keys() and all(torch.equal(a[r], b[r]) for r in a)
        assert torch.equal(pools[0], pools[1])
        for r in "abc":
            a, b = states[0][r], states[1][r]
            assert a.keys() == b.keys()
            assert all(torch.equal(a[p].conv_window, b[p].conv_window) for p in a)
    finally:
        layer.set_table(plain)
        layer.to(torch.float32)


def test_a_new_table_is_read_by_the_native_step():
    """The C gather's table pointer follows set_table: after a swap, the rows of the new table."""
    layer = _layer(0)
    plain = layer.table
    other = MemoryTable(torch.randn_like(plain.data))
    try:
        before, _, _, _ = _run_both(layer, "ring", 2, torch.float32, seed=5)
        layer.set_table(other)
        after, _, _, spy = _run_both(layer, "ring", 2, torch.float32, seed=5)
        assert spy.took == 2
        for a, b in zip(*after):
            assert all(torch.equal(a[r], b[r]) for r in a)  # native and operators read the new table alike
        assert any(not torch.equal(x[r], y[r]) for x, y in zip(before[0], after[0]) for r in x)
    finally:
        layer.set_table(plain)


def test_the_native_step_steps_aside_where_the_kernels_do_not_take_the_operands(monkeypatch):
    """A column-strided hidden and PLE_NATIVE=0 (read at every call) leave the step to the operators;
    the outputs stay those of the layer."""
    layer = _layer(0)
    width = layer.config.hc_hidden_size
    spy = _Spy(layer._native_step)
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 2 * width, generator=g)
    chunk = {0: torch.tensor([5, 9, 11])}
    outs = []
    try:
        layer._native_step = spy
        for case in ("strided", "off", "native"):
            session = Session(layer, 1)
            session.add(0)
            step = session.begin(chunk)
            hidden = wide[:, ::2] if case == "strided" else wide[:, ::2].contiguous()
            with monkeypatch.context() as mp:
                if case == "off":
                    mp.setenv("PLE_NATIVE", "0")
                outs.append(session.run(step, 0, hidden))
            session.end(step)
    finally:
        layer._native_step = spy.real
    assert spy.declined == 2 and spy.took == 1
    for out in outs[:2]:
        torch.testing.assert_close(out, outs[2], rtol=1e-5, atol=1e-5)


def test_layers_the_kernels_do_not_compute_have_no_native_step():
    layer = _layer(2)
    try:
        assert isinstance(layer._native_step, NativeStep)
        layer.to(torch.float16)
        assert layer._native_step is None  # the fused kernel computes bfloat16 and float32
    finally:
        layer.to(torch.float32)
    assert isinstance(layer._native_step, NativeStep)


def test_scratch_buffers_are_kept_for_short_steps_only():
    """Decode-sized steps reuse the native step's scratch (ids, rows, conv inputs); a long chunk
    allocates its own and leaves the kept ones in place; outputs equal the operators' either way."""
    layer = _layer(0)
    width, vocab = layer.config.hc_hidden_size, layer.config.vocab_size
    g = torch.Generator().manual_seed(2)
    steps = [
        {"a": (torch.randn(300, width, generator=g), torch.randint(0, vocab, (300,), generator=g))},
        {"a": (torch.randn(1, width, generator=g), torch.randint(0, vocab, (1,), generator=g))},
        {"a": (torch.randn(400, width, generator=g), torch.randint(0, vocab, (400,), generator=g))},
        {"a": (torch.randn(1, width, generator=g), torch.randint(0, vocab, (1,), generator=g))},
    ]
    native = layer._native_step
    native._scratch = None
    kept = []
    outs: list[list] = [[], []]
    try:
        for k in range(2):
            layer._native_step = native if k == 0 else None
            session = Session(layer, 1)
            session.add("a")
            for step in steps:
                outs[k].append(session.step(step)["a"])
                if k == 0:
                    kept.append(native._scratch)
    finally:
        layer._native_step = native
    assert kept[0] is None  # the 300-token chunk's buffers were not kept
    assert kept[1] is not None and kept[1].kept and kept[1].tokens == 2
    assert kept[2] is kept[1] and kept[3] is kept[1]  # the long chunk left the decode buffers in place
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_layer_dropped_is_freed_without_the_cycle_collector():
    """The native step refers to its layer weakly: dropping the last reference frees the layer (and its
    weights) at once, with the cyclic garbage collector off."""
    import gc
    import weakref

    from ple import PLELayer

    layer = PLELayer(_layer(0).config, 0)
    assert isinstance(layer._native_step, NativeStep)
    gone = weakref.ref(layer)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del layer
        assert gone() is None
    finally:
        if enabled:
            gc.enable()


def test_operands_that_disagree_are_refused_before_any_kernel_reads_them():
    """Called directly with a batch that disagrees with its hidden and tokens, the native step raises a
    ple error (shapes named; query_start_loc past T from the ids kernel) and leaves the pool as it was."""
    from ple.errors import InvalidArgumentError
    from ple.runtime import Batch

    layer = _layer(0)
    cfg = layer.config
    pool = layer.new_state_pool(2)
    ctx = torch.full((2, cfg.ngram_size - 1), cfg.eos_token_id)
    batch = Batch.build([1, 1], [0, 1], ctx, pool)
    hidden = torch.randn(2, cfg.hc_hidden_size)
    before = pool.clone()
    for h, t in (
        (hidden, torch.tensor([1, 2, 3])),
        (hidden[:1], torch.tensor([1])),
        (torch.randn(2, 3), torch.tensor([1, 2])),
    ):
        # shapes are compared in Python; offsets past T (read from the tensor) are the ids kernel's refusal
        with pytest.raises(
            InvalidArgumentError, match=r"native step: hidden|ngram_ids \(C kernel\): query_start_loc is not 0 \.\. T=1"
        ):
            layer._native_step(h.contiguous(), t, batch, True, False)
    assert torch.equal(pool, before)
    assert layer._native_step(hidden, torch.tensor([1, 2]), batch, True, False).shape == hidden.shape


def _engine_steps(layer, ring: bool, seed: int = 7):
    """An engine's steps on prebuilt batches (``layer(hidden, ids, batch)``, checked): two requests'
    prefill chunks, a mixed chunk + decode step, a verify step whose drafts are partly rejected, decode.
    Returns the outputs and the final pool in the engine layout."""
    from ple.ops.state import ring_to_engine
    from ple.runtime import Batch

    cfg = layer.config
    g = torch.Generator().manual_seed(seed)
    if ring:
        pool, offsets = layer.new_ring_pool(3, num_spec=2)
    else:
        pool, offsets = layer.new_state_pool(3, num_spec=2), None
    kept: dict[int, list[int]] = {0: [], 1: []}
    started = {0: False, 1: False}
    rejected = {0: 0, 1: 0}
    outs = []
    # (slot -> chunk length, verify?) per step; a verify step keeps the first `accept` tokens
    for lens, verify, accept in [({0: 5, 1: 3}, False, 0), ({0: 1, 1: 4}, False, 0), ({0: 3, 1: 3}, True, 1),
                                 ({0: 1, 1: 1}, False, 0)]:  # fmt: skip
        n = cfg.ngram_size - 1
        ctx = torch.tensor([([cfg.eos_token_id] * n + kept[r])[-n:] for r in lens], dtype=torch.int64)
        tokens = torch.randint(0, cfg.vocab_size, (sum(lens.values()),), generator=g)
        hidden = torch.randn(tokens.shape[0], cfg.hc_hidden_size, generator=g).to(layer.dtype)
        batch = Batch.build(
            list(lens.values()), list(lens), ctx, pool, kinds=["verify" if verify else "prefill"] * 2,
            has_initial_state=[started[r] for r in lens], num_rejected=[rejected[r] for r in lens], num_spec=2,
            state_offsets=offsets,
        )  # fmt: skip
        with torch.no_grad():
            outs.append(layer(hidden, tokens, batch))
        at = 0
        for r, k in lens.items():
            keep = accept if verify else k
            kept[r] += tokens[at : at + keep].tolist()
            rejected[r] = k - keep
            started[r] = True
            at += k
    return outs, (ring_to_engine(pool, offsets) if ring else pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ring", [False, True], ids=["engine", "ring"])
def test_the_engine_call_on_prebuilt_batches_runs_the_native_step(dtype, ring):
    """The checked engine call (an engine's prebuilt batches, either pool layout) runs the C kernels
    straight from the native step, and gives the operators' bits: outputs and pool, through chunks,
    a verify step with rejected drafts and decode."""
    layer = _layer(0).to(dtype)
    real = layer._native_step
    try:
        spy = _Spy(real)
        layer._native_step = spy
        native = _engine_steps(layer, ring)
        assert spy.took == 4 and spy.declined == 0
        layer._native_step = None
        operators = _engine_steps(layer, ring)
    finally:
        layer._native_step = real
        layer.to(torch.float32)
    for a, b in zip(native[0], operators[0]):
        assert torch.equal(a, b)
    assert torch.equal(native[1], operators[1])


def test_a_ring_pool_holds_the_engine_layouts_columns():
    """The same steps on a ring pool and on an engine-layout pool: equal outputs, and the ring pool read
    back in the engine layout equals the other pool exactly."""
    layer = _layer(1)
    a, b = _engine_steps(layer, ring=True), _engine_steps(layer, ring=False)
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert torch.equal(a[1], b[1])
    pool, offsets = layer.new_ring_pool(2, num_spec=1)
    assert pool.shape == (2, layer.config.conv_window + 1, layer.config.hc_hidden_size)
    assert pool.dtype == layer.dtype and offsets.dtype == torch.int64 and not offsets.any()


@pytest.mark.parametrize("where", ["input_ids", "ngram_context"])
@pytest.mark.parametrize("value", [-1, 40])
def test_the_checked_engine_call_refuses_tokens_outside_the_vocabulary_before_any_write(where, value):
    """A token or a context value outside [0, vocab_size) is refused by the native path as by the
    operators (the same error and message, naming it), and the pool is unchanged."""
    from ple.ngram import NgramInputError
    from ple.runtime import Batch

    layer = _layer(0)
    cfg = layer.config
    assert cfg.vocab_size == 40
    messages = []
    for native in (True, False):
        real = layer._native_step
        layer._native_step = real if native else None
        try:
            pool = layer.new_state_pool(2)
            torch.nn.init.normal_(pool)
            before = pool.clone()
            ctx = torch.full((2, cfg.ngram_size - 1), cfg.eos_token_id)
            batch = Batch.build([2, 1], [0, 1], ctx, pool, has_initial_state=[True, True])
            tokens = torch.tensor([5, 6, 7])
            if where == "input_ids":
                tokens[1] = value
            else:
                ctx[1, 0] = value  # changed after the batch was built: the call checks it
            with pytest.raises(NgramInputError) as err, torch.no_grad():
                layer(torch.randn(3, cfg.hc_hidden_size), tokens, batch)
            messages.append(str(err.value))
            assert torch.equal(pool, before)
        finally:
            layer._native_step = real
    assert messages[0] == messages[1] and str(value) in messages[0]
