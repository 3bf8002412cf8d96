"""ple.parallel across 2 and 4 gloo processes: every mode, dtype and table tier against one process.

Each world size is launched once (:func:`ple.parallel.spawn_local`, the environment torchrun gives,
``env://`` rendezvous, a 20 s collective timeout, a hard kill after WORKER_TIMEOUT_S). The ranks
run every scenario in one fixed order: a seeded random serving schedule (chunked prefill, decode,
speculative verify with rejections, EOS, slot reuse, null rows; "dp" ranks and "sp" replicas each
their own stream, so ranks also step with no tokens) through :class:`ple.parallel.ParallelLayer`,
compared on every step, bit for bit, with a one-process layer holding the whole table; then ranks
that disagree, which must all fail before any data collective. The tests read what each rank saved.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from ple.parallel import spawn_local

WORKER_TIMEOUT_S = 240
PG_TIMEOUT_S = 20
WORLDS = (2, 4)

TINY = {
    "hidden_size": 12,
    "hc_count": 2,
    "ple_layer_ids": [1],
    "ple_embed_dim": 16,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "vocab_size": 300,
    "ngram_vocab_size_base": 500,
    "make_ngram_vocab_size_divisible_by": 16,
    "split_ngram_parts": 3,
    "ple_conv_kernel_size": 3,
    "eos_token_id": 7,
}

# (name, mode, dtype, table split, tier, lookup method, sp size (None: the whole world; "half")); the
# 4-rank launch runs those in WORLD4 (the others' paths do not change with the world size)
SERVE = [
    ("sp-fp32-replicated", "sp", "float32", "replicated", "memory", None, None),
    ("sp-bf16-sharded", "sp", "bfloat16", "sharded", "memory", None, None),
    ("sp-fp32-sharded-allreduce", "sp", "float32", "sharded", "memory", "allreduce", None),
    ("sp-bf16-mmap-sharded", "sp", "bfloat16", "sharded", "mmap", None, None),
    ("sp-fp32-mmap-replicated", "sp", "float32", "replicated", "mmap", None, None),
    ("spxdp-fp32-sharded", "sp", "float32", "sharded", "memory", None, "half"),
    ("spxdp-bf16-sharded-allreduce", "sp", "bfloat16", "sharded", "memory", "allreduce", "half"),
    ("etp-fp32-allreduce", "etp", "float32", "sharded", "memory", "allreduce", None),
    ("etp-bf16-alltoall", "etp", "bfloat16", "sharded", "mmap", "alltoall", None),
    ("dp-fp32-sharded", "dp", "float32", "sharded", "memory", None, None),
    ("dp-bf16-sharded-allreduce", "dp", "bfloat16", "sharded", "memory", "allreduce", None),
    ("dp-fp32-replicated", "dp", "float32", "replicated", "memory", None, None),
]
WORLD4 = {
    "sp-bf16-sharded",
    "sp-fp32-sharded-allreduce",
    "sp-fp32-mmap-replicated",
    "spxdp-fp32-sharded",
    "spxdp-bf16-sharded-allreduce",
    "etp-fp32-allreduce",
    "dp-bf16-sharded-allreduce",
}


def _runs(world: int, name: str) -> bool:
    return world == 2 or name in WORLD4


# ---------------------------------------------------------------------- worker side
def _options(world: int, seed: int, **kw):
    from ple.commands.demo.parallel import Options

    base = dict(mode="sp", ranks=world, seed=seed, requests=6, slots=3, num_spec=2, chunk=11)
    base.update(kw)
    return Options(**base)


def _scenarios(ctx, tmp: Path):
    """(key, thunk) in one fixed order; every rank runs them all."""
    from ple.commands.demo.parallel import serve_rank

    world, rank, last = ctx.world_size, ctx.rank, ctx.world_size - 1
    config = str(tmp / "config.json")
    for i, (name, mode, dtype, split, tier, method, sp) in enumerate(SERVE):
        if not _runs(world, name):
            continue
        opts = _options(
            world,
            config=config,
            seed=i,
            mode=mode,
            dtype=dtype,
            table_split=split,
            tier=tier,
            lookup_method=method,
            sp_size=max(1, world // 2) if sp == "half" else None,
        )
        yield f"serve/{name}", lambda o=opts: _serve(serve_rank, o, ctx, tmp)

    # ---- ranks that disagree: all fail, before any data collective
    def options_differ(**kw):
        mine = {"config": config, **(kw if rank == last else {})}
        return _serve(serve_rank, _options(world, seed=1, **mine), ctx, tmp)

    yield "differ/mode", lambda: options_differ(mode="dp")
    yield "differ/dtype", lambda: options_differ(dtype="bfloat16")
    yield "differ/sp_size", lambda: options_differ(sp_size=1)
    yield "differ/config", lambda: options_differ(config=str(tmp / "config_wide.json"))
    yield "differ/weights", lambda: _library_differ(ctx, weights_seed=1 if rank == last else 0)
    yield "differ/batch", lambda: _library_differ(ctx, batch_seed=1 if rank == last else 0)
    yield "differ/hidden_rows", lambda: _library_differ(ctx, extra_row=rank == last)
    yield "differ/check_batches", lambda: _library_differ(ctx, check_batches=rank != last)
    # records of different lengths used to abort a rank inside gloo (SIGABRT) and hang the others
    yield "differ/field_count", lambda: _agree({"a": 1, "b": "x", **({"c": 2} if rank == last else {})})
    yield "differ/field_names", lambda: _agree({"a": 1, ("c" if rank == last else "b"): "x"})
    yield "after", lambda: _serve(serve_rank, _options(world, config=config, seed=99, table_split="sharded"), ctx, tmp)


def _serve(serve_rank, opts, ctx, tmp):
    stats = serve_rank(opts, ctx, tmp)
    stats.pop("times")
    return stats


def _agree(fields):
    from ple.parallel import agree

    agree(fields, "a test's fields")


def _library_differ(ctx, weights_seed=0, batch_seed=0, extra_row=False, check_batches=True):
    """ParallelLayer directly: weights, settings, or one step's batch, differ on the last rank."""
    from ple.commands.demo.parallel import Workload, build_layer
    from ple.config import PLEConfig
    from ple.parallel import ParallelLayer, shard_of

    config = PLEConfig.from_dict(TINY)
    layer, full = build_layer(config, 0, torch.float32, weights_seed)
    layer.set_table(full)
    player = ParallelLayer(layer, "sp", context=ctx, check_batches=check_batches)
    st = Workload(config, seed=batch_seed, requests=4, slots=4, num_spec=0, chunk=8).next_step()
    hidden = shard_of(st.hidden, player.group_size, player.group_rank)
    if extra_row:
        hidden = torch.cat([hidden, hidden[:1]])
    pool = layer.new_state_pool(4)
    return player(hidden, st.tokens, st.batch(pool, 0, config.conv_window))


