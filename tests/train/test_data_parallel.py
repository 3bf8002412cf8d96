"""A replicated table trained under ``DistributedDataParallel`` with 2 and 3 gloo ranks, each rank its own
batches (``ddp_worker.py``, as a user writes the loop): the ranks' trained rows, SparseAdam's states and
the other weights are equal bit for bit on every rank, and equal within fp32 rounding to one process
training on the ranks' batches together with the loss averaged over them (DDP's mean of gradients);
with gradient accumulation (``no_sync`` backwards) and a bf16 model too; and transformers' ``Trainer``
launched with 2 processes by ``accelerate launch``. A fused optimizer and ranks that disagree on what decides
an update (step count, learning rate, optimizer class, the table's format, an adapter's rows, optimizer
states) are refused on
every rank, naming the field; ranks that load the same adapter midway train on, identical."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ple.parallel import spawn_local
from ple.train import read_adapter, save_adapter
from tests.integrations.helpers import tiny_config, tiny_model
from tests.train import trainer_worker
from tests.train.ddp_worker import CASES, LR_REST, LR_TABLE, REFUSALS, load, rank_batch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny qwen4_exp checkpoint, its table files and their fp8 copies, and an adapter of a step's rows
    in fp32 and bf16 (made once, before the ranks start)."""
    from ple.integrations.transformers import from_pretrained

    root = tmp_path_factory.mktemp("ddp")
    tiny_model(tiny_config(split_ngram_parts=4, ple_embed_dim=64), seed=81).save_pretrained(root / "ckpt")
    from_pretrained(root / "ckpt", table_dir=root / "tables", table_format="fp8")
    model, opt, _ = load(root / "ckpt", root / "tables")
    ids = rank_batch(5, 0)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        save_adapter(root / f"adapter-{name}.safetensors", model, dtype=dtype)
    return root


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _spawn(root: Path, ranks: int, case: str, out: Path):
    out.mkdir(exist_ok=True)
    worker = [sys.executable, str(ROOT / "tests" / "train" / "ddp_worker.py")]
    argv = [*worker, str(root / "ckpt"), str(root / "tables"), str(out), case]
    res = spawn_local(argv, ranks, deadline_s=240, grace_s=20, capture=True, env={"PYTHONPATH": str(ROOT / "src")})
    assert res.ok, res.outputs
    return res.outputs


def _one_process(root: Path, ranks: int, case: str, path: Path):
    """One process, the ranks' batches (and micro-batches) concatenated into one: its loss is the mean
    over all of them, the mean of the ranks' losses."""
    steps, micro, dtype = CASES[case]
    model, opt, rest = load(root / "ckpt", root / "tables", dtype)
    for step in range(steps):
        ids = torch.cat([rank_batch(step, r, m) for r in range(ranks) for m in range(micro)])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        rest.step()
        rest.zero_grad()
    save_adapter(path, model, optimizer=opt)
    return {n: p.detach() for n, p in model.named_parameters()}


def _trained(path: Path):
    """Per table: ``(ids, rows, state ids, states)``, and the step counts."""
    file = read_adapter(path)
    out = {}
    for i in file.layers:
        ids, rows = (torch.cat(t) for t in zip(*file.chunks(i), strict=True))
        out[i] = (ids, rows, *file.optimizer_states(i))
    return out, file.optimizer["steps"]


