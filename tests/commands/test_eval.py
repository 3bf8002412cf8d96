"""``ple eval`` on the demo's model (fp8 tables in the published layout, and its fp32 plain copy):
the reference's perplexity is plain transformers', a format's KL divergence is the one computed
from two independently loaded models' logits, the checkpoint's own format costs nothing, an adapter
row is the model served with that adapter (several adapters: one row each, the model loaded once),
bad input is refused with the right exit status."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ple.commands.cli import main

pytest.importorskip("transformers")

CTX = 48
WINDOWS = 4


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's model (published fp8 checkpoint and fp32 plain copy), a token file of
    ``WINDOWS`` windows and a bit, and an adapter trained for two steps on those tokens."""
    from ple.integrations.demo_model import MODEL_SIZES, write_checkpoints

    root = tmp_path_factory.mktemp("eval")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        write_checkpoints(root / "model", MODEL_SIZES["quick"], seed=3)
        tokens = np.random.default_rng(7).integers(0, 1024, WINDOWS * CTX + CTX // 2)
        np.save(root / "tokens.npy", tokens)
        ids = torch.from_numpy(tokens[: 2 * CTX]).view(2, CTX)
        train_adapter(root / "model" / "published", root / "tables", ids, 0.5, root / "adapter.safetensors")
    finally:
        torch.set_num_threads(before)
    return {
        "published": root / "model" / "published",
        "plain": root / "model" / "plain",
        "tokens": root / "tokens.npy",
        "adapter": root / "adapter.safetensors",
        "tables": root / "tables",
        "ids": torch.from_numpy(tokens[: WINDOWS * CTX]).view(WINDOWS, CTX),
    }


def train_adapter(published: Path, tables: Path, ids: torch.Tensor, lr: float, path: Path) -> None:
    """An adapter of the model's tables trained for two SGD steps on ``ids`` (the rest frozen), saved to ``path``."""
    from ple.integrations.transformers import from_pretrained
    from ple.train import SGD, save_adapter, trainable

    model = from_pretrained(published, table_dir=tables)
    opt = SGD(trainable(model), lr=lr)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    save_adapter(path, model)


def run_eval(demo, capsys, *extra: str) -> dict:
    argv = ["eval", str(demo["published"]), "--tokens", str(demo["tokens"]), "--ctx", str(CTX)]
    argv += ["--table-dir", str(demo["tables"]), "--json", *extra]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def window_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """``[windows, ctx - 1, vocab]`` float64: each window run on its own, its last position dropped."""
    with torch.no_grad():
        return torch.stack([model(input_ids=w.view(1, -1)).logits[0, :-1].double() for w in ids])


def kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    lr, lv = ref_logits.log_softmax(-1), logits.log_softmax(-1)
    return (lr.exp() * (lr - lv)).sum(-1)


def nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return -logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


@pytest.fixture(scope="module")
def plain_logits(demo):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(demo["plain"], dtype=torch.float32).eval()
    return window_logits(model, demo["ids"])


def test_reference_and_formats_against_transformers(demo, capsys, plain_logits):
    """The reference's perplexity is plain transformers' on the fp32 copy over the same windows; q4_0's
    mean KL and same-top share are those of from_pretrained(table_format="q4_0")'s logits against
    the plain model's; the checkpoint's own format ("fp8") is the reference: KL 0, same top 1."""
    from ple.integrations.transformers import from_pretrained

    doc = run_eval(demo, capsys, "--formats", "fp8,q4_0")
    assert doc["ctx"] == CTX and doc["windows"] == WINDOWS and doc["predictions"] == WINDOWS * (CTX - 1)
    want_nll = float(nll(plain_logits, demo["ids"]).mean())
    ref = doc["reference"]
    assert ref["format"] == "fp8" and ref["bytes_per_row"] == 32
    assert ref["nll"] == pytest.approx(want_nll, rel=1e-4)
    assert ref["ppl"] == pytest.approx(math.exp(want_nll), rel=1e-4)

    q4 = from_pretrained(demo["published"], table_format="q4_0", table_dir=demo["tables"]).eval()
    q4_logits = window_logits(q4, demo["ids"])
    v = doc["variants"]["q4_0"]
    k = kl(plain_logits, q4_logits)
    assert float(k.mean()) > 1e-5  # a real difference, measured
    assert v["kld_mean"] == pytest.approx(float(k.mean()), rel=1e-3)
    assert v["kld_max"] == pytest.approx(float(k.max()), rel=1e-3)
    assert v["nll"] == pytest.approx(float(nll(q4_logits, demo["ids"]).mean()), rel=1e-4)
    same = (q4_logits.argmax(-1) == plain_logits.argmax(-1)).double().mean()
    assert abs(v["same_top"] - float(same)) <= 2 / doc["predictions"]  # a near tie may round either way
    p = lambda lg: lg.softmax(-1).gather(-1, demo["ids"][:, 1:, None])[..., 0]  # noqa: E731
    assert v["delta_p_mean"] == pytest.approx(float((p(q4_logits) - p(plain_logits)).mean()), abs=1e-6)
    assert v["bytes_per_row"] == 18 and v["table_bytes"] < ref["table_bytes"]

    same_fmt = doc["variants"]["fp8"]
    assert same_fmt["kld_mean"] == 0 and same_fmt["kld_max"] == 0 and same_fmt["same_top"] == 1.0
    assert same_fmt["nll"] == ref["nll"] and same_fmt["delta_p_mean"] == 0


def test_adapter_row_is_the_model_with_the_adapter(demo, capsys, plain_logits):
    """The adapter row's perplexity is from_pretrained(table_adapter=)'s over the same windows, and
    its KL the one from those logits against the reference's; the text report has one row a variant."""
    from ple.integrations.transformers import from_pretrained

    doc = run_eval(demo, capsys, "--adapter", str(demo["adapter"]))
    adapted = from_pretrained(demo["published"], table_dir=demo["tables"], table_adapter=demo["adapter"]).eval()
    logits = window_logits(adapted, demo["ids"])
    v = doc["variants"]["adapter"]
    assert v["nll"] == pytest.approx(float(nll(logits, demo["ids"]).mean()), rel=1e-4)
    k = kl(plain_logits, logits)
    assert float(k.mean()) > 1e-5
    assert v["kld_mean"] == pytest.approx(float(k.mean()), rel=1e-3)
    assert v["adapter_bytes"] == demo["adapter"].stat().st_size
    assert v["table_bytes"] == doc["reference"]["table_bytes"] + v["adapter_bytes"]

    rc = main(
        ["eval", str(demo["published"]), "--tokens", str(demo["tokens"]), "--ctx", str(CTX), "--table-dir",
         str(demo["tables"]), "--adapter", str(demo["adapter"]), "--formats", "q8_0"]
    )  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert [line.split()[0] for line in out[2:]] == ["reference", "q8_0", "adapter"]


TIMINGS = ("tokens_per_s", "forward_seconds", "compare_seconds")


@pytest.fixture(scope="module")
def two_adapters(demo, tmp_path_factory):
    """Two different adapters of the demo's model, in different folders: legal/legal.safetensors (the
    demo's adapter) and medical/medical.safetensors (trained on other tokens, at another rate)."""
    import shutil

    root = tmp_path_factory.mktemp("adapters")
    (root / "legal").mkdir()
    (root / "medical").mkdir()
    legal, medical = root / "legal" / "legal.safetensors", root / "medical" / "medical.safetensors"
    shutil.copy(demo["adapter"], legal)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_adapter(demo["published"], demo["tables"], demo["ids"][2:], 0.2, medical)
    finally:
        torch.set_num_threads(before)
    return legal, medical


def test_several_adapters_one_row_each_from_one_model(demo, capsys, monkeypatch, two_adapters):
    """Two --adapter: the model is loaded once and each adapter once; one variant an adapter, keyed by
    its file's stem, whose numbers are exactly those of ple eval with that adapter alone (the same
    reference, the same windows); the text report has one row a variant, named so."""
    import ple.commands.evaluate as evaluate
    import ple.train

    legal, medical = two_adapters
    calls = {"model": 0, "adapters": []}
    load, load_adapter = evaluate._load, ple.train.load_adapter

    def counted_load(*a, **k):
        calls["model"] += 1
        return load(*a, **k)

    def counted_adapter(model, path, *a, **k):
        calls["adapters"].append(Path(path))
        return load_adapter(model, path, *a, **k)

    monkeypatch.setattr(evaluate, "_load", counted_load)
    monkeypatch.setattr(ple.train, "load_adapter", counted_adapter)
    doc = run_eval(demo, capsys, "--formats", "q4_0", "--adapter", str(legal), "--adapter", str(medical))
    assert calls == {"model": 1, "adapters": [legal, medical]}
    assert list(doc["variants"]) == ["q4_0", "legal", "medical"]
    for path in (legal, medical):
        alone = run_eval(demo, capsys, "--adapter", str(path))
        assert alone["reference"]["nll"] == doc["reference"]["nll"]
        want = {k: v for k, v in alone["variants"]["adapter"].items() if k not in TIMINGS}
        got = {k: v for k, v in doc["variants"][path.stem].items() if k not in TIMINGS}
        assert got == want and got["adapter_bytes"] == path.stat().st_size
    assert calls["model"] == 3
    a, b = doc["variants"]["legal"], doc["variants"]["medical"]
    assert a["nll"] != b["nll"] and a["kld_mean"] > 1e-5 and b["kld_mean"] > 1e-5  # two real adapters

    argv = ["eval", str(demo["published"]), "--tokens", str(demo["tokens"]), "--ctx", str(CTX), "--table-dir"]
    argv += [str(demo["tables"]), "--adapter", str(medical), "--adapter", str(legal)]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[2:]] == ["reference", "medical", "legal"]


