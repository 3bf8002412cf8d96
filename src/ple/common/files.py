"""Opening the files ple reads, parsing the JSON it reads, writing the small files it writes.

Reading: regular files only. A FIFO, a device or a socket named like a checkpoint, a
``config.json`` or a table file would block a reader forever (or stream without end); a folder is
never a file. :func:`open_regular` opens without blocking and refuses anything but a regular file,
naming what it found; symbolic links are followed (a link to a regular file is fine).

JSON: :func:`parse_json` and :func:`read_json` turn every way ``json`` refuses hostile input
(malformed text, bytes that are no Unicode, nesting deeper than the recursion limit, an integer of
more digits than Python converts) into the caller's error naming the file.

Writing: :func:`write_atomically` (and :func:`write_atomically_from`, streamed) replaces a file all or nothing through a temporary file of its
own (random name, created exclusively, never through a symbolic link); :func:`partial_dir`
makes such a private folder for a writer that builds a whole folder, locked while it works, so
folders of writers that died are swept away by the next one (:func:`sweep_partial_dirs`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ple.errors import InvalidArgumentError, PLEError

__all__ = [
    "file_identity",
    "file_kind",
    "fsync_dir",
    "kept_notes",
    "note_kept",
    "open_regular",
    "parse_json",
    "partial_dir",
    "partial_entries",
    "pread_exact",
    "read_json",
    "read_regular",
    "require_regular",
    "sweep_partial_dirs",
    "sweep_partial_files",
    "write_atomically",
    "write_atomically_from",
]

PARTIAL_SUFFIX = ".partial"
"""The suffix of the temporary files and folders writers fill before renaming them into place."""


def file_kind(mode: int) -> str:
    """What a ``st_mode`` describes, in words ("a regular file", "a folder", "a FIFO", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _refuse(path: str | os.PathLike, what: str, mode: int, error: type[PLEError]) -> PLEError:
    return error(f"{what} {os.fspath(path)} is {file_kind(mode)}, not a regular file")


def require_regular(
    path: str | os.PathLike, what: str = "file", error: type[PLEError] = InvalidArgumentError
) -> os.stat_result:
    """``os.stat(path)`` when it is a regular file; ``error`` naming what it is otherwise.

    For paths handed to a library that opens them itself; :func:`open_regular` has no window
    between the check and the open."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, what, st.st_mode, error)
    return st


def open_regular(path: str | os.PathLike, what: str = "file", error: type[PLEError] = InvalidArgumentError) -> int:
    """A read-only descriptor of ``path``, a regular file; raises ``error`` naming what it is otherwise.

    The open itself never blocks (``O_NONBLOCK``: a FIFO without a writer opens at once and is then
    refused); a missing file raises ``FileNotFoundError`` as ``open`` does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, what, st.st_mode, error)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(
    path: str | os.PathLike, what: str = "file", limit: int = 64 << 20, error: type[PLEError] = InvalidArgumentError
) -> bytes:
    """The bytes of a small regular file (a JSON config or index); refuses files over ``limit`` bytes."""
    fd = open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{what} {os.fspath(path)} is {size} bytes, more than the {limit} a {what} may have")
        parts = []
        total = 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            total += len(b)
            if total > limit:  # grew while being read
                raise error(f"{what} {os.fspath(path)} is more than the {limit} bytes a {what} may have")
            parts.append(b)
        return b"".join(parts)
    finally:
        os.close(fd)


