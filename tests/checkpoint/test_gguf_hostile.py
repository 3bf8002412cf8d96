"""Hostile GGUF files: written by the ``gguf`` package's own writer, then damaged where a tensor's
bytes lie (its offset, its type), in what the PLE metadata says, or of another architecture. Each is
refused with a ple error naming the value (exit 1), never converted into wrong rows."""

from __future__ import annotations

import json
import struct

import gguf  # the oracle: a dev dependency, so a missing install fails here
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from ple.checkpoint.gguf import TABLE_TENSOR, GGUFError, read_gguf
from ple.commands.cli import main
from ple.config import PLEConfig
from ple.table import MmapTable
from ple.table.files.table_file import TableFileWriter
from tests.conftest import SMALL

WIDE = {**SMALL, "ple_embed_dim": 128, "ple_layer_ids": (2,)}  # one PLE layer, head_dim 32
OTHER = "token_embd.weight"


def ple_keys(cfg: PLEConfig) -> dict:
    """The PLE metadata llama.cpp's qwen4exp converter writes for ``cfg``'s layer 0: ``key: (value, type)``."""
    lay = cfg.layout(0)
    return {
        "ple.layers": ([i - 1 for i in cfg.ple_layer_ids[:1]], VT.UINT32),
        "ple.ngram_size": (cfg.ngram_size, VT.UINT32),
        "ple.heads_per_ngram": (cfg.heads_per_ngram, VT.UINT32),
        "ple.conv_kernel": (cfg.ple_conv_kernel_size, VT.UINT32),
        "ple.eos_token_id": (cfg.eos_token_id, VT.UINT32),
        "embedding_length_per_layer_input": (lay.head_dim, VT.UINT32),
        "ple.layer_multipliers": (list(lay.multipliers), VT.UINT64),
        "ple.head_offsets": (list(lay.head_offsets), VT.UINT64),
        "ple.head_vocab_sizes": (list(lay.head_sizes), VT.UINT64),
    }


def write_gguf(
    path, cfg, qtype=QT.Q8_0, *, arch="qwen4exp", keys=None, rows=None, before=(), after=(), alignment=None, extra=None
):
    """A GGUF holding a random table of ``cfg``'s layer 0 between the tensors ``before`` and ``after``
    (``(name, array, raw type or None)``), with the PLE ``keys`` (default :func:`ple_keys`) and the
    ``extra`` metadata ``{full key: (value, type)}``; returns the table's stored bytes."""
    lay = cfg.layout(0)
    rows = lay.padded_rows if rows is None else rows
    x = np.random.default_rng(1).standard_normal((rows, lay.head_dim)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype) if qtype != QT.F32 else x
    w = gguf.GGUFWriter(str(path), arch=arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for k, (v, t) in (ple_keys(cfg) if keys is None else keys).items():
        if isinstance(v, list):
            w.add_key_value(f"{arch}.{k}", v, VT.ARRAY, t)
        else:
            w.add_key_value(f"{arch}.{k}", v, t)
    for k, (v, t) in (extra or {}).items():
        if isinstance(v, list):
            w.add_key_value(k, v, VT.ARRAY, t)
        else:
            w.add_key_value(k, v, t)
    for name, arr, qt in before:
        w.add_tensor(name, arr, raw_dtype=qt)
    w.add_tensor(TABLE_TENSOR, raw, raw_dtype=qtype)
    for name, arr, qt in after:
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return np.asarray(raw)


def tensor_info(path, name: str) -> tuple[int, int]:
    """Byte positions of the GGML type and the offset fields of tensor ``name``'s description."""
    blob = path.read_bytes()
    key = struct.pack("<Q", len(name)) + name.encode()
    at = blob.index(key) + len(key)
    (nd,) = struct.unpack_from("<I", blob, at)
    type_at = at + 4 + 8 * nd
    return type_at, type_at + 4


def poke(path, at: int, fmt: str, value: int, grow: int = 0) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(struct.pack(fmt, value))
        if grow:  # room after the data, so that a range past the end is not what refuses the file
            fh.seek(0, 2)
            fh.write(bytes(grow))


def offset_of(path, name: str) -> int:
    _, off_at = tensor_info(path, name)
    return struct.unpack_from("<Q", path.read_bytes(), off_at)[0]


def convert(tmp_path, src, *extra) -> int:
    return main(["convert", str(src), str(tmp_path / "out"), *map(str, extra)])


def refused(tmp_path, capsys, src, msg, *extra) -> None:
    capsys.readouterr()
    assert convert(tmp_path, src, *extra) == 1
    err = capsys.readouterr().err
    assert err.startswith("ple convert: ") and msg in err, err
    assert main(["inspect", str(src)]) == 1
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def cfg(tmp_path):
    cfg = PLEConfig(**WIDE)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg.to_dict()))
    return cfg


