"""NamedAdapters.apply against a literal per-token reading: each token reads its request's adapter's
row where that adapter holds one and the base's elsewhere (under a default adapter too); requests
of no tokens; refusals."""

from __future__ import annotations

import pytest
import torch

import ple.table.tiers.named as named_module
from ple.errors import InvalidArgumentError
from ple.table import MemoryTable
from ple.table.base import TableRef, adapter_choice
from ple.table.tiers.adapted import AdaptedTable, RowOverlay
from ple.table.tiers.named import NamedAdapter, NamedAdapters

ROWS, D, G = 50, 4, 3


def _overlay(seed: int, share: float = 0.5) -> RowOverlay:
    g = torch.Generator().manual_seed(seed)
    overlay = RowOverlay(ROWS, D)
    ids = torch.randperm(ROWS, generator=g)[: int(ROWS * share)]
    overlay.put(ids, torch.randn(ids.numel(), D, generator=g))
    return overlay


def _reference(table, named: dict[int, RowOverlay], ids, chosen, starts) -> torch.Tensor:
    """Row by row: the default's tokens read ``table``, a named adapter's its row or the base's."""
    base = table.base if isinstance(table, AdaptedTable) else table
    out = torch.empty(ids.shape[0], G * D)
    for r, k in enumerate(chosen):
        for t in range(starts[r], starts[r + 1]):
            for g in range(G):
                i = int(ids[t, g])
                one = torch.tensor([[i]])
                if k >= 0 and i in set(named[k].ids().tolist()):
                    row = named[k].get(torch.tensor([i]))[1][0]
                else:
                    row = (table if k < 0 else base).lookup(one, torch.float32)[0]
                out[t, g * D : (g + 1) * D] = row
    return out


@pytest.fixture(params=["c", "numpy"], autouse=True)
def path(request, monkeypatch):
    """Every test twice: the named rows put in place by the C row copy, and by the numpy path."""
    calls: list[bool] = []
    real = named_module.NamedAdapters._native_rows

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(named_module.NamedAdapters, "_native_rows", staticmethod(spy))
    if request.param == "numpy":
        monkeypatch.setattr(named_module._native, "available", lambda: False)
    yield request.param
    if calls:  # the path asked for ran (the C copy declines an overlay whose rows spill)
        assert (True in calls) if request.param == "c" else set(calls) == {False}


@pytest.fixture
def served():
    g = torch.Generator().manual_seed(0)
    base = MemoryTable(torch.randn(ROWS, D, generator=g))
    held = NamedAdapters(base)
    overlays = {0: _overlay(1), 2: _overlay(2), 5: _overlay(3, 0.9)}  # indices need not be dense
    for k, overlay in overlays.items():
        held.add(NamedAdapter(f"a{k}", k, overlay))
    return base, held, overlays


@pytest.mark.parametrize("default", [False, True])
@pytest.mark.parametrize(
    "chosen, lengths",
    [
        ([2, -1, 0, 5, 2, -1], [3, 2, 0, 4, 1, 2]),  # mixed, one request of no tokens
        ([5], [7]),  # one request, one adapter
        ([0, 0, 0], [1, 1, 1]),  # decode, one adapter
        ([-1, 2, -1], [0, 3, 0]),  # empty requests first and last
        ([2, 5, 0, -1] * 4, [1] * 16),  # decode, every adapter and the default
    ],
)
def test_every_token_reads_its_adapter_or_the_base(served, chosen, lengths, default):
    base, held, overlays = served
    table = AdaptedTable(base, _overlay(9)) if default else base
    g = torch.Generator().manual_seed(4)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    ids = torch.randint(0, ROWS, (starts[-1], G), generator=g)
    rows = table.lookup(ids, torch.float32)
    want = _reference(table, overlays, ids, chosen, starts)
    _apply(held, table, ids, rows, chosen, starts)
    assert torch.equal(rows, want)


