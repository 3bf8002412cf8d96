"""``ple eval``: what a table format or an adapter costs in quality, measured on the model's predictions.

The reference is the checkpoint as stored: :func:`ple.integrations.transformers.from_pretrained`
without ``table_format`` (its tables in their own format, each lookup ``row * scale`` exactly; every
other weight as stored). Each candidate is the same model with other tables: a copy in a format of
``--formats`` (made once beside the checkpoint-format table files and reused, as
``from_pretrained(table_format=)`` makes it), or the reference's tables with an adapter's trained
rows on top (``--adapter``, repeatable: one candidate an adapter, each loaded once with
:func:`ple.train.load_adapter`). The model is loaded once: every candidate swaps only the PLE
layers' tables (``PLELayer.set_table``), which stay on disk. One adapter's candidate is named
"adapter"; several are named by their files' stems (``legal`` for ``/x/legal.safetensors``), which
must differ.

The token stream is cut into non-overlapping windows of ``--ctx`` tokens (the last incomplete window
dropped); in each window every position but the last predicts the next token. Windows run one after
the other: for each window the reference's next-token distributions are computed, then each
candidate's logits are compared with them row by row (two passes a row in C, ``_native/ple_eval.c``;
PyTorch log-softmaxes where the kernels are off), and dropped; only per-token scalars are kept (negative
log-likelihood of the actual next token, KL divergence of the full distributions to the reference's,
whether the top-1 token is the reference's, the change of the actual token's probability). The
summaries are those ``llama-perplexity --kl-divergence`` gives: perplexity, KL mean / median /
percentiles / max, "same top", Δp percentiles. The token stream is read by :mod:`ple.data.tokens`,
as every command reads it (text mapped into a small model's vocabulary).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ple.common.argtypes import byte_size, int_between, shown_size
from ple.errors import CommandLineError, InvalidArgumentError
from ple.table.tiers.open import DEFAULT_MEMORY_BUDGET, DEFAULT_TIER, FILE_TIERS

__all__ = ["HELP", "add_arguments", "run", "token_windows", "compare_logits", "evaluate", "summarize"]

HELP = "what a table format or an adapter costs in quality: perplexity and KL divergence, side by side"

DESCRIPTION = f"""\
{HELP}

The reference is CHECKPOINT as stored (its PLE tables in their own format, dequantized exactly).
Each format of --formats is the same model served from a copy of its tables in that format (made
once and reused, as from_pretrained(table_format=) makes it); --adapter adds the reference with an
adapter's trained rows on top; repeated, one row an adapter, the model loaded once (one adapter's row
is "adapter"; several are named by their files' stems, which must differ). The token stream is cut
into windows of --ctx tokens (the last incomplete one dropped); every position of a window but the
last predicts the next token.

Per variant: perplexity and mean negative log-likelihood; against the reference, per predicted
token: KL divergence of the next-token distributions (mean, median, 99th / 99.9th percentile, max),
the share of tokens whose most likely next token is the reference's ("same top"), and the change
of the actual next token's probability (dp); table bytes on disk, tokens/s and peak memory."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ple.data.tokens import add_token_arguments
    from ple.table.formats.catalog import accepted_names

    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("checkpoint", help="a qwen4_exp model folder (config.json + safetensors)")
    p.add_argument(
        "--formats",
        metavar="FORMATS",
        help=f"table formats to compare with the reference, separated by commas ({accepted_names()}; "
        "'fp8' on an fp8 checkpoint is the checkpoint's own format, on another fp8_row)",
    )
    p.add_argument(
        "--adapter",
        metavar="FILE",
        action="append",
        help="an adapter file (ple train): the reference with its rows on top; repeat it for several "
        "(one row each, named by the file's stem)",
    )
    add_token_arguments(p)
    p.add_argument(
        "--ctx", type=int_between(2, 1 << 20), default=512, help="tokens a window (512): ctx - 1 predictions each"
    )
    p.add_argument(
        "--tier",
        choices=FILE_TIERS,
        default=DEFAULT_TIER,
        help=f"where the tables are served from ({DEFAULT_TIER})",
    )
    p.add_argument(
        "--memory-budget",
        type=byte_size,
        metavar="SIZE",
        help="--tier direct: memory for each table's rows, with its unit: 64MiB, 1GiB "
        f"(default {shown_size(DEFAULT_MEMORY_BUDGET)})",
    )
    p.add_argument("--table-dir", help="where the table files and format copies live (default: from_pretrained's)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of the report")
    p.add_argument("--output", metavar="F", help="also write the JSON document to F")
    p.add_argument("--plot", metavar="PNG", help="draw perplexity and mean KL against bytes per row (matplotlib)")


