"""``ple convert``, ``verify``, ``stats``, ``bench`` and ``demo``: the commands of the higher levels."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TABLE_SUFFIX = ".pletable"


def register(sub) -> None:
    p = sub.add_parser("convert", help="write each PLE layer's table as one memory-mappable file")
    p.add_argument("checkpoint", help="model directory (config.json + safetensors) or index file")
    p.add_argument("out", help="output directory (one <prefix>.pletable file per PLE layer)")
    p.add_argument("--to", choices=["fp8", "int8"], help="requantize with one scale per row")
    p.add_argument("--layers", help="comma-separated ple_layer_index values (default: all)")
    p.add_argument("--force", action="store_true", help="replace existing table files")
    p.add_argument("--config", help="config.json (default: the checkpoint's)")
    p.set_defaults(fn=cmd_convert)

    p = sub.add_parser("verify", help="recompute a table file's checksums (and compare with its checkpoint)")
    p.add_argument("file", help="a .pletable file")
    p.add_argument("--checkpoint", help="the model directory it was converted from")
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser("stats", help="row traffic of a token stream: distinct rows, reuse, bucket load")
    p.add_argument("path", help="config.json or model directory")
    p.add_argument("--tokens", required=True, help="token file: .npy, or text with integers")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_stats)

    from .bench import runner

    p = sub.add_parser("bench", help="benchmarks against transformers, side by side")
    runner.add_arguments(p)
    p.set_defaults(fn=runner.run)

    from . import demo

    p = sub.add_parser("demo", help="end-to-end run: synthesize, load, serve, check against the reference")
    demo.add_arguments(p)
    p.set_defaults(fn=demo.run)


def layout_fields(config, ple_layer_index: int) -> dict:
    """The fields a table file's layout hash covers."""
    return {**config.layout_key(), "ple_layer_index": ple_layer_index}


def shards_for_convert(entry, reader=None):
    """Checkpoint shards as ``convert_layer`` takes them (fp8 shards carry the global scale)."""
    from .checkpoint import _TABLE_SCALE, _Reader, iter_table_shards

    own = reader is None
    reader = reader or _Reader()
    try:
        gscale = None
        if entry.table_format == "fp8":
            gscale = reader.get(entry.global_scale, entry.prefix + _TABLE_SCALE).reshape(1).float()
        for k, rows, scale in iter_table_shards(entry, reader):
            yield k, rows, (gscale if scale is None else scale)
    finally:
        if own:
            reader.close()


def _checked_scan(checkpoint: str, config_path: str | None):
    from .checkpoint import CheckpointError, scan_checkpoint
    from .cli import _config_and_checkpoint
    from .config import PLEConfig

    cfg, ckpt = _config_and_checkpoint(checkpoint)
    if config_path:
        cfg = PLEConfig.from_pretrained(config_path)
    if ckpt is None:
        raise CheckpointError(f"{checkpoint}: no safetensors weights found")
    scan = scan_checkpoint(ckpt, cfg)
    problems = scan.all_problems
    if problems:
        raise CheckpointError(problems)
    return cfg, scan


def table_file_name(entry) -> str:
    return entry.prefix.rstrip(".").replace("/", "_") + TABLE_SUFFIX


def cmd_convert(args) -> int:
    from .table import convert_layer

    cfg, scan = _checked_scan(args.checkpoint, args.config)
    wanted = None if not args.layers else {int(x) for x in args.layers.split(",")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    to = {"fp8": "fp8_row", "int8": "int8_row", None: None}[args.to]
    for e in scan.layers:
        if wanted is not None and e.ple_layer_index not in wanted:
            continue
        lay = e.layout
        path = out / table_file_name(e)
        stats = convert_layer(
            shards_for_convert(e),
            path,
            layout_fields(cfg, e.ple_layer_index),
            lay.padded_rows,
            lay.head_dim,
            lay.shard_rows,
            to=to,
            force=args.force,
            progress=True,
            head_ranges=[(o, o + n) for o, n in zip(lay.head_offsets, lay.head_sizes)],
        )
        print(f"PLE layer {e.ple_layer_index}: wrote {path} ({e.table_format} -> {to or e.table_format})")
        if to:
            tot = stats["error"]
            print(f"  quantization error (relative to the source): max {tot['max_rel']:.3e}, rms {tot['rms_rel']:.3e}")
            for h, row in enumerate(stats["per_head"]):
                print(f"  head {h:2d}: max {row['max_rel']:.3e}  rms {row['rms_rel']:.3e}")
    return 0


def cmd_verify(args) -> int:
    from .checkpoint import scan_checkpoint
    from .cli import _config_and_checkpoint
    from .table import compare_with_source, read_table_header, verify_table_file

    problems = verify_table_file(args.file)
    if args.checkpoint and not problems:
        header = read_table_header(args.file)
        fields = header.get("layout") or {}
        cfg, ckpt = _config_and_checkpoint(args.checkpoint)
        if "ple_layer_index" not in fields:
            problems.append("the file's header records no layout fields; cannot match it to a checkpoint layer")
        else:
            idx = fields["ple_layer_index"]
            if layout_fields(cfg, idx) != fields:
                problems.append(f"the file was made for another layout than {args.checkpoint}'s config (layer {idx})")
            else:
                scan = scan_checkpoint(ckpt, cfg)
                entry = next((e for e in scan.layers if e.ple_layer_index == idx), None)
                if entry is None:
                    problems.append(f"checkpoint has no PLE layer {idx}")
                else:
                    problems += compare_with_source(args.file, shards_for_convert(entry))
    if problems:
        for q in problems:
            print(f"problem: {q}")
        return 1
    print(f"{args.file}: OK")
    return 0


def cmd_stats(args) -> int:
    from .cli import _config_and_checkpoint
    from .stats import read_token_file, row_traffic

    cfg, _ = _config_and_checkpoint(args.path)
    tokens = read_token_file(args.tokens)
    res = row_traffic(tokens, cfg, args.layer)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(
        f"{res['tokens']} tokens, {res['lookups']} lookups, {res['total']['distinct_rows']} distinct rows; "
        f"top 1% of rows serve {res['total']['top1_share']:.1%}, top 10% serve {res['total']['top10_share']:.1%}"
    )
    print("head order  distinct rows  top1%   top10%  distinct n-grams  shared rows  max load")
    for h in res["heads"]:
        print(
            f"{h['head']:4d} {h['order']:5d} {h['distinct_rows']:14d} {h['top1_share']:6.1%} {h['top10_share']:7.1%} "
            f"{h['distinct_ngrams']:17d} {h['shared_rows']:12d} {h['max_bucket_load']:9d}"
        )
    sys.stdout.flush()
    return 0