def test_several_adapters_refused_before_the_model_is_loaded(demo, capsys, monkeypatch, tmp_path, two_adapters):
    """Two --adapter of the same stem, or a stem naming a format compared: exit 2 naming the paths; a
    missing file or one that is no adapter: exit 2 naming it; an adapter of another layout: exit 1
    naming it. Each before the model is loaded."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    import ple.commands.evaluate as evaluate

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(evaluate, "_load", no_load)
    legal, medical = two_adapters
    other = tmp_path / "other" / "legal.safetensors"
    other.parent.mkdir()
    shutil.copy(medical, other)
    q4 = tmp_path / "q4_0.safetensors"
    shutil.copy(medical, q4)
    with safe_open(str(medical), "pt") as f:  # the same rows, recorded for another layout
        tensors, md = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    layers = json.loads(md["layers"])
    layers[0]["layout_hash"] = "0" * 64
    save_file(tensors, str(tmp_path / "foreign.safetensors"), {**md, "layers": json.dumps(layers)})

    base = ["eval", str(demo["published"]), "--tokens", str(demo["tokens"]), "--ctx", str(CTX)]
    base += ["--table-dir", str(demo["tables"])]
    cases = [
        ([legal, medical, other], 2, f"--adapter {legal} and --adapter {other}: the same stem 'legal'"),
        ([q4, legal], 2, f"--adapter {q4}: its stem 'q4_0' is the name of a format of --formats's row"),
        ([legal, tmp_path / "missing.safetensors"], 2, f"--adapter {tmp_path / 'missing.safetensors'}: no such file"),
        ([legal, demo["tokens"]], 2, f"--adapter {demo['tokens']}: "),
        ([legal, tmp_path / "foreign.safetensors"], 1, f"{tmp_path / 'foreign.safetensors'}: PLE layer 0 was trained "),
    ]
    for files, status, message in cases:
        argv = [*base, "--formats", "q4_0"] + [x for f in files for x in ("--adapter", str(f))]
        assert main(argv) == status, files
        err = capsys.readouterr().err
        last = err.splitlines()[-1]  # after the usage (exit 2), or the one line (exit 1)
        assert message in last and last.startswith("ple eval: error: " if status == 2 else "ple eval: "), err
        assert status == 2 or err == last + "\n"
    assert main([*base, "--adapter", str(tmp_path / "foreign.safetensors")]) == 1  # one adapter: checked alike
    assert "another layout or table" in capsys.readouterr().err


def test_every_tier_gives_the_same_numbers(demo, capsys):
    """Lookups are bit-exact on every tier: the tables served with a row cache or read directly
    within a 1 MB budget give the memory map's numbers exactly."""
    keys = ("nll", "kld_mean", "kld_max", "same_top", "delta_p_mean")
    runs = {}
    for tier in (["--tier", "mmap"], ["--tier", "cached"], ["--tier", "direct", "--memory-budget", "1MiB"]):
        doc = run_eval(demo, capsys, "--formats", "q4_0", "--adapter", str(demo["adapter"]), *tier)
        assert doc["tier"] == tier[1]
        runs[tier[1]] = [doc["reference"]["nll"]] + [v[k] for v in doc["variants"].values() for k in keys]
    assert runs["cached"] == runs["mmap"] and runs["direct"] == runs["mmap"]


