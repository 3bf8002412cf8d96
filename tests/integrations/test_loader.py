"""``from_pretrained``: a qwen4_exp checkpoint loads with its PLE tables on disk, never in memory,
and generates what transformers generates; table files are made once, reused while the checkpoint
is unchanged, and never used when stale or foreign."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen4ExpForCausalLM
from transformers.models.qwen4_exp import modeling_qwen4_exp as mq
from transformers.monkey_patching import get_patch_mapping

from ple.checkpoint import CheckpointError
from ple.config import PLEConfig
from ple.convert.folder import RECORD_SUFFIX, default_table_dir
from ple.errors import InvalidArgumentError
from ple.integrations.transformers import (
    ScaledTableWarning,
    TableStub,
    dequantize_checkpoint,
    from_pretrained,
    patch,
    patched_layers,
)
from ple.table import CachedTable, DirectTable, MemoryTable, MmapTable, quantize_rows
from ple.table.formats.quantize import quantize_global
from tests.integrations.helpers import (
    LOGIT_ATOL,
    assert_same_generation,
    generate,
    prompts,
    tiny_config,
    tiny_model,
    tiny_multimodal_model,
)

TABLES = ["model.layers.0.ple.pletable", "model.layers.1.ple.pletable"]


def _save(model, path):
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny fp32 checkpoint (tables in 4 shards), what transformers generates from it, the model."""
    model = tiny_model(tiny_config(split_ngram_parts=4), seed=21)
    path = _save(model, tmp_path_factory.mktemp("ckpt") / "tiny")
    ids, mask = prompts(seed=21)
    return path, generate(model, ids, mask), model


def logits(model) -> torch.Tensor:
    """One forward pass over the test prompts (no cache): ``[B, S, vocab]``."""
    ids, mask = prompts(seed=21)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def assert_same_logits(model, reference) -> None:
    want, got = logits(reference), logits(model)
    assert want.abs().max() > 0.3
    torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_ATOL)


def _table_bytes_of(path):
    """``{table tensor name: (file, start, stop)}`` of a checkpoint (absolute byte ranges)."""
    from ple.checkpoint import checkpoint_files, read_header

    out = {}
    for f in checkpoint_files(path):
        for name, e in read_header(f).tensors.items():
            if ".ngram_embedding." in name:
                out[name] = (f, e.begin, e.end)
    return out


@pytest.mark.parametrize("tier", ["mmap", "cached", "memory", "direct"])
def test_generates_what_transformers_generates(checkpoint, tier, tmp_path):
    path, want, reference = checkpoint
    ids, mask = prompts(seed=21)
    kw = {} if tier == "memory" else {"table_dir": tmp_path}
    model = from_pretrained(path, table_tier=tier, **kw)
    assert type(model) is Qwen4ExpForCausalLM
    wrappers = patched_layers(model)
    assert [w.layer_idx for w in wrappers] == [0, 1]
    kind = {"mmap": MmapTable, "cached": CachedTable, "memory": MemoryTable, "direct": DirectTable}[tier]
    assert all(type(w.layer.table) is kind for w in wrappers)
    assert all(isinstance(w.original.ple_embedding.ngram_embedding, TableStub) for w in wrappers)
    # the table is nowhere in the model: not a parameter, not a buffer
    assert not any("ngram_embedding" in n for n, _ in model.named_parameters())
    table_numel = sum(
        m.ple_embedding.ngram_embedding.weight.numel() for m in reference.modules() if hasattr(m, "ple_embedding")
    )
    assert model.num_parameters() == reference.num_parameters() - table_numel
    if tier != "memory":
        assert sorted(p.name for p in tmp_path.glob("*.pletable")) == TABLES
        assert [w.prepared.action for w in wrappers] == ["converted", "converted"]
    assert_same_generation(want, generate(model, ids, mask), model)


