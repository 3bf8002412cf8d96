"""What each table format costs against the published fp8 table: size, row error, layer-output error,
end-to-end agreement and lookup speed, all measured in one run (the numbers of docs/FORMATS.md).

    .venv/bin/python benchmarks/formats_bench.py [--quick] [--json out.json] [--work DIR]

1. sizes: bytes per 160-value row and for the published table (320,001,536 rows), exact.
2. row error: rows of N(0, 1) values times a per-row magnitude, stored as fp8 with one global scale
   (the published format); every other format quantizes the fp8 values (fp32) and its rows are
   compared with them: max over rows of max|err| / max|row|, and RMS(err) / RMS(row).
3. layer output: one PLE layer at the published layer geometry (hidden 2560, HC 4, 16 heads of 160;
   a shorter table: rows do not change the arithmetic), random weights; its output
   (``forward_padded``) with each format's table against the fp8 table's: relative RMS and max.
4. end to end: the demo's model with rows of 32 values (``ple_embed_dim`` 512, so every block format
   fits), saved with fp8 tables; ``from_pretrained(table_format=...)`` against the fp8 load: greedy
   continuations equal out of N prompts, and the mean KL divergence of the next-token distributions.
5. lookup speed: a table file of 2^20 rows per format; [2048 tokens x 16 heads] random-id lookups
   into bf16, median of several runs: in memory (``MemoryTable``), page-cached (``MmapTable``, file
   read once before), cold (``posix_fadvise(DONTNEED)`` on the file before each run, fresh ids).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ple.config import PLEConfig
from ple.layer import PLELayer
from ple.table import MemoryTable, MmapTable, format_info
from ple.table.files.table_file import TableFileWriter
from ple.table.formats.blocks import dequantize_blocks, nvfp4_global_scale, quantize_blocks
from ple.table.formats.catalog import BLOCK_FORMATS
from ple.table.formats.quantize import QuantStats, RowStats, quantize_global, quantize_rows

PUBLISHED_ROWS = 320_001_536
HEAD_DIM = 160
COMPARED = ("fp8_row", *BLOCK_FORMATS)


def _fp8_source(rows: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g) * torch.exp(0.5 * torch.randn(rows, 1, generator=g))
    return quantize_global(x)


def _as(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 rows ``x`` stored in ``fmt``."""
    if fmt == "fp8_row":
        return quantize_rows(x, "fp8_row")
    g = nvfp4_global_scale(float(x.abs().max())) if fmt == "nvfp4" else None
    q = torch.from_numpy(quantize_blocks(x, fmt, g))
    return q, (None if g is None else torch.tensor([g]))


def _values(q: torch.Tensor, s: torch.Tensor | None, fmt: str) -> torch.Tensor:
    if format_info(fmt).blocked:
        return dequantize_blocks(q, fmt, s)
    return q.float() * s


def sizes() -> dict:
    out = {}
    for fmt in ("bf16", "fp8", "fp8_row", *BLOCK_FORMATS):
        info = format_info(fmt)
        rb = info.row_nbytes(HEAD_DIM) + (4 if info.scale_kind == "row" else 0)
        total = PUBLISHED_ROWS * rb + (4 if info.scale_kind == "global" else 0)
        out[fmt] = {"row_bytes": rb, "bits_per_value": rb * 8 / HEAD_DIM, "published_bytes": total}
    return out


def row_error(rows: int) -> dict:
    q8, s8 = _fp8_source(rows, HEAD_DIM, seed=1)
    x = q8.float() * s8
    out = {}
    for fmt in COMPARED:
        t0 = time.perf_counter()
        q, s = _as(x, fmt)
        e = QuantStats()
        e.add(RowStats.of(x, _values(q, s, fmt)))
        out[fmt] = {**e.to_dict(), "quantize_s": time.perf_counter() - t0}
    return out


