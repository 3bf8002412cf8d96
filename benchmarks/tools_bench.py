"""Every table tool on a slice of the published table, beside the disk's limits measured in the same run.

    python benchmarks/tools_bench.py [--rows 4000000] [--dir /tmp] [--out tools.json]
    python benchmarks/tools_bench.py --rows 500000 --compare /path/to/other/checkout/src

A slice: one PLE layer at the published geometry (16 heads of 160 values, fp8 with a global scale,
the published config's hashing) with ``ngram_vocab_size_base`` reduced to give about ``--rows`` rows,
cut in shards of ``--shard-rows`` (default the published 2,500,012; at least two), as
``synthesize_checkpoint`` writes it (random fp8 bytes), plus a q4_0 GGUF of the same table; all
written to a folder of ``--dir`` and removed at the end. Two slices are timed, ``--rows`` and
``--small-rows`` (default a sixteenth): each tool's rate is the slope between them, which leaves out
what a run costs whatever its size (reading the dense weights, creating and syncing the file); the
projection for the published table adds that fixed cost back once.

Each tool runs in a child process of its own (``--compare SRC``: once with this checkout's sources
and once with SRC's, in alternating order, for rates measured side by side on a shared machine): the
child imports ple, drops the files it reads from the page cache (``posix_fadvise``: the source comes
from the disk, as it would at full size), then times the tool's own call (start-up left out) and
reports its peak RSS. The tools are ``ple convert`` (the fp8 copy, every ``--to`` format), ``ple
convert X.gguf`` (the GGUF copy), ``ple verify FILE`` and ``ple verify FILE --checkpoint CKPT`` (fp8
and iq4_nl files), and the copy ``from_pretrained(table_format="iq4_nl")`` makes (``write_layer_table``
of ``table_shards(entry, PreadReader())``, the call its table folder makes). Reported: rows/s, the
projected time for the published table's 320,001,536 rows, MB/s of the table bytes written (read for
verify) and, for the plain copies, that rate over the disk's sequential bandwidth: the smaller of
its sequential read and write (``fio``, 4 MiB ``O_DIRECT`` requests at depth 8; without fio, Python's
``O_DIRECT`` reads and writes), measured in the same run with its random 4 KiB read rate (``fio``
at depth 32, as ``benchmarks/disk_bench.py`` measures it). "cpu us/row" is the CPU time (every thread) a
row cost: on a machine shared with other work the wall-clock rate falls, this much less.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
PUBLISHED_ROWS = 320_001_536
FORMATS = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "mxfp4", "nvfp4", "fp8", "int8")
TOOLS = (
    "copy",
    *(f"to-{f}" for f in FORMATS),
    "gguf",
    "verify-fp8",
    "verify-iq4_nl",
    "verify-ckpt-fp8",
    "verify-ckpt-iq4_nl",
    "from-pretrained-iq4_nl",
)
PLAIN_COPIES = ("copy", "gguf")

# The child: argv = tool, json of paths (the slice's files, "out": the folder to write, "file": the
# table file to verify); prints one JSON line: seconds of the tool's call, peak RSS, table bytes moved.
_CHILD = r"""
import contextlib, io, json, os, resource, sys, time
tool, paths = sys.argv[1], json.loads(sys.argv[2])
from ple.commands.cli import build_parser, main
build_parser()  # every command's module imported before the clock starts

def drop(path):  # nothing of it in the page cache: it is read from the disk
    files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs] if os.path.isdir(path) else [path]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

out, ckpt, argv = paths["out"], paths["ckpt"], None
reads = [ckpt]
if tool == "copy":
    argv = ["convert", ckpt, out]
elif tool.startswith("to-"):
    argv = ["convert", ckpt, out, "--to", tool[3:]]
elif tool == "gguf":
    argv, reads = ["convert", paths["gguf"], out], [paths["gguf"]]
elif tool.startswith("verify-ckpt-"):
    argv, reads = ["verify", paths["file"], "--checkpoint", ckpt], [paths["file"], ckpt]
elif tool.startswith("verify-"):
    argv, reads = ["verify", paths["file"]], [paths["file"]]
for p in reads:
    drop(p)