class _Reads:
    """What a load reads from files: every ``pread``/``preadv`` (file, offset, bytes) and every tensor
    safetensors materializes (``get_tensor``, or indexing a ``get_slice``), ple's and transformers'."""

    def __init__(self, monkeypatch):
        import safetensors
        import transformers.modeling_utils as mu

        self.ranges: list[tuple[str, int, int]] = []
        self.tensors: list[str] = []
        for name in ("pread", "preadv"):
            monkeypatch.setattr(os, name, self._spy(getattr(os, name), name))
        for module in (safetensors, mu):
            monkeypatch.setattr(module, "safe_open", self._opener(module.safe_open))

    def _spy(self, real, name):
        def spy(fd, what, offset):
            n = what if name == "pread" else sum(memoryview(b).nbytes for b in what)
            self.ranges.append((os.path.realpath(f"/proc/self/fd/{fd}"), offset, n))
            return real(fd, what, offset)

        return spy

    def _opener(self, real):
        log = self.tensors

        class Slice:
            def __init__(self, inner, key):
                self._inner, self._key = inner, key

            def __getitem__(self, item):
                log.append(self._key)
                return self._inner[item]

            def __getattr__(self, name):
                return getattr(self._inner, name)

        class Handle:
            def __init__(self, inner):
                self._inner = inner

            def get_slice(self, key):
                return Slice(self._inner.get_slice(key), key)

            def get_tensor(self, key):
                log.append(key)
                return self._inner.get_tensor(key)

            def __enter__(self):
                self._inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self._inner.__exit__(*exc)

            def __getattr__(self, name):
                return getattr(self._inner, name)

        return lambda *a, **k: Handle(real(*a, **k))

    def table_reads(self, tables: dict[str, tuple]) -> tuple[list[str], list[tuple[str, int, int]]]:
        """The table tensors materialized, and the reads overlapping a table's bytes."""
        spans = [(os.path.realpath(f), a, b) for f, a, b in tables.values()]
        hits = [r for r in self.ranges for f, a, b in spans if r[0] == f and r[1] < b and a < r[1] + r[2]]
        return [k for k in self.tensors if k in tables], hits


def test_a_second_start_reads_no_table_bytes(checkpoint, tmp_path, monkeypatch):
    """After the first start, neither transformers nor ple reads the checkpoint's tables: no read
    touches their bytes (every pread recorded, every tensor safetensors materializes recorded). With
    their bytes overwritten in place (size, header and modification time kept) the change time
    moved: the table files are compared with the checkpoint again, and its NaN rows are refused
    instead of the old tables being served."""
    path, _, reference = checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    tables = _table_bytes_of(copy)
    reads = _Reads(monkeypatch)
    first = from_pretrained(copy, table_dir=tmp_path / "tables")
    assert [w.prepared.action for w in patched_layers(first)] == ["converted", "converted"]
    materialized, hits = reads.table_reads(tables)
    assert not materialized and hits  # the conversion read the tables, with pread (the spy sees it)
    assert any(".key_proj." in k for k in reads.tensors)
    reads.ranges.clear()
    reads.tensors.clear()
    second = from_pretrained(copy, table_dir=tmp_path / "tables")
    assert [w.prepared.action for w in patched_layers(second)] == ["reused", "reused"]
    materialized, hits = reads.table_reads(tables)
    assert materialized == [] and hits == []
    assert any(".key_proj." in k for k in reads.tensors)  # transformers read the dense weights
    monkeypatch.undo()
    for f, start, stop in tables.values():
        st = os.stat(f)
        with open(f, "r+b") as fh:
            fh.seek(start)
            fh.write(b"\xff" * (stop - start))  # NaN rows if anything read them
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.warns(UserWarning, match="rows differ from the checkpoint's"):
        with pytest.raises(InvalidArgumentError, match="holds byte 0xff \\(NaN in torch.float32\\)|holds nan"):
            from_pretrained(copy, table_dir=tmp_path / "tables")


