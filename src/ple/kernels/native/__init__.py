"""The CPU kernels of ``ple_cpu.c`` (the fused gate + conv step, n-gram ids), ``ple_quant.c`` (table
row gathers), ``ple_direct.c`` (the direct tier's reader), ``ple_encode.c`` (table conversion) and
``ple_eval.c`` (``ple eval``'s passes over the logits), compiled on first use.

The shared library is built with ``$CC`` (default ``cc``) as ``-O3``: on x86-64 for the baseline
instruction set, with AVX2 and AVX-512 variants of the step's kernel inside, the best one the CPU runs
chosen at run time (``PLE_NATIVE_ISA=portable|avx2|avx512|avx512bf16`` forces one, :func:`set_isa` too; an
unknown name or one the CPU lacks raises :class:`NativeISAError`); elsewhere as ``-march=native``
(``PLE_NATIVE_PREFETCH=auto|all|N`` and :func:`set_prefetch_lines` set how much of its next work unit
the fused kernel prefetches). The library is stored under ``$PLE_CACHE_DIR`` (default
``~/.cache/ple``; a per-user temporary folder when the default cannot be written), keyed by the
source, the flags, the compiler's version and the CPU's model and flags (a cache shared between
machines stays correct), so later processes load it without compiling (a build takes about a
second). ``PLE_NATIVE=0`` turns the kernels off (ple then
uses its PyTorch fast paths).

Where this process's PyTorch runs its intra-op threads on GNU OpenMP (Linux wheels: ``libgomp`` is
mapped once torch is imported), the library is built with ``-fopenmp`` and shares that runtime: the
kernels' threads are PyTorch's own, already running (and still spinning after a GEMM), so a step's
second thread joins in microseconds instead of competing with a spinning one (:func:`team`).
``PLE_NATIVE_OPENMP=0`` builds without OpenMP (threads started per call); a compiler without OpenMP
warns once and builds without it.

What is loaded is verified: beside each library ``<name>.so`` the build writes ``<name>.so.sha256``
(its SHA-256 and size), both through a temporary file, fsync and rename. A process reads the
library's bytes, checks them against that record, and loads its own private copy of the checked
bytes (an anonymous memory file), never the cache file itself: a truncated, damaged or half-written
library in the cache is rebuilt instead of loaded, and a cache file changed later cannot kill a
process that loaded it (a mapped file cut short raises SIGBUS). A library that matches its record
but does not load, or lacks one of the kernels, is rebuilt too.

:func:`library` returns the loaded library or raises :class:`NativeUnavailable` with the reason;
:func:`available` is the non-raising check (it warns once, with the reason, when the build fails).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from ple.common.files import read_regular, write_atomically
from ple.errors import InvalidArgumentError, PLEError

__all__ = [
    "ISAS",
    "NativeISAError",
    "NativeUnavailable",
    "available",
    "cache_dir",
    "current_isa",
    "isa_available",
    "library",
    "set_isa",
    "background_thread",
    "team",
    "threads_for",
]

_SOURCE = Path(__file__).with_name("ple_cpu.c")
_SOURCES = (
    _SOURCE,
    Path(__file__).with_name("ple_quant.c"),
    Path(__file__).with_name("ple_direct.c"),
    Path(__file__).with_name("ple_encode.c"),
    Path(__file__).with_name("ple_eval.c"),
    Path(__file__).with_name("ple_train.c"),
)
"""Every C file of the library: the fused step and ids (``ple_cpu.c``), the block-format lookup
(``ple_quant.c``), the direct tier's pread pool (``ple_direct.c``), the table conversion kernels
(``ple_encode.c``), ``ple eval``'s log-sum-exp, KL and top-token passes (``ple_eval.c``), the backward of a
training step's gate and conv (``ple_train.c``)."""
_HEADERS = (Path(__file__).with_name("ple_common.h"),)
"""What the C files include (``ple_common.h``: the shared declarations, targets and exponential), hashed
with them into the library's cache key."""
_FLAGS = [
    "-O3",
    "-march=native",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-std=gnu11",
]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_forked = False  # this process is a fork (its OpenMP runtime cannot start teams: see team())
_library_file: Path | None = None  # the cache file whose checked bytes were loaded
_error: str | None = None
_warned = False


