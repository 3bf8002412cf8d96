"""Loading a qwen4_exp model with its PLE tables on disk: peak memory and load time vs table size.

    python benchmarks/load_bench.py [--bases 250000,1000000,4000000] [--repeats 3] [--json out/load.json]

For each ``ngram_vocab_size_base`` a random-weight ``qwen4_exp`` model (hidden 64, 4 decoder layers,
PLE on two, ``~16 x base`` rows x 4 per table, fp32: its tables are nearly all of it) is saved with
``save_pretrained``; then, each in a fresh process (:mod:`ple.commands.demo.measure`, the checkpoint's and
the table files' pages evicted from the page cache first, so loads read from disk):

- transformers: ``from_pretrained`` + ``generate`` (4 prompts x 8 new tokens);
- ple, first start: ``ple.integrations.transformers.from_pretrained`` converts the tables to table
  files (streamed shard by shard), then ``generate``;
- ple, second start: the table files are reused (``--repeats`` fresh processes, medians).

Reported per process: load seconds, generate seconds, peak resident memory (``VmHWM``: anonymous
plus file-backed pages) and the sampled peaks of each kind. Every ple process must generate
transformers' tokens, with step logits within ``LOGIT_TOLERANCE`` of transformers' (each process
writes its own logits file); the largest difference is reported.
Prints a markdown table; ``--json`` writes the samples with the machine description.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from ple.commands.bench.runner import machine_info, versions
from ple.integrations.demo_model import build_model, measure, prompts

LOGIT_TOLERANCE = 1e-4


def _checkpoint(folder: Path, base: int) -> int:
    model = build_model(base, seed=0)
    tables = sum(p.nbytes for n, p in model.named_parameters() if n.endswith("ngram_embedding.weight"))
    model.save_pretrained(folder, max_shard_size="2GB")
    return tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bases", default="250000,1000000,4000000", help="ngram_vocab_size_base values")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per second-start measurement")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--workdir", help="keep checkpoints and table files here (default: a temporary folder)")
    ap.add_argument("--json", help="write the samples here")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="ple-load-bench-"))
    ids = prompts(seed=0)
    rows = []
    try:
        for base in (int(b) for b in args.bases.split(",")):
            folder = work / f"base-{base}"
            shutil.rmtree(folder, ignore_errors=True)
            tables = _checkpoint(folder / "ckpt", base)
            print(f"base {base}: tables {tables / 1e6:,.0f} MB", file=sys.stderr)
            plain = measure("plain", folder / "ckpt", ids, args.new_tokens, folder / "logits-plain.pt", timeout=1800)
            ple_logits = [folder / f"logits-ple-{i}.pt" for i in range(1 + args.repeats)]
            first = measure("ple", folder / "ckpt", ids, args.new_tokens, ple_logits[0], table_dir=folder / "tables")
            seconds = [
                measure("ple", folder / "ckpt", ids, args.new_tokens, out, table_dir=folder / "tables")
                for out in ple_logits[1:]
            ]
            want = torch.load(folder / "logits-plain.pt")
            diff = 0.0
            for r, out in zip((first, *seconds), ple_logits):
                if r["tokens"] != plain["tokens"]:
                    raise SystemExit(f"base {base}: ple generated other tokens than transformers")
                got = torch.load(out)
                if got.shape != want.shape:
                    raise SystemExit(
                        f"base {base}: ple's logits are {list(got.shape)}, transformers' {list(want.shape)}"
                    )
                diff = max(diff, float((got - want).abs().max()))
            if diff > LOGIT_TOLERANCE:
                raise SystemExit(
                    f"base {base}: ple's logits differ from transformers' by {diff:.2e} > {LOGIT_TOLERANCE}"
                )
            if any(r["tables"] != [["reused", "reused"]] for r in seconds):
                raise SystemExit(f"base {base}: a second start did not reuse the table files")
            rows.append(
                {
                    "base": base,
                    "table_bytes": tables,
                    "max_logit_diff": diff,
                    "plain": plain,
                    "first": first,
                    "second": seconds,
                }
            )
            shutil.rmtree(folder / "ckpt")  # disk: keep only the table files of the sizes measured
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    def med(rs, key, i=0):
        return statistics.median(r[key][i] if isinstance(r[key], list) else r[key] for r in rs)

    print("| tables (fp32) | process | load s | generate s | peak resident MB | peak anon MB | peak file MB |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        mb = f"{row['table_bytes'] / 1e6:,.0f} MB"
        for name, rs in (
            ("transformers", [row["plain"]]),
            ("ple, 1st start", [row["first"]]),
            ("ple, 2nd start", row["second"]),
        ):
            print(
                f"| {mb} | {name} | {med(rs, 'load_seconds'):.2f} | {med(rs, 'generate_seconds'):.2f} | "
                f"{med(rs, 'peak_rss_bytes') / 1e6:,.0f} | {med(rs, 'peak_anon_bytes') / 1e6:,.0f} | "
                f"{med(rs, 'peak_file_bytes') / 1e6:,.0f} |"
            )
    print()
    for row in rows:
        drop = row["plain"]["peak_rss_bytes"] - max(
            row["first"]["peak_rss_bytes"], med(row["second"], "peak_rss_bytes")
        )
        print(
            f"tables {row['table_bytes'] / 1e6:,.0f} MB: peak memory drop {drop / 1e6:,.0f} MB = "
            f"{drop / row['table_bytes']:.0%} of the tables; 2nd-start load {med(row['second'], 'load_seconds'):.2f} s; "
            f"max logit diff vs transformers {row['max_logit_diff']:.1e}"
        )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        machine = {**machine_info(), "load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
        out.write_text(json.dumps({"machine": machine, "versions": versions(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
