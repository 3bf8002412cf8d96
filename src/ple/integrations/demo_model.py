"""The demo's model: a deterministic random-weight transformers ``qwen4_exp`` model whose PLE tables
dominate, saved in the published layout, and the side-by-side run of plain transformers and ple's
loader on it (each in a fresh process, see :mod:`ple.commands.demo.measure`).

The published layout: ``save_pretrained`` of a model patched with fp8 tables (one global scale per
table, ``ple_embedding.ngram_embedding.shard_{k}.weight`` + ``weight_scale``), sharded. transformers
5.24 reads such a table as a plain cast and drops the scale, so plain transformers gets the same
model as a copy with the tables dequantized to fp32 (:func:`ple.integrations.transformers.dequantize_checkpoint`):
the values ple's lookup produces, row for row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ple.errors import InvalidArgumentError, PLEError
from ple.table import MemoryTable

__all__ = [
    "model_config",
    "build_model",
    "randomize_ple_weights",
    "save_published",
    "check_workdir",
    "new_workdir",
    "write_checkpoints",
    "measure",
    "compare",
    "MeasureError",
    "MODEL_SIZES",
    "MODEL_DIRECT_BUDGET",
]


class MeasureError(PLEError, RuntimeError):
    """A measuring process failed: it exited with an error, was killed, ran past its time limit, or
    printed no report."""


# ngram_vocab_size_base per size: each PLE layer has about 4 x base rows of 32 values (every block
# format holds them: ``ple convert --to q4_0``, ``from_pretrained(table_format="iq4_nl")``)
MODEL_SIZES = {"quick": 30_000, "default": 300_000}

MODEL_DIRECT_BUDGET = 1 << 20
"""Bytes of rows each table of the model keeps in memory on the direct tier (``--memory-budget``
changes it): a small share of its table, which is what the direct tier is for."""


def model_config(base: int) -> dict[str, Any]:
    """A small ``qwen4_exp`` text model (hidden 64, 4 decoder layers, PLE on the first two; 4 heads
    of 32 values) whose two tables of ``~4 * base`` rows x 32 dominate its size."""
    return dict(
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        hc_count=2,
        hc_lowrank=8,
        ple_layer_ids=[1, 2],
        ple_embed_dim=128,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=base,
        make_ngram_vocab_size_divisible_by=128,
        split_ngram_parts=16,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )


def build_model(base: int, seed: int = 0):
    """The random-weight ``Qwen4ExpForCausalLM`` (eval mode, fp32), PLE conv and norms non-zero
    (transformers initializes them to zero, which would hide the table)."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**model_config(base))).eval()
    randomize_ple_weights(model, seed + 1)
    return model


def randomize_ple_weights(model, seed: int, table: bool = False) -> None:
    """Give every PLE weight of ``model`` random values from ``seed``: norms ``0.3 * N(0, 1)``, conv
    taps ``0.5 * N(0, 1)``, projections ``N(0, 1) / sqrt(fan_in)`` (transformers initializes norms and
    conv to zero, which would hide the table); with ``table``, the n-gram tables ``N(0, 1)`` too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ple." not in name:
                continue
            if name.endswith("ngram_embedding.weight"):
                if table:
                    p.copy_(torch.randn(p.shape, generator=g))
            elif ".norm_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def _quantize_global(weight: torch.Tensor) -> MemoryTable:
    """fp8 e4m3 with one scale (absmax / 448), chunk by chunk (no full-size temporaries)."""
    scale = (weight.abs().amax() / 448.0).clamp_min(1e-12).reshape(1).float()
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    step = 1 << 20
    for a in range(0, weight.shape[0], step):
        q[a : a + step] = (weight[a : a + step].float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return MemoryTable(q, scale)


def save_published(model, out: Path, max_shard_size: str = "64MB") -> dict[str, Any]:
    """``save_pretrained`` of ``model`` with fp8 tables (global scale) in the published layout."""
    from ple.integrations.transformers import ScaledTableWarning, patch

    patch(model, lambda weight, layer: _quantize_global(weight.detach()))
    with warnings.catch_warnings():  # the fp8 layout is the point here (the plain copy is made next)
        warnings.simplefilter("ignore", ScaledTableWarning)
        model.save_pretrained(out, max_shard_size=max_shard_size)
    files = sorted(out.glob("*.safetensors"))
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def _table_bytes_on_disk(folder: Path) -> int:
    """Bytes of the table tensors in a checkpoint folder (from the safetensors headers)."""
    from ple.checkpoint import checkpoint_files, read_header

    total = 0
    for f in checkpoint_files(folder):
        total += sum(e.nbytes for n, e in read_header(f).tensors.items() if ".ngram_embedding." in n)
    return total


def new_workdir(path: str | os.PathLike, command: str, keeps: str) -> Path:
    """The ``--workdir`` of ``ple demo`` and ``ple train``, one rule for both: an empty or new folder
    (made here, with its parents), so that nothing a run keeps there is mixed with an earlier run's;
    a folder holding anything is refused, naming what it holds, before any work is done. ``keeps``:
    what the command writes there, for the message."""
    work = Path(path)
    if work.exists() and not work.is_dir():
        raise InvalidArgumentError(f"--workdir {work} is not a folder: pass an empty or new folder")
    held = sorted(p.name for p in work.iterdir()) if work.is_dir() else []
    if held:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise InvalidArgumentError(
            f"--workdir {work} is not empty (it holds {shown}): {command} keeps {keeps} there and reuses "
            "nothing; pass an empty or new folder"
        )
    work.mkdir(parents=True, exist_ok=True)
    return work


def check_workdir(work: Path) -> None:
    """Refuse a folder that already holds the model part's checkpoints (before any work is done)."""
    for p in (work / "published", work / "plain"):
        if os.path.lexists(p):
            raise InvalidArgumentError(f"{p} exists: pass an empty --workdir")