class NativeUnavailable(PLEError, RuntimeError):
    """The fused CPU kernels cannot be used here (disabled, no compiler, or the build failed)."""


class NativeISAError(PLEError, ValueError):
    """An instruction set the kernels cannot be forced to: unknown, or not run by this CPU."""


ISAS = ("portable", "avx2", "avx512", "avx512bf16")
"""The kernels' instruction sets (index = the C library's number): ``portable`` is the build's
baseline, ``avx2`` AVX2 + FMA, ``avx512`` AVX-512 (F, BW, VL, DQ) with 512-bit vectors, ``avx512bf16``
the same plus AVX-512 BF16, with the step's rounding and SiLU loops written by hand."""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$PLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/ple``, else ``~/.cache/ple``."""
    env = os.environ.get("PLE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ple"


def _flags(openmp: bool = False) -> list[str]:
    flags = list(_FLAGS)
    if platform.machine().lower() in ("x86_64", "amd64"):
        # the baseline instruction set: the kernels carry AVX2 and AVX-512 variants of their own,
        # chosen at run time (ISAS)
        flags.remove("-march=native")
    return flags + ["-fopenmp"] if openmp else flags


def _off(value: str | None) -> bool:
    """Whether an environment switch (``PLE_NATIVE``, ``PLE_NATIVE_OPENMP``) is set to off."""
    return value is not None and value.strip().lower() in ("0", "false", "no", "off")


def _torch_openmp() -> str | None:
    """The GNU OpenMP runtime PyTorch runs its intra-op threads on (the path of the ``libgomp`` mapped
    into this process once torch is imported), or None: not Linux, another runtime (Intel's, LLVM's),
    no OpenMP, or ``PLE_NATIVE_OPENMP=0``."""
    if _off(os.environ.get("PLE_NATIVE_OPENMP")) or not os.path.exists("/proc/self/maps"):
        return None
    import torch  # noqa: F401  (its runtime must be mapped before the maps are read)

    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split(None, 5)[5].strip() for ln in f if len(ln.split(None, 5)) == 6}
    except OSError:
        return None
    gomp = sorted(p for p in paths if os.path.basename(p).startswith("libgomp"))
    return gomp[0] if len(gomp) == 1 else None


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if path is None:
        raise NativeUnavailable(f"no C compiler: {cc!r} is not on PATH (set CC, or PLE_NATIVE=0 to silence this)")
    return path


def _cpu_signature() -> bytes:
    """What ``-march=native`` depends on: the CPU's model and feature flags (Linux), else the platform."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith((b"model name", b"flags", b"Features"))]
        return b"\n".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def _writable_cache(name: str) -> Path:
    """The cache folder, created if needed. A default folder that cannot be written (a read-only home)
    falls back to a per-user folder in the temporary directory; an explicit ``$PLE_CACHE_DIR`` does not."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / name).exists() or os.access(folder, os.W_OK):
            return folder
        problem = "is not writable"
    except OSError as e:
        problem = f"cannot be created ({e})"
    if os.environ.get("PLE_CACHE_DIR"):
        raise NativeUnavailable(f"PLE_CACHE_DIR={folder} {problem}")
    fallback = Path(tempfile.gettempdir()) / f"ple-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    fallback.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = fallback.stat()
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        # a shared folder: someone else could place a library there that this process would load
        raise NativeUnavailable(
            f"the cache folder {cache_dir()} {problem}, and the fallback {fallback} is not private to this "
            "user (set PLE_CACHE_DIR)"
        )
    return fallback


_MAX_LIBRARY_BYTES = 256 << 20


def _record(data: bytes) -> str:
    """What ``<name>.so.sha256`` holds for a library of these bytes."""
    return f"{hashlib.sha256(data).hexdigest()} {len(data)}\n"


_loaded_fds: list[int] = []
"""Descriptors of the memory files loaded libraries came from, open while the process runs."""


def _dlopen_copy(data: bytes, folder: Path) -> ctypes.CDLL:
    """Load a private copy of the library bytes ``data``: an anonymous memory file where the OS has
    them, else a temporary file removed once loaded. The cache file is never mapped.

    A memory file that loaded stays open: the dynamic loader takes a name it has loaded before
    (``/proc/self/fd/N``, N reused once closed) for that library and would hand back the old one
    instead of loading these bytes (a rebuild after a damaged cache would get the damaged library)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("ple_cpu", getattr(os, "MFD_CLOEXEC", 0))
        try:
            _write_all(fd, data)
            lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
        except BaseException:
            os.close(fd)
            raise
        _loaded_fds.append(fd)
        return lib
    fd, tmp = tempfile.mkstemp(prefix="ple_cpu-load.", suffix=".so", dir=folder)
    try:
        _write_all(fd, data)
        os.close(fd)
        fd = -1
        return ctypes.CDLL(tmp)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _load_cached(target: Path, stamp: Path) -> ctypes.CDLL | None:
    """The cached library if its bytes match its record, it loads and it has every kernel; None
    otherwise (rebuild)."""
    try:
        record = read_regular(stamp, "library record", 4096).decode("ascii", "replace")
        data = read_regular(target, "library", _MAX_LIBRARY_BYTES)
    except (OSError, PLEError):
        return None
    if record != _record(data):
        return None  # truncated, damaged, or a record of another build
    try:
        lib = _dlopen_copy(data, target.parent)
    except OSError:
        return None
    if _missing_symbol(lib) is not None:
        return None  # another library under this name (a damaged cache): rebuilt
    _declare(lib)
    return lib


