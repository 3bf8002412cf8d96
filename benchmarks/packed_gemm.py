"""The projections' GEMM: ``F.linear`` against the weight packed once for oneDNN (``ple.kernels.cpu_gemm``), side by side.

    python benchmarks/packed_gemm.py [--rows 1,8,64,128,192,256,2048] [--out 12800] [--in 2560]
                                [--dtype bf16|fp32] [--threads N] [--repeat 11]

For each row count: the median ms of ``F.linear(x, w)`` and of ``ple.kernels.cpu_gemm.linear(x, w, packed)``
in rotating order (``x [rows, in]``, ``w [out, in]``, the published projections by default), their ratio,
whether the two give the same bits, and whether the layer takes the packed GEMM for that many rows on
this CPU (``PLE_PACKED_GEMM``, ``ple.kernels.cpu_gemm.max_rows()``). The packing itself is timed once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ple.commands.bench.runner import versions
from ple.kernels import cpu_gemm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,64,128,192,256,2048")
    p.add_argument("--out", type=int, default=12800)
    p.add_argument("--in", dest="inner", type=int, default=2560)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeat", type=int, default=11)
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows takes comma-separated integers, got {args.rows!r}")
    if not rows or min(rows) < 1 or args.out < 1 or args.inner < 1 or args.repeat < 1:
        p.error("--rows, --out, --in and --repeat must be positive")
    lacking = cpu_gemm.missing()
    if lacking is not None:
        print(f"no packed GEMM here: {lacking}", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(args.out, args.inner, generator=g) / args.inner**0.5).to(dtype)
    t0 = time.perf_counter()
    packed = cpu_gemm.PackedWeight(w)
    pack_ms = (time.perf_counter() - t0) * 1e3
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, w [{args.out}, {args.inner}], "
        f"packed in {pack_ms:.1f} ms; the layer's GEMM here: {versions()['cpu_gemm']}"
    )
    print("| rows | F.linear ms | packed ms | F.linear / packed | same bits | the layer takes it |")
    print("|---:|---:|---:|---:|---|---|")
    layer_packs = cpu_gemm.packing(dtype)
    for n in rows:
        x = torch.randn(n, args.inner, generator=g).to(dtype)
        fns = {"linear": lambda x=x: F.linear(x, w), "packed": lambda x=x: cpu_gemm.linear(x, w, packed)}
        same = torch.equal(fns["linear"](), fns["packed"]())
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for i in range(args.repeat):
            for k in list(fns)[i % 2 :] + list(fns)[: i % 2]:
                t = time.perf_counter()
                fns[k]()
                samples[k].append(time.perf_counter() - t)
        a, b = (statistics.median(samples[k]) * 1e3 for k in ("linear", "packed"))
        takes = "yes" if layer_packs and n <= cpu_gemm.max_rows() else "no"
        print(f"| {n} | {a:.3f} | {b:.3f} | {a / b:.2f} | {'yes' if same else 'no'} | {takes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
