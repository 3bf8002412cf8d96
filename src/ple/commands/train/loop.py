"""The fine-tune behind ``ple train``: the demo's model loaded with its tables on disk, trained on real text.

:func:`finetune` loads the model with :func:`ple.integrations.transformers.from_pretrained` (tables
memory-mapped, read directly or behind a row cache, in the checkpoint's fp8 or another format),
makes its tables trainable (:func:`ple.train.trainable`), and trains with ple's row-sparse optimizer
for the tables and ``torch.optim.AdamW`` for the other weights (``CombinedOptimizer``), on its token
input (:mod:`ple.data.tokens`; by default real text), measuring the held-out loss (the stream's last
``HELD_OUT_WINDOWS`` windows) as it goes. The trained rows are saved as an adapter
file; the table files are hashed before and after (they are never written). With a process group
(``ple train --ranks N``) every rank's tables are sharded (replicated ids: every rank the same
batches) and the adapter is gathered to rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ple.errors import InvalidArgumentError
from ple.table.tiers.open import DEFAULT_TIER

__all__ = [
    "Options",
    "OPTIMIZERS",
    "LOSS_WINDOW",
    "HELD_OUT_WINDOWS",
    "default_tokens",
    "check_stream_length",
    "token_streams",
    "quiet_transformers",
    "finetune",
    "prepare_checkpoint",
    "plot_losses",
]

OPTIMIZERS = ("sparse_adam", "adamw", "adagrad", "rowwise_adagrad", "sgd")
LOSS_WINDOW = 5
"""Steps averaged at each end of the run for the training-loss check (which needs twice as many)."""
HELD_OUT_WINDOWS = 8
"""Windows of ``length`` tokens held out: the last tokens of the stream, never trained on."""


@dataclasses.dataclass
class Options:
    """What ``ple train`` runs (see its ``--help``)."""

    size: str = "quick"
    steps: int = 40
    batch: int = 4
    length: int = 32
    tier: str = DEFAULT_TIER
    table_format: str | None = None
    optimizer: str = "sparse_adam"
    lr: float = 0.05
    rest_lr: float = 3e-3
    tables_only: bool = False
    fused: bool = False
    eval_every: int = 10
    seed: int = 0
    memory_budget: int | None = None
    # the token input (ple.data.tokens), at most one; none: --real-text default_tokens(options)
    tokens: str | None = None
    text: str | None = None
    real_text: int | None = None


def default_tokens(opts: Options) -> int:
    """The tokens of real text ``ple train`` reads without a token input: a batch for every step, then
    the held-out windows (their map is made from the training part, see :mod:`ple.data.tokens`)."""
    return (opts.steps * opts.batch + HELD_OUT_WINDOWS) * opts.length


def check_stream_length(n: int, opts: Options) -> None:
    """Refuse a token stream of ``n`` tokens too short for ``opts``: the held-out windows, and a batch
    of windows to train on before them."""
    from ple.data.tokens import token_source
    from ple.errors import CommandLineError

    held = HELD_OUT_WINDOWS * opts.length
    need = held + opts.batch * opts.length
    if n < need:
        raise CommandLineError(
            f"{token_source(opts, default_tokens(opts))}: {n:,} tokens; ple train holds out the last "
            f"{HELD_OUT_WINDOWS} x --length {opts.length} = {held:,} and trains on the rest, which must hold "
            f"--batch {opts.batch} windows of --length {opts.length}: give at least {need:,} tokens"
        )


def token_streams(opts: Options, vocab_size: int, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held_out)`` int64 model ids: the token input less its last ``HELD_OUT_WINDOWS``
    windows, and those (:func:`ple.data.tokens.read_tokens`; a small vocabulary's map is made from the
    training part)."""
    from ple.data.tokens import read_tokens

    held = HELD_OUT_WINDOWS * opts.length
    chunks = read_tokens(opts, vocab_size, eos, held_out=held, real_text_default=default_tokens(opts))
    stream = np.concatenate(list(chunks))
    check_stream_length(stream.size, opts)
    return torch.from_numpy(stream[:-held]), torch.from_numpy(stream[-held:])


@contextlib.contextmanager
def quiet_transformers(progress: bool) -> Iterator[None]:
    """transformers' log at errors only (its warnings that it runs its PyTorch reference code on the CPU
    would fill the report: ``ple train`` says it once), its progress bars only with ``progress``."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def prepare_checkpoint(work: Path, size: str, seed: int) -> Path:
    """The demo's model saved in the published layout (fp8 tables) in ``work/published``, made once."""
    from ple.integrations.demo_model import MODEL_SIZES, build_model, save_published

    out = work / "published"
    if (out / "config.json").exists():
        return out
    model = build_model(MODEL_SIZES[size], seed)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        save_published(model, out)
    finally:
        hf_logging.set_verbosity(verbosity)
    return out


def _table_files(model) -> list[Path]:
    from ple.integrations.transformers import patched_layers

    return [w.table_path for w in patched_layers(model) if w.table_path is not None]


def _sha(paths: list[Path]) -> list[str]:
    out = []
    for p in paths:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        out.append(h.hexdigest())
    return out


