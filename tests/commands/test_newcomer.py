"""A newcomer's path through the README and the ``ple`` command: sizes with their unit in every
command, one ``--workdir`` rule, messages that say what is accepted and what to do, the README's
claims (set-up, commands, return values, versions, units) true, and no leftovers in the checkout."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from ple.commands.cli import build_parser, main
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig
from tests.conftest import SMALL

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


# ---------------------------------------------------------------------------------------------- sizes
def test_a_size_is_read_with_its_unit():
    from ple.common.argtypes import byte_size, shown_size

    assert [byte_size(t) for t in ("64MiB", "1GiB", "512MB", "1.5KiB", "65536B", "64kib", "0")] == [
        64 << 20,
        1 << 30,
        512_000_000,
        1536,
        65536,
        64 << 10,
        0,
    ]
    for bad, says in [
        ("64", "'64' has no unit: give a size with its unit, e.g. 64MiB, 64KiB or 64B"),
        ("64M", "unknown unit 'M'"),
        ("-1MiB", "is not a size"),
        ("0.3B", "is not a whole number of bytes"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
            byte_size(bad)
    assert [shown_size(n) for n in (64 << 20, 1536, 65536, 7)] == ["64MiB", "1536B", "64KiB", "7B"]


@pytest.mark.parametrize("command", ["demo", "bench", "train", "eval"])
def test_every_command_takes_the_memory_budget_with_its_unit(command, capsys):
    """``64`` was 64 MB to ``ple demo`` and ``ple bench`` and 64 bytes to ``ple train``."""
    rest = ["CHECKPOINT", "--tokens", "t.npy"] if command == "eval" else []
    args = build_parser().parse_args([command, *rest, "--memory-budget", "64KiB"])
    assert args.memory_budget == 64 << 10
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, *rest, "--memory-budget", "64"])
    assert e.value.code == 2 and "'64' has no unit" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- --workdir
def test_ple_demo_refuses_any_non_empty_workdir_before_anything_runs(tmp_path, capsys):
    config = tmp_path / "config.json"
    cfg = PLEConfig(**SMALL)
    config.write_text(
        json.dumps({"model_type": "qwen4_exp", "text_config": {**cfg.to_dict(), "model_type": "qwen4_exp_text"}})
    )
    work = tmp_path / "w"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    argv = ["demo", "--config", str(config), "--synthetic-tokens", "--requests", "2", "--slots", "2"]
    for extra in ([], ["--ranks", "2", "--parallel", "sp"]):
        assert main([*argv, *extra, "--workdir", str(work), "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"ple demo: --workdir {work} is not empty (it holds notes.txt)")
        assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]  # nothing ran


# ---------------------------------------------------------------------------------------------- messages
@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("model")
    synthesize_checkpoint(PLEConfig(**SMALL), root, seed=1, files=2)
    return root


def test_a_file_that_is_not_a_model_is_named_with_what_is_accepted(capsys):
    assert main(["inspect", str(README)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ple inspect: {README} is not a model file: expected a config.json, a model folder")
    assert err.rstrip().endswith("or a GGUF file or a .pletable table file")


@pytest.mark.parametrize("command", ["inspect", "ids", "stats", "convert", "verify"])
def test_a_missing_path_is_spelled_one_way(command, tmp_path, capsys):
    missing = tmp_path / "absent"
    extra = {"ids": ["--tokens", "3"], "stats": ["--real-text", "10"], "convert": [str(tmp_path / "out")]}
    assert main([command, str(missing), *extra.get(command, [])]) == 1
    assert capsys.readouterr().err == f"ple {command}: No such file or directory: {missing}\n"


def test_convert_says_when_it_cannot_create_its_output_folder(small_model, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "tables"  # a folder cannot be made inside a file
    assert main(["convert", str(small_model), str(out)]) == 1
    err = capsys.readouterr().err
    assert err == f"ple convert: cannot create the output folder {out}: Not a directory\n"


def test_stats_reads_real_text_into_a_small_vocabulary_as_every_command_does(small_model, capsys):
    """A model of 500 ids gets the real text through the vocabulary map (ple.data.tokens), as ple
    eval and ple train give it, not a refusal."""
    assert main(["stats", str(small_model), "--real-text", "2000", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tokens"] == 2000 and doc["total"]["distinct_rows"] > 0


@pytest.mark.parametrize(("command", "extra"), [("demo", "demo"), ("train", "train")])
def test_without_transformers_the_extra_that_makes_the_command_work_is_named(command, extra, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    argv = ["demo", "--quick", "--only", "model"] if command == "demo" else ["train", "--steps", "1"]
    assert main(argv) == 1
    assert f"pip install 'ple[{extra}]'" in capsys.readouterr().err


def test_train_help_gives_its_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    text = text[text.index("options:") :]
    for option, default in [("--size", "(quick)"), ("--tier", "(mmap)"), ("--optimizer", "(sparse_adam)")]:
        help_of = text[text.index(option + " {") :]
        assert default in help_of[: help_of.index(" --", 3)], option


def test_inspect_gives_sizes_in_the_readmes_units(capsys):
    assert main(["inspect", str(ROOT / "examples" / "published-config.json")]) == 0
    size = next(s for s in capsys.readouterr().out.splitlines() if s.strip().startswith("size"))
    assert "fp8 47.7 GiB" in size and "q4_0 26.8 GiB" in size and " GB" not in size
    assert "| fp8 (one global scale) | 160 B | 47.7 GiB |" in README.read_text()


# ---------------------------------------------------------------------------------------------- README
def _bash_lines() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_runs_ple_the_way_its_set_up_says():
    """The quick start activates the environment before the first bare ``ple``, and every command
    of the README is then the same bare ``ple``."""
    lines = _bash_lines()
    activate = lines.index(". .venv/bin/activate  # python and ple are the environment's from here on")
    first_ple = next(i for i, s in enumerate(lines) if s.startswith("ple "))
    assert activate < first_ple
    assert not [s for s in lines if ".venv/bin/ple" in s or ".venv/bin/python" in s]


def test_the_readme_says_what_the_code_does():
    text = README.read_text()
    pinned = re.search(r"^transformers==(\d+\.\d+)", (ROOT / "constraints-cpu.txt").read_text(), flags=re.M)
    assert pinned is not None
    assert f"transformers itself ({pinned.group(1)}, as `constraints-cpu.txt`" in text
    assert not re.search(r"transformers 5\.\d+ itself", text)
    # session.step returns one tensor per request (tests/test_readme.py runs the snippet)
    assert '-> {"a": [n, HC*H]}' in text and "tokens [n] -> [n, HC*H]" not in text
    row = next(s for s in text.splitlines() if s.startswith("| `ple train [--steps N]"))
    for option in ("--workdir", "--table-format", "--memory-budget SIZE", "--size"):
        assert option in row, option
    assert "--memory-budget MB" not in text and "--memory-budget 65536" not in text


def test_what_the_readmes_commands_write_is_ignored_by_git():
    import subprocess

    names = ["demo/model/published/config.json", "train-demo/adapter.safetensors", "merged.pletable"]
    names.append("adapter.safetensors")
    res = subprocess.run(["git", "check-ignore", *names], cwd=ROOT, capture_output=True, text=True)
    assert res.stdout.split() == names


def test_the_architecture_map_stays_short():
    assert len((ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines()) <= 200


def test_serving_ple_converts_output_leaves_no_lock_of_a_file_never_made(tmp_path, monkeypatch):
    """The README's 4-bit route: ``from_pretrained(table_format="q4_0", table_dir=...)`` serves the
    files ``ple convert --to q4_0`` wrote, and leaves beside them their locks only (none of a
    ``.q4_0.pletable`` it never makes)."""
    from ple.integrations.transformers import from_pretrained
    from tests.integrations.helpers import tiny_config, tiny_model

    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    ckpt, out = tmp_path / "model", tmp_path / "q4"
    tiny_model(tiny_config(split_ngram_parts=3, ple_embed_dim=128), seed=41).save_pretrained(ckpt)
    assert main(["convert", str(ckpt), str(out), "--to", "q4_0"]) == 0
    from_pretrained(ckpt, table_dir=out, table_format="q4_0")
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".lock")) == [
        "model.layers.0.ple.pletable.lock",
        "model.layers.1.ple.pletable.lock",
    ]
