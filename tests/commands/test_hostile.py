"""Hostile inputs through the ``ple`` command: every user or environment error ends in one line on
stderr and a documented exit status (1 bad input, 2 wrong command line, 130 interrupted), never in
a traceback, a hang, a wrong table or a file left behind."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ple.commands.cli import main
from ple.table import MmapTable
from tests.checkpoint.test_checkpoint import (
    P0,
    SCALE,
    _shard,
    _to_format,
    published_tensors,
    tiny_model,
    write_checkpoint,
)
from tests.commands.test_cli import model_dir

SRC = Path(__file__).resolve().parents[2] / "src"


@contextlib.contextmanager
def watchdog(seconds: int = 30):
    """Fail (instead of hanging the suite) if the block blocks: SIGALRM interrupts a blocked syscall."""

    def fire(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run(capsys, *argv) -> tuple[int, str, str]:
    with watchdog():
        code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code: int, err: str, command: str, *parts: str) -> None:
    """Exit 2: the command's usage, then ``ple <command>: error: ...`` containing every part."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert lines[0].startswith(f"usage: ple {command} ") and lines[-1].startswith(f"ple {command}: error: "), err
    assert all(line.startswith(" ") for line in lines[1:-1]), err  # the usage's continuation lines
    for p in parts:
        assert p in lines[-1], (p, err)


def assert_one_line(code: int, err: str, command: str, *parts: str) -> None:
    """Exit 1 and exactly one line on stderr, ``ple <command>: ...`` containing every part."""
    assert code == 1, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ple {command}: "), err
    for part in parts:
        assert part in lines[0], (part, lines[0])


# ---------------------------------------------------------------------------------------------- configs

_BASE = dict(hidden_size=24, hc_count=2, eos_token_id=7, vocab_size=300, ple_layer_ids=[1], heads_per_ngram=2)

CONFIGS = {
    "string_field": ({"hidden_size": "24"}, "hidden_size='24': an integer >= 1"),
    "float_field": ({"hc_count": 2.0}, "hc_count=2.0: an integer >= 1"),
    "bool_field": ({"hc_count": True}, "hc_count=True: an integer >= 1"),
    "int64_overflow": ({"hidden_size": 2**70}, "hidden_size=1180591620717411303424: at most 1048576"),
    "many_parts": ({"split_ngram_parts": 10**12}, "split_ngram_parts=1000000000000: at most 1048576"),
    "many_heads": ({"heads_per_ngram": 10**6}, "heads_per_ngram=1000000: at most 1024"),
    "ngram_65": ({"ngram_size": 65}, "ngram_size=65: at most 64 (the C kernels hash n-grams of 2..64 tokens)"),
    "heads_product": ({"ngram_size": 64, "heads_per_ngram": 17}, "1071 heads, at most 1024"),
    "huge_base": ({"ngram_vocab_size_base": 2**63}, "ngram_vocab_size_base=9223372036854775808: at most"),
    "huge_vocab": ({"vocab_size": 2**40}, "vocab_size=1099511627776: at most 2147483647"),
    "negative_seed": ({"seed": -1}, "seed=-1: an integer >= 0"),
    "seed_64_bits": ({"seed": 2**64}, "seed=18446744073709551616: at most"),
    "nan_eps": ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan: a positive finite number"),
    "inf_eps": ({"rms_norm_eps": float("inf")}, "rms_norm_eps=inf: a positive finite number"),
    "eps_string": ({"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6'"),
    "eos_empty": ({"eos_token_id": []}, "eos_token_id=[]"),
    "eos_strings": ({"eos_token_id": ["a"]}, "eos_token_id=['a']: integer token ids"),
    "eos_huge": ({"eos_token_id": 10**30}, "eos_token_id=1000000000000000000000000000000"),
    "layer_ids_int": ({"ple_layer_ids": 5}, "ple_layer_ids=5: a list"),
    "layer_ids_str": ({"ple_layer_ids": "12"}, "ple_layer_ids='12': a list"),
    "layer_ids_zero": ({"ple_layer_ids": [0]}, "ple_layer_ids=[0]: one-indexed"),
    "layer_ids_bool": ({"ple_layer_ids": [True]}, "ple_layer_ids=[True]"),
    "layer_ids_twice": ({"ple_layer_ids": [1, 1]}, "ids must be distinct"),
    "layer_ids_many": ({"ple_layer_ids": list(range(1, 5000))}, "4999 PLE layers x 4 heads = 19996 head primes"),
    "table_dtype_list": ({"ple_embedding_dtype": ["fp8"]}, "ple_embedding_dtype=['fp8']"),
    "text_config_list": ({"text_config": [1]}, "text_config=[1]: a JSON object"),
    "model_type_other": ({"model_type": "llama"}, "model_type='llama': one of ['qwen4_exp', 'qwen4_exp_text']"),
    "model_type_list": ({"model_type": ["qwen4_exp"]}, "model_type=['qwen4_exp']"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_bad_config_field(tmp_path, capsys, case):
    fields, message = CONFIGS[case]
    (tmp_path / "config.json").write_text(json.dumps({**_BASE, **fields}))
    code, _, err = run(capsys, "inspect", tmp_path / "config.json")
    assert_one_line(code, err, "inspect", message)
    code, _, err = run(capsys, "ids", tmp_path, "--tokens", "1")
    assert_one_line(code, err, "ids", message)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"{not json", "is not valid JSON"),
        (b"\xff\xfe\x00", "is not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON"),
        (b"[1, 2]", "expected a dict, got list"),
        (b"", "is not valid JSON"),
        (json.dumps({"eos_token_id": 1}).encode(), "hidden_size=None: required"),
    ],
)
def test_unreadable_config(tmp_path, capsys, content, message):
    (tmp_path / "config.json").write_bytes(content)
    code, _, err = run(capsys, "inspect", tmp_path)
    assert_one_line(code, err, "inspect", message)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_config_that_is_not_a_file(tmp_path, capsys, kind):
    cfg = tmp_path / "config.json"
    os.mkfifo(cfg) if kind == "fifo" else cfg.mkdir()
    what = "a FIFO" if kind == "fifo" else "a folder"
    code, _, err = run(capsys, "inspect", tmp_path)
    assert_one_line(code, err, "inspect", f"config {cfg} is {what}, not a regular file")
    code, _, err = run(capsys, "ids", tmp_path, "--tokens", "1")
    assert_one_line(code, err, "ids", f"config {cfg} is {what}, not a regular file")
    if kind == "fifo":
        code, _, err = run(capsys, "inspect", cfg)
        assert_one_line(code, err, "inspect", f"{cfg} is a FIFO, not a regular file or a folder")