def file_identity(file: str | os.PathLike | os.stat_result) -> dict[str, int]:
    """A file as the file system knows it now (a path, or its ``os.stat`` result): its size, modification
    and change times (ns) and inode. Any write to the file changes it, even one whose modification time
    was set back afterwards (no program can set the change time), and so does a file put in its place.
    It is the one identity of a file that ple keeps: a conversion's resume key (the source's files) and
    a table folder's record (the checkpoint's files, the table file) are made of it. The device number
    is left out: network and overlay file systems do not keep it stable, and hosts sharing a folder
    see different ones. (A change time also moves on a ``chmod`` or a new hard link: a file so
    touched is taken for a changed one, which costs a comparison or a conversion, never a wrong row.)"""
    st = file if isinstance(file, os.stat_result) else os.stat(file)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def note_kept(interruption: BaseException | None, path: Path, message: str) -> None:
    """Say that ``path`` was kept (``message``, one line) when it is true: on stderr at once without an
    ``interruption``; else noted on it (a note of the exception, shown with its traceback, and what
    :func:`kept_notes` gives whoever handles it, the ``ple`` command, once whatever removes folders on
    the way out, say a temporary one, has run)."""
    if interruption is None:
        print(message, file=sys.stderr)
        return
    interruption.ple_kept = [*getattr(interruption, "ple_kept", []), (Path(path), message)]  # type: ignore[attr-defined]
    if hasattr(interruption, "add_note"):  # Python 3.11
        interruption.add_note(message)


def kept_notes(interruption: BaseException) -> list[str]:
    """The messages :func:`note_kept` noted on ``interruption`` whose file is still there."""
    return [m for p, m in getattr(interruption, "ple_kept", []) if os.path.lexists(p)]


# ---------------------------------------------------------------------------------------------- JSON


def pread_exact(fd: int, n: int, offset: int, short: Callable[[int], Exception]) -> bytearray:
    """``n`` bytes at ``offset`` of the open file ``fd``, in a fresh buffer. A file that ends first
    raises ``short(at)``, the caller's error for a file that ends at byte ``at``."""
    buf = bytearray(n)
    view = memoryview(buf)
    done = 0
    while done < n:
        k = os.preadv(fd, [view[done:]], offset + done)
        if k <= 0:
            raise short(offset + done)
        done += k
    return buf


def parse_json(blob: bytes | bytearray | str, what: str, error: type[PLEError] = InvalidArgumentError) -> Any:
    """``json.loads(blob)``; ``error`` naming ``what`` (say ``"config /m/config.json"``) when it is not
    valid JSON: malformed text, bytes that are not UTF-8/16/32, nesting deeper than Python's recursion
    limit, or an integer of more digits than Python converts (``sys.get_int_max_str_digits()``)."""
    try:
        return json.loads(blob)
    except RecursionError:
        raise error(f"{what} is not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors; so is a too long integer
        reason = str(e) if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else str(e).split(";")[0]
        raise error(f"{what} is not valid JSON ({reason})") from None


def read_json(
    path: str | os.PathLike, what: str = "file", limit: int = 64 << 20, error: type[PLEError] = InvalidArgumentError
) -> Any:
    """The parsed JSON of a small regular file (:func:`read_regular`, then :func:`parse_json`);
    every problem raises ``error`` naming ``what`` and the path (a missing file: ``FileNotFoundError``)."""
    return parse_json(read_regular(path, what, limit, error), f"{what} {os.fspath(path)}", error)


# ---------------------------------------------------------------------------------------------- writing


def _partial_name(path: Path) -> Path:
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(6)}{PARTIAL_SUFFIX}")