# ---------------------------------------------------------------------------------------------- tokens


def parse_formats(text: str | None) -> list[str]:
    """``--formats`` as a list of formats (canonical names, :func:`~ple.table.formats.catalog.resolve_format`:
    "int8" is int8_row), each once."""
    from ple.table.formats.catalog import resolve_format

    if text is None:
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise CommandLineError(f"--formats {text!r}: no format names (expected e.g. q8_0,q4_0)")
    try:
        formats = [resolve_format(n, "--formats") for n in names]
    except InvalidArgumentError as e:
        raise CommandLineError(str(e)) from None
    dup = sorted({f for f in formats if formats.count(f) > 1})
    if dup:
        said = {f: [n for n in names if resolve_format(n) == f] for f in dup}
        shown = "; ".join(f"{f} ({', '.join(dict.fromkeys(said[f]))})" for f in dup)
        raise CommandLineError(f"--formats: {shown} named more than once")
    return formats


def token_windows(chunks: Iterable[np.ndarray], ctx: int) -> Iterator[np.ndarray]:
    """Non-overlapping windows ``[ctx]`` int64 of the concatenated ``chunks``, in order; the last
    incomplete window is dropped."""
    buf = np.empty(0, dtype=np.int64)
    for arr in chunks:
        buf = np.concatenate([buf, np.asarray(arr, dtype=np.int64).reshape(-1)])
        n = buf.size // ctx
        for k in range(n):
            yield buf[k * ctx : (k + 1) * ctx]
        buf = buf[n * ctx :].copy()


# ---------------------------------------------------------------------------------------------- comparison

_CHUNK_VALUES = 1 << 20
"""Values of the logits the PyTorch path handles at a time (4 MiB in float32; four predictions of a
248,320-id vocabulary): the passes over a chunk (log-softmax, top token, KL terms) run in cache; the
reference's log-probabilities are written into the window's array as they are made, a candidate's
never leave the chunk."""


