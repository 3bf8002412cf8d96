"""``ple demo``: an end-to-end run on an embedded default (or a real checkpoint).

Synthesizes a checkpoint in the published format (sharded safetensors with an index, fp8 table
with one global scale), loads it through the real loader into the chosen tier, streams a serving
workload through a :class:`~ple.runtime.Session` (requests joining and finishing, chunked prefill,
decode, speculative verification with random acceptance), checks every kept output against the
one-shot reference, and prints throughput per phase, rows read, bytes moved and peak memory.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from collections.abc import Hashable
from pathlib import Path

import torch

from ..argtypes import non_negative_int, positive_int
from ..config import PLEConfig
from ..errors import InvalidArgumentError
from ..table import format_info
from . import parallel

# The published geometry scaled down 10x in width (same H : HC : E : heads ratios), small table.
DEMO_CONFIG = {
    "model_type": "qwen4_exp",
    "text_config": {
        "model_type": "qwen4_exp_text",
        "hidden_size": 256,
        "hc_count": 4,
        "ple_layer_ids": [2],
        "ple_embed_dim": 256,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "vocab_size": 248320,
        "ngram_vocab_size_base": 20000,
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 128,
        "ple_conv_kernel_size": 4,
        "rms_norm_eps": 1e-6,
        "ple_embedding_dtype": "fp8",
        "eos_token_id": 248044,
    },
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tier", choices=["memory", "mmap"], default="memory", help="where the table lives")
    p.add_argument("--config", help="config.json to use instead of the embedded default")
    p.add_argument("--checkpoint", help="a real qwen4_exp model directory (PLE layers only are read)")
    p.add_argument("--layer", type=non_negative_int, default=0, help="PLE layer index to serve (default 0)")
    p.add_argument("--requests", type=positive_int, default=64, help="requests in the workload")
    p.add_argument("--slots", type=positive_int, default=16, help="concurrent requests (state slots)")
    p.add_argument("--num-spec", type=non_negative_int, default=3, help="speculative tokens per verify chunk")
    p.add_argument("--chunk", type=positive_int, default=64, help="prefill chunk size")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--workdir", help="keep the synthesized checkpoint and table file here")
    p.add_argument("--json", action="store_true", help="print the results as one JSON document on stdout")
    p.add_argument("--output", metavar="PATH", help="also write the results as JSON to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (also off when stderr is no terminal)")
    parallel.add_arguments(p)


# ---------------------------------------------------------------------------------------- checkpoint
def synthesize_checkpoint(config: PLEConfig, out: Path, seed: int = 0, files: int = 4) -> Path:
    """Write random PLE weights in the published naming: ``config.json``, ``files`` safetensors
    files with shards spread over them in shuffled order, ``model.safetensors.index.json``; the
    table is fp8 e4m3 with one global scale."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    c, h, e, k = config.hc_hidden_size, config.hidden_size, config.ple_embed_dim, config.ple_conv_kernel_size
    tensors: dict[str, torch.Tensor] = {}
    for idx, one_based in enumerate(config.ple_layer_ids or (1,)):
        lay = config.layout(idx)
        prefix = f"model.language_model.layers.{one_based - 1}.ple."
        tensors[prefix + "key_proj.weight"] = (torch.randn(c, e, generator=g) / e**0.5).bfloat16()
        tensors[prefix + "value_proj.weight"] = (torch.randn(h, e, generator=g) / e**0.5).bfloat16()
        for name in ("norm_key", "norm_query", "norm_conv"):
            tensors[prefix + name + ".weight"] = (0.1 * torch.randn(c, generator=g)).bfloat16()
        tensors[prefix + "conv1d.weight"] = (0.3 * torch.randn(c, 1, k, generator=g)).bfloat16()
        tensors[prefix + "ple_embedding.layer_multipliers"] = torch.tensor(lay.multipliers, dtype=torch.int64)
        tensors[prefix + "ple_embedding.ngram_heads_vocab_sizes"] = torch.tensor(lay.head_sizes, dtype=torch.int64)
        tensors[prefix + "ple_embedding.ngram_heads_offsets"] = torch.tensor(lay.head_offsets, dtype=torch.int64)
        scale = 0.02
        tensors[prefix + "ple_embedding.ngram_embedding.weight_scale"] = torch.tensor([scale], dtype=torch.float32)
        for s in range(lay.split_parts):
            a, b = lay.shard_range(s)
            rows = (torch.randn(b - a, lay.head_dim, generator=g) * 0.05 / scale).clamp(-448, 448)
            tensors[prefix + f"ple_embedding.ngram_embedding.shard_{s}.weight"] = rows.to(torch.float8_e4m3fn)
    names = list(tensors)
    rng.shuffle(names)
    weight_map = {}
    for f in range(files):
        part = names[f::files]
        fname = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = dict(DEMO_CONFIG)
    cfg["text_config"] = {**config.to_dict(), "model_type": "qwen4_exp_text"}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


