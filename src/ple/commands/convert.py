"""``ple convert``: each PLE layer's table as one memory-mappable table file, written atomically and
streamed shard by shard, from a checkpoint (converted to ``--to``, or copied) or from a GGUF model's PLE
table (its blocks copied); an interrupted conversion continues where it stopped."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ple.checkpoint import CheckpointError, check_checkpoint, table_file_name, table_shards, write_layer_table
from ple.checkpoint import classify as paths
from ple.checkpoint.gguf import PLE_KEYS, GGUFError, GGUFModel, GGUFRows, GGUFTensor, ple_table, read_gguf
from ple.commands.report import (
    GGUF_FILE,
    LIST_SEPARATOR,
    add_format_argument,
    add_json_argument,
    emit_json,
    layer_index_help,
    short,
    show_progress,
)
from ple.common.argtypes import parse_int, shown
from ple.config import PLEConfig
from ple.convert.folder import made_from, record_table, source_identity
from ple.errors import CommandLineError, InvalidArgumentError, PLEError
from ple.table import FORMATS, format_info
from ple.table.files.table_file import TABLE_SUFFIX
from ple.table.files.transcode import convert_layer, table_amax, target_format
from ple.table.formats.blocks import nvfp4_global_scale

__all__ = ["HELP", "add_arguments", "run"]

HELP = (
    "write each PLE layer's table as one memory-mappable table file (from a checkpoint, or from a GGUF "
    "model's PLE table, its blocks copied)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint", help=f"model directory (config.json + safetensors), index file, or a qwen4exp {GGUF_FILE}"
    )
    p.add_argument("out", help="output folder (one <prefix>.pletable file per PLE layer)")
    add_format_argument(
        p,
        "--to",
        "the format to write: {names}. fp8_row/int8_row (int8): one scale per row; fp8: the "
        "source copied when it is fp8 already, else fp8_row; bf16/fp16/fp32: the values cast; q8_0 q5_1 q5_0 q4_1 "
        "q4_0 iq4_nl mxfp4 (GGML blocks of 32) or nvfp4 (blocks of 16, E4M3 scales): block formats. The format the "
        "source already has is copied exactly",
    )
    p.add_argument("--layers", help="PLE layer indexes (positions in ple_layer_ids), e.g. 0,1 (default: all)")
    p.add_argument("--force", action="store_true", help="replace existing table files")
    p.add_argument(
        "--config",
        help="config.json (default: the checkpoint's; for a GGUF, the config whose layout the table file "
        "carries, every PLE key of the GGUF checked against it; without it the GGUF's PLE keys are the layout)",
    )
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    """One memory-mappable table file per PLE layer, written atomically and streamed shard by shard.

    The checkpoint passes the loader's validation first (:func:`ple.checkpoint.check_checkpoint`, dense
    weights included): what the loader refuses is never converted. A GGUF model (one file or a split
    set) gives its table in its own type, bytes copied."""
    info = paths.classify(args.checkpoint)
    if info.kind == paths.GGUF:
        return _convert_gguf(args)
    info.require(
        paths.CHECKPOINT, paths.CONFIG, wanted="a checkpoint (a model folder) or a GGUF model, what ple convert reads"
    )
    cfg, ckpt = info.config, info.weights
    assert cfg is not None
    if args.config:
        cfg = PLEConfig.from_pretrained(args.config)
    if ckpt is None:
        raise CheckpointError(f"{args.checkpoint}: no safetensors weights found")
    wanted = _parse_layers(args.layers, cfg)
    _check_target_fits(args.to, cfg.head_dim)
    scan = check_checkpoint(ckpt, cfg, layers=wanted, dense_values=True)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"output {out} exists and is not a folder")
    entries = [e for e in scan.layers if wanted is None or e.ple_layer_index in wanted]
    for e in entries:  # a merged table is never converted over, --force or not
        merged = paths.merged_table(out / table_file_name(e.prefix))
        if merged is not None:
            raise InvalidArgumentError(
                f"table file {merged.path} is {merged.what}: ple convert never writes over a merged table; "
                "convert into another folder, or move it out of this one"
            )
    done: set[int] = set()  # layers whose file an earlier run of this conversion finished: kept
    for e in entries if not args.force else []:
        path = out / table_file_name(e.prefix)
        if os.path.lexists(path):
            fmt = target_format(args.to, e.table_format or "") or e.table_format or ""
            why = made_from(path, e, cfg, fmt)
            if why is not None:
                raise FileExistsError(f"table file {path} exists and is not kept ({why}): pass --force to replace it")
            done.add(e.ple_layer_index)
    results: list[dict[str, Any]] = []
    with _output_folder(out):
        _convert_layers(args, cfg, entries, out, results, done)
    if args.json:
        emit_json({"checkpoint": str(args.checkpoint), "out": str(out), "layers": results})
    return 0


def _parse_layers(text: str | None, cfg: PLEConfig) -> list[int] | None:
    if text is None:
        return None
    out = []
    for part in [p for p in LIST_SEPARATOR.split(text.strip()) if p]:
        idx = parse_int(part)
        if idx is None:
            raise CommandLineError(f"--layers: {shown(part)} is not a PLE layer index")
        if not 0 <= idx < cfg.num_ple_layers:
            raise CommandLineError(f"--layers: no PLE layer {idx}; {layer_index_help(cfg)}")
        out.append(idx)
    if not out:
        raise CommandLineError(f"--layers: no index given; {layer_index_help(cfg)}")
    return out


def _check_target_fits(to: str | None, head_dim: int) -> None:
    """``--to`` names a format whose blocks divide rows of ``head_dim`` values: one that does not is a
    command-line value out of range for this checkpoint (exit status 2). (A source already in that
    format is copied, and its rows fit by construction.)"""
    target = target_format(to, "")
    if target is None:
        return
    block = format_info(target).block
    if head_dim % block:
        fits = [f for f in FORMATS if head_dim % format_info(target_format(f, "") or f).block == 0]
        raise CommandLineError(
            f"--to {to}: the checkpoint's rows are {head_dim} values (head_dim), not whole {target} blocks of "
            f"{block} values; formats these rows fit: {', '.join(fits)}"
        )


@contextmanager
def _output_folder(out: Path) -> Iterator[None]:
    """Make the output folder ``out`` (and its missing parents) for the block's writing; when the block
    fails, remove those of them that are still empty (a folder that existed before is never removed;
    table files already published stay, each complete)."""
    made: list[Path] = []
    p = out
    while not os.path.lexists(p) and p != p.parent:
        made.append(p)  # deepest first
        p = p.parent

    def remove_made() -> None:
        for q in made:
            try:
                q.rmdir()
            except FileNotFoundError:  # never made (a parent could not be)
                continue
            except OSError:  # not empty: leave it, and its parents
                break

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        remove_made()
        where = "" if e.filename in (None, str(out)) else f" ({e.filename})"
        raise PLEError(f"cannot create the output folder {out}{where}: {e.strerror}") from e
    try:
        yield
    except BaseException:
        remove_made()
        raise


def _convert_layers(
    args: argparse.Namespace, cfg: PLEConfig, entries: list, out: Path, results: list[dict[str, Any]], done: set[int]
) -> None:
    for e in entries:
        path = out / table_file_name(e.prefix)
        to = target_format(args.to, e.table_format or "")
        if e.ple_layer_index in done:
            fmt = to or e.table_format
            print(
                f"PLE layer {e.ple_layer_index}: kept {path}: its record says it holds this conversion of the "
                "checkpoint as it is now (--force converts it again)",
                file=sys.stderr,
            )
            results.append({"ple_layer_index": e.ple_layer_index, "path": str(path), "format": fmt, "kept": True})
            continue
        source = source_identity(e)  # before the rows are read: a checkpoint changed meanwhile does not match
        g = None
        if to == "nvfp4":
            rows = cfg.layout(e.ple_layer_index).padded_rows
            g = nvfp4_global_scale(table_amax(table_shards(e), show_progress(), rows, path.name))
        stats = write_layer_table(
            table_shards(e),
            path,
            cfg,
            e.ple_layer_index,
            to=to,
            force=args.force,
            progress=show_progress(),
            global_scale=g,
        )
        record_table(path, e, source)  # from_pretrained(table_dir=out) reuses the file without a comparison
        results.append({"ple_layer_index": e.ple_layer_index, **stats, "kept": False})
        if args.json:
            continue
        print(f"PLE layer {e.ple_layer_index}: wrote {path} ({e.table_format} -> {stats['format']})")
        if to:
            tot = stats["error"]
            print(f"  quantization error (relative to the source): max {tot['max_rel']:.3e}, rms {tot['rms_rel']:.3e}")
            for h, row in enumerate(stats["per_head"]):
                print(f"  head {h:2d}: max {row['max_rel']:.3e}  rms {row['rms_rel']:.3e}")


def _convert_gguf(args: argparse.Namespace) -> int:
    """``ple convert model.gguf OUT``: the GGUF's table, its bytes copied, as one table file."""
    # with a config, the PLE keys present must equal what it gives (which makes them consistent)
    model = read_gguf(args.checkpoint)
    t = ple_table(model, metadata=not args.config)
    assert t.format is not None
    if args.to is not None and target_format(args.to, t.format) is not None:
        raise CommandLineError(
            f"--to {args.to}: a GGUF table is written in its own type ({t.type_name}, ple format {t.format}), "
            f"never requantized: drop --to {args.to}"
        )
    if args.layers not in (None, "0"):
        raise CommandLineError(f"--layers {args.layers}: a GGUF model has one PLE table (layer 0)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"output {out} exists and is not a folder")
    head_dim, rows = t.dims
    if args.config:
        cfg = PLEConfig.from_pretrained(args.config)
        problems = _gguf_config_problems(model, t, cfg)
        if problems:
            raise GGUFError(f"{args.checkpoint} does not match {args.config}: " + "; ".join(problems))
        layout: dict[str, Any] = cfg.layout_fields(0)
        shard_rows = cfg.layout(0).shard_rows
        path = out / table_file_name(cfg.layer_prefix(0))
    else:
        meta = model.ple_metadata()
        needed = (
            "ple.layer_multipliers",
            "ple.head_offsets",
            "ple.head_vocab_sizes",
            "ple.ngram_size",
            "ple.heads_per_ngram",
        )
        missing = [f"{model.arch}.{k}" for k in needed if k not in meta]
        if missing:
            raise GGUFError(
                f"{args.checkpoint} lacks the PLE metadata {', '.join(missing)}: name the model's config.json with --config"
            )
        layout = {"gguf": {k: meta[k] for k in PLE_KEYS if k in meta}, "ple_layer_index": 0}
        shard_rows = min(rows, 1 << 20)
        path = out / ("per_layer_token_embd" + TABLE_SUFFIX)
    if path.exists() and not args.force:
        raise FileExistsError(f"table file {path} exists: pass --force to replace it")
    source = GGUFRows(t, shard_rows)  # bytes copied, values checked finite, resumable
    with _output_folder(out):
        convert_layer(source, path, layout, rows, head_dim, shard_rows, force=args.force, progress=show_progress())
    stats = {"ple_layer_index": 0, "path": str(path), "format": t.format, "source_format": f"gguf {t.type_name}"}
    stats["rows"] = rows
    if args.json:
        emit_json({"checkpoint": str(args.checkpoint), "out": str(out), "layers": [stats]})
    else:
        print(f"PLE layer 0: wrote {path} (GGUF {t.type_name} -> {t.format}, bytes copied)")
    return 0


def _gguf_config_problems(model: GGUFModel, table: GGUFTensor, cfg: PLEConfig) -> list[str]:
    """Where the GGUF's PLE metadata (and its table's shape) disagrees with the config's layer 0."""
    lay = cfg.layout(0)
    meta = model.ple_metadata()
    want = {
        "ple.layers": [i - 1 for i in cfg.ple_layer_ids[:1]],
        "ple.ngram_size": cfg.ngram_size,
        "ple.heads_per_ngram": cfg.heads_per_ngram,
        "ple.conv_kernel": cfg.ple_conv_kernel_size,
        "ple.eos_token_id": cfg.eos_token_id,
        "ple.layer_multipliers": list(lay.multipliers),
        "ple.head_offsets": list(lay.head_offsets),
        "ple.head_vocab_sizes": list(lay.head_sizes),
        "embedding_length_per_layer_input": lay.head_dim,
    }
    problems = [
        f"{model.arch}.{k} is {short(meta[k])}, the config gives {short(v)}"
        for k, v in want.items()
        if k in meta and meta[k] != v
    ]
    if table.dims != (lay.head_dim, lay.padded_rows):
        problems.append(
            f"tensor {table.name} is [{table.dims[0]}, {table.dims[1]}] ([head_dim, rows]), the config's table is "
            f"[{lay.head_dim}, {lay.padded_rows}]"
        )
    return problems
