"""The ``ple`` command: ``inspect`` (layout, header-only checkpoint check) and ``ids``."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch

from ple.commands.cli import main
from ple.ngram import fresh_context, ngram_ids
from tests.checkpoint.test_checkpoint import (
    EMB,
    INDEX,
    PREFIX,
    _evil_pickle,
    file_of,
    garble_large,
    model_tensors,
    tiny_model,
    truncate,
    write_checkpoint,
)
from tests.conftest import hf_config, ple_config_from_hf

SRC = Path(__file__).resolve().parents[2] / "src"
LAYOUT_KEYS = ("multipliers", "head_sizes", "head_offsets", "rows", "padded_rows", "head_dim", "shard_rows")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def model_dir(root: Path, geometry: str = "short_last", ple_layer_ids=(1,), mutate=None, **kw):
    """A model directory: config.json plus a checkpoint in three files with an index."""
    hf, cfg, mods = tiny_model(geometry, ple_layer_ids=ple_layer_ids, **kw)
    tensors = model_tensors(cfg, mods)
    if mutate is not None:
        mutate(tensors)
    write_checkpoint(root, tensors)
    hf.to_json_file(str(root / "config.json"), use_diff=False)
    return cfg


def _check_layout(entry: dict, cfg, idx: int) -> None:
    lay = cfg.layout(idx)
    assert entry["ple_layer_index"] == idx
    for key in LAYOUT_KEYS:
        want = getattr(lay, key)
        assert entry[key] == (list(want) if isinstance(want, tuple) else want), key


# ------------------------------------------------------------------------------------------ inspect


def test_inspect_config_only(tmp_path, capsys):
    hf = hf_config(ple_layer_ids=[2, 3], num_hidden_layers=3, split_ngram_parts=7)
    hf.to_json_file(str(tmp_path / "config.json"), use_diff=False)
    cfg = ple_config_from_hf(hf)
    code, out, err = run_cli(capsys, "inspect", tmp_path / "config.json", "--json")
    assert code == 0, err
    layers = json.loads(out)["layers"]
    # a text-only config (qwen4_exp_text) names its layers as Qwen4ExpForCausalLM saves them
    assert [d["prefix"] for d in layers] == ["model.layers.1.ple.", "model.layers.2.ple."]
    for i, d in enumerate(layers):
        _check_layout(d, cfg, i)
        assert d["problems"] == []
    assert layers[0]["head_sizes"] == [503, 509, 521, 523] and layers[1]["head_sizes"] == [541, 547, 557, 563]


@pytest.mark.parametrize("form", ["dir", "index", "file"])
def test_inspect_checkpoint_ok(tmp_path, capsys, form):
    cfg = model_dir(tmp_path, "empty_tail", ple_layer_ids=(2, 3))
    path = {"dir": tmp_path, "index": tmp_path / INDEX, "file": None}[form]
    if form == "file":  # one safetensors file holding everything
        for f in tmp_path.glob("*.safetensors"):
            f.unlink()
        (tmp_path / INDEX).unlink()
        _, cfg2, mods = tiny_model("empty_tail", ple_layer_ids=(2, 3))
        write_checkpoint(tmp_path, model_tensors(cfg2, mods), files=1, index=False)
        path = tmp_path / "model-00001-of-00001.safetensors"
    code, out, err = run_cli(capsys, "inspect", path, "--json")
    assert code == 0, out + err
    doc = json.loads(out)
    assert doc["problems"] == []
    assert [d["prefix"] for d in doc["layers"]] == [PREFIX.format(1), PREFIX.format(2)]
    for i, d in enumerate(doc["layers"]):
        _check_layout(d, cfg, i)
        assert d["problems"] == [] and d["table_format"] == "fp32"


def _text_fields(out: str, labels: tuple[str, ...]) -> dict[str, str]:
    """The value after each label of a text report (a line starting with the label), whitespace
    collapsed: the tests read content, not column layout."""
    fields = {}
    for line in out.splitlines():
        words = " ".join(line.split())
        for label in labels:
            if words.startswith(label + " ") and label not in fields:
                fields[label] = words[len(label) + 1 :]
    return fields


def test_inspect_text(tmp_path, capsys):
    cfg = model_dir(tmp_path, "short_last")
    lay = cfg.layout(0)
    code, out, _ = run_cli(capsys, "inspect", tmp_path)
    assert code == 0
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert f"PLE layer 0 (decoder layer 0) prefix {PREFIX.format(0)}" in lines
    fields = _text_fields(out, ("multipliers", "head sizes", "rows", "shards", "checkpoint"))
    assert fields["multipliers"] == str(list(lay.multipliers))
    assert fields["head sizes"] == f"{lay.head_sizes[0]} .. {lay.head_sizes[-1]} ({len(lay.head_sizes)} primes)"
    assert (lay.rows, lay.padded_rows, lay.head_dim, lay.shard_rows) == (2056, 2064, 6, 413)
    assert fields["rows"] == "2,056 (padded 2,064) x 6"
    assert fields["shards"] == "5 x 413 rows"
    assert fields["checkpoint"] == "table fp32; OK"


def test_inspect_reads_no_table(tmp_path, capsys, monkeypatch):
    """The table and dense bytes replaced by garbage (headers and the small tensors intact), every
    bulk data reader disabled: inspect passes."""
    model_dir(tmp_path, "empty_tail")
    garble_large(tmp_path)

    def no_data(*a, **k):
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(safetensors, "safe_open", no_data)
    monkeypatch.setattr(safetensors.torch, "load_file", no_data)
    code, out, err = run_cli(capsys, "inspect", tmp_path, "--json")
    assert code == 0, out + err
    assert json.loads(out)["layers"][0]["problems"] == []


def _break(t):
    P = PREFIX.format(0)
    del t[f"{P}{EMB}shard_2.weight"]
    t[P + "key_proj.weight"] = torch.zeros(48, 23)
    t[P + "ple_embedding.mystery"] = torch.zeros(1)


def test_inspect_lists_problems(tmp_path, capsys):
    model_dir(tmp_path, "short_last", mutate=_break)
    P = PREFIX.format(0)
    want = [
        f"{P}: missing table shard(s) [2] of 5",
        f"{P}key_proj.weight: shape [48, 23], expected [48, 24]",
        f"unexpected tensor {P}ple_embedding.mystery",
    ]
    code, out, _ = run_cli(capsys, "inspect", tmp_path, "--json")
    assert code == 1
    assert sorted(json.loads(out)["layers"][0]["problems"]) == sorted(want)
    code, out, _ = run_cli(capsys, "inspect", tmp_path)
    assert code == 1
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert _text_fields(out, ("checkpoint",))["checkpoint"] == "table fp32; PROBLEMS:"
    for w in want:
        assert f"- {w}" in lines


def test_inspect_checkpoint_wide_problems(tmp_path, capsys):
    model_dir(tmp_path, "short_last")
    victim = file_of(tmp_path, f"{PREFIX.format(0)}{EMB}shard_0.weight")
    truncate(victim, 8)
    cfg_path = tmp_path / "config.json"
    d = json.loads(cfg_path.read_text())
    d["ple_layer_ids"], d["num_hidden_layers"] = [1, 2], 2  # a PLE layer the checkpoint lacks
    cfg_path.write_text(json.dumps(d))
    code, out, _ = run_cli(capsys, "inspect", tmp_path, "--json")
    assert code == 1
    problems = json.loads(out)["problems"]
    assert any(f"{victim.name}: truncated" in p for p in problems), problems
    assert any("PLE layer 1 (decoder layer 1, ple_layer_ids[1]=2) has no tensors" in p for p in problems), problems
    code, out, _ = run_cli(capsys, "inspect", tmp_path)
    assert code == 1 and f"problem: {victim.name}: truncated" in out


@pytest.mark.parametrize("target", ["dir", "file"])
def test_inspect_refuses_pickles(tmp_path, capsys, target):
    hf = hf_config()
    hf.to_json_file(str(tmp_path / "config.json"), use_diff=False)
    marker = tmp_path / "MARKER"
    (tmp_path / "pytorch_model.bin").write_bytes(_evil_pickle(marker))
    path = tmp_path if target == "dir" else tmp_path / "pytorch_model.bin"
    code, out, err = run_cli(capsys, "inspect", path)
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert "pickled weights" in err and "refused" in err and "convert to safetensors" in err
    assert not marker.exists()


def test_inspect_bad_paths(tmp_path, capsys):
    code, _, err = run_cli(capsys, "inspect", tmp_path / "absent")
    assert code == 1 and err == f"ple inspect: No such file or directory: {tmp_path / 'absent'}\n"
    code, _, err = run_cli(capsys, "inspect", tmp_path)
    assert code == 1 and err.startswith(f"ple inspect: {tmp_path} has no config.json: expected a config.json, a model")
    assert err.endswith("or a GGUF file or a .pletable table file\n")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 24, "eos_token_id": 7, "heads_per_ngram": 5}))
    code, _, err = run_cli(capsys, "inspect", tmp_path / "config.json")
    assert code == 1 and "ple_embed_dim" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------------------------------------- ids


def _hf_ids(hf, ple_layer_index: int, tokens: list[int]) -> torch.Tensor:
    """Ids transformers' Qwen4ExpTextNGramEmbedding hands its embedding for one fresh request."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    emb = Qwen4ExpTextNGramEmbedding(hf, hf.ple_embed_dim, hf.ple_layer_ids[ple_layer_index] - 1, ple_layer_index)
    seen = []
    orig = emb.ngram_embedding.forward
    emb.ngram_embedding.forward = lambda ids: (seen.append(ids.clone()), orig(ids))[1]
    emb(torch.tensor([tokens]), None)
    return seen[0][0]


