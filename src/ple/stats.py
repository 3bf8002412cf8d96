"""Row traffic statistics of a token stream: what a cache of hot rows in a faster tier would save.

Per head: distinct rows touched, the share of lookups served by the hottest 1% / 10% of touched
rows (reuse), and bucket load — how many distinct n-grams share a row (the hash collision view).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from numpy.lib import format as npy_format

from .argtypes import parse_int, shown
from .config import PLEConfig
from .errors import InvalidArgumentError
from .files import open_regular
from .ngram import fresh_context, ngram_ids
from .ngram.torch_impl import ngram_windows

__all__ = ["read_token_file", "row_traffic"]


def read_token_file(path: str | os.PathLike, vocab_size: int | None = None) -> torch.Tensor:
    """Token ids ``[n]`` int64 from a ``.npy`` file (integers, any shape) or a text file of integers
    separated by spaces, commas or newlines.

    Refuses, naming the file and the first offending entry: a path that is not a regular file, an
    empty stream, a ``.npy`` file that is truncated, pickled, not of an integer dtype or whose header
    does not match its size, text that is not an integer in ASCII digits (:func:`ple.argtypes.parse_int`),
    negative ids, and (given ``vocab_size``) ids outside ``[0, vocab_size)``.
    """
    p = Path(path)
    if not p.exists():
        raise InvalidArgumentError(f"token file {p} is missing")
    fd = open_regular(p, "token file")  # a folder, a FIFO or a device is refused, never read
    with os.fdopen(fd, "rb") as f:
        if p.suffix == ".npy":
            arr = _read_npy(f, p)
        else:
            blob = f.read()
    if p.suffix == ".npy":
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise InvalidArgumentError(f"token file {p}: id {int(arr.max())} does not fit int64")
        tokens = torch.from_numpy(np.ascontiguousarray(arr.reshape(-1).astype(np.int64)))
    else:
        try:
            words = blob.decode().replace(",", " ").split()
        except UnicodeDecodeError:
            raise InvalidArgumentError(f"token file {p}: not text (use .npy for binary token arrays)") from None
        values = []
        top = vocab_size if vocab_size is not None else 1 << 63
        for i, w in enumerate(words):
            v = parse_int(w)
            if v is None:
                raise InvalidArgumentError(f"token file {p}: entry {i} is {shown(w)}, not an integer token id")
            if not 0 <= v < top:
                limit = f"[0, vocab_size={vocab_size})" if vocab_size is not None else "[0, 2^63)"
                raise InvalidArgumentError(f"token file {p}: entry {i} is {v}, outside {limit}")
            values.append(v)
        tokens = torch.tensor(values, dtype=torch.int64)
    if tokens.numel() == 0:
        raise InvalidArgumentError(f"token file {p} holds no token ids")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = lo if lo < 0 else hi
        i = int((tokens == bad).nonzero()[0, 0])
        limit = f"[0, vocab_size={vocab_size})" if vocab_size is not None else ">= 0"
        raise InvalidArgumentError(f"token file {p}: entry {i} is {bad}, outside {limit}")
    return tokens


def _read_npy(f: BinaryIO, p: Path) -> np.ndarray:
    """The integer array of an open ``.npy`` file. Its header is read first and checked against the
    file's size before anything is allocated: a header claiming a shape larger (or smaller) than the
    data the file holds is refused, as are pickled objects and non-integer dtypes."""
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
    need = math.prod(shape) * dtype.itemsize
    have = os.fstat(f.fileno()).st_size - f.tell()
    if need != have:
        raise InvalidArgumentError(
            f"token file {p}: not a readable .npy array (its header says shape {shape} of {dtype}, {need} bytes, "
            f"but {have} bytes follow the header)"
        )
    data = f.read(have)
    if len(data) != have:
        raise InvalidArgumentError(f"token file {p}: not a readable .npy array (it shrank while being read)")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran_order else "C")


def _top_share(counts: torch.Tensor, fraction: float) -> float:
    """Share of all lookups that the hottest ``fraction`` of touched rows serve."""
    k = max(1, int(round(fraction * counts.numel())))
    return float(torch.topk(counts, k).values.sum()) / float(counts.sum())


def row_traffic(tokens: torch.Tensor, config: PLEConfig, ple_layer_index: int = 0) -> dict:
    """Statistics of the rows a stream of tokens (one request; EOS separates documents) reads.

    Returns ``{"tokens", "lookups", "heads": [{"head", "order", "rows", "distinct_rows",
    "top1_share", "top10_share", "distinct_ngrams", "shared_rows", "max_bucket_load"}], "total": {...}}``.
    """
    lay = config.layout(ple_layer_index)
    eos = config.eos_token_id
    qsl = torch.tensor([0, tokens.numel()])
    ctx = fresh_context(1, lay, eos)
    ids = ngram_ids(tokens, qsl, ctx, lay, eos)
    y = ngram_windows(tokens, qsl, ctx, lay.ngram_size, eos)
    heads = []
    for g in range(lay.num_heads):
        order = g // lay.heads_per_ngram + 2
        col = ids[:, g]
        rows, counts = torch.unique(col, return_counts=True)
        grams = torch.unique(torch.cat([col.unsqueeze(1), y[:, :order]], dim=1), dim=0)  # distinct (row, n-gram)
        _, per_row = torch.unique(grams[:, 0], return_counts=True)
        heads.append(
            {
                "head": g,
                "order": order,
                "rows": lay.head_sizes[g],
                "distinct_rows": int(rows.numel()),
                "top1_share": _top_share(counts, 0.01),
                "top10_share": _top_share(counts, 0.10),
                "distinct_ngrams": int(grams.shape[0]),
                "shared_rows": int((per_row > 1).sum()),
                "max_bucket_load": int(per_row.max()) if per_row.numel() else 0,
            }
        )
    all_rows, all_counts = torch.unique(ids.reshape(-1), return_counts=True)
    return {
        "tokens": int(tokens.numel()),
        "lookups": int(ids.numel()),
        "heads": heads,
        "total": {
            "distinct_rows": int(all_rows.numel()),
            "top1_share": _top_share(all_counts, 0.01) if all_counts.numel() else 0.0,
            "top10_share": _top_share(all_counts, 0.10) if all_counts.numel() else 0.0,
            "bytes_per_row_fp8": lay.head_dim,
        },
    }
