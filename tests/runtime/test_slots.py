"""The session's per-slot arrays: the C pass and the numpy one read and advance the same values."""

import numpy as np
import pytest
import torch

from ple.kernels import native as _native
from ple.runtime.slots import SlotArrays

needs_native = pytest.mark.skipif(not _native.available(), reason="the C kernels do not build here")


def _filled(native: bool, slots: int = 12, ctx_len: int = 3) -> SlotArrays:
    a = SlotArrays(slots, ctx_len, eos=7, native=native)
    g = torch.Generator().manual_seed(0)
    a.contexts.copy_(torch.randint(0, 50, (slots, ctx_len), generator=g))
    a.length[:] = np.arange(slots) * 3
    a.has_state[:] = np.arange(slots) % 3 != 0
    a.rejected[:] = np.arange(slots) % 4
    return a


def _snapshot(a: SlotArrays) -> tuple:
    return a.contexts.clone(), a.length.copy(), a.has_state.copy(), a.rejected.copy()


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y) for x, y in zip(a, b))


@needs_native
@pytest.mark.parametrize("ctx_len", [0, 1, 3])
def test_the_c_pass_reads_and_advances_what_numpy_does(ctx_len):
    c_arrays, np_arrays = _filled(True, ctx_len=ctx_len), _filled(False, ctx_len=ctx_len)
    assert c_arrays.native and not np_arrays.native
    slots = torch.tensor([5, 0, 11, 3])
    tokens = torch.tensor([4, 49, 0, 17])
    got, want = c_arrays.read_decode(tokens, slots, 50), np_arrays.read_decode(tokens, slots, 50)
    assert got[0] is None and want[0] is None
    for x, y in zip(got[1:4], want[1:4]):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert got[4] is want[4] is False  # slots 0 and 3 hold no state
    assert torch.equal(got[1], c_arrays.contexts[slots])
    assert got[2].tolist() == [True, False, True, False] and got[3].tolist() == [1, 0, 3, 3]
    c_arrays.advance_decode(tokens, slots)
    np_arrays.advance_decode(tokens, slots)
    assert _same(_snapshot(c_arrays), _snapshot(np_arrays))
    if ctx_len:
        assert c_arrays.contexts[5, -1] == 4 and c_arrays.contexts[11, -1] == 0
    assert c_arrays.length[[5, 0, 11, 3]].tolist() == [16, 1, 34, 10] and c_arrays.length[1] == 3
    assert c_arrays.has_state[[5, 0, 11, 3]].all() and not c_arrays.has_state[6]
    assert not c_arrays.rejected[[5, 0, 11, 3]].any() and c_arrays.rejected[6] == 2
    slots = torch.tensor([5, 11])
    assert c_arrays.read_decode(torch.tensor([1, 2]), slots, 50)[4] is True


@pytest.mark.parametrize("native", [True, False])
def test_a_token_outside_the_range_is_found_first(native):
    if native and not _native.available():
        pytest.skip("the C kernels do not build here")
    a = _filled(native)
    before = _snapshot(a)
    slots = torch.tensor([1, 2, 4, 5])
    for tokens, bad in (([3, 50, -1, 2], 1), ([3, 4, -1, 2], 2), ([3, 4, 5, 49], None)):
        assert a.read_decode(torch.tensor(tokens), slots, 50)[0] == bad
    assert _same(_snapshot(a), before)  # reading changes nothing


@pytest.mark.parametrize("native", [True, False])
def test_growing_keeps_values_and_the_c_pass_follows_the_new_arrays(native):
    if native and not _native.available():
        pytest.skip("the C kernels do not build here")
    a = _filled(native, slots=4)
    before = _snapshot(a)
    a.grow(3)
    assert torch.equal(a.contexts[:4], before[0]) and (a.contexts[4:] == 7).all()
    assert np.array_equal(a.length[:4], before[1]) and not a.length[4:].any()
    a.advance_decode(torch.tensor([9, 8]), torch.tensor([6, 0]))
    assert a.contexts[6].tolist() == [7, 7, 9] and a.contexts[0, -1] == 8 and a.length[6] == 1
    _, ctx, has, _, _ = a.read_decode(torch.tensor([1]), torch.tensor([6]), 50)
    assert ctx.tolist() == [[7, 7, 9]] and has.tolist() == [True]


def test_sessions_with_either_pass_step_alike_and_name_a_bad_token():
    from ple.runtime import Session, SessionError
    from tests.runtime.test_session import _layer

    layer = _layer(0)
    width = layer.config.hc_hidden_size
    sessions = [Session(layer, 3), Session(layer, 3)]
    sessions[1]._arrays = SlotArrays(3, layer.config.ngram_size - 1, layer.config.eos_token_id, native=False)
    g = torch.Generator().manual_seed(5)
    first = {
        r: (torch.randn(n, width, generator=g), torch.randint(0, 40, (n,), generator=g)) for r, n in ((0, 2), (1, 3))
    }
    decodes = [
        {r: (torch.randn(1, width, generator=g), torch.randint(0, 40, (1,), generator=g, dtype=dt)) for r in (1, 0, 2)}
        for dt in (torch.int64, torch.int32, torch.int64)
    ]
    outs = []
    for s in sessions:
        for r in (0, 1, 2):
            s.add(r)
        got = [s.step(first)]  # request 2 joins with its first token in a step of one token each
        got += [s.step(d) for d in decodes]
        outs.append(got)
        bad = {0: (torch.randn(1, width), torch.tensor([3])), 2: (torch.randn(1, width), torch.tensor([40]))}
        with pytest.raises(SessionError, match=r"request 2: token 40 at offset 0 is outside \[0, vocab_size=40\)"):
            s.step(bad)
    for a, b in zip(*outs):
        assert a.keys() == b.keys() and all(torch.equal(a[r], b[r]) for r in a)
    assert _same(_snapshot(sessions[0]._arrays), _snapshot(sessions[1]._arrays))
    assert sessions[0]._arrays.length.tolist() == [5, 6, 3]
