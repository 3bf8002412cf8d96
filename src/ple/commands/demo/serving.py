"""The serving part of ``ple demo``: a PLE layer at the published geometry driven through a
:class:`~ple.runtime.Session`.

Synthesizes a checkpoint in the published format (sharded safetensors with an index, fp8 table
with one global scale), makes its table file once (:func:`ple.convert.folder.prepare_table`,
as the model loader does), loads the layer with the table in the chosen tier, streams a workload
(requests joining and finishing, chunked prefill, decode, speculative verification with random
acceptance), checks every kept output against the one-shot reference, and reports throughput per
phase, rows read, bytes moved and peak memory.
"""

from __future__ import annotations

import json
import random
import resource
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ple.commands.demo.adapters import serve_adapters
from ple.config import PLEConfig
from ple.errors import CommandLineError, InvalidArgumentError
from ple.table import CachedTable, DirectTable, Table, format_info
from ple.table.tiers.open import FILE_TIERS, open_table

__all__ = ["DEMO_CONFIG", "SERVING_BASES", "synthesize_checkpoint", "serve", "run_serving", "print_serving"]

# The published layer geometry (H 2560, HC 4, E 2560, 16 heads of 160, K 4); the table has about
# 16 x ngram_vocab_size_base rows (the published base, 20,000,003, makes 320 M rows).
DEMO_CONFIG = {
    "model_type": "qwen4_exp",
    "text_config": {
        "model_type": "qwen4_exp_text",
        "hidden_size": 2560,
        "hc_count": 4,
        "ple_layer_ids": [2],
        "ple_embed_dim": 2560,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "vocab_size": 248320,
        "ngram_vocab_size_base": 200_000,
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 128,
        "ple_conv_kernel_size": 4,
        "rms_norm_eps": 1e-6,
        "ple_embedding_dtype": "fp8",
        "eos_token_id": 248044,
    },
}
REAL_TEXT_TOKENS = 200_000
"""The serving workload's tokens without a token input: the first this many of the real text."""
_LONGEST_PROMPT = 96  # a request's prompt holds 8 to this many tokens
SERVING_BASES = {"quick": 20_000, "default": 200_000}
"""``ngram_vocab_size_base`` of the synthesized table (~51 MB and ~512 MB of fp8 rows)."""


# ---------------------------------------------------------------------------------------- checkpoint
def synthesize_checkpoint(config: PLEConfig, out: Path, seed: int = 0, files: int = 4) -> Path:
    """Write random PLE weights in the published naming: ``config.json``, ``files`` safetensors
    files with shards spread over them in shuffled order, ``model.safetensors.index.json``; the
    table is fp8 e4m3 with one global scale (random bytes, ``|value| <= 1.875``, scale 0.02)."""
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
        tensors[prefix + "ple_embedding.ngram_embedding.weight_scale"] = torch.tensor([0.02], dtype=torch.float32)
        # random fp8 bytes with the top exponent bit cleared: |value| <= 1.875, never NaN
        bits = np.random.default_rng([seed, idx])
        for s in range(lay.split_parts):
            a, b = lay.shard_range(s)
            raw = bits.integers(0, 256, (b - a, lay.head_dim), dtype=np.uint8) & 0xBF
            tensors[prefix + f"ple_embedding.ngram_embedding.shard_{s}.weight"] = torch.from_numpy(raw).view(
                torch.float8_e4m3fn
            )
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

    from ple.runtime import Session

    cfg = layer.config
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    session = Session(layer, max_requests=args.slots, num_spec=args.num_spec)
    waiting = [_Request(i, rng.randint(8, _LONGEST_PROMPT), rng.randint(16, 48)) for i in range(args.requests)]
    live: dict[int, _Request] = {}
    phases = {p: {"steps": 0, "tokens": 0, "seconds": 0.0} for p in ("prefill", "decode", "verify")}
    lookups = 0
    worst = 0.0
    checked = 0
    bar = tqdm(total=args.requests, desc="ple demo", unit="req", disable=not progress)

    real = None if getattr(args, "synthetic_tokens", False) else token_stream(args, cfg)

    def tokens_of(r: _Request, n: int) -> list[int]:
        if real is not None:  # the request's own stretch of real text
            start = (r.rid * 4099 + len(r.tokens)) % (real.size - n)
            return real[start : start + n].tolist()
        return [cfg.eos_token_id if rng.random() < 0.03 else rng.randrange(cfg.vocab_size) for _ in range(n)]

    while waiting or live:
        while waiting and len(live) < args.slots:
            r = waiting.pop(0)
            session.add(r.rid)
            live[r.rid] = r
        inputs: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}
        spec: set[Hashable] = set()
        plan = {}
        # a step either decodes one token per running request or verifies a speculative chunk for
        # each (as an engine alternates draft-and-verify rounds); new requests' prefill chunks join it
        verify_step = bool(args.num_spec) and rng.random() < 0.3
        for r in live.values():
            done = len(r.tokens)
            if done < r.prompt:
                n, kind = min(args.chunk, r.prompt - done), "prefill"
            elif verify_step:
                n, kind = min(1 + args.num_spec, r.target - done), "verify"
            else:
                n, kind = 1, "decode"
            toks = tokens_of(r, n)
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