def test_config_without_ple_or_of_another_model(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in _BASE.items() if k != "ple_layer_ids"}))
    code, _, err = run(capsys, "inspect", tmp_path)
    assert_one_line(code, err, "inspect", "the config has no PLE layers", "is it a qwen4_exp model with PLE?")
    (tmp_path / "config.json").write_text(json.dumps({**_BASE, "model_type": "qwen3"}))
    code, _, err = run(capsys, "inspect", tmp_path)
    assert_one_line(code, err, "inspect", "model_type='qwen3'", "ple reads qwen4_exp models")


def test_text_only_prefix_is_what_the_loader_reads(tmp_path, capsys):
    """A text-only causal LM (qwen4_exp_text) saves its PLE layers as ``model.layers.{d}.ple.``:
    inspect shows that prefix and a checkpoint written that way loads."""
    from ple.checkpoint import load_ple_weights

    hf, cfg, (mod,) = tiny_model("even", ple_layer_ids=(2,))
    assert hf.model_type == "qwen4_exp_text"
    hf.to_json_file(str(tmp_path / "config.json"), use_diff=False)
    code, out, _ = run(capsys, "inspect", tmp_path / "config.json", "--json")
    assert code == 0
    (layer,) = json.loads(out)["layers"]
    assert layer["prefix"] == "model.layers.1.ple."
    write_checkpoint(tmp_path, published_tensors(mod, cfg.layout(0), layer["prefix"]))
    code, out, _ = run(capsys, "inspect", tmp_path, "--json")
    assert code == 0 and json.loads(out)["layers"][0]["prefix"] == layer["prefix"]
    assert load_ple_weights(tmp_path, cfg)[0].prefix == layer["prefix"]


# ---------------------------------------------------------------------------------------------- ids