# ---------------------------------------------------------------------------------------- workload
class _Request:
    def __init__(self, rid: int, prompt: int, gen: int):
        self.rid = rid
        self.prompt = prompt
        self.gen = gen
        self.tokens: list[int] = []
        self.hidden: list[torch.Tensor] = []
        self.out: list[torch.Tensor] = []

    @property
    def target(self) -> int:
        return self.prompt + self.gen


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def serve(layer, args, progress: bool = True) -> dict:
    """Stream the workload through a Session; check every kept row against the one-shot reference."""
    from tqdm.auto import tqdm

    from ..runtime import Session

    cfg = layer.config
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    session = Session(layer, max_requests=args.slots, num_spec=args.num_spec)
    waiting = [_Request(i, rng.randint(8, 160), rng.randint(4, 40)) for i in range(args.requests)]
    live: dict[int, _Request] = {}
    phases = {p: {"steps": 0, "tokens": 0, "seconds": 0.0} for p in ("prefill", "decode", "verify")}
    lookups = 0
    worst = 0.0
    checked = 0
    bar = tqdm(total=args.requests, desc="ple demo", unit="req", disable=not progress)

    def token() -> int:
        return cfg.eos_token_id if rng.random() < 0.03 else rng.randrange(cfg.vocab_size)

    while waiting or live:
        while waiting and len(live) < args.slots:
            r = waiting.pop(0)
            session.add(r.rid)
            live[r.rid] = r
        inputs: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}
        spec, plan = set(), {}
        for r in live.values():
            done = len(r.tokens)
            if done < r.prompt:
                n, kind = min(args.chunk, r.prompt - done), "prefill"
            elif args.num_spec and rng.random() < 0.4:
                n, kind = min(1 + args.num_spec, r.target - done), "verify"
            else:
                n, kind = 1, "decode"
            toks = [token() for _ in range(n)]
            hid = torch.randn(n, cfg.hc_hidden_size, generator=gen).to(layer.dtype)
            kept = rng.randint(1, n) if kind == "verify" else n
            inputs[r.rid] = (hid, torch.tensor(toks))
            plan[r.rid] = (toks, hid, kept, kind)
            if kind == "verify":
                spec.add(r.rid)
        kinds = {k for *_, k in plan.values()}
        phase = "prefill" if "prefill" in kinds else ("verify" if "verify" in kinds else "decode")
        t0 = time.perf_counter()
        out = session.step(inputs, speculative=spec)
        dt = time.perf_counter() - t0
        ntok = sum(len(t) for t, *_ in plan.values())
        phases[phase]["steps"] += 1
        phases[phase]["tokens"] += ntok
        phases[phase]["seconds"] += dt
        lookups += ntok * cfg.num_heads
        for rid, (toks, hid, kept, kind) in plan.items():
            r = live[rid]
            if kind == "verify":
                session.accept(rid, kept)
            r.tokens += toks[:kept]
            r.hidden.append(hid[:kept])
            r.out.append(out[rid][:kept])
            if len(r.tokens) >= r.target:
                worst = max(worst, _check(layer, r))
                checked += len(r.tokens)
                session.finish(rid)
                del live[rid]
                bar.update(1)
    bar.close()
    return {"phases": phases, "lookups": lookups, "checked_tokens": checked, "worst_error_vs_tolerance": worst}


RTOL = ATOL = 1e-5


def _check(layer, r: _Request) -> float:
    """Worst ``|got - want| / (ATOL + RTOL*|want|)`` of the request's kept outputs against the
    one-shot reference (<= 1 passes)."""
    hidden = torch.cat(r.hidden)
    tokens = torch.tensor(r.tokens)
    with torch.no_grad():
        want = hidden + layer.forward_padded(hidden[None], tokens[None])[0]
    got = torch.cat(r.out)
    if layer.dtype != torch.float32:
        raise InvalidArgumentError("the demo checks exactness in fp32")
    return ((got.double() - want.double()).abs() / (ATOL + RTOL * want.double().abs())).max().item()