def _worker_main(tmp: str) -> int:
    from ple.parallel import init_from_env

    torch.set_num_threads(1)
    ctx = init_from_env("gloo", PG_TIMEOUT_S)
    results = {}
    for key, thunk in _scenarios(ctx, Path(tmp)):
        try:
            results[key] = ("ok", thunk())
        except Exception as e:
            results[key] = ("err", type(e).__name__, str(e))
    torch.save(results, Path(tmp) / f"rank{ctx.rank}.pt")
    torch.distributed.destroy_process_group()
    return 0


# ---------------------------------------------------------------------- launcher / fixtures
def _launch(world: int, tmp: Path) -> list[dict]:
    (tmp / "config.json").write_text(json.dumps(TINY))
    (tmp / "config_wide.json").write_text(json.dumps({**TINY, "hidden_size": 24}))
    env = {
        "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    res = spawn_local(
        [sys.executable, __file__, "--worker", str(tmp)],
        world,
        deadline_s=WORKER_TIMEOUT_S,
        grace_s=PG_TIMEOUT_S + 10,
        env=env,
        capture=True,
    )
    for r, rc in enumerate(res.returncodes):
        if rc != 0 or not (tmp / f"rank{r}.pt").is_file():
            killed = " (killed: hang?)" if r in res.killed else ""
            pytest.fail(f"world {world}: rank {r} exited with {rc}{killed}:\n{res.outputs[r][-4000:]}")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def world(request, tmp_path_factory):
    return request.param, _launch(request.param, tmp_path_factory.mktemp(f"parallel{request.param}"))


def ok(results, key):
    vals = []
    for r, res in enumerate(results):
        entry = res[key]
        if entry[0] != "ok":
            pytest.fail(f"{key}: rank {r} raised {entry[1]}: {entry[2]}")
        vals.append(entry[1])
    return vals


def errors(results, key):
    out = []
    for r, res in enumerate(results):
        entry = res[key]
        assert entry[0] == "err", f"{key}: rank {r} did not raise"
        out.append((entry[1], entry[2]))
    return out