def test_ids_token_lists(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(_BASE))
    code, out, err = run(capsys, "ids", tmp_path, "--tokens", "1 2 3", "--json")
    assert code == 0, err
    assert json.loads(out)["tokens"] == [1, 2, 3] and len(json.loads(out)["ids"]) == 3
    for tokens, message in [
        ("", "no token ids"),
        ("-5,3", "entry 0 is -5; token ids are >= 0"),
        ("1e3", "entry 0 is '1e3', not an integer token id"),
        ("3,x", "entry 1 is 'x'"),
        ("1_0", "entry 0 is '1_0', not an integer token id"),  # int() reads 10
        ("3,+5", "entry 1 is '+5', not an integer token id"),  # int() reads 5
        ("\u0663", "entry 0 is '\u0663', not an integer token id"),  # ARABIC-INDIC DIGIT THREE: int() reads 3
        ("\uff11", "entry 0 is '\uff11', not an integer token id"),  # FULLWIDTH DIGIT ONE
        ("9" * 5000, "entry 0 is '" + "9" * 55 + "...', not an integer token id"),
        (str(10**30), "outside [0, vocab_size=300)"),
    ]:
        code, _, err = run(capsys, "ids", tmp_path, "--tokens", tokens)
        assert_usage_error(code, err, "ids", message)
    code, _, err = run(capsys, "ids", tmp_path, "--tokens", "1", "--layer", "3")
    assert_usage_error(code, err, "ids", "--layer 3: no such PLE layer", "positions in ple_layer_ids")


# ---------------------------------------------------------------------------------------------- convert


@pytest.fixture
def ckpt(tmp_path):
    root = tmp_path / "model"
    root.mkdir()
    model_dir(root, "short_last")
    return root


def _no_tables(out: Path) -> bool:
    return not out.exists() or not [p for p in out.iterdir() if ".pletable" in p.name]


def _mutated(tmp_path: Path, mutate) -> Path:
    root = tmp_path / "bad"
    root.mkdir()
    model_dir(root, "short_last", mutate=mutate)
    return root


def _set_buffer(t):
    t[P0 + "ple_embedding.ngram_heads_offsets"] = torch.tensor([0, 503, 1012, 1534])


def _nan_dense(t):
    t[P0 + "key_proj.weight"][0, 0] = float("nan")


def _zero_row_scale(t):
    _to_format(t, torch.int8, row_scale=True)
    t[_shard(3, "weight_scale")][4, 0] = 0.0


def _f64_row_scale_overflows(t):
    _to_format(t, torch.int8, row_scale=True)
    t[_shard(3, "weight_scale")] = t[_shard(3, "weight_scale")].double()
    t[_shard(3, "weight_scale")][4, 0] = 1e39  # finite in float64, inf in the float32 tables keep


CONVERT_REFUSES = {
    "hash_buffers": (_set_buffer, "ngram_heads_offsets = [0, 503, 1012, 1534] but the config implies"),
    "nan_dense": (_nan_dense, "key_proj.weight in", "is nan, not finite"),
    "zero_global_scale": (
        lambda t: _to_format(t, torch.float8_e4m3fn, scale=torch.zeros(1)),
        f"{P0}{SCALE} = 0.0: the global scale must be a positive finite number",
    ),
    "zero_row_scale": (_zero_row_scale, "the scale of row 1243 is 0.0", "source shard 3"),
    "f64_global_scale_overflows": (
        lambda t: _to_format(t, torch.float8_e4m3fn, scale=torch.tensor([1e39], dtype=torch.float64)),
        f"{P0}{SCALE} = 1e+39 (inf as float32): the global scale must be a positive finite number",
    ),
    "f64_row_scale_overflows": (_f64_row_scale_overflows, "the scale of row 1243 is 1e+39 (inf as float32)"),
    "both_scales": (
        lambda t: _to_format(t, torch.float8_e4m3fn, row_scale=True, scale=torch.ones(1)),
        "both per-row weight_scale tensors and a global",
    ),
    "int_dense": (
        lambda t: t.__setitem__(P0 + "value_proj.weight", torch.ones(24, 24, dtype=torch.int16)),
        "value_proj.weight: dtype I16, expected a floating point dtype",
    ),
}


@pytest.mark.parametrize("case", list(CONVERT_REFUSES))
def test_convert_refuses_what_the_loader_refuses(tmp_path, capsys, case):
    from ple.checkpoint import CheckpointError, load_ple_weights
    from ple.config import PLEConfig

    mutate, *parts = CONVERT_REFUSES[case]
    root = _mutated(tmp_path, mutate)
    with pytest.raises(CheckpointError) as loader:
        load_ple_weights(root, PLEConfig.from_pretrained(root))
    code, _, err = run(capsys, "convert", root, tmp_path / "out")
    assert_one_line(code, err, "convert", *parts)
    assert any(parts[0] in p for p in loader.value.problems)
    assert _no_tables(tmp_path / "out")
    if case not in ("nan_dense", "zero_row_scale", "f64_row_scale_overflows"):  # inspect reads no bulk data
        code, out, _ = run(capsys, "inspect", root)
        assert code == 1 and parts[0] in out


