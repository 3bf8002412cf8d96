"""Token input, one for every command: ``--tokens FILE``, ``--text FILE`` and ``--real-text N``.

``ple stats``, ``ple eval``, ``ple train`` and ``ple demo`` declare the three options with
:func:`add_token_arguments` and read the stream they name with :func:`read_tokens`, so they mean the
same in each:

- ``--tokens FILE``: the model's own token ids, from a ``.npy`` file (integers, any shape, read in C
  order) or a text file of integers separated by spaces, commas or newlines (:func:`iter_token_file`,
  streamed); every id is checked against the model's vocabulary and never changed;
- ``--text FILE``: a UTF-8 text file tokenized with Qwen's BPE vocabulary
  (:func:`ple.data.realtext.tokenize_file`, streamed); a NUL byte or a form feed ends a document;
- ``--real-text N``: the first N tokens of the built-in real text (:mod:`ple.data.realtext`: Python's
  documentation, one document after another).

How text reaches the model. A model whose vocabulary holds the tokenizer's 151,644 ids (Qwen's
248,320 do) gets the tokenizer's ids, its own EOS at the end of each document. A smaller vocabulary
(the demo's model has 1,024 ids) gets the text through a vocabulary map made from the text itself
(:func:`vocabulary_map`): the text's most frequent tokens get the model's ids from 3 up, in order of
frequency (equal counts: the smaller token id first; the model's EOS id is skipped), every other
token the unknown id 2, and the end of each document the model's EOS. The map is made from the
whole stream read (``--text`` reads its file twice, once to count and once to map), but in ``ple
train`` from its training part only: the stream less its last, held-out tokens, which are mapped by
it too (a token the training part lacks becomes the unknown id). So ``--real-text N`` maps the first
N tokens exactly as ``ple train`` mapped them when they were its training part (by default the first
steps x batch x length tokens of the real text).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
from numpy.lib import format as npy_format

from ple.common.argtypes import parse_int, positive_int, shown
from ple.common.files import open_regular
from ple.data.realtext import QWEN_ENDOFTEXT
from ple.errors import CommandLineError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = [
    "add_token_arguments",
    "read_tokens",
    "token_source",
    "given_source",
    "TokenSource",
    "vocabulary_map",
    "apply_map",
    "needs_map",
    "iter_token_file",
    "read_token_file",
    "CHUNK_TOKENS",
    "TOKENIZER_IDS",
    "FIRST_ID",
    "UNKNOWN_ID",
]

FIRST_ID = 3
"""The first model id a mapped text token gets (ids 0 to 2 are left to the model's special tokens)."""
UNKNOWN_ID = FIRST_ID - 1
"""The model id of every text token the vocabulary map leaves out."""
_OPTIONS = ("tokens", "text", "real_text")


TOKENIZER_IDS = QWEN_ENDOFTEXT + 1
"""The token ids the text tokenizer gives (151,644: Qwen's merges and its end of text)."""


# ---------------------------------------------------------------------------------------------- options


def add_token_arguments(p: argparse.ArgumentParser, *, required: bool = True) -> Any:
    """Declare ``--tokens FILE``, ``--text FILE`` and ``--real-text N`` on ``p``, one of them at most
    (exactly one with ``required``); returns their mutually exclusive group (a command may add its own
    alternative to it, as ``ple demo`` adds ``--synthetic-tokens``)."""
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument(
        "--tokens", metavar="FILE", help="the model's token ids: a .npy file, or text with integers (streamed)"
    )
    group.add_argument(
        "--text",
        metavar="FILE",
        help="a UTF-8 text file, tokenized with the Qwen BPE vocabulary (streamed; a smaller vocabulary gets "
        "it mapped, README 'Token input')",
    )
    group.add_argument(
        "--real-text", type=positive_int, metavar="N", help="the first N tokens of the built-in real text"
    )
    return group


@dataclasses.dataclass(frozen=True)
class TokenSource:
    """The one of ``--tokens`` / ``--text`` / ``--real-text`` that names a stream, and its value."""

    option: str  # "tokens", "text" or "real_text"
    value: str | int

    def __str__(self) -> str:
        """``--real-text 4096``, as given on the command line."""
        return f"--{self.option.replace('_', '-')} {self.value}"

    @property
    def needs_tokenizer(self) -> bool:
        """Whether reading it needs the text tokenizer (``tiktoken`` and ``dashscope``)."""
        return self.option != "tokens"

    def describe(self) -> dict[str, str | int]:
        """``{"real_text": 4096}``: the source for a JSON document."""
        return {self.option: self.value}


def given_source(args: Any) -> TokenSource | None:
    """The source ``args`` names (any object with ``tokens``, ``text`` and ``real_text`` attributes,
    missing ones read as None), or None; more than one is refused."""
    given = [TokenSource(o, getattr(args, o)) for o in _OPTIONS if getattr(args, o, None) is not None]
    if len(given) > 1:
        raise CommandLineError(f"{given[0]} and {given[1]}: give one token input, not both")
    return given[0] if given else None


def token_source(args: Any, real_text_default: int | None = None) -> TokenSource:
    """The source ``args`` names (:func:`given_source`); without one, ``--real-text real_text_default``
    (none without a default is refused)."""
    source = given_source(args)
    if source is not None:
        return source
    if real_text_default is None:
        raise CommandLineError("no token input: give --tokens FILE, --text FILE or --real-text N")
    return TokenSource("real_text", real_text_default)


# ---------------------------------------------------------------------------------------------- the stream


def needs_map(vocab_size: int) -> bool:
    """Whether text reaches a model of ``vocab_size`` ids through a vocabulary map (it is smaller than
    the tokenizer's ids)."""
    return vocab_size < TOKENIZER_IDS


def read_tokens(
    args: Any, vocab_size: int, eos: int, *, held_out: int = 0, real_text_default: int | None = None
) -> Iterator[np.ndarray]:
    """The token stream ``args`` names (:func:`token_source`), as int64 chunks of model ids in
    ``[0, vocab_size)``; ``eos``: the model's end-of-document id. See the module docstring for each
    option and for the vocabulary map of a small model.

    ``held_out``: the last ``held_out`` tokens are left out of the vocabulary map (``ple train``'s
    held-out part); a mapped stream is then read whole before its first chunk. Token files are read
    as they are consumed: a bad entry raises :class:`~ple.errors.InvalidArgumentError` there."""
    source = token_source(args, real_text_default)
    if source.option == "tokens":
        return iter_token_file(str(source.value), vocab_size)
    if not needs_map(vocab_size):
        return _text_chunks(source, eos)
    return _mapped(source, vocab_size, eos, held_out)


def _text_chunks(source: TokenSource, eos: int) -> Iterator[np.ndarray]:
    """The tokenizer's ids of ``--text`` / ``--real-text``, documents ended by ``eos``."""
    from ple.data.realtext import token_stream, tokenize_file

    if source.option == "text":
        return tokenize_file(str(source.value), eos)
    return iter([token_stream(int(source.value), eos)])


def _mapped(source: TokenSource, vocab_size: int, eos: int, held_out: int) -> Iterator[np.ndarray]:
    """Text through the vocabulary map of its first ``len - held_out`` tokens: the real text (or a
    stream with a held-out part) read whole, a text file otherwise counted in a first pass and mapped
    in a second, block by block."""
    if source.option == "real_text" or held_out:
        stream = np.concatenate(list(_text_chunks(source, QWEN_ENDOFTEXT)))
        basis = stream[: max(0, stream.size - held_out)]
        yield apply_map(stream, vocabulary_map(basis, vocab_size, QWEN_ENDOFTEXT, eos))
        return
    counts = np.zeros(TOKENIZER_IDS, dtype=np.int64)
    for chunk in _text_chunks(source, QWEN_ENDOFTEXT):
        counts += np.bincount(chunk, minlength=TOKENIZER_IDS)
    mapping = _map_counts(counts, vocab_size, QWEN_ENDOFTEXT, eos)
    for chunk in _text_chunks(source, QWEN_ENDOFTEXT):
        yield apply_map(chunk, mapping)


# ---------------------------------------------------------------------------------------------- the map


def vocabulary_map(
    tokens: np.ndarray, vocab_size: int, eos_in: int, eos_out: int, first_id: int = FIRST_ID
) -> np.ndarray:
    """``map [max(max(tokens), eos_in) + 1]`` int64: source token -> model id, made from the counts of
    ``tokens`` (the module docstring says how); ``eos_in`` -> ``eos_out``, the unknown id is
    ``first_id - 1``. ``tokens`` need not hold ``eos_in`` (a short slice of text may end before its
    first document does)."""
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    size = max(int(tokens.max(initial=0)), eos_in) + 1
    return _map_counts(np.bincount(tokens, minlength=size), vocab_size, eos_in, eos_out, first_id)


def _map_counts(counts: np.ndarray, vocab_size: int, eos_in: int, eos_out: int, first_id: int = FIRST_ID) -> np.ndarray:
    """:func:`vocabulary_map` from ``counts[token]`` (``eos_in``'s own count is ignored)."""
    if vocab_size <= first_id:
        raise InvalidArgumentError(f"vocab_size {vocab_size} leaves no ids from {first_id} on")
    counts = counts.copy()
    counts[eos_in] = 0
    values = np.flatnonzero(counts)
    order = np.lexsort((values, -counts[values]))  # most frequent first, ties by id
    ids = np.arange(first_id, vocab_size, dtype=np.int64)
    ids = ids[ids != eos_out]
    keep = values[order][: ids.size]
    out = np.full(counts.size, first_id - 1, dtype=np.int64)
    out[keep] = ids[: keep.size]
    out[eos_in] = eos_out
    return out


def apply_map(tokens: np.ndarray, mapping: np.ndarray) -> np.ndarray:
    """``tokens`` as model ids through ``mapping`` (:func:`vocabulary_map`); a token past its end is
    the unknown id."""
    return np.where(tokens < mapping.size, mapping[np.minimum(tokens, mapping.size - 1)], UNKNOWN_ID)


# ---------------------------------------------------------------------------------------------- token files

CHUNK_TOKENS = 1 << 18
"""Tokens per chunk that :func:`iter_token_file` yields (and :func:`ple.data.stats.row_traffic` processes at once)."""

_TEXT_BLOCK = 1 << 20  # bytes read at a time from a text token file (~300k numbers as Python strings)
_MAX_WORD = 1 << 20  # a "word" longer than this (no separator in sight) is not a token id
_SEPARATORS = (b" ", b"\t", b"\n", b"\r", b"\x0b", b"\x0c", b",")
_PLAIN_DIGITS = re.compile(r"[0-9\s,]*")
_LONG_NUMBER = re.compile(r"[0-9]{19}")


def read_token_file(path: str | os.PathLike, vocab_size: int | None = None) -> torch.Tensor:
    """Token ids ``[n]`` int64 of a whole token file (see :func:`iter_token_file`, which this joins;
    use that to stream files larger than memory)."""
    import torch

    return torch.from_numpy(np.concatenate(list(iter_token_file(path, vocab_size))))


def iter_token_file(
    path: str | os.PathLike, vocab_size: int | None = None, chunk_tokens: int = CHUNK_TOKENS
) -> Iterator[np.ndarray]:
    """Token ids of a ``.npy`` file (integers, any shape) or a text file of integers separated by
    spaces, commas or newlines, as int64 arrays of at most ``chunk_tokens`` ids, read in blocks.

    Refuses, naming the file and the first offending entry (its index in the whole stream): a path
    that is not a regular file, an empty stream, a ``.npy`` file that is truncated, pickled, not of an
    integer dtype or whose header does not match its size, text that is not an integer in ASCII
    digits (:func:`ple.common.argtypes.parse_int`), negative ids, and (given ``vocab_size``) ids outside
    ``[0, vocab_size)``. Chunks before the offending one have been yielded by then.
    """
    p = Path(path)
    if not p.exists():
        raise InvalidArgumentError(f"token file {p} is missing")
    fd = open_regular(p, "token file")  # a folder, a FIFO or a device is refused, never read
    seen = 0
    with os.fdopen(fd, "rb") as f:
        blocks = _npy_blocks(f, p, chunk_tokens) if p.suffix == ".npy" else _text_blocks(f, p, vocab_size)
        for block in blocks:
            for k in range(0, block.size, chunk_tokens):
                arr = block[k : k + chunk_tokens]
                _check_range(arr, p, seen, vocab_size)
                seen += arr.size
                yield arr
    if seen == 0:
        raise InvalidArgumentError(f"token file {p} holds no token ids")


def _check_range(arr: np.ndarray, p: Path, first: int, vocab_size: int | None) -> None:
    from ple.ngram import first_out_of_range

    at = first_out_of_range(arr, vocab_size)
    if at is not None:
        bad, i = int(arr.reshape(-1)[at]), first + at
        limit = f"[0, vocab_size={vocab_size})" if vocab_size is not None else ">= 0"
        raise InvalidArgumentError(f"token file {p}: entry {i} is {bad}, outside {limit}")


def _text_blocks(f: BinaryIO, p: Path, vocab_size: int | None) -> Iterator[np.ndarray]:
    """Blocks of a text token file cut after a separator, so no number is split."""
    carry = b""
    index = 0
    while True:
        block = f.read(_TEXT_BLOCK)
        last = not block
        data = carry + block
        if not last:
            cut = max(data.rfind(s) for s in _SEPARATORS)
            if cut < 0:
                carry = data
                if len(carry) > _MAX_WORD:
                    word = carry[:64].decode(errors="replace")
                    raise InvalidArgumentError(
                        f"token file {p}: entry {index} is {shown(word)}, not an integer token id"
                    )
                continue
            data, carry = data[: cut + 1], data[cut + 1 :]
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise InvalidArgumentError(f"token file {p}: not text (use .npy for binary token arrays)") from None
        words = text.replace(",", " ").split()
        yield _parse_words(words, text, p, index, vocab_size)
        index += len(words)
        if last:
            return


def _parse_words(words: list[str], text: str, p: Path, first: int, vocab_size: int | None) -> np.ndarray:
    if _PLAIN_DIGITS.fullmatch(text) and not _LONG_NUMBER.search(text):
        return np.fromiter(map(int, words), dtype=np.int64, count=len(words))  # plain digits: int() agrees
    top = vocab_size if vocab_size is not None else 1 << 63
    values = np.empty(len(words), dtype=np.int64)
    for i, w in enumerate(words):
        v = parse_int(w)
        if v is None:
            raise InvalidArgumentError(f"token file {p}: entry {first + i} is {shown(w)}, not an integer token id")
        if not 0 <= v < top:
            limit = f"[0, vocab_size={vocab_size})" if vocab_size is not None else "[0, 2^63)"
            raise InvalidArgumentError(f"token file {p}: entry {first + i} is {v}, outside {limit}")
        values[i] = v
    return values


def _npy_blocks(f: BinaryIO, p: Path, chunk_tokens: int) -> Iterator[np.ndarray]:
    """The integers of an open ``.npy`` file, flattened in C order, ``chunk_tokens`` at a time. The
    header is read first and checked against the file's size before anything is allocated: a header
    claiming a shape larger (or smaller) than the data the file holds is refused, as are pickled
    objects and non-integer dtypes. A Fortran-ordered array of several dimensions is read whole."""
    try:
        version = npy_format.read_magic(f)
        if version == (1, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_2_0(f)
        else:
            raise ValueError(f"format version {version[0]}.{version[1]} (integer arrays are 1.0 or 2.0)")
    except (ValueError, OSError, EOFError, SyntaxError) as e:
        raise InvalidArgumentError(f"token file {p}: not a readable .npy array ({e})") from None
    if dtype.hasobject:
        raise InvalidArgumentError(f"token file {p}: not a readable .npy array (it holds pickled objects)")
    if not np.issubdtype(dtype, np.integer):
        raise InvalidArgumentError(f"token file {p}: dtype {dtype}, expected integer token ids")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise InvalidArgumentError(f"token file {p}: not a readable .npy array (its header says shape {shape})")
    count = math.prod(shape)
    need = count * dtype.itemsize
    have = os.fstat(f.fileno()).st_size - f.tell()
    if need != have:
        raise InvalidArgumentError(
            f"token file {p}: not a readable .npy array (its header says shape {shape} of {dtype}, {need} bytes, "
            f"but {have} bytes follow the header)"
        )

    def read(n: int) -> np.ndarray:
        data = f.read(n * dtype.itemsize)
        if len(data) != n * dtype.itemsize:
            raise InvalidArgumentError(f"token file {p}: not a readable .npy array (it shrank while being read)")
        arr = np.frombuffer(data, dtype=dtype)
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise InvalidArgumentError(f"token file {p}: id {int(arr.max())} does not fit int64")
        return arr.astype(np.int64)

    if fortran_order and sum(d > 1 for d in shape) > 1:
        yield np.ascontiguousarray(read(count).reshape(shape, order="F").reshape(-1))
        return
    for k in range(0, count, chunk_tokens):
        yield read(min(chunk_tokens, count - k))