def _check(root: Path, out: Path, ranks: int, case: str, tmp_path: Path):
    tables = [_trained(out / f"{case}-rank{r}.safetensors") for r in range(ranks)]
    weights = [torch.load(out / f"{case}-rank{r}.pt") for r in range(ranks)]
    for r in range(1, ranks):  # every rank: the same bits
        assert tables[r][1] == tables[0][1]
        for i, want in tables[0][0].items():
            for a, b in zip(want, tables[r][0][i], strict=True):
                assert torch.equal(a, b), (case, r, i)
        for n, w in weights[0].items():
            assert torch.equal(w, weights[r][n]), (case, r, n)
    one = _one_process(root, ranks, case, tmp_path / f"{case}-one.safetensors")
    ref, steps = _trained(tmp_path / f"{case}-one.safetensors")
    got = tables[0][0]
    assert tables[0][1] == steps == {str(i): CASES[case][0] for i in ref}
    if CASES[case][2] == torch.bfloat16:
        # bf16 GEMMs of other sizes round differently, and Adam moves an element whose gradient is near
        # zero by up to lr either way: nearly every element within bf16 rounding, every one within the
        # most the steps can move it
        steps = CASES[case][0]
        for i, (ids, rows, s_ids, _states) in ref.items():
            assert torch.equal(got[i][0], ids) and torch.equal(got[i][2], s_ids), (case, i)
            diff = (got[i][1] - rows).abs()
            assert float((diff > 2e-2).float().mean()) < 0.01 and float(diff.max()) <= 2 * steps * LR_TABLE
        for n, w in one.items():
            torch.testing.assert_close(weights[0][n].float(), w.float(), rtol=0.05, atol=2 * steps * LR_REST)
        return
    for i, (ids, rows, s_ids, states) in ref.items():
        assert ids.numel() > 50 and torch.equal(got[i][0], ids) and torch.equal(got[i][2], s_ids), (case, i)
        torch.testing.assert_close(got[i][1], rows, rtol=1e-4, atol=1e-5)  # the same terms in another grouping
        d = rows.shape[1]
        torch.testing.assert_close(got[i][3][:, :d], states[:, :d], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got[i][3][:, d:], states[:, d:], rtol=1e-4, atol=1e-8)
    for n, w in one.items():  # DDP's own: AdamW makes an element of a near-zero gradient sensitive to rounding
        torch.testing.assert_close(weights[0][n], w, rtol=1e-3, atol=0.1 * LR_REST)


def test_two_ranks_keep_one_table_equal_to_one_process_on_their_batches(checkpoint, tmp_path):
    out = tmp_path / "out"
    outputs = _spawn(checkpoint, 2, "all", out)
    for case in CASES:
        _check(checkpoint, out, 2, case, tmp_path)
    assert all("exchanged" in o for o in outputs)


def test_three_ranks_keep_one_table_equal_to_one_process_on_their_batches(checkpoint, tmp_path):
    out = tmp_path / "out"
    _spawn(checkpoint, 3, "plain", out)
    _check(checkpoint, out, 3, "plain", tmp_path)


