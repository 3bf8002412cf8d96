"""One judge of what a path is (:mod:`ple.checkpoint.classify`), and one rule of table identity.

- Every kind: a published checkpoint, a config without weights, a training checkpoint (transformers'
  ``Trainer``'s ``checkpoint-N`` folder, a ``save_pretrained`` of a model whose tables train), a table
  folder, a table file, a merged table, an adapter, a GGUF file, and paths that are not ple's.
- A Trainer checkpoint is a training checkpoint everywhere: ``ple inspect`` describes it (exit 0, text
  and ``--json``); ``from_pretrained``, ``ple convert``, ``ple eval`` and ``ple verify --checkpoint``
  refuse it with the one message that says how to load it.
- A merged table is never converted over or overwritten: ``from_pretrained(ckpt, table_dir=F)`` over
  ``merge_model(model, F)``'s folder serves the merged files as they are (same inodes, times and
  bytes; the same logits as the merged model); another checkpoint's start and ``ple convert --force``
  into that folder are refused, naming it, and leave it as it was.
- An adapter trained over the checkpoint's fp8 table merges into the q4_0 table ``ple convert --to
  q4_0`` made of that checkpoint (its trained rows requantized, the others the conversion's bytes);
  another checkpoint's table is refused naming both; an adapter trained over a merged table merges
  only into a table with the same merges.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ple.checkpoint import classify as paths
from ple.commands.cli import main
from ple.config import PLEConfig
from ple.errors import InvalidArgumentError, UsageError
from ple.integrations.demo_model import save_published
from ple.integrations.transformers import from_pretrained, patched_layers
from ple.table import MmapTable, read_table_header
from ple.train import (
    CombinedOptimizer,
    SparseAdam,
    merge_model,
    merge_table_file,
    read_adapter,
    save_adapter,
    trainable,
)
from ple.train.merge import requantize
from tests.checkpoint.test_gguf_hostile import WIDE, write_gguf
from tests.integrations.conftest import _one_thread  # noqa: F401 (autouse: one torch thread, as the tiny models want)
from tests.integrations.helpers import EOS, VOCAB, generate, tiny_config, tiny_model

CFG = tiny_config(ple_embed_dim=128)  # head_dim 32: whole q4_0 blocks
P0, P1 = "model.layers.0.ple.pletable", "model.layers.1.ple.pletable"


def _train(model, steps: int = 2, seed: int = 0):
    model.requires_grad_(False)  # the tables alone train
    opt = SparseAdam(trainable(model), lr=0.1)
    for i in range(steps):
        ids = torch.randint(EOS + 1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(seed + i))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _published(path: Path, seed: int) -> Path:
    save_published(tiny_model(CFG, seed=seed), path)  # fp8 tables, one global scale: the published layout
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two fp8 checkpoints of one layout; a model of the first trained over its table folder: its adapter,
    its state dict while training (``save_pretrained``), and ``merge_model``'s folder."""
    root = tmp_path_factory.mktemp("judge")
    ck, other = _published(root / "ck", 1), _published(root / "other", 2)
    model = _train(from_pretrained(ck, table_dir=root / "tables"))
    adapter = save_adapter(root / "adapter.safetensors", model)
    model.save_pretrained(root / "state")
    rows = [w.layer.table.overlay.range(0, w.layer.table.rows)[0].numel() for w in patched_layers(model)]
    merge_model(model, root / "merged")
    model.eval()
    return SimpleNamespace(
        root=root, ck=ck, other=other, tables=root / "tables", adapter=adapter, model=model, rows=rows,
        state=root / "state", merged=root / "merged",
    )  # fmt: skip


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _stat(folder: Path) -> dict[str, tuple]:
    """Each table file of ``folder``: inode, modification and change times, and the sha256 of its bytes."""
    out = {}
    for p in sorted(folder.glob("*.pletable")):
        st = p.stat()
        out[p.name] = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


