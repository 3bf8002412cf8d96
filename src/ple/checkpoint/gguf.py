"""GGUF files (llama.cpp's format, version 2 and 3) as a source of PLE tables: ple's own reader.

:func:`read_gguf` parses the header of one file or of a split set (``<name>-00001-of-0000N.gguf``:
every part is found beside the first and checked against its ``split.no`` / ``split.count``) into a
:class:`GGUFModel`: metadata (scalars and arrays; the values of arrays longer than
:data:`MAX_KEPT_ARRAY` are skipped, their length kept) and tensor descriptions, each with the part it
lies in, its absolute byte range there and its ple format. Nothing of the tensors is read.

GGUF stores a 2-D tensor with its dimensions innermost first: ``[ne0, ne1]`` is ``ne1`` rows of
``ne0`` values, each row ``ne0 / block`` whole blocks; the GGML types ple serves map to table
formats (:data:`GGML_FORMATS`), every other type is refused by name (:class:`GGUFError`).

Where the tensors lie is checked as llama.cpp checks it: the data section holds them in the order
they are described, each at the previous one's end rounded up to ``general.alignment`` (default 32),
all within the file; every tensor's GGML type must be one whose block size ple knows.

The PLE table of a ``qwen4exp`` GGUF (the only architecture read, :data:`ARCHITECTURES`) is the tensor
``per_layer_token_embd.weight`` ([head_dim, rows]); the PLE metadata keys are ``<arch>.ple.*`` and
``<arch>.embedding_length_per_layer_input`` (see :data:`PLE_KEYS` and docs/FORMATS.md), checked
against one another and the tensor by :func:`ple_table`.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ple.common.files import file_identity, open_regular, pread_exact
from ple.config import LIMITS, MAX_HEADS
from ple.errors import PLEError
from ple.table.formats.catalog import format_info

__all__ = [
    "ARCHITECTURES",
    "GGUFError",
    "GGUFModel",
    "GGUFRows",
    "GGUFTensor",
    "GGML_FORMATS",
    "PLE_KEYS",
    "TABLE_TENSOR",
    "ple_metadata_problems",
    "ple_table",
    "read_gguf",
    "split_parts",
    "table_tensor",
]

ARCHITECTURES = ("qwen4exp",)
"""The GGUF architectures (``general.architecture``) whose PLE table ple reads; any other is refused
by name (the table tensor's name and shape alone do not say how its rows are addressed)."""

TABLE_TENSOR = "per_layer_token_embd.weight"
"""The tensor llama.cpp's converter writes a qwen4exp model's PLE table as."""

PLE_KEYS = (
    "ple.layers",
    "ple.ngram_size",
    "ple.heads_per_ngram",
    "ple.conv_kernel",
    "ple.eos_token_id",
    "ple.layer_multipliers",
    "ple.head_offsets",
    "ple.head_vocab_sizes",
    "embedding_length_per_layer_input",
)
"""The PLE metadata keys (each prefixed by ``<general.architecture>.``)."""

GGML_FORMATS = {
    0: "fp32",
    1: "fp16",
    30: "bf16",
    8: "q8_0",
    7: "q5_1",
    6: "q5_0",
    3: "q4_1",
    2: "q4_0",
    20: "iq4_nl",
    39: "mxfp4",
}
"""GGML type number -> the table format that stores it byte for byte."""

_GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}  # fmt: skip
"""GGML type number -> (name, values a block, bytes a block) of every type GGUF files hold: what the
data section's layout is computed from (a tensor of any other type number is refused)."""

_GGML_NAMES = {k: v[0] for k, v in _GGML_TYPES.items()}

MAX_KEPT_ARRAY = 1 << 16
"""Arrays longer than this (a tokenizer's vocabulary) are skipped, their length kept."""

_MAX_COUNT = 1 << 24
_MAX_STRING = 1 << 24
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# value type -> (struct format, size)
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9


class GGUFError(PLEError, ValueError):
    """A GGUF file ple cannot read as a table source; the message names the file and what is wrong."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF model: ``dims`` innermost first, GGML ``type`` (and its ple ``format``,
    None when ple has none), and where its bytes lie (``path``, absolute ``offset``, ``nbytes``)."""

    name: str
    dims: tuple[int, ...]
    type: int
    path: Path
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return _GGML_NAMES.get(self.type, f"type {self.type}")

    @property
    def format(self) -> str | None:
        return GGML_FORMATS.get(self.type)