@pytest.fixture(scope="module")
def published_like(tmp_path_factory):
    """Published vocabulary and EOS, two PLE layers, small tables."""
    root = tmp_path_factory.mktemp("ids")
    hf = hf_config(vocab_size=248320, eos_token_id=248044, ple_layer_ids=[2, 3], num_hidden_layers=3, heads_per_ngram=3)
    hf.to_json_file(str(root / "config.json"), use_diff=False)
    return root, hf, ple_config_from_hf(hf)


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("tokens", ["3,17,248044,9", "248044", "5, 248319,0,0,248044,248044,12,13,14"])
def test_ids_json(published_like, capsys, layer, tokens):
    root, hf, cfg = published_like
    toks = [int(t) for t in tokens.split(",")]
    code, out, err = run_cli(capsys, "ids", root / "config.json", "--tokens", tokens, "--layer", layer, "--json")
    assert code == 0, err
    got = torch.tensor(json.loads(out)["ids"], dtype=torch.int64)
    lay = cfg.layout(layer)
    x = torch.tensor(toks)
    want = ngram_ids(x, torch.tensor([0, len(toks)]), fresh_context(1, lay, cfg.eos_token_id), lay, cfg.eos_token_id)
    assert got.shape == (len(toks), cfg.num_heads)
    assert torch.equal(got, want)
    assert torch.equal(got, _hf_ids(hf, layer, toks))


