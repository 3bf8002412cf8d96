"""What each table format costs a model that has learned something, and what an adapter buys:
the run behind docs/FORMATS.md's "Quality: perplexity and KL divergence".

    python benchmarks/eval_formats.py WORKDIR [--plot docs/formats_eval.png]

1. The demo's model (``ple train``'s: random weights, fp8 tables in the published layout) is trained
   on real text (:mod:`ple.data.tokens`: Python's documentation through Qwen's BPE, mapped into
   the model's 1,024 ids) as ``ple train`` trains it, every weight: ple's SparseAdam for the tables
   (lr 0.05), AdamW for the rest (lr 0.003), batches of 8 x 64 tokens, ``--steps`` steps (about one
   pass over the training part), both learning rates falling linearly to zero; the validation loss
   is measured every 50 steps (it has stopped falling quickly by the end).
2. The trained model is saved with its tables in bf16 (the trained rows at full precision written
   into the dequantized tables, then rounded to bf16 once): ``WORKDIR/trained``, the reference.
3. An adapter: the trained model's tables alone fine-tuned further (SparseAdam, lr 0.05, falling
   linearly) on the next
   ``--adapter-tokens`` tokens of the text, the other weights frozen: ``WORKDIR/adapter.safetensors``.
4. ``ple eval WORKDIR/trained --formats <every format ple converts to> --adapter ... --tokens
   WORKDIR/held_out.npy`` on held-out text (after everything trained on and the validation part),
   and the same model in the published layout (fp8, one global scale) on the same windows.

Every run's settings and the documents ``ple eval`` printed go to WORKDIR/report.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

FORMATS = "fp8,int8,q8_0,q5_1,q5_0,q4_1,q4_0,iq4_nl,mxfp4,nvfp4"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loss_on(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def train(model, opt, text: torch.Tensor, val: torch.Tensor, args, max_steps: int) -> list:
    """``max_steps`` steps, the learning rates falling linearly to zero; the validation curve."""
    from ple.commands.train.batches import windows

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / max_steps)
    model.train()
    curve = [(0, loss_on(model, val))]
    say(f"step 0: validation loss {curve[-1][1]:.4f}")
    for step in range(max_steps):
        ids = windows(text, args.batch, args.length, step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if (step + 1) % 50 == 0 or step + 1 == max_steps:
            curve.append((step + 1, loss_on(model, val)))
            say(f"step {step + 1}: validation loss {curve[-1][1]:.4f}")
    model.eval()
    return curve


def save_bf16_tables(model, adapter: Path, tmp: Path, out: Path) -> None:
    """``model`` (patched, trained) saved with its tables in bf16: the dequantized tables with the
    adapter's full-precision rows written in, rounded to bf16 once."""
    from transformers import AutoModelForCausalLM

    from ple.train import read_adapter

    model.save_pretrained(tmp, dequantize=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    tables = [m.ple_embedding.ngram_embedding for m in plain.modules() if type(m).__name__ == "Qwen4ExpTextPLELayer"]
    rows = read_adapter(adapter)
    with torch.no_grad():
        for i, emb in enumerate(tables):
            for ids, r in rows.chunks(i):
                emb.weight[ids] = r.float()
            emb.weight.data = emb.weight.data.to(torch.bfloat16)
    plain.save_pretrained(out)
    return plain


def ple_eval(*argv: str) -> dict:
    cmd = [sys.executable, "-m", "ple.commands.cli", "eval", *argv, "--json"]
    say(" ".join(cmd[2:]))
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stderr)
    return json.loads(res.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--adapter-tokens", type=int, default=65_536)
    ap.add_argument("--val-tokens", type=int, default=4_096)
    ap.add_argument("--eval-tokens", type=int, default=32_768)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--plot", default="docs/formats_eval.png")
    args = ap.parse_args()
    from ple.commands.train.loop import prepare_checkpoint
    from ple.data.realtext import token_documents
    from ple.data.tokens import read_tokens
    from ple.integrations.demo_model import save_published
    from ple.integrations.transformers import from_pretrained
    from ple.train import CombinedOptimizer, SparseAdam, save_adapter, trainable

    torch.manual_seed(0)
    torch.set_num_threads(1)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    published = prepare_checkpoint(work, "quick", 0)
    total = sum(doc.size + 1 for doc in token_documents())  # the whole real text, EOS after each document
    held_n = args.val_tokens + args.eval_tokens
    train_n = total - held_n
    cfg = json.loads((published / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    source = argparse.Namespace(real_text=train_n + held_n)  # as ple train reads it: the map from the training part
    stream = np.concatenate(list(read_tokens(source, text["vocab_size"], text["eos_token_id"], held_out=held_n)))
    train_ids, held = torch.from_numpy(stream[:train_n]), torch.from_numpy(stream[train_n:])
    first = train_ids[: train_n - args.adapter_tokens]
    second = train_ids[train_n - args.adapter_tokens :]
    val = held[: args.val_tokens].view(-1, args.length)
    test = held[args.val_tokens :].numpy()
    np.save(work / "held_out.npy", test)
    report: dict = {
        "settings": {k: v for k, v in vars(args).items()},
        "tokens": {
            "train": int(first.numel()),
            "adapter": int(second.numel()),
            "validation": args.val_tokens,
            "held_out": int(test.size),
        },  # fmt: skip
    }

    say(f"training every weight on {first.numel():,} tokens ...")
    model = from_pretrained(published, table_dir=work / "tables")
    table_opt = SparseAdam(trainable(model), lr=0.05)
    opt = CombinedOptimizer(table_opt, torch.optim.AdamW(model.parameters(), lr=3e-3))
    t0 = time.perf_counter()
    report["training"] = train(model, opt, first, val, args, args.steps)
    report["training_seconds"] = time.perf_counter() - t0
    save_adapter(work / "trained_rows.safetensors", model)
    plain = save_bf16_tables(model, work / "trained_rows.safetensors", work / "trained_fp32", work / "trained")
    del model

    say(f"an adapter: the tables alone, {second.numel():,} more tokens ...")
    model = from_pretrained(work / "trained", table_dir=work / "trained_tables")
    handles = trainable(model)
    model.requires_grad_(False)
    steps = second.numel() // (args.batch * args.length)
    report["adapter_training"] = train(model, SparseAdam(handles, lr=0.05), second, val, args, steps)
    save_adapter(work / "adapter.safetensors", model)
    del model

    save_published(plain, work / "trained_fp8")  # the published layout: fp8, one global scale
    common = ["--tokens", str(work / "held_out.npy"), "--ctx", str(args.ctx)]
    report["eval"] = ple_eval(
        str(work / "trained"), "--formats", FORMATS, "--adapter", str(work / "adapter.safetensors"),
        "--table-dir", str(work / "trained_tables"), *common, "--plot", args.plot,
    )  # fmt: skip
    report["eval_fp8_global"] = ple_eval(str(work / "trained_fp8"), "--table-dir", str(work / "fp8_tables"), *common)
    report["eval_untrained"] = ple_eval(str(published), "--table-dir", str(work / "tables"), *common)
    (work / "report.json").write_text(json.dumps(report, indent=1))
    say("done: " + str(work / "report.json"))


if __name__ == "__main__":
    main()