def _names() -> str:
    return " and ".join(p.name for p in _SOURCES)


def _compile(cc: str, folder: Path, name: str, flags: list[str]) -> bytes:
    """The bytes of a fresh build (its temporary output is removed)."""
    fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".partial", dir=folder)
    os.close(fd)
    try:
        try:
            proc = subprocess.run(
                [cc, *flags, "-o", tmp, *map(str, _SOURCES), "-lm"], capture_output=True, text=True, timeout=300
            )
        except (OSError, subprocess.SubprocessError) as e:  # includes a compile that ran past 300 s
            raise NativeUnavailable(f"building {_names()} with {cc} failed: {e}") from e
        if proc.returncode != 0:
            raise NativeUnavailable(
                f"building {_names()} with {cc} failed (exit {proc.returncode}):\n{proc.stderr.strip()}"
            )
        return read_regular(tmp, "library", _MAX_LIBRARY_BYTES)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build() -> ctypes.CDLL:
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"C compiler {cc} does not run: {e}") from e
    gomp = _torch_openmp()
    if gomp is None:
        return _build_with(cc, version, _flags())
    try:
        return _build_with(cc, version, _flags(openmp=True))
    except NativeUnavailable as e:
        if "timed out" in str(e):
            raise  # a second build would wait as long
        failed = e
    lib = _build_with(cc, version, _flags())  # a plain build that fails too raises its own reason
    warnings.warn(
        f"ple: the C kernels are built without OpenMP (their threads are started per call, not PyTorch's "
        f"OpenMP threads of {gomp}): {failed}",
        RuntimeWarning,
        stacklevel=3,
    )
    return lib