def test_the_pytorch_passes_give_the_c_kernels_numbers(demo, capsys, monkeypatch):
    """Where the C kernels are unavailable the PyTorch passes run (the same forwards): the same
    perplexities and tops, KL within float32 log-softmax rounding, the checkpoint's own format 0."""
    import ple.commands.evaluate
    from ple.kernels import native as _native

    if not _native.available():
        pytest.skip("the C kernels do not build here")
    runs = {}
    for path in ("c", "pytorch"):
        if path == "pytorch":
            monkeypatch.setattr(ple.commands.evaluate, "_native_lib", lambda: None)
        runs[path] = run_eval(demo, capsys, "--formats", "fp8,q4_0")
    c, t = runs["c"], runs["pytorch"]
    assert t["reference"]["nll"] == pytest.approx(c["reference"]["nll"], rel=1e-6)
    for name in ("fp8", "q4_0"):
        a, b = c["variants"][name], t["variants"][name]
        assert b["nll"] == pytest.approx(a["nll"], rel=1e-6)
        assert b["kld_mean"] == pytest.approx(a["kld_mean"], rel=1e-3, abs=1e-9)
        assert abs(b["same_top"] - a["same_top"]) <= 2 / c["predictions"]
        assert b["delta_p_mean"] == pytest.approx(a["delta_p_mean"], abs=1e-6)
    assert c["variants"]["fp8"]["kld_max"] == 0 and t["variants"]["fp8"]["kld_max"] == 0
    assert c["variants"]["q4_0"]["kld_mean"] > 1e-5