def test_a_changed_checkpoint_is_converted_again(checkpoint, tmp_path):
    path, _, _ = checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    from_pretrained(copy, table_dir=tmp_path / "tables")
    retrained = tiny_model(tiny_config(split_ngram_parts=4), seed=22)  # same geometry, other weights
    shutil.rmtree(copy)
    _save(retrained, copy)
    with pytest.warns(UserWarning, match="changed since .* converting it again"):
        model = from_pretrained(copy, table_dir=tmp_path / "tables")
    assert [w.prepared.action for w in patched_layers(model)] == ["converted", "converted"]
    assert_same_logits(model, retrained)


def test_a_foreign_table_file_is_never_used(checkpoint, tmp_path):
    """``ple convert`` writes each file's record: one of this checkpoint is reused as it is; one of
    another checkpoint folder that still exists is refused, like a folder's own (one folder serves
    one checkpoint). Files without a record (copied in) are compared row by row: one of this
    checkpoint is adopted, one of another checkpoint with the same geometry is not used and replaced."""
    from ple.commands.cli import main

    path, _, reference = checkpoint
    other = _save(tiny_model(tiny_config(split_ngram_parts=4), seed=23), tmp_path / "other")
    tables = tmp_path / "tables"
    assert main(["convert", str(path), str(tables), "--layers", "0"]) == 0
    assert main(["convert", str(other), str(tables), "--layers", "1"]) == 0
    assert sorted(p.name for p in tables.glob("*" + RECORD_SUFFIX)) == [t + RECORD_SUFFIX for t in TABLES]
    with pytest.raises(
        InvalidArgumentError, match=r"holds model.layers.1.ple.pletable, PLE layer 1's table of checkpoint"
    ):
        from_pretrained(path, table_dir=tables)
    for t in TABLES:
        (tables / (t + RECORD_SUFFIX)).unlink()
    with pytest.warns(UserWarning, match="layers.1.ple.pletable is not used: its rows differ from the checkpoint's"):
        model = from_pretrained(path, table_dir=tables)
    assert [w.prepared.action for w in patched_layers(model)] == ["verified", "converted"]
    assert_same_logits(model, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = from_pretrained(path, table_dir=tables)
    assert [w.prepared.action for w in patched_layers(again)] == ["reused", "reused"]
    # a record does not vouch for another file put in place of the one it describes
    assert main(["convert", str(other), str(tmp_path / "elsewhere"), "--layers", "0"]) == 0
    shutil.copy(tmp_path / "elsewhere" / TABLES[0], tables / TABLES[0])
    with pytest.warns(UserWarning, match="layers.0.ple.pletable is not used: its rows differ"):
        model = from_pretrained(path, table_dir=tables)
    assert_same_logits(model, reference)
    # a file ple convert made of this checkpoint is reused without a comparison
    fresh = tmp_path / "fresh"
    assert main(["convert", str(path), str(fresh)]) == 0
    assert [w.prepared.action for w in patched_layers(from_pretrained(path, table_dir=fresh))] == ["reused"] * 2


def test_a_table_file_changed_in_place_is_compared_again(checkpoint, tmp_path):
    """The record vouches for the table file it was written beside, not for whatever that file holds
    later: a file touched or edited in place (header and checksums kept) is compared with the
    checkpoint row by row before it serves again. (An edit that also puts the old modification time
    back is what ``ple verify`` is for: it checks every shard's checksum.)"""
    from ple.table.files.table_file import read_table_header

    path, _, reference = checkpoint
    tables = tmp_path / "tables"
    from_pretrained(path, table_dir=tables)
    target = tables / TABLES[0]
    st = os.stat(target)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: rows the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = from_pretrained(path, table_dir=tables)
    assert [w.prepared.action for w in patched_layers(model)] == ["verified", "reused"]
    header = read_table_header(target)
    with open(target, "r+b") as f:  # one row edited in place: size, header and checksums kept
        f.seek(header["data_offset"] + header["row_nbytes"] * 5)
        f.write(b"\x7f" * header["row_nbytes"])
    with pytest.warns(UserWarning, match="layers.0.ple.pletable is not used: its rows differ from the checkpoint's"):
        model = from_pretrained(path, table_dir=tables)
    assert [w.prepared.action for w in patched_layers(model)] == ["converted", "reused"]
    assert_same_logits(model, reference)


def test_a_table_dir_that_cannot_be_a_folder_is_named(checkpoint, tmp_path):
    path, _, _ = checkpoint
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    for bad in (afile, afile / "below"):
        with pytest.raises(InvalidArgumentError, match=f"table_dir {bad} cannot be a folder of table files"):
            from_pretrained(path, table_dir=bad)


def test_a_table_file_of_another_layout_is_refused(checkpoint, tmp_path):
    from ple.commands.cli import main

    path, _, reference = checkpoint
    other = _save(tiny_model(tiny_config(split_ngram_parts=4, seed=99), seed=21), tmp_path / "other")  # other hash seed
    tables = tmp_path / "tables"
    assert main(["convert", str(other), str(tables)]) == 0
    with pytest.raises(InvalidArgumentError, match="PLE layer 0's table of checkpoint"):  # its record names it
        from_pretrained(path, table_dir=tables)
    for t in TABLES:
        (tables / (t + RECORD_SUFFIX)).unlink()
    with pytest.warns(UserWarning, match="layout hash .* does not match"):
        model = from_pretrained(path, table_dir=tables)
    assert_same_logits(model, reference)


def test_one_table_folder_serves_one_checkpoint(checkpoint, tmp_path):
    """Two checkpoints in one table_dir would convert each other's tables back and forth: the second
    is refused, the first's files left as they are; once the first folder is gone, the second may
    take the folder over."""
    path, _, reference = checkpoint
    tables = tmp_path / "tables"
    first = from_pretrained(path, table_dir=tables)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in tables.iterdir()}
    other_model = tiny_model(tiny_config(split_ngram_parts=4), seed=25)
    other = _save(other_model, tmp_path / "other")
    with pytest.raises(ValueError, match=r"table folder .* holds model.layers.0.ple.pletable, PLE layer 0's table of "):
        from_pretrained(other, table_dir=tables)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in tables.iterdir()} == before
    again = from_pretrained(path, table_dir=tables)
    assert [w.prepared.action for w in patched_layers(again)] == ["reused", "reused"]
    assert_same_logits(first, reference)
    moved = tmp_path / "moved"
    shutil.copytree(path, moved)  # a copy (modification times kept, change times new): compared, then used
    assert [w.prepared.action for w in patched_layers(from_pretrained(moved, table_dir=tables))] == ["verified"] * 2
    shutil.rmtree(moved)
    # a folder retrained in place is converted again (test_a_changed_checkpoint_is_converted_again);
    # a gone checkpoint's tables may be replaced
    gone = _save(tiny_model(tiny_config(split_ngram_parts=4), seed=30), tmp_path / "gone")
    third = tmp_path / "tables3"
    from_pretrained(gone, table_dir=third)
    shutil.rmtree(gone)
    with pytest.warns(UserWarning, match="changed since"):
        model = from_pretrained(other, table_dir=third)
    assert [w.prepared.action for w in patched_layers(model)] == ["converted", "converted"]
    assert_same_logits(model, other_model)


