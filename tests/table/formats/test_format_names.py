"""One vocabulary of table formats: every name ple prints for a format (the one table of
:mod:`ple.table.formats.catalog`) is accepted wherever a format is given and means the same format there:
``ple convert --to``, ``ple eval --formats``, ``ple demo --table-format``, ``ple train
--table-format`` and ``from_pretrained(table_format=)``; the kernels' codes, GGML types and fp16
fields other modules use are the table's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ple.commands.cli import build_parser, main
from ple.commands.demo import synthesize_checkpoint
from ple.commands.evaluate import parse_formats
from ple.config import PLEConfig
from ple.errors import InvalidArgumentError
from ple.table import MmapTable
from ple.table.files.transcode import convert_layer, target_format
from ple.table.formats.catalog import (
    BLOCK_FORMATS,
    FORMAT_NAMES,
    FORMATS,
    accepted_names,
    format_info,
    resolve_format,
)
from ple.table.formats.quantize import quantize_rows
from tests.conftest import SMALL

NATIVE = Path(__file__).resolve().parents[3] / "src" / "ple" / "kernels" / "native"
WIDE = {**SMALL, "ple_embed_dim": 128}  # head_dim 32: every block format fits
ACCEPTED = "bf16, fp16, fp32, fp8, fp8_row, int8_row (or int8), q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl, mxfp4, nvfp4"


def test_the_names_ple_prints_and_their_aliases():
    assert FORMATS == (
        "bf16", "fp16", "fp32", "fp8", "fp8_row", "int8_row",
        "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "mxfp4", "nvfp4",
    )  # fmt: skip
    assert sorted(FORMAT_NAMES) == sorted([*FORMATS, "int8"])
    assert accepted_names() == ACCEPTED
    for name in FORMATS:
        assert resolve_format(name) == name and format_info(name).name == name
    assert resolve_format("int8") == "int8_row"
    with pytest.raises(InvalidArgumentError) as e:
        resolve_format("q3_k", "--to")
    assert str(e.value) == f"--to: 'q3_k' is not a table format; accepted names: {ACCEPTED}"
    with pytest.raises(InvalidArgumentError, match="unknown table format 'int8'"):
        format_info("int8")  # what a table stores is a canonical name: an alias is no header format


def _enum(source: str, first: str) -> list[str]:
    """The names of the C enum whose first member is ``first`` (``T_Q8_0 = 0, T_Q5_1, ...``), in order."""
    m = re.search(r"enum \{ (" + first + r" = 0, [^}]*)\}", source)
    assert m is not None, first
    return [n.strip().split(" ")[0] for n in m.group(1).split(",") if n.strip()]


def test_the_kernel_codes_are_the_kernels_numbers():
    """The table's kernel codes are the numbers the C kernels give the formats (ple_quant.c's lookup,
    ple_encode.c's targets), and every module reads its numbers from the table."""
    from ple.checkpoint import gguf
    from ple.table.formats import encode

    quant = _enum((NATIVE / "ple_quant.c").read_text(), "F_Q8_0")
    enc = _enum((NATIVE / "ple_encode.c").read_text(), "T_Q8_0")
    assert [n[2:].lower() for n in quant] == list(BLOCK_FORMATS)
    for code, name in enumerate(enc):
        assert format_info(name[2:].lower()).kernel_code == code
    assert {f for f in FORMATS if format_info(f).kernel_code is not None} == {n[2:].lower() for n in enc}
    assert encode._TARGETS == {n[2:].lower(): code for code, n in enumerate(enc)}
    assert gguf.GGML_FORMATS == {0: "fp32", 1: "fp16", 30: "bf16", 8: "q8_0", 7: "q5_1", 6: "q5_0", 3: "q4_1",
                                 2: "q4_0", 20: "iq4_nl", 39: "mxfp4"}  # fmt: skip
    fields = {f: format_info(f).fp16_fields for f in FORMATS if format_info(f).fp16_fields}
    assert fields == {"q8_0": (0,), "q5_1": (0, 2), "q5_0": (0,), "q4_1": (0, 2), "q4_0": (0,), "iq4_nl": (0,)}


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_name_is_accepted_by_every_command_line(name):
    want = resolve_format(name)
    parser = build_parser()
    assert parser.parse_args(["convert", "CK", "OUT", "--to", name]).to == want
    assert parse_formats(parser.parse_args(["eval", "CK", "--tokens", "T", "--formats", name]).formats) == [want]
    assert parser.parse_args(["demo", "--table-format", name]).table_format == want
    assert parser.parse_args(["train", "--table-format", name]).table_format == want


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "CK", "OUT", "--to", "q3_k"],
        ["demo", "--table-format", "q3_k"],
        ["train", "--table-format", "q3_k"],
        ["eval", "CK", "--tokens", "T", "--formats", "q4_0,q3_k"],
    ],
)
def test_an_unknown_name_is_a_usage_error_listing_the_names(argv, capsys):
    """argparse refuses the option's value (SystemExit 2), ``ple eval`` the list it parses (exit status 2)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: ple {argv[0]} ")
    assert f"'q3_k' is not a table format; accepted names: {ACCEPTED}\n" in err


def test_a_name_given_twice_under_two_names_is_refused():
    from ple.errors import CommandLineError

    with pytest.raises(CommandLineError, match=r"--formats: int8_row \(int8, int8_row\) named more than once"):
        parse_formats("q4_0,int8,int8_row")


def test_what_each_name_converts_to():
    """``--to NAME`` of a table in each format: the format NAME names (a copy when the table has it),
    but fp8, which is only copied (fp8_row from the others; a table in fp8_row is copied too)."""
    for source in FORMATS:
        for name in FORMAT_NAMES:
            want = resolve_format(name)
            got = target_format(name, source)
            if want == "fp8":
                assert got == (None if source in ("fp8", "fp8_row") else "fp8_row"), source
            else:
                assert got == (None if source == want else want), (name, source)
    with pytest.raises(InvalidArgumentError) as e:
        target_format("fp4", "fp8")
    assert str(e.value) == f"'fp4' is not a table format; accepted names: {ACCEPTED}"


# ---------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    cfg = PLEConfig(**WIDE)
    return cfg, synthesize_checkpoint(cfg, tmp_path_factory.mktemp("ckpt"), seed=7, files=1)


def _convert(capsys, ckpt, out, name) -> dict:
    capsys.readouterr()
    assert main(["convert", str(ckpt), str(out), "--layers", "0", "--to", name, "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)["layers"]
    return doc


def _inspected_format(capsys, path) -> str:
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["format"]


@pytest.mark.parametrize("name", FORMATS)
def test_convert_to_every_printed_name_of_the_fp8_checkpoint(wide_checkpoint, tmp_path, capsys, name):
    """Of the published fp8 checkpoint, ``--to NAME`` writes a table in the format NAME, which ``ple
    inspect`` prints back as NAME, and which ``ple verify`` finds equal to the checkpoint converted."""
    cfg, ckpt = wide_checkpoint
    doc = _convert(capsys, ckpt, tmp_path, name)
    assert (doc["source_format"], doc["format"]) == ("fp8", name)
    assert (doc["error"]["max_rel"] == 0) == (name in ("fp8", "fp32"))  # a copy, or exact in fp32
    path = Path(doc["path"])
    assert _inspected_format(capsys, path) == name
    capsys.readouterr()
    assert main(["verify", str(path), "--checkpoint", str(ckpt)]) == 0


def test_an_alias_writes_the_file_its_format_writes(wide_checkpoint, tmp_path, capsys):
    """``--to int8`` is ``--to int8_row``, byte for byte; ``--to fp8_row`` requantizes the fp8 table with
    a scale per row (``--to fp8`` copies it); bf16 holds the fp8 values rounded once."""
    from ple.checkpoint import load_ple_weights

    cfg, ckpt = wide_checkpoint
    a = MmapTable.open(_convert(capsys, ckpt, tmp_path / "a", "int8")["path"])
    b = MmapTable.open(_convert(capsys, ckpt, tmp_path / "b", "int8_row")["path"])
    assert a.format == b.format == "int8_row"
    assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
    source = load_ple_weights(ckpt, cfg)[0].table
    x = source.data.float() * source.scale.float()
    row = MmapTable.open(_convert(capsys, ckpt, tmp_path / "c", "fp8_row")["path"])
    q, s = quantize_rows(x, "fp8_row")
    assert row.format == "fp8_row"
    assert torch.equal(row.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(row.scale, s)
    same = MmapTable.open(_convert(capsys, ckpt, tmp_path / "d", "fp8")["path"])
    assert same.format == "fp8" and torch.equal(same.data.view(torch.uint8), source.data.view(torch.uint8))
    bf = MmapTable.open(_convert(capsys, ckpt, tmp_path / "e", "bf16")["path"])
    assert bf.format == "bf16" and bf.scale is None and torch.equal(bf.data, x.to(torch.bfloat16))


def test_a_value_past_fp16_is_refused_naming_its_row(tmp_path):
    rows = torch.zeros(6, 32)
    rows[4, 3] = 1e5
    with pytest.raises(InvalidArgumentError) as e:
        convert_layer([(0, rows, None)], tmp_path / "t.pletable", "0" * 32, 6, 32, 6, to="fp16", progress=False)
    assert str(e.value) == (
        "source shard 0: cannot convert table row 4 to fp16: column 3 holds 100000, past fp16's largest finite "
        "value 65504: choose a format with a scale (fp8, int8, a block format) or a wider one"
    )
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- the model


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The demo's model, small: its published checkpoint (fp8 tables), its fp32 copy and a token file."""
    pytest.importorskip("transformers")
    from ple.integrations.demo_model import write_checkpoints

    root = tmp_path_factory.mktemp("names")
    write_checkpoints(root / "model", 2000, seed=5)
    np.save(root / "tokens.npy", np.random.default_rng(3).integers(0, 1024, 3 * 24))
    return root