def _build_with(cc: str, version: str, flags: list[str]) -> ctypes.CDLL:
    source = b"\0".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))
    digest = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_signature()])
    ).hexdigest()[:16]
    name = f"ple_cpu-{digest}.so"
    folder = _writable_cache(name)
    target, stamp = folder / name, folder / (name + ".sha256")
    lib = _load_cached(target, stamp)
    if lib is None:
        data = _compile(cc, folder, name, flags)
        try:
            lib = _dlopen_copy(data, folder)
        except OSError as e:
            raise NativeUnavailable(f"the freshly built {name} does not load: {e}") from e
        missing = _missing_symbol(lib)
        if missing is not None:
            raise NativeUnavailable(f"the freshly built {name} lacks the kernel {missing}")
        _declare(lib)
        # the library first, then its record: a reader between the two sees a mismatch and rebuilds
        try:
            write_atomically(target, data, 0o600)
            write_atomically(stamp, _record(data).encode(), 0o600)
        except OSError:
            pass  # a cache that cannot be written is rebuilt by the next process; this one has its library
    global _library_file
    _library_file = target
    return lib


_SYMBOLS = (
    "ple_gate_conv",
    "ple_ngram_ids",
    "ple_quant_lookup",
    "ple_gather_rows",
    "ple_gather_lut",
    "ple_overlay_rows",
    "ple_isa_available",
    "ple_set_isa",
    "ple_current_isa",
    "ple_set_prefetch_lines",
    "ple_prefetch_lines",
    "ple_set_decode_tiles",
    "ple_decode_tiles",
    "ple_tile_rows",
    "ple_team_kind",
    "ple_team_after_fork",
    "ple_slots_read",
    "ple_slots_advance",
    "ple_first_outside",
    "ple_gate_conv_backward",
    "ple_reader_new",
    "ple_uring_new",
    "ple_uring_read",
    "ple_uring_free",
    "ple_uring_compiled",
    "ple_reader_read",
    "ple_reader_free",
    "ple_encode_rows",
    "ple_first_nonfinite",
    "ple_eval_reference",
    "ple_eval_compare",
)
"""The functions the library must export (what :func:`_declare` declares)."""


def _missing_symbol(lib: ctypes.CDLL) -> str | None:
    """The first of :data:`_SYMBOLS` the library lacks, or None."""
    for name in _SYMBOLS:
        try:
            getattr(lib, name)
        except AttributeError:
            return name
    return None