def write_checkpoints(work: Path, base: int, seed: int = 0, progress: bool = False) -> dict[str, Any]:
    """Build the model, save it in the published layout (``work/published``) and as the dequantized
    copy plain transformers reads (``work/plain``); returns sizes and timings."""
    from transformers.utils import logging as hf_logging

    from ple.integrations.transformers import dequantize_checkpoint

    published, plain = work / "published", work / "plain"
    check_workdir(work)
    t0 = time.perf_counter()
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = build_model(base, seed)
        rows = [
            m.ple_embedding.ngram_embedding.weight.shape
            for m in model.modules()
            if type(m).__name__ == "Qwen4ExpTextPLELayer"
        ]
        table_memory = sum(r[0] * r[1] * 4 for r in rows)
        saved = save_published(model, published)
        del model
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    t1 = time.perf_counter()
    dequantize_checkpoint(published, plain, torch.float32)
    return {
        "published": str(published),
        "plain": str(plain),
        "tables": [list(r) for r in rows],
        "table_bytes_in_memory": table_memory,
        "published_files": saved["files"],
        "published_bytes": saved["bytes"],
        "published_table_bytes": _table_bytes_on_disk(published),
        "plain_bytes": sum(f.stat().st_size for f in plain.glob("*.safetensors")),
        "build_save_seconds": t1 - t0,
        "dequantize_seconds": time.perf_counter() - t1,
    }


def prompts(seed: int = 0, n: int = 4, length: int = 12) -> list[list[int]]:
    """Deterministic prompts of the demo model's vocabulary (one holds an EOS)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 1024, (n, length), generator=g)
    ids[0, length // 2] = 1
    return ids.tolist()


def measure(
    loader: str,
    checkpoint: Path,
    prompt_ids: list[list[int]],
    new_tokens: int,
    logits_out: Path,
    *,
    table_dir: Path | None = None,
    tier: str = "mmap",
    memory_budget: int | None = None,
    starts: int = 1,
    evict: bool = True,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run :mod:`ple.commands.demo.measure` in a fresh process; returns its JSON report.

    Raises :class:`MeasureError` when the process fails, is killed, runs past ``timeout`` seconds
    (then it is killed) or prints no report; the message ends with the last lines it wrote to stderr."""
    cmd = [sys.executable, "-m", "ple.commands.demo.measure", "--loader", loader, "--checkpoint", str(checkpoint)]
    cmd += ["--prompts", json.dumps(prompt_ids), "--new-tokens", str(new_tokens), "--logits", str(logits_out)]
    cmd += ["--tier", tier, "--starts", str(starts)]
    if memory_budget is not None:
        cmd += ["--memory-budget", f"{memory_budget}B"]
    if table_dir is not None:
        cmd += ["--table-dir", str(table_dir)]
    if evict:
        cmd.append("--evict")
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise MeasureError(
            f"the {loader} process ran past its {timeout:g} s limit and was stopped" + _tail(err)
        ) from None
    if proc.returncode != 0:
        how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"failed (exit {proc.returncode})"
        raise MeasureError(f"the {loader} process {how}" + _tail(proc.stderr))
    lines = proc.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        report = None
    if not isinstance(report, dict):
        raise MeasureError(f"the {loader} process printed no report" + _tail(proc.stderr))
    return report


