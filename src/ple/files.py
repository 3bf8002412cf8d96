"""Opening the files ple reads: regular files only.

A FIFO, a device or a socket named like a checkpoint, a ``config.json`` or a table file would block
a reader forever (or stream without end); a folder is never a file. :func:`open_regular` opens
without blocking and refuses anything but a regular file, naming what it found; symbolic links are
followed (a link to a regular file is fine).
"""

from __future__ import annotations

import os
import stat

from .errors import InvalidArgumentError, PLEError

__all__ = ["file_kind", "open_regular", "read_regular", "require_regular"]


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