def _declare(lib: ctypes.CDLL) -> None:
    i64, f32, ptr, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    fn = lib.ple_gate_conv
    fn.restype = i32
    # fmt: off
    fn.argtypes = [
        i32, i64, i64, i64, i64, i64,  # bf16?, tokens, hidden_size, hc, taps, dilation
        i64, i64, i64, f32,  # state_len, num_slots, requests, eps
        ptr, i64, ptr, i64, ptr, i64,  # key, stride, value, stride, hidden, stride
        ptr, ptr, ptr,  # wkq, wc, conv_w [K, C]
        ptr, ptr, ptr, ptr, ptr,  # starts, slots, has_init, rejected, mask
        ptr, ptr, i32,  # state, ring_base, add_hidden
        ptr, ptr, i64,  # c_in, res_in, res_stride (conv stage)
        ptr, ptr, i32,  # out, c_out, c_all
        i64, i32,  # unit_tokens, threads
    ]
    ids = lib.ple_ngram_ids
    ids.restype = i32
    ids.argtypes = [
        ptr, i64, ptr, i64,  # tokens, total, starts, requests
        ptr, i64, i64, ptr,  # context [R, N-1], order N, heads per order, multipliers [N]
        ptr, ptr, i64, ptr, i32,  # sizes [G], offsets [G], eos, out [T, G], threads
    ]
    quant = lib.ple_quant_lookup
    quant.restype = i32
    quant.argtypes = [
        i32, ptr, i64, i64, i64,  # format, data, rows, row bytes, head_dim
        ptr, i64, f32, i32, ptr, i32,  # ids, n, global scale, output kind, out, threads
    ]
    rows = lib.ple_gather_rows
    rows.restype = i32
    rows.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i32]  # data, rows, row stride (B), row bytes, ids, n, out, threads
    over = lib.ple_overlay_rows
    over.restype = i64
    # n, ids, which, adapters, keys**, counts, slots**, rows**, capacity, row bytes, out
    over.argtypes = [i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr]
    lut = lib.ple_gather_lut
    lut.restype = i32
    lut.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i32, ptr, i32]  # ... ids, n, lut [256], element bytes, out, threads
    # fmt: on
    for name in ("ple_isa_available", "ple_set_isa"):
        getattr(lib, name).restype = i32
        getattr(lib, name).argtypes = [i32]
    lib.ple_current_isa.restype = i32
    lib.ple_current_isa.argtypes = []
    lib.ple_set_prefetch_lines.restype = i32
    lib.ple_set_prefetch_lines.argtypes = [i64]
    lib.ple_prefetch_lines.restype = i64
    lib.ple_prefetch_lines.argtypes = []
    lib.ple_set_decode_tiles.restype = i32
    lib.ple_set_decode_tiles.argtypes = [i32]
    lib.ple_decode_tiles.restype = i32
    lib.ple_decode_tiles.argtypes = []
    lib.ple_tile_rows.restype = i64
    lib.ple_tile_rows.argtypes = []
    lib.ple_team_kind.restype = i32
    lib.ple_team_kind.argtypes = []
    lib.ple_team_after_fork.restype = None
    lib.ple_team_after_fork.argtypes = []
    # a session's decode step: tokens, slots, n, vocab, contexts, ctx_len, has_state, rejected, 4 outputs
    lib.ple_slots_read.restype = i64
    lib.ple_slots_read.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr]
    # tokens, slots, n, contexts, ctx_len, has_state, rejected, length
    lib.ple_slots_advance.restype = None
    lib.ple_slots_advance.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, ptr]
    # values, n, vocab: the first index outside [0, vocab), or -1
    lib.ple_first_outside.restype = i64
    lib.ple_first_outside.argtypes = [ptr, i64, i64]
    # B, S, HC, H, K, dilation | dout, dc_out, mask, value, value stride | kr, rk, qr, rq, kn, qn, match, root,
    # gate, cr, rc, c, y, y's three strides | nk, nq, nc, taps | dk, dvalue, dq, dnk, dnq, dnc, dtaps | kpath,
    # qpath, threads
    lib.ple_gate_conv_backward.restype = i32
    lib.ple_gate_conv_backward.argtypes = (
        [i64] * 6 + [ptr] * 4 + [i64] + [ptr] * 13 + [i64] * 3 + [ptr] * 11 + [i32] * 3
    )
    # the direct tier's reader (ple_direct.c): fd, depth, align, drop, file size, out handle
    lib.ple_reader_new.restype = i32
    lib.ple_reader_new.argtypes = [i32, i32, i64, i32, i64, ptr]
    # its io_uring reader: fd, depth, align, drop, file size, IORING_SETUP_* flags, out handle; read as above
    lib.ple_uring_new.restype = i32
    lib.ple_uring_new.argtypes = [i32, i32, i64, i32, i64, i32, ptr]
    lib.ple_uring_read.restype = i64
    lib.ple_uring_read.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr]
    lib.ple_uring_free.restype = None
    lib.ple_uring_free.argtypes = [ptr]
    lib.ple_uring_compiled.restype = i32
    lib.ple_uring_compiled.argtypes = []
    # handle, pieces, offsets, lengths, destinations, max span, error out
    lib.ple_reader_read.restype = i64
    lib.ple_reader_read.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr]
    lib.ple_reader_free.restype = None
    lib.ple_reader_free.argtypes = [ptr]
    # table conversion (ple_encode.c): source kind, rows, stride, n, D, scale kind, scale, source global,
    # target, target global, out, out row bytes, out scales, err_sq, ref_sq, max_rel, threads, fail, value
    enc = lib.ple_encode_rows
    enc.restype = i32
    enc.argtypes = [i32, ptr, i64, i64, i64, i32, ptr, f32, i32, f32, ptr, i64, ptr, ptr, ptr, ptr, i32, ptr, ptr]
    lib.ple_first_nonfinite.restype = i64
    lib.ple_first_nonfinite.argtypes = [i32, ptr, i64, i64, i64, ptr]  # kind, rows, stride, n, D, column out
    # ple eval (ple_eval.c): bf16?, logits, rows, vocab, targets, m, s, top, nll, threads
    lib.ple_eval_reference.restype = i32
    lib.ple_eval_reference.argtypes = [i32, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i32]
    # reference bf16?, its logits, candidate bf16?, its logits, rows, vocab, targets, m, s, top, nll, kld, threads
    lib.ple_eval_compare.restype = i32
    lib.ple_eval_compare.argtypes = [i32, ptr, i32, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i32]