def check_real_text() -> None:
    """Raise :class:`~ple.data.realtext.RealTextError` saying what to install (``ple[demo]``) when the
    real-text tokenizer is missing (the demo serves real text unless ``--synthetic-tokens``)."""
    from ple.data.realtext import RealTextError, tokenizer

    try:
        tokenizer()
    except RealTextError as e:
        raise RealTextError(
            f"{e}. ple demo serves real text: pip install 'ple[demo]' (transformers, tiktoken, dashscope), "
            "or pass --synthetic-tokens"
        ) from e


def token_stream(args, cfg) -> np.ndarray:
    """The serving workload's tokens: the token input (:mod:`ple.data.tokens`, as every command reads
    it), by default the first ``REAL_TEXT_TOKENS`` of the real text; refused when shorter than the
    longest piece a step asks for, plus one."""
    from ple.data.tokens import read_tokens, token_source
    from ple.errors import CommandLineError

    if getattr(args, "tokens", None) is None:
        check_real_text()
    stream = np.concatenate(
        list(read_tokens(args, cfg.vocab_size, cfg.eos_token_id, real_text_default=REAL_TEXT_TOKENS))
    )
    longest = max(min(args.chunk, _LONGEST_PROMPT), 1 + args.num_spec)
    if stream.size <= longest:
        raise CommandLineError(
            f"{token_source(args, REAL_TEXT_TOKENS)}: {stream.size:,} tokens; the serving workload reads pieces "
            f"of up to {longest} tokens (--chunk, --num-spec) at offsets within them: give at least {longest + 1}"
        )
    return stream


def token_label(args) -> str:
    """The serving workload's tokens in a word or two: ``real text``, ``synthetic``, ``--text F``."""
    from ple.data.tokens import given_source

    if getattr(args, "synthetic_tokens", False):
        return "synthetic"
    given = given_source(args)
    return "real text" if given is None else str(given)


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
def _serving_config(args) -> tuple[PLEConfig, Path | None]:
    from ple.checkpoint import resolve_model

    if args.checkpoint:
        config, ckpt = resolve_model(args.checkpoint)
        if args.config:
            config = PLEConfig.from_pretrained(args.config)
        if ckpt is None:
            raise InvalidArgumentError(f"--checkpoint {args.checkpoint}: no safetensors weights there")
        return config, ckpt
    if args.config:
        return PLEConfig.from_pretrained(args.config), None
    cfg = json.loads(json.dumps(DEMO_CONFIG))
    cfg["text_config"]["ngram_vocab_size_base"] = SERVING_BASES["quick" if args.quick else "default"]
    return PLEConfig.from_dict(cfg), None