# ---------------------------------------------------------------------------------------------- kinds
def test_each_kind_of_path(world, tmp_path):
    ck = paths.classify(world.ck)
    assert ck.kind == paths.CHECKPOINT and ck.weights == world.ck and ck.config is not None
    assert ck.config.ple_layer_ids == (1, 2) and ck.trained == ()
    assert paths.classify(world.ck / "model.safetensors").kind == paths.CHECKPOINT

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_bytes((world.ck / "config.json").read_bytes())
    only = paths.classify(tmp_path / "cfg")
    assert only.kind == paths.CONFIG and only.weights is None and only.config == ck.config

    state = paths.classify(world.state)  # save_pretrained while the tables train: the trained rows
    rows = world.rows  # the trained rows' count of each layer
    assert min(rows) > 0
    assert state.kind == paths.TRAINING and state.trainer_step is None
    assert [(t.prefix, t.decoder_layer, t.trained_rows) for t in state.trained] == [
        ("model.layers.0.ple.", 0, rows[0]),
        ("model.layers.1.ple.", 1, rows[1]),
    ]
    assert f"their trained rows ({rows[0]:,}, {rows[1]:,}), not tables" in state.what

    table = paths.classify(world.tables / P0)
    assert table.kind == paths.TABLE_FILE and table.header == read_table_header(world.tables / P0)
    assert table.what == f"a table file (fp8, {table.header['rows']:,} rows x 32)"
    merged = paths.classify(world.merged / P0)
    assert merged.kind == paths.MERGED_TABLE and merged.header is not None
    assert merged.header["merged"]["into"]["file"] == str((world.tables / P0).resolve())

    folder = paths.classify(world.tables)  # its records and lock files are no table files
    assert folder.kind == paths.TABLE_FOLDER and [p.name for p in folder.tables] == [P0, P1]
    assert any(p.name.endswith(".source.json") for p in world.tables.iterdir())
    listed = paths.folder_tables(paths.classify(world.merged))
    assert [(t["file"], t["kind"], t["format"]) for t in listed] == [(name, "merged table", "fp8") for name in (P0, P1)]

    adapter = paths.classify(world.adapter)
    assert adapter.kind == paths.ADAPTER and adapter.adapter is not None and adapter.adapter["optimizer"] is False
    assert [d["trained_rows"] for d in adapter.adapter["layers"]] == rows

    write_gguf(tmp_path / "m.gguf", PLEConfig(**WIDE))
    assert paths.classify(tmp_path / "m.gguf").kind == paths.GGUF

    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty").mkdir()
    for p in (tmp_path / "notes.txt", tmp_path / "empty"):
        info = paths.classify(p)
        assert info.kind == paths.OTHER and info.problem is not None
        assert info.refusal("a model") is info.problem and str(p) in str(info.problem)
    with pytest.raises(FileNotFoundError):
        paths.classify(tmp_path / "absent")
    with pytest.raises(InvalidArgumentError, match=r"is a table folder \(2 table files, no config.json\), not a model"):
        folder.require(paths.CHECKPOINT, wanted="a model")


# ---------------------------------------------------------------------------------------------- training
def _trainer_checkpoint(world, out: Path) -> Path:
    """transformers' Trainer, 2 steps saving at step 2: ``out/checkpoint-2``."""
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from transformers import Trainer, TrainingArguments

    model = from_pretrained(world.ck, table_dir=world.tables)
    for n, p in model.named_parameters():
        p.requires_grad_(p.requires_grad and ".experts." not in n)  # as tests/train/test_train_checkpoints.py
    rest = [p for p in model.parameters() if p.requires_grad]
    opt = CombinedOptimizer(SparseAdam(trainable(model), lr=0.05), torch.optim.AdamW(rest, lr=3e-3))
    ids = torch.randint(EOS + 1, VOCAB, (8, 12), generator=torch.Generator().manual_seed(3))
    args = TrainingArguments(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=4, save_strategy="steps", save_steps=2,
        report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    data = [{"input_ids": row, "labels": row} for row in ids]
    Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched)).train()
    return out / "checkpoint-2"


