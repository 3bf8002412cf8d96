"""Real-text token streams, offline: a real BPE tokenizer over real English text, both from packages.

What ple measures on (row reuse, cache hit rates, disk reads) depends on the tokens: uniform random
tokens touch a fresh row for almost every lookup, real text does not. This module gives token
streams of real text without any download at run time:

- the tokenizer is Qwen's byte-level BPE vocabulary (151,643 merges plus the ``<|endoftext|>`` id
  151,643) in the tiktoken file format, as shipped inside the ``dashscope`` package
  (``dashscope/resources/qwen.tiktoken``), run by the ``tiktoken`` package. It is smaller than the
  248,320 ids of a ``qwen4_exp`` model: its ids are a subset of the model's id range, and the
  n-gram hashing treats any id alike. The package is located, never imported;
- the text is Python's own documentation as the interpreter ships it: the language reference and
  library topics of ``pydoc_data.topics`` (about 0.47 MB), then the docstrings of the standard
  library's modules, classes and functions, module by module in sorted path order (several MB).
  Each topic and each module is one document.

Both ``dashscope`` and ``tiktoken`` are in the ``dev`` extra; without them :func:`tokenizer` raises
:class:`RealTextError` naming the package to install.

``documents()`` yields the texts, ``token_documents(eos)`` their token ids (one ``int64`` array per
document), and ``requests(count, length, eos)`` cuts ``count`` requests of ``length`` tokens out of the
stream (documents joined with ``eos`` between them), the way a serving benchmark needs them.
"""

from __future__ import annotations

import ast
import base64
import functools
import importlib
import importlib.util
import os
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ple.common.files import open_regular
from ple.errors import InvalidArgumentError, PLEError

__all__ = [
    "RealTextError",
    "QWEN_PATTERN",
    "QWEN_ENDOFTEXT",
    "vocab_path",
    "tokenizer",
    "documents",
    "token_documents",
    "token_stream",
    "requests",
    "tokenize_file",
]

# Qwen's pre-tokenizer split: contractions, letter runs (one leading non-letter allowed), single
# digits, punctuation runs, newlines, other whitespace.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_ENDOFTEXT = 151643  # "<|endoftext|>", right after the 151,643 merges
_VOCAB_FILE = ("resources", "qwen.tiktoken")


class RealTextError(PLEError, RuntimeError):
    """The real-text resources are missing or unreadable (the message says what to install)."""


def vocab_path() -> Path:
    """The Qwen BPE vocabulary file inside the installed ``dashscope`` package (found without
    importing the package). Raises :class:`RealTextError` when the package or the file is missing."""
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise RealTextError(
            "real-text token streams need the Qwen vocabulary shipped in the 'dashscope' package: "
            "pip install dashscope tiktoken (both are in ple's dev extra)"
        )
    for root in spec.submodule_search_locations:
        p = Path(root).joinpath(*_VOCAB_FILE)
        if p.is_file():
            return p
    raise RealTextError(
        f"the installed dashscope package ({list(spec.submodule_search_locations)}) has no "
        f"{'/'.join(_VOCAB_FILE)}: install a dashscope release that ships it (2.x does)"
    )


def _read_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, IndexError):
                raise RealTextError(f"{path}: line {n} is not '<base64 token> <rank>'") from None
            ranks[token] = rank
    if len(ranks) != QWEN_ENDOFTEXT or sorted(ranks.values()) != list(range(QWEN_ENDOFTEXT)):
        raise RealTextError(f"{path}: expected ranks 0..{QWEN_ENDOFTEXT - 1} once each, got {len(ranks)} entries")
    return ranks


@functools.lru_cache(maxsize=1)
def tokenizer():
    """A ``tiktoken.Encoding`` of Qwen's vocabulary (151,643 merges; ``<|endoftext|>`` is 151,643).

    Raises :class:`RealTextError` when ``tiktoken`` or the vocabulary file is missing."""
    try:
        import tiktoken
    except ImportError:
        raise RealTextError(
            "real-text token streams need the 'tiktoken' package: pip install tiktoken (in ple's dev extra)"
        ) from None
    ranks = _read_ranks(vocab_path())
    return tiktoken.Encoding(
        name="qwen-bpe", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": QWEN_ENDOFTEXT}
    )


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "__pycache__"}
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return out