usage0 = resource.getrusage(resource.RUSAGE_SELF)
cpu0 = usage0.ru_utime + usage0.ru_stime
t0 = time.perf_counter()
if argv is not None:
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
else:  # the copy from_pretrained(table_format="iq4_nl") makes: its table folder's call
    from ple.checkpoint import check_checkpoint, table_shards, write_layer_table
    from ple.config import PLEConfig
    from ple.common.safetensors import PreadReader
    cfg = PLEConfig.from_pretrained(ckpt)
    entry = check_checkpoint(ckpt, cfg, layers=[0]).layers[0]
    os.makedirs(out, exist_ok=True)
    with PreadReader() as reader:
        path = os.path.join(out, "t.iq4_nl.pletable")
        write_layer_table(table_shards(entry, reader), path, cfg, 0, to="iq4_nl", force=True)
    rc = 0
seconds = time.perf_counter() - t0
if tool.startswith("verify"):
    moved = os.path.getsize(paths["file"])
else:
    moved = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) if os.path.isdir(out) else 0
usage = resource.getrusage(resource.RUSAGE_SELF)
with open("/proc/self/status") as f:  # this process's own peak (ru_maxrss keeps the parent's across exec)
    rss = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
cpu = usage.ru_utime + usage.ru_stime - cpu0
print(json.dumps({"rc": rc, "seconds": seconds, "cpu_seconds": cpu, "maxrss": rss, "bytes": moved}))
"""


def cpu_isa() -> tuple[str, str]:
    """The CPU's model and its widest instruction set among AVX2, AVX-512, AVX-512 BF16 and AMX."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "baseline"
    for flag, label in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"), ("amx_tile", "AMX")):
        if flag in flags:
            isa = label
    return name, isa