def test_a_trainer_checkpoint_is_a_training_checkpoint_everywhere(world, tmp_path, capsys):
    ckpt = _trainer_checkpoint(world, tmp_path / "out")
    assert (ckpt / "trainer_state.json").is_file() and (ckpt / "optimizer.pt").is_file()
    info = paths.classify(ckpt)
    assert info.kind == paths.TRAINING and info.trainer_step == 2
    assert [t.decoder_layer for t in info.trained] == [0, 1] and all(t.trained_rows > 0 for t in info.trained)
    assert "transformers Trainer's, at step 2" in info.what

    # ple inspect describes it: exit 0, each layer's trained rows, no problem
    code, out, err = run(capsys, "inspect", ckpt)
    assert code == 0, out + err
    assert f"{info.what}: load the base model with from_pretrained, then model.load_state_dict" in out
    for t in info.trained:
        assert f"  checkpoint   {t.trained_rows:,} trained rows (the table is the base model's); OK\n" in out
    assert "PROBLEMS" not in out and "unexpected tensor" not in out
    code, out, _ = run(capsys, "inspect", ckpt, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["kind"] == "training checkpoint" and doc["trainer_step"] == 2
    assert doc["problems"] == [] and [d["problems"] for d in doc["layers"]] == [[], []]
    assert [d["trained_rows"] for d in doc["layers"]] == [t.trained_rows for t in info.trained]
    code, out, _ = run(capsys, "inspect", world.ck, "--json")  # a published checkpoint: its tables
    assert code == 0 and json.loads(out)["kind"] == "checkpoint"
    assert [d["trained_rows"] for d in json.loads(out)["layers"]] == [None, None]

    # loading, converting, evaluating or comparing with it: the one answer, how to load it
    said = str(paths.training_refusal(ckpt))
    assert said.startswith(f"{ckpt} is a training checkpoint") and "model.load_state_dict" in said
    with pytest.raises(UsageError) as refused:
        from_pretrained(ckpt, table_dir=tmp_path / "t")
    assert str(refused.value) == said and not (tmp_path / "t").exists()
    code, _, err = run(capsys, "convert", ckpt, tmp_path / "converted")
    assert (code, err) == (1, f"ple convert: {said}\n") and not (tmp_path / "converted").exists()
    (tmp_path / "tokens.txt").write_text("7 8 9 10")
    code, _, err = run(capsys, "eval", ckpt, "--tokens", tmp_path / "tokens.txt", "--ctx", "2")
    assert (code, err) == (1, f"ple eval: {said}\n")
    code, _, err = run(capsys, "verify", world.tables / P0, "--checkpoint", ckpt)
    assert (code, err) == (1, f"ple verify: {said}\n")


# ---------------------------------------------------------------------------------------------- merged
def test_a_merged_table_folder_is_served_as_it_is_and_never_converted_over(world, tmp_path, capsys):
    before = _stat(world.merged)
    assert list(before) == [P0, P1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "converting it again"
        model = from_pretrained(world.ck, table_dir=world.merged).eval()
    try:
        for w in patched_layers(model):
            assert w.prepared.action == "merged" and w.table_path == world.merged / w.table_path.name
            assert w.layer.table.header == read_table_header(w.table_path)
        assert _stat(world.merged) == before  # not rewritten: the same inodes, times and bytes
        prompt = torch.randint(EOS + 1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
        want, got = generate(world.model, prompt), generate(model, prompt)  # the merged model's own logits
        assert torch.equal(want.sequences, got.sequences)
        for a, b in zip(want.logits, got.logits, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        base = from_pretrained(world.ck, table_dir=world.tables).eval()  # the checkpoint's own tables: not these
        moved = max(float((a - b).abs().max()) for a, b in zip(generate(base, prompt).logits, got.logits))
        assert moved > 1e-3, moved
    finally:
        for w in patched_layers(model):
            w.layer.table.close()

    # another checkpoint of the same layout: refused, naming the file; nothing replaced
    with pytest.raises(InvalidArgumentError, match=f"holds {P0}, a merged table") as refused:
        from_pretrained(world.other, table_dir=world.merged)
    assert "is never converted over" in str(refused.value) and str(world.other.resolve()) in str(refused.value)
    assert "made from the fp8 table model.layers.0.ple. of checkpoint " + str(world.ck.resolve()) in str(refused.value)
    assert _stat(world.merged) == before

    # ple convert into it, even with --force: refused; ple inspect and ple verify say what it holds
    code, _, err = run(capsys, "convert", world.ck, world.merged, "--force")
    assert code == 1 and f"table file {world.merged / P0} is a merged table file (fp8" in err
    assert "ple convert never writes over a merged table" in err and _stat(world.merged) == before
    code, out, _ = run(capsys, "inspect", world.merged)
    assert code == 0 and out.startswith(f"{world.merged}: a table folder (2 table files, no config.json)\n")
    assert f"  {P0}: merged table, fp8, " in out and "with 1 adapter merge on top" in out
    code, out, _ = run(capsys, "verify", world.merged)
    assert code == 0 and out.endswith("2 files: all OK\n")


# ---------------------------------------------------------------------------------------------- identity
def test_an_adapter_merges_into_any_conversion_of_its_table_and_no_other(world, tmp_path, capsys):
    for ck, out in ((world.ck, tmp_path / "q4"), (world.other, tmp_path / "other-q4")):
        assert run(capsys, "convert", ck, out, "--to", "q4_0")[0] == 0
    base, q4, foreign = world.tables / P0, tmp_path / "q4" / P0, tmp_path / "other-q4" / P0
    entry = read_adapter(world.adapter).layers[0]
    assert entry.base is not None and entry.base["file"] == str(base.resolve()) and entry.base["format"] == "fp8"
    assert read_table_header(q4)["format"] == "q4_0"
    assert paths.table_identity(q4).same(paths.table_identity(base))  # both made from the checkpoint's table
    assert not paths.table_identity(foreign).same(paths.table_identity(base))

    out = merge_table_file(q4, world.adapter, tmp_path / "merged.pletable", ple_layer_index=0)
    merged, conv = MmapTable.open(out), MmapTable.open(q4)
    try:
        ids, values = next(read_adapter(world.adapter).chunks(0))
        stored, _ = requantize(values, "q4_0")
        assert torch.equal(merged.data[ids], stored)  # the trained rows, requantized to q4_0
        rest = torch.ones(conv.rows, dtype=torch.bool)
        rest[ids] = False
        assert torch.equal(merged.data[rest], conv.data[rest])  # the others: the conversion's bytes
    finally:
        merged.close(), conv.close()
    record = read_table_header(out)["merged"]
    assert record["identity"]["origin"] == paths.table_identity(q4).origin
    assert [list(m) for m in record["identity"]["merges"]] == [["ids", "rows"]]

    with pytest.raises(InvalidArgumentError) as refused:  # another checkpoint's table: refused, naming both
        merge_table_file(foreign, world.adapter, tmp_path / "no.pletable", ple_layer_index=0)
    said = str(refused.value)
    assert f"PLE layer 0 was trained over the table file {base.resolve()} (fp8, made from the fp8 table" in said
    assert f"of checkpoint {world.ck.resolve()}" in said and f"not {foreign} (q4_0, made from" in said
    assert f"of checkpoint {world.other.resolve()}" in said and not (tmp_path / "no.pletable").exists()

    # an adapter of rows trained over the merged table: its untrained rows include the first merge's
    model = _train(from_pretrained(world.ck, table_dir=world.merged), seed=9)
    second = save_adapter(tmp_path / "second.safetensors", model)
    for w in patched_layers(model):
        w.layer.table.base.close()
    with pytest.raises(InvalidArgumentError, match="with 1 adapter merge on top"):
        merge_table_file(base, second, tmp_path / "no.pletable", ple_layer_index=0)
    twice = merge_table_file(world.merged / P0, second, tmp_path / "twice.pletable", ple_layer_index=0)
    assert len(paths.table_identity(twice).merges) == 2


def test_identity_of_tables_without_a_record_and_of_adapters_that_recorded_none(world, tmp_path):
    copy = tmp_path / P0
    copy.write_bytes((world.tables / P0).read_bytes())  # no record beside it: the table says only itself
    header = read_table_header(copy)
    own = paths.table_identity(copy)
    assert own.origin == {"table": header["header_checksum"]} and own.merges == ()
    assert "no conversion record says what it was made from" in own.describe()
    assert paths.require_trained_over("a", 0, {"header_checksum": header["header_checksum"]}, copy, header).same(own)

    # an adapter that recorded no identity: the file it names, while it holds the same rows
    base = world.tables / P0
    h = read_table_header(base)
    recorded = {"file": str(base), "format": "fp8", "header_checksum": h["header_checksum"]}
    assert paths.trained_over_identity(recorded).same(paths.table_identity(base))
    gone = {**recorded, "file": str(tmp_path / "gone.pletable")}
    assert paths.trained_over_identity(gone).origin == {"table": h["header_checksum"]}
    with pytest.raises(InvalidArgumentError, match="a table of its own"):
        paths.require_trained_over("a", 0, {**gone, "header_checksum": "0" * 32}, copy, header)

    # a copy of the checkpoint's files keeps the identity (change times, inodes aside); a write does not
    source = json.loads(paths.record_path(base).read_text())["source"]
    f = source["files"][0]
    copied = {**source, "files": [{**f, "ctime_ns": f["ctime_ns"] + 1, "inode": f["inode"] + 1}]}
    written = {**source, "files": [{**f, "mtime_ns": f["mtime_ns"] + 1}]}
    assert paths.source_origin(copied) == paths.source_origin(source) == paths.table_identity(base).origin
    assert paths.source_origin(written) != paths.source_origin(source)