def test_json_document_shape(demo, capsys, tmp_path):
    out = tmp_path / "eval.json"
    doc = run_eval(demo, capsys, "--formats", "q8_0", "--output", str(out))
    assert json.loads(out.read_text()) == doc
    assert set(doc["reference"]) >= {"format", "ppl", "nll", "bytes_per_row", "table_bytes", "tokens_per_s"}
    keys = {"ppl", "nll", "kld_mean", "kld_median", "kld_p99", "kld_p999", "kld_max", "same_top", "delta_p_mean"}
    assert set(doc["variants"]) == {"q8_0"} and set(doc["variants"]["q8_0"]) >= keys | {"bytes_per_row", "table_bytes"}
    assert doc["variants"]["q8_0"]["tokens"] == doc["predictions"] and doc["peak_rss_bytes"] > 0


def test_refused_inputs(demo, capsys, tmp_path):
    """A token id past the vocabulary in a token file: exit 1 naming it (a bad value inside a file, as
    every command reads token files); an unknown format: exit 2 naming the value; a missing file: 1."""
    bad = np.arange(200) % 1024
    bad[70] = 1024
    np.save(tmp_path / "bad.npy", bad)
    base = ["eval", str(demo["published"]), "--ctx", str(CTX), "--table-dir", str(demo["tables"])]
    assert main([*base, "--tokens", str(tmp_path / "bad.npy")]) == 1
    err = capsys.readouterr().err
    assert err == f"ple eval: token file {tmp_path / 'bad.npy'}: entry 70 is 1024, outside [0, vocab_size=1024)\n"
    assert main([*base, "--tokens", str(demo["tokens"]), "--formats", "q4_0,q3_k"]) == 2
    assert "'q3_k' is not a table format" in capsys.readouterr().err
    assert main([*base, "--tokens", str(tmp_path / "missing.npy")]) == 1
    assert main([*base, "--tokens", str(demo["tokens"]), "--ctx", "100000"]) == 2
    n = np.load(demo["tokens"]).size
    assert (
        f"--ctx 100000: the token stream holds {n} tokens, fewer than one window of 100000" in capsys.readouterr().err
    )


