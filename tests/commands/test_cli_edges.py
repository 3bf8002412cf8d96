"""Command-line edges: options that cannot work are refused in one line before any work (``--ranks``
beyond the machine, ``--dist-timeout`` that is no timeout, a launcher's impossible ``WORLD_SIZE``, a
peer that never starts, ``--output`` into a missing folder), and the ``ple ids`` text report takes
time linear in the tokens."""

from __future__ import annotations

import contextlib
import io
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ple.commands.cli import main
from ple.commands.ids import hashed_windows
from ple.errors import InvalidArgumentError
from ple.ngram import reference
from ple.parallel import launch
from tests.conftest import hf_config

SRC = Path(__file__).resolve().parents[2] / "src"


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or k not in env:
            full.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "ple.commands.cli", *args], capture_output=True, text=True, env=full, timeout=timeout
    )


def _one_line_refusal(res: subprocess.CompletedProcess, *parts: str) -> None:
    assert res.returncode == 1, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    for p in parts:
        assert p in res.stderr, res.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- launching


def test_ranks_beyond_what_the_machine_runs_are_refused_before_any_spawn(monkeypatch):
    limit, why = launch.local_rank_limit()
    assert limit >= 1 and ("CPU" in why or "memory" in why)
    started = []
    with monkeypatch.context() as m:
        m.setattr(launch.subprocess, "Popen", lambda *a, **k: started.append(a))
        with pytest.raises(InvalidArgumentError, match=f"{limit + 1} local ranks: this machine runs at most {limit}"):
            launch.spawn_local([sys.executable, "-c", "pass"], limit + 1, deadline_s=10, grace_s=1)
    assert started == []
    res = _cli("demo", "--ranks", "10000", "--parallel", "sp")  # a fresh process: nothing mocked
    _one_line_refusal(res, "10000 local ranks: this machine runs at most")


def _main_refusal(capsys, args: list[str], *parts: str, status: int = 1) -> None:
    assert main(args) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    # exit 1: one line; exit 2 (a wrong command-line value): the command's usage, then one error line
    assert status == 2 or len(err.strip().splitlines()) == 1, err
    if status == 2:
        assert err.splitlines()[0].startswith("usage: ") and err.strip().splitlines()[-1].startswith("ple "), err
    for p in parts:
        assert p in err, err


@pytest.mark.parametrize("value", ["inf", "1e-9", "nan", "0", "-3", "1e99"])
def test_dist_timeouts_that_are_no_timeout_are_refused(value, capsys):
    args = ["demo", "--ranks", "2", "--parallel", "sp", "--dist-timeout", value]
    _main_refusal(capsys, args, "--dist-timeout must be between 0.01 and 604800 seconds", status=2)
    with pytest.raises(InvalidArgumentError, match="timeout_s must be between"):
        launch.check_timeout(float(value))


def test_check_timeout_takes_the_range():
    assert launch.check_timeout(0.01) == 0.01 and launch.check_timeout(60) == 60.0
    for bad in (True, "60", None):
        with pytest.raises(InvalidArgumentError, match="must be a number of seconds"):
            launch.check_timeout(bad)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "99999999999999999999", "RANK": "0"}, "WORLD_SIZE=99999999999999999999 must be between 1 and"),
        ({"WORLD_SIZE": "2", "RANK": "99999999999999999999"}, "RANK=99999999999999999999 must be between 0 and"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "4294967296"}, "LOCAL_RANK=4294967296 must be between 0 and"),
    ],
)
def test_a_launchers_impossible_numbers_are_one_line(env, message, monkeypatch, capsys):
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **env}.items():
        monkeypatch.setenv(k, v)
    _main_refusal(capsys, ["demo", "--parallel", "sp"], message)


def test_a_peer_that_never_starts_is_one_line():
    """Rank 0 of 2 alone: the rendezvous times out and says so, without a traceback."""
    port = _free_port()
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    t0 = time.monotonic()
    res = _cli("demo", "--parallel", "sp", "--dist-timeout", "1", env=env)
    _one_line_refusal(res, "rank 0 of 2: the process group at 127.0.0.1:", "did not form within 1 s")
    assert time.monotonic() - t0 < 100


# ---------------------------------------------------------------------------------------------- demo --output