def library() -> ctypes.CDLL:
    """The loaded kernel library (built on first use); raises :class:`NativeUnavailable` with the reason."""
    global _lib, _error
    if _off(os.environ.get("PLE_NATIVE")):
        raise NativeUnavailable("the fused CPU kernels are turned off (PLE_NATIVE=0)")
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            if _error is not None:
                raise NativeUnavailable(_error)
            try:
                lib = _build()
                if _forked:
                    lib.ple_team_after_fork()
                _apply_isa(lib, os.environ.get("PLE_NATIVE_ISA", "auto"), "PLE_NATIVE_ISA=")
                _apply_prefetch(lib, os.environ.get("PLE_NATIVE_PREFETCH", "auto"), "PLE_NATIVE_PREFETCH=")
                _lib = lib
            except NativeUnavailable as e:
                _error = str(e)
                raise
            except OSError as e:
                _error = f"loading the fused CPU kernels failed: {e}"
                raise NativeUnavailable(_error) from e
    return _lib


def _apply_isa(lib: ctypes.CDLL, name: str, what: str) -> None:
    """Force the instruction set ``name`` (``auto``: the best the CPU runs) in ``lib``."""
    name = name.strip().lower()
    if name == "auto":
        lib.ple_set_isa(-1)
        return
    if name not in ISAS:
        raise NativeISAError(f"{what}{name!r} is not an instruction set of the kernels: one of auto, {', '.join(ISAS)}")
    if lib.ple_set_isa(ISAS.index(name)) != 0:
        runs = [n for i, n in enumerate(ISAS) if lib.ple_isa_available(i)]
        raise NativeISAError(f"{what}{name!r}: this CPU does not run {name} (it runs {', '.join(runs)})")


def isa_available(name: str) -> bool:
    """Whether this CPU runs the kernels' instruction set ``name`` (one of :data:`ISAS`)."""
    if name not in ISAS:
        raise NativeISAError(f"{name!r} is not an instruction set of the kernels: one of {', '.join(ISAS)}")
    return bool(library().ple_isa_available(ISAS.index(name)))


def set_isa(name: str) -> str:
    """Run the kernels with instruction set ``name`` (one of :data:`ISAS`, or ``auto``: the best the CPU
    runs) from now on, in this process; returns the one run before. Raises :class:`NativeISAError` for
    an unknown name or one this CPU does not run (nothing changes)."""
    lib = library()
    before = current_isa()
    _apply_isa(lib, name, "instruction set ")
    return before


def current_isa() -> str:
    """The instruction set the kernels run (one of :data:`ISAS`)."""
    return ISAS[library().ple_current_isa()]


_PREFETCH_ALL = 2**63 - 1
"""The C library's "whole runs" (``ple_prefetch_lines``)."""


def _apply_prefetch(lib: ctypes.CDLL, value, what: str) -> None:
    """Set the fused kernel's prefetch plan in ``lib`` (see :func:`set_prefetch_lines`)."""
    spelled = value.strip().lower() if isinstance(value, str) else value
    if spelled == "auto":
        lines = -1
    elif spelled == "all":
        lines = _PREFETCH_ALL
    elif isinstance(spelled, str) and spelled.isdigit():
        lines = int(spelled)
    elif type(spelled) is int and spelled >= 0:
        lines = spelled
    else:
        raise InvalidArgumentError(
            f"{what}{value!r} is not a prefetch depth of the kernels: 'auto', 'all' or a number of lines >= 0"
        )
    lib.ple_set_prefetch_lines(min(lines, _PREFETCH_ALL))


