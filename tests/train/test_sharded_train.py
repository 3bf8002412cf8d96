"""A table sharded over 2 gloo ranks trains with each rank updating only its own rows.

- Replicated ids (every rank the same batches): the trained rows, and SparseAdam's states, are
  bit-identical to one process's, for SGD and SparseAdam.
- Per-rank ids (each rank its own batch, the sparse gradients all-gathered): each step, rank ``r``
  runs its batch and its loss ``L_r``, and the table's gradient applied is that of ``L_0 + L_1`` (the
  ranks' gradients summed, nothing averaged). The one process it is compared with runs the ranks'
  batches concatenated, with the loss ``L_0 + L_1`` (each rank's loss on its own rows of the output).
  Compared after every run (``STEPS`` steps): the trained row ids exactly, the step counts exactly,
  and, within fp32 rounding (the same terms summed in another grouping, GEMMs of other sizes), the
  trained rows for SGD and SparseAdam, and SparseAdam's two moments of every row.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ple.parallel import spawn_local
from ple.table import MmapTable
from ple.train import SGD, SparseAdam, read_adapter, save_adapter, trainable
from tests.train._helpers import new_layer, write_table_file
from tests.train.sharded_worker import RUNS, loss_of, rank_batch

ROOT = Path(__file__).resolve().parents[2]
RANKS = 2
STEPS = 6


def _one_process(path: Path, name: str) -> dict:
    ids_mode, cls, hp = RUNS[name]
    layer = new_layer(seed=9, table=MmapTable.open(path))
    for p in layer.parameters():
        p.requires_grad_(False)
    opt = cls(trainable(layer), **hp)
    per_rank = ids_mode == "per_rank"
    for step in range(STEPS):
        if per_rank:  # the ranks' batches as one, each rank's loss on its own rows of the output
            parts = [rank_batch(step, r, True) for r in range(RANKS)]
            out = layer.forward_padded(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
            loss = sum(loss_of(o, step, r) for r, o in enumerate(out.split(2)))
        else:
            hidden, tokens, _ = rank_batch(step, 0, False)
            loss = loss_of(layer.forward_padded(hidden, tokens), step, 0)
        loss.backward()
        opt.step()
    return layer, opt


def _rows(path: Path):
    file = read_adapter(path)
    ids, rows = zip(*file.chunks(0), strict=True)
    return torch.cat(ids), torch.cat(rows), file


def test_a_table_sharded_over_ranks_trains_each_rank_its_own_rows(tmp_path):
    table = write_table_file(tmp_path / "base.pletable", "fp8_row", seed=11)
    out = tmp_path / "out"
    out.mkdir()
    worker = [sys.executable, str(ROOT / "tests" / "train" / "sharded_worker.py"), str(table), str(out), str(STEPS)]
    res = spawn_local(worker, RANKS, deadline_s=240, grace_s=20, capture=True, env={"PYTHONPATH": str(ROOT / "src")})
    assert res.ok, res.outputs
    ranges = [line.split()[-1] for o in res.outputs for line in o.splitlines() if "etp-sgd" in line]
    assert len(set(ranges)) == RANKS  # the rows were split
    for name in RUNS:
        layer, opt = _one_process(table, name)
        want = save_adapter(tmp_path / f"{name}-one.safetensors", layer, optimizer=opt)
        ids_s, rows_s, file_s = _rows(out / f"{name}.safetensors")
        ids_1, rows_1, file_1 = _rows(want)
        assert torch.equal(ids_s, ids_1) and ids_s.numel() > 50, name
        if name.startswith("etp"):
            assert torch.equal(rows_s, rows_1), name  # the same gradient on every rank: the same bits
        else:
            torch.testing.assert_close(
                rows_s, rows_1, rtol=1e-4, atol=1e-5
            )  # sums grouped by rank, GEMMs of other sizes
        if "adam" in name:  # the optimizer's per-row states came back whole from the ranks
            s_ids, s_vals = file_s.optimizer_states(0)
            o_ids, o_vals = file_1.optimizer_states(0)
            assert torch.equal(s_ids, o_ids) and torch.equal(s_ids, ids_s), name
            if name.startswith("etp"):
                assert torch.equal(s_vals, o_vals)
            else:  # the moments: m [head_dim], then v [head_dim]
                d = s_vals.shape[1] // 2
                torch.testing.assert_close(s_vals[:, :d], o_vals[:, :d], rtol=1e-4, atol=1e-6)
                torch.testing.assert_close(s_vals[:, d:], o_vals[:, d:], rtol=1e-4, atol=1e-8)
            assert file_s.optimizer["steps"] == file_1.optimizer["steps"] == {"0": STEPS}
        assert isinstance(opt, SGD if "sgd" in name else SparseAdam)
