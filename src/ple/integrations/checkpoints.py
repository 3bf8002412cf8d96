"""Checkpoint folders at the byte level: safetensors headers with their byte ranges, tensors read
with ``pread`` (nothing mapped into the process), and :func:`dequantize_checkpoint`, which writes a
copy of a checkpoint whose quantized PLE tables are dequantized for readers that ignore
``weight_scale`` (transformers 5.24 reads an F8_E4M3 table as a plain cast and drops the scale).

No transformers import here: these helpers work on any safetensors checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from ..checkpoint import INDEX_NAME, CheckpointError, TensorInfo, TensorReader
from ..errors import InvalidArgumentError
from ..table import dequantize

__all__ = [
    "SafetensorsHeader",
    "PreadReader",
    "read_header",
    "checkpoint_files",
    "dequantize_checkpoint",
    "ST_DTYPES",
]

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype names -> torch dtypes (the ones a qwen4_exp checkpoint uses)."""
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
_CHUNK_BYTES = 64 << 20
_TABLE_RE = re.compile(r"(?:^|\.)ple\.ple_embedding\.ngram_embedding\.(?:shard_(?P<k>\d+)\.)?weight$")
_SCALE_RE = re.compile(r"(?:^|\.)ple\.ple_embedding\.ngram_embedding\.(?:shard_(?P<k>\d+)\.)?weight_scale$")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype name, shape, absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed safetensors header: ``entries`` by name (absolute byte ranges), ``metadata``,
    and the raw header bytes (whose digest identifies the file's layout cheaply)."""

    path: Path
    entries: dict[str, Entry]
    metadata: dict[str, str]
    raw: bytes


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse the header of a safetensors file (reads only the header)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path.name}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise CheckpointError(f"{path.name}: header length {n} exceeds the file size {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name}: unreadable safetensors header ({e})") from None
    base = 8 + n
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = (int(v) for v in meta["data_offsets"])
        entries[name] = Entry(str(meta["dtype"]), tuple(int(d) for d in meta["shape"]), base + a, base + b)
    end = max((e.stop for e in entries.values()), default=base)
    if end > size:
        raise CheckpointError(f"{path.name}: truncated: tensor data needs {end} bytes, the file has {size}")
    return SafetensorsHeader(path, entries, dict(header.get("__metadata__") or {}), raw)