def write_atomically(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with a file holding ``data``, all or nothing (see :func:`write_atomically_from`)."""
    write_atomically_from(path, (data,), mode)


def write_atomically_from(path: str | os.PathLike, chunks: Iterable, mode: int = 0o644) -> None:
    """Replace ``path`` with a file holding the bytes of ``chunks`` (bytes-like objects, in order,
    made as they are written: a large file streams through bounded memory), all or nothing.

    The bytes go to a temporary file of a random name in the same folder
    (``<name>.<pid>-<random>.partial``), created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: nothing
    already at that name (a symbolic link planted there, another writer's file) is followed, reused
    or truncated. The file is fsync'd and renamed over ``path`` (``os.replace``; then the folder is
    fsync'd), so a reader sees the old file or the new one, never a mix; concurrent writers each
    write their own file and the last rename wins. On any error (the disk full, an interruption) the temporary file is removed and
    ``path`` is left as it was; an ``OSError`` of a write names ``path``; ``chunks`` is closed (a
    generator's ``finally`` runs) whether it was used up or not. ``mode`` is the new file's
    permissions (less the umask)."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    tmp: Path | None = None
    try:
        for _ in range(16):
            name = _partial_name(path)
            try:
                fd = os.open(name, flags, mode)
            except FileExistsError:
                continue
            tmp = name
            break
        else:  # 16 random names taken
            raise FileExistsError(f"could not create a temporary file beside {path}: every name tried exists")
        try:
            for data in chunks:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as e:
            if e.filename is None and e.errno is not None:  # the disk full, a file size limit: name the file
                raise OSError(e.errno, f"{e.strerror} (writing {path})", os.fspath(path)) from e
            raise
        finally:
            os.close(fd)
            close = getattr(chunks, "close", None)
            if close is not None:  # a generator stopped midway runs its cleanup now, in this thread
                close()
        os.replace(tmp, path)
        tmp = None
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def sweep_partial_files(path: str | os.PathLike) -> list[Path]:
    """Remove the temporary files that dead writers of ``path`` left (``<name>.<pid>-<random>.partial``,
    see :func:`write_atomically_from`): those whose process no longer exists (a symbolic link of such a
    name is removed, never followed). Returns the files removed."""
    path = Path(path)
    pattern = re.compile(re.escape(path.name) + r"\.(\d+)-[0-9a-f]{12}" + re.escape(PARTIAL_SUFFIX))
    removed: list[Path] = []
    for p, st in partial_entries(path.parent, pattern):
        if not stat.S_ISREG(st.st_mode):
            continue
        m = pattern.fullmatch(p.name)
        assert m is not None
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its writer lives (or the number is another process's now: left alone)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
            removed.append(p)
    return removed


_STALE_PARTIAL_S = 60.0  # a writer locks its folder within microseconds of making it


def _lock_dir(folder: Path, blocking: bool) -> int | None:
    """A descriptor of ``folder`` holding an exclusive ``flock`` on it, or None when another process
    holds it (``blocking=False``) or locks are unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def partial_entries(folder: Path, pattern: re.Pattern[str]) -> Iterator[tuple[Path, os.stat_result]]:
    """The entries of ``folder`` whose names match ``pattern`` (writers' temporary files or folders),
    with their ``lstat``; a symbolic link of such a name is removed on the way, never followed (its
    target is never touched). A folder that cannot be listed has none."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not pattern.fullmatch(name):
            continue
        p = folder / name
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
            continue
        yield p, st


def sweep_partial_dirs(path: str | os.PathLike) -> list[Path]:
    """Remove the folders that dead writers of ``path`` left (``<name>.<pid>-<random>.partial``,
    see :func:`partial_dir`): those no process holds locked, made more than a minute ago (a
    symbolic link of such a name is removed, never followed). Returns the folders removed."""
    path = Path(path)
    pattern = re.compile(re.escape(path.name) + r"\.\d+-[0-9a-f]{12}" + re.escape(PARTIAL_SUFFIX))
    removed: list[Path] = []
    for p, st in partial_entries(path.parent, pattern):
        if not stat.S_ISDIR(st.st_mode) or time.time() - st.st_mtime < _STALE_PARTIAL_S:
            continue
        try:
            fd = _lock_dir(p, blocking=False)
        except OSError:
            continue
        if fd is None:
            continue  # its writer is at work
        try:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def partial_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A new empty folder beside ``path`` to build ``path`` in, for the duration of the block:
    ``<name>.<pid>-<random>.partial``, made with ``mkdir`` (which never follows or reuses what is
    already at a name), permissions 0o777 less the umask, and locked (``flock``) while the block
    runs, so :func:`sweep_partial_dirs` (run here first) removes only folders of writers that died.
    The block fills the folder and renames it to ``path``; if it raises, the folder is removed."""
    path = Path(path)
    sweep_partial_dirs(path)
    for _ in range(16):
        tmp = _partial_name(path)
        try:
            os.mkdir(tmp, 0o777)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"could not create a temporary folder beside {path}: every name tried exists")
    fd: int | None = None
    try:
        fd = _lock_dir(tmp, blocking=True)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename or a new entry in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
