"""The ``ple`` command: inspect, ids (and the tools built on the higher levels)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import PLEConfig

FORMAT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "fp8_row": 1, "int8_row": 1}


def _config_and_checkpoint(path: str) -> tuple[PLEConfig, Path | None]:
    """(config, checkpoint path or None) for a config.json, a model directory or an index file."""
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"ple: no such file or directory: {p}")
    if p.is_file() and p.name.endswith(".json") and p.name != "model.safetensors.index.json":
        return PLEConfig.from_pretrained(p), None
    root = p.parent if p.is_file() else p
    if not (root / "config.json").is_file():
        raise SystemExit(f"ple: {root} has no config.json")
    cfg = PLEConfig.from_pretrained(root)
    # Pickled weights count as weights here so the checkpoint reader refuses them by name,
    # instead of the directory silently reading as "config only".
    from .checkpoint import _PICKLE_SUFFIXES

    has_weights = (
        p.is_file()
        or any(root.glob("*.safetensors"))
        or (root / "model.safetensors.index.json").exists()
        or any(q.suffix in _PICKLE_SUFFIXES for q in root.iterdir())
    )
    return cfg, (p if has_weights else None)


def table_bytes(layout, fmt: str) -> int:
    n = layout.padded_rows * layout.head_dim * FORMAT_BYTES[fmt]
    if fmt == "fp8":
        n += 4
    elif fmt.endswith("_row"):
        n += layout.padded_rows * 4
    return n


def cmd_inspect(args) -> int:
    from .checkpoint import scan_checkpoint

    cfg, ckpt = _config_and_checkpoint(args.path)
    scan = scan_checkpoint(ckpt, cfg) if ckpt is not None else None
    entries = {e.ple_layer_index: e for e in scan.layers} if scan else {}
    layers = []
    for idx in range(cfg.num_ple_layers):
        lay = cfg.layout(idx)
        e = entries.get(idx)
        dec = cfg.ple_layer_ids[idx] - 1 if cfg.ple_layer_ids else None
        layers.append(
            {
                "ple_layer_index": idx,
                "prefix": e.prefix if e else (f"model.language_model.layers.{dec}.ple." if dec is not None else None),
                "multipliers": list(lay.multipliers),
                "head_sizes": list(lay.head_sizes),
                "head_offsets": list(lay.head_offsets),
                "rows": lay.rows,
                "padded_rows": lay.padded_rows,
                "head_dim": lay.head_dim,
                "shard_rows": lay.shard_rows,
                "split_parts": lay.split_parts,
                "table_format": e.table_format if e else None,
                "bytes": {f: table_bytes(lay, f) for f in FORMAT_BYTES},
                "problems": list(e.problems) if e else [],
            }
        )
    problems = (scan.problems if scan else []) + [q for d in layers for q in d["problems"]]
    if args.json:
        print(json.dumps({"layers": layers, "problems": scan.problems if scan else []}, indent=1))
    else:
        print(
            f"config: {args.path}   hidden {cfg.hidden_size} x hc {cfg.hc_count}, E {cfg.ple_embed_dim}, "
            f"N {cfg.ngram_size}, {cfg.num_heads} heads of {cfg.head_dim}, K {cfg.ple_conv_kernel_size}, "
            f"eos {cfg.eos_token_id}, seed {cfg.seed}"
        )
        for d in layers:
            print(f"\nPLE layer {d['ple_layer_index']}  prefix {d['prefix']}")
            print(f"  multipliers  {d['multipliers']}")
            print(f"  head sizes   {d['head_sizes'][0]} .. {d['head_sizes'][-1]} ({len(d['head_sizes'])} primes)")
            print(f"  rows         {d['rows']:,} (padded {d['padded_rows']:,}) x {d['head_dim']}")
            print(f"  shards       {d['split_parts']} x {d['shard_rows']:,} rows")
            print("  size         " + ", ".join(f"{f} {_human(b)}" for f, b in d["bytes"].items()))
            if ckpt is not None:
                print(
                    f"  checkpoint   table {d['table_format'] or '-'}; " + ("OK" if not d["problems"] else "PROBLEMS:")
                )
                for q in d["problems"]:
                    print(f"    - {q}")
        for q in scan.problems if scan else []:
            print(f"problem: {q}")
    return 1 if problems else 0


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return str(n)


def cmd_ids(args) -> int:
    import torch

    from .ngram import fresh_context, ngram_ids, reference

    cfg, _ = _config_and_checkpoint(args.path)
    try:
        tokens = [int(t) for t in args.tokens.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise SystemExit(f"ple ids: --tokens must be comma-separated integers, got {args.tokens!r}") from None
    lay = cfg.layout(args.layer)
    x = torch.tensor(tokens, dtype=torch.int64)
    ids = ngram_ids(x, torch.tensor([0, len(tokens)]), fresh_context(1, lay, cfg.eos_token_id), lay, cfg.eos_token_id)
    if args.json:
        print(json.dumps({"ids": ids.tolist()}))
        return 0
    ys = reference.ngram_tokens(tokens, cfg.ngram_size, cfg.eos_token_id)
    hpn = cfg.heads_per_ngram
    for t, tok in enumerate(tokens):
        print(f"token {t}: {tok}")
        for order in range(2, cfg.ngram_size + 1):
            gram = list(reversed(ys[t][:order]))
            heads = ", ".join(f"h{(order - 2) * hpn + j}:{int(ids[t, (order - 2) * hpn + j])}" for j in range(hpn))
            print(f"  {order}-gram {gram}: {heads}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ple", description="PLE layer tools")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="layout per PLE layer; for a checkpoint, a header-only check")
    p.add_argument("path", help="config.json, model directory or model.safetensors.index.json")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("ids", help="the table rows each token of a fresh request reads")
    p.add_argument("path", help="config.json or model directory")
    p.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 3,17,248044,9")
    p.add_argument("--layer", type=int, default=0, help="ple_layer_index (default 0)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_ids)
    _register_extra(sub)
    return ap


def _register_extra(sub) -> None:
    """Subcommands of the higher levels (registered here so ``ple --help`` lists them all)."""
    from . import commands

    commands.register(sub)


def main(argv: list[str] | None = None) -> int:
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .ngram import NgramInputError

    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (ConfigError, CheckpointError, NgramInputError, FileNotFoundError) as e:
        print(f"ple {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
