"""Faults injected into training, each ending in a ple error or an ``OSError`` naming the path, with
nothing lost or wrong: the base table byte for byte as it was, the last good adapter whole, the
trained rows and optimizer states as before the failed call (and training goes on from them to the
bits of a run that never failed).

- spill files on a full disk (a small tmpfs, or a file size limit: ``RLIMIT_FSIZE``), in a child
  process: a write through the map of a file without its space killed the process (``SIGBUS``);
- ``fork()`` of a model whose rows and states spilled: the spill file was shared, so a child's steps
  changed the parent's rows (and the parent's the child's); each process now trains its own copy;
- a save that fails on a full disk left the overlay's lock held: later lookups from other threads
  blocked for good;
- saving an adapter over the base table file (through any name), or over a file that is no adapter.

Disks are small tmpfs mounts where the test may mount one (root); else those cases are skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import resource
import select
import subprocess
import threading
import time
import traceback
import uuid
from pathlib import Path

import pytest
import torch

from ple.errors import InvalidArgumentError
from ple.table import MmapTable
from ple.table.tiers.rowstore import SpillFileError
from ple.train import SparseAdam, read_adapter, save_adapter, trainable
from tests.table._helpers import FORK_DEADLINE_S, run_forked
from tests.train._helpers import batch, new_layer, write_table_file

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")

ROWS_BUDGET = 300  # rows (and their states) in memory: the first 3 steps fit, the 4th spills
MiB = 1 << 20


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _tmpfs(folder: Path, size: str):
    """A tmpfs of ``size`` mounted at ``folder`` for the block (the test is skipped where that fails)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(folder: Path, leave: int) -> Path:
    """A file filling ``folder``'s file system up to ``leave`` bytes free."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    filler = folder / "filler"
    with open(filler, "wb") as f:
        f.write(b"\1" * max(0, free - leave))
    return filler


def _model(table_path: Path, spill_dir, budget: int = ROWS_BUDGET):
    layer = new_layer(seed=1, table=MmapTable.open(table_path))
    layer.requires_grad_(False)
    record = layer.table.head_dim * 4
    kw = {} if spill_dir is None else {"spill_dir": spill_dir}
    handles = trainable(layer, memory_budget=budget * record, **kw)
    opt = SparseAdam(handles, lr=0.05, memory_budget=budget * 2 * record, **kw)
    return layer, handles, opt


def _backward(layer, i: int) -> None:
    hidden, ids, _ = batch(seed=300 + i)
    out = layer.forward_padded(hidden, ids)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(i))).sum().backward()


def _snapshot(layer, handle, opt):
    overlay = layer.table.overlay
    ids = overlay.ids()
    rs = opt.row_state(handle)
    states = rs.export() if rs is not None else None
    return ids, overlay.get(ids)[1], states, opt.state[handle].get("step")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _train(table_path, spill_dir, steps, before_step=None, remedy=None):
    """Train ``steps`` steps; ``before_step(i)`` may fill the disk. A step that raises
    :class:`SpillFileError` is checked (nothing changed), ``remedy()`` makes room, and the step is
    done again. Returns (the final snapshot, the errors' messages)."""
    layer, handles, opt = _model(table_path, spill_dir)
    errors = []
    for i in range(steps):
        if before_step is not None:
            before_step(i)
        _backward(layer, i)
        before = _snapshot(layer, handles[0], opt)
        try:
            opt.step()
        except SpillFileError as e:
            assert isinstance(e, OSError) and e.errno is not None and e.filename == str(spill_dir)
            after = _snapshot(layer, handles[0], opt)
            errors.append((str(e), _same(before, after)))
            assert handles[0].grad is not None  # the gradient of the table not updated is kept
            remedy()
            opt.step()  # the same gradient again, without a second backward
            assert handles[0].grad is None
    assert layer.table.overlay.spilled_rows > 0 and opt.state_nbytes()[1] > 0
    return _snapshot(layer, handles[0], opt), errors


@pytest.mark.parametrize("limit", ["tmpfs", "rlimit"])
def test_spilling_to_a_full_disk_raises_and_training_goes_on_to_the_same_bits(tmp_path, limit):
    """The 4th step spills (2 MiB of row file, then 4 MiB of state file) on a disk that has no room
    left (tmpfs), or under a file size limit with room for the row file only (rlimit). The step raises
    SpillFileError naming the folder, rows and states are as before it; once there is room the same
    step runs and the run ends with the bits of one that had room."""
    table = write_table_file(tmp_path / "t.pletable", "fp8", seed=3)
    digest = _sha(table)
    disk = tmp_path / "disk"
    room = tmp_path / "room"
    room.mkdir()
    with _tmpfs(disk, "8m") if limit == "tmpfs" else contextlib.nullcontext(disk.mkdir()):

        def body():
            want, _ = _train(table, room, 8)
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            if limit == "tmpfs":
                filler = []

                def fill(i):
                    if i == 3:
                        filler.append(_fill(disk, 0))

                def remedy():
                    filler.pop().unlink()

            else:

                def fill(i):
                    if i == 3:
                        resource.setrlimit(resource.RLIMIT_FSIZE, (3 * MiB, hard))

                def remedy():
                    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

            got, errors = _train(table, disk, 8, fill, remedy)
            return want, got, errors

        want, got, errors = run_forked(body, tmp_path / "out.pkl")
    assert len(errors) == 1, errors
    message, unchanged = errors[0]
    assert unchanged  # rows, states and the step count as before the failed step
    assert str(disk) in message and ("trained rows" if limit == "tmpfs" else "optimizer states") in message
    assert "spill_dir=" in message and "memory_budget=" in message
    assert _same(want, got)
    assert _sha(table) == digest


def test_a_disk_filled_by_the_table_itself_refuses_the_default_spill_folder(tmp_path):
    """No spill_dir: rows spill beside the table file, on a disk the table fills."""
    disk = tmp_path / "disk"
    with _tmpfs(disk, "1m"):
        table = write_table_file(disk / "t.pletable", "fp8", seed=3)
        digest = _sha(table)
        filler = _fill(disk, 0)  # the table's disk is full

        def body():
            layer, handles, opt = _model(table, None)
            for i in range(3):
                _backward(layer, i)
                opt.step()
            _backward(layer, 3)
            before = _snapshot(layer, handles[0], opt)
            try:
                opt.step()
            except SpillFileError as e:
                return str(e), _same(before, _snapshot(layer, handles[0], opt))
            return "no error", False

        message, unchanged = run_forked(body, tmp_path / "out.pkl")
        assert str(disk) in message and "trained rows" in message and unchanged
        filler.unlink()
        assert _sha(table) == digest and sorted(p.name for p in disk.iterdir()) == ["t.pletable"]


# ---------------------------------------------------------------------------------------------- fork
def _fork(body, out_path: Path, go: int | None = None) -> int:
    """Fork a child that (after a byte on ``go``, when given) runs ``body()`` and pickles its result."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            torch.set_num_threads(1)
            if go is not None:
                ready, _, _ = select.select([go], [], [], FORK_DEADLINE_S)
                assert ready and os.read(go, 1) == b"g", "the parent never said go"
            result = ("ok", body())
        except BaseException:  # noqa: BLE001 - reported to the parent
            result = ("err", traceback.format_exc())
            code = 1
        try:
            with open(out_path, "wb") as f:
                pickle.dump(result, f)
        finally:
            os._exit(code)
    return pid


def _collect(pid: int, out_path: Path):
    end = time.monotonic() + FORK_DEADLINE_S
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > end:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish in time (hung)")
        time.sleep(0.02)
    with open(out_path, "rb") as f:
        status, value = pickle.load(f)
    if status != "ok":
        pytest.fail(f"the forked child failed:\n{value}")
    return value


def test_a_forked_child_trains_its_own_copy_of_the_spilled_rows_and_states(tmp_path):
    """Rows and states spilled before a fork: the child's steps leave the parent's as they were, the
    parent's steps leave the child's as they were at the fork, and both train from the fork's
    state to the same bits."""
    table = write_table_file(tmp_path / "t.pletable", "fp8", seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the parent's steps are compared with a child's (one thread)
    try:
        layer, handles, opt = _model(table, tmp_path, budget=40)  # rows come and go through the files
        for i in range(5):
            _backward(layer, i)
            opt.step()
        assert layer.table.overlay.spilled_rows > 0 and opt.state_nbytes()[1] > 0
        at_fork = _snapshot(layer, handles[0], opt)

        def more_steps():
            for i in range(5, 10):
                _backward(layer, i)
                opt.step()
            return _snapshot(layer, handles[0], opt)

        # the child trains; the parent's rows and states stay
        child = _collect(_fork(more_steps, tmp_path / "a.pkl"), tmp_path / "a.pkl")
        assert _same(_snapshot(layer, handles[0], opt), at_fork)
        assert not _same(child, at_fork)

        # the parent trains while a child waits; the child then reads the rows of the fork
        r, w = os.pipe()
        try:
            pid = _fork(lambda: _snapshot(layer, handles[0], opt), tmp_path / "b.pkl", go=r)
            parent = more_steps()
            os.write(w, b"g")
            seen = _collect(pid, tmp_path / "b.pkl")
        finally:
            os.close(r)
            os.close(w)
        assert _same(seen, at_fork)
        assert _same(parent, child)  # the same three steps from the same state, in two processes
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ple-spill")] == []
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------- saving
def test_a_save_that_fails_on_a_full_disk_leaves_no_lock_and_the_last_adapter_whole(tmp_path):
    """The second save runs out of room while writing the rows: an OSError naming the file; the file
    saved before is whole, nothing else is left, and a lookup from another thread finishes."""
    table = write_table_file(tmp_path / "t.pletable", "fp8", seed=3)
    digest = _sha(table)
    disk = tmp_path / "disk"
    with _tmpfs(disk, "64k"):
        layer = new_layer(seed=1, table=MmapTable.open(table))
        layer.requires_grad_(False)
        opt = SparseAdam(trainable(layer), lr=0.05)
        _backward(layer, 0)
        opt.step()
        path = disk / "a.safetensors"
        save_adapter(path, layer)
        good = _sha(path)
        for i in range(1, 8):
            _backward(layer, i)
            opt.step()
        assert len(layer.table.overlay) * layer.table.head_dim * 4 > 64 << 10  # more rows than room

        failures: list[BaseException] = []  # kept alive, with their tracebacks
        failed, looked = threading.Event(), threading.Event()

        def save():  # fails, then lives on (a thread ending could hand its id to the reader below)
            try:
                save_adapter(path, layer)
            except OSError as e:
                failures.append(e)
            failed.set()
            looked.wait(FORK_DEADLINE_S)

        saver = threading.Thread(target=save, daemon=True)
        saver.start()
        assert failed.wait(FORK_DEADLINE_S) and len(failures) == 1

        ids = torch.arange(layer.table.rows).view(-1, 1)
        got: list[torch.Tensor] = []
        reader = threading.Thread(target=lambda: got.append(layer.table.lookup(ids, torch.float32)), daemon=True)
        reader.start()
        reader.join(timeout=FORK_DEADLINE_S)
        looked.set()
        saver.join()
        assert got, "a lookup from another thread blocked on the overlay's lock after the failed save"
        assert failures[0].filename == str(path) and str(path) in str(failures[0])
        assert _sha(path) == good and read_adapter(path).layers[0].trained_rows > 0
        assert sorted(p.name for p in disk.iterdir()) == ["a.safetensors"]
    assert _sha(table) == digest


def test_an_adapter_is_never_saved_over_a_table_file_or_a_file_that_is_not_an_adapter(tmp_path):
    table = write_table_file(tmp_path / "t.pletable", "fp8", seed=3)
    other = write_table_file(tmp_path / "other.pletable", "fp8", seed=4)
    digests = {p: _sha(p) for p in (table, other)}
    layer = new_layer(seed=1, table=MmapTable.open(table))
    layer.requires_grad_(False)
    opt = SparseAdam(trainable(layer), lr=0.05)
    _backward(layer, 0)
    opt.step()
    link = tmp_path / "link.safetensors"
    link.symlink_to(table)
    hard = tmp_path / "hard.safetensors"
    os.link(table, hard)
    for target in (table, link, hard):
        with pytest.raises(InvalidArgumentError, match="table file .*t.pletable.* PLE layer 0 serves"):
            save_adapter(target, layer)
    notes = tmp_path / "notes.txt"
    notes.write_text("not an adapter")
    for target in (other, notes):
        with pytest.raises(InvalidArgumentError, match=f"{target.name} exists and is not a ple table adapter"):
            save_adapter(target, layer)
    assert notes.read_text() == "not an adapter" and link.is_symlink()
    assert all(_sha(p) == d for p, d in digests.items())
    # an adapter is replaced by the next save, as before
    path = save_adapter(tmp_path / f"{uuid.uuid4().hex}.safetensors", layer)
    _backward(layer, 1)
    opt.step()
    save_adapter(path, layer)
    assert read_adapter(path).layers[0].trained_rows == len(layer.table.overlay)
