"""``ple verify``: recompute table files' checksums, and with ``--checkpoint`` compare each with the
checkpoint it was converted from (a merged table's trained rows with its adapter)."""

from __future__ import annotations

import argparse
import errno
import os
from typing import Any

from ple.checkpoint import CheckpointError, check_checkpoint, open_layer_table, resolve_model, table_shards
from ple.checkpoint import classify as paths
from ple.checkpoint.gguf import ple_metadata_problems
from ple.commands.report import add_json_argument, emit_json, show_progress
from ple.table import read_table_header, verify_table_file
from ple.table.files.table_file import hash_layout
from ple.table.files.transcode import compare_with_source

__all__ = ["HELP", "add_arguments", "run"]

HELP = "recompute table files' checksums (and compare each with its checkpoint); exit 1 if any has a problem"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "files",
        nargs="+",
        metavar="file",
        help="one or more .pletable files or folders of them (with --json: one file's {file, ok, problems}; "
        "for several, {ok, files: [...]})",
    )
    p.add_argument(
        "--checkpoint", help="the model directory they were converted from (each file matched to its PLE layer)"
    )
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    """Recompute the checksums of one or more table files; with ``--checkpoint``, compare each with its
    source (each file is matched to the PLE layer its header names). Exit 1 when any file has a problem.

    A file that cannot be read at all (missing, no permission) is one line on stderr before anything is
    verified, as for every command; what is wrong inside a file it can read is listed on stdout."""
    files: list[str] = []
    for f in args.files:
        os.stat(f)  # FileNotFoundError, NotADirectoryError, PermissionError: ple.commands.cli's one line
        if not os.access(f, os.R_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(f))
        folder = paths.classify(f) if os.path.isdir(f) else None
        files += [str(t) for t in folder.tables] if folder is not None and folder.kind == paths.TABLE_FOLDER else [f]
    if args.checkpoint:  # a training checkpoint is said so, as every command says it
        paths.classify(args.checkpoint).require(
            paths.CHECKPOINT, paths.CONFIG, wanted="a checkpoint to compare table files with"
        )
    results: list[dict[str, Any]] = []
    for f in files:
        problems = verify_table_file(f, progress=show_progress())
        note = ""
        if not problems:
            problems += _recorded_gguf_problems(f)
        if args.checkpoint and not problems:
            found, note = _compare_with_checkpoint(f, args.checkpoint)
            problems += found
        elif not problems:
            header = read_table_header(f)
            record = header.get("merged")
            if record is not None:
                from ple.table import TableFileError
                from ple.train.merge_record import recorded_rows

                try:
                    recorded_rows(f, header)  # a damaged record is a problem even without the checkpoint
                except TableFileError as e:
                    problems.append(str(e))
            if isinstance(record, dict) and not problems:
                note = (
                    f"a merge of {record.get('adapter')} (PLE layer {record.get('ple_layer_index')}, "
                    f"{record.get('trained_rows')} rows trained; --checkpoint compares them and the rest)"
                )
        results.append({"file": str(f), "ok": not problems, "problems": problems, **({"note": note} if note else {})})
    ok = all(r["ok"] for r in results)
    if args.json:
        if len(results) == 1:
            emit_json(results[0])
        else:
            emit_json({"ok": ok, "files": results})
    elif len(results) == 1:
        for q in results[0]["problems"]:
            print(f"problem: {q}")
        if results[0]["ok"]:
            noted = results[0].get("note")
            print(f"{results[0]['file']}: OK" + (f" ({noted})" if noted else ""))
    else:
        for r in results:
            n = len(r["problems"])
            fine = "OK" + (f" ({r['note']})" if r.get("note") else "")
            print(f"{r['file']}: " + (fine if r["ok"] else f"{n} problem{'s' * (n != 1)}"))
            for q in r["problems"]:
                print(f"  problem: {q}")
        bad = sum(not r["ok"] for r in results)
        print(f"{len(results)} files: " + ("all OK" if ok else f"{bad} with problems"))
    return 0 if ok else 1


def _recorded_gguf_problems(file: str) -> list[str]:
    """For a table file converted from a GGUF without a config: whether the PLE metadata its header
    records addresses rows the file has (see :func:`ple.checkpoint.gguf.ple_metadata_problems`)."""
    header = read_table_header(file)
    layout = header.get("layout")
    recorded = layout.get("gguf") if isinstance(layout, dict) else None
    if not isinstance(recorded, dict):
        return []
    found = ple_metadata_problems(recorded, header["rows"], header["head_dim"])
    return [f"{file}: the GGUF metadata its header records: {q}" for q in found]


def _compare_with_checkpoint(file: str, checkpoint: str) -> tuple[list[str], str]:
    """``(problems, a note for the report)``: the file compared with its PLE layer in ``checkpoint``;
    a merged table file's trained rows with the adapter it names instead (:mod:`ple.train.merge`)."""
    from ple.train.merge import check_merged_rows, merged_rows

    header = read_table_header(file)
    fields = header.get("layout")
    if not isinstance(fields, dict) or not isinstance(fields.get("ple_layer_index"), int):
        return ["the file's header records no layout fields: it cannot be matched to a checkpoint layer"], ""
    cfg, ckpt = resolve_model(checkpoint)
    idx = fields["ple_layer_index"]
    if not 0 <= idx < cfg.num_ple_layers:
        return [f"the file is for PLE layer {idx}, which {checkpoint}'s config does not have"], ""
    want = cfg.layout_fields(idx)
    if fields != want or header.get("layout_hash") != hash_layout(want):
        return [f"the file was made for another layout than {checkpoint}'s config (PLE layer {idx})"], ""
    if ckpt is None:
        return [f"{checkpoint}: no safetensors weights to compare with"], ""
    try:
        scan = check_checkpoint(ckpt, cfg, layers=[idx])
    except CheckpointError as e:
        return e.problems, ""
    entry = next(e for e in scan.layers if e.ple_layer_index == idx)
    open_layer_table(file, cfg, idx).close()  # the layout hash as the loader checks it
    record, trained, adapter, why = merged_rows(file)
    if record is None:
        return compare_with_source(file, table_shards(entry), progress=show_progress()), ""
    what = f"a merge of {record.get('adapter')} (PLE layer {record.get('ple_layer_index')})"
    if trained is None or adapter is None:  # the trained rows cannot be told apart from damage
        problems = compare_with_source(file, table_shards(entry), progress=show_progress())
        return [f"the file is {what}: {why}; the rows below include the trained ones", *problems], ""
    import numpy as np

    ids = np.concatenate([i.numpy() for i, _ in adapter.chunks(trained.ple_layer_index)] or [np.empty(0, np.int64)])
    problems = check_merged_rows(file, adapter, trained.ple_layer_index)
    problems += compare_with_source(file, table_shards(entry), progress=show_progress(), skip_rows=ids)
    from ple.train.merge_record import RecordedRows

    against = "their recorded digests" if isinstance(adapter, RecordedRows) else "the adapter's"
    return (
        problems,
        f"{what}: {trained.trained_rows:,} rows trained, equal to {against}; the rest equal to the checkpoint's",
    )