def test_outputs_are_checked_before_the_work_and_never_written_over_an_input(demo, capsys, tmp_path):
    """--output / --plot over one of the inputs, in a missing folder, on a folder or twice the same file:
    refused before anything is loaded (exit 1, a path that cannot be written; naming the flag), every
    input unchanged; a report whose
    file fails to be written at the end has reached stdout first."""
    base = ["eval", str(demo["published"]), "--ctx", str(CTX), "--table-dir", str(demo["tables"])]
    base += ["--tokens", str(demo["tokens"])]
    weights = sorted(Path(demo["published"]).glob("*.safetensors"))[0]
    before = weights.read_bytes()
    cases = [
        (["--output", str(weights)], f"--output {weights}: one of the command's inputs"),
        (["--output", str(demo["tokens"])], f"--output {demo['tokens']}: one of the command's inputs"),
        (["--plot", str(tmp_path / "missing" / "x.png")], f"--plot {tmp_path / 'missing' / 'x.png'}: its folder"),
        (["--output", str(tmp_path)], f"--output {tmp_path}: is a folder"),
        (["--output", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.json")], "the same file as --output"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 1, extra
        assert message in capsys.readouterr().err
    assert weights.read_bytes() == before
    assert main([*base, "--json", "--output", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == json.loads((tmp_path / "report.json").read_text())


def test_windows_drop_the_incomplete_tail():
    from ple.commands.evaluate import token_windows

    chunks = [np.arange(5), np.arange(5, 12), np.arange(12, 13)]
    got = [w.tolist() for w in token_windows(chunks, 4)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def readme_commands() -> list[list[str]]:
    """The command lines of the README's "Choosing a table format"."""
    import re
    import shlex

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text[text.index("## Choosing a table format") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block is not None
    return [shlex.split(ln) for ln in block.group(1).splitlines() if ln.strip()]


@pytest.mark.slow
def test_the_readme_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """On the demo's model at demo/model/published (as ``ple demo --only model --quick --workdir demo``
    writes it; 1,024 token ids, so the text reaches it through the vocabulary map), from a folder
    holding the README: each exits 0 with one report row per variant, over the predictions its text
    gives, and the plot is written."""
    import shutil

    from ple.integrations.demo_model import MODEL_SIZES, write_checkpoints

    pytest.importorskip("matplotlib")
    pytest.importorskip("tiktoken")
    commands = readme_commands()
    assert [c[:3] for c in commands] == [["ple", "eval", "demo/model/published"]] * 2
    assert "--real-text" in commands[0] and "--text" in commands[1]
    write_checkpoints(tmp_path / "demo" / "model", MODEL_SIZES["quick"], seed=0)
    shutil.copy(Path(__file__).resolve().parents[2] / "README.md", tmp_path / "README.md")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    for argv in commands:
        assert main([*argv[1:], "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        formats = argv[argv.index("--formats") + 1].split(",")
        assert sorted(doc["variants"]) == sorted(formats) and doc["predictions"] > 0
        assert doc["reference"]["ppl"] > 1 and all(v["kld_mean"] > 0 for v in doc["variants"].values())
    assert doc["source"] == {"text": "README.md"}
    assert (tmp_path / "formats.png").stat().st_size > 0
