"""One fresh process: load a qwen4_exp model (plain transformers, or ple's loader) and generate.

``python -m ple.commands.demo.measure --loader plain|ple --checkpoint DIR --prompts JSON --new-tokens N
--logits FILE [--table-dir DIR] [--tier mmap|cached|memory|direct] [--memory-budget SIZE]
[--starts K] [--evict]`` prints one JSON line: load and generate seconds (per start for ple), peak
resident memory (``VmHWM``: anonymous and file-backed pages, the number a process monitor shows)
with sampled peaks of each kind, the tables at the end (the bytes of the table files served, on disk;
resident: the resident pages of their mappings plus what the tier holds in memory itself, the
cached tier's rows or the direct tier's row cache and read buffers, the latter at their size), how
the table files were obtained, and the generated tokens; the step logits ``[steps, B, vocab]`` go to ``--logits`` (torch.save). ``--evict`` drops the
checkpoint's and the table files' pages from the page cache first, so that a load reads from disk.
``--starts 2`` loads (and generates) twice in the process: the second start reuses the table files.
``--threads`` sets torch's threads (default 1: for a tiny model more threads only add synchronization,
which on a busy machine costs seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

__all__ = ["main", "status_bytes", "mapped_bytes", "table_bytes", "evict"]


def status_bytes() -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon`` and ``RssFile`` of this process, in bytes (Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        import resource

        out["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def mapped_bytes(suffix: str) -> tuple[int, int]:
    """``(resident, mapped)`` bytes of this process's mappings of files whose name ends with ``suffix``."""
    resident = size = 0
    current = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                parts = line.split()
                if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                    current = len(parts) >= 6 and parts[-1].endswith(suffix)
                elif current and parts[0] == "Rss:":
                    resident += int(parts[1]) * 1024
                elif current and parts[0] == "Size:":
                    size += int(parts[1]) * 1024
    except OSError:
        pass
    return resident, size


def table_bytes(model) -> tuple[int, int]:
    """``(on disk, held)`` of a model from ple's loader: the bytes of the table files its PLE layers
    serve, and what their tiers hold in memory besides a mapping (a cached tier's rows, a direct
    tier's row cache and read buffers: :attr:`ple.table.DirectTable.nbytes`)."""
    from ple.integrations.transformers import patched_layers
    from ple.table import CachedTable, DirectTable

    files = held = 0
    for w in patched_layers(model):
        if w.table_path is not None:
            files += os.stat(w.table_path).st_size
        table = w.layer.table
        if isinstance(table, CachedTable):
            held += table.cache_nbytes
        elif isinstance(table, DirectTable):
            held += table.nbytes
    return files, held


def evict(paths) -> None:
    """Drop the files' clean pages from the page cache (``posix_fadvise(DONTNEED)``; no privileges).
    Paths that are not regular files (or are gone) are skipped: a FIFO is never waited on."""
    from ple.common.files import open_regular
    from ple.errors import PLEError

    for p in paths:
        try:
            fd = open_regular(p)
        except (OSError, PLEError):
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _Peaks:
    """Peak ``RssAnon`` / ``RssFile`` sampled every few milliseconds on a thread."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def sample(self) -> None:
        s = status_bytes()
        self.anon = max(self.anon, s.get("RssAnon", 0))
        self.file = max(self.file, s.get("RssFile", 0))

    def __enter__(self) -> _Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def main(argv: list[str] | None = None) -> int:
    from ple.common.argtypes import byte_size

    ap = argparse.ArgumentParser(prog="python -m ple.commands.demo.measure", description=__doc__.splitlines()[0])
    ap.add_argument("--loader", choices=["plain", "ple"], required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of equal-length token id lists")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--logits", required=True, help="where to torch.save the step logits")
    ap.add_argument("--table-dir")
    ap.add_argument("--tier", default="mmap")
    ap.add_argument(
        "--memory-budget", type=byte_size, default=None, help="--tier direct: rows each table keeps (65536B)"
    )
    ap.add_argument("--starts", type=int, default=1)
    ap.add_argument("--evict", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the demo's model is tiny)")
    args = ap.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(args.threads)

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from ple.checkpoint import checkpoint_files
    from ple.common.files import read_regular
    from ple.table import TABLE_SUFFIX

    ckpt = Path(args.checkpoint)
    tables = sorted(Path(args.table_dir).glob(f"*{TABLE_SUFFIX}")) if args.table_dir else []
    if args.evict:
        evict([*checkpoint_files(ckpt), *tables])
    ids = torch.tensor(json.loads(args.prompts))
    # imports before the clock starts: load time is the load, not Python importing the modeling code
    arch = json.loads(read_regular(ckpt / "config.json", "config.json"))["architectures"][0]
    model_class = getattr(transformers, arch)
    from ple.integrations.transformers import from_pretrained, patched_layers

    baseline = status_bytes().get("VmRSS", 0)
    loads, gens, prepared = [], [], []
    with _Peaks() as peaks:
        for start in range(max(1, args.starts)):
            t0 = time.perf_counter()
            if args.loader == "plain":
                model = model_class.from_pretrained(ckpt)
            else:
                budget = {"memory_budget": args.memory_budget} if args.memory_budget is not None else {}
                model = from_pretrained(ckpt, table_dir=args.table_dir, table_tier=args.tier, progress=False, **budget)
                prepared.append([None if w.prepared is None else w.prepared.action for w in patched_layers(model)])
            loads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    ids,
                    max_new_tokens=args.new_tokens,
                    do_sample=False,
                    return_dict_in_generate=True,
                    output_logits=True,
                )
            gens.append(time.perf_counter() - t0)
            resident, mapped = mapped_bytes(TABLE_SUFFIX)
            files, held = table_bytes(model) if args.loader == "ple" else (0, 0)
            tokens = out.sequences.tolist()
            logits = torch.stack(list(out.logits))
            if start < args.starts - 1:
                del model, out
    status = status_bytes()
    torch.save(logits, args.logits)
    report = {
        "loader": args.loader,
        "tier": args.tier if args.loader == "ple" else None,
        "load_seconds": loads,
        "generate_seconds": gens,
        "tables": prepared,
        "peak_rss_bytes": status.get("VmHWM", 0),
        "peak_anon_bytes": peaks.anon,
        "peak_file_bytes": peaks.file,
        "baseline_rss_bytes": baseline,
        "table_file_bytes": files,
        "table_resident_bytes": resident + held,
        "table_tier_bytes": held,
        "table_mapped_bytes": mapped,
        "tokens": tokens,
        "pid": os.getpid(),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