def _pread(fd: int, n: int, offset: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    done = 0
    while done < n:
        k = os.preadv(fd, [view[done:]], offset + done)
        if k <= 0:
            raise CheckpointError(f"unexpected end of file at byte {offset + done}")
        done += k
    return buf


def _tensor(buf: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype not in ST_DTYPES:
        raise CheckpointError(f"unsupported safetensors dtype {dtype}")
    if not buf:
        return torch.empty(shape, dtype=ST_DTYPES[dtype])
    return torch.frombuffer(buf, dtype=torch.uint8).view(ST_DTYPES[dtype]).reshape(shape)


class PreadReader(TensorReader):
    """A :class:`ple.checkpoint.TensorReader` that reads each tensor with ``pread`` into a fresh
    buffer: no file is mapped, so reading a table shard by shard keeps the process's resident memory
    at one shard (a mapped reader keeps every page it touched resident until it is closed)."""

    def __init__(self) -> None:
        super().__init__()
        self._headers: dict[Path, SafetensorsHeader] = {}
        self._fds: dict[Path, int] = {}

    def entry(self, file: Path, name: str) -> Entry:
        header = self._headers.get(file)
        if header is None:
            header = self._headers[file] = read_header(file)
        try:
            return header.entries[name]
        except KeyError:
            raise CheckpointError(f"{file.name}: no tensor {name!r} (the file changed after it was scanned)") from None

    def read(self, file: Path, name: str) -> torch.Tensor:
        e = self.entry(file, name)
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        return _tensor(_pread(fd, e.nbytes, e.start), e.dtype, e.shape)

    def get(self, info: TensorInfo, name: str) -> torch.Tensor:
        return self.read(info.file, name)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._headers.clear()
        super().close()


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (the index's, else ``*.safetensors``)."""
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({folder / v for v in weight_map.values()})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files and no {INDEX_NAME}")
    return files


# ---------------------------------------------------------------------------------------------- dequantize


def _scales(headers: list[SafetensorsHeader]) -> dict[str, tuple[Path, Entry]]:
    """Every table scale of the checkpoint: name -> (file, entry)."""
    out = {}
    for h in headers:
        for name, e in h.entries.items():
            if _SCALE_RE.search(name):
                out[name] = (h.path, e)
    return out


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def _copy_range(src_fd: int, dst_fd: int, offset: int, n: int) -> None:
    done = 0
    while done < n:
        k = min(_CHUNK_BYTES, n - done)
        _write_all(dst_fd, _pread(src_fd, k, offset + done))
        done += k


def _dequantized_chunks(
    file: Path, name: str, e: Entry, scale: tuple[Path, Entry], dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    rows = e.shape[0]
    width = e.shape[1] if len(e.shape) > 1 else 1
    itemsize = ST_DTYPES[e.dtype].itemsize
    step = max(1, _CHUNK_BYTES // max(1, width * max(itemsize, dtype.itemsize)))
    sfile, se = scale
    per_row = se.shape not in ((1,), ())
    if per_row and tuple(se.shape) != (rows, 1):
        raise CheckpointError(f"{name}: per-row scale of shape {list(se.shape)}, expected [{rows}, 1]")
    fd = os.open(file, os.O_RDONLY)
    sfd = os.open(sfile, os.O_RDONLY)
    try:
        gscale = None if per_row else _tensor(_pread(sfd, se.nbytes, se.start), se.dtype, (1,)).float()
        for a in range(0, rows, step):
            b = min(rows, a + step)
            q = _tensor(_pread(fd, (b - a) * width * itemsize, e.start + a * width * itemsize), e.dtype, (b - a, width))
            s = gscale
            if per_row:
                ss = ST_DTYPES[se.dtype].itemsize
                s = _tensor(_pread(sfd, (b - a) * ss, se.start + a * ss), se.dtype, (b - a, 1)).float()
            yield dequantize(q, s, dtype)
    finally:
        os.close(fd)
        os.close(sfd)


def _table_scale_name(name: str) -> str:
    return name[: -len("weight")] + "weight_scale"


def _global_scale_name(name: str) -> str:
    cut = name.rindex("ngram_embedding.") + len("ngram_embedding.")
    return name[:cut] + "weight_scale"


def dequantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a copy of checkpoint folder ``src`` at ``dst`` whose fp8/int8 PLE tables are
    dequantized to ``dtype`` (``q.to(dtype) * scale.to(dtype)``, what ple's lookup computes in a
    ``dtype`` model) and whose ``weight_scale`` tensors are gone: the form plain transformers reads
    correctly. Other tensors are copied byte for byte, other files as they are;
    ``ple_embedding_dtype`` is removed from ``config.json``. Streams in chunks of 64 MiB.

    ``dst`` must not exist; it is built at ``dst + ".partial"`` and renamed when complete.
    """
    src, dst = Path(src), Path(dst)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InvalidArgumentError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    if not src.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {src}")
    if dst.exists():
        raise FileExistsError(f"{dst} exists: choose a new folder")
    partial = dst.with_name(dst.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    files = checkpoint_files(src)
    try:
        headers = [read_header(f) for f in files]
        scales = _scales(headers)
        weight_map: dict[str, str] = {}
        total = 0
        for h in headers:
            total += _dequantize_file(h, partial / h.path.name, scales, dtype, weight_map)
        for p in src.iterdir():
            if p.is_file() and p.suffix != ".safetensors" and p.name != INDEX_NAME:
                shutil.copyfile(p, partial / p.name)
        cfg_path = partial / "config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
            cfg.pop("ple_embedding_dtype", None)
            if isinstance(cfg.get("text_config"), dict):
                cfg["text_config"].pop("ple_embedding_dtype", None)
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if (src / INDEX_NAME).is_file():
            index = json.loads((src / INDEX_NAME).read_text())
            index["weight_map"] = dict(sorted(weight_map.items()))
            index.setdefault("metadata", {})["total_size"] = total
            (partial / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        os.replace(partial, dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return dst


def _dequantize_file(
    h: SafetensorsHeader,
    out: Path,
    scales: dict[str, tuple[Path, Entry]],
    dtype: torch.dtype,
    weight_map: dict[str, str],
) -> int:
    """Write one file of the copy; returns its tensor bytes."""
    plan: list[tuple[str, Entry, tuple[Path, Entry] | None, str, int]] = []  # name, entry, scale, dtype, nbytes
    for name, e in sorted(h.entries.items(), key=lambda kv: kv[1].start):
        if _SCALE_RE.search(name):
            continue
        scale = None
        if _TABLE_RE.search(name) and e.dtype in ("F8_E4M3", "I8"):
            scale = scales.get(_table_scale_name(name)) or scales.get(_global_scale_name(name))
            if scale is None:
                raise CheckpointError(f"{name} is {e.dtype} but the checkpoint has no weight_scale for it")
        if scale is None:
            plan.append((name, e, None, e.dtype, e.nbytes))
        else:
            n = e.nbytes // ST_DTYPES[e.dtype].itemsize * dtype.itemsize
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
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    src_fd = os.open(h.path, os.O_RDONLY)
    try:
        _write_all(fd, struct.pack("<Q", len(blob)) + blob)
        for name, e, scale, _, _ in plan:
            if scale is None:
                _copy_range(src_fd, fd, e.start, e.nbytes)
            else:
                for chunk in _dequantized_chunks(h.path, name, e, scale, dtype):
                    _write_all(fd, chunk.contiguous().view(torch.uint8).numpy())
            weight_map[name] = out.name
        os.fsync(fd)
    finally:
        os.close(fd)
        os.close(src_fd)
    return off