def test_bf16_rows_and_an_overlay_over_a_budget(path):
    """bf16 rows (the C copy's bytes), and an overlay whose rows spill (the numpy path takes it)."""
    g = torch.Generator().manual_seed(8)
    base = MemoryTable(torch.randn(ROWS, D, generator=g).bfloat16())
    held = NamedAdapters(base)
    small = RowOverlay(ROWS, D, torch.bfloat16)
    small.put(torch.arange(0, ROWS, 2), torch.randn(ROWS // 2, D, generator=g))
    spilled = RowOverlay(ROWS, D, torch.bfloat16, memory_budget=4 * D * 2)
    spilled.put(torch.arange(1, ROWS, 3), torch.randn(len(range(1, ROWS, 3)), D, generator=g))
    held.add(NamedAdapter("small", 0, small))
    held.add(NamedAdapter("spilled", 1, spilled))
    ids = torch.randint(0, ROWS, (6, G), generator=g)
    for chosen in ([0, -1, 0], [1, 0, -1]):
        rows = base.lookup(ids, torch.bfloat16)
        want = _reference_bf16(base, {0: small, 1: spilled}, ids, chosen, [0, 2, 4, 6])
        _apply(held, base, ids, rows, chosen, [0, 2, 4, 6])
        assert torch.equal(rows, want), chosen


def _reference_bf16(base, named, ids, chosen, starts) -> torch.Tensor:
    out = base.lookup(ids, torch.bfloat16)
    for r, k in enumerate(chosen):
        for t in range(starts[r], starts[r + 1]):
            for g in range(G):
                i = int(ids[t, g])
                if k >= 0 and i in set(named[k].ids().tolist()):
                    out[t, g * D : (g + 1) * D] = named[k].get(torch.tensor([i]))[1][0]
    return out


def _apply(held, table, ids, rows, chosen, starts) -> None:
    """``held.apply`` as the lookup calls it: through the checks of :func:`adapter_choice`."""
    choice = adapter_choice(torch.tensor(chosen), torch.tensor(starts), ids.shape[0])
    if choice is not None:
        held.apply(table, ids, rows, *choice)


def test_an_unknown_index_is_refused_even_for_a_request_of_no_tokens(served):
    base, held, _ = served
    ids = torch.zeros(2, G, dtype=torch.int64)
    rows = base.lookup(ids, torch.float32)
    before = rows.clone()
    with pytest.raises(InvalidArgumentError, match="adapter index 3 is not served by this layer"):
        _apply(held, base, ids, rows, [0, 3], [0, 2, 2])
    assert torch.equal(rows, before)


@pytest.mark.parametrize(
    "chosen, starts, message",
    [
        ([0, -2], [0, 1, 2], "adapter index -2"),
        ([0, 2], [0, 1], "2 adapter indices need query_start_loc of 3 offsets"),
        ([0, 2], [0, 1, 3], "must run from 0 to the 2 ids' tokens"),  # more tokens than ids: never read
        ([0, 2], [1, 1, 2], "must run from 0"),
        ([0, 2], [0, 2, 1], "non-decreasing"),
    ],
)
def test_indices_and_offsets_that_disagree_are_refused(served, chosen, starts, message):
    base, held, _ = served
    ids = torch.zeros(2, G, dtype=torch.int64)
    with pytest.raises(InvalidArgumentError, match=message):
        _apply(held, base, ids, base.lookup(ids, torch.float32), chosen, starts)
    with pytest.raises(InvalidArgumentError, match="must be a 1-D int64 tensor"):
        adapter_choice(torch.tensor([0.0]), torch.tensor([0, 2]), 2)
    # the operator refuses them before reading the table
    ref = TableRef(base)
    ref.adapters = held
    with pytest.raises(InvalidArgumentError, match=message):
        torch.ops.ple.table_lookup(ids, ref, D, torch.float32, torch.tensor(chosen), torch.tensor(starts))
    with pytest.raises(InvalidArgumentError, match="query_start_loc must be a 1-D int64 tensor"):
        torch.ops.ple.table_lookup(ids, ref, D, torch.float32, torch.tensor(chosen), None)