def _docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return ""
    parts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                parts.append(doc)
    return "\n\n".join(parts)


def documents() -> Iterator[str]:
    """Real English text, one document at a time: the ``pydoc_data.topics`` pages in sorted key
    order, then each standard-library module's docstrings (sorted paths, tests left out)."""
    try:
        table: dict[str, str] = importlib.import_module("pydoc_data.topics").topics
    except ImportError:  # pragma: no cover - some distributions split it out
        table = {}
    for key in sorted(table):
        yield table[key]
    for path in _stdlib_files():
        text = _docstrings(path)
        if text:
            yield text


def token_documents(limit_tokens: int | None = None) -> Iterator[np.ndarray]:
    """Token ids ``[n]`` int64 of each document of :func:`documents`, until ``limit_tokens`` tokens
    (the last document cut) when given."""
    enc = tokenizer()
    left = sys.maxsize if limit_tokens is None else int(limit_tokens)
    for text in documents():
        if left <= 0:
            return
        ids = np.asarray(enc.encode_ordinary(text), dtype=np.int64)[:left]
        if ids.size:
            left -= ids.size
            yield ids


def token_stream(num_tokens: int, eos: int) -> np.ndarray:
    """The first ``num_tokens`` tokens of the documents joined with ``eos`` after each: ``[num_tokens]``
    int64. Raises :class:`RealTextError` if the text holds fewer tokens."""
    parts: list[np.ndarray] = []
    have = 0
    eos_arr = np.array([eos], dtype=np.int64)
    for doc in token_documents():
        parts += [doc, eos_arr]
        have += doc.size + 1
        if have >= num_tokens:
            return np.concatenate(parts)[:num_tokens]
    raise RealTextError(f"the real text holds {have} tokens, fewer than the {num_tokens} asked for")


def requests(count: int, length: int, eos: int, skip: int = 0) -> np.ndarray:
    """``[count, length]`` int64: consecutive ``length``-token pieces of :func:`token_stream` after its
    first ``skip`` tokens (request ``r`` reads tokens ``skip + r*length ..``)."""
    flat = token_stream(skip + count * length, eos)[skip:]
    return flat.reshape(count, length)


def tokenize_file(
    path: str | os.PathLike, eos: int, vocab_size: int | None = None, block_bytes: int = 1 << 22
) -> Iterator[np.ndarray]:
    """Token ids of a UTF-8 text file, read ``block_bytes`` at a time (cut after the last newline of
    a block, so a line is never split; a block without one is cut after its last space), as int64
    arrays. A NUL byte or form feed in the text is a document boundary, which becomes ``eos``.
    ``vocab_size``: the model's, which must hold the tokenizer's ids."""
    p = Path(path)
    if not p.exists():
        raise InvalidArgumentError(f"text file {p} is missing")
    enc = tokenizer()
    if vocab_size is not None and enc.n_vocab > vocab_size:
        raise InvalidArgumentError(f"the tokenizer's {enc.n_vocab} ids do not fit vocab_size={vocab_size}")
    fd = open_regular(p, "text file")
    carry = b""
    any_tokens = False
    with os.fdopen(fd, "rb") as f:
        while True:
            block = f.read(block_bytes)
            data = carry + block
            if block:
                cut = data.rfind(b"\n")
                cut = data.rfind(b" ") if cut < 0 else cut
                if cut < 0:
                    carry = data
                    continue
                data, carry = data[: cut + 1], data[cut + 1 :]
            try:
                text = data.decode()
            except UnicodeDecodeError as e:
                raise InvalidArgumentError(f"text file {p}: not UTF-8 text ({e.reason} near byte {e.start})") from None
            parts = []
            for k, doc in enumerate(re.split("[\x00\x0c]", text)):
                if k:
                    parts.append(np.array([eos], dtype=np.int64))
                if doc:
                    parts.append(np.asarray(enc.encode_ordinary(doc), dtype=np.int64))
            out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            if out.size:
                any_tokens = True
                yield out
            if not block:
                break
    if not any_tokens:
        raise InvalidArgumentError(f"text file {p} holds no text")
