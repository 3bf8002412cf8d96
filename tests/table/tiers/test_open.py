"""``open_table``: a table file opened as each tier by name, with the one set of defaults; the
errors for a bad tier or option; and ``from_pretrained``, ``ple eval`` and ``ple demo``'s serving
path getting the same tier objects for the same options (they all open their tables through it)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch

import ple.table.tiers.open as opener
from ple.errors import ArgumentTypeError, InvalidArgumentError, PLEError
from ple.table import (
    DEFAULT_CACHE_ROWS,
    DEFAULT_MEMORY_BUDGET,
    DEFAULT_TIER,
    FILE_TIERS,
    MODEL_TIERS,
    TIERS,
    CachedTable,
    DirectTable,
    MemoryTable,
    MmapTable,
    ShardedTable,
    TableFileError,
    open_table,
)
from tests.table._helpers import LAYOUT, assert_same, make_table, random_ids, write_file

ROWS, HD = 3000, 16
KINDS = {"mmap": MmapTable, "cached": CachedTable, "memory": MemoryTable, "direct": DirectTable}


@pytest.fixture
def table_file(tmp_path):
    """``(path of an fp8 table file, the same rows in memory)``."""
    data, scale = make_table("fp8", ROWS, HD)
    return write_file(tmp_path / "t.pletable", "fp8", data, scale, shard_rows=512), MemoryTable(data, scale, "fp8")


def _same_rows(table, reference) -> None:
    ids = random_ids(ROWS, 64, 6)
    assert_same(table.lookup(ids, torch.float32), reference.lookup(ids, torch.float32))


def test_the_tier_names_and_defaults():
    """The names and defaults are the documented ones, listed once."""
    assert TIERS == ("mmap", "cached", "memory", "direct", "sharded")
    assert MODEL_TIERS == ("mmap", "cached", "memory", "direct")
    assert FILE_TIERS == ("mmap", "cached", "direct")
    assert DEFAULT_TIER == "mmap"
    assert DEFAULT_CACHE_ROWS == 1 << 20
    assert DEFAULT_MEMORY_BUDGET == 64 << 20
    from ple.integrations.transformers import DEFAULT_CACHE_ROWS as loader_rows
    from ple.integrations.transformers import LOAD_TIERS

    assert loader_rows is DEFAULT_CACHE_ROWS and LOAD_TIERS == MODEL_TIERS


@pytest.mark.parametrize("tier", ["mmap", "cached", "memory", "direct"])
def test_each_tier_by_name_serves_the_files_rows(table_file, tier):
    path, reference = table_file
    table = open_table(path, tier)
    try:
        assert type(table) is KINDS[tier]
        assert (table.format, table.rows, table.head_dim) == ("fp8", ROWS, HD)
        _same_rows(table, reference)
        if tier == "cached":
            assert table.capacity_rows == ROWS  # the default, 1 << 20 rows, holds the whole table
            assert type(table.backing) is MmapTable
        if tier == "direct":
            assert table.memory_budget == DEFAULT_MEMORY_BUDGET
        if tier == "memory":  # a copy in memory: the rows do not come from the file any more
            assert table.data.device.type == "cpu"
            os.unlink(path)
            _same_rows(table, reference)
    finally:
        table.close()


def test_the_default_tier_is_mmap(table_file):
    path, _ = table_file
    table = open_table(path)
    assert type(table) is MmapTable
    table.close()


def test_the_cached_tiers_default_keeps_DEFAULT_CACHE_ROWS(tmp_path):
    """A table with more rows than the default: the cache holds exactly ``DEFAULT_CACHE_ROWS``."""
    rows = DEFAULT_CACHE_ROWS + 4096
    data = torch.zeros(rows, 4, dtype=torch.bfloat16)
    path = write_file(tmp_path / "big.pletable", "bf16", data, None, shard_rows=1 << 18)
    table = open_table(path, "cached")
    assert isinstance(table, CachedTable) and table.capacity_rows == DEFAULT_CACHE_ROWS
    table.close()


def test_options_given_are_used(table_file):
    path, reference = table_file
    cached = open_table(path, "cached", table_cache_rows=7)
    assert isinstance(cached, CachedTable) and cached.capacity_rows == 7
    _same_rows(cached, reference)
    cached.close()
    direct = open_table(path, "direct", memory_budget=0)
    assert isinstance(direct, DirectTable) and direct.memory_budget == 0 and direct.cache_slots == 0
    _same_rows(direct, reference)
    direct.close()


def test_an_open_table_is_owned(table_file):
    """Given a table already open (a table folder's checked file): wrapped, or closed once the tier
    holds the file itself."""
    path, reference = table_file
    mapped = MmapTable.open(path)
    direct = open_table(mapped, "direct", memory_budget=1 << 16)
    assert isinstance(direct, DirectTable) and direct.path == mapped.path
    with pytest.raises(PLEError, match="closed"):
        mapped.same_file(path)  # closed: the direct tier reads the file itself
    _same_rows(direct, reference)
    direct.close()
    mapped = MmapTable.open(path)
    cached = open_table(mapped, "cached")
    assert isinstance(cached, CachedTable) and cached.backing is mapped
    cached.close()
    mapped = MmapTable.open(path)
    assert open_table(mapped, "mmap") is mapped
    mapped.close()


def test_a_file_replaced_after_it_was_opened_is_refused(table_file, tmp_path):
    path, _ = table_file
    mapped = MmapTable.open(path)
    other = tmp_path / "other.pletable"
    other.write_bytes(path.read_bytes())
    os.replace(other, path)  # the same bytes, another file
    with pytest.raises(InvalidArgumentError, match=f"{path} was replaced while it was opened"):
        open_table(mapped, "direct")
    with pytest.raises(PLEError, match="closed"):
        mapped.same_file(path)


@pytest.mark.parametrize("tier", ["disk", "Mmap", "", None, 3])
def test_a_bad_tier_is_named_with_the_accepted_ones(table_file, tier):
    path, _ = table_file
    with pytest.raises(InvalidArgumentError) as e:
        open_table(path, tier)
    assert str(e.value) == (
        f"table_tier must be one of ['mmap', 'cached', 'memory', 'direct', 'sharded'], got {tier!r}"
    )


@pytest.mark.parametrize(
    "tier, options, error, message",
    [
        ("direct", {"memory_budget": -1}, InvalidArgumentError, "memory_budget must be >= 0, got -1"),
        ("direct", {"memory_budget": 1.5}, ArgumentTypeError, "memory_budget must be an int (bytes), got 1.5"),
        ("direct", {"memory_budget": True}, ArgumentTypeError, "memory_budget must be an int (bytes), got True"),
        (
            "mmap",
            {"memory_budget": 1 << 20},
            InvalidArgumentError,
            "memory_budget is for table_tier='direct', got table_tier='mmap'",
        ),
        (
            "cached",
            {"table_cache_rows": 0},
            InvalidArgumentError,
            "table_cache_rows must be >= 1, got 0; for no cache use table_tier='mmap'",
        ),
        (
            "cached",
            {"table_cache_rows": "10"},
            ArgumentTypeError,
            "table_cache_rows must be an int (rows kept in memory), got '10'",
        ),
        (
            "direct",
            {"table_cache_rows": 10},
            InvalidArgumentError,
            "table_cache_rows is for table_tier='cached', got table_tier='direct'",
        ),
        ("mmap", {"ids": "per_rank"}, InvalidArgumentError, "ids is for table_tier='sharded', got table_tier='mmap'"),
        (
            "cached",
            {"method": "allreduce"},
            InvalidArgumentError,
            "method is for table_tier='sharded', got table_tier='cached'",
        ),
    ],
)
def test_a_bad_option_is_refused_before_the_file_is_opened(tmp_path, tier, options, error, message):
    with pytest.raises(error) as e:
        open_table(tmp_path / "no-such-file.pletable", tier, **options)  # refused before it is looked for
    assert str(e.value) == message


def test_the_file_is_checked_as_every_reader_checks_it(table_file, tmp_path):
    path, _ = table_file
    other = dict(LAYOUT, seed=99)
    for tier in ("mmap", "cached", "memory", "direct"):
        with pytest.raises(TableFileError, match="layout"):
            open_table(path, tier, expected_layout_hash=other)
    for tier in ("mmap", "direct"):
        open_table(path, tier, expected_layout_hash=LAYOUT).close()
    with pytest.raises(FileNotFoundError):
        open_table(tmp_path / "missing.pletable", "mmap")
    mapped = MmapTable.open(path)
    with pytest.raises(InvalidArgumentError, match="expected_layout_hash is for a path"):
        open_table(mapped, "mmap", expected_layout_hash=LAYOUT)


def test_the_sharded_tier_in_a_one_rank_group(table_file, tmp_path):
    import torch.distributed as dist

    path, reference = table_file
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'rendezvous'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        table = open_table(path, "sharded", ids="replicated", expected_layout_hash=LAYOUT)
        assert isinstance(table, ShardedTable) and table.ids == "replicated"
        _same_rows(table, reference)
        table.close()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------- one opener for from_pretrained, eval, demo
def _describe(table) -> tuple:
    """What a tier object is, as the options made it."""
    if isinstance(table, CachedTable):
        return ("cached", table.capacity_rows, table.policy, table.refresh_every, table.decay, _describe(table.backing))
    if isinstance(table, DirectTable):
        return ("direct", table.memory_budget, table.queue_depth)  # its slots: the budget over the format's rows
    assert type(table) is MmapTable
    return ("mmap", table.rows, table.head_dim)


@pytest.fixture
def spy(monkeypatch):
    """Every ``open_table`` call of the loader, ``ple eval`` and the demo's serving path:
    ``(caller, tier, table_cache_rows, memory_budget, description of the table made)``."""
    import ple.commands.demo.serving
    import ple.integrations.transformers

    calls: list[tuple] = []
    real = opener.open_table

    def recording(caller):
        def call(path, table_tier=DEFAULT_TIER, **options):
            table = real(path, table_tier, **options)
            calls.append(
                (caller, table_tier, options.get("table_cache_rows"), options.get("memory_budget"), _describe(table))
            )
            return table

        return call

    monkeypatch.setattr(ple.integrations.transformers, "open_table", recording("from_pretrained"))
    monkeypatch.setattr(opener, "open_table", recording("eval"))  # ple eval imports it when it runs
    monkeypatch.setattr(ple.commands.demo.serving, "open_table", recording("demo"))
    return calls


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny fp32 qwen4_exp checkpoint (two PLE layers)."""
    pytest.importorskip("transformers")
    from tests.integrations.helpers import tiny_config, tiny_model

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    tiny_model(tiny_config(split_ngram_parts=4), seed=5).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "tier, budget",
    [("mmap", None), ("cached", None), ("direct", None), ("direct", 1 << 14)],
    ids=["mmap", "cached", "direct", "direct-16KiB"],
)
def test_from_pretrained_eval_and_demo_get_the_same_tier_objects(spy, checkpoint, tmp_path, monkeypatch, tier, budget):
    """The same ``--tier``/``--memory-budget`` give the same tier object in each command: the same
    opener, called with the same options (none of them supplies a default of its own)."""
    from ple.commands.cli import main
    from ple.commands.evaluate import format_variant
    from ple.convert.folder import default_table_dir
    from ple.integrations.transformers import from_pretrained, patched_layers

    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    model = from_pretrained(checkpoint, table_tier=tier, memory_budget=budget, progress=False)
    # ple eval: its reference is from_pretrained's model; each format's copy is opened for the same tier
    variant = format_variant(model, checkpoint, "fp8", default_table_dir(checkpoint), tier, budget, False)
    argv = ["demo", "--checkpoint", str(checkpoint), "--tier", tier, "--synthetic-tokens", "--json"]
    argv += ["--requests", "2", "--slots", "2", "--num-spec", "1", "--new-tokens", "2", "--no-progress"]
    if budget is not None:
        argv += ["--memory-budget", f"{budget}B"]
    assert main(argv) == 0
    by_caller: dict[str, list] = {}
    for caller, *made in spy:  # in the order of the PLE layers
        by_caller.setdefault(caller, []).append(tuple(made))
    assert sorted(by_caller) == ["demo", "eval", "from_pretrained"]
    # the two PLE layers loaded and in ple eval's copy, the demo's layer 0: the same tier objects
    assert by_caller["from_pretrained"] == by_caller["eval"] and len(by_caller["eval"]) == 2
    assert by_caller["demo"] == by_caller["eval"][:1]
    (description,) = by_caller["demo"]
    assert description[:3] == (tier, None, budget)  # the tier, and no option but the one given
    first = patched_layers(model)[0].layer.table
    mapped = ("mmap", first.rows, first.head_dim)
    made = description[3]
    if tier == "mmap":
        assert made == mapped
    if tier == "cached":
        assert made == ("cached", min(first.rows, DEFAULT_CACHE_ROWS), "lfu", 64, 0.5, mapped)
    if tier == "direct":
        assert made == ("direct", DEFAULT_MEMORY_BUDGET if budget is None else budget, 32)
    for t in variant.owned:
        t.close()