def test_a_fused_optimizer_and_ranks_that_disagree_are_refused_on_every_rank(checkpoint, tmp_path):
    out = tmp_path / "out"
    outputs = _spawn(checkpoint, 2, "refusals", out)
    sparse_adam = "SparseAdam(lr={}, betas=(0.9, 0.999), eps=1e-08)"
    want = {  # what each case's refusal names, on every rank
        "mismatch": "table 0's optimizer steps: rank 0: 1; rank 1: 0",
        "lr": f"table 0's optimizer: rank 0: {sparse_adam.format(LR_TABLE)}; rank 1: {sparse_adam.format(2 * LR_TABLE)}",
        "class": f"table 0's optimizer: rank 0: Adagrad(lr={LR_TABLE}, lr_decay=0.0, weight_decay=0.0, "
        f"eps=1e-10); rank 1: {sparse_adam.format(LR_TABLE)}",
        "format": "table 0's base table format: rank 0: fp32; rank 1: fp8_row",
        "adapter": "table 0's trained rows' values: rank 0: digest ",
        "states": "table 0's optimizer states: rank 0: digest ",
    }
    for r, o in enumerate(outputs):
        lines = {line.split()[2]: line for line in o.splitlines() if line.startswith(f"rank {r} ")}
        assert list(lines) == list(REFUSALS), o
        for case, text in want.items():
            assert f"rank {r} {case} refused: RankMismatchError: " in lines[case] and text in lines[case], lines[case]
            assert f"this is rank {r}" in lines[case] and "load the same adapter or checkpoint" in lines[case]
        assert "table 1's" in lines["lr"] and "table 1's" in lines["format"]  # both tables named
        assert "base table header checksum: rank 0: " in lines["format"]
        assert "optimizer" not in lines["adapter"].split("(")[1].split(";")[0]  # only the rows differ
        assert lines["adapter"].count("trained rows' values") == 2 and "rank 1: digest " in lines["adapter"]
        assert "table 1's" not in lines["states"] and "trained rows' values" not in lines["states"]
        assert lines["agree"] == f"rank {r} agree not refused"
        fused = lines["fused"]
        assert "refused: UsageError" in fused and "fused=False" in fused and "2 data-parallel ranks" in fused
    agreed = [_trained(out / f"agree-rank{r}.safetensors") for r in range(2)]  # loaded midway, trained on alike
    assert agreed[0][1] == agreed[1][1] == {"0": 2, "1": 2}
    for i, want_rows in agreed[0][0].items():
        for a, b in zip(want_rows, agreed[1][0][i], strict=True):
            assert torch.equal(a, b), i


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trainer_launched_with_two_processes_keeps_one_table_equal_to_one_process(checkpoint, tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` (torchrun underneath; ``use_cpu=True``: gloo)
    of a script giving ``Trainer`` the combined optimizer, as a user writes it."""
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    if launcher is None:
        pytest.skip("accelerate's launcher is not installed")
    out = tmp_path / "out"
    out.mkdir()
    worker = ROOT / "tests" / "train" / "trainer_worker.py"
    argv = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    argv += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), MASTER_ADDR="127.0.0.1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run(
        [*argv, str(worker), str(checkpoint / "ckpt"), str(checkpoint / "tables"), str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "rank 0 of 2" in res.stdout and "rank 1 of 2" in res.stdout

    tables = [_trained(out / f"rank{r}.safetensors") for r in range(2)]
    saved = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert tables[1][1] == tables[0][1] == {str(i): trainer_worker.STEPS for i in tables[0][0]}
    for i, want in tables[0][0].items():
        for a, b in zip(want, tables[1][0][i], strict=True):
            assert torch.equal(a, b), i
    for n, w in saved[0]["weights"].items():
        assert torch.equal(w, saved[1]["weights"][n]), n
    assert not torch.equal(saved[0]["batches"][0], saved[1]["batches"][0])  # each rank its own batches

    # one process, each step the ranks' batches together
    from ple.integrations.transformers import from_pretrained

    model = from_pretrained(checkpoint / "ckpt", table_dir=checkpoint / "tables")
    model.train()
    opt = trainer_worker.optimizer(model)
    for step in range(trainer_worker.STEPS):
        ids = torch.cat([saved[r]["batches"][step] for r in range(2)])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    save_adapter(tmp_path / "one.safetensors", model, optimizer=opt.optimizers[0])
    ref, _ = _trained(tmp_path / "one.safetensors")
    for i, (ids, rows, s_ids, states) in ref.items():
        got = tables[0][0][i]
        assert ids.numel() > 50 and torch.equal(got[0], ids) and torch.equal(got[2], s_ids)
        torch.testing.assert_close(got[1], rows, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[3], states, rtol=1e-4, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(saved[0]["weights"][n], p.detach(), rtol=1e-3, atol=0.1 * LR_REST)


def test_the_data_parallel_setting_is_checked_and_kept_by_the_handles():
    from ple.errors import InvalidArgumentError
    from ple.train import trainable
    from ple.train.data_parallel import group_of
    from tests.train._helpers import make_tier, new_layer

    layer = new_layer(seed=3, table=make_tier("memory", "bf16", None, seed=4))
    for bad in ("yes", None, True, 2):
        with pytest.raises(InvalidArgumentError, match="data_parallel must be 'auto'"):
            trainable(layer, data_parallel=bad)
    (handle,) = trainable(layer, data_parallel=False)
    assert handle.ple_target.data_parallel is False and group_of(handle.ple_target) is None
    (again,) = trainable(layer)  # the same handle, the setting given again
    assert again is handle and handle.ple_target.data_parallel == "auto"
    assert group_of(handle.ple_target) is None  # no process group here: this process alone
