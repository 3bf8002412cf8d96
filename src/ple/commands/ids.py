"""``ple ids``: the table rows each token of a fresh request reads, per n-gram order and head."""

from __future__ import annotations

import argparse

from ple.checkpoint import resolve_model
from ple.commands.report import LIST_SEPARATOR, add_json_argument, check_layer_index, emit_json
from ple.common.argtypes import integer, parse_int, shown
from ple.errors import CommandLineError

__all__ = ["HELP", "add_arguments", "run", "parse_tokens", "hashed_windows"]

HELP = "the table rows each token of a fresh request reads"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="config.json or model directory")
    p.add_argument("--tokens", required=True, help="token ids separated by commas or spaces, e.g. 3,17,248044,9")
    p.add_argument("--layer", type=integer, default=0, help="PLE layer index: position in ple_layer_ids (default 0)")
    add_json_argument(p)


def parse_tokens(text: str) -> list[int]:
    """Token ids from ``"3,17,248044"`` or ``"3 17 248044"``; refuses empty lists, anything but ASCII
    digits (``"+5"``, ``"1_0"``, ``"٣"``: :func:`ple.common.argtypes.parse_int`) and negative ids, naming the
    offending entry (a :class:`~ple.errors.CommandLineError`: exit status 2)."""
    parts = [t for t in LIST_SEPARATOR.split(text.strip()) if t]
    if not parts:
        raise CommandLineError(f"--tokens: no token ids in {text!r} (expected e.g. 3,17,248044,9)")
    out = []
    for i, t in enumerate(parts):
        v = parse_int(t)
        if v is None:
            raise CommandLineError(f"--tokens: entry {i} is {shown(t)}, not an integer token id")
        if v < 0:
            raise CommandLineError(f"--tokens: entry {i} is {v}; token ids are >= 0")
        out.append(v)
    return out


def run(args: argparse.Namespace) -> int:
    """The table rows each token of a fresh request reads, per n-gram order and head."""
    import torch

    from ple.ngram import fresh_context, ngram_ids

    cfg, _ = resolve_model(args.path)
    tokens = parse_tokens(args.tokens)
    check_layer_index(cfg, args.layer)
    lay = cfg.layout(args.layer)
    bad = [(i, t) for i, t in enumerate(tokens) if t >= cfg.vocab_size]
    if bad:
        i, t = bad[0]
        raise CommandLineError(f"--tokens: entry {i} is {t}, outside [0, vocab_size={cfg.vocab_size})")
    x = torch.tensor(tokens, dtype=torch.int64)
    rows = ngram_ids(x, torch.tensor([0, len(tokens)]), fresh_context(1, lay, cfg.eos_token_id), lay, cfg.eos_token_id)
    if args.json:
        emit_json({"ple_layer_index": args.layer, "tokens": tokens, "ids": rows.tolist()})
        return 0
    hpn = cfg.heads_per_ngram
    table = rows.tolist()
    lines = []
    for t, (tok, y) in enumerate(zip(tokens, hashed_windows(tokens, cfg.ngram_size, cfg.eos_token_id))):
        lines.append(f"token {t}: {tok}")
        row = table[t]
        for order in range(2, cfg.ngram_size + 1):
            gram = list(reversed(y[:order]))
            g0 = (order - 2) * hpn
            heads = ", ".join(f"h{g0 + j}:{row[g0 + j]}" for j in range(hpn))
            lines.append(f"  {order}-gram {gram}: {heads}")
    print("\n".join(lines))
    return 0


def hashed_windows(tokens: list[int], ngram_size: int, eos_token_id: int):
    """Per token of a fresh request, ``[y_0, ..., y_{N-1}]`` as the hash sees them (itself, then its
    predecessors; EOS at or before the most recent earlier EOS, and before the start): what
    :func:`ple.ngram.reference.ngram_tokens` defines, in one pass (time linear in the tokens)."""
    last_eos = -1  # the most recent EOS strictly before t
    for t, tok in enumerate(tokens):
        yield [tokens[t - s] if t - s > last_eos and t - s >= 0 else eos_token_id for s in range(ngram_size)]
        if tok == eos_token_id:
            last_eos = t
