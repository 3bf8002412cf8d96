"""``ple eval``'s own cost at the published geometry of one PLE layer, beside the forward it wraps.

    python benchmarks/eval_bench.py [--windows 3] [--ctx 512] [--rows 1000000] [--json out.json]
    python benchmarks/eval_bench.py --passes [--ctx 512]

A random-weight ``qwen4_exp`` model of two decoder layers: the first (linear attention) carries a
PLE layer at the published geometry (hidden 2560, HC 4, E 2560, 16 heads of 160, conv kernel 4),
the second has indexed attention (transformers needs one); the published vocabulary of 248,320
ids; attention and experts small; bf16 weights; the table (``--rows`` rows) in fp8 with a global
scale, saved in the published layout. Then, each in a fresh process (its peak memory its own), on
the same ``--windows`` windows of ``--ctx`` random tokens:

- plain: ``from_pretrained`` (tables on disk) and ``model(input_ids=window)`` on each window, timed;
- eval: ``ple eval CKPT --tokens F --ctx N --json``, the reference alone;
- eval + q4_0: the same with ``--formats q4_0`` (one candidate compared with the reference).

Reported: seconds a window of the forward and of the eval's own work (log-probabilities, KL, top
token, per-token statistics), their ratio, predictions/s (all variants together) and peak RSS.

``--passes``: the eval's own work alone, without a model: a window's reference pass and one
candidate's comparison on random bf16 logits of the published vocabulary (``ctx - 1`` rows), by the C
kernels and by the PyTorch path (``PLE_NATIVE=0``), the best of three each.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

VOCAB = 248_320


def build(folder: Path, rows: int) -> None:
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    from ple.integrations.demo_model import model_config, randomize_ple_weights, save_published

    cfg = model_config(max(1, rows // 16))
    cfg.update(
        vocab_size=VOCAB,
        hidden_size=2560,
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        hc_count=4,
        ple_layer_ids=[1],
        ple_embed_dim=2560,
        heads_per_ngram=8,
        ple_conv_kernel_size=4,
        eos_token_id=248044,
        bos_token_id=0,
        pad_token_id=248044,
    )
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of the 248,320-id embeddings
    try:
        model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**cfg)).eval()
    finally:
        torch.set_default_dtype(dtype)
    randomize_ple_weights(model, 1)
    save_published(model, folder, max_shard_size="2GB")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def plain(ckpt: str, tokens: str, ctx: int, table_dir: str) -> dict:
    from ple.integrations.transformers import from_pretrained

    model = from_pretrained(ckpt, table_dir=table_dir).eval()
    ids = torch.from_numpy(np.load(tokens))
    n = ids.numel() // ctx
    times = []
    with torch.inference_mode():
        for k in range(n):
            t0 = time.perf_counter()
            _ = model(input_ids=ids[k * ctx : (k + 1) * ctx].view(1, -1)).logits
            times.append(time.perf_counter() - t0)
    return {"seconds_per_window": float(np.mean(times)), "peak_rss_bytes": _peak(), "dtype": str(model.dtype)}


def _eval(ckpt: Path, tokens: Path, ctx: int, table_dir: Path, *extra: str) -> dict:
    argv = [sys.executable, "-m", "ple.commands.cli", "eval", str(ckpt), "--tokens", str(tokens), "--ctx", str(ctx)]
    out = subprocess.run([*argv, "--table-dir", str(table_dir), "--json", *extra], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout)


def passes(ctx: int) -> None:
    from ple.commands.evaluate import compare_logits, reference_of

    g = torch.Generator().manual_seed(0)
    zr = (torch.randn(ctx - 1, VOCAB, generator=g) * 3).bfloat16()
    zc = (zr.float() + 0.05 * torch.randn(ctx - 1, VOCAB, generator=g)).bfloat16()
    targets = torch.randint(0, VOCAB, (ctx - 1,), generator=g)
    buf = torch.empty(zr.shape)
    print(
        f"| passes over {ctx - 1} x {VOCAB:,} bf16 logits, {torch.get_num_threads()} threads | reference s | candidate s |"
    )
    print("|---|---|---|")
    for native in (True, False):
        best = [float("inf"), float("inf")]
        for _ in range(3):
            t0 = time.perf_counter()
            ref, _ = reference_of(zr, targets, buf, native=native)
            t1 = time.perf_counter()
            compare_logits(ref, zc, targets)
            best = [min(best[0], t1 - t0), min(best[1], time.perf_counter() - t1)]
        print(f"| {'C kernels' if native else 'PyTorch'} | {best[0]:.3f} | {best[1]:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--json")
    ap.add_argument("--passes", action="store_true", help="time the eval's passes over the logits alone")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(plain(args.child[0], args.child[1], int(args.child[2]), args.child[3])))
        return
    if args.passes:
        passes(args.ctx)
        return
    from ple.commands.bench.runner import machine_info

    with tempfile.TemporaryDirectory(prefix="ple-eval-bench-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        build(work / "model", args.rows)
        print(f"model built and saved in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        tokens = work / "tokens.npy"
        np.save(tokens, np.random.default_rng(0).integers(0, VOCAB, (args.windows + 1) * args.ctx))
        tables = work / "tables"
        child = [sys.executable, __file__, "--child", str(work / "model"), str(tokens), str(args.ctx), str(tables)]
        res = subprocess.run(child, capture_output=True, text=True, env={**os.environ})
        if res.returncode:
            raise SystemExit(res.stderr)
        base = json.loads(res.stdout)
        runs = {"eval": _eval(work / "model", tokens, args.ctx, tables)}
        runs["eval + q4_0"] = _eval(work / "model", tokens, args.ctx, tables, "--formats", "q4_0")
    lines = [
        "| run | forward s/window | eval's own s/window | (forward + own) / forward | tokens/s | peak RSS |",
        "|---|---|---|---|---|---|",
        f"| plain forward | {base['seconds_per_window']:.2f} | - | - | "
        f"{(args.ctx - 1) / base['seconds_per_window']:.0f} | {base['peak_rss_bytes'] / 2**30:.2f} GiB |",
    ]
    for name, doc in runs.items():
        rows = [doc["reference"], *doc["variants"].values()]
        windows = doc["windows"]
        fwd = sum(r["forward_seconds"] for r in rows) / windows
        own = sum(r["compare_seconds"] for r in rows) / windows
        lines.append(
            f"| {name} | {fwd:.2f} | {own:.2f} | {(fwd + own) / fwd:.3f} | "
            f"{doc['predictions'] * len(rows) / (windows * (fwd + own)):.0f} | "
            f"{doc['peak_rss_bytes'] / 2**30:.2f} GiB |"
        )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "plain": base, **runs}, indent=1))


if __name__ == "__main__":
    main()