@pytest.mark.parametrize("where", ["missing/out.json", "file/out.json", "."])
def test_demo_output_that_cannot_be_written_is_refused_before_work(tmp_path, monkeypatch, capsys, where):
    import ple.commands.demo as demo

    (tmp_path / "file").write_text("x")
    called = []
    monkeypatch.setattr(demo, "run_serving", lambda *a, **k: called.append(1))
    monkeypatch.setattr(demo.parallel, "run", lambda *a, **k: called.append(2))
    out = tmp_path / where
    for extra in ([], ["--ranks", "2", "--parallel", "sp"]):
        assert main(["demo", "--only", "serving", "--output", str(out), *extra]) == 1
        err = capsys.readouterr().err
        assert f"--output {out}" in err and len(err.strip().splitlines()) == 1, err
    assert called == []


# ---------------------------------------------------------------------------------------------- ple ids


@pytest.mark.parametrize("seed", range(4))
def test_ids_windows_equal_the_reference(seed):
    rng = random.Random(seed)
    eos, n = 7, rng.choice([2, 3, 5])
    toks = [eos if rng.random() < 0.25 else rng.randrange(20) for _ in range(rng.randrange(1, 60))]
    assert list(hashed_windows(toks, n, eos)) == reference.ngram_tokens(toks, n, eos)


@pytest.fixture(scope="module")
def published_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("ids")
    hf = hf_config(vocab_size=248320, eos_token_id=248044, ple_layer_ids=[2, 3], num_hidden_layers=3, heads_per_ngram=3)
    hf.to_json_file(str(root / "config.json"), use_diff=False)
    return root


def _ids(root: Path, tokens: list[int], *extra: str) -> tuple[float, str]:
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        assert main(["ids", str(root), "--tokens", ",".join(map(str, tokens)), *extra]) == 0
    return time.perf_counter() - t0, buf.getvalue()


def test_ids_text_report_does_not_rescan_the_history(published_vocab, monkeypatch):
    """The text report equals what the reference windows give, and never calls the quadratic
    reference (each token's window from the start of the stream)."""
    rng = random.Random(1)
    toks = [248044 if rng.random() < 0.1 else rng.randrange(248320) for _ in range(300)]
    want_windows = reference.ngram_tokens(toks, 3, 248044)
    monkeypatch.setattr(reference, "ngram_tokens", lambda *a: pytest.fail("quadratic reference called"))
    _, text = _ids(published_vocab, toks)
    lines = text.splitlines()
    assert len(lines) == 3 * len(toks)
    for t in range(len(toks)):
        assert lines[3 * t] == f"token {t}: {toks[t]}"
        assert lines[3 * t + 2].startswith(f"  3-gram {list(reversed(want_windows[t]))}: h3:")


@pytest.mark.perf
def test_ids_text_report_of_24000_tokens_costs_about_what_json_costs(published_vocab):
    rng = random.Random(2)
    toks = [248044 if rng.random() < 0.05 else rng.randrange(248320) for _ in range(24_000)]
    text_s = min(_ids(published_vocab, toks)[0] for _ in range(2))
    json_s = min(_ids(published_vocab, toks, "--json")[0] for _ in range(2))
    assert text_s < 6 * json_s + 0.5, (text_s, json_s)  # the quadratic report took 45x


def test_a_spawned_rank_whose_peer_never_starts_says_so_in_one_line(tmp_path):
    """Rank 1 exits before joining; rank 0, spawned as ``ple demo --ranks`` spawns ranks, ends in one
    line naming the rendezvous, not a traceback."""
    import dataclasses
    import json

    from ple.commands.demo.parallel import Options

    spec = tmp_path / "options.json"
    spec.write_text(json.dumps(dataclasses.asdict(Options(mode="sp", ranks=2, timeout_s=1.0, workdir=str(tmp_path)))))
    code = (
        "import os, sys\n"
        "if os.environ['RANK'] == '1': sys.exit(0)\n"
        "from ple.commands.demo.parallel import rank_main\n"
        "sys.exit(rank_main(sys.argv[1:]))\n"
    )
    env = {"PYTHONPATH": str(SRC)}
    res = launch.spawn_local(
        [sys.executable, "-c", code, str(spec)], 2, deadline_s=120, grace_s=60, env=env, capture=True
    )
    assert res.returncodes == [1, 0], res.outputs
    lines = [x for x in res.outputs[0].splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.outputs[0], res.outputs[0]
    assert lines[0].startswith("ple demo: rank 0: rank 0 of 2: the process group at 127.0.0.1:"), lines[0]
    assert "did not form within 1 s" in lines[0]