@dataclass
class GGUFModel:
    """The header of a GGUF model (one file or a split set)."""

    paths: list[Path]
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)

    @property
    def arch(self) -> str | None:
        a = self.metadata.get("general.architecture")
        return a if isinstance(a, str) else None

    def vocab_size(self) -> int | None:
        """The model's vocabulary: ``<arch>.vocab_size``, else the length of ``tokenizer.ggml.tokens``
        (None when neither is there)."""
        v = self.metadata.get(f"{self.arch}.vocab_size")
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, _Skipped):
            return tokens.length
        return len(tokens) if isinstance(tokens, list) else None

    def ple_metadata(self) -> dict[str, Any]:
        """The PLE keys present (:data:`PLE_KEYS`, without the architecture prefix)."""
        arch = self.arch
        if arch is None:
            return {}
        return {k: self.metadata[f"{arch}.{k}"] for k in PLE_KEYS if f"{arch}.{k}" in self.metadata}


class _Cursor:
    def __init__(self, buf, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: the file ends inside its header ({what} at byte {self.pos})")
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def scalar(self, kind: int, what: str):
        fmt, size = _SCALARS[kind]
        return struct.unpack(fmt, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        if n > _MAX_STRING:
            raise GGUFError(f"{self.path}: {what} claims a string of {n} bytes")
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: {what} is not UTF-8 text") from None

    def value(self, kind: int, what: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(kind, what)
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise GGUFError(f"{self.path}: {what} has unknown value type {kind}")
        elem = self.u32(what)
        n = self.u64(what)
        if n > len(self.buf):
            raise GGUFError(f"{self.path}: {what} claims an array of {n} values")
        if elem == _ARRAY:
            raise GGUFError(f"{self.path}: {what} is an array of arrays, which ple does not read")
        if elem in _SCALARS and n > MAX_KEPT_ARRAY:
            self.take(n * _SCALARS[elem][1], what)
            return _Skipped(n)
        values = [self.value(elem, what) for _ in range(n)]
        return values if n <= MAX_KEPT_ARRAY else _Skipped(n)


@dataclass(frozen=True)
class _Skipped:
    """An array too long to keep: its length."""

    length: int


def split_parts(path: str | os.PathLike) -> list[Path]:
    """Every file of the model ``path`` names: itself, or for ``<stem>-0000k-of-0000N.gguf`` the N
    parts beside it (each must exist)."""
    p = Path(path)
    m = _SPLIT.match(p.name)
    if m is None:
        return [p]
    count = int(m["count"])
    if count < 1 or int(m["no"]) > count:
        raise GGUFError(f"{p}: a split part numbered {m['no']} of {m['count']}")
    parts = [p.with_name(f"{m['stem']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise GGUFError(f"{p}: split set of {count} files lacks {', '.join(missing)}")
    return parts


def _read_one(path: Path) -> tuple[int, dict[str, Any], list[GGUFTensor]]:
    fd = open_regular(path, "GGUF file", GGUFError)  # a FIFO or a device is refused, never waited on
    try:
        size = os.fstat(fd).st_size
        if size < 24:
            raise GGUFError(f"{path}: {size} bytes is too short for a GGUF file")
        buf = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        c = _Cursor(memoryview(buf), path)
        if bytes(c.take(4, "magic")) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (no GGUF magic)")
        version = c.u32("version")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version}, ple reads versions 2 and 3")
        n_tensors, n_kv = c.u64("tensor count"), c.u64("metadata count")
        if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
            raise GGUFError(f"{path}: header claims {n_tensors} tensors and {n_kv} metadata entries")
        meta: dict[str, Any] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key {i}")
            if key in meta:
                raise GGUFError(f"{path}: metadata key {key!r} appears twice")
            meta[key] = c.value(c.u32(key), key)
        infos = []
        for i in range(n_tensors):
            name = c.string(f"tensor name {i}")
            nd = c.u32(name)
            if not 1 <= nd <= 4:
                raise GGUFError(f"{path}: tensor {name} has {nd} dimensions")
            dims = tuple(c.u64(name) for _ in range(nd))
            infos.append((name, dims, c.u32(name), c.u64(name)))
        align = meta.get("general.alignment", 32)
        if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
            raise GGUFError(f"{path}: general.alignment {align!r} is not a power of two")
        data_start = -(-c.pos // align) * align
        return version, meta, _place_tensors(path, infos, align, data_start, size)
    finally:
        c.buf.release()
        buf.close()


def _place_tensors(
    path: Path, infos: list[tuple[str, tuple[int, ...], int, int]], align: int, data_start: int, size: int
) -> list[GGUFTensor]:
    """The tensors of one file, each checked where its bytes lie: the data section holds the tensors
    in the order of their descriptions, each starting where the previous one's bytes end, rounded up
    to ``general.alignment`` (what llama.cpp requires); a misaligned offset, one inside the previous
    tensor's bytes or past a gap, and bytes beyond the end of the file are refused."""
    tensors = []
    expected = 0  # the offset (from the data section's start) the next tensor must have
    for name, dims, typ, off in infos:
        nbytes = _nbytes(path, name, dims, typ)
        if off % align:
            raise GGUFError(
                f"{path}: tensor {name} has offset {off}, not a multiple of general.alignment {align} "
                f"(expected {expected})"
            )
        if off != expected:
            if off < expected:
                where = "inside the bytes of a tensor before it"
            else:
                where = "past a gap after the tensor before it" if expected else "past a gap at the data's start"
            raise GGUFError(
                f"{path}: tensor {name} has offset {off}, expected {expected} ({where}: a GGUF's tensors lie "
                f"one after another in the order they are described, each aligned to {align} bytes)"
            )
        start = data_start + off
        if start + nbytes > size:
            raise GGUFError(
                f"{path}: tensor {name} ({nbytes} bytes at byte {start}) runs past the end of the file "
                f"({size} bytes): the data section is truncated"
            )
        tensors.append(GGUFTensor(name, dims, typ, path, start, nbytes))
        expected = off + -(-nbytes // align) * align
    return tensors


def _nbytes(path: Path, name: str, dims: tuple[int, ...], typ: int) -> int:
    """Bytes of a tensor of shape ``dims`` (innermost first) and GGML type ``typ``; an unknown type, or
    rows that are not whole blocks of the type, are refused."""
    kind = _GGML_TYPES.get(typ)
    if kind is None:
        raise GGUFError(
            f"{path}: tensor {name} has GGML type {typ}, which ple does not know "
            "(so where the tensors after it lie cannot be checked)"
        )
    type_name, block, block_nbytes = kind
    if dims[0] % block:
        raise GGUFError(f"{path}: tensor {name} has rows of {dims[0]} values, not whole {type_name} blocks of {block}")
    n = dims[0] // block * block_nbytes
    for d in dims[1:]:
        n *= d
    return n


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """The header of the GGUF model ``path`` (one file, or the first or any part of a split set)."""
    parts = split_parts(path)
    model: GGUFModel | None = None
    for k, p in enumerate(parts):
        version, meta, tensors = _read_one(p)
        if len(parts) > 1:
            no, count = meta.get("split.no"), meta.get("split.count")
            if no != k or count != len(parts):
                raise GGUFError(f"{p}: its split.no/split.count are {no}/{count}, its name says {k}/{len(parts)}")
        if model is None:
            model = GGUFModel(parts, version, meta)
        for t in tensors:
            if t.name in model.tensors:
                raise GGUFError(f"{p}: tensor {t.name} appears twice in the set")
            model.tensors[t.name] = t
    assert model is not None
    want = model.metadata.get("split.tensors.count")
    if len(parts) > 1 and isinstance(want, int) and want != len(model.tensors):
        raise GGUFError(f"{parts[0]}: split.tensors.count is {want}, the parts hold {len(model.tensors)} tensors")
    return model


def table_tensor(model: GGUFModel, name: str = TABLE_TENSOR, head_dim: int | None = None) -> GGUFTensor:
    """The table tensor, checked: present, 2-D ``[head_dim, rows]`` with at least one row, of a type ple
    serves (and ``head_dim`` wide when given)."""
    t = model.tensors.get(name)
    where = model.paths[0]
    if t is None:
        raise GGUFError(f"{where}: no tensor {name!r} (the PLE table a qwen4exp GGUF holds)")
    if len(t.dims) != 2 or 0 in t.dims:
        raise GGUFError(f"{t.path}: tensor {name} has shape {list(t.dims)}, expected [head_dim, rows] (both >= 1)")
    if t.format is None:
        raise GGUFError(
            f"{t.path}: tensor {name} is of GGML type {t.type_name}, which ple has no table format for "
            f"(it reads {', '.join(_GGML_NAMES[k] for k in GGML_FORMATS)})"
        )
    if head_dim is not None and t.dims[0] != head_dim:
        raise GGUFError(f"{t.path}: tensor {name} has rows of {t.dims[0]} values, the model's head_dim is {head_dim}")
    return t


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def ple_metadata_problems(
    ple: dict[str, Any], rows: int, head_dim: int, prefix: str = "", vocab_size: int | None = None
) -> list[str]:
    """What in the PLE metadata ``ple`` (:data:`PLE_KEYS` without the architecture prefix; the keys
    absent are not judged) is malformed or disagrees with itself or with a table of ``rows`` rows of
    ``head_dim`` values; empty when all is consistent. Checked: each value's type and range (those of
    :class:`~ple.config.PLEConfig`'s fields), ``layer_multipliers`` (``ngram_size`` odd integers below
    2^64), ``head_vocab_sizes`` and ``head_offsets`` (``(ngram_size - 1) * heads_per_ngram`` heads, each
    head's rows following the previous head's from row 0, as the qwen4_exp layout places them), that
    the table holds every row the heads address, and ``embedding_length_per_layer_input == head_dim``;
    given the model's ``vocab_size``, ``eos_token_id`` is a token of it and each multiplier is one the
    layout derives for it (at most ``2 * (((2^63 - 1) // vocab_size) // 2) - 1``). Keys are named with
    ``prefix`` (``"qwen4exp."``)."""
    problems: list[str] = []

    def integer(key: str, lo: int, hi: int) -> int | None:
        if key not in ple:
            return None
        v = ple[key]
        if not _is_int(v) or not lo <= v <= hi:
            problems.append(f"{prefix}{key} is {_shown(v)}, expected an integer in [{lo}, {hi}]")
            return None
        return v

    def integers(key: str, n: int | None, lo: int, hi: int) -> list[int] | None:
        if key not in ple:
            return None
        v = ple[key]
        if isinstance(v, _Skipped) or not isinstance(v, list) or not all(_is_int(x) for x in v):
            problems.append(f"{prefix}{key} is {_shown(v)}, expected a list of integers")
            return None
        if n is not None and len(v) != n:
            problems.append(f"{prefix}{key} has {len(v)} entries, expected {n}")
            return None
        bad = [(i, x) for i, x in enumerate(v) if not lo <= x <= hi]
        if bad:
            i, x = bad[0]
            problems.append(f"{prefix}{key}[{i}] is {x}, expected an integer in [{lo}, {hi}]")
            return None
        return v

    lim = LIMITS
    n = integer("ple.ngram_size", *lim["ngram_size"][:2])
    hpn = integer("ple.heads_per_ngram", *lim["heads_per_ngram"][:2])
    integer("ple.conv_kernel", *lim["ple_conv_kernel_size"][:2])
    vocab = vocab_size if vocab_size is not None and vocab_size >= 1 else lim["vocab_size"][1]
    integer("ple.eos_token_id", 0, vocab - 1)
    width = integer("embedding_length_per_layer_input", 1, lim["ple_embed_dim"][1])
    if width is not None and width != head_dim:
        problems.append(f"{prefix}embedding_length_per_layer_input is {width}, the table's rows are {head_dim} values")
    heads = None
    if n is not None and hpn is not None:
        heads = (n - 1) * hpn
        if heads > MAX_HEADS:
            problems.append(
                f"{prefix}ple.ngram_size {n} and {prefix}ple.heads_per_ngram {hpn} make {heads} heads, "
                f"at most {MAX_HEADS}"
            )
            heads = None
    mults = integers("ple.layer_multipliers", n, 1, (1 << 64) - 1)
    if mults is not None:
        even = [i for i, m in enumerate(mults) if m % 2 == 0]
        if even:
            problems.append(f"{prefix}ple.layer_multipliers[{even[0]}] is {mults[even[0]]}, expected an odd integer")
        top = 2 * max(1, ((1 << 63) - 1) // vocab // 2) - 1
        big = [i for i, m in enumerate(mults) if m > top]
        if vocab_size is not None and big:
            problems.append(
                f"{prefix}ple.layer_multipliers[{big[0]}] is {mults[big[0]]}, more than the {top} a vocabulary of "
                f"{vocab_size} tokens gives"
            )
    sizes = integers("ple.head_vocab_sizes", heads, 1, (1 << 64) - 1)
    offsets = integers("ple.head_offsets", heads if sizes is None else len(sizes), 0, (1 << 64) - 1)
    if sizes is not None and not sizes:
        problems.append(f"{prefix}ple.head_vocab_sizes is empty: a PLE layer has at least one head")
    if sizes and offsets is not None:
        at = 0
        for h, (o, z) in enumerate(zip(offsets, sizes)):
            if o != at:
                problems.append(
                    f"{prefix}ple.head_offsets[{h}] is {o}, expected {at} (head {h}'s rows follow those of the "
                    f"heads before it: the sum of {prefix}ple.head_vocab_sizes[:{h}])"
                )
                break
            at += z
        else:
            if at > rows:
                problems.append(
                    f"the heads address rows [0, {at}) ({prefix}ple.head_offsets[-1] {offsets[-1]} + "
                    f"{prefix}ple.head_vocab_sizes[-1] {sizes[-1]}), the table has {rows} rows"
                )
    elif sizes and sum(sizes) > rows:
        problems.append(
            f"the heads address {sum(sizes)} rows (the sum of {prefix}ple.head_vocab_sizes), the table has {rows}"
        )
    return problems


def _shown(v: Any) -> str:
    if isinstance(v, _Skipped):
        return f"an array of {v.length} values"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def ple_table(model: GGUFModel, metadata: bool = True) -> GGUFTensor:
    """The PLE table of a GGUF model, checked: an architecture ple reads (:data:`ARCHITECTURES`), one
    PLE layer, the table tensor (:func:`table_tensor`) and (``metadata``) the PLE metadata present,
    consistent with itself and with the tensor (:func:`ple_metadata_problems`). Raises
    :class:`GGUFError` naming every problem."""
    where = model.paths[0]
    arch = model.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{where}: general.architecture is {_shown(arch) if arch is not None else 'missing'}; ple reads the PLE "
            f"table of GGUF models of architecture {', '.join(repr(a) for a in ARCHITECTURES)}"
        )
    meta = model.ple_metadata()
    layers = meta.get("ple.layers")
    if layers is not None and (not isinstance(layers, list) or len(layers) != 1 or not _is_int(layers[0])):
        raise GGUFError(f"{where}: {arch}.ple.layers is {_shown(layers)}: ple reads GGUF models with one PLE layer")
    t = table_tensor(model)
    vocab = model.vocab_size()
    problems = ple_metadata_problems(meta, t.dims[1], t.dims[0], f"{arch}.", vocab) if metadata else []
    if problems:
        raise GGUFError(f"{where}: the PLE metadata does not fit the table tensor {t.name}: " + "; ".join(problems))
    return t


class GGUFRows:
    """A 2-D table tensor's stored rows as :func:`ple.table.files.transcode.convert_layer` takes them (a shard
    source): ``shard_rows`` rows a shard, read with ``pread`` in pieces when asked for (nothing stays
    mapped; any thread), named by the file's path and identity (:func:`ple.common.files.file_identity`) and
    the tensor's place in it (so a conversion can resume). A value that is not finite (an F16/BF16/F32 NaN or
    infinity, a NaN or infinite block scale, an mxfp4 value past float32) is a :class:`GGUFError`
    naming the tensor's row and column."""

    error = GGUFError

    def __init__(self, t: GGUFTensor, shard_rows: int) -> None:
        assert t.format is not None
        self.t, self.format, self.shard_rows = t, t.format, shard_rows
        self.num_shards = -(-t.dims[1] // shard_rows)
        info = format_info(t.format)
        self._width, self._rn, self._dtype = info.width(t.dims[0]), info.row_nbytes(t.dims[0]), info.storage_dtype

    @property
    def identity(self) -> str:
        record: list = [str(self.t.path.resolve()), file_identity(self.t.path)]
        record += [self.t.name, self.t.offset, self.t.type, list(self.t.dims)]
        return hashlib.sha256(json.dumps(record).encode()).hexdigest()

    def chunks(self, k: int, max_rows: int) -> Iterator[tuple[torch.Tensor, None]]:
        """Shard ``k``'s stored rows ``[m, width]`` in pieces of at most ``max_rows`` rows, in order (read
        into one buffer the shard's pieces share: a piece is valid until the next)."""
        t, rows = self.t, self.t.dims[1]
        start, stop = min(k * self.shard_rows, rows), min((k + 1) * self.shard_rows, rows)
        step = max(1, max_rows)
        buffer = mmap.mmap(-1, max(1, min(step, stop - start) * self._rn))  # the pieces' one buffer
        fd = os.open(t.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for a in range(start, stop, step):
                n = min(step, stop - a)
                ahead = min(step, stop - a - n) * self._rn  # the next piece: read ahead while this one is worked on
                if ahead > 0 and hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, t.offset + (a + n) * self._rn, ahead, os.POSIX_FADV_WILLNEED)
                view, done = memoryview(buffer)[: n * self._rn], 0
                while done < len(view):
                    got = os.preadv(fd, [view[done:]], t.offset + a * self._rn + done)
                    if got <= 0:
                        at = t.offset + a * self._rn + done
                        raise GGUFError(f"{t.path}: tensor {t.name} ends early, at byte {at}: the file was cut short")
                    done += got
                yield torch.frombuffer(view, dtype=torch.uint8).view(self._dtype).reshape(n, self._width), None
        finally:
            os.close(fd)

    def nonfinite_problem(self, k: int, rows: torch.Tensor, first_row: int, shard_row: int, format=None) -> str | None:
        """The first value of ``rows`` (stored rows from table row ``first_row``) that is not finite, named."""
        from ple.table.formats.encode import first_nonfinite

        hit = first_nonfinite(rows, self.format if format_info(self.format).blocked else None)
        if hit is None:
            return None
        i, col = hit
        row = rows[i]
        if format_info(self.format).blocked:
            info = format_info(self.format)
            block = row[col // 32 * info.block_nbytes :][: info.block_nbytes]
            if self.format == "mxfp4":
                what = f"a value past float32 (its {self.t.type_name} block's exponent byte is 0x{int(block[0]):02x})"
            else:
                d, m = (float(v) for v in block[0:4].view(torch.float16))
                if self.format in ("q4_1", "q5_1") and math.isfinite(d):
                    what = f"the {self.t.type_name} block minimum {m}"
                else:
                    what = f"the {self.t.type_name} block scale {d}"
        else:
            what = str(float(row[col]))
        return (
            f"{self.t.path}: tensor {self.t.name}: row {first_row + i}, column {col} holds {what}, not a finite "
            "value (ple refuses tables it would serve NaN or infinite values from)"
        )


def iter_rows(t: GGUFTensor, shard_rows: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(k, stored rows [n, row_nbytes or head_dim])`` of a 2-D table tensor, ``shard_rows`` at a time,
    read with ``pread`` into fresh buffers (nothing stays mapped)."""
    fmt = t.format
    assert fmt is not None
    info = format_info(fmt)
    width, rows = info.width(t.dims[0]), t.dims[1]
    rn = info.row_nbytes(t.dims[0])
    fd = os.open(t.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for k, start in enumerate(range(0, rows, shard_rows)):
            n = min(shard_rows, rows - start)
            buf = pread_exact(
                fd,
                n * rn,
                t.offset + start * rn,
                lambda at: GGUFError(f"{t.path}: tensor {t.name} ends early, at byte {at}: the file was cut short"),
            )
            raw = torch.frombuffer(buf, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            yield k, raw.view(info.storage_dtype).reshape(n, width)
    finally:
        os.close(fd)
