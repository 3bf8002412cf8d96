"""ple.parallel pieces that need no process group: token shards, ids of a shard, the agreement
encoding and ple.common.collective's helpers, the launcher's environment, the local launcher, the demo's
options and workload."""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys

import pytest
import torch

from ple.commands.demo import parallel as demo_parallel
from ple.common.collective import differing, exchange_records, hash60, rank_list
from ple.config import PLEConfig
from ple.errors import ArgumentTypeError, InvalidArgumentError, UsageError
from ple.layer import PLELayer
from ple.parallel import (
    ParallelLayer,
    init_from_env,
    launch_env,
    local_ngram_ids,
    shard_of,
    spawn_local,
    token_shard,
)
from ple.parallel.guard import _decode, _encode

CONFIG = PLEConfig(
    hidden_size=12,
    eos_token_id=7,
    vocab_size=300,
    hc_count=2,
    ple_layer_ids=(1,),
    ngram_size=4,
    heads_per_ngram=2,
    ngram_vocab_size_base=500,
    make_ngram_vocab_size_divisible_by=16,
    split_ngram_parts=3,
    ple_conv_kernel_size=3,
)


@pytest.mark.parametrize("T", [0, 1, 3, 4, 5, 17, 64])
@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
def test_token_shards_tile_the_batch_with_equal_padded_sizes(T, W):
    shards = [token_shard(T, W, r) for r in range(W)]
    assert {s for _, _, s in shards} == {-(-T // W)}
    assert shards[0][0] == 0 and shards[-1][1] == T
    assert all(shards[i][1] == shards[i + 1][0] for i in range(W - 1))
    full = torch.arange(T * 2, dtype=torch.float32).view(T, 2)
    pieces = [shard_of(full, W, r) for r in range(W)]
    assert all(p.shape == (-(-T // W), 2) for p in pieces)
    assert torch.equal(torch.cat(pieces)[:T], full)
    assert not torch.cat(pieces)[T:].any()  # padding is zero


def test_token_shard_rejects_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="sp_rank must be in \\[0, 2\\), got 2"):
        token_shard(5, 2, 2)
    with pytest.raises(InvalidArgumentError, match="num_tokens must be an integer >= 0"):
        token_shard(-1, 2, 0)


def test_ids_of_a_shard_equal_the_same_rows_of_the_whole_batch():
    """Seeded random schedules (chunked prefill, decode, verify with rejections, EOS, null rows):
    the ids computed on a shard's tokens alone, for every shard boundary, equal the batch's."""
    layer = PLELayer(CONFIG, 0)
    boundaries_inside_requests = 0
    for seed in range(6):
        wl = demo_parallel.Workload(CONFIG, seed=seed, requests=10, slots=4, num_spec=2, chunk=9, eos_p=0.2)
        pool = layer.new_state_pool(4, 2)
        while not wl.done:
            st = wl.next_step()
            batch = st.batch(pool, 2, CONFIG.conv_window)
            want = layer.ngram_ids(st.tokens, batch)
            T = st.tokens.numel()
            qsl = set(batch.query_start_loc.tolist())
            for W in (2, 3, 4, 7):
                for r in range(W):
                    a, b, _ = token_shard(T, W, r)
                    got = local_ngram_ids(layer, st.tokens, batch, a, b)
                    assert torch.equal(got, want[a:b]), (seed, W, r)
                    boundaries_inside_requests += a not in qsl
            wl.advance(st)
        assert wl.counts["eos"] and wl.counts["rejected"] and wl.counts["prefill_continued"]
    assert boundaries_inside_requests > 50


def test_workload_covers_the_serving_mixes():
    wl = demo_parallel.Workload(CONFIG, seed=3, requests=12, slots=3, num_spec=3, chunk=16)
    while not wl.done:
        wl.advance(wl.next_step())
    c = wl.counts
    for key in ("prefill_first", "prefill_continued", "decode", "verify", "rejected", "eos", "slot_reuse", "null_rows"):
        assert c[key] > 0, key
    assert c["finished"] == 12


@pytest.mark.parametrize("value", [0, -5, 2**62, "sp", "bfloat16", "x" * 40, "é"])
def test_agreement_fields_round_trip(value):
    row = _encode(value)
    text = _decode(row)
    if isinstance(value, int):
        assert text == str(value)
    elif len(value.encode()) <= 32:
        assert text == repr(value)
    else:
        assert text.startswith(repr(value[:32])[:-1]) and "hash" in text
    assert _encode(value)[:2] != _encode(f"{value}!")[:2]


@pytest.mark.parametrize(
    "value, error, message",
    [
        (True, ArgumentTypeError, r"field 'mode' is True \(bool\), expected an int or a str"),
        (1.5, ArgumentTypeError, r"field 'mode' is 1.5 \(float\), expected an int or a str"),
        (None, ArgumentTypeError, r"field 'mode' is None \(NoneType\), expected an int or a str"),
        (list(range(100)), ArgumentTypeError, r"field 'mode' is \[0, 1, 2, .*\.\.\. \(list\)"),
        (2**63, InvalidArgumentError, r"field 'mode' is 9223372036854775808, outside the int64 range"),
    ],
)
def test_agreement_refuses_a_field_it_cannot_send_by_name(value, error, message):
    """Refused before any collective (no process group is needed to see it), naming field and value."""
    from ple.parallel import agree

    with pytest.raises(error, match=r"^PLE layer 0: configuration: " + message):
        agree({"ranks": 2, "mode": value}, "PLE layer 0: configuration")
    assert _encode(2**63 - 1)[1] == 2**63 - 1 and _encode(-(2**63))[1] == -(2**63)


def test_spawn_local_reports_each_rank_and_kills_stragglers():
    code = "import os, sys, time; r = int(os.environ['RANK']); time.sleep(60 if r == 2 else 0); sys.exit(r)"
    res = spawn_local([sys.executable, "-c", code], 3, deadline_s=60, grace_s=1.0, capture=True)
    assert res.returncodes[:2] == [0, 1] and res.returncodes[2] < 0  # rank 2 killed after rank 1 failed
    assert res.killed == [2] and not res.ok
    env = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'], os.environ['MASTER_ADDR'])"
    res = spawn_local([sys.executable, "-c", env], 2, deadline_s=60, grace_s=1.0, capture=True)
    assert res.ok and [o.split() for o in res.outputs] == [["0", "2", "0", "127.0.0.1"], ["1", "2", "1", "127.0.0.1"]]


def test_spawn_local_gives_each_rank_its_share_of_the_cores(monkeypatch):
    """Two local ranks on this machine's cores: each gets half of them (at least one) as OMP_NUM_THREADS,
    as torchrun keeps its ranks from oversubscribing; a value the user set is kept."""
    cores = len(os.sched_getaffinity(0))
    show = "import os; print(os.environ['OMP_NUM_THREADS'])"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    res = spawn_local([sys.executable, "-c", show], 2, deadline_s=60, grace_s=1.0, capture=True)
    assert res.ok and [o.strip() for o in res.outputs] == [str(max(1, cores // 2))] * 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    res = spawn_local([sys.executable, "-c", show], 2, deadline_s=60, grace_s=1.0, capture=True)
    assert res.ok and [o.strip() for o in res.outputs] == ["3", "3"]


def test_spawn_local_deadline():
    res = spawn_local([sys.executable, "-c", "import time; time.sleep(60)"], 2, deadline_s=1.0, grace_s=60)
    assert sorted(res.killed) == [0, 1] and all(rc < 0 for rc in res.returncodes)


def _demo_args(*argv: str) -> argparse.Namespace:
    from ple.commands.cli import build_parser

    return build_parser().parse_args(["demo", *argv])


def test_demo_options():
    assert not demo_parallel.requested(_demo_args())
    assert demo_parallel.requested(_demo_args("--ranks", "2"))
    with pytest.raises(InvalidArgumentError, match="--ranks 2: say how to split the work with --parallel"):
        demo_parallel.Options.from_args(_demo_args("--ranks", "2"))
    opts = demo_parallel.Options.from_args(_demo_args("--ranks", "4", "--parallel", "sp", "--sp-size", "2"))
    assert (opts.mode, opts.ranks, opts.sp_size, opts.split) == ("sp", 4, 2, "replicated")
    assert demo_parallel.Options.from_args(_demo_args("--parallel", "dp")).split == "sharded"


def test_demo_refuses_what_cannot_run_before_spawning():
    opts = demo_parallel.Options.from_args(_demo_args("--ranks", "4", "--parallel", "sp", "--sp-size", "3"))
    with pytest.raises(InvalidArgumentError, match="--sp-size 3 does not divide the 4 ranks"):
        opts.check_world(4)


def test_demo_refuses_ranks_without_a_mode():
    out = subprocess.run(
        [sys.executable, "-m", "ple.commands.cli", "demo", "--ranks", "2"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "--parallel" in out.stderr and "Traceback" not in out.stderr


def test_parallel_layer_needs_a_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(UsageError, match="needs an initialized torch.distributed process group"):
        ParallelLayer(PLELayer(CONFIG, 0), "sp")


def test_hash60_and_rank_lists():
    digest = "0123456789abcdef" * 4  # a sha256 hex digest reads as its own prefix
    assert hash60(digest) == 0x0123456789ABCDE
    assert hash60("layout") == hash60(b"layout") == int(hashlib.sha256(b"layout").hexdigest()[:15], 16)
    assert hash60("ABC") != hash60("abc") and hash60("12") != hash60("012")  # short hex is hashed, not parsed
    assert all(0 <= hash60(v) < 2**60 for v in (b"", "x", digest.upper()))
    assert rank_list([3]) == "rank 3" and rank_list([0, 2]) == "ranks 0, 2"
    assert differing([5, 5, 5]) is None and differing({}) is None
    assert differing(["a", "b", "a"], repr) == "ranks 0, 2: 'a'; rank 1: 'b'"
    assert differing({1: 7, 3: 8}) == "rank 1: 7; rank 3: 8"  # some ranks, by their real numbers


def test_exchange_records_refuses_a_record_that_is_no_int64_vector():
    with pytest.raises(InvalidArgumentError, match="t: a record must be a 1-D int64 tensor, got torch.int32"):
        exchange_records(torch.zeros(3, dtype=torch.int32), what="t")
    with pytest.raises(InvalidArgumentError, match="a record must be a 1-D int64 tensor"):
        exchange_records(torch.zeros(2, 2, dtype=torch.int64), what="t")


def _launcher_env(monkeypatch, **env):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_launch_env_checks_every_variable(monkeypatch):
    _launcher_env(monkeypatch, RANK="1", WORLD_SIZE="2")
    assert launch_env() == (1, 2, 0)  # LOCAL_RANK defaults to 0
    _launcher_env(monkeypatch, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    assert launch_env().local_rank == 1
    for env, message in [
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "gpu1"},
            "environment variable LOCAL_RANK='gpu1' is not an integer",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "environment variable LOCAL_RANK=-1 must be >= 0"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "environment variable RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "1_0"}, "environment variable WORLD_SIZE='1_0' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "environment variable WORLD_SIZE=0 must be >= 1"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ]:
        _launcher_env(monkeypatch, **env)
        with pytest.raises(InvalidArgumentError, match=f"^{message}$"):
            launch_env()
    _launcher_env(monkeypatch, WORLD_SIZE="2")
    with pytest.raises(UsageError, match="environment variable RANK is not set"):
        launch_env()


def test_init_from_env_refuses_a_bad_local_rank_before_joining(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    _launcher_env(monkeypatch, RANK="0", WORLD_SIZE="1", LOCAL_RANK="one")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(InvalidArgumentError, match="LOCAL_RANK='one' is not an integer"):
        init_from_env("gloo", 5)
    assert not dist.is_initialized()


def test_demo_under_a_launcher_checks_its_world_size(monkeypatch):
    _launcher_env(monkeypatch, RANK="0", WORLD_SIZE="two")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(InvalidArgumentError, match="WORLD_SIZE='two' is not an integer"):
        demo_parallel.run(_demo_args("--parallel", "dp"))