def _eval(capsys, root, checkpoint, formats: str) -> dict:
    capsys.readouterr()
    argv = ["eval", str(root / "model" / checkpoint), "--tokens", str(root / "tokens.npy"), "--ctx", "24"]
    assert main([*argv, "--table-dir", str(root / f"tables-{checkpoint}"), "--formats", formats, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_takes_back_every_name_it_prints(model, capsys, one_thread):
    """``ple eval`` names each variant by its format; those names, and the reference's format, given
    back to ``--formats`` are the same variants (the same numbers; the reference's own format costs
    nothing)."""
    first = _eval(capsys, model, "published", "int8,fp8_row,bf16")
    assert first["reference"]["format"] == "fp8"
    assert {k: v["format"] for k, v in first["variants"].items()} == {
        "int8_row": "int8_row",
        "fp8_row": "fp8_row",
        "bf16": "bf16",
    }
    printed = [first["reference"]["format"], *first["variants"]]
    again = _eval(capsys, model, "published", ",".join(printed))
    assert list(again["variants"]) == printed
    assert again["variants"]["fp8"]["format"] == "fp8" and again["variants"]["fp8"]["kld_max"] == 0
    for name in first["variants"]:
        assert again["variants"][name]["kld_mean"] == first["variants"][name]["kld_mean"], name
        assert again["variants"][name]["ppl"] == first["variants"][name]["ppl"], name
    assert first["variants"]["fp8_row"]["kld_mean"] > 0  # requantized, not the reference's table


def test_fp8_of_a_table_in_another_format_is_fp8_row(model, capsys, one_thread):
    """Of the fp32 copy, "fp8" is served as fp8_row, what "fp8_row" names: the same numbers."""
    doc = _eval(capsys, model, "plain", "fp8,fp8_row,fp32")
    assert doc["reference"]["format"] == "fp32"
    v = doc["variants"]
    assert (v["fp8"]["format"], v["fp8_row"]["format"], v["fp32"]["format"]) == ("fp8_row", "fp8_row", "fp32")
    assert v["fp8"]["kld_mean"] == v["fp8_row"]["kld_mean"] > 0 and v["fp32"]["kld_max"] == 0


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_from_pretrained_takes_every_name(model, monkeypatch, name):
    """``from_pretrained(table_format=NAME)`` serves the format ``ple convert --to NAME`` writes of the
    same table (checked for every layer before any file is made)."""
    import ple.integrations.transformers as hf
    from ple.checkpoint import scan_checkpoint

    class Stop(Exception):
        pass

    asked = []

    def prepare(entry, config, folder, *, progress=False, table_format=None):
        asked.append((entry.table_format, hf.served_format(entry, config, table_format)))
        raise Stop

    monkeypatch.setattr(hf, "prepare_table", prepare)
    ckpt = model / "model" / "published"
    with pytest.raises(Stop):
        hf.from_pretrained(ckpt, table_dir=model / "unused", table_format=name)
    want = target_format(name, "fp8") or "fp8"
    assert asked == [("fp8", want)]
    assert want == (resolve_format(name) if name != "fp8" else "fp8")
    config = PLEConfig.from_pretrained(ckpt)
    for e in scan_checkpoint(ckpt, config).layers:
        assert hf.served_format(e, config, name) == want
    assert not (model / "unused").exists()


def test_from_pretrained_refuses_an_unknown_name(model):
    from ple.integrations.transformers import from_pretrained

    with pytest.raises(InvalidArgumentError) as e:
        from_pretrained(model / "model" / "published", table_dir=model / "unused", table_format="q3_k")
    assert str(e.value) == f"table_format: 'q3_k' is not a table format; accepted names: {ACCEPTED}"