def test_a_replaced_table_file_does_not_change_a_loaded_model(tmp_path):
    """A model keeps serving, saving and (unpatched) holding the table file it opened, even after
    another load converted a new file in its place (its checkpoint folder retrained)."""
    from ple.integrations.transformers import unpatch

    a = tiny_model(tiny_config(split_ngram_parts=4), seed=26)
    ckpt = _save(a, tmp_path / "ckpt")
    loaded = from_pretrained(ckpt, table_dir=tmp_path / "tables")
    b = tiny_model(tiny_config(split_ngram_parts=4), seed=27)
    shutil.rmtree(ckpt)
    _save(b, ckpt)
    with pytest.warns(UserWarning, match="changed since"):
        newer = from_pretrained(ckpt, table_dir=tmp_path / "tables")
    assert [w.prepared.action for w in patched_layers(newer)] == ["converted", "converted"]
    assert [w.table_path for w in patched_layers(newer)] == [w.table_path for w in patched_layers(loaded)]
    assert_same_logits(loaded, a)
    loaded.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        for i in (0, 1):
            key = f"model.layers.{i}.ple.ple_embedding.ngram_embedding.shard_{{}}.weight"
            saved = torch.cat([f.get_tensor(key.format(k)) for k in range(4)])
            assert torch.equal(saved, a.model.layers[i].ple.ple_embedding.ngram_embedding.weight)
    unpatch(loaded)
    for i in (0, 1):
        got = loaded.model.layers[i].ple.ple_embedding.ngram_embedding.weight
        assert torch.equal(got, a.model.layers[i].ple.ple_embedding.ngram_embedding.weight)
    assert_same_logits(newer, b)