# ---------------------------------------------------------------------------------------- main
def run(args) -> int:
    if parallel.requested(args):
        return parallel.run(args)
    from ..checkpoint import open_layer_table, resolve_model, scan_checkpoint, table_shards, write_layer_table
    from ..layer import PLELayer
    from ..runtime import tune_host_allocator

    tune_host_allocator()
    progress = not args.no_progress and sys.stderr.isatty()
    t_start = time.perf_counter()
    tmp = None
    if args.workdir:
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="ple-demo-")
        work = Path(tmp.name)
    try:
        if args.checkpoint:
            config, ckpt = resolve_model(args.checkpoint)
            if args.config:
                config = PLEConfig.from_pretrained(args.config)
            if ckpt is None:
                raise InvalidArgumentError(f"--checkpoint {args.checkpoint}: no safetensors weights there")
            source = f"checkpoint {ckpt}"
        else:
            config = PLEConfig.from_pretrained(args.config) if args.config else PLEConfig.from_dict(DEMO_CONFIG)
            ckpt = synthesize_checkpoint(config, work / "checkpoint", seed=args.seed)
            source = "synthesized checkpoint (published format, fp8 + global scale)"
        if not 0 <= args.layer < config.num_ple_layers:
            raise InvalidArgumentError(
                f"--layer {args.layer}: the config has {config.num_ple_layers} PLE layer(s) (indexes into ple_layer_ids)"
            )
        t0 = time.perf_counter()
        table = None
        if args.tier == "mmap":  # the table goes straight from the checkpoint to a table file, never to memory
            path = work / f"ple_layer_{args.layer}.pletable"
            entry = next(e for e in scan_checkpoint(ckpt, config).layers if e.ple_layer_index == args.layer)
            write_layer_table(table_shards(entry), path, config, args.layer, force=True, progress=progress)
            table = open_layer_table(path, config, args.layer)
        layer = PLELayer.from_checkpoint(ckpt, config, ple_layer_index=args.layer, progress=progress, table=table)
        load_s = time.perf_counter() - t0
        table = layer.table
        res = serve(layer, args, progress)
        res.update(
            source=source,
            tier=args.tier,
            table=f"{table.format} [{table.rows:,} x {table.head_dim}]",
            load_seconds=load_s,
            peak_rss_bytes=_peak_rss_bytes(),
            wall_seconds=time.perf_counter() - t_start,
        )
        info = format_info(table.format)
        row_bytes = table.head_dim * info.itemsize + (4 if info.scale_kind == "row" else 0)
        res["bytes_moved"] = res["lookups"] * row_bytes
        ok = res["checked_tokens"] > 0 and res["worst_error_vs_tolerance"] <= 1.0
        res["ok"] = ok
        if args.output:
            Path(args.output).write_text(json.dumps(res, indent=1))
        if args.json:
            print(json.dumps(res, indent=1))
            return 0 if ok else 1
        _print(res)
        print(
            f"check: every kept output ({res['checked_tokens']:,} tokens) equals the one-shot reference "
            "(fp32, rtol = atol = 1e-5)"
            if ok
            else f"check FAILED: an output is {res['worst_error_vs_tolerance']:.2f} x the fp32 tolerance off the reference"
        )
        return 0 if ok else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


def _print(res: dict) -> None:
    print(f"\nsource : {res['source']}\ntable  : {res['table']} ({res['tier']})")
    print(f"load   : {res['load_seconds']:.2f} s through the checkpoint loader (and ple convert for mmap)\n")
    print("| phase   | steps | tokens | seconds | tokens/s |")
    print("|---------|------:|-------:|--------:|---------:|")
    for name, p in res["phases"].items():
        tps = p["tokens"] / p["seconds"] if p["seconds"] else 0.0
        print(f"| {name:7s} | {p['steps']:5d} | {p['tokens']:6d} | {p['seconds']:7.3f} | {tps:8.0f} |")
    print(f"\nrows read        : {res['lookups']:,}")
    print(f"bytes moved      : {res['bytes_moved'] / 1e6:.2f} MB from the table")
    print(f"peak resident    : {res['peak_rss_bytes'] / 1e6:.0f} MB")
    print(
        f"tokens checked   : {res['checked_tokens']:,} (worst error {res['worst_error_vs_tolerance']:.2f} x the fp32 tolerance)"
    )
    print(f"wall time        : {res['wall_seconds']:.1f} s")