def run_serving(args, work: Path, progress: bool) -> dict[str, Any]:
    """The serving part: checkpoint (given or synthesized), table file, layer, workload, checks."""
    from ple.checkpoint import CheckpointError, scan_checkpoint
    from ple.convert.folder import default_table_dir, prepare_table
    from ple.layer import PLELayer
    from ple.runtime import tune_host_allocator

    tune_host_allocator()
    config, ckpt = _serving_config(args)
    if not 0 <= args.layer < config.num_ple_layers:  # before anything is written
        raise CommandLineError(
            f"--layer {args.layer}: the config has {config.num_ple_layers} PLE layer(s) (indexes into ple_layer_ids)"
        )
    if ckpt is None:
        t0 = time.perf_counter()
        ckpt = synthesize_checkpoint(config, work / "serving-checkpoint", seed=args.seed)
        source = "synthesized checkpoint (published format: fp8 table + global scale, 4 files)"
        synth_s = time.perf_counter() - t0
    else:
        source, synth_s = f"checkpoint {ckpt}", 0.0
    t0 = time.perf_counter()
    table: Table | None = None
    prepared = None
    if args.tier in FILE_TIERS:
        scan = scan_checkpoint(ckpt, config)
        if scan.all_problems:
            raise CheckpointError(scan.all_problems)
        entry = next(e for e in scan.layers if e.ple_layer_index == args.layer)
        # a given checkpoint's table file goes where from_pretrained keeps it (made once, reused)
        folder = default_table_dir(ckpt) if args.checkpoint else work / "serving-tables"
        prepared = prepare_table(
            entry, config, folder, progress=progress, table_format=getattr(args, "table_format", None)
        )
        assert prepared.table is not None  # opened while checked: the file served is the file checked
        # served as from_pretrained serves a table file: the same opener and defaults
        table = open_table(prepared.table, args.tier, memory_budget=getattr(args, "memory_budget", None))
    layer = PLELayer.from_checkpoint(ckpt, config, ple_layer_index=args.layer, progress=progress, table=table)
    load_s = time.perf_counter() - t0
    t = layer.table
    assert t is not None
    res = serve(layer, args, progress)
    res["tokens"] = token_label(args)
    info = format_info(t.format)
    row_bytes = info.row_nbytes(t.head_dim) + (4 if info.scale_kind == "row" else 0)
    lay = config.layout(args.layer)
    published = PLEConfig.from_dict(DEMO_CONFIG)
    res.update(
        source=source,
        published_geometry=all(
            getattr(config, k) == getattr(published, k)
            for k in ("hidden_size", "hc_count", "ple_embed_dim", "num_heads", "head_dim", "ple_conv_kernel_size")
        ),
        geometry=(
            f"H {config.hidden_size}, HC {config.hc_count}, E {config.ple_embed_dim}, "
            f"{lay.num_heads} heads of {lay.head_dim}, K {config.ple_conv_kernel_size}"
        ),
        tier=args.tier,
        table=f"{t.format} [{t.rows:,} x {t.head_dim}]",
        table_bytes=t.rows * row_bytes,
        table_file=None if prepared is None else {"path": str(prepared.path), "action": prepared.action},
        synthesize_seconds=synth_s,
        load_seconds=load_s,
        peak_rss_bytes=_peak_rss_bytes(),
        bytes_moved=res["lookups"] * row_bytes,
    )
    if isinstance(t, CachedTable):
        res["cache_hit_rate"] = t.hit_rate
    if isinstance(t, DirectTable):
        res["cache_hit_rate"] = t.hits / max(1, t.hits + t.misses)
    res["adapters"] = serve_adapters(layer, work, seed=args.seed)
    res["ok"] = res["checked_tokens"] > 0 and res["worst_error_vs_tolerance"] <= 1.0
    return res


def print_serving(res: dict[str, Any]) -> None:
    tf = res["table_file"]
    how = "" if tf is None else f", table file {tf['action']}"
    print(f"source   : {res['source']}")
    print(f"geometry : {res['geometry']}")
    print(f"table    : {res['table']}, {res['table_bytes'] / 1e6:,.0f} MB ({res['tier']}{how})")
    print(f"tokens   : {res.get('tokens', 'real text')}")
    print(f"load     : {res['load_seconds']:.2f} s\n")
    print("| phase   | steps | tokens | seconds | tokens/s |")
    print("|---------|------:|-------:|--------:|---------:|")
    for name, p in res["phases"].items():
        tps = p["tokens"] / p["seconds"] if p["seconds"] else 0.0
        print(f"| {name:7s} | {p['steps']:5d} | {p['tokens']:6d} | {p['seconds']:7.3f} | {tps:8.0f} |")
    print(f"\nrows read      : {res['lookups']:,} ({res['bytes_moved'] / 1e6:.2f} MB from the table)")
    if "cache_hit_rate" in res:
        print(f"cache hit rate : {res['cache_hit_rate']:.1%}")
    print(f"peak resident  : {res['peak_rss_bytes'] / 1e6:,.0f} MB (this process)")
    if res["ok"]:
        print(
            f"check          : every kept output ({res['checked_tokens']:,} tokens) equals the one-shot reference "
            f"(fp32, rtol = atol = 1e-5; worst {res['worst_error_vs_tolerance']:.2f} x the tolerance)"
        )
    else:
        print(
            f"check FAILED   : an output is {res['worst_error_vs_tolerance']:.2f} x the fp32 tolerance off the reference"
        )
    ad = res.get("adapters")
    if ad is not None:
        verdict = "equal" if ad["ok"] else "FAILED: not equal"
        print(
            f"adapters       : {ad['requests']} requests of adapters {', '.join(ad['adapters'])} and the base table in "
            f"one session ({ad['rows']:,} adapter rows): {verdict} to each adapter served alone, bit for bit"
        )