def prefetch_lines() -> int | str:
    """How much of the next work unit's rows and state columns the fused step's C kernel prefetches
    while it computes one unit: ``"all"`` (whole rows and columns), or at most that many 64-byte lines
    from the start of each (0: none)."""
    lines = library().ple_prefetch_lines()
    return "all" if lines == _PREFETCH_ALL else int(lines)


def set_prefetch_lines(lines: int | str) -> int | str:
    """Set the fused kernel's prefetch plan from now on, in this process (``PLE_NATIVE_PREFETCH`` sets it
    at load): ``"all"`` whole rows and state columns, a number of lines from the start of each (0: no
    plan), or ``"auto"``: this CPU's default (8 lines on Intel cores, whose line-fill buffers whole runs
    would hold up; whole runs elsewhere). Returns the plan before (:func:`prefetch_lines`). The plan
    changes no result, only when the bytes arrive. Raises :class:`ple.errors.InvalidArgumentError` for
    another value (nothing changes)."""
    lib = library()
    before = prefetch_lines()
    _apply_prefetch(lib, lines, "prefetch depth ")
    return before


def team() -> str:
    """How the kernels run on several threads: ``"openmp"`` (the OpenMP threads PyTorch runs its own
    work on, shared with it: the library is built with ``-fopenmp`` when this process's torch uses GNU
    OpenMP, unless ``PLE_NATIVE_OPENMP=0``) or ``"pthreads"`` (threads started per call; also in a
    forked child, where GNU OpenMP cannot start a team)."""
    if _lib is not None and _lib is _team[0]:
        return _team[1]
    lib = library()
    if lib is not _team[0]:
        _team[:] = [lib, ("pthreads", "openmp")[lib.ple_team_kind()]]
    return _team[1]


_team: list = [None, "pthreads"]
"""The library :func:`team` last asked and its answer (asked once per library)."""


def _after_fork_in_child() -> None:
    """GNU OpenMP cannot start a team in a child forked after its parent ran one: the child's kernels
    run on threads started per call (the C library sees forks after it loaded; this covers a library
    loaded in the child)."""
    global _forked
    _forked = True
    _team[:] = [None, "pthreads"]
    if _lib is not None:
        _lib.ple_team_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_local = threading.local()


def background_thread() -> None:
    """Mark the calling thread as one that works beside the model (a lookahead worker): its kernel
    calls then run on it alone, instead of starting an OpenMP team that would take cores from the
    model's own work (:func:`threads_for`)."""
    _local.background = True


def threads_for(
    items: int, per_thread: int, *, started_per_call: bool = False, threads: int | None = None, kind: str | None = None
) -> int:
    """Threads for a kernel call over ``items`` pieces of work: one per ``per_thread`` pieces, at most
    ``torch.get_num_threads()``, on PyTorch's OpenMP threads (:func:`team`); one on a
    :func:`background_thread`, and one where threads would be started per call unless
    ``started_per_call`` says the pieces pay for that (block decoding does; a row copy does not).
    ``threads`` and ``kind``: ``torch.get_num_threads()`` and :func:`team`, when the caller has them."""
    if items < 2 * per_thread or getattr(_local, "background", False):
        return 1
    if not started_per_call and (team() if kind is None else kind) != "openmp":
        return 1
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    return max(1, min(threads, items // per_thread))


def available() -> bool:
    """True when :func:`library` works; warns once with the reason when the kernels were wanted but failed."""
    global _warned
    try:
        library()
        return True
    except NativeUnavailable as e:
        if not _warned and not _off(os.environ.get("PLE_NATIVE")):
            _warned = True
            warnings.warn(f"ple: using the PyTorch CPU path: {e}", RuntimeWarning, stacklevel=2)
        return False