def _fill(layer: PLELayer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.startswith("norm_"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "conv" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    layer.refresh_weights()


def layer_error(tokens: int, table_base: int) -> dict:
    cfg = PLEConfig(
        hidden_size=2560,
        hc_count=4,
        ple_layer_ids=(2,),
        ple_embed_dim=2560,
        ngram_size=3,
        heads_per_ngram=8,
        ngram_vocab_size_base=table_base,
        make_ngram_vocab_size_divisible_by=128,
        vocab_size=248320,
        eos_token_id=248044,
    )
    lay = cfg.layout(0)
    layer = PLELayer(cfg, 0, torch.float32)
    _fill(layer, seed=2)
    q8, s8 = _fp8_source(lay.padded_rows, lay.head_dim, seed=3)
    x = q8.float() * s8
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=g)
    ids[0, ::100] = cfg.eos_token_id
    hidden = torch.randn(1, tokens, cfg.hc_hidden_size, generator=g)
    with torch.no_grad():
        layer.set_table(MemoryTable(q8, s8))
        ref = layer.forward_padded(hidden, ids)
        out = {"geometry": f"H 2560, HC 4, 16 heads of {lay.head_dim}, {lay.padded_rows:,} rows", "tokens": tokens}
        for fmt in COMPARED:
            q, s = _as(x, fmt)
            layer.set_table(MemoryTable(q, s, format=fmt))
            got = layer.forward_padded(hidden, ids)
            err = got - ref
            out[fmt] = {
                "rms_rel": float(err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()),
                "max_rel": float(err.abs().max() / ref.abs().max()),
            }
    return out


def end_to_end(work: Path, prompts_n: int, new_tokens: int) -> dict:
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    from ple.integrations.demo_model import model_config, randomize_ple_weights, save_published
    from ple.integrations.transformers import from_pretrained

    cfg = {**model_config(2000), "ple_embed_dim": 512}
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**cfg)).eval()
    randomize_ple_weights(model, 1, table=True)
    ckpt = work / "e2e-ckpt"
    save_published(model, ckpt)
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(2, 1024, (prompts_n, 16), generator=g)

    def run(m):
        with torch.no_grad():
            logits = m(input_ids=prompts, use_cache=False).logits.float()
            gen = m.generate(prompts, max_new_tokens=new_tokens, do_sample=False, pad_token_id=1)
        return logits.log_softmax(-1), gen[:, prompts.shape[1] :]

    base_lp, base_gen = run(from_pretrained(ckpt, table_dir=work / "e2e-tables"))
    out = {"prompts": prompts_n, "new_tokens": new_tokens, "table": f"2 tables of {32} values a row"}
    for fmt in BLOCK_FORMATS:
        lp, gen = run(from_pretrained(ckpt, table_dir=work / "e2e-tables", table_format=fmt))
        kl = (base_lp.exp() * (base_lp - lp)).sum(-1).mean()
        out[fmt] = {
            "greedy_equal": int((gen == base_gen).all(dim=1).sum()),
            "tokens_equal": float((gen == base_gen).float().mean()),
            "kl": float(kl),
        }
    return out


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def lookup_speed(work: Path, rows: int, reps: int) -> dict:
    block = 65537
    q8, s8 = _fp8_source(block, HEAD_DIM, seed=6)
    x = q8.float() * s8
    T, G = 2048, 16
    out: dict = {"rows": rows, "ids": [T, G], "threads": torch.get_num_threads()}
    for fmt in ("fp8", *BLOCK_FORMATS):
        q, s = (q8, s8) if fmt == "fp8" else _as(x, fmt)
        info = format_info(fmt)
        path = work / f"speed-{fmt}.pletable"
        with TableFileWriter(path, rows, HEAD_DIM, fmt, block, {"bench": fmt}, force=True) as w:
            for k in range(-(-rows // block)):
                a, b = w.shard_range(k)
                w.write_shard(k, q[: b - a], s if info.scale_kind == "global" else None)
        rb = info.row_nbytes(HEAD_DIM)
        res = {}
        g = torch.Generator().manual_seed(7)

        def timed(table, g=g) -> float:
            i = torch.randint(0, rows, (T, G), generator=g)
            t0 = time.perf_counter()
            table.lookup(i, torch.bfloat16, check=False)
            return time.perf_counter() - t0

        mem = MemoryTable(MmapTable.open(path).data.clone(), s if info.scale_kind == "global" else None, format=fmt)
        timed(mem)
        res["memory_s"] = statistics.median(timed(mem) for _ in range(reps))
        mapped = MmapTable.open(path)
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
        timed(mapped)
        res["cached_s"] = statistics.median(timed(mapped) for _ in range(reps))
        mapped.close()
        cold = []
        for _ in range(max(3, reps // 2)):
            _evict(path)
            t = MmapTable.open(path)
            cold.append(timed(t))
            t.close()
        res["cold_s"] = statistics.median(cold)
        for tier in ("memory", "cached", "cold"):
            sec = res[f"{tier}_s"]
            res[f"{tier}_rows_per_s"] = T * G / sec
            res[f"{tier}_gb_per_s"] = T * G * rb / sec / 1e9
        out[fmt] = res
        path.unlink()
    for fmt in BLOCK_FORMATS:
        for tier in ("memory", "cached", "cold"):
            out[fmt][f"{tier}_vs_fp8"] = out["fp8"][f"{tier}_s"] / out[fmt][f"{tier}_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--work", help="folder for the files made (default: a temporary one)")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: rows,layer,e2e,speed")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    q = args.quick
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        res: dict = {
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
            "torch": torch.__version__,
            "sizes": sizes(),
        }
        if "rows" not in skip:
            res["row_error"] = row_error(4096 if q else 131072)
            print("row error done", file=sys.stderr)
        if "layer" not in skip:
            res["layer_error"] = layer_error(64 if q else 512, 500 if q else 4000)
            print("layer error done", file=sys.stderr)
        if "e2e" not in skip:
            res["end_to_end"] = end_to_end(work, 4 if q else 32, 4 if q else 16)
            print("end to end done", file=sys.stderr)
        if "speed" not in skip:
            res["lookup"] = lookup_speed(work, (1 << 16) if q else (1 << 20), 3 if q else 7)
    text = json.dumps(res, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