def build(folder: Path, rows: int, shard_rows: int) -> dict[str, str]:
    """The slice's checkpoint and a q4_0 GGUF of the same table; returns their paths."""
    import gguf
    import numpy as np

    from ple import PLEConfig
    from ple.checkpoint import check_checkpoint, table_shards
    from ple.commands.demo import synthesize_checkpoint
    from ple.table.formats.encode import encode_rows

    cfg = json.loads((_REPO / "examples" / "published-config.json").read_text())
    text = cfg["text_config"]
    text["ngram_vocab_size_base"] = max(1000, rows // 16)
    probe = PLEConfig.from_dict(cfg).layout(0).padded_rows
    text["split_ngram_parts"] = max(2, -(-probe // shard_rows))
    config = PLEConfig.from_dict(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    ckpt = synthesize_checkpoint(config, folder / "ckpt", seed=0, files=1)
    lay = config.layout(0)
    entry = check_checkpoint(ckpt, config, layers=[0]).layers[0]
    parts = [encode_rows(r, s, "q4_0", threads=os.cpu_count() or 1).data for _, r, s in table_shards(entry)]
    raw = np.concatenate(parts)
    w = gguf.GGUFWriter(str(folder / "table.gguf"), arch="qwen4exp")
    p = "qwen4exp."
    w.add_key_value(
        p + "ple.layers", [i - 1 for i in config.ple_layer_ids], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
    )
    w.add_uint32(p + "ple.ngram_size", config.ngram_size)
    w.add_uint32(p + "ple.heads_per_ngram", config.heads_per_ngram)
    w.add_uint32(p + "embedding_length_per_layer_input", lay.head_dim)
    for key, values in (
        ("layer_multipliers", lay.multipliers),
        ("head_offsets", lay.head_offsets),
        ("head_vocab_sizes", lay.head_sizes),
    ):
        w.add_key_value(p + "ple." + key, list(values), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64)
    w.add_tensor("per_layer_token_embd.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    del raw, parts
    return {
        "ckpt": str(ckpt),
        "gguf": str(folder / "table.gguf"),
        "rows": lay.padded_rows,
        "shard_rows": lay.shard_rows,
    }


def _fio(path: Path, rw: str, size_mb: int, seconds: int, bs: str = "4M", depth: int = 8) -> float | None:
    """MB/s (rw read/write) or IOPS (randread) of ``fio`` with ``O_DIRECT``; None without fio."""
    if shutil.which("fio") is None:
        return None
    cmd = [
        "fio", "--name=probe", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", "--direct=1", f"--size={size_mb}M",
        "--ioengine=libaio", f"--iodepth={depth}", f"--runtime={seconds}", "--time_based", "--output-format=json",
    ]  # fmt: skip
    if rw != "write":
        cmd.append("--readonly")
    job = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return float(side["iops"]) if rw == "randread" else float(side["bw_bytes"]) / 1e6


def _python_seq(path: Path, write: bool, size_mb: int) -> float:
    """MB/s of sequential 4 MiB ``O_DIRECT`` requests from Python (fio's stand-in)."""
    import mmap

    buf = mmap.mmap(-1, 4 << 20)
    buf.write(os.urandom(4 << 20))
    fd = os.open(path, (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_DIRECT)
    t0 = time.perf_counter()
    try:
        for i in range(size_mb // 4):
            (os.pwritev if write else os.preadv)(fd, [buf], i * (4 << 20))
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)
    return size_mb / (time.perf_counter() - t0)


def disk(folder: Path, size_mb: int, seconds: int) -> dict[str, Any]:
    """Sequential write and read MB/s and random 4 KiB reads/s of the device under ``folder``."""
    path = folder / "disk-probe"
    try:
        if shutil.which("fio") is not None:
            write = _fio(path, "write", size_mb, seconds)
            read = _fio(path, "read", size_mb, seconds)
            iops = _fio(path, "randread", size_mb, seconds, bs="4k", depth=32)
            tool = "fio"
        else:
            write, read, iops, tool = (
                _python_seq(path, True, size_mb),
                _python_seq(path, False, size_mb),
                None,
                "python",
            )
    finally:
        path.unlink(missing_ok=True)
    return {"seq_write_MBps": write, "seq_read_MBps": read, "rand_read_4k_iops": iops, "tool": tool}


def run_tool(tool: str, src: Path, paths: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, tool, json.dumps(paths)], capture_output=True, text=True, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{tool} with {src} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    res = json.loads(lines[-1])
    if res["rc"] != 0:
        raise RuntimeError(f"{tool} with {src} exited {res['rc']}: {proc.stderr[-2000:]}")
    return res


def table_file(folder: Path) -> str:
    (f,) = [p for p in folder.iterdir() if p.name.endswith(".pletable")]
    return str(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4_000_000, help="rows of the slice (about)")
    p.add_argument("--small-rows", type=int, default=None, help="rows of the second slice (default rows/16; 0: none)")
    p.add_argument("--shard-rows", type=int, default=2_500_012, help="rows a shard (the published 2,500,012)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the slices are written (and removed)")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, of {', '.join(TOOLS)}")
    p.add_argument("--compare", default=None, help="another checkout's src folder, run side by side")
    p.add_argument("--repeat", type=int, default=1, help="runs of each tool (medians reported)")
    p.add_argument("--disk-seconds", type=int, default=5, help="seconds of each disk measurement (0: none)")
    p.add_argument("--disk-mb", type=int, default=2048, help="size of the disk probe file")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        p.error(f"unknown tools {unknown}: one of {', '.join(TOOLS)}")
    small_rows = args.rows // 16 if args.small_rows is None else args.small_rows
    sources = {"this": _REPO / "src"} | ({"other": Path(args.compare).resolve()} if args.compare else {})
    folder = Path(tempfile.mkdtemp(prefix="ple-tools-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        slices = {"big": build(folder / "big", args.rows, args.shard_rows)}
        if small_rows:
            slices["small"] = build(folder / "small", small_rows, args.shard_rows)
        for name, sl in slices.items():
            print(f"{name} slice: {sl['rows']:,} rows of 160 values in shards of {sl['shard_rows']:,}")
        print(f"(built in {time.perf_counter() - t0:.0f} s)")
        disk_res = disk(folder, args.disk_mb, args.disk_seconds) if args.disk_seconds > 0 else {}
        if disk_res:
            print(
                f"disk ({disk_res['tool']}): sequential write {disk_res['seq_write_MBps']:.0f} MB/s, read "
                f"{disk_res['seq_read_MBps']:.0f} MB/s, random 4 KiB reads {disk_res['rand_read_4k_iops'] or 0:,.0f}/s"
            )
        results = {t: {s: {n: [] for n in slices} for s in sources} for t in tools}
        for r in range(args.repeat):
            for i, tool in enumerate(tools):
                order = list(sources) if (r + i) % 2 == 0 else list(sources)[::-1]
                for s in order:
                    for n, sl in slices.items():
                        results[tool][s][n].append(_timed(tool, sources, s, sl, folder / n))
        report = summarize(results, {n: sl["rows"] for n, sl in slices.items()}, disk_res)
        name, isa = cpu_isa()
        how = f"the slope between {small_rows:,} and {args.rows:,} rows" if small_rows else "whole runs"
        print(f"\nCPU: {name} ({isa}), {os.cpu_count()} cores; rates from {how}; projected for {PUBLISHED_ROWS:,} rows")
        print(format_table(report, sources))
        if args.out:
            doc = {"cpu": name, "isa": isa, "cores": os.cpu_count(), "rows": slices["big"]["rows"],
                   "small_rows": slices["small"]["rows"] if small_rows else 0, "shard_rows": slices["big"]["shard_rows"],
                   "disk": disk_res, "sources": {k: str(v) for k, v in sources.items()}, "tools": report}  # fmt: skip
            Path(args.out).write_text(json.dumps(doc, indent=1))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _timed(tool: str, sources: dict, s: str, paths: dict, folder: Path) -> dict:
    """One timed run of ``tool`` with source tree ``s`` on the slice ``paths`` (files in ``folder``)."""
    work = folder / "work"
    work.mkdir(exist_ok=True)
    run = dict(paths, out=str(work / f"out-{tool}-{s}"))
    if tool.startswith("verify-"):
        fmt = tool.split("-")[-1]
        made = work / f"made-{fmt}"  # the file verified: made once, by this checkout, untimed
        if not made.exists():
            run_tool("copy" if fmt == "fp8" else f"to-{fmt}", sources["this"], dict(paths, out=str(made)))
        run["file"] = table_file(made)
    try:
        return run_tool(tool, sources[s], run)
    finally:
        shutil.rmtree(run["out"], ignore_errors=True)


def summarize(results: dict, rows: dict[str, int], disk_res: dict) -> dict:
    """Per tool and source: medians of the big slice's runs, and (with a small slice) the rate between
    the two (the slope, which leaves a run's fixed costs out), its fixed cost, and the projection."""
    seq = None
    if disk_res.get("seq_read_MBps") and disk_res.get("seq_write_MBps"):
        seq = min(disk_res["seq_read_MBps"], disk_res["seq_write_MBps"])
    report: dict[str, dict] = {}
    for tool, by_src in results.items():
        report[tool] = {}
        for s, by_slice in by_src.items():
            med = {
                n: {k: statistics.median(r[k] for r in runs) for k in ("seconds", "cpu_seconds", "bytes")}
                for n, runs in by_slice.items()
            }
            big = med["big"]
            entry = {
                "seconds": big["seconds"],
                "cpu_seconds": big["cpu_seconds"],
                "rows_per_s_whole": rows["big"] / big["seconds"],
                "peak_rss_MiB": max(r["maxrss"] for runs in by_slice.values() for r in runs) / 2**20,
            }
            d_rows, d_s, d_bytes, d_cpu = rows["big"], big["seconds"], big["bytes"], big["cpu_seconds"]
            fixed = 0.0
            if "small" in med and big["seconds"] > med["small"]["seconds"]:
                small = med["small"]
                d_rows, d_s = rows["big"] - rows["small"], big["seconds"] - small["seconds"]
                d_bytes, d_cpu = big["bytes"] - small["bytes"], big["cpu_seconds"] - small["cpu_seconds"]
                fixed = max(0.0, small["seconds"] - rows["small"] * d_s / d_rows)
            rate = d_rows / d_s
            entry |= {
                "rows_per_s": rate,
                "fixed_s": fixed,
                "projected_s": fixed + PUBLISHED_ROWS / rate,
                "MBps": d_bytes / 1e6 / d_s if d_bytes else None,
                "cpu_us_per_row": 1e6 * max(d_cpu, 0.0) / d_rows,
            }
            if tool in PLAIN_COPIES and seq and d_bytes:
                entry["of_disk"] = (d_bytes / 1e6 / d_s) / seq
            report[tool][s] = entry
        if len(by_src) == 2:
            a, b = (report[tool][s]["rows_per_s"] for s in by_src)
            report[tool]["speedup"] = a / b
    return report


def format_table(report: dict, sources: dict) -> str:
    cols = f"{'rows/s':>12s}{'320M rows':>11s}{'MB/s':>7s}{'of disk':>8s}{'cpu us/row':>11s}{'RSS MiB':>8s}"
    lines = [f"{'':24s}" + "".join(f"{s:^57s}" for s in sources), f"{'tool':24s}" + cols * len(sources)]
    if len(sources) == 2:
        lines[-1] += f"{'this/other':>11s}"
    for tool, by in report.items():
        line = f"{tool:24s}"
        for s in sources:
            e = by[s]
            t = e["projected_s"]
            shown = f"{t / 3600:.1f} h" if t >= 3600 else f"{t / 60:.1f} min"
            mbps = f"{e['MBps']:.0f}" if e.get("MBps") else "-"
            disk_share = f"{e['of_disk']:.2f}" if "of_disk" in e else "-"
            line += f"{e['rows_per_s']:>12,.0f}{shown:>11s}{mbps:>7s}{disk_share:>8s}"
            line += f"{e['cpu_us_per_row']:>11.2f}{e['peak_rss_MiB']:>8.0f}"
        if "speedup" in by:
            line += f"{by['speedup']:>10.1f}x"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
