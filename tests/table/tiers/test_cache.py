"""CachedTable: bit-exact lookups, hit accounting, capacity, LFU admission, refresh determinism,
prefetch concurrency with refreshes, and use under a PLELayer."""

from __future__ import annotations

import threading

import pytest
import torch

from ple.errors import InvalidArgumentError, UsageError
from ple.table import CachedTable, IdOutOfRangeError, MemoryTable, MmapTable, Table
from ple.table.lookup import gather_dequant_reference
from ple.table.tiers import cache as cache_mod
from tests.table._helpers import DTYPES, ELEMENT, make_table, write_file


def _stream(rows: int, T: int, G: int, seed: int, hot: int | None = None) -> torch.Tensor:
    """Ids with repeats: half the reads fall on the first ``hot`` rows."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (T, G), generator=g, dtype=torch.int64)
    if hot:
        pick = torch.rand(T, G, generator=g) < 0.5
        ids = torch.where(pick, torch.randint(0, hot, (T, G), generator=g, dtype=torch.int64), ids)
    return ids


@pytest.fixture(params=["memory", "mmap"])
def backing(request, tmp_path):
    def build(fmt, rows, D, seed=0):
        data, scale = make_table(fmt, rows, D, seed=seed)
        if request.param == "memory":
            return MemoryTable(data, scale), data, scale
        path = write_file(tmp_path / f"{fmt}-{rows}-{D}.ple", fmt, data, scale, max(1, rows // 3))
        return MmapTable.open(path), data, scale

    return build


# ---------------------------------------------------------------------- exactness
@pytest.mark.parametrize("fmt", ELEMENT)
def test_lookup_is_bit_exact_with_the_backing_table(backing, fmt):
    rows, D = 301, 7  # odd row width: 7 bytes (fp8/int8) tile no machine word
    table, data, scale = backing(fmt, rows, D, seed=2)
    cache = CachedTable(table, 40, refresh_every=3)
    shapes = [(1, 1), (2, 3), (63, 4), (129, 2), (17, 5)]
    for i, (T, G) in enumerate(shapes * 2):
        ids = _stream(rows, T, G, seed=i, hot=30)
        for dtype in DTYPES:
            got = cache.lookup(ids, dtype)
            assert torch.equal(got, table.lookup(ids, dtype)), (fmt, T, G, dtype)
            assert torch.equal(got, gather_dequant_reference(data, scale, ids, dtype))
    assert cache.refreshes > 0 and 0 < cache.cached_rows <= 40
    assert cache.hits > 0 and cache.misses > 0
    # all hits, all misses, and non-contiguous ids
    hot = cache.cached_ids
    all_hit = hot[torch.arange(50) % hot.numel()].reshape(10, 5)
    cold = torch.tensor(sorted(set(range(rows)) - set(hot.tolist()))[:24]).reshape(8, 3)
    wide = _stream(rows, 40, 8, seed=99, hot=30)[:, ::2]
    before = cache.hits
    for ids in (all_hit, cold, wide):
        for dtype in DTYPES:
            assert torch.equal(cache.lookup(ids, dtype), gather_dequant_reference(data, scale, ids, dtype))
    assert cache.hits >= before + 3 * 50
    table.close()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_row"])
def test_word_aligned_rows_and_row_width_one(fmt):
    for D in (1, 8, 12):  # 1 byte, one int64 word, int32 words (fp8); 2/16/24 bytes (bf16)
        data, scale = make_table(fmt, 97, D, seed=D)
        table = MemoryTable(data, scale)
        cache = CachedTable(table, 20, refresh_every=2)
        for i in range(6):
            ids = _stream(97, 33, 3, seed=i, hot=15)
            for dtype in DTYPES:
                assert torch.equal(cache.lookup(ids, dtype), table.lookup(ids, dtype))


def test_empty_batch_and_out_of_range_ids():
    table = MemoryTable(*make_table("fp8", 50, 4))
    cache = CachedTable(table, 10)
    out = cache.lookup(torch.empty(0, 3, dtype=torch.int64), torch.bfloat16)
    assert out.shape == (0, 12)
    assert cache.hits == cache.misses == 0
    with pytest.raises(IdOutOfRangeError, match=r"row id 50 at \(token 1, head 0\)"):
        cache.lookup(torch.tensor([[0, 1], [50, 2]]), torch.float32)
    with pytest.raises(IdOutOfRangeError):
        cache.start_prefetch(torch.tensor([[-1]]), torch.float32)
    with pytest.raises(ValueError, match="row id 77 is out of range"):
        cache.warm(torch.tensor([1, 77]))


# ---------------------------------------------------------------------- hit accounting
def test_hit_rate_of_a_known_hot_set():
    data, scale = make_table("int8_row", 1000, 6)
    table = MemoryTable(data, scale)
    cache = CachedTable(table, 10, policy="static")
    assert cache.hit_rate == 0.0
    admitted = cache.warm(torch.arange(10).repeat(5))  # ids 0..9 are the hot set
    assert admitted == 10 and cache.cached_ids.tolist() == list(range(10))
    g = torch.Generator().manual_seed(4)
    want_hits = want_fetched = total = 0
    for _ in range(5):
        ids = torch.randint(0, 40, (37, 3), generator=g, dtype=torch.int64)
        want_hits += int((ids < 10).sum())
        want_fetched += int(torch.unique(ids[ids >= 10]).numel())
        total += ids.numel()
        assert torch.equal(cache.lookup(ids, torch.float32), gather_dequant_reference(data, scale, ids, torch.float32))
    assert cache.hits == want_hits and cache.misses == total - want_hits
    assert cache.fetched_rows == want_fetched
    assert cache.hit_rate == pytest.approx(want_hits / total)
    assert cache.cached_ids.tolist() == list(range(10))  # "static": lookups never change the set
    cache.reset_stats()
    assert cache.hits == cache.misses == cache.fetched_rows == 0 and cache.hit_rate == 0.0


def test_prefetch_counts_and_returns_exact_rows():
    data, scale = make_table("fp8", 300, 5)
    table = MemoryTable(data, scale)
    cache = CachedTable(table, 30, refresh_every=None)
    cache.warm(torch.arange(30))
    ids = _stream(300, 64, 4, seed=7, hot=30)
    with cache.start_prefetch(ids, torch.bfloat16) as h:
        assert torch.equal(h.wait(ids), gather_dequant_reference(data, scale, ids, torch.bfloat16))
    assert cache.hits == int((ids < 30).sum()) and cache.hits + cache.misses == ids.numel()
    cache.close()


# ---------------------------------------------------------------------- capacity and admission
def test_capacity_is_respected():
    data, scale = make_table("fp8_row", 400, 8)
    table = MemoryTable(data, scale)
    cache = CachedTable(table, 25, refresh_every=1, max_tracked=60)
    for i in range(30):
        ids = _stream(400, 50, 4, seed=i)
        assert torch.equal(cache.lookup(ids, torch.float16), table.lookup(ids, torch.float16))
        assert cache.cached_rows <= 25
        assert cache.cache_nbytes == cache.cached_rows * (8 + 8 + 4)  # id + row + per-row scale
    assert cache.cached_rows == 25
    ids = cache.cached_ids
    assert torch.equal(ids, torch.unique(ids)) and ids.dtype == torch.int64

    huge = CachedTable(table, 10**9)  # clamps to the table
    assert huge.capacity_rows == 400
    huge.warm(torch.arange(400))
    assert huge.cached_rows == 400 and huge.lookup(torch.tensor([[399]]), torch.float32).shape == (1, 8)
    assert huge.misses == 0

    none = CachedTable(table, 0, refresh_every=1)
    for i in range(3):
        ids = _stream(400, 9, 2, seed=i)
        assert torch.equal(none.lookup(ids, torch.bfloat16), table.lookup(ids, torch.bfloat16))
    assert none.cached_rows == 0 and none.hits == 0 and none.misses == 3 * 18


def test_lfu_admits_the_most_frequent_ids_with_ties_to_the_smaller_id():
    table = MemoryTable(*make_table("bf16", 100, 4))
    cache = CachedTable(table, 3, refresh_every=None)
    counts = {7: 5, 3: 4, 50: 4, 9: 4, 1: 1}
    cache.warm(torch.tensor([i for i, c in counts.items() for _ in range(c)]))
    assert cache.cached_ids.tolist() == [3, 7, 9]  # 7 (5), then 3 and 9 win the tie at 4 over 50
    # decay: new traffic displaces old. History * 0.5 + new counts: 60 and 61 (3), 7 (2.5), then
    # 3, 9, 50 and 62 (2).
    cache.warm(torch.tensor([60] * 3 + [61] * 3 + [62] * 2))
    assert cache.cached_ids.tolist() == [7, 60, 61]
    with_decay_one = CachedTable(table, 3, refresh_every=None, decay=1.0)
    with_decay_one.warm(torch.tensor([i for i, c in counts.items() for _ in range(c)]))
    with_decay_one.warm(torch.tensor([60] * 3 + [61] * 3 + [62] * 2))
    assert with_decay_one.cached_ids.tolist() == [3, 7, 9]  # plain LFU: totals 5, 4, 4 vs 3


def test_refresh_every_counts_lookups():
    table = MemoryTable(*make_table("fp16", 64, 3))
    cache = CachedTable(table, 4, refresh_every=3)
    ids = torch.tensor([[5, 6], [5, 7]])
    cache.lookup(ids, torch.float16)
    cache.lookup(ids, torch.float16)
    assert cache.cached_rows == 0 and cache.refreshes == 0
    cache.lookup(ids, torch.float16)  # the third lookup refreshes after it is served
    assert cache.refreshes == 1 and cache.cached_ids.tolist() == [5, 6, 7]
    assert cache.hits == 0
    cache.lookup(ids, torch.float16)
    assert cache.hits == 4
    cache.clear()
    assert cache.cached_rows == 0 and cache.refresh() == 0 and cache.cached_rows == 0


def test_refresh_is_deterministic(monkeypatch):
    monkeypatch.setattr(cache_mod, "_PENDING_LIMIT", 100)  # fold counts often, mid-window
    data, scale = make_table("fp8", 500, 4)

    def run():
        cache = CachedTable(MemoryTable(data, scale), 16, refresh_every=2, max_tracked=40, decay=0.75)
        trace = []
        for i in range(24):
            ids = _stream(500, 31, 3, seed=i, hot=25)
            cache.lookup(ids, torch.float32)
            assert cache._pending_n < 100  # raw ids are folded into counts once the buffer fills
            trace.append((cache.cached_ids.tolist(), cache.hits, cache.misses, cache.fetched_rows))
        return trace

    a, b = run(), run()
    assert a == b
    assert len({tuple(t[0]) for t in a}) > 2  # the set did move
    assert a[-1][1] > 0


def test_rejects_bad_arguments():
    table = MemoryTable(*make_table("fp8", 20, 4))
    with pytest.raises(ValueError, match="capacity_rows must be an integer >= 0, got -1"):
        CachedTable(table, -1)
    with pytest.raises(ValueError, match="unknown cache policy 'lru'"):
        CachedTable(table, 5, policy="lru")
    with pytest.raises(ValueError, match="refresh_every must be"):
        CachedTable(table, 5, refresh_every=0)
    with pytest.raises(ValueError, match=r"decay must be a number in \(0, 1\], got 0"):
        CachedTable(table, 5, decay=0)
    with pytest.raises(ValueError, match="max_tracked must be an integer >= capacity_rows"):
        CachedTable(table, 5, max_tracked=4)
    with pytest.raises(TypeError, match="reads the table's rows directly, which a Tensor does not hold"):
        CachedTable(torch.zeros(3, 3), 5)
    bad_devices = [
        ("bogus", r"device must be a torch device \(cpu, cuda, cuda:1\), got 'bogus'"),
        (True, "device must be a torch device .*, got True"),
        ("meta", "device meta is not a device tables can live on"),
    ]
    if not torch.cuda.is_available():
        bad_devices += [("cuda", "device cuda: CUDA is not available"), (3, "device must be a torch device .*, got 3")]
    else:
        bad_devices += [(f"cuda:{torch.cuda.device_count()}", "CUDA device")]
    for device, message in bad_devices:
        with pytest.raises(InvalidArgumentError, match=message):
            CachedTable(table, 5, device=device)
    assert CachedTable(table, 5, device="cpu").device == torch.device("cpu")

    class Remote(Table):
        """A lookup-only tier (rows elsewhere, as for a table sharded across ranks)."""

        device = torch.device("cpu")
        nbytes = 0

        def _lookup_into(self, ids, out):
            out.zero_()

    with pytest.raises(TypeError, match="which a Remote does not hold in this process"):
        CachedTable(Remote("fp8", 10, 4), 5)


def test_table_attributes_delegate_to_the_backing_table(tmp_path):
    data, scale = make_table("int8_row", 90, 6)
    mm = MmapTable.open(write_file(tmp_path / "t.ple", "int8_row", data, scale, 30))
    cache = CachedTable(mm, 9)
    assert (cache.format, cache.rows, cache.head_dim) == ("int8_row", 90, 6)
    assert cache.data is mm.data and cache.scale is mm.scale and cache.nbytes == mm.nbytes
    assert cache.device == torch.device("cpu") and "CachedTable(format='int8_row'" in repr(cache)
    cache.close()
    with pytest.raises(UsageError, match="closed"):
        _ = mm.data  # the backing table was closed with the cache


# ---------------------------------------------------------------------- concurrency
def test_prefetch_and_refresh_stress():
    data, scale = make_table("fp8_row", 600, 5)
    table = MemoryTable(data, scale)
    cache = CachedTable(table, 50, refresh_every=2, max_tracked=120)
    stop = threading.Event()
    errors: list[BaseException] = []

    def refresher():
        i = 0
        try:
            while not stop.is_set():
                i += 1
                cache.warm(_stream(600, 20, 4, seed=1000 + i, hot=60)) if i % 2 else cache.refresh()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    worker = threading.Thread(target=refresher)
    worker.start()
    try:
        batches = [_stream(600, 45, 4, seed=i, hot=60) for i in range(40)]
        h = cache.start_prefetch(batches[0], torch.bfloat16)
        for i, ids in enumerate(batches):
            rows = h.wait(ids)
            nxt = cache.start_prefetch(batches[i + 1], torch.bfloat16) if i + 1 < len(batches) else None
            assert torch.equal(rows, gather_dequant_reference(data, scale, ids, torch.bfloat16)), i
            assert torch.equal(
                cache.lookup(ids, torch.float32), gather_dequant_reference(data, scale, ids, torch.float32)
            )
            h.release()
            h = nxt
    finally:
        stop.set()
        worker.join()
    assert not errors
    assert cache.refreshes > 10 and cache.hits > 0
    cache.close()


# ---------------------------------------------------------------------- under a PLE layer
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_cached_mmap_table_under_ple_layer(tmp_path, fmt):
    from ple.config import PLEConfig
    from ple.layer import PLELayer
    from ple.runtime import Batch

    cfg = PLEConfig(
        hidden_size=6,
        eos_token_id=2,
        vocab_size=40,
        hc_count=2,
        ple_embed_dim=12,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=4,
        split_ngram_parts=3,
    )
    lay = cfg.layout(0)
    data, scale = make_table(fmt, lay.padded_rows, lay.head_dim, seed=5)
    path = write_file(tmp_path / "layer.ple", fmt, data, scale, 64, layout=cfg.layout_fields(0))
    g = torch.Generator().manual_seed(0)
    layer = PLELayer(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    tokens = torch.randint(0, cfg.vocab_size, (2, 23), generator=g)
    tokens[0, 7] = cfg.eos_token_id
    hidden = torch.randn(2, 23, cfg.hc_hidden_size, generator=g)

    def engine_call(prefetch: bool):
        lens = [23, 23]
        pool = layer.new_state_pool(2)
        ctx = torch.full((2, cfg.ngram_size - 1), cfg.eos_token_id)
        batch = Batch.build(lens, [0, 1], ctx, pool, conv_window=cfg.conv_window)
        flat_tokens, flat_hidden = tokens.reshape(-1), hidden.reshape(46, -1)
        handle = layer.start_prefetch(flat_tokens, batch) if prefetch else None
        return layer(flat_hidden, flat_tokens, batch, prefetched=handle)

    layer.set_table(MemoryTable(data, scale))
    want = (engine_call(False), layer.forward_padded(hidden, tokens))
    cached = CachedTable(MmapTable.open(path), 30, refresh_every=1)
    layer.set_table(cached)
    for prefetch in (False, True, False):
        assert torch.equal(engine_call(prefetch), want[0])
    assert torch.equal(layer.forward_padded(hidden, tokens), want[1])
    assert cached.refreshes >= 3 and cached.hits > 0
    cached.close()