def _tail(stderr: str, n: int = 6) -> str:
    lines = stderr.strip().splitlines()[-n:]
    return (":\n" + "\n".join(lines)) if lines else ""


def compare(
    work: Path,
    base: int,
    seed: int = 0,
    new_tokens: int = 16,
    tier: str = "mmap",
    progress: bool = False,
    say: Callable[[str], None] = lambda msg: None,
    memory_budget: int = MODEL_DIRECT_BUDGET,
) -> dict[str, Any]:
    """The side-by-side run: checkpoints, then plain transformers and ple in fresh processes, ple
    twice (a first start that converts the tables, a second, in a process of its own, that reuses
    them); each process starts with the files evicted from the page cache. ``memory_budget``: bytes
    of rows each table keeps in memory on the direct tier.

    ``memory_saved_share_of_tables`` is the drop in peak resident memory (ple: the higher of its two
    starts) over the memory the tables take in transformers minus what ple's tier keeps of them in
    memory (the fp8 rows for "memory", the cached rows for "cached", the row cache and read buffers
    for "direct"); ``memory_saved_anon_bytes`` / ``memory_saved_file_bytes`` split it into anonymous
    memory (the model's copy of the tables) and file pages (the checkpoint pages mapped while
    loading), which is why it can exceed 100 %."""
    say("writing the checkpoints (save_pretrained in the published layout, and a plain fp32 copy) ...")
    ck = write_checkpoints(work, base, seed, progress)
    ids = prompts(seed)
    tables = None if tier == "memory" else work / "tables"
    with tempfile.TemporaryDirectory(prefix="ple-demo-logits-") as tmp:
        lp, lq = Path(tmp) / "plain.pt", [Path(tmp) / "ple-1.pt", Path(tmp) / "ple-2.pt"]
        say("plain transformers: load and generate ...")
        plain = measure("plain", Path(ck["plain"]), ids, new_tokens, lp)
        starts = []
        for i, q in enumerate(lq):
            say(f"ple, {('1st', '2nd')[i]} start: load and generate ...")
            budget = memory_budget if tier == "direct" else None
            starts.append(
                measure(
                    "ple", Path(ck["published"]), ids, new_tokens, q, table_dir=tables, tier=tier, memory_budget=budget
                )
            )
        want, got = torch.load(lp), [torch.load(q) for q in lq]
    ple = {
        **starts[-1],
        "load_seconds": [s["load_seconds"][0] for s in starts],
        "generate_seconds": [s["generate_seconds"][0] for s in starts],
        "tables": [s["tables"][0] for s in starts],
        "peak_rss_bytes": max(s["peak_rss_bytes"] for s in starts),
        "peak_rss_bytes_per_start": [s["peak_rss_bytes"] for s in starts],
        "pids": [s["pid"] for s in starts],
        "peak_anon_bytes": max(s["peak_anon_bytes"] for s in starts),
        "peak_file_bytes": max(s["peak_file_bytes"] for s in starts),
        "table_tier_bytes": max(s["table_tier_bytes"] for s in starts),
    }
    tokens_equal = all(s["tokens"] == plain["tokens"] for s in starts)
    diff = max(float((want - g).abs().max()) if want.shape == g.shape else float("inf") for g in got)
    saved = plain["peak_rss_bytes"] - ple["peak_rss_bytes"]
    kept = ck["published_table_bytes"] if tier == "memory" else ple["table_tier_bytes"]
    beyond = ck["table_bytes_in_memory"] - kept
    return {
        "checkpoint": ck,
        "prompts": len(ids),
        "new_tokens": new_tokens,
        "plain": plain,
        "ple": ple,
        "tokens_equal": tokens_equal,
        "max_logit_diff": diff,
        "memory_saved_bytes": saved,
        "memory_saved_anon_bytes": plain["peak_anon_bytes"] - ple["peak_anon_bytes"],
        "memory_saved_file_bytes": plain["peak_file_bytes"] - ple["peak_file_bytes"],
        "table_bytes_kept_in_memory": kept,
        # a tier that keeps as much as the tables take leaves nothing to save: the check fails
        "memory_saved_share_of_tables": saved / beyond if beyond > 0 else 0.0,
    }
