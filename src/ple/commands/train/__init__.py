"""``ple train``: fine-tune a model's PLE tables where they live, end to end, with its loss curve.

The demo's model (:mod:`ple.integrations.demo_model`: a random-weight ``qwen4_exp`` model whose fp8 tables
dominate, saved in the published layout) is loaded with ``from_pretrained`` with its tables on disk
and trained on its token input (:mod:`ple.data.tokens`: real text by default) with ple's row-sparse
optimizer for the tables and AdamW for the other weights (:mod:`.loop`). The report gives the training and held-out losses, the rows
trained, the adapter file written, whether the table files stayed untouched, peak memory and time;
``--plot`` draws the loss curve. ``--ranks N`` also runs the fine-tune on N processes with the
tables sharded across them and checks the trained rows are bit-identical to one process's.
``ple train --merge TABLE ADAPTER OUT`` writes an adapter's rows into a table file instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ple.common.argtypes import byte_size, int_between, non_negative_int, positive_float
from ple.errors import UsageError

__all__ = ["HELP", "add_arguments", "run"]

HELP = "fine-tune a model's PLE tables from disk on real text, with its loss curve; merge adapters"

DESCRIPTION = f"""\
{HELP}

Builds the demo's qwen4_exp model (random weights; fp8 tables in the published layout), loads it
with ple.integrations.transformers.from_pretrained with its tables on disk (--tier, --table-format)
and trains it: a row-sparse optimizer for the tables (--optimizer), AdamW for the other weights.
Its text is the token input (--tokens FILE, --text FILE or --real-text N, read as ple eval, ple stats
and ple demo read them; README 'Token input'), by default --real-text (steps x batch + 8) x length:
the stream's last 8 x length tokens are held out, the rest cut into windows of --length tokens, a
batch of them a step (cycling through them); text reaches the demo model's 1,024 ids through a map
made from the training part. It reports the training and held-out losses, the rows trained, the
adapter file written (the trained rows and the optimizer's state) and that the table files were
never written; the exit status is 1 when one of these checks fails. A step's training loss is one
batch's: the first and the last 5 steps are compared from 10 steps on; the held-out loss, before and
after training, in every run.

Needs transformers, and tiktoken with dashscope for text (the Qwen vocabulary ships in
dashscope); the loss plot needs matplotlib: pip install 'ple[train]' installs them all (and
accelerate, which transformers' Trainer needs for your own fine-tunes).

Without --workdir everything goes to a temporary folder, removed at the end. With it (an empty or
new folder: a folder holding anything is refused, nothing is reused), WORKDIR keeps published/
(the checkpoint), tables/ (one table file per PLE layer), adapter.safetensors and loss.png; serve
the adapter with from_pretrained(WORKDIR/published, table_dir=WORKDIR/tables,
table_adapter=WORKDIR/adapter.safetensors), measure it with ple eval WORKDIR/published --table-dir
WORKDIR/tables --adapter WORKDIR/adapter.safetensors --real-text N (N: the steps x batch x length
tokens it trained on, mapped as it mapped them), or write it into a table file with --merge."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ple.commands.report import add_format_argument
    from ple.commands.train.loop import OPTIMIZERS
    from ple.data.tokens import add_token_arguments
    from ple.table.tiers.open import DEFAULT_TIER, FILE_TIERS

    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter

    p.add_argument("--size", choices=["quick", "default"], default="quick", help="the demo model's table size (quick)")
    p.add_argument("--steps", type=int_between(1, 100_000), default=40, help="training steps (40)")
    p.add_argument("--batch", type=int_between(1, 4096), default=4, help="sequences a step (4)")
    p.add_argument("--length", type=int_between(4, 1 << 16), default=32, help="tokens a sequence (32)")
    add_token_arguments(p, required=False)
    p.add_argument(
        "--tier", choices=FILE_TIERS, default=DEFAULT_TIER, help=f"where the tables are served from ({DEFAULT_TIER})"
    )
    add_format_argument(
        p,
        "--table-format",
        "train over a copy of the tables in this format ({names}; default: the checkpoint's, fp8)",
    )
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sparse_adam", help="the tables' optimizer (sparse_adam)")
    p.add_argument("--lr", type=positive_float, default=0.05, help="the tables' learning rate (0.05)")
    p.add_argument("--rest-lr", type=positive_float, default=3e-3, help="AdamW's for the other weights (0.003)")
    p.add_argument("--tables-only", action="store_true", help="train the tables alone (the rest frozen)")
    p.add_argument("--fused", action="store_true", help="apply the tables' updates inside the backward")
    p.add_argument(
        "--memory-budget",
        type=byte_size,
        metavar="SIZE",
        help="per table: trained rows, and optimizer states, kept in memory (the recently used), a size with "
        "its unit (64KiB, 16MiB, 1GiB, 512MB); the rest spill to unnamed files beside the table files "
        "(default: all in memory)",
    )
    p.add_argument(
        "--ranks", type=int_between(1, 64), default=1, help="also train with the tables sharded over N ranks"
    )
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--plot", metavar="PNG", help="draw the loss curve here (default: WORKDIR/loss.png with --workdir)")
    p.add_argument(
        "--workdir", help="keep the checkpoint, table files, adapter and loss plot here (an empty or new folder)"
    )
    p.add_argument("--merge", nargs=3, metavar=("TABLE", "ADAPTER", "OUT"), help="merge an adapter into a table file")
    p.add_argument("--force", action="store_true", help="--merge: replace OUT")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of the report")


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _check_real_text() -> None:
    from ple.data.realtext import RealTextError, tokenizer

    try:
        tokenizer()
    except RealTextError as e:
        raise RealTextError(f"{e}. ple train fine-tunes on real text: pip install 'ple[train]'") from e


def _say(msg: str) -> None:
    print(f"ple train: {msg}", file=sys.stderr, flush=True)


def _merge(args) -> int:
    import os

    from ple.table import read_table_header
    from ple.train import merge_table_file

    table, adapter, out = args.merge
    exists = f"{out} exists: pass --force to replace it"
    if os.path.lexists(out) and not args.force:
        raise FileExistsError(exists)
    try:
        path = merge_table_file(table, adapter, out, force=args.force, progress=sys.stderr.isatty())
    except FileExistsError as e:  # another process made it meanwhile
        raise FileExistsError(exists) from e
    record = read_table_header(path)["merged"]
    if args.json:
        print(json.dumps({"merged": str(path), **record}))
        return 0
    rows, layer = record["trained_rows"], record["ple_layer_index"]
    print(
        f"merged {adapter}'s PLE layer {layer} ({rows:,} trained row{'s' * (rows != 1)}) into {path}: a copy of "
        f"{table} ({record['into']['format']}) with those rows requantized"
    )
    if record["trained_over"] is None:
        print("note: the adapter does not record the table it was trained over (not a table file): not checked")
    return 0


def run(args) -> int:
    """``ple train``; returns the exit status (1 when a check fails)."""
    if args.merge:
        return _merge(args)
    from ple.commands.report import check_destinations

    inputs = [p for p in (getattr(args, "tokens", None), getattr(args, "text", None)) if p is not None]
    check_destinations([("--plot", args.plot)], inputs)
    from ple.commands.train.loop import (
        LOSS_WINDOW,
        Options,
        check_stream_length,
        finetune,
        plot_losses,
        prepare_checkpoint,
        quiet_transformers,
    )
    from ple.integrations.demo_model import new_workdir
    from ple.integrations.qwen4_exp import require_transformers

    # what the run needs, before anything runs
    require_transformers(extra="train")
    if args.tokens is None:
        _check_real_text()
    if args.plot and not _has_matplotlib():
        raise UsageError(f"--plot {args.plot}: drawing the loss curve needs matplotlib (pip install 'ple[train]')")
    opts = Options(
        size=args.size,
        steps=args.steps,
        batch=args.batch,
        length=args.length,
        tier=args.tier,
        table_format=args.table_format,
        optimizer=args.optimizer,
        lr=args.lr,
        rest_lr=args.rest_lr,
        tables_only=args.tables_only,
        fused=args.fused,
        seed=args.seed,
        memory_budget=args.memory_budget,
        eval_every=max(1, args.steps // 8),
        tokens=args.tokens,
        text=args.text,
        real_text=args.real_text,
    )
    if args.real_text is not None:
        check_stream_length(args.real_text, opts)
    import torch

    tmp = None
    if args.workdir:
        keeps = "the checkpoint (published/), the table files (tables/), adapter.safetensors and loss.png"
        work = new_workdir(args.workdir, "ple train", keeps)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="ple-train-")
        work = Path(tmp.name)
    threads = torch.get_num_threads()
    try:
        # the demo model is tiny (hidden 64): one thread (more only add synchronization), the ranks' too,
        # so one process and the ranks run the same GEMMs and get the same bits
        torch.set_num_threads(1)
        progress = sys.stderr.isatty()
        _say("building the demo model in the published layout ...")
        with quiet_transformers(progress):
            published = prepare_checkpoint(work, args.size, args.seed)
        _say(f"fine-tuning its tables from disk ({args.tier}) on {_text(opts)}, {_steps(args.steps)} ...")
        _say(
            "(its linear-attention layers run transformers' PyTorch reference code: correct, and slower than "
            "the CUDA kernels transformers uses where they are installed)"
        )
        with quiet_transformers(progress):
            report = finetune(
                published, work / "tables", work / "adapter.safetensors", opts, say=_say, progress=progress
            )
        checks = {}
        if report["loss_first"] is not None:  # the first and last steps are different steps
            checks["loss_fell"] = report["loss_last"] < report["loss_first"]
        else:
            _say(f"the training loss is compared from {2 * LOSS_WINDOW} steps on (the first and last {LOSS_WINDOW})")
        checks["held_out_loss_fell"] = report["held_out"][-1][1] < report["held_out"][0][1]
        checks["tables_untouched"] = report["tables_untouched"]
        if args.ranks > 1:
            report["ranks"] = _ranked(args.ranks, published, work, opts)
            checks["ranks_bit_identical"] = report["ranks"]["identical"]
        plot = args.plot or (str(work / "loss.png") if args.workdir and _has_matplotlib() else None)
        if args.workdir and not plot:
            _say("no loss plot: matplotlib is not installed (pip install 'ple[train]')")
        if plot:
            title = (
                f"ple train: demo model ({args.size}), tables {report['tables'][0][2]} on {args.tier}, {_text(opts)}"
            )
            report["plot"] = plot if plot_losses(report, Path(plot), title) else None
        report["checks"] = checks
        report["ok"] = all(checks.values())
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            _print(report, args)
        return 0 if report["ok"] else 1
    finally:
        torch.set_num_threads(threads)
        if tmp is not None:
            tmp.cleanup()


def _ranked(ranks: int, published: Path, work: Path, opts) -> dict[str, Any]:
    """The same fine-tune on ``ranks`` processes, tables sharded; compared with the one-process run."""
    import torch

    from ple.errors import PLEError
    from ple.parallel import spawn_local
    from ple.train import read_adapter

    _say(f"the same fine-tune on {ranks} ranks, each table sharded across them ...")
    folder = work / f"ranks{ranks}"
    folder.mkdir(exist_ok=True)
    report = folder / "report.json"
    adapter = folder / "adapter.safetensors"
    argv = [
        sys.executable, "-m", "ple.commands.train.worker", str(published), str(work / "tables"), str(adapter), str(report),
        json.dumps(dataclasses.asdict(opts)),
    ]  # fmt: skip
    t0 = time.perf_counter()
    res = spawn_local(argv, ranks, deadline_s=3600, grace_s=30, capture=True)
    if not res.ok:
        tail = "\n".join(o[-2000:] for o in res.outputs)
        raise PLEError(f"the {ranks} ranks failed (exit statuses {res.returncodes}):\n{tail}")
    doc = json.loads(report.read_text())
    one, many = read_adapter(work / "adapter.safetensors"), read_adapter(adapter)
    identical = sorted(one.layers) == sorted(many.layers)
    for i in one.layers if identical else ():
        for (ia, ra), (ib, rb) in zip(one.chunks(i), many.chunks(i), strict=False):
            identical = identical and torch.equal(ia, ib) and torch.equal(ra, rb)
        identical = identical and one.layers[i].trained_rows == many.layers[i].trained_rows
    return {
        "ranks": ranks,
        "losses": doc["losses"],
        "held_out": doc["held_out"],
        "identical": bool(identical),
        "seconds": time.perf_counter() - t0,
        "adapter": str(adapter),
    }


def _print(r: dict[str, Any], args) -> None:
    o = r["options"]
    print("== ple train: the demo model's PLE tables fine-tuned from disk ==")
    print(f"model      : qwen4_exp demo ({o['size']}), {_tables(r['tables'])}, tier {o['tier']}")
    print(f"text       : {_text(o)}, {_steps(o['steps'])} x {o['batch']} x {o['length']} tokens ({r['tokens']:,})")
    rest = "the rest frozen" if o["tables_only"] else f"AdamW lr {o['rest_lr']} for the other weights"
    print(f"optimizers : {r['table_optimizer']} lr {o['lr']} for the tables{' (fused)' if o['fused'] else ''}; {rest}")
    if r["loss_first"] is not None:
        training = f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} (the first / last 5 steps)"
    else:
        n = len(r["losses"])
        training = f"{sum(r['losses']) / n:.3f}, the mean of {_steps(n)} (the first and last 5 compared from 10 on)"
    print(f"loss       : training {training}; held-out {r['held_out'][0][1]:.3f} -> {r['held_out'][-1][1]:.3f}")
    print(f"rows       : {_rows_trained(r['trained_rows'], r['lookups'])}")
    where = r["adapter"] if args.workdir else "in the temporary folder, removed at the end (--workdir keeps it)"
    print(f"adapter    : {where}, {r['adapter_bytes'] / 1e6:.2f} MB (the trained rows and the optimizer's state)")
    print(
        f"tables     : {'untouched' if r['tables_untouched'] else 'CHANGED'} ({len(r['table_files'])} files hashed before and after)"
    )
    print(f"memory     : peak RSS {r['peak_rss_bytes'] / 1e6:,.0f} MB")
    print(f"time       : {r['seconds_per_step']:.2f} s a step, {r['wall_seconds']:.1f} s in all")
    if "ranks" in r:
        k = r["ranks"]
        print(f"ranks      : {k['ranks']} processes, tables sharded: trained rows "
              f"{'bit-identical to' if k['identical'] else 'DIFFERENT from'} one process's ({k['seconds']:.1f} s)")  # fmt: skip
    if r.get("plot"):
        print(f"plot       : {r['plot']}")
    failed = [k for k, v in r["checks"].items() if not v]
    print(f"checks     : {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)} ({len(r['checks'])} checks)")


def _text(o) -> str:
    """What ``ple train`` trains on: ``real text``, ``the first 4,096 tokens of real text``, ``token file F``."""
    o = o if isinstance(o, dict) else dataclasses.asdict(o)
    if o["tokens"] is not None:
        return f"token file {o['tokens']}"
    if o["text"] is not None:
        return f"text file {o['text']}"
    return "real text" if o["real_text"] is None else f"the first {o['real_text']:,} tokens of real text"


def _steps(n: int) -> str:
    return f"{n:,} step{'s' * (n != 1)}"


def _tables(tables: list) -> str:
    """``2 PLE tables of 120,192 and 120,320 rows x 32 (fp8)``: each table's rows, once each width and format."""
    rows = [f"{t[0]:,}" for t in tables]
    widths, formats = sorted({t[1] for t in tables}), sorted({t[2] for t in tables})
    listed = rows[0] if len(rows) == 1 else ", ".join(rows[:-1]) + " and " + rows[-1]
    kind = f"{len(tables)} PLE table{'s' * (len(tables) != 1)}"
    return f"{kind} of {listed} rows x {' / '.join(map(str, widths))} ({' / '.join(formats)})"


def _rows_trained(trained: list[int], reads: list[int]) -> str:
    """``3,345 and 3,346 distinct rows trained (one table each), of 4,096 row reads a table``."""
    n = [f"{k:,}" for k in trained]
    listed = n[0] if len(n) == 1 else ", ".join(n[:-1]) + " and " + n[-1]
    per = "" if len(n) == 1 else " (one number a table)"
    reads_s = f"{reads[0]:,}" if len(set(reads)) == 1 else " / ".join(f"{k:,}" for k in reads)
    return f"{listed} distinct rows trained{per}, of {reads_s} row reads a table"