@pytest.mark.parametrize("index", ["{", '{"weight_map": {"x": "../elsewhere.safetensors"}}'])
def test_malformed_index_through_the_command(ckpt, tmp_path, capsys, index):
    (ckpt / "model.safetensors.index.json").write_text(index)
    for command in ("inspect", "convert"):
        args = [ckpt] if command == "inspect" else [ckpt, tmp_path / "out"]
        code, _, err = run(capsys, command, *args)
        assert_one_line(code, err, command, "model.safetensors.index.json")


def test_convert_output_problems(ckpt, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    code, _, err = run(capsys, "convert", ckpt, out, "--layers", "3")
    assert_usage_error(code, err, "convert", "--layers: no PLE layer 3", "0 (decoder layer 0, ple_layer_ids[0] = 1)")
    code, _, err = run(capsys, "convert", ckpt, out, "--layers", "x")
    assert_usage_error(code, err, "convert", "--layers: 'x' is not a PLE layer index")
    code, _, err = run(capsys, "convert", ckpt, out, "--layers", "+0")
    assert_usage_error(code, err, "convert", "--layers: '+0' is not a PLE layer index")
    code, _, err = run(capsys, "convert", ckpt, out, "--layers", " , ")
    assert_usage_error(code, err, "convert", "--layers: no index given")
    assert not out.exists()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    code, _, err = run(capsys, "convert", ckpt, a_file)
    assert_one_line(code, err, "convert", f"output {a_file} exists and is not a folder")
    assert run(capsys, "convert", ckpt, out)[0] == 0
    (table,) = out.glob("*.pletable")
    code, _, err = run(capsys, "convert", ckpt, out, "--to", "int8")  # the same conversion would keep it
    assert_one_line(code, err, "convert", "exists and is not kept (it holds fp32 rows, not int8_row): pass --force")
    # a read-only folder (simulated: tests may run as root, who may write anywhere)
    ro = tmp_path / "ro"
    ro.mkdir()
    real_open = os.open

    def refuse(path, flags, *a, **k):
        if Path(path).parent == ro and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", refuse)
    code, _, err = run(capsys, "convert", ckpt, ro)
    assert_one_line(code, err, "convert", "Permission denied:", str(ro))
    monkeypatch.undo()
    assert list(ro.iterdir()) == []


def test_convert_disk_full_leaves_nothing(ckpt, tmp_path, capsys, monkeypatch):
    """ENOSPC while rows are written (simulated; a full tmpfs behaves the same): one line, no file."""
    out = tmp_path / "out"
    real = os.pwrite

    def full(fd, buf, offset):
        if offset >= 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", full)
    code, _, err = run(capsys, "convert", ckpt, out)
    name = "model.language_model.layers.0.ple.pletable"
    assert_one_line(code, err, "convert", f"No space left on device: {out / name}")
    assert not out.exists()  # nothing it made stays: not even the folder


_INTERRUPTED_CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import ple.table.files.writer as f
    orig = f.TableFileWriter.commit

    def slow(self, k, *a, **kw):  # runs in the converting thread once a shard is done
        orig(self, k, *a, **kw)
        Path(sys.argv[3]).write_text("writing")
        time.sleep(120)

    f.TableFileWriter.commit = slow
    from ple.commands.cli import main
    sys.exit(main(["convert", sys.argv[1], sys.argv[2]]))
    """
)


@pytest.mark.parametrize(
    "sig, code, said",
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hung up")],
    ids=["int", "term", "hup"],
)
def test_ctrl_c_or_sigterm_during_convert(ckpt, tmp_path, capsys, sig, code, said):
    """Ctrl-C, SIGTERM (what ``timeout``, ``kill`` and job runners send) and SIGHUP (a closed terminal)
    stop a conversion the same way: nothing is published, the shards already done stay in the one
    temporary file (said on stderr), and the same command run again finishes the table from there."""
    out, marker = tmp_path / "out", tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    child = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_CHILD, str(ckpt), str(out), str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), child.communicate(timeout=30)
        assert any(p.name.endswith(".partial") for p in out.iterdir())
        child.send_signal(sig)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == code, stderr
    assert stderr.endswith(f"ple convert: {said}\n") and "the same conversion run again continues it" in stderr
    (kept,) = out.iterdir()
    assert kept.name.endswith(".partial")
    assert run(capsys, "convert", ckpt, out)[0] == 0
    (table,) = [p for p in out.iterdir() if not p.name.endswith(".source.json")]
    assert table.name.endswith(".pletable") and run(capsys, "verify", table, "--checkpoint", ckpt)[0] == 0


# ---------------------------------------------------------------------------------------------- inspect, verify


def test_inspect_and_verify_of_fifos(ckpt, tmp_path, capsys):
    os.mkfifo(ckpt / "zz.safetensors")
    (ckpt / "model.safetensors.index.json").unlink()
    code, out, err = run(capsys, "inspect", ckpt)
    assert code == 1 and "Traceback" not in err
    assert "zz.safetensors: checkpoint file" in out and "is a FIFO, not a regular file" in out
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "out")
    assert_one_line(code, err, "convert", "zz.safetensors: checkpoint file", "is a FIFO")
    fifo = tmp_path / "t.pletable"
    os.mkfifo(fifo)
    code, out, err = run(capsys, "verify", fifo)
    assert code == 1 and err == "" and out == f"problem: table file {fifo} is a FIFO, not a regular file\n"


def test_verify_damaged_and_foreign(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(capsys, "convert", ckpt, out)[0] == 0
    (table,) = out.glob("*.pletable")
    assert run(capsys, "verify", table, "--checkpoint", ckpt)[0] == 0
    raw = bytearray(table.read_bytes())
    at = raw.index(b'"head_dim": 6') + len(b'"head_dim": ')
    raw[at] = ord("7")  # the header still parses, but says something else
    table.write_bytes(bytes(raw))
    code, out_text, err = run(capsys, "verify", table, "--checkpoint", ckpt)
    assert code == 1 and err == "" and "header checksum mismatch" in out_text
    with pytest.raises(Exception, match="header checksum mismatch"):
        MmapTable.open(table)
    junk = tmp_path / "junk.pletable"
    junk.write_bytes(b"\x00" * 10)
    code, out_text, _ = run(capsys, "verify", junk)
    assert code == 1 and "bad magic" in out_text


# ---------------------------------------------------------------------------------------------- stats


@pytest.fixture
def stats_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_BASE))
    return tmp_path


def _npy_claiming(shape: tuple[int, ...], data: bytes):
    """A .npy file whose header claims ``shape`` (int64) over ``data``."""

    def make(p: Path) -> None:
        with open(p, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": shape})
            f.write(data)

    return make


def _npy_truncated(p: Path) -> None:
    np.save(p, np.arange(100, dtype=np.int64))
    p.write_bytes(p.read_bytes()[:-40])


STATS = {
    "folder": (lambda p: p.mkdir(), "tokens", "is a folder, not a regular file"),
    "fifo": (lambda p: os.mkfifo(p), "tokens", "is a FIFO, not a regular file"),
    "missing": (lambda p: None, "tokens", "is missing"),
    "words": (lambda p: p.write_text("1 2 three"), "tokens.txt", "entry 2 is 'three', not an integer token id"),
    "floats": (lambda p: p.write_text("1 2.5"), "tokens.txt", "entry 1 is '2.5'"),
    "underscore": (lambda p: p.write_text("1 1_0"), "tokens.txt", "entry 1 is '1_0', not an integer token id"),
    "plus": (lambda p: p.write_text("+5"), "tokens.txt", "entry 0 is '+5', not an integer token id"),
    "arabic_digit": (lambda p: p.write_text("1 \u0663"), "tokens.txt", "entry 1 is '\u0663', not an integer"),
    "empty": (lambda p: p.write_text(""), "tokens.txt", "holds no token ids"),
    "binary": (lambda p: p.write_bytes(b"\xff\xfe\x01"), "tokens.txt", "not text"),
    "huge": (lambda p: p.write_text(f"1 {10**30}"), "tokens.txt", "entry 1 is 1" + "0" * 30 + ", outside [0, vocab"),
    "out_of_vocab": (lambda p: p.write_text("1 300"), "tokens.txt", "entry 1 is 300, outside [0, vocab_size=300)"),
    "negative": (lambda p: p.write_text("-1"), "tokens.txt", "entry 0 is -1, outside"),
    "npy_empty": (lambda p: np.save(p, np.zeros(0, dtype=np.int32)), "t.npy", "holds no token ids"),
    "npy_truncated": (_npy_truncated, "t.npy", "not a readable .npy array"),
    "npy_float": (lambda p: np.save(p, np.ones(3)), "t.npy", "dtype float64, expected integer token ids"),
    "npy_pickle": (lambda p: np.save(p, np.array([{"a": 1}], dtype=object)), "t.npy", "not a readable .npy array"),
    "npy_garbage": (lambda p: p.write_bytes(b"\x93NUMPY garbage"), "t.npy", "not a readable .npy array"),
    "npy_huge_shape": (  # would allocate 7.3 TiB before reading
        _npy_claiming((10**12,), bytes(64)),
        "t.npy",
        "its header says shape (1000000000000,) of int64, 8000000000000 bytes, but 64 bytes follow the header",
    ),
    "npy_many_dims": (_npy_claiming((2**40,) * 30, bytes(8)), "t.npy", "bytes, but 8 bytes follow the header"),
    "npy_trailing_bytes": (_npy_claiming((2,), bytes(17)), "t.npy", "16 bytes, but 17 bytes follow the header"),
    "npy_negative_dims": (_npy_claiming((-1, -2), bytes(16)), "t.npy", "its header says shape (-1, -2)"),
    "npy_uint64": (lambda p: np.save(p, np.array([2**64 - 1], dtype=np.uint64)), "t.npy", "does not fit int64"),
}


@pytest.mark.parametrize("case", list(STATS))
def test_stats_token_files(stats_model, capsys, case):
    make, name, message = STATS[case]
    path = stats_model / name
    make(path)
    code, _, err = run(capsys, "stats", stats_model, "--tokens", path)
    assert_one_line(code, err, "stats", message)


def test_stats_layer_out_of_range(stats_model, capsys):
    (stats_model / "t.txt").write_text("1 2 3")
    code, _, err = run(capsys, "stats", stats_model, "--tokens", stats_model / "t.txt", "--layer", "1")
    assert_usage_error(code, err, "stats", "--layer 1: no such PLE layer")


# ---------------------------------------------------------------------------------------------- demo, bench arguments


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--slots", "0"], "argument --slots: 0 is out of range: expected an integer in [1, 4,096]"),
        (["demo", "--slots", "100000000000"], "argument --slots: 100000000000 is out of range: expected an integer in"),
        (["demo", "--requests", "1000000000"], "argument --requests: 1000000000 is out of range"),
        (["demo", "--new-tokens", "10000000"], "argument --new-tokens: 10000000 is out of range"),
        (["demo", "--chunk", "0"], "argument --chunk: 0 is out of range"),
        (["demo", "--requests", "0"], "argument --requests: 0 is out of range"),
        (["demo", "--requests", "x"], "argument --requests: 'x' is not an integer"),
        (["demo", "--slots", " 5"], "argument --slots: ' 5' is not an integer"),
        (["demo", "--slots", "1_0"], "argument --slots: '1_0' is not an integer"),
        (["demo", "--chunk", "+8"], "argument --chunk: '+8' is not an integer"),
        (["ids", "m", "--tokens", "1", "--layer", "\u0663"], "argument --layer: '\u0663' is not an integer"),
        (["stats", "m", "--tokens", "t", "--layer", "0_0"], "argument --layer: '0_0' is not an integer"),
        (["demo", "--num-spec", "-1"], "argument --num-spec: -1 is out of range: expected an integer in [0, 64]"),
        (["demo", "--layer", "-2"], "argument --layer: -2 is out of range"),
        (["bench", "--threads", "0"], "argument --threads: 0 is out of range"),
        (["bench", "--repeat", "0"], "argument --repeat: 0 is out of range"),
        (["bench", "--device", "bogus"], "argument --device: 'bogus' is not a torch device"),
        (["bench", "--device", "meta"], "argument --device: 'meta': ple runs on cpu or cuda devices"),
        (["bench", "--seed", "-1"], "argument --seed: -1 is out of range"),
        (["inspect"], "the following arguments are required: path"),
        (["convert", "a", "b", "--to", "fp4"], "argument --to: 'fp4' is not a table format"),
    ],
)
def test_wrong_command_lines_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.splitlines()[-1], err


# ---------------------------------------------------------------------------------------------- JSON limits

_HUGE = "1" * 5000  # more digits than Python converts to an int (sys.get_int_max_str_digits(): 4300)


def _safetensors_bytes(header: str, data: bytes = b"") -> bytes:
    blob = header.encode()
    return len(blob).to_bytes(8, "little") + blob + data


def test_huge_integer_in_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"hidden_size": ' + _HUGE + ', "eos_token_id": 7}')
    code, _, err = run(capsys, "inspect", tmp_path)
    assert_one_line(code, err, "inspect", f"config {tmp_path / 'config.json'} is not valid JSON", "4300 digits")
    assert len(err) < 400


def test_huge_integer_in_index_json(ckpt, tmp_path, capsys):
    index = ckpt / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    index.write_text(json.dumps(doc).replace('"metadata": {}', '"metadata": {"total_size": ' + _HUGE + "}"))
    assert _HUGE in index.read_text()
    for command, args in (("inspect", [ckpt]), ("convert", [ckpt, tmp_path / "out"])):
        code, _, err = run(capsys, command, *args)
        assert_one_line(code, err, command, f"checkpoint index {index} is not valid JSON", "4300 digits")


def test_huge_integer_in_safetensors_header(ckpt, tmp_path, capsys):
    (ckpt / "model.safetensors.index.json").unlink()
    (ckpt / "zz.safetensors").write_bytes(
        _safetensors_bytes('{"a": {"dtype": "U8", "shape": [' + _HUGE + '], "data_offsets": [0, 0]}}')
    )
    code, out, err = run(capsys, "inspect", ckpt)
    assert code == 1 and err == "", err
    assert "zz.safetensors: the safetensors header is not valid JSON (Exceeds the limit (4300 digits)" in out
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "out")
    assert_one_line(code, err, "convert", "zz.safetensors: the safetensors header is not valid JSON")


def test_huge_integer_in_table_file_header(tmp_path, capsys):
    from ple.table import TableFileError, read_table_header

    blob = ('{"magic": "ple-table", "rows": ' + _HUGE + "}").encode()
    path = tmp_path / "t.pletable"
    path.write_bytes(b"PLETABLE" + len(blob).to_bytes(8, "little") + blob)
    code, out, err = run(capsys, "verify", path)
    assert code == 1 and err == "" and out == f"problem: {path}: header is not valid JSON " + out.split("JSON ", 1)[1]
    assert "4300 digits" in out
    for opener in (read_table_header, MmapTable.open):
        with pytest.raises(TableFileError, match="header is not valid JSON"):
            opener(path)


def _long_layer_name(t):
    t[f"model.language_model.layers.{'1' * 10_000}.ple.key_proj.weight"] = torch.zeros(1)


def _long_shard_name(t):
    t[f"{P0}ple_embedding.ngram_embedding.shard_{'2' * 10_000}.weight"] = torch.zeros(1)


def _arabic_layer_name(t):
    t["model.language_model.layers.\u0663.ple.key_proj.weight"] = torch.zeros(1)  # ARABIC-INDIC DIGIT THREE


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_long_layer_name, "the layer '" + "1" * 36 + "... is not a decoder layer number"),
        (_arabic_layer_name, "the layer '\u0663' is not a decoder layer number"),
        (_long_shard_name, f"unexpected tensor {P0}ple_embedding.ngram_embedding.shard_2222"),
    ],
    ids=["long_layer", "arabic_layer", "long_shard"],
)
def test_tensor_names_with_bad_numbers(tmp_path, capsys, mutate, message):
    """A layer or shard number of 10,000 digits (or of another script's digits) is no index: the name
    is a problem named in one short line, never an int conversion error."""
    from ple.checkpoint import CheckpointError, load_ple_weights
    from ple.config import PLEConfig

    root = _mutated(tmp_path, mutate)
    code, out, err = run(capsys, "inspect", root)
    assert code == 1 and err == "" and message in out, out
    assert max(len(line) for line in out.splitlines()) < 400
    code, _, err = run(capsys, "convert", root, tmp_path / "out")
    assert_one_line(code, err, "convert", message)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_ple_weights(root, PLEConfig.from_pretrained(root))


# ---------------------------------------------------------------------------------------------- safetensors byte ranges


def _append_byte(root: Path) -> Path:
    victim = sorted(root.glob("*.safetensors"))[0]
    with open(victim, "ab") as f:
        f.write(b"\0")
    return victim


def test_trailing_byte_after_the_tensor_data(ckpt, tmp_path, capsys):
    """One byte after the last tensor: safetensors refuses the file, so every ple reader refuses it
    too, naming the file (inspect used to pass it and convert to fail inside the library)."""
    out = tmp_path / "out"
    assert run(capsys, "convert", ckpt, out)[0] == 0
    (table,) = out.glob("*.pletable")
    victim = _append_byte(ckpt)
    size = victim.stat().st_size
    message = f"{victim.name}: 1 bytes after the end of the tensor data (byte {size - 1}; the file has {size})"
    code, text, err = run(capsys, "inspect", ckpt)
    assert code == 1 and err == "" and message in text
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "out2")
    assert_one_line(code, err, "convert", message)
    code, text, err = run(capsys, "verify", table, "--checkpoint", ckpt)
    assert code == 1 and err == "" and text == f"problem: {message}: a damaged or foreign file\n"


@pytest.mark.parametrize(
    "header, data, message",
    [
        (
            '{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, '
            '"b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}}',
            b"xxxxx",
            "bytes [{s2}, {s3}) after 'a' belong to no tensor",
        ),
        (
            '{"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}',
            b"xxx",
            "bytes [{s0}, {s1}) before the first tensor belong to no tensor",
        ),
        (
            '{"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}, '
            '"b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}',
            b"xxxx",
            "tensor 'b' at bytes [{s2}, {s4}) overlaps 'a'",
        ),
        (
            '{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, '
            '"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}',
            b"xxxx",
            "bytes [{s0}, {s2}) before the first tensor belong to no tensor",
        ),
        (
            '{"a": {"dtype": "F32", "shape": [' + "1" * 4000 + ", " + "1" * 4000 + '], "data_offsets": [0, 4]}}',
            b"xxxx",
            "needs more than the file's 4 data bytes",
        ),
        ('{"a": {"dtype": "F8_E8M0", "shape": [3], "data_offsets": [0, 3]}}', b"xxx", None),
        ('{"a": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}', b"xxx", None),
        ('{"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}', b"xx", "2 bytes for a F4 tensor of shape [3]"),
        ('{"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}', b"xx", "unknown dtype 'Q7'"),
        (
            '{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, '
            '"b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}',
            b"xx",
            None,
        ),
        (
            '{"a": {"dtype": "F32", "shape": [1099511627776, 0], "data_offsets": [0, 0]}, '
            '"b": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}',
            b"xx",
            None,
        ),
    ],
    ids=[
        "gap",
        "gap_first",
        "overlap",
        "duplicate_name",
        "huge_shape",
        "e8m0",
        "f4",
        "f4_size",
        "unknown",
        "empty",
        "empty_huge_dim",
    ],  # fmt: skip
)
def test_safetensors_byte_ranges_tile_the_file(tmp_path, header, data, message):
    """The header's byte ranges are checked as the safetensors library checks them: a file ple's scan
    passes is one the library opens, and one ple refuses the library refuses too."""
    from safetensors import safe_open

    from ple.checkpoint import read_safetensors_header

    path = tmp_path / "x.safetensors"
    path.write_bytes(_safetensors_bytes(header, data))
    infos, problem = read_safetensors_header(path)
    start = 8 + len(header.encode())
    try:
        with safe_open(str(path), "np") as f:
            for name in f.keys():
                f.get_slice(name)
        library = None
    except Exception as e:
        library = e
    if message is None:
        assert problem is None and library is None and sorted(infos) == sorted(json.loads(header))
    else:
        want = message.format(**{f"s{k}": start + k for k in range(6)})
        assert problem is not None and problem.startswith("x.safetensors: ") and want in problem, problem
        assert library is not None, "the library opened a file ple refuses"


def test_safetensors_library_errors_name_the_file(ckpt):
    """A file that changes after the scan: what the safetensors library raises reaches the caller as a
    CheckpointError naming the file."""
    from ple.checkpoint import CheckpointError, TensorReader, scan_checkpoint
    from ple.config import PLEConfig

    cfg = PLEConfig.from_pretrained(ckpt)
    (layer,) = scan_checkpoint(ckpt, cfg).layers
    name, info = next(iter(layer.dense.items()))
    _append_byte_to(info.file)
    with TensorReader() as reader, pytest.raises(CheckpointError, match=f"{info.file.name}: the safetensors library"):
        reader.get(info, layer.prefix + name)


def _append_byte_to(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")
