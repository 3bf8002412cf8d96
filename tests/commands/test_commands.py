"""ple convert / verify / stats, end to end on small synthesized checkpoints (``ple demo``: tests/demo)."""

import json
import re

import pytest
import torch

from ple.commands.cli import main
from ple.commands.demo import synthesize_checkpoint
from ple.config import PLEConfig
from ple.ngram import fresh_context, reference
from ple.table import MmapTable
from tests.conftest import SMALL


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    cfg = PLEConfig(**SMALL)
    return cfg, synthesize_checkpoint(cfg, tmp_path_factory.mktemp("ckpt"), seed=3, files=3)


def test_convert_then_verify_and_lookup(small_checkpoint, tmp_path, capsys):
    cfg, ckpt = small_checkpoint
    out = tmp_path / "tables"
    assert main(["convert", str(ckpt), str(out)]) == 0
    files = sorted(out.glob("*.pletable"))
    assert [f.name for f in files] == [
        "model.language_model.layers.1.ple.pletable",
        "model.language_model.layers.2.ple.pletable",
    ]
    for f in files:
        assert main(["verify", str(f), "--checkpoint", str(ckpt)]) == 0
    # the file serves exactly the rows the loader assembles
    from ple.checkpoint import load_ple_weights

    w = load_ple_weights(ckpt, cfg)
    for idx, f in enumerate(files):
        t = MmapTable.open(f)
        ids = torch.randint(0, cfg.layout(idx).padded_rows, (17, cfg.num_heads))
        assert torch.equal(t.lookup(ids, torch.float32), w[idx].table.lookup(ids, torch.float32))
    # the same conversion again keeps the file its record vouches for; another is no overwrite without --force
    capsys.readouterr()
    assert main(["convert", str(ckpt), str(out), "--layers", "0"]) == 0
    assert "PLE layer 0: kept" in capsys.readouterr().err
    assert main(["convert", str(ckpt), str(out), "--layers", "0", "--to", "int8"]) == 1
    assert "exists and is not kept (it holds fp8 rows, not int8_row): pass --force to replace it" in (
        capsys.readouterr().err
    )
    assert main(["convert", str(ckpt), str(out), "--layers", "0", "--force"]) == 0


def test_verify_reports_flipped_byte(small_checkpoint, tmp_path, capsys):
    cfg, ckpt = small_checkpoint
    out = tmp_path / "t"
    assert main(["convert", str(ckpt), str(out), "--layers", "1"]) == 0
    (f,) = out.glob("*.pletable")
    header = MmapTable.open(f).header
    lay = cfg.layout(1)
    shard = 3
    row = lay.shard_range(shard)[0] + 5
    pos = header["data_offset"] + row * header["row_nbytes"] + 2
    with open(f, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0x10]))
    capsys.readouterr()
    assert main(["verify", str(f)]) == 1
    text = capsys.readouterr().out
    assert f"shard {shard}" in text


def test_convert_to_int8_reports_error(small_checkpoint, tmp_path, capsys):
    cfg, ckpt = small_checkpoint
    capsys.readouterr()
    assert main(["convert", str(ckpt), str(tmp_path), "--to", "int8", "--layers", "0"]) == 0
    text = capsys.readouterr().out
    assert "quantization error" in text
    per_head = re.findall(r"^\s*head\s+(\d+):\s+max\s+(\S+)\s+rms\s+(\S+)\s*$", text, re.MULTILINE)
    assert [int(h) for h, _, _ in per_head] == list(range(cfg.num_heads))
    assert main(["convert", str(ckpt), str(tmp_path / "again"), "--to", "int8", "--layers", "0", "--json"]) == 0
    (layer,) = json.loads(capsys.readouterr().out)["layers"]
    want = [(f"{r['max_rel']:.3e}", f"{r['rms_rel']:.3e}") for r in layer["per_head"]]
    assert [(mx, rms) for _, mx, rms in per_head] == want  # the text shows the JSON document's numbers
    assert all(0 < float(v) < 0.02 for row in want for v in row), want  # int8 with one scale per row
    (f,) = tmp_path.glob("*.pletable")
    assert MmapTable.open(f).format == "int8_row"
    assert main(["verify", str(f), "--checkpoint", str(ckpt)]) == 0


def test_stats_counts_rows_and_collisions(tmp_path, capsys):
    cfg = PLEConfig(**SMALL)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 40, (3000,), generator=g)
    tokens[::37] = cfg.eos_token_id
    (tmp_path / "tokens.txt").write_text(",".join(map(str, tokens.tolist())))
    capsys.readouterr()
    assert main(["stats", str(tmp_path), "--tokens", str(tmp_path / "tokens.txt"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    lay = cfg.layout(0)
    ids = reference.ngram_ids(tokens, torch.tensor([0, len(tokens)]), fresh_context(1, lay, 2), lay, 2)
    windows = reference.ngram_tokens(tokens.tolist(), 3, 2)
    for h in res["heads"]:
        g_ = h["head"]
        col = ids[:, g_].tolist()
        assert h["distinct_rows"] == len(set(col))
        grams = {(r, tuple(w[: h["order"]])) for r, w in zip(col, windows)}
        assert h["distinct_ngrams"] == len(grams)
        per_row = {}
        for r, _ in grams:
            per_row[r] = per_row.get(r, 0) + 1
        assert h["shared_rows"] == sum(1 for v in per_row.values() if v > 1)
        assert h["max_bucket_load"] == max(per_row.values())
        assert 0 < h["top1_share"] <= h["top10_share"] <= 1
    assert res["total"]["distinct_rows"] == len(set(ids.reshape(-1).tolist()))


def test_layer_from_checkpoint_with_a_table_file(small_checkpoint, tmp_path):
    from ple.checkpoint import load_ple_weights
    from ple.layer import PLELayer
    from ple.runtime import Batch

    cfg, ckpt = small_checkpoint
    assert load_ple_weights(ckpt, cfg, with_table=False)[1].table is None
    assert main(["convert", str(ckpt), str(tmp_path), "--layers", "1"]) == 0
    (f,) = tmp_path.glob("*.pletable")
    in_memory = PLELayer.from_checkpoint(ckpt, cfg, ple_layer_index=1)
    mapped = PLELayer.from_checkpoint(ckpt, cfg, ple_layer_index=1, table=MmapTable.open(f))
    assert isinstance(mapped.table, MmapTable)
    tokens = torch.tensor([5, 9, 2, 7, 7, 11])
    hidden = torch.randn(6, cfg.hc_hidden_size)
    outs = []
    for layer in (in_memory, mapped):
        batch = Batch.build([4, 2], [0, 1], torch.full((2, 2), cfg.eos_token_id), layer.new_state_pool(2))
        outs.append(layer(hidden, tokens, batch))
    assert torch.equal(outs[0], outs[1])