def _table_optimizer(name: str, handles, lr: float, **kw):
    from ple import train

    cls = {
        "sparse_adam": train.SparseAdam,
        "adamw": train.AdamW,
        "adagrad": train.Adagrad,
        "rowwise_adagrad": train.RowWiseAdagrad,
        "sgd": train.SGD,
    }.get(name)
    if cls is None:
        raise InvalidArgumentError(f"optimizer must be one of {list(OPTIMIZERS)}, got {name!r}")
    return cls(handles, lr=lr, **kw)


def finetune(
    published: Path,
    table_dir: Path,
    adapter: Path,
    opts: Options,
    *,
    sharded: bool = False,
    say: Callable[[str], None] = lambda s: None,
    progress: bool = False,
) -> dict[str, Any]:
    """Fine-tune the checkpoint ``published`` with its table files in ``table_dir`` (made there once),
    saving the trained rows to ``adapter`` (see the module docstring); returns the report."""
    from ple.commands.train.batches import windows
    from ple.integrations.transformers import from_pretrained, patched_layers
    from ple.train import CombinedOptimizer, save_adapter, save_sharded_adapter, trainable

    torch.manual_seed(opts.seed)
    t0 = time.perf_counter()
    model = from_pretrained(
        published,
        table_dir=table_dir,
        table_tier=opts.tier,
        table_format=opts.table_format,
        progress=progress,
    )
    files = _table_files(model)
    if sharded:
        from ple.table.tiers.open import open_table

        for w in patched_layers(model):
            old = w.layer.table
            assert w.table_path is not None and old is not None
            fields = w.layer.config.layout_fields(w.layer.ple_layer_index)
            w.layer.set_table(open_table(w.table_path, "sharded", expected_layout_hash=fields, ids="replicated"))
            old.close()
    before = _sha(files)
    cfg = model.config
    train_ids, held_ids = token_streams(opts, cfg.vocab_size, cfg.eos_token_id)
    held = windows(held_ids, HELD_OUT_WINDOWS, opts.length, 0)
    handles = trainable(model, memory_budget=opts.memory_budget)
    table_opt = _table_optimizer(opts.optimizer, handles, opts.lr, fused=opts.fused, memory_budget=opts.memory_budget)
    if opts.tables_only:
        model.requires_grad_(False)
        opt: torch.optim.Optimizer = table_opt
    else:
        opt = CombinedOptimizer(table_opt, torch.optim.AdamW(model.parameters(), lr=opts.rest_lr))
    model.train()

    def held_out() -> float:
        with torch.no_grad():
            return float(model(input_ids=held, labels=held).loss)

    losses: list[float] = []
    evals: list[tuple[int, float]] = [(0, held_out())]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=opts.steps, unit="step", desc="ple train")
    t_train = time.perf_counter()
    for step in range(opts.steps):
        ids = windows(train_ids, opts.batch, opts.length, step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if (step + 1) % opts.eval_every == 0 or step + 1 == opts.steps:
            evals.append((step + 1, held_out()))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    if bar is not None:
        bar.close()
    train_s = time.perf_counter() - t_train
    if sharded:
        save_sharded_adapter(adapter, model, optimizer=table_opt, meta={"steps": opts.steps})
    else:
        save_adapter(adapter, model, optimizer=table_opt, meta={"steps": opts.steps})
    trained = []
    for w in patched_layers(model):
        table = w.layer.table
        local = getattr(table, "local_table", table)
        trained.append(len(local.overlay))
    tables = [(w.layer.table.rows, w.layer.table.head_dim, w.layer.table.format) for w in patched_layers(model)]
    after = _sha(files)
    tokens = opts.steps * opts.batch * opts.length
    # the training loss of a step is one batch's: noisy, so the first and the last LOSS_WINDOW steps are
    # compared, and only when they are different steps (the held-out loss is compared in every run)
    compared = len(losses) >= 2 * LOSS_WINDOW
    first = sum(losses[:LOSS_WINDOW]) / LOSS_WINDOW if compared else None
    last = sum(losses[-LOSS_WINDOW:]) / LOSS_WINDOW if compared else None
    return {
        "options": dataclasses.asdict(opts),
        "tables": tables,
        "table_files": [str(p) for p in files],
        "tables_untouched": before == after,
        "losses": losses,
        "held_out": evals,
        "loss_first": first,
        "loss_last": last,
        "trained_rows": trained,
        "lookups": [tokens * w.layer.layout.num_heads for w in patched_layers(model)],
        "tokens": tokens,
        "adapter": str(adapter) if adapter.exists() else None,
        "adapter_bytes": adapter.stat().st_size if adapter.exists() else None,
        "seconds_per_step": train_s / opts.steps,
        "wall_seconds": time.perf_counter() - t0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        * (1 if sys.platform == "darwin" else 1024),
        "table_optimizer": type(table_opt).__name__,
    }


def plot_losses(report: dict[str, Any], path: Path, title: str) -> bool:
    """A PNG of the training loss per step and the held-out loss; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    losses = report["losses"]
    ax.plot(range(1, len(losses) + 1), losses, label="training batch", color="#1f77b4", linewidth=1)
    steps, held = zip(*report["held_out"], strict=True)
    ax.plot(steps, held, "o-", label="held-out text", color="#d62728")
    ranks = report.get("ranks")
    if ranks:
        ax.plot(range(1, len(ranks["losses"]) + 1), ranks["losses"], "--", color="#2ca02c", linewidth=1,
                label=f"{ranks['ranks']} ranks, table sharded")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
