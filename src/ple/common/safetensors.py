"""Safetensors files as ple reads them: the header parsed and checked against the file, and two
readers of the tensors.

:func:`read_header` parses a header (names, dtypes, shapes, byte ranges) and insists that the byte
ranges tile the file's data exactly, as the format requires; :func:`read_safetensors_header` lists
the problem instead of raising (the checkpoint scan collects every problem). :class:`TensorReader`
reads through the safetensors library (mapped files); :class:`PreadReader` reads with ``pread`` into
fresh buffers (nothing mapped) and compares each tensor's header entry with the one it is given.
Only regular files are opened (:func:`ple.common.files.open_regular`); whatever goes wrong raises
:class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import torch

from ple.common.files import open_regular, parse_json, pread_exact, require_regular
from ple.errors import InvalidArgumentError, PLEError

__all__ = [
    "CheckpointError",
    "PreadReader",
    "SAFETENSORS_DTYPES",
    "SafetensorsHeader",
    "TensorInfo",
    "TensorReader",
    "clipped",
    "read_checked",
    "read_header",
    "read_safetensors_header",
    "read_small",
    "shown_name",
]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype names -> torch dtypes (those ple reads)."""
_DTYPE_BITS: dict[str, int] = {
    **{name: 8 for name in ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")},
    **{name: 16 for name in ("I16", "U16", "F16", "BF16")},
    **{name: 32 for name in ("I32", "U32", "F32")},
    **{name: 64 for name in ("I64", "U64", "F64", "C64")},
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
"""Bits per element of every dtype a safetensors file may hold (the format's list): a header entry's
byte range is checked against its shape for each, and an unknown dtype is a malformed entry."""


class CheckpointError(PLEError, ValueError):
    """A checkpoint cannot be loaded; ``problems`` lists every reason found."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("checkpoint problems:\n  - " + "\n  - ".join(self.problems))


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a safetensors file is: its file, dtype, shape, and byte range ``[begin, end)``
    in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class _PastTheEnd(ValueError):
    """A header entry whose data ends past the end of the file (``end``: its end offset in the data)."""

    def __init__(self, end: int) -> None:
        super().__init__(end)
        self.end = end


def _tensor_info(path: Path, meta, data_start: int, data_size: int) -> TensorInfo:
    """One header entry as a :class:`TensorInfo`; ValueError when it is malformed: not an object of
    ``dtype``, ``shape`` and ``data_offsets``, a dtype safetensors does not know, offsets that decrease
    or pass the end of the file's data (``data_size`` bytes), or a byte count other than the shape's."""
    if not isinstance(meta, dict):
        raise ValueError("not an object")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        raise ValueError("dtype, shape or data_offsets malformed")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in [*shape, *offsets]):
        raise ValueError("negative or non-integer sizes")
    bits = _DTYPE_BITS.get(dtype)
    if bits is None:
        raise ValueError(f"unknown dtype {dtype!r}")
    begin, end = offsets
    if begin > end:
        raise ValueError("data_offsets decrease")
    if end > data_size:
        raise _PastTheEnd(end)
    numel = 0 if 0 in shape else 1  # a zero-size tensor of any other dimensions is valid
    for d in shape if numel else ():  # stops early: a shape of huge dimensions costs no huge product
        numel *= d
        if numel * bits > 8 * data_size:
            raise ValueError(
                f"a {dtype} tensor of shape {clipped(str(shape), 100)} needs more than the file's {data_size} data bytes"
            )
    if numel * bits != 8 * (end - begin):
        raise ValueError(f"{end - begin} bytes for a {dtype} tensor of shape {clipped(str(shape), 100)}")
    return TensorInfo(path, dtype, tuple(shape), data_start + begin, data_start + end)


def _coverage_problem(path: Path, tensors: dict[str, TensorInfo], data_start: int, size: int) -> str | None:
    """Whether the tensors' byte ranges tile the file's data exactly, as safetensors requires (and its
    library checks when it opens the file): in offset order each range starts where the one before
    ends, the first at the data's start, the last at the file's end. None when they do."""
    at, last = data_start, None
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != at:
            where = f"after {shown_name(last)}" if last is not None else "before the first tensor"
            if info.begin > at:
                return (
                    f"{path.name}: bytes [{at}, {info.begin}) {where} belong to no tensor "
                    "(tensor data must be contiguous)"
                )
            return f"{path.name}: tensor {shown_name(name)} at bytes [{info.begin}, {info.end}) overlaps {shown_name(last)}"
        at, last = info.end, name
    if at != size:
        return (
            f"{path.name}: {size - at} bytes after the end of the tensor data (byte {at}; the file has {size}): "
            "a damaged or foreign file"
        )
    return None


def clipped(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters (ending in ``...``) when longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown_name(name: str | None) -> str:
    """A tensor name for a message: quoted, a long one cut short."""
    return clipped(repr(name), 120)


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed safetensors header: ``tensors`` by name (absolute byte ranges), ``metadata``, and
    the raw header bytes (whose digest identifies the file's layout cheaply)."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    raw: bytes


def _parse_header(fd: int, path: Path) -> tuple[SafetensorsHeader, str | None]:
    """The header of the open safetensors file ``fd``, and a problem (malformed, truncated, tensor data
    that does not tile the rest of the file) or None; with a problem the header holds the entries
    read before it."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        return SafetensorsHeader(path, {}, {}, b""), f"{path.name}: not a safetensors file (only {size} bytes)"
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8 or n > 100_000_000:
        return SafetensorsHeader(path, {}, {}, b""), (
            f"{path.name}: header length {n} exceeds the file size {size} (truncated or not safetensors)"
        )
    blob = os.pread(fd, n, 8)
    if len(blob) != n:
        return SafetensorsHeader(path, {}, {}, b""), f"{path.name}: truncated inside its header"
    out: dict[str, TensorInfo] = {}
    try:
        header = parse_json(blob, f"{path.name}: the safetensors header", CheckpointError)
    except CheckpointError as e:
        return SafetensorsHeader(path, out, {}, blob), str(e.problems[0])
    if not isinstance(header, dict):
        return SafetensorsHeader(path, out, {}, blob), f"{path.name}: the safetensors header is not a JSON object"
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return SafetensorsHeader(path, out, {}, blob), (
            f"{path.name}: malformed safetensors __metadata__ (not an object of strings)"
        )
    data_start = 8 + n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            info = _tensor_info(path, meta, data_start, size - data_start)
        except _PastTheEnd as exc:
            problem = f"{path.name}: truncated: tensor data needs {data_start + exc.end} bytes, the file has {size}"
            return SafetensorsHeader(path, out, metadata, blob), problem
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            why = f" ({exc})" if isinstance(exc, ValueError) else ""
            problem = f"{path.name}: malformed safetensors header entry for {shown_name(name)}: {clipped(repr(meta), 200)}{why}"
            return SafetensorsHeader(path, out, metadata, blob), problem
        out[name] = info
    return SafetensorsHeader(path, out, metadata, blob), _coverage_problem(path, out, data_start, size)


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The header of a safetensors file (only the header is read). Raises :class:`CheckpointError`
    for anything but a regular file with a sound header whose byte ranges fit in the file."""
    path = Path(path)
    fd = open_regular(path, "checkpoint file", CheckpointError)
    try:
        header, problem = _parse_header(fd, path)
    finally:
        os.close(fd)
    if problem:
        raise CheckpointError(problem)
    return header


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], str | None]:
    """Tensor names -> info from a safetensors header, and a problem string (not a regular file,
    malformed, truncated) or None; with a problem, the entries read before it."""
    try:
        fd = open_regular(path, "checkpoint file", CheckpointError)
    except CheckpointError as e:
        return {}, f"{path.name}: {e.problems[0]}"
    try:
        header, problem = _parse_header(fd, path)
    finally:
        os.close(fd)
    return header.tensors, problem


def read_small(info: TensorInfo) -> torch.Tensor:
    """A small tensor (a hash buffer, a global scale) read straight from its byte range."""
    fd = open_regular(info.file, "checkpoint file", CheckpointError)
    n = info.end - info.begin
    try:
        blob = pread_exact(fd, n, info.begin, lambda at: CheckpointError(f"{info.file.name}: truncated at byte {at}"))
    finally:
        os.close(fd)
    dtype = SAFETENSORS_DTYPES[info.dtype]
    flat = torch.frombuffer(blob, dtype=dtype) if n else torch.empty(0, dtype=dtype)
    return flat.reshape(info.shape)


class TensorReader:
    """Reads checkpoint tensors one at a time, keeping one open safetensors handle per file (the
    files are mapped: pages a read touched stay resident until :meth:`close`). For reads that map
    nothing, use :class:`PreadReader`.

    Only regular files are opened; whatever the safetensors library refuses (a file that changed
    since it was scanned, a damaged header) raises :class:`CheckpointError` naming the file."""

    def __init__(self):
        self._handles = {}

    def _handle(self, file: Path):
        from safetensors import safe_open

        h = self._handles.get(file)
        if h is None:
            require_regular(file, "checkpoint file", CheckpointError)
            h = self._handles[file] = _safetensors_call(file, safe_open, str(file), framework="pt")
        return h

    def get(self, info: TensorInfo, name: str) -> torch.Tensor:
        """The tensor ``name`` of ``info.file``."""
        return _safetensors_call(info.file, lambda: self._handle(info.file).get_tensor(name))

    def rows(self, info: TensorInfo, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (along the first dimension) of the tensor ``name`` of ``info.file``."""
        return _safetensors_call(info.file, lambda: self._handle(info.file).get_slice(name)[start:stop])

    def close(self):
        self._handles.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _safetensors_call(file: Path, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a call into the safetensors library; what the library raises becomes a
    :class:`CheckpointError` naming ``file``."""
    from safetensors import SafetensorError

    try:
        return fn(*args, **kwargs)
    except SafetensorError as e:
        raise CheckpointError(f"{file.name}: the safetensors library cannot read it: {e}") from None


class PreadReader(TensorReader):
    """A :class:`TensorReader` that reads each tensor (or rows of one) with ``pread`` into a fresh
    buffer: nothing is mapped, so streaming a table shard by shard keeps the process's resident
    memory at one shard. Files are opened as regular files only (:func:`ple.common.files.open_regular`),
    once each; the header is read again at the first read of a file, and a tensor whose name, dtype,
    shape or byte range differ from the ``info`` given (the scan's) raises :class:`CheckpointError`
    (the file changed after it was scanned), as does a file cut short."""

    def __init__(self) -> None:
        super().__init__()
        self._files: dict[Path, tuple[int, SafetensorsHeader]] = {}

    def _open(self, file: Path) -> tuple[int, SafetensorsHeader]:
        got = self._files.get(file)
        if got is None:
            fd = open_regular(file, "checkpoint file", CheckpointError)
            try:
                header, problem = _parse_header(fd, file)
                if problem:
                    raise CheckpointError(f"{problem} (the file changed after it was scanned)")
            except BaseException:
                os.close(fd)
                raise
            got = self._files[file] = (fd, header)
        return got

    def _checked(self, info: TensorInfo, name: str) -> int:
        """The descriptor of ``info.file`` once its header says what ``info`` says of ``name``."""
        fd, header = self._open(info.file)
        now = header.tensors.get(name)
        if now is None:
            raise CheckpointError(f"{info.file.name}: no tensor {name!r} (the file changed after it was scanned)")
        if (now.dtype, now.shape, now.begin, now.end) != (info.dtype, info.shape, info.begin, info.end):
            raise CheckpointError(
                f"{name} in {info.file.name}: {now.dtype} {list(now.shape)} at bytes [{now.begin}, {now.end}), "
                f"expected {info.dtype} {list(info.shape)} at [{info.begin}, {info.end}) "
                "(the file changed after it was scanned)"
            )
        return fd

    def raw(self, info: TensorInfo, name: str, start: int = 0, stop: int | None = None) -> bytearray:
        """Bytes ``[start, stop)`` of tensor ``name``'s data (offsets within the tensor; default all),
        whatever its dtype."""
        fd = self._checked(info, name)
        stop = info.nbytes if stop is None else stop
        if not 0 <= start <= stop <= info.nbytes:
            raise InvalidArgumentError(f"bytes [{start}, {stop}) outside {name}'s {info.nbytes} bytes")
        file, end = info.file, info.begin + stop
        return pread_exact(
            fd,
            stop - start,
            info.begin + start,
            lambda at: CheckpointError(
                f"{file.name} ends at byte {at}, {end - at} bytes before the end of the range read "
                "(it was cut short after it was scanned)"
            ),
        )

    def get(self, info: TensorInfo, name: str) -> torch.Tensor:
        return _as_tensor(self.raw(info, name), info, name, info.shape)

    def rows_into(
        self, info: TensorInfo, name: str, start: int, stop: int, buffer, then: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """:meth:`rows`, read into ``buffer`` (a writable buffer of at least their bytes, reused by a
        caller that reads many pieces: no fresh memory a piece); the tensor is a view of it. ``then``:
        the rows ``[a, b)`` the caller reads next, asked of the OS now (read ahead while this piece is
        worked on)."""
        n = info.shape[0] if info.shape else 1
        if not 0 <= start <= stop <= n or not info.shape:
            raise InvalidArgumentError(f"rows [{start}, {stop}) outside {name}'s shape {list(info.shape)}")
        fd = self._checked(info, name)
        row = info.nbytes // n if n else 0
        if then is not None and hasattr(os, "posix_fadvise") and then[1] > then[0]:
            os.posix_fadvise(fd, info.begin + then[0] * row, (then[1] - then[0]) * row, os.POSIX_FADV_WILLNEED)
        view = memoryview(buffer).cast("B")[: (stop - start) * row]
        done, at = 0, info.begin + start * row
        while done < len(view):
            k = os.preadv(fd, [view[done:]], at + done)
            if k <= 0:
                raise CheckpointError(
                    f"{info.file.name} ends at byte {at + done} (it was cut short after it was scanned)"
                )
            done += k
        t = SAFETENSORS_DTYPES.get(info.dtype)
        if t is None:
            raise CheckpointError(f"{name} in {info.file.name}: unsupported safetensors dtype {info.dtype}")
        shape = (stop - start, *info.shape[1:])
        if not len(view):
            return torch.empty(shape, dtype=t)
        return torch.frombuffer(view, dtype=torch.uint8).view(t).reshape(shape)

    def rows(self, info: TensorInfo, name: str, start: int, stop: int) -> torch.Tensor:
        n = info.shape[0] if info.shape else 1
        if not 0 <= start <= stop <= n or not info.shape:
            raise InvalidArgumentError(f"rows [{start}, {stop}) outside {name}'s shape {list(info.shape)}")
        row = info.nbytes // n if n else 0
        shape = (stop - start, *info.shape[1:])
        return _as_tensor(self.raw(info, name, start * row, stop * row), info, name, shape)

    def __enter__(self) -> PreadReader:
        return self

    def close(self) -> None:
        files, self._files = self._files, {}
        for fd, _ in files.values():
            os.close(fd)
        super().close()


def _as_tensor(buf: bytearray, info: TensorInfo, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = SAFETENSORS_DTYPES.get(info.dtype)
    if t is None:
        raise CheckpointError(f"{name} in {info.file.name}: unsupported safetensors dtype {info.dtype}")
    if not buf:
        return torch.empty(shape, dtype=t)
    return torch.frombuffer(buf, dtype=torch.uint8).view(t).reshape(shape)


def read_checked(reader: TensorReader, info: TensorInfo, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Read one tensor and insist on the shape and dtype its header promised (the file may have
    changed since the scan; ``copy_`` would otherwise broadcast or convert silently)."""
    t = reader.get(info, name)
    want_dtype = SAFETENSORS_DTYPES.get(info.dtype)
    if tuple(t.shape) != shape or (want_dtype is not None and t.dtype != want_dtype):
        raise CheckpointError(
            f"{name} in {info.file.name}: read {list(t.shape)} {t.dtype}, expected {list(shape)} {want_dtype} "
            "(the file changed after it was scanned)"
        )
    if t.is_floating_point():
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            where = [int(v) for v in bad.nonzero()[0]]
            raise CheckpointError(
                f"{name} in {info.file.name}: element {where} is {float(t[tuple(where)])}, not finite"
            )
    return t
