"""One convention for every ``ple`` subcommand: ``--version``, ``--json`` (one JSON document on stdout,
nothing else there), exit statuses, one line on stderr for a refused input, a quiet end when the
reader of stdout goes away, and no progress bars when stderr is not a terminal."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ple
from ple.commands import cli
from ple.commands.cli import EXIT_PIPE, EXIT_PROBLEM, EXIT_USAGE, main
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = dict(
    hidden_size=16,
    hc_count=2,
    ple_layer_ids=(2,),
    ple_embed_dim=16,
    ngram_size=3,
    heads_per_ngram=2,
    vocab_size=300,
    ngram_vocab_size_base=300,
    make_ngram_vocab_size_divisible_by=16,
    split_ngram_parts=3,
    eos_token_id=2,
)


def _ple(*args: str, stdin=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real entry point in a child process (what the console script runs)."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, "-m", "ple.commands.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        stdin=stdin,
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("model")
    synthesize_checkpoint(PLEConfig(**TINY), root, seed=1, files=2)
    return root


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"ple {ple.__version__}\n"


def test_version_imports_no_torch():
    """``ple --version`` answers without importing torch (seconds on a cold start)."""
    code = "import sys; from ple.commands.cli import main; main(['--version']); print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"ple {ple.__version__}\n[]\n"


def test_every_command_is_declared_one_way():
    """The parser is the registry's: each command module (or package) gives its one-line HELP (help and
    description), add_arguments and run, and ``ple --help`` lists the commands in the registry's order."""
    import importlib

    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert list(sub.choices) == [name for name, _ in cli.COMMANDS]
    for name, path in cli.COMMANDS:
        module = importlib.import_module(path)
        assert isinstance(module.HELP, str) and "\n" not in module.HELP, name
        parser = sub.choices[name]
        assert parser.description.split("\n")[0] == module.HELP, name
        assert parser.get_default("fn") is module.run and callable(module.add_arguments), name


def test_json_is_one_document_on_stdout_for_every_subcommand(model, tmp_path, capsys):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("5 6 7 2 9 9 9")
    runs = {
        "inspect": ["inspect", str(model), "--json"],
        "ids": ["ids", str(model), "--tokens", "5,6,7", "--json"],
        "convert": ["convert", str(model), str(tmp_path / "tables"), "--json"],
        "stats": ["stats", str(model), "--tokens", str(tokens), "--json"],
        "bench --list": ["bench", "--list", "--json"],
    }
    docs = {}
    for name, argv in runs.items():
        assert main(argv) == 0, name
        out, _ = capsys.readouterr()
        docs[name] = json.loads(out)  # the whole of stdout is one JSON document
    (table,) = (tmp_path / "tables").glob("*.pletable")
    assert main(["verify", str(table), "--checkpoint", str(model), "--json"]) == 0
    docs["verify"] = json.loads(capsys.readouterr().out)
    assert docs["verify"] == {"file": str(table), "ok": True, "problems": []}
    assert docs["convert"]["layers"][0]["path"] == str(table)
    assert len(docs["ids"]["ids"]) == 3 and docs["stats"]["tokens"] == 7
    assert [d["ple_layer_index"] for d in docs["inspect"]["layers"]] == [0]
    assert "decode-fp32" in [c["name"] for c in docs["bench --list"]["cases"]]


def test_a_refused_input_is_one_line_and_exit_1(tmp_path):
    proc = _ple("inspect", str(tmp_path / "absent"))
    assert proc.returncode == EXIT_PROBLEM
    assert proc.stdout == "" and proc.stderr == f"ple inspect: No such file or directory: {tmp_path / 'absent'}\n"
    assert "Traceback" not in proc.stderr


def test_a_wrong_command_line_is_exit_2():
    proc = _ple("ids")
    assert proc.returncode == EXIT_USAGE and "usage: ple ids" in proc.stderr
    proc = _ple("demo", "--requests", "0")
    assert proc.returncode == EXIT_USAGE and "argument --requests: 0 is out of range" in proc.stderr


def test_an_unknown_option_shows_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["inspect", "examples/published-config.json", "--jsn"])
    assert e.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: ple inspect ") and err.endswith("ple inspect: error: unrecognized arguments: --jsn\n")


def test_verify_of_a_missing_file_is_one_line(tmp_path, capsys):
    """As for every other command: one line on stderr, nothing on stdout, exit 1."""
    missing = tmp_path / "absent.pletable"
    assert main(["verify", str(missing)]) == EXIT_PROBLEM
    assert capsys.readouterr() == ("", f"ple verify: No such file or directory: {missing}\n")
    assert main(["verify", str(missing), "--json"]) == EXIT_PROBLEM
    assert capsys.readouterr() == ("", f"ple verify: No such file or directory: {missing}\n")


def test_negative_and_empty_tokens_are_refused_by_name(model, capsys):
    assert main(["ids", str(model), "--tokens", "-5,3"]) == EXIT_USAGE
    assert capsys.readouterr().err.endswith("\nple ids: error: --tokens: entry 0 is -5; token ids are >= 0\n")
    assert main(["ids", str(model), "--tokens", " , "]) == EXIT_USAGE
    assert "no token ids" in capsys.readouterr().err
    assert main(["ids", str(model), "--tokens", "1 2 3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [1, 2, 3]


def test_closed_stdout_ends_quietly(model):
    """``ple ids ... | head -1``: the reader leaves early; no traceback, exit 141."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    tokens = ",".join(str(5 + i % 200) for i in range(3000))  # far more text than a pipe buffer holds
    child = subprocess.Popen(
        [sys.executable, "-m", "ple.commands.cli", "ids", str(model), "--tokens", tokens],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert child.stdout is not None and child.stderr is not None
    with child.stderr:
        assert child.stdout.readline().startswith(b"token 0: ")
        child.stdout.close()
        err = child.stderr.read().decode()
    assert child.wait(timeout=120) == EXIT_PIPE
    assert err == ""


def test_no_progress_bars_without_a_terminal(model, tmp_path):
    proc = _ple("convert", str(model), str(tmp_path / "tables"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # tqdm writes to stderr; with no terminal there is none
    assert "wrote" in proc.stdout


def test_the_readme_table_lists_every_exit_status():
    """The README's table of exit statuses and the statuses ``ple`` returns are the same list, in order."""
    readme = (SRC.parent / "README.md").read_text()
    table = readme.split("Exit status, the same for every command:", 1)[1].split("\n\n", 2)[1]
    listed = [int(m) for m in re.findall(r"^\| (\d+) \|", table, flags=re.M)]
    assert listed == sorted({getattr(cli, n) for n in cli.__all__ if n.startswith("EXIT_")})


def test_bare_ple_lists_every_command(capsys):
    """``ple`` alone: the usage with every command and its one line on stderr, exit 2 (a wrong command line)."""
    from ple.commands.cli import COMMANDS

    assert main([]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    text = " ".join(captured.err.split())
    for name, module in COMMANDS:
        start = " ".join(importlib.import_module(module).HELP.split()[:4])
        assert f"{name} {start}" in text, name