def _other():
    return [(OTHER, np.zeros((4, 32), np.float32), None)]  # 512 bytes: the table's offset is 512


# ------------------------------------------------------------------------------------------ item 2: offsets


def test_the_size_of_every_ggml_type_is_the_gguf_packages():
    from ple.checkpoint.gguf import _GGML_TYPES

    want = {int(t): (t.name, *sizes) for t, sizes in gguf.constants.GGML_QUANT_SIZES.items()}
    assert _GGML_TYPES == want


def test_offsets_are_checked_as_llama_cpp_does_on_the_writers_own_files(tmp_path, capsys):
    """Tensors of many types and sizes (padding between them), the table in the middle, alignments 32
    and 256: every offset ple finds is the ``gguf`` package reader's, and the table converts exactly."""
    cfg = PLEConfig(**WIDE)
    before = [
        ("a.weight", np.zeros((3, 144), np.uint8), QT.Q4_K),
        ("b.weight", np.arange(15, dtype=np.float16).reshape(3, 5), None),
        ("c.weight", np.arange(7, dtype=np.int8), None),
    ]
    after = [("d.weight", np.zeros((2, 210), np.uint8), QT.Q6_K), ("e.weight", np.ones((5,), np.float32), None)]
    for align in (None, 256):
        path = tmp_path / f"m{align}.gguf"
        raw = write_gguf(path, cfg, QT.Q5_0, before=before, after=after, alignment=align)
        model = read_gguf(path)
        oracle = {t.name: (t.data_offset, t.n_bytes) for t in gguf.GGUFReader(path).tensors}
        assert {n: (t.offset, t.nbytes) for n, t in model.tensors.items()} == oracle
        capsys.readouterr()
        assert main(["convert", str(path), str(tmp_path / f"out{align}")]) == 0
        (f,) = (tmp_path / f"out{align}").glob("*.pletable")
        assert np.array_equal(MmapTable.open(f).data.numpy(), raw)


@pytest.mark.parametrize(
    "damage, msg",
    [
        # misaligned: one byte on
        (lambda p: poke(p, tensor_info(p, TABLE_TENSOR)[1], "<Q", 513, grow=64), "has offset 513, not a multiple of general.alignment 32 (expected 512)"),
        # aligned, but inside the previous tensor's 512 bytes
        (lambda p: poke(p, tensor_info(p, TABLE_TENSOR)[1], "<Q", 256), "has offset 256, expected 512 (inside the bytes of a tensor before it"),
        # aligned, after a gap
        (lambda p: poke(p, tensor_info(p, TABLE_TENSOR)[1], "<Q", 544, grow=64), "has offset 544, expected 512 (past a gap"),
        # the first tensor does not start the data section
        (lambda p: poke(p, tensor_info(p, OTHER)[1], "<Q", 32), f"tensor {OTHER} has offset 32, expected 0 (past a gap at the data's start"),
    ],
    ids=["misaligned", "overlap", "gap", "first"],
)  # fmt: skip
def test_a_tensor_offset_that_is_not_the_running_one_is_refused(tmp_path, capsys, cfg, damage, msg):
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, before=_other())
    assert offset_of(src, TABLE_TENSOR) == 512
    damage(src)
    refused(tmp_path, capsys, src, msg)
    refused(tmp_path, capsys, src, msg, "--config", tmp_path / "cfg")


def test_swapped_offsets_are_refused(tmp_path, capsys, cfg):
    """The two tensors' offsets exchanged: the table would be read from the other tensor's bytes."""
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, after=_other())  # the table first, at 0
    other = offset_of(src, OTHER)
    poke(src, tensor_info(src, TABLE_TENSOR)[1], "<Q", other)
    poke(src, tensor_info(src, OTHER)[1], "<Q", 0)
    refused(tmp_path, capsys, src, f"tensor {TABLE_TENSOR} has offset {other}, expected 0")


def test_a_larger_alignment_is_honoured(tmp_path, capsys, cfg):
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, before=_other(), alignment=64)
    poke(src, tensor_info(src, TABLE_TENSOR)[1], "<Q", 544, grow=128)  # a multiple of 32, not of 64
    refused(tmp_path, capsys, src, "has offset 544, not a multiple of general.alignment 64 (expected 512)")


def test_any_tensor_past_the_end_of_the_file_is_refused(tmp_path, capsys, cfg):
    """The table is whole, but a tensor of a type ple does not serve after it is cut short."""
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, after=[(OTHER, np.zeros((8, 144), np.uint8), QT.Q4_K)])
    with open(src, "r+b") as fh:
        fh.truncate(src.stat().st_size - 100)
    refused(tmp_path, capsys, src, f"tensor {OTHER} (1152 bytes at byte")