def _rows(vocab: int) -> int:
    return max(1, _CHUNK_VALUES // vocab)


@dataclasses.dataclass
class Reference:
    """One window's reference, dropped with the window: its predictions' top tokens and actual tokens'
    probabilities, and what a candidate is compared with. The C kernel (``ple_eval.c``) keeps the
    logits themselves, their rows' maxima ``m`` and sums ``s`` of ``exp(logits - m)`` (float64): the
    distribution is ``exp(logits - m) / s``. The PyTorch path keeps the log-probabilities ``logp``."""

    top: torch.Tensor  # [P] int64
    p_actual: torch.Tensor  # [P] float64
    logp: torch.Tensor | None = None  # [P, V] float32 (PyTorch path)
    logits: torch.Tensor | None = None  # [P, V] as the model returned them (C kernel)
    m: torch.Tensor | None = None  # [P] float32
    s: torch.Tensor | None = None  # [P] float64


def _native_lib():
    """The C kernels' library, or None where they are off or unavailable (the PyTorch path then)."""
    from ple.kernels import native as _native

    return _native.library() if _native.available() else None


def _kernel_input(logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``logits`` as the C kernel reads them: (1 for bf16 else 0, contiguous bf16 or float32 rows)."""
    if logits.dtype not in (torch.bfloat16, torch.float32):
        logits = logits.float()
    return int(logits.dtype == torch.bfloat16), logits.contiguous()


def _checked_targets(targets: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    t = targets.to(torch.int64).contiguous()
    if t.shape != (logits.shape[0],):
        raise InvalidArgumentError(f"targets of shape {tuple(t.shape)} for logits of shape {tuple(logits.shape)}")
    return t


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _bad_target(t: torch.Tensor, vocab: int) -> InvalidArgumentError:
    bad = int(t[(t < 0) | (t >= vocab)][0])
    return InvalidArgumentError(
        f"target token id {bad} is outside the logits' vocabulary [0, {vocab}): give ids of the model's vocabulary"
    )


def reference_of(
    logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor | None = None, *, native: bool | None = None
) -> tuple[Reference, np.ndarray]:
    """The reference of a window's ``logits [P, V]`` and its per-prediction NLL (float64).
    ``native``: the C kernel (default: where the library is available; the reference then keeps
    ``logits``), or the PyTorch path (False). ``out``: for the PyTorch path, a float32 tensor of the
    logits' shape for the log-probabilities (one allocation reused window after window: a fresh one
    would be faulted in page by page each time)."""
    lib = _native_lib() if native is not False else None
    if native and lib is None:
        from ple.kernels.native import library

        library()  # raises NativeUnavailable with the reason
    n, vocab = logits.shape
    if lib is None:
        return _reference_torch(logits, targets, torch.empty(logits.shape, dtype=torch.float32) if out is None else out)
    from ple.kernels.native import threads_for

    bf, z = _kernel_input(logits)
    t = _checked_targets(targets, z)
    m = torch.empty(n, dtype=torch.float32)
    s = torch.empty(n, dtype=torch.float64)
    top = torch.empty(n, dtype=torch.int64)
    nll = torch.empty(n, dtype=torch.float64)
    rc = lib.ple_eval_reference(
        bf,
        _ptr(z),
        n,
        vocab,
        _ptr(t),
        _ptr(m),
        _ptr(s),
        _ptr(top),
        _ptr(nll),
        threads_for(n, 1, started_per_call=True),
    )
    if rc != 0:
        raise _bad_target(t, vocab)
    ref = Reference(top, (-nll).exp(), logits=z, m=m, s=s)
    return ref, nll.numpy()


def _in_vocabulary(targets: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``targets`` checked as the C path checks them (shape, every id in the logits' vocabulary)."""
    t = _checked_targets(targets, logits)
    vocab = logits.shape[1]
    if bool(((t < 0) | (t >= vocab)).any()):
        raise _bad_target(t, vocab)
    return t


def _reference_torch(logits: torch.Tensor, targets: torch.Tensor, logp: torch.Tensor) -> tuple[Reference, np.ndarray]:
    targets = _in_vocabulary(targets, logits)
    n = logits.shape[0]
    top = torch.empty(n, dtype=torch.int64)
    rows = _rows(logits.shape[1])
    for a in range(0, n, rows):
        b = min(a + rows, n)
        torch.log_softmax(logits[a:b], dim=-1, dtype=torch.float32, out=logp[a:b])
        top[a:b] = logp[a:b].argmax(-1)
    actual = logp.gather(1, targets[:, None])[:, 0]
    return Reference(top, actual.double().exp(), logp=logp), (-actual).double().numpy()


def compare_logits(ref: Reference, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, np.ndarray]:
    """Per prediction of a candidate's ``logits [P, V]`` against the reference: ``nll``; ``kld``,
    KL(reference || candidate) of the next-token distributions (float64; rounding below zero counted as
    zero); ``same_top`` (bool); ``delta_p``, the actual next token's probability, candidate minus
    reference. By the C kernel where the reference was made by it (two passes a row: see ``ple_eval.c``),
    else by PyTorch, a chunk at a time."""
    if ref.logits is None:
        return _compare_torch(ref, logits, targets)
    from ple.kernels.native import library, threads_for

    assert ref.m is not None and ref.s is not None
    if logits.shape != ref.logits.shape:
        raise InvalidArgumentError(
            f"candidate logits of shape {tuple(logits.shape)}, the reference's {tuple(ref.logits.shape)}"
        )
    n, vocab = logits.shape
    bf, z = _kernel_input(logits)
    t = _checked_targets(targets, z)
    top = torch.empty(n, dtype=torch.int64)
    nll = torch.empty(n, dtype=torch.float64)
    kld = torch.empty(n, dtype=torch.float64)
    rc = library().ple_eval_compare(
        int(ref.logits.dtype == torch.bfloat16), _ptr(ref.logits), bf, _ptr(z), n, vocab, _ptr(t), _ptr(ref.m),
        _ptr(ref.s), _ptr(top), _ptr(nll), _ptr(kld), threads_for(n, 1, started_per_call=True),
    )  # fmt: skip
    if rc != 0:
        raise _bad_target(t, vocab)
    return {
        "nll": nll.numpy(),
        "kld": kld.clamp_min(0).numpy(),
        "same_top": (top == ref.top).numpy(),
        "delta_p": ((-nll).exp() - ref.p_actual).numpy(),
    }


def _compare_torch(ref: Reference, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, np.ndarray]:
    assert ref.logp is not None
    targets = _in_vocabulary(targets, logits)
    n = logits.shape[0]
    kld = torch.empty(n, dtype=torch.float32)
    actual = torch.empty(n, dtype=torch.float32)
    top = torch.empty(n, dtype=torch.int64)
    rows = _rows(logits.shape[1])
    for a in range(0, n, rows):
        b = min(a + rows, n)
        lv = torch.log_softmax(logits[a:b], dim=-1, dtype=torch.float32)
        lr = ref.logp[a:b]
        kld[a:b] = (lr.exp() * (lr - lv)).sum(-1)
        actual[a:b] = lv.gather(1, targets[a:b, None])[:, 0]
        top[a:b] = lv.argmax(-1)
    return {
        "nll": (-actual).double().numpy(),
        "kld": kld.clamp_min(0).double().numpy(),
        "same_top": (top == ref.top).numpy(),
        "delta_p": (actual.double().exp() - ref.p_actual).numpy(),
    }


# ---------------------------------------------------------------------------------------------- variants


@dataclasses.dataclass
class Variant:
    """A model to evaluate: its tables per PLE layer (by PLE layer index) and what they cost on disk."""

    name: str
    format: str
    tables: dict[int, Any]
    bytes_per_row: int
    table_bytes: int
    owned: list[Any] = dataclasses.field(default_factory=list)  # tables to close at the end
    adapter_bytes: int | None = None
    nll: list[np.ndarray] = dataclasses.field(default_factory=list)
    kld: list[np.ndarray] = dataclasses.field(default_factory=list)
    same_top: list[np.ndarray] = dataclasses.field(default_factory=list)
    delta_p: list[np.ndarray] = dataclasses.field(default_factory=list)
    forward_s: float = 0.0
    compare_s: float = 0.0


def _row_bytes(fmt: str, head_dim: int) -> int:
    from ple.table import format_info

    info = format_info(fmt)
    return info.row_nbytes(head_dim) + (4 if info.scale_kind == "row" else 0)


def reference_variant(model) -> Variant:
    from ple.integrations.transformers import patched_layers

    layers = patched_layers(model)
    fmt = layers[0].layer.table.format
    return Variant(
        name="reference",
        format=fmt,
        tables={w.layer.ple_layer_index: w.layer.table for w in layers},
        bytes_per_row=_row_bytes(fmt, layers[0].layer.layout.head_dim),
        table_bytes=sum(w.table_path.stat().st_size for w in layers if w.table_path is not None),
    )


def format_variant(model, checkpoint: Path, fmt: str, table_dir: Path, tier: str, budget: int | None, show: bool):
    """The model's tables as a copy in format ``fmt`` (made once in ``table_dir``, reused)."""
    from ple.checkpoint import scan_checkpoint
    from ple.config import PLEConfig
    from ple.convert.folder import prepare_table, served_format
    from ple.integrations.transformers import patched_layers
    from ple.table.tiers.open import open_table

    config = PLEConfig.from_pretrained(checkpoint)
    entries = {e.ple_layer_index: e for e in scan_checkpoint(checkpoint, config).layers}
    want = {}
    for i, e in entries.items():
        try:
            want[i] = served_format(e, config, fmt)
        except InvalidArgumentError as err:
            raise CommandLineError(f"--formats {fmt}: {err}") from None
    v = Variant(fmt, next(iter(want.values())), {}, 0, 0)
    try:
        for w in patched_layers(model):
            i = w.layer.ple_layer_index
            prepared = prepare_table(entries[i], config, table_dir, progress=show, table_format=fmt)
            assert prepared.table is not None
            # served as from_pretrained serves the reference's tables: the same opener, options and device
            device = w.layer.key_proj.device
            table = open_table(prepared.table, tier, memory_budget=budget, device=device)
            v.owned.append(table)
            v.tables[i] = table
            v.table_bytes += prepared.path.stat().st_size
            v.bytes_per_row = _row_bytes(want[i], w.layer.layout.head_dim)
    except BaseException:
        for t in v.owned:
            t.close()
        raise
    return v


def adapter_names(files: list[str] | None, formats: list[str]) -> list[tuple[str, Path]]:
    """``--adapter``'s files, each with its variant's name: "adapter" for one, each file's stem for
    several (a stem given twice, or naming the reference or a format compared, is refused)."""
    paths = [Path(f) for f in files or []]
    if len(paths) == 1:
        return [("adapter", paths[0])]
    named: dict[str, Path] = {}
    for path in paths:
        if path.stem in named:
            raise CommandLineError(
                f"--adapter {named[path.stem]} and --adapter {path}: the same stem {path.stem!r}, which names "
                "each adapter's row (rename one)"
            )
        if path.stem == "reference" or path.stem in formats:
            row = "the reference" if path.stem == "reference" else "a format of --formats"
            raise CommandLineError(f"--adapter {path}: its stem {path.stem!r} is the name of {row}'s row (rename it)")
        named[path.stem] = path
    return list(named.items())


def check_adapter(path: Path, config, checkpoint: str) -> None:
    """``path`` is an adapter file whose layers fit ``checkpoint``'s tables (``config``: its PLE
    config); its header only: the rows are read and checked as it is loaded."""
    from ple.checkpoint.classify import ADAPTER, classify
    from ple.table.files.table_file import hash_layout
    from ple.train.adapter import AdapterFileError, check_layer_fits, read_adapter

    if not path.is_file():
        raise CommandLineError(f"--adapter {path}: no such file")
    if (given := classify(path)).kind != ADAPTER:
        raise CommandLineError(f"--adapter {path}: {given.what}, not an adapter file (ple train writes one)")
    n = len(config.ple_layer_ids)
    for i, e in sorted(read_adapter(path).layers.items()):
        if not 0 <= i < n:
            raise AdapterFileError(f"{path}: holds rows of PLE layer {i}; {checkpoint} has {n} PLE layer(s)")
        layout = config.layout(i)
        check_layer_fits(
            path, e, hash_layout(config.layout_fields(i)), layout.padded_rows, layout.head_dim, f"{checkpoint}'s"
        )


def adapter_variant(model, reference: Variant, adapter: Path, name: str = "adapter") -> Variant:
    """The reference's tables with ``adapter``'s rows on top (the model is left serving the reference)."""
    from ple.integrations.transformers import patched_layers
    from ple.train import load_adapter

    load_adapter(model, adapter)
    layers = patched_layers(model)
    tables = {w.layer.ple_layer_index: w.layer.table for w in layers}
    for w in layers:
        w.layer.set_table(reference.tables[w.layer.ple_layer_index])
    size = adapter.stat().st_size
    v = Variant(name, reference.format, tables, reference.bytes_per_row, reference.table_bytes + size)
    v.adapter_bytes = size
    v.owned = [t.overlay for t in tables.values() if hasattr(t, "overlay")]
    return v


def _install(model, v: Variant) -> None:
    from ple.integrations.transformers import patched_layers

    for w in patched_layers(model):
        w.layer.set_table(v.tables[w.layer.ple_layer_index])


# ---------------------------------------------------------------------------------------------- the run


def evaluate(model, variants: list[Variant], windows: Iterable[np.ndarray], *, bar=None) -> int:
    """Run every window through every variant (``variants[0]``: the reference), keeping per-token
    statistics in the variants; returns the number of windows. The model is left serving the reference."""
    count = 0
    buf: torch.Tensor | None = None  # the PyTorch path's log-probabilities, window after window
    native = _native_lib() is not None  # built or loaded before the first window, not within its timing
    try:
        with torch.inference_mode():
            for win in windows:
                ids = torch.from_numpy(np.ascontiguousarray(win)).view(1, -1)
                targets = ids[0, 1:]
                ref: Reference | None = None
                for v in variants:
                    _install(model, v)
                    t0 = time.perf_counter()
                    logits = model(input_ids=ids).logits[0, :-1]
                    t1 = time.perf_counter()
                    if ref is None:
                        if not native and (buf is None or buf.shape != logits.shape):
                            buf = torch.empty(logits.shape, dtype=torch.float32)
                        ref, nll = reference_of(logits, targets, buf)
                        v.nll.append(nll)
                    else:
                        c = compare_logits(ref, logits, targets)
                        v.nll.append(c["nll"])
                        v.kld.append(c["kld"])
                        v.same_top.append(c["same_top"])
                        v.delta_p.append(c["delta_p"])
                    del logits
                    v.forward_s += t1 - t0
                    v.compare_s += time.perf_counter() - t1
                del ref
                count += 1
                if bar is not None:
                    bar.update(1)
    finally:
        _install(model, variants[0])
    return count


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if x.size else float("nan")


def summarize(v: Variant) -> dict[str, Any]:
    """The JSON record of a variant (see the module docstring)."""
    nll = np.concatenate(v.nll) if v.nll else np.empty(0)
    mean = float(nll.mean()) if nll.size else float("nan")
    seconds = v.forward_s + v.compare_s
    out: dict[str, Any] = {
        "format": v.format,
        "ppl": math.exp(mean) if nll.size else float("nan"),
        "nll": mean,
        "bytes_per_row": v.bytes_per_row,
        "table_bytes": v.table_bytes,
        "tokens": int(nll.size),
        "tokens_per_s": nll.size / seconds if seconds > 0 else None,
        "forward_seconds": v.forward_s,
        "compare_seconds": v.compare_s,
    }
    if v.adapter_bytes is not None:
        out["adapter_bytes"] = v.adapter_bytes
    if v.kld:
        kld, dp = np.concatenate(v.kld), np.concatenate(v.delta_p)
        out.update(
            kld_mean=float(kld.mean()),
            kld_median=_pct(kld, 50),
            kld_p99=_pct(kld, 99),
            kld_p999=_pct(kld, 99.9),
            kld_max=float(kld.max()),
            same_top=float(np.concatenate(v.same_top).mean()),
            delta_p_mean=float(dp.mean()),
            delta_p_p1=_pct(dp, 1),
            delta_p_p5=_pct(dp, 5),
            delta_p_median=_pct(dp, 50),
            delta_p_p95=_pct(dp, 95),
            delta_p_p99=_pct(dp, 99),
        )
    return out


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def run(args: argparse.Namespace) -> int:
    """``ple eval``; returns the exit status."""
    from ple.checkpoint.classify import CHECKPOINT, OTHER, TRAINING, classify
    from ple.data.tokens import read_tokens
    from ple.integrations.qwen4_exp import require_transformers

    formats = parse_formats(args.formats)
    if args.memory_budget is not None and args.tier != "direct":
        raise CommandLineError(f"--memory-budget is for --tier direct, not --tier {args.tier}")
    if args.plot and not _has_matplotlib():
        raise CommandLineError(f"--plot {args.plot}: drawing needs matplotlib (pip install matplotlib)")
    adapters = adapter_names(args.adapter, formats)
    info = classify(args.checkpoint)
    if info.kind in (TRAINING, OTHER):  # how to load a training checkpoint; why a path is no model
        raise info.refusal("a model folder")
    cfg = info.config
    if info.kind != CHECKPOINT or cfg is None or not info.path.is_dir():
        raise CommandLineError(
            f"{args.checkpoint}: not a model folder with weights (config.json + safetensors): {info.what}"
        )
    for _, path in adapters:
        check_adapter(path, cfg, args.checkpoint)
    from ple.commands.report import check_destinations

    named = (args.checkpoint, args.table_dir, *(args.adapter or []), args.tokens, args.text)
    inputs = [p for p in named if p is not None]
    check_destinations([("--output", args.output), ("--plot", args.plot)], inputs)
    if args.real_text is not None and args.real_text < args.ctx:
        raise CommandLineError(f"--real-text {args.real_text} is fewer tokens than one window (--ctx {args.ctx})")
    require_transformers()
    from ple.convert.folder import default_table_dir

    root = Path(args.checkpoint)
    show = sys.stderr.isatty()
    budget = args.memory_budget
    table_dir = Path(args.table_dir) if args.table_dir else default_table_dir(root)
    t0 = time.perf_counter()
    model = _load(root, table_dir, args.tier, budget, show)
    variants = [reference_variant(model)]
    try:
        for fmt in formats:
            variants.append(format_variant(model, root, fmt, table_dir, args.tier, budget, show))
        for name, path in adapters:
            variants.append(adapter_variant(model, variants[0], path, name))
        load_s = time.perf_counter() - t0
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(unit="window", desc="ple eval", file=sys.stderr)
        t1 = time.perf_counter()
        try:
            read = [0]  # tokens of the stream, for the message when it holds no window

            def counted(chunks):
                for arr in chunks:
                    read[0] += len(arr)
                    yield arr

            chunks = counted(read_tokens(args, cfg.vocab_size, cfg.eos_token_id))
            windows = evaluate(model, variants, token_windows(chunks, args.ctx), bar=bar)
        finally:
            if bar is not None:
                bar.close()
        if windows == 0:
            raise CommandLineError(
                f"--ctx {args.ctx}: the token stream holds {read[0]} tokens, fewer than one window of {args.ctx}"
            )
        doc = _document(args, variants, windows, load_s, time.perf_counter() - t1)
    finally:
        for v in variants[1:]:
            for t in v.owned:
                t.close()
    text = json.dumps(doc, indent=1)
    if args.json:  # the report first: a file that fails to be written below loses nothing
        print(text)
    else:
        print_report(doc)
    sys.stdout.flush()
    if args.output:
        from ple.common.files import write_atomically

        write_atomically(args.output, (text + "\n").encode())
    if args.plot:
        plot(doc, Path(args.plot), f"ple eval: {root.name}, {doc['predictions']:,} predictions, ctx {args.ctx}")
    return 0


def _load(root: Path, table_dir: Path, tier: str, budget: int | None, show: bool):
    """The reference model (transformers' own messages and bars quiet unless stderr is a terminal)."""
    from transformers.utils import logging as hf_logging

    from ple.integrations.transformers import from_pretrained

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not show:
        hf_logging.disable_progress_bar()
    try:
        return from_pretrained(root, table_dir=table_dir, table_tier=tier, memory_budget=budget, progress=show).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _document(args, variants: list[Variant], windows: int, load_s: float, eval_s: float) -> dict[str, Any]:
    from ple.data.tokens import token_source

    ref = summarize(variants[0])
    return {
        "checkpoint": str(args.checkpoint),
        "source": token_source(args).describe(),
        "ctx": args.ctx,
        "windows": windows,
        "predictions": windows * (args.ctx - 1),
        "tier": args.tier,
        "reference": ref,
        "variants": {v.name: summarize(v) for v in variants[1:]},
        "load_seconds": load_s,
        "eval_seconds": eval_s,
        "peak_rss_bytes": _peak_rss(),
    }


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_report(doc: dict[str, Any]) -> None:
    """One row per variant (the reference first)."""
    print(
        f"{doc['windows']} windows of {doc['ctx']} tokens, {doc['predictions']:,} predictions; tables served from "
        f"{doc['tier']}; peak RSS {doc['peak_rss_bytes'] / 1e6:,.0f} MB"
    )
    rows = [("reference", doc["reference"])] + list(doc["variants"].items())
    w = max(10, *(len(name) for name, _ in rows))  # the names of several adapters are their files' stems
    head = (
        f"{'variant':<{w}} {'format':<9} {'B/row':>6} {'table MB':>9} {'ppl':>9} {'nll':>7} {'KLD mean':>9} "
        f"{'median':>9} {'p99':>8} {'p99.9':>8} {'max':>8} {'same top':>8} {'dp mean':>8} {'dp p1':>8} "
        f"{'dp p99':>8} {'tok/s':>8}"
    )
    print(head)
    for name, r in rows:
        print(
            f"{name:<{w}} {r['format']:<9} {r['bytes_per_row']:6d} {r['table_bytes'] / 1e6:9.2f} {r['ppl']:9.3f} "
            f"{r['nll']:7.4f} {_f(r.get('kld_mean'), '9.3g'):>9} {_f(r.get('kld_median'), '9.3g'):>9} "
            f"{_f(r.get('kld_p99'), '8.3g'):>8} {_f(r.get('kld_p999'), '8.3g'):>8} {_f(r.get('kld_max'), '8.3g'):>8} "
            f"{_f(r.get('same_top'), '8.2%'):>8} {_f(r.get('delta_p_mean'), '+8.4f'):>8} "
            f"{_f(r.get('delta_p_p1'), '+8.4f'):>8} {_f(r.get('delta_p_p99'), '+8.4f'):>8} "
            f"{_f(r.get('tokens_per_s'), '8.0f'):>8}"
        )


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def plot(doc: dict[str, Any], path: Path, title: str) -> None:
    """Perplexity and mean KL divergence against table bytes per row, one point per variant."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ple.common.files import write_atomically

    ref = doc["reference"]
    formats = [(k, r) for k, r in doc["variants"].items() if "adapter_bytes" not in r]
    adapters = [(k, r) for k, r in doc["variants"].items() if "adapter_bytes" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    a.plot(ref["bytes_per_row"], ref["ppl"], "o", color="#d62728")
    a.annotate(f"reference ({ref['format']})", (ref["bytes_per_row"], ref["ppl"]), fontsize=7, xytext=(3, 3),
               textcoords="offset points")  # fmt: skip
    for axes, key in ((a, "ppl"), (b, "kld_mean")):
        seen: dict[int, int] = {}  # points of the same size: labels right, left, right, ...
        for r in sorted((r for _, r in formats), key=lambda r: -r[key]):
            y = max(r[key], 1e-12)
            k = seen[r["bytes_per_row"]] = seen.get(r["bytes_per_row"], -1) + 1
            axes.plot(r["bytes_per_row"], y, "o", color="#1f77b4")
            axes.annotate(r["format"], (r["bytes_per_row"], y), fontsize=7, xytext=(-5 if k % 2 else 5, -3),
                          textcoords="offset points", ha="right" if k % 2 else "left")  # fmt: skip
    for name, r in adapters:  # their perplexities in the legend (a fine-tune moves them off the formats' scale)
        label = "the adapter" if len(adapters) == 1 else name
        a.plot([], [], "*", color="#2ca02c", label=f"with {label}: {r['ppl']:.3f}")
        k = max(r["kld_mean"], 1e-12)
        b.plot(r["bytes_per_row"], k, "*", color="#2ca02c", markersize=9)
        b.annotate(name, (r["bytes_per_row"], k), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if adapters:
        a.legend(fontsize=7)
    a.axhline(doc["reference"]["ppl"], color="#d62728", linewidth=0.5)
    a.set_xlabel("table bytes per row")
    a.set_ylabel("perplexity")
    a.ticklabel_format(axis="y", useOffset=False)
    b.set_xlabel("table bytes per row")
    b.set_ylabel("mean KL divergence to the reference (nats)")
    b.set_yscale("log")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomically(path, buf.getvalue())
