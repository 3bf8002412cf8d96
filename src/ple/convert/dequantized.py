""":func:`dequantize_checkpoint`: a copy of a checkpoint folder whose quantized PLE tables are
dequantized, for readers that ignore ``weight_scale`` (transformers 5.24 reads an F8_E4M3 table as a
plain cast and drops the scale).

The folder is read the way :mod:`ple.checkpoint` reads every checkpoint: its files listed by
:func:`ple.checkpoint.checkpoint_files` (an index may only name files inside the folder), headers
parsed by :func:`ple.checkpoint.read_header`, tensors read with ``pread`` by a
:class:`ple.checkpoint.PreadReader` (nothing mapped; regular files only: a FIFO or a device named
like a checkpoint file is refused, never waited on). No transformers import here.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from ple.checkpoint import (
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    CheckpointError,
    PreadReader,
    SafetensorsHeader,
    TensorInfo,
    checkpoint_files,
    read_header,
)
from ple.common.files import file_kind, fsync_dir, open_regular, partial_dir, read_json, write_atomically
from ple.errors import InvalidArgumentError
from ple.table import dequantize

__all__ = ["dequantize_checkpoint"]

_ST_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_CHUNK_BYTES = 64 << 20
_MAX_JSON_BYTES = 64 << 20
_TABLE_RE = re.compile(r"(?:^|\.)ple\.ple_embedding\.ngram_embedding\.(?:shard_[0-9]{1,9}\.)?weight$")
_SCALE_RE = re.compile(r"(?:^|\.)ple\.ple_embedding\.ngram_embedding\.(?:shard_[0-9]{1,9}\.)?weight_scale$")

#: (file, name, info) of a tensor
_Where = tuple[Path, str, TensorInfo]


def _scales(headers: list[SafetensorsHeader]) -> dict[str, _Where]:
    """Every table scale of the checkpoint: name -> where it is."""
    return {name: (h.path, name, i) for h in headers for name, i in h.tensors.items() if _SCALE_RE.search(name)}


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def _dequantized_chunks(
    reader: PreadReader, name: str, e: TensorInfo, scale: _Where, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    rows = e.shape[0]
    width = e.shape[1] if len(e.shape) > 1 else 1
    itemsize = SAFETENSORS_DTYPES[e.dtype].itemsize
    step = max(1, _CHUNK_BYTES // max(1, width * max(itemsize, dtype.itemsize)))
    _, sname, se = scale
    per_row = se.shape not in ((1,), ())
    if per_row and tuple(se.shape) != (rows, 1):
        raise CheckpointError(f"{name}: per-row scale of shape {list(se.shape)}, expected [{rows}, 1]")
    gscale = None if per_row else reader.get(se, sname).reshape(1).float()
    for a in range(0, rows, step):
        b = min(rows, a + step)
        q = reader.rows(e, name, a, b).reshape(b - a, width)
        s = reader.rows(se, sname, a, b).float() if per_row else gscale
        yield dequantize(q, s, dtype)


def _table_scale_name(name: str) -> str:
    return name[: -len("weight")] + "weight_scale"


def _global_scale_name(name: str) -> str:
    cut = name.rindex("ngram_embedding.") + len("ngram_embedding.")
    return name[:cut] + "weight_scale"


def _other_files(src: Path) -> list[Path]:
    """The folder's files other than its weights and index (tokenizer, config, ...), copied as they
    are; subfolders are skipped; anything that is neither a file nor a folder is refused."""
    out = []
    for p in sorted(src.iterdir()):
        if p.suffix == ".safetensors" or p.name == INDEX_NAME:
            continue
        mode = os.stat(p).st_mode
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{p} is {file_kind(mode)}, not a regular file: refusing to copy the folder")
        out.append(p)
    return out


def _copy_file(src: Path, dst: Path) -> None:
    fd = open_regular(src, "file", CheckpointError)
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            while chunk := os.read(fd, _CHUNK_BYTES):
                _write_all(out, chunk)
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _json(path: Path, what: str) -> dict:
    doc = read_json(path, what, _MAX_JSON_BYTES, CheckpointError)
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return doc


def dequantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a copy of checkpoint folder ``src`` at ``dst`` whose fp8/int8 PLE tables are
    dequantized to ``dtype`` (``q.to(dtype) * scale.to(dtype)``, what ple's lookup computes in a
    ``dtype`` model) and whose ``weight_scale`` tensors are gone: the form plain transformers reads
    correctly. Other tensors are copied byte for byte, other files as they are (subfolders are not
    copied); ``ple_embedding_dtype`` is removed from ``config.json``. Streams in chunks of 64 MiB.

    ``dst`` must not exist; it is built in a new folder of its own beside it
    (``<dst>.<pid>-<random>.partial``, see :func:`ple.common.files.partial_dir`), every file fsync'd, and
    renamed to ``dst`` when complete, so concurrent writers never share files: the first to finish
    wins, the others raise ``FileExistsError``; a failed or interrupted one removes its folder, and
    the folder of one that was killed is removed by the next call for ``dst``. The folder is
    checked (files, headers, what else it holds) before anything is written; raises
    :class:`~ple.checkpoint.CheckpointError` for a checkpoint that cannot be read.
    """
    src, dst = Path(src), Path(dst)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InvalidArgumentError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    if not src.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {src}")
    if dst.exists():
        raise FileExistsError(f"{dst} exists: choose a new folder")
    headers = [read_header(f) for f in checkpoint_files(src)]
    others = _other_files(src)
    config = _json(src / "config.json", "config.json") if (src / "config.json") in others else None
    index = _json(src / INDEX_NAME, "checkpoint index") if os.path.lexists(src / INDEX_NAME) else None
    scales = _scales(headers)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with partial_dir(dst) as partial:
        weight_map: dict[str, str] = {}
        total = 0
        with PreadReader() as reader:
            for h in headers:
                total += _dequantize_file(reader, h, partial / h.path.name, scales, dtype, weight_map)
        for p in others:
            if p.name != "config.json":
                _copy_file(p, partial / p.name)
        if config is not None:
            config.pop("ple_embedding_dtype", None)
            if isinstance(config.get("text_config"), dict):
                config["text_config"].pop("ple_embedding_dtype", None)
            write_atomically(partial / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
        if index is not None:
            index["weight_map"] = dict(sorted(weight_map.items()))
            metadata = index.get("metadata")
            index["metadata"] = {**(metadata if isinstance(metadata, dict) else {}), "total_size": total}
            write_atomically(partial / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
        fsync_dir(partial)
        _publish_folder(partial, dst)
    fsync_dir(dst.parent)
    return dst


def _publish_folder(partial: Path, dst: Path) -> None:
    """Rename the finished folder ``partial`` to ``dst``, which must not exist (another writer that
    finished first keeps its copy)."""
    if os.path.lexists(dst):
        raise FileExistsError(f"{dst} appeared while the copy was written (another writer finished first)")
    try:
        os.rename(partial, dst)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
            raise FileExistsError(f"{dst} appeared while the copy was written (another writer finished first)") from e
        raise


def _dequantize_file(
    reader: PreadReader,
    h: SafetensorsHeader,
    out: Path,
    scales: dict[str, _Where],
    dtype: torch.dtype,
    weight_map: dict[str, str],
) -> int:
    """Write one file of the copy; returns its tensor bytes."""
    plan: list[tuple[str, TensorInfo, _Where | None, str, int]] = []  # name, info, scale, dtype, nbytes
    for name, e in sorted(h.tensors.items(), key=lambda kv: kv[1].begin):
        if _SCALE_RE.search(name):
            continue
        scale = None
        if _TABLE_RE.search(name) and e.dtype == "U8":
            raise CheckpointError(
                f"{name} is an NVFP4 table (U8), which this copy does not expand: load the model with ple's "
                "from_pretrained and save_pretrained it (its tables are written dequantized)"
            )
        if _TABLE_RE.search(name) and e.dtype in ("F8_E4M3", "I8"):
            scale = scales.get(_table_scale_name(name)) or scales.get(_global_scale_name(name))
            if scale is None:
                raise CheckpointError(f"{name} is {e.dtype} but the checkpoint has no weight_scale for it")
        if scale is None:
            plan.append((name, e, None, e.dtype, e.nbytes))
        else:
            n = e.nbytes // SAFETENSORS_DTYPES[e.dtype].itemsize * dtype.itemsize
            plan.append((name, e, scale, _ST_NAMES[dtype], n))
    header: dict[str, object] = {}
    off = 0
    for name, e, _, dt, n in plan:
        header[name] = {"dtype": dt, "shape": list(e.shape), "data_offsets": [off, off + n]}
        off += n
    if h.metadata:
        header["__metadata__"] = h.metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, struct.pack("<Q", len(blob)) + blob)
        for name, e, scale, _, _ in plan:
            if scale is None:
                for a in range(0, e.nbytes, _CHUNK_BYTES):
                    _write_all(fd, reader.raw(e, name, a, min(e.nbytes, a + _CHUNK_BYTES)))
            else:
                for chunk in _dequantized_chunks(reader, name, e, scale, dtype):
                    _write_all(fd, chunk.contiguous().view(torch.uint8).numpy())
            weight_map[name] = out.name
        os.fsync(fd)
    finally:
        os.close(fd)
    return off