def test_a_ggml_type_ple_does_not_know_is_refused(tmp_path, capsys, cfg):
    """Where the tensors after it lie cannot be computed: the file is refused by the type's number."""
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, before=[(OTHER, np.zeros((4, 144), np.uint8), QT.Q4_K)])
    poke(src, tensor_info(src, OTHER)[0], "<I", 99)
    refused(tmp_path, capsys, src, f"tensor {OTHER} has GGML type 99, which ple does not know")


def test_rows_that_are_not_whole_blocks_of_another_tensor_are_refused(tmp_path, capsys, cfg):
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, before=[(OTHER, np.zeros((4, 144), np.uint8), QT.Q4_K)])
    type_at, _ = tensor_info(src, OTHER)
    poke(src, type_at - 16, "<Q", 255)  # ne0 of a 2-D tensor: 255 values, not whole Q4_K blocks of 256
    refused(tmp_path, capsys, src, f"tensor {OTHER} has rows of 255 values, not whole Q4_K blocks of 256")


def test_a_metadata_key_twice_is_refused(tmp_path, capsys, cfg):
    """A second ``head_offsets`` (the last one would have won) is refused, not chosen from."""
    keys = ple_keys(cfg)
    keys["ple.head_offsetX"] = ([0] * len(keys["ple.head_offsets"][0]), VT.UINT64)
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, keys=keys)
    blob = src.read_bytes().replace(b"qwen4exp.ple.head_offsetX", b"qwen4exp.ple.head_offsets")
    src.write_bytes(blob)
    refused(tmp_path, capsys, src, "metadata key 'qwen4exp.ple.head_offsets' appears twice")


def test_a_fifo_named_like_a_gguf_is_refused_at_once(tmp_path):
    """Refused, not waited on (the open would wait for a writer): run in a thread given 60 s, and
    released by a writer's open if it did wait."""
    import os
    import threading

    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            read_gguf(fifo)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(60)
    waited = t.is_alive()
    if waited:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(60)
    assert not waited, "read_gguf waited on a FIFO"
    assert len(errors) == 1 and isinstance(errors[0], GGUFError), errors
    assert "is a FIFO, not a regular file" in str(errors[0])


# ------------------------------------------------------------------------------ item 5: metadata vs table


def test_a_table_with_fewer_rows_than_its_heads_address_is_refused(tmp_path, capsys, cfg):
    lay = cfg.layout(0)
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, rows=lay.rows - 1)
    end = lay.head_offsets[-1] + lay.head_sizes[-1]
    refused(tmp_path, capsys, src, f"the heads address rows [0, {end}) (qwen4exp.ple.head_offsets[-1]")
    # with the config, its geometry says so too
    capsys.readouterr()
    assert convert(tmp_path, src, "--config", tmp_path / "cfg") == 1
    assert f"the config's table is [32, {lay.padded_rows}]" in capsys.readouterr().err
    # padding rows past the last head's are fine (the config pads to a multiple of 64)
    write_gguf(src, cfg, rows=lay.rows)
    assert convert(tmp_path, src) == 0


def _bump(key, f):
    def mutate(keys):
        v, t = keys[key]
        keys[key] = (f(v), t)

    return mutate


