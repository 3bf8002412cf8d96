"""NamedAdapters.apply against a literal per-token reading: each token reads its request's adapter's
row where that adapter holds one and the base's elsewhere (under a default adapter too); requests
of no tokens; refusals."""

from __future__ import annotations

import pytest
import torch

from ple.errors import InvalidArgumentError
from ple.table import MemoryTable
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
    held.apply(table, ids, rows, torch.tensor(chosen), torch.tensor(starts))
    assert torch.equal(rows, want)


def test_an_unknown_index_is_refused_even_for_a_request_of_no_tokens(served):
    base, held, _ = served
    ids = torch.zeros(2, G, dtype=torch.int64)
    rows = base.lookup(ids, torch.float32)
    before = rows.clone()
    with pytest.raises(InvalidArgumentError, match="adapter index 3 is not served by this layer"):
        held.apply(base, ids, rows, torch.tensor([0, 3]), torch.tensor([0, 2, 2]))
    with pytest.raises(InvalidArgumentError, match="adapter index -2"):
        held.apply(base, ids, rows, torch.tensor([0, -2]), torch.tensor([0, 1, 2]))
    assert torch.equal(rows, before)
