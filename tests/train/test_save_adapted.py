"""A model with trained rows on its tables (an adapter) saved with ``save_pretrained`` and unpatched:
the tables come out merged, as ``ple.train.merge_model`` makes them, and the model keeps its adapter."""

from __future__ import annotations

import hashlib

import pytest
import torch

import ple.integrations.table_state as table_state
from ple.integrations.transformers import from_pretrained, patched_layers, unpatch
from ple.table.tiers.adapted import AdaptedTable
from ple.train import SparseAdam, freeze, merge_model, save_adapter, trainable
from tests.integrations.helpers import EOS, VOCAB, tiny_config, tiny_model
from tests.integrations.test_save import assert_same_checkpoint


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sha_tables(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.pletable"))}


def _load(tmp_path, ckpt, fmt, tier, **kw):
    where = {} if tier == "memory" else {"table_dir": tmp_path / "tables"}
    return from_pretrained(ckpt, table_tier=tier, table_format=fmt, **where, **kw)


def _trained(tmp_path, fmt, tier, seed=71):
    """A from_pretrained model whose tables (alone) were trained a few steps, its adapter file, the checkpoint."""
    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        tiny_model(tiny_config(split_ngram_parts=4, ple_embed_dim=128), seed=seed).save_pretrained(ckpt)
    model = _load(tmp_path, ckpt, fmt, tier)
    model.requires_grad_(False)  # the tables alone train: the dense weights stay the checkpoint's
    opt = SparseAdam(trainable(model), lr=0.2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        ids = torch.randint(EOS + 1, VOCAB, (2, 10), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    adapter = save_adapter(tmp_path / "adapter.safetensors", model)
    freeze(model)  # training done: save_pretrained writes the tables (while trainable, the trained rows)
    return model, adapter, ckpt


def _merged_reference(tmp_path, ckpt, fmt, adapter):
    """What merge_model then save_pretrained / unpatch start from: the adapter merged into table files."""
    ref = from_pretrained(
        ckpt, table_dir=tmp_path / "tables", table_tier="mmap", table_format=fmt, table_adapter=adapter
    )
    merge_model(ref, tmp_path / "merged")
    return ref


@pytest.mark.filterwarnings("ignore::ple.integrations.transformers.ScaledTableWarning")
@pytest.mark.parametrize(
    ("fmt", "tier"), [(None, "mmap"), (None, "memory"), ("fp8", "mmap"), ("int8", "direct"), ("q8_0", "cached")]
)
def test_save_pretrained_writes_the_merged_tables_and_keeps_the_adapter(tmp_path, fmt, tier, monkeypatch):
    monkeypatch.setattr(table_state, "STAGE_ROWS", 37)  # many staged chunks per shard
    model, adapter, ckpt = _trained(tmp_path, fmt, tier)
    files = _sha_tables(tmp_path / "tables")
    before = {w.layer_idx: w.layer.table.overlay.ids() for w in patched_layers(model)}
    model.save_pretrained(tmp_path / "saved")
    for w in patched_layers(model):  # the model keeps serving (and training) its adapter
        assert isinstance(w.layer.table, AdaptedTable)
        assert torch.equal(w.layer.table.overlay.ids(), before[w.layer_idx]) and before[w.layer_idx].numel() > 20
    assert _sha_tables(tmp_path / "tables") == files  # the table files are never written

    ref = _merged_reference(tmp_path, ckpt, fmt, adapter)
    ref.save_pretrained(tmp_path / "reference")
    assert_same_checkpoint(tmp_path / "saved", tmp_path / "reference")  # every tensor, bit for bit
    saved = sorted(p.name for p in (tmp_path / "saved").iterdir())
    assert saved == sorted(p.name for p in (tmp_path / "reference").iterdir())  # nothing staged left behind
    plain = _load(tmp_path, ckpt, fmt, tier)
    plain.save_pretrained(tmp_path / "untrained")
    from tests.integrations.test_save import tensors

    a, b = tensors(tmp_path / "saved"), tensors(tmp_path / "untrained")
    changed = [
        k for k in a if "ngram_embedding" in k and not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
    ]
    assert changed  # the trained rows are in it


@pytest.mark.parametrize(("fmt", "tier"), [(None, "mmap"), (None, "memory"), ("fp8", "direct")])
def test_unpatch_gives_the_modules_their_tables_merged(tmp_path, fmt, tier):
    model, adapter, ckpt = _trained(tmp_path, fmt, tier, seed=72)
    ref = _merged_reference(tmp_path, ckpt, fmt, adapter)
    files = _sha_tables(tmp_path / "tables")
    assert files
    materialize = fmt is not None
    if materialize:  # an fp8 table given back to an fp32 module is dequantized only when asked
        with pytest.raises(Exception, match="materialize=True"):
            unpatch(model)
        assert all(isinstance(w.layer.table, AdaptedTable) for w in patched_layers(model))  # nothing changed
    want = [
        m.ple_embedding.ngram_embedding.weight.detach().clone()
        for m in _originals(unpatch(ref, materialize=materialize))
    ]
    got = [m.ple_embedding.ngram_embedding.weight.detach() for m in _originals(unpatch(model, materialize=materialize))]
    assert len(got) == 2
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert _sha_tables(tmp_path / "tables") == files
    with torch.no_grad():  # a map given back takes writes privately
        got[0][0] += 1
    assert _sha_tables(tmp_path / "tables") == files


def _originals(model):
    from ple.integrations.qwen4_exp import hf_ple_class

    return [m for m in model.modules() if isinstance(m, hf_ple_class())]