@pytest.mark.parametrize(
    "mutate, msg",
    [
        (_bump("ple.head_offsets", lambda v: [v[0], v[1] + 1, *v[2:]]), "qwen4exp.ple.head_offsets[1] is "),
        (_bump("ple.head_vocab_sizes", lambda v: v[:-1]), "qwen4exp.ple.head_vocab_sizes has 3 entries, expected 4"),
        (_bump("ple.layer_multipliers", lambda v: v + [3]), "qwen4exp.ple.layer_multipliers has 4 entries, expected 3"),
        (_bump("ple.layer_multipliers", lambda v: [v[0] + 1, *v[1:]]), "qwen4exp.ple.layer_multipliers[0] is "),
        (_bump("ple.heads_per_ngram", lambda v: 3), "qwen4exp.ple.head_vocab_sizes has 4 entries, expected 6"),
        (_bump("ple.ngram_size", lambda v: 1), "qwen4exp.ple.ngram_size is 1, expected an integer in [2, 64]"),
        (_bump("ple.conv_kernel", lambda v: 0), "qwen4exp.ple.conv_kernel is 0, expected an integer in [1, 1024]"),
        (_bump("ple.layers", lambda v: [1, 2]), "qwen4exp.ple.layers is [1, 2]: ple reads GGUF models with one PLE layer"),
    ],
    ids=["offsets", "sizes", "multipliers", "even", "heads", "ngram", "kernel", "layers"],
)  # fmt: skip
def test_metadata_that_disagrees_with_itself_is_refused(tmp_path, capsys, cfg, mutate, msg):
    keys = ple_keys(cfg)
    mutate(keys)
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, keys=keys)
    refused(tmp_path, capsys, src, msg)
    # with the config, the key that differs is named with both values
    capsys.readouterr()
    assert convert(tmp_path, src, "--config", tmp_path / "cfg") == 1
    assert "qwen4exp.ple." in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_models_vocabulary_bounds_eos_and_the_multipliers(tmp_path, capsys, cfg):
    """``tokenizer.ggml.tokens`` (or ``qwen4exp.vocab_size``) gives the vocabulary the layout was made for."""
    tokens = {"tokenizer.ggml.tokens": ([f"t{i}" for i in range(cfg.vocab_size)], VT.STRING)}
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, extra=tokens)
    assert main(["convert", str(src), str(tmp_path / "ok")]) == 0  # the layout's own values fit
    keys = ple_keys(cfg)
    keys["ple.eos_token_id"] = (cfg.vocab_size, VT.UINT32)
    write_gguf(src, cfg, keys=keys, extra=tokens)
    refused(
        tmp_path,
        capsys,
        src,
        f"qwen4exp.ple.eos_token_id is {cfg.vocab_size}, expected an integer in [0, {cfg.vocab_size - 1}]",
    )
    write_gguf(src, cfg, extra={"qwen4exp.vocab_size": (10**6, VT.UINT32)})  # multipliers made for 500 tokens
    refused(tmp_path, capsys, src, "a vocabulary of 1000000 tokens gives")


def test_a_gguf_without_heads_per_ngram_needs_its_config(tmp_path, capsys, cfg):
    keys = ple_keys(cfg)
    del keys["ple.heads_per_ngram"]
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, keys=keys)
    capsys.readouterr()
    assert convert(tmp_path, src) == 1
    assert (
        "lacks the PLE metadata qwen4exp.ple.heads_per_ngram: name the model's config.json" in capsys.readouterr().err
    )
    assert convert(tmp_path, src, "--config", tmp_path / "cfg") == 0


def test_verify_judges_the_metadata_a_file_records(tmp_path, capsys, cfg):
    """A table file made from a GGUF without a config (by an older ple, here by hand) whose rows do not
    reach the rows its recorded heads address is a problem for ``ple verify``."""
    keys = {k: v for k, (v, _) in ple_keys(cfg).items()}
    layout = {"gguf": keys, "ple_layer_index": 0}
    f = tmp_path / "per_layer_token_embd.pletable"
    with TableFileWriter(f, 64, 32, "q8_0", 64, layout) as w:
        w.write_shard(0, torch.zeros(64, 34, dtype=torch.uint8))
    capsys.readouterr()
    assert main(["verify", str(f)]) == 1
    out = capsys.readouterr().out
    end = cfg.layout(0).rows
    assert f"the GGUF metadata its header records: the heads address rows [0, {end})" in out
    assert "the table has 64 rows" in out


# --------------------------------------------------------------------------------- item 6: architecture


def test_another_architecture_is_refused_by_name(tmp_path, capsys, cfg):
    """A llama GGUF with a tensor of the table's name and the config's shape, and no PLE key."""
    src = tmp_path / "m.gguf"
    write_gguf(src, cfg, arch="llama", keys={})
    msg = "general.architecture is 'llama'; ple reads the PLE table of GGUF models of architecture 'qwen4exp'"
    refused(tmp_path, capsys, src, msg, "--config", tmp_path / "cfg")
    from ple.checkpoint.gguf import ple_table

    with pytest.raises(GGUFError, match="'llama'"):
        ple_table(read_gguf(src))


def test_a_qwen4exp_gguf_without_ple_keys_converts_with_its_config(tmp_path, capsys, cfg):
    """The architecture ple reads, no PLE key: the config gives the layout, the tensor's shape is checked."""
    src = tmp_path / "m.gguf"
    raw = write_gguf(src, cfg, keys={})
    capsys.readouterr()
    assert convert(tmp_path, src) == 1
    assert "lacks the PLE metadata qwen4exp.ple.layer_multipliers" in capsys.readouterr().err
    assert convert(tmp_path, src, "--config", tmp_path / "cfg") == 0
    (f,) = (tmp_path / "out").glob("*.pletable")
    assert np.array_equal(MmapTable.open(f, cfg.layout_fields(0)).data.numpy(), raw)
