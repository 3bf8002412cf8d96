"""One token input (``ple.data.tokens``): ``--tokens FILE``, ``--text FILE`` and ``--real-text N`` are
declared alike by ``ple stats``, ``ple eval``, ``ple train`` and ``ple demo`` and read alike, text
reaching a small vocabulary through the map ``ple train`` has always used; the README's ``ple eval``
runs on the demo's model, and ``ple train``'s adapter is measured by ``ple eval --adapter``."""

from __future__ import annotations

import argparse
import hashlib
import json

import numpy as np
import pytest
import torch

from ple.commands.cli import build_parser, main
from ple.common.argtypes import positive_int
from ple.data import tokens as tk
from ple.errors import CommandLineError, InvalidArgumentError

realtext = pytest.importorskip("ple.data.realtext")
pytest.importorskip("tiktoken")
QWEN_EOT = realtext.QWEN_ENDOFTEXT
OPTIONS = ("tokens", "text", "real_text")


def ns(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"tokens": None, "text": None, "real_text": None, **kw})


def stream(args, vocab_size: int, eos: int, **kw) -> np.ndarray:
    return np.concatenate(list(tk.read_tokens(args, vocab_size, eos, **kw)))


def old_real_text(train_tokens: int, eval_tokens: int, vocab_size: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """``ple train``'s real text before ple.data.tokens (``finetune/data.py``'s ``real_text`` and
    ``vocabulary_map``), written out."""
    s = realtext.token_stream(train_tokens + eval_tokens, QWEN_EOT)
    train, held = s[:train_tokens], s[train_tokens:]
    values, counts = np.unique(train[train != QWEN_EOT], return_counts=True)
    keep = values[np.lexsort((values, -counts))][: vocab_size - 3]
    mapping = np.full(max(int(train.max(initial=0)), QWEN_EOT) + 1, 2, dtype=np.int64)
    mapping[keep] = np.arange(3, 3 + keep.size)
    mapping[QWEN_EOT] = eos
    return mapping[train], np.where(held < mapping.size, mapping[np.minimum(held, mapping.size - 1)], 2)


# ---------------------------------------------------------------------------------------------- options


def _token_actions(command: str) -> dict[str, tuple]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    acts = {a.dest: a for a in sub.choices[command]._actions}
    return {d: (acts[d].option_strings, acts[d].help, acts[d].type, acts[d].metavar) for d in OPTIONS}


def test_the_four_commands_declare_the_three_options_alike():
    eval_ = _token_actions("eval")
    assert eval_["real_text"][2] is positive_int and eval_["tokens"][0] == ["--tokens"]
    assert [eval_[d][3] for d in OPTIONS] == ["FILE", "FILE", "N"]
    for command in ("stats", "train", "demo"):
        assert _token_actions(command) == eval_, command


@pytest.mark.parametrize(
    ("argv", "source"),
    [
        (["--tokens", "t.npy"], tk.TokenSource("tokens", "t.npy")),
        (["--text", "notes.txt"], tk.TokenSource("text", "notes.txt")),
        (["--real-text", "4096"], tk.TokenSource("real_text", 4096)),
    ],
)
def test_each_option_parses_to_its_source(argv, source):
    p = argparse.ArgumentParser()
    tk.add_token_arguments(p)
    args = p.parse_args(argv)
    assert tk.token_source(args) == source and tk.given_source(args) == source
    assert str(source) == " ".join(argv) and source.describe() == {source.option: source.value}
    assert source.needs_tokenizer == (argv[0] != "--tokens")


@pytest.mark.parametrize(
    "argv", [[], ["--real-text", "0"], ["--real-text", "4k"], ["--tokens", "a", "--real-text", "5"]]
)
def test_a_required_token_input_refuses_none_a_bad_count_and_two(argv, capsys):
    p = argparse.ArgumentParser()
    tk.add_token_arguments(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args(argv)
    assert e.value.code == 2


def test_an_optional_token_input_falls_back_to_its_default():
    p = argparse.ArgumentParser()
    tk.add_token_arguments(p, required=False)
    args = p.parse_args([])
    assert tk.given_source(args) is None
    assert tk.token_source(args, real_text_default=1536) == tk.TokenSource("real_text", 1536)
    with pytest.raises(CommandLineError, match="no token input: give --tokens FILE, --text FILE or --real-text N"):
        tk.token_source(args)
    with pytest.raises(CommandLineError, match="--tokens a and --real-text 5: give one token input"):
        tk.token_source(ns(tokens="a", real_text=5))


# ---------------------------------------------------------------------------------------------- reading


def test_token_files_are_the_model_ids_as_they_are(tmp_path):
    ids = np.array([[5, 1023], [0, 7]], dtype=np.int32)
    np.save(tmp_path / "t.npy", ids)
    (tmp_path / "t.txt").write_text("5, 1023\n0 7")
    for name in ("t.npy", "t.txt"):
        got = stream(ns(tokens=str(tmp_path / name)), 1024, 1)
        assert got.dtype == np.int64 and got.tolist() == [5, 1023, 0, 7]
    with pytest.raises(InvalidArgumentError, match=r"t.npy: entry 1 is 1023, outside \[0, vocab_size=1000\)"):
        stream(ns(tokens=str(tmp_path / "t.npy")), 1000, 1)


def test_a_qwen_sized_vocabulary_gets_the_tokenizers_ids(tmp_path):
    eos = 248044
    assert stream(ns(real_text=3000), 248320, eos).tolist() == realtext.token_stream(3000, eos).tolist()
    f = tmp_path / "a.txt"
    f.write_text("The cat sat.\x0cOn the mat, again and again.\n")
    want = np.concatenate(list(realtext.tokenize_file(f, eos)))
    assert stream(ns(text=str(f)), 248320, eos).tolist() == want.tolist() and eos in want
    assert not tk.needs_map(tk.TOKENIZER_IDS) and tk.needs_map(tk.TOKENIZER_IDS - 1)


# Before ple.data.tokens, ple train's default stream (10 steps x 4 x 32 and 8 x 32 held out), mapped
# into the demo model's 1,024 ids (EOS 1): its hash, first ids, first held-out ids, unknown held-out ids.
OLD_TRAIN_STREAM = {
    (1280, 256, 1024): ("e8fcfbe283e7a879", [87, 13, 54, 17, 72, 4, 121, 399, 298, 103, 30, 10], [67, 36, 10, 2], 49),
    (300, 64, 40): ("7bb0cea654cd1e8a", [22, 8, 14, 5, 2, 3, 2, 2, 2, 29, 21, 35], [25, 2, 31, 2], 52),
}


@pytest.mark.parametrize("key", list(OLD_TRAIN_STREAM))
def test_real_text_reaches_a_small_vocabulary_as_ple_train_mapped_it(key):
    train_n, held_n, vocab = key
    digest, first, held_first, unknown = OLD_TRAIN_STREAM[key]
    got = stream(ns(real_text=train_n + held_n), vocab, 1, held_out=held_n)
    assert hashlib.sha256(got.astype("<i8").tobytes()).hexdigest()[:16] == digest
    assert got[:12].tolist() == first and got[train_n : train_n + 4].tolist() == held_first
    assert int((got[train_n:] == tk.UNKNOWN_ID).sum()) == unknown
    old_train, old_held = old_real_text(train_n, held_n, vocab, 1)
    assert got.tolist() == old_train.tolist() + old_held.tolist()


def test_ple_train_reads_its_default_stream_as_before():
    from ple.commands.train.loop import Options, default_tokens, token_streams

    opts = Options(steps=3, batch=2, length=16)
    assert default_tokens(opts) == 3 * 2 * 16 + 8 * 16
    train, held = token_streams(opts, 1024, 1)
    old_train, old_held = old_real_text(3 * 2 * 16, 8 * 16, 1024, 1)
    assert train.dtype == torch.int64 and train.tolist() == old_train.tolist() and held.tolist() == old_held.tolist()


def test_the_map_of_a_small_vocabulary():
    """Most frequent first (equal counts: smaller id first), from 3 on; the rest 2; end of text ->
    the model's EOS; a model EOS among the ids is skipped, never given to a text token."""
    toks = np.array([9, 5, 7, 5, 9, 5, 11, 20, 4], dtype=np.int64)  # 20: the end of text
    m = tk.vocabulary_map(toks, vocab_size=6, eos_in=20, eos_out=1)
    assert m.shape == (21,) and (m[5], m[9], m[4]) == (3, 4, 5) and m[7] == m[11] == m[0] == 2 and m[20] == 1
    m = tk.vocabulary_map(toks, vocab_size=6, eos_in=20, eos_out=4)
    assert (m[5], m[9], m[4], m[20]) == (3, 5, 2, 4)
    assert tk.apply_map(np.array([5, 20, 30]), m).tolist() == [3, 4, tk.UNKNOWN_ID]  # 30: past the map
    with pytest.raises(InvalidArgumentError, match="vocab_size 3 leaves no ids from 3 on"):
        tk.vocabulary_map(toks, vocab_size=3, eos_in=20, eos_out=1)


def test_a_text_file_is_mapped_from_all_of_it_streamed_in_blocks(tmp_path, monkeypatch):
    import functools

    f = tmp_path / "doc.txt"
    lines = "".join(f"w{i % 97} and {i % 13}\n" for i in range(3000))
    f.write_text(lines + "\x00" + lines[:2000])
    blocks = functools.partial(realtext.tokenize_file, block_bytes=1000)
    whole = np.concatenate(list(blocks(f, QWEN_EOT)))
    want = tk.apply_map(whole, tk.vocabulary_map(whole, 64, QWEN_EOT, 1))
    monkeypatch.setattr(realtext, "tokenize_file", blocks)
    chunks = list(tk.read_tokens(ns(text=str(f)), 64, 1))
    assert len(chunks) > 5  # counted in a first pass, mapped in a second, block by block
    got = np.concatenate(chunks)
    assert got.tolist() == want.tolist() and int((got == 1).sum()) == 1 and got.max() < 64 and got.min() >= 1


# ---------------------------------------------------------------------------------------------- commands


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's model as ``ple demo --only model --quick`` writes it (1,024 token ids)."""
    pytest.importorskip("transformers")
    from ple.integrations.demo_model import MODEL_SIZES, write_checkpoints

    root = tmp_path_factory.mktemp("tokens")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        write_checkpoints(root / "model", MODEL_SIZES["quick"], seed=0)
    finally:
        torch.set_num_threads(before)
    return root


def _eval(capsys, *argv: str) -> dict:
    rc = main(["eval", *argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_eval_on_the_demo_model_with_real_text_and_a_text_file(demo, tmp_path, capsys):
    """Both run on the 1,024-id model, and read the very ids ``read_tokens`` gives (a token file of
    them evaluates to the same numbers)."""
    model, tables = str(demo / "model" / "published"), str(demo / "tables")
    text = tmp_path / "notes.txt"
    text.write_text("A table of rows on disk, read a row at a time.\n" * 40)
    for source, args in ((["--real-text", "96"], ns(real_text=96)), (["--text", str(text)], ns(text=str(text)))):
        doc = _eval(capsys, model, *source, "--ctx", "32", "--table-dir", tables)
        ids = stream(args, 1024, 1)
        assert doc["windows"] == ids.size // 32 >= 3 and doc["source"] == tk.token_source(args).describe()
        np.save(tmp_path / "ids.npy", ids)
        same = _eval(capsys, model, "--tokens", str(tmp_path / "ids.npy"), "--ctx", "32", "--table-dir", tables)
        assert same["reference"]["nll"] == doc["reference"]["nll"]


def test_stats_on_the_demo_model_with_a_text_file(demo, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("the cat sat on the mat\n" * 50)
    assert main(["stats", str(demo / "model" / "published"), "--text", str(text), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == stream(ns(text=str(text)), 1024, 1).size == 50 * 7


def test_train_then_eval_of_its_adapter_on_the_text_it_trained_on(tmp_path, capsys):
    """The README's route, at its smallest: ``ple train`` keeps its adapter in WORKDIR, ``ple eval
    --adapter`` measures it with no Python, on the tokens it trained on (mapped alike)."""
    pytest.importorskip("transformers")
    work = tmp_path / "w"
    before = torch.get_num_threads()
    try:
        assert main(["train", "--steps", "2", "--batch", "1", "--length", "16", "--workdir", str(work), "--json"]) == 0
    finally:
        torch.set_num_threads(before)
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 32 and report["options"]["real_text"] is None
    doc = _eval(
        capsys, str(work / "published"), "--table-dir", str(work / "tables"),
        "--adapter", str(work / "adapter.safetensors"), "--real-text", "32", "--ctx", "16",
    )  # fmt: skip
    assert doc["windows"] == 2 and set(doc["variants"]) == {"adapter"}
    assert doc["variants"]["adapter"]["nll"] < doc["reference"]["nll"]


def test_train_takes_the_same_token_input(tmp_path, capsys):
    """``--tokens FILE`` trains on the file's ids (its last 8 x length held out); a stream too short
    for the held-out windows and a batch is refused before anything runs, naming what it needs."""
    pytest.importorskip("transformers")
    ids = np.random.default_rng(0).integers(3, 1024, 8 * 8 + 2 * 8)
    np.save(tmp_path / "t.npy", ids)
    before = torch.get_num_threads()
    try:
        argv = ["train", "--steps", "1", "--batch", "2", "--length", "8", "--json"]
        assert main([*argv, "--tokens", str(tmp_path / "t.npy")]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["options"]["tokens"] == str(tmp_path / "t.npy") and report["checks"]["tables_untouched"]
        assert main([*argv, "--real-text", "79"]) == 2
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == (
        "ple train: error: --real-text 79: 79 tokens; ple train holds out the last 8 x --length 8 = 64 and trains "
        "on the rest, which must hold --batch 2 windows of --length 8: give at least 80 tokens"
    )


def test_demo_serves_the_same_token_input(tmp_path, capsys):
    """The serving workload's stream is ``read_tokens``'s (a small vocabulary's text mapped, not
    folded); too short a stream is refused; the options are the serving workload's only."""
    from ple.commands.demo.serving import token_label, token_stream
    from ple.config import PLEConfig

    cfg = PLEConfig(
        hidden_size=16, hc_count=2, ple_layer_ids=(1,), ple_embed_dim=16, ngram_size=3, heads_per_ngram=2,
        vocab_size=500, ngram_vocab_size_base=300, make_ngram_vocab_size_divisible_by=16, split_ngram_parts=3,
        eos_token_id=1,
    )  # fmt: skip
    work = ns(real_text=5000, chunk=64, num_spec=3)
    assert token_stream(work, cfg).tolist() == stream(ns(real_text=5000), 500, 1).tolist()
    assert token_label(work) == "--real-text 5000" and token_label(ns()) == "real text"
    with pytest.raises(
        CommandLineError, match="--real-text 40: 40 tokens; the serving workload reads pieces of up to 64"
    ):
        token_stream(ns(real_text=40, chunk=64, num_spec=3), cfg)
    assert main(["demo", "--only", "model", "--real-text", "1000"]) == 2
    assert "--real-text 1000: the token input is the single-process serving workload's" in capsys.readouterr().err
