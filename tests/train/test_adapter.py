"""Adapters: the trained rows as a file of their own, served on any base tier and format, swapped
and removed on a running model, merged into a table file of the base's format; a training run
killed at any point (SIGKILL, in a child process) leaves the base table and the last saved adapter
whole, and resumes from them to the bits of an uninterrupted run."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ple.runtime import Batch
from ple.table import MmapTable, format_info, verify_table_file
from ple.table.formats.catalog import FORMATS
from ple.table.tiers.adapted import AdaptedTable
from ple.train import (
    AdamW,
    AdapterFileError,
    SparseAdam,
    load_adapter,
    load_optimizer_state,
    merge_table_file,
    read_adapter,
    remove_adapter,
    save_adapter,
    trainable,
)
from ple.train.merge import requantize
from tests.train._helpers import CFG, TIERS, batch, dequantized, make_tier, new_layer, write_table_file

ROOT = Path(__file__).resolve().parents[2]


def _train(layer, steps=6, seed=0, opt=None):
    opt = opt or SparseAdam(trainable(layer), lr=0.05)
    for i in range(steps):
        hidden, ids, _ = batch(seed=seed + i, b=3, s=16)
        out = layer.forward_padded(hidden, ids)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()
    return opt


def _engine(layer, seed=3):
    hidden, ids, _ = batch(seed=seed, b=2, s=10)
    pool = layer.new_state_pool(2)
    b = Batch.build([10, 10], [0, 1], torch.full((2, 2), CFG.eos_token_id), pool)
    with torch.no_grad():
        return layer(hidden.reshape(20, -1), ids.reshape(-1), b)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("fmt", ["fp8", "q4_0"])
@pytest.mark.parametrize("tier", TIERS)
def test_an_adapter_file_serves_the_trained_rows_on_every_tier(tmp_path, tier, fmt):
    trained = new_layer(seed=1, table=make_tier("mmap", fmt, tmp_path, seed=2))
    _train(trained)
    overlay = trained.table.overlay
    path = save_adapter(tmp_path / "a.safetensors", trained)
    n, d = len(overlay), overlay.head_dim
    assert n > 50 and path.stat().st_size < n * (8 + 4 * d) + 4096  # the rows and their ids, a small header
    want = dequantized(trained.table)

    served = new_layer(seed=1, table=make_tier(tier, fmt, tmp_path, seed=2))
    file = load_adapter(served, path)
    assert file.dtype == torch.float32 and file.layers[0].trained_rows == n
    assert isinstance(served.table, AdaptedTable) and served.table.overlay.dtype == torch.float32
    assert torch.equal(dequantized(served.table), want)
    assert torch.equal(_engine(served), _engine(trained))
    # a bf16 adapter: half the rows' bytes, each row the fp32 one rounded once
    half = save_adapter(tmp_path / "b.safetensors", trained, dtype=torch.bfloat16)
    assert half.stat().st_size < path.stat().st_size - n * d
    load_adapter(served, half)
    got = dequantized(served.table)
    rows = overlay.ids()
    assert torch.equal(got[rows], want[rows].to(torch.bfloat16).float())
    other = torch.ones(served.table.rows, dtype=torch.bool)
    other[rows] = False
    assert torch.equal(got[other], want[other])


def test_the_safetensors_library_reads_an_adapter_file(tmp_path):
    from safetensors.torch import load_file

    layer = new_layer(seed=1, table=make_tier("memory", "bf16", tmp_path))
    _train(layer, steps=2)
    path = save_adapter(tmp_path / "a.safetensors", layer, meta={"note": "x"})
    tensors = load_file(path)
    ids, rows = layer.table.overlay.chunks().__next__()
    assert torch.equal(tensors["layer0.ids"], ids) and torch.equal(tensors["layer0.rows"], rows)
    assert read_adapter(path).meta == {"note": "x"}


def test_adapters_load_swap_and_remove_on_a_running_model_and_the_base_stays(tmp_path):
    path = write_table_file(tmp_path / "base.pletable", "int8_row", seed=4)
    before = _sha(path)
    a_layer = new_layer(seed=2, table=MmapTable.open(path))
    _train(a_layer, seed=10)
    a = save_adapter(tmp_path / "a.safetensors", a_layer)
    b_layer = new_layer(seed=2, table=MmapTable.open(path))
    _train(b_layer, seed=20)
    b = save_adapter(tmp_path / "b.safetensors", b_layer)

    running = new_layer(seed=2, table=MmapTable.open(path))
    plain = _engine(running)
    base = running.table
    load_adapter(running, a)
    with_a = _engine(running)
    load_adapter(running, b)  # swapped: the base underneath is the same table
    assert running.table.base is base
    with_b = _engine(running)
    assert torch.equal(with_a, _engine(a_layer)) and torch.equal(with_b, _engine(b_layer))
    assert not torch.equal(with_a, with_b) and not torch.equal(with_a, plain)
    remove_adapter(running)
    assert running.table is base and torch.equal(_engine(running), plain)
    assert _sha(path) == before and verify_table_file(path) == []


def test_bad_adapter_files_are_refused_and_leave_the_model_as_it_was(tmp_path):
    layer = new_layer(seed=1, table=make_tier("memory", "fp32", tmp_path))
    _train(layer, steps=2)
    good = save_adapter(tmp_path / "a.safetensors", layer)
    target = new_layer(seed=1, table=make_tier("memory", "fp32", tmp_path))
    table = target.table
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(AdapterFileError, match="cut.safetensors"):
        load_adapter(target, cut)
    other = new_layer(seed=1, index=1, table=make_tier("memory", "fp32", tmp_path, index=1))
    with pytest.raises(AdapterFileError, match="PLE layers \\[0\\]"):
        load_adapter(other, good)
    bad = tmp_path / "bad.safetensors"
    raw = bytearray(good.read_bytes())
    raw[-4:] = b"\xff\xff\xff\x7f"  # the last row's last value: NaN
    bad.write_bytes(bytes(raw))
    with pytest.raises(AdapterFileError, match="not finite"):
        load_adapter(target, bad)
    not_one = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, not_one)
    with pytest.raises(AdapterFileError, match="not a ple table adapter"):
        read_adapter(not_one)
    assert target.table is table


def test_a_checkpoint_resumes_training_to_the_bits_of_an_uninterrupted_run(tmp_path):
    path = write_table_file(tmp_path / "base.pletable", "fp8", seed=6)
    straight = new_layer(seed=3, table=MmapTable.open(path))
    _train(straight, steps=12, opt=AdamW(trainable(straight), lr=0.03, weight_decay=0.1))

    first = new_layer(seed=3, table=MmapTable.open(path))
    opt = AdamW(trainable(first), lr=0.03, weight_decay=0.1)
    for i in range(6):
        hidden, ids, _ = batch(seed=i, b=3, s=16)
        out = first.forward_padded(hidden, ids)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()
    ckpt = save_adapter(tmp_path / "ckpt.safetensors", first, optimizer=opt, meta={"step": 6})
    assert read_adapter(ckpt).optimizer["class"] == "AdamW"

    resumed = new_layer(seed=3, table=MmapTable.open(path))
    load_adapter(resumed, ckpt)
    opt2 = AdamW(trainable(resumed), lr=0.5)  # hyperparameters come back from the checkpoint
    load_optimizer_state(opt2, ckpt)
    assert opt2.param_groups[0]["lr"] == 0.03
    for i in range(6, 12):
        hidden, ids, _ = batch(seed=i, b=3, s=16)
        out = resumed.forward_padded(hidden, ids)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt2.step()
    assert torch.equal(dequantized(resumed.table), dequantized(straight.table))
    with pytest.raises(AdapterFileError, match="SparseAdam"):
        load_optimizer_state(SparseAdam(trainable(resumed)), ckpt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_merging_writes_the_trained_rows_in_the_base_format_and_keeps_the_others(tmp_path, fmt):
    path = write_table_file(tmp_path / "base.pletable", fmt, seed=7)
    before = _sha(path)
    layer = new_layer(seed=4, table=MmapTable.open(path))
    _train(layer, steps=4)
    adapter = save_adapter(tmp_path / "a.safetensors", layer)
    merged = merge_table_file(path, adapter, tmp_path / "merged.pletable")
    assert verify_table_file(merged) == [] and _sha(path) == before
    base, out = MmapTable.open(path), MmapTable.open(merged)
    overlay = layer.table.overlay
    rows = overlay.ids()
    other = torch.ones(base.rows, dtype=torch.bool)
    other[rows] = False
    assert torch.equal(out.data[other], base.data[other])  # untouched rows: the same bytes
    if format_info(fmt).scale_kind == "row":
        assert torch.equal(out.scale[other], base.scale[other])
    _, trained = overlay.get(rows)
    gs = float(base.scale.reshape(-1)[0]) if format_info(fmt).scale_kind == "global" else None
    stored, scale = requantize(trained, fmt, gs)
    assert torch.equal(out.data[rows], stored)
    got = dequantized(out)[rows]
    if fmt == "fp32":
        assert torch.equal(got, trained)
    else:  # the format's rounding of the trained rows
        err = (got - trained).abs().amax(1) / trained.abs().amax(1)
        coarse = fmt not in ("bf16", "fp16", "int8_row", "q8_0")  # 4-bit codes, fp8's 3-bit mantissa
        assert float(err.max()) < (0.35 if coarse else 0.01)
    base.close()
    out.close()


def test_a_training_run_killed_at_any_point_leaves_the_base_and_the_last_adapter_whole(tmp_path):
    path = write_table_file(tmp_path / "base.pletable", "q8_0", seed=8)
    before = _sha(path)
    ckpt = tmp_path / "ckpt.safetensors"
    # a child that dies of a signal says where (faulthandler), not only that it printed nothing
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONFAULTHANDLER": "1"}
    child = [sys.executable, str(ROOT / "tests" / "train" / "train_child.py"), str(path), str(ckpt)]
    rng = random.Random(0)
    saved_steps: set[int] = set()
    for run in range(3):
        resume = ckpt.exists()
        proc = subprocess.Popen(
            [*child, str(10**9), "2", *(["resume"] if resume else [])],  # killed long before its end
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # the first save of this run
        if not line.startswith("saved"):
            proc.kill()
            _, err = proc.communicate(timeout=60)
            raise AssertionError(
                f"run {run} (resume={resume}, saved so far {sorted(saved_steps)}) printed {line!r} and exited "
                f"with {proc.returncode}; its stderr:\n{err[-4000:]}"
            )
        saved_steps.add(int(line.split()[1]))
        time.sleep(rng.uniform(0.0, 0.6))  # then a kill anywhere: a step, a save, between
        proc.send_signal(signal.SIGKILL)
        for rest in proc.stdout:
            saved_steps.add(int(rest.split()[1]))
        proc.wait()
        proc.stderr.close()
        assert _sha(path) == before
        file = read_adapter(ckpt)  # whole: every row readable, the step one that was saved
        step = int(file.meta["step"])
        assert step in saved_steps or step == max(saved_steps) + 2  # killed after its rename, before the print
        list(file.chunks(0))
    resumed_from = int(read_adapter(ckpt).meta["step"])
    done = subprocess.run([*child, str(resumed_from + 6), "2", "resume"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    straight = tmp_path / "straight.safetensors"
    done = subprocess.run(
        [sys.executable, *child[1:3], str(straight), str(resumed_from + 6), "1000"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    a, b = read_adapter(ckpt), read_adapter(straight)
    for (ia, ra), (ib, rb) in zip(a.chunks(0), b.chunks(0), strict=True):
        assert torch.equal(ia, ib) and torch.equal(ra, rb)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    assert len(leftovers) <= 1  # at most the last killed save's; the next save sweeps it


def test_a_session_serves_an_adapter_as_a_table_holding_the_merged_rows(tmp_path):
    from ple.runtime import Session
    from ple.table import MemoryTable

    layer = new_layer(seed=8, table=make_tier("mmap", "fp32", tmp_path, seed=9))
    _train(layer, steps=3)
    merged = new_layer(seed=8, table=MemoryTable(dequantized(layer.table)))
    outs = []
    for served in (layer, merged):
        session = Session(served, max_requests=2)
        session.add("a")
        hidden, ids, _ = batch(seed=12, b=1, s=20)
        first = session.step({"a": (hidden[0, :12], ids[0, :12])})["a"]
        second = session.step({"a": (hidden[0, 12:], ids[0, 12:])})["a"]
        outs.append(torch.cat([first, second]))
    assert torch.equal(outs[0], outs[1])