# ---------------------------------------------------------------------- tests
def test_every_rank_matches_one_process_bit_for_bit(world):
    """Every scenario of this world size: each rank's rows and state pool equal one process's on every step."""
    w, results = world
    ran = [sc for sc in SERVE if _runs(w, sc[0])]
    assert len(ran) == (len(SERVE) if w == 2 else len(WORLD4))
    for name, mode, _, _, _, _, sp in ran:
        stats = ok(results, f"serve/{name}")
        for r, s in enumerate(stats):
            assert s["bad_rows"] == 0 and s["bad_pools"] == 0, f"{name}, rank {r}: {s}"
            assert s["steps"] > 5, name
        assert len({s["steps"] for s in stats}) == 1, name  # every rank took part in every step
        if mode == "sp":  # each token row checked on exactly one rank of its group
            size = max(1, w // 2) if sp == "half" else w
            for g in range(0, w, size):
                group = stats[g : g + size]
                assert len({s["tokens"] for s in group}) == 1, name
                assert sum(s["rows"] for s in group) == group[0]["tokens"], name
            assert min(s["rows"] for s in stats) > 0, name
        else:
            assert all(s["rows"] == s["tokens"] for s in stats), name


def test_schedules_cover_the_serving_mixes(world):
    """The random schedules did exercise what they are meant to (the tests above are not vacuous)."""
    w, results = world
    total: dict[str, int] = {}
    empty_steps = {"sp": 0, "etp": 0, "dp": 0}
    for name, mode, *_ in (sc for sc in SERVE if _runs(w, sc[0])):
        for s in ok(results, f"serve/{name}"):
            empty_steps[mode] += s["empty_steps"]
            for k, v in s["coverage"].items():
                total[k] = total.get(k, 0) + v
    for key in ("prefill_first", "prefill_continued", "decode", "verify", "rejected", "eos", "slot_reuse", "null_rows"):
        assert total[key] > 0, (key, total)
    # ranks with no rows in a step still took part: sp shards past a short batch's end, dp ranks done early
    assert empty_steps["sp"] > 0 and empty_steps["dp"] > 0, empty_steps


def _mismatch(results, key, field):
    errs = errors(results, key)
    for r, (typ, msg) in enumerate(errs):
        assert typ == "RankMismatchError", (r, typ, msg)
        assert "before any data collective" in msg and f"this is rank {r})" in msg
        assert f"disagree on {field}" in msg or f"disagree on {field}," in msg or f", {field}" in msg, msg
    return [m for _, m in errs]


def test_ranks_with_another_mode_fail_together(world):
    w, results = world
    for msg in _mismatch(results, "differ/mode", "mode"):
        assert f"rank {w - 1}: 'dp'" in msg and "'sp'" in msg


def test_ranks_with_another_dtype_fail_together(world):
    w, results = world
    for msg in _mismatch(results, "differ/dtype", "dtype"):
        assert f"rank {w - 1}: 'bfloat16'" in msg


def test_ranks_with_another_geometry_fail_together(world):
    w, results = world
    for msg in _mismatch(results, "differ/sp_size", "sp_size"):
        assert f"rank {w - 1}: 1" in msg and f": {w}" in msg
    _mismatch(results, "differ/config", "config")


def test_ranks_with_other_weights_fail_together(world):
    _mismatch(world[1], "differ/weights", "weights")


def test_ranks_with_another_batch_fail_together(world):
    w, results = world
    _mismatch(results, "differ/batch", "batch")
    for msg in _mismatch(results, "differ/hidden_rows", "hidden_rows"):
        assert "step 0: the batch" in msg


def test_ranks_with_other_settings_fail_together(world):
    w, results = world
    for msg in _mismatch(results, "differ/check_batches", "check_batches"):
        assert f"rank {w - 1}: 0" in msg and "configuration" in msg


def test_ranks_checking_other_fields_fail_together(world):
    """Another number of fields (records of other lengths), or other names: every rank raises."""
    w, results = world
    others = "rank 0" if w == 2 else f"ranks {', '.join(str(r) for r in range(w - 1))}"
    for r, (typ, msg) in enumerate(errors(results, "differ/field_count")):
        assert typ == "RankMismatchError", (r, typ, msg)
        assert msg.startswith(f"a test's fields: the {w} ranks exchange records of different lengths ("), msg
        assert f"{others}: 18 words; rank {w - 1}: 24 words" in msg and f"this is rank {r})" in msg
    for r, (typ, msg) in enumerate(errors(results, "differ/field_names")):
        assert typ == "RankMismatchError", (r, typ, msg)
        assert f"the {w} ranks check different sets of fields" in msg and f"this is rank {r})" in msg


def test_group_works_after_the_failures(world):
    for r, s in enumerate(ok(world[1], "after")):
        assert s["bad_rows"] == 0 and s["bad_pools"] == 0 and s["rows"] > 0, r


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.exit(_worker_main(sys.argv[2]))