def test_ids_random_stream_matches_transformers(published_like, capsys):
    root, hf, cfg = published_like
    rng = random.Random(0)
    toks = [248044 if rng.random() < 0.2 else rng.randrange(248320) for _ in range(37)]
    code, out, _ = run_cli(capsys, "ids", root, "--tokens", ",".join(map(str, toks)), "--json")
    assert code == 0
    assert torch.equal(torch.tensor(json.loads(out)["ids"]), _hf_ids(hf, 0, toks))


def test_ids_text(published_like, capsys):
    root, hf, cfg = published_like
    code, out, _ = run_cli(capsys, "ids", root, "--tokens", "3,17,248044,9", "--layer", "1")
    assert code == 0
    ids = _hf_ids(hf, 1, [3, 17, 248044, 9])
    lines = out.splitlines()
    assert lines[0] == "token 0: 3" and "token 2: 248044" in lines
    # token 3 follows an EOS: its trigram reads [EOS, EOS, 9]
    i = lines.index("token 3: 9")
    hpn = cfg.heads_per_ngram
    assert lines[i + 1] == "  2-gram [248044, 9]: " + ", ".join(f"h{j}:{int(ids[3, j])}" for j in range(hpn))
    assert lines[i + 2] == "  3-gram [248044, 248044, 9]: " + ", ".join(
        f"h{hpn + j}:{int(ids[3, hpn + j])}" for j in range(hpn)
    )
    assert lines[1].startswith("  2-gram [248044, 3]: h0:")


def test_ids_errors(published_like, capsys):
    root, _, _ = published_like
    # values out of range, whether argparse or the command finds them: exit 2 with the command's usage
    code, _, err = run_cli(capsys, "ids", root, "--tokens", "3,248320")
    assert code == 2 and err.startswith("usage: ple ids ")
    assert err.endswith("\nple ids: error: --tokens: entry 1 is 248320, outside [0, vocab_size=248320)\n")
    code, _, err = run_cli(capsys, "ids", root, "--tokens", "3", "--layer", "2")
    assert code == 2 and "--layer 2: no such PLE layer" in err and "0 (decoder layer 1, ple_layer_ids[0] = 2)" in err
    code, _, err = run_cli(capsys, "ids", root, "--tokens", "3,x")
    assert code == 2 and err.endswith("\nple ids: error: --tokens: entry 1 is 'x', not an integer token id\n")


def test_module_entry_point(tmp_path, capsys):
    """``python -m ple.commands.cli`` (what the ``ple`` console script runs): output and exit status."""
    model_dir(tmp_path, "short_last", mutate=_break)
    args = ["inspect", str(tmp_path), "--json"]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run(
        [sys.executable, "-m", "ple.commands.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    assert main(args) == 1
    assert json.loads(proc.stdout) == json.loads(capsys.readouterr().out)
    assert "missing table shard(s) [2] of 5" in proc.stdout