def test_bad_per_row_scales_are_refused_by_every_tier(tmp_path):
    """The memory tier reads the table with the loader's own checks: a NaN or negative per-row scale
    is refused, as the table-file tiers refuse it."""
    model = tiny_model(tiny_config(split_ngram_parts=4), seed=28)
    patch(model, lambda weight, layer: MemoryTable(*quantize_rows(weight, "fp8_row")))
    with pytest.warns(ScaledTableWarning):
        _save(model, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model.safetensors"
    with safe_open(str(f), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    key = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight_scale"
    tensors[key][3, 0] = -2.0
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"shard_1.weight_scale: the scale of row \d+ is -2.0"):
        from_pretrained(tmp_path / "ckpt", table_tier="memory")
    with pytest.raises(ValueError, match=r"the scale of row \d+ is -2.0"):
        from_pretrained(tmp_path / "ckpt", table_dir=tmp_path / "tables")


def test_the_memory_tier_refuses_a_checkpoint_changed_since_the_scan(checkpoint, tmp_path, monkeypatch):
    import ple.integrations.transformers as integration

    path, _, _ = checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    f = copy / "model.safetensors"
    key = "model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight"
    real_scan = integration.scan_checkpoint

    def scan_then_change(root, config):
        scan = real_scan(root, config)
        with safe_open(str(f), "pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        tensors[key] = tensors[key][:-1].clone()  # one row fewer
        save_file(tensors, str(f), metadata={"format": "pt"})
        return scan

    monkeypatch.setattr(integration, "scan_checkpoint", scan_then_change)
    with pytest.raises(CheckpointError, match="changed after it was scanned"):
        from_pretrained(copy, table_tier="memory")


def test_the_free_space_check_does_not_count_the_file_being_replaced(checkpoint, tmp_path, monkeypatch):
    """The new table file is written beside the stale one: only the disk's free space counts."""
    import ple.convert.folder as tables_mod

    path, _, _ = checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    tables = tmp_path / "tables"
    from_pretrained(copy, table_dir=tables)
    retrained = tiny_model(tiny_config(split_ngram_parts=4), seed=29)
    shutil.rmtree(copy)
    _save(retrained, copy)
    stale = tables / TABLES[0]
    lay = PLEConfig.from_pretrained(copy).layout(0)
    need = lay.padded_rows * lay.head_dim * 4  # fp32 rows: what the new file needs
    assert stale.stat().st_size > need  # before: free space plus the stale file's size sufficed
    real = shutil.disk_usage

    def just_short(p):
        return real(p)._replace(free=need - 1)

    monkeypatch.setattr(tables_mod.shutil, "disk_usage", just_short)
    with pytest.warns(UserWarning, match="changed since"):
        # units that show the numbers (a small table is not "0.00 GB free, needs 0.00 GB")
        shown = rf"has \S+ KiB \({need - 1:,} bytes\) free, PLE layer 0's table needs \S+ KiB \({need:,} bytes\)"
        with pytest.raises(ValueError, match=shown):
            from_pretrained(copy, table_dir=tables)
    assert stale.is_file()


@pytest.mark.parametrize(
    "rows, error, message",
    [
        (0, ValueError, "table_cache_rows must be >= 1, got 0"),
        (-5, ValueError, "table_cache_rows must be >= 1, got -5"),
        (2.5, TypeError, "table_cache_rows must be an int"),
        (True, TypeError, "table_cache_rows must be an int"),
    ],
)
def test_table_cache_rows_is_checked_before_any_work(checkpoint, tmp_path, monkeypatch, rows, error, message):
    import ple.integrations.transformers as integration

    path, _, _ = checkpoint

    def no_work(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(integration, "scan_checkpoint", no_work)
    with pytest.raises(error, match=message):
        from_pretrained(path, table_tier="cached", table_cache_rows=rows, table_dir=tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_default_table_folder_is_per_checkpoint_under_the_cache(checkpoint, tmp_path, monkeypatch):
    path, _, _ = checkpoint
    monkeypatch.setenv("PLE_CACHE_DIR", str(tmp_path / "cache"))
    folder = default_table_dir(path)
    assert folder.parent == tmp_path / "cache" / "tables" and folder.name.startswith("tiny-")
    model = from_pretrained(path)
    assert {w.table_path.parent for w in patched_layers(model)} == {folder}
    assert sorted(p.name for p in folder.glob("*.pletable")) == TABLES
    copy = tmp_path / "elsewhere" / "tiny"
    shutil.copytree(path, copy)
    assert default_table_dir(copy) != folder


def _quantized_checkpoint(path, fmt, seed):
    """A checkpoint with fp8 tables (global or per-row scales) saved by ``save_pretrained`` of a
    patched model, and a model holding the dequantized values (the reference)."""
    model = tiny_model(tiny_config(split_ngram_parts=4), seed=seed)

    def quantized(weight, layer):
        q, s = quantize_global(weight) if fmt == "fp8" else quantize_rows(weight, fmt)
        with torch.no_grad():
            weight.copy_(q.float() * s)
        return MemoryTable(q, s)

    patch(model, quantized)
    with pytest.warns(ScaledTableWarning):  # plain transformers would ignore the scales
        _save(model, path)
    from ple.integrations.transformers import unpatch

    unpatch(model)
    return model


@pytest.mark.parametrize("fmt", ["fp8", "fp8_row"])
def test_quantized_tables_load_exactly(fmt, tmp_path):
    """The published format (fp8 + global scale) and per-row scales: ple applies the scales; plain
    transformers (5.24) does not, and reads a dequantized copy instead."""
    path = tmp_path / "ckpt"
    reference = _quantized_checkpoint(path, fmt, seed=24)
    ids, mask = prompts(seed=24)
    want = generate(reference, ids, mask)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert (
            f.get_tensor("model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight").dtype == torch.float8_e4m3fn
        )
    scale = "weight_scale" if fmt == "fp8" else "shard_3.weight_scale"
    assert f"model.layers.0.ple.ple_embedding.ngram_embedding.{scale}" in names
    model = from_pretrained(path, table_dir=tmp_path / "t")
    assert {w.layer.table.format for w in patched_layers(model)} == {fmt}
    assert_same_generation(want, generate(model, ids, mask), model)
    in_memory = from_pretrained(path, table_tier="memory")
    assert {w.layer.table.format for w in patched_layers(in_memory)} == {fmt}
    torch.testing.assert_close(logits(in_memory), logits(model), rtol=0, atol=0)
    plain = Qwen4ExpForCausalLM.from_pretrained(path)  # the scale is dropped: other values
    assert (logits(plain) - logits(reference)).abs().max() > 0.1
    dequantize_checkpoint(path, tmp_path / "plain", torch.float32)
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "ple_embedding_dtype" not in config
    with safe_open(str(tmp_path / "plain" / "model.safetensors"), "pt") as f:
        assert not any(k.endswith("weight_scale") for k in f.keys())
    plain = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "plain")
    assert torch.equal(logits(plain), logits(reference))


def test_a_broken_checkpoint_is_refused_before_loading(checkpoint, tmp_path):
    path, _, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    f = broken / "model.safetensors"
    with safe_open(str(f), "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys() if not k.endswith("ngram_embedding.shard_2.weight")}
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing table shard\(s\) \[2\]"):
        from_pretrained(broken, table_dir=tmp_path / "tables")
    assert not (tmp_path / "tables").exists()


def test_arguments_are_checked(checkpoint, tmp_path):
    path, _, _ = checkpoint
    with pytest.raises(ValueError, match="table_tier must be one of"):
        from_pretrained(path, table_tier="disk")
    with pytest.raises(ValueError, match="table_dir is for"):
        from_pretrained(path, table_tier="memory", table_dir=tmp_path)
    with pytest.raises(ValueError, match="table_cache_rows is for"):
        from_pretrained(path, table_cache_rows=10, table_dir=tmp_path)
    with pytest.raises(ValueError, match="memory_budget is for table_tier='direct'"):
        from_pretrained(path, memory_budget=10, table_dir=tmp_path)
    with pytest.raises(ValueError, match="memory_budget must be >= 0"):
        from_pretrained(path, table_tier="direct", memory_budget=-1, table_dir=tmp_path)
    with pytest.raises(ValueError, match="state_dict"):
        from_pretrained(path, state_dict={})
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        from_pretrained(tmp_path / "no" / "such" / "folder")
    model, info = from_pretrained(
        path, table_tier="cached", table_cache_rows=16, table_dir=tmp_path, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert all(w.layer.table.capacity_rows == 16 for w in patched_layers(model))


def test_plain_loads_in_other_threads_are_unaffected(checkpoint, tmp_path, monkeypatch):
    """While ple's load has transformers' names swapped, a plain load in another thread builds
    transformers' own module with its table, and ignores no table keys."""
    import threading

    import ple.integrations.transformers as integration
    from ple.integrations.qwen4_exp import TABLE_KEYS

    path, _, reference = checkpoint
    real = integration.tableless_load
    original = mq.Qwen4ExpTextNGramEmbedding
    plain: dict = {}

    def load_plainly():
        plain["swapped"] = mq.Qwen4ExpTextNGramEmbedding is not original
        plain["model"], plain["info"] = Qwen4ExpForCausalLM.from_pretrained(path, output_loading_info=True)

    @contextlib.contextmanager
    def with_a_plain_load_meanwhile():
        with real() as replacement:
            t = threading.Thread(target=load_plainly)
            t.start()
            t.join()
            yield replacement

    monkeypatch.setattr(integration, "tableless_load", with_a_plain_load_meanwhile)
    model = from_pretrained(path, table_dir=tmp_path)
    assert plain["swapped"]  # the plain load ran inside ple's window
    assert all(isinstance(w.original.ple_embedding.ngram_embedding, TableStub) for w in patched_layers(model))
    other = plain["model"]
    for i in (0, 1):
        emb = other.model.layers[i].ple.ple_embedding
        assert type(emb) is original
        want = reference.model.layers[i].ple.ple_embedding.ngram_embedding.weight
        assert torch.equal(emb.ngram_embedding.weight, want)
    assert TABLE_KEYS not in (other._keys_to_ignore_on_load_unexpected or ())
    assert TABLE_KEYS in model._keys_to_ignore_on_load_unexpected
    assert plain["info"]["missing_keys"] == set() and plain["info"]["unexpected_keys"] == set()
    assert torch.equal(logits(other), logits(reference))
    assert_same_logits(model, reference)


def test_transformers_is_left_as_it_was(checkpoint, tmp_path, monkeypatch):
    """The patch mapping and the ignore patterns live only for the load, also when it fails."""
    path, _, _ = checkpoint
    original = mq.Qwen4ExpTextNGramEmbedding
    ignore = {c: c.__dict__.get("_keys_to_ignore_on_load_unexpected") for c in vars(mq).values() if isinstance(c, type)}
    from_pretrained(path, table_dir=tmp_path)

    def boom(self, *a, **k):
        raise RuntimeError("boom while building")

    monkeypatch.setattr(mq.Qwen4ExpTextPLELayer, "__init__", boom)
    with pytest.raises(RuntimeError, match="boom"):
        from_pretrained(path, table_dir=tmp_path)
    monkeypatch.undo()
    assert mq.Qwen4ExpTextNGramEmbedding is original
    assert not any("NGramEmbedding" in k for k in get_patch_mapping())
    assert {c: c.__dict__.get("_keys_to_ignore_on_load_unexpected") for c in ignore} == ignore
    plain = Qwen4ExpForCausalLM.from_pretrained(path)  # and plain transformers loads the tables again
    assert plain.model.layers[0].ple.ple_embedding.ngram_embedding.weight.shape[0] > 0


def test_a_hub_id_resolves_through_the_hub_cache(checkpoint, tmp_path):
    path, _, reference = checkpoint
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny"
    shutil.copytree(path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model = from_pretrained("someone/tiny", cache_dir=tmp_path / "hub", local_files_only=True, table_dir=tmp_path / "t")
    assert_same_logits(model, reference)
    with pytest.raises(FileNotFoundError, match="Hub snapshot could not be had"):
        from_pretrained("someone/other", cache_dir=tmp_path / "hub", local_files_only=True)


def test_an_unsupported_transformers_fails_loudly(checkpoint, tmp_path, monkeypatch):
    """Too old a version is refused up front; a transformers that builds the tables anyway (here: the
    swap does nothing) is caught after the load instead of serving a table it may have made up."""
    import contextlib

    import transformers

    import ple.integrations.transformers as integration
    from ple.integrations.qwen4_exp import TransformersVersionError

    path, _, _ = checkpoint
    monkeypatch.setattr(transformers, "__version__", "5.10.0")
    with pytest.raises(TransformersVersionError, match="transformers 5.10.0 is installed"):
        from_pretrained(path, table_dir=tmp_path)
    monkeypatch.undo()
    monkeypatch.setattr(integration, "tableless_load", contextlib.nullcontext)
    with pytest.raises(TransformersVersionError, match="did not build the PLE tables the way ple's loader expects"):
        from_pretrained(path, table_dir=tmp_path)


def test_a_multimodal_model_loads_and_saves_back(tmp_path):
    """``Qwen4ExpForConditionalGeneration``: PLE config under ``text_config``, layers and checkpoint
    names under ``model.language_model``."""
    model = tiny_multimodal_model(tiny_config(split_ngram_parts=4))
    model.save_pretrained(tmp_path / "ckpt")
    loaded = from_pretrained(tmp_path / "ckpt", table_dir=tmp_path / "tables")
    assert type(loaded) is type(model) and type(model).__name__ == "Qwen4ExpForConditionalGeneration"
    assert [w.table_path.name for w in patched_layers(loaded)] == [
        "model.language_model.layers.0.ple.pletable",
        "model.language_model.layers.1.ple.pletable",
    ]
    assert_same_logits(loaded, model)
    loaded.save_pretrained(tmp_path / "again")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as a:
        with safe_open(str(tmp_path / "again" / "model.safetensors"), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
