"""Named adapters served at once, chosen per request: their cost beside the same steps on the base.

    python benchmarks/adapters_bench.py [--requests 64] [--adapters 8] [--steps 4] [--prefill 2048]
        [--repeat 9] [--rows 100000] [--counts 1 8 64] [--load-rows 1000000] [--load-repeat 3]
        [--table-base 300000] [--threads N] [--dir TMP] [--quick] [--json PATH]

One bf16 PLE layer at the published geometry (H 2560, HC 4, E 2560, 16 heads of 160, K 4; random
weights; a table of ``--table-base``: 300,000 gives 4.8 M rows, 1.5 GB), built as
``benchmarks/session_floor.py`` builds it. ``--adapters`` adapter files of ``--rows`` rows each are
written to a temporary folder (removed at the end). Each adapter holds every row its requests read
(so every lookup of a request that names it reads the adapter's row: the most work the adapter path
can have), topped up with random rows. Parts:

- **decode**: ``--steps`` decode steps of ``--requests`` requests (after a 16-token prompt each), the
  requests spread over the adapters (request r reads adapter r mod A), against the same steps with
  every request on the base; ``Session.step`` and ``begin``/``run``/``end``, the four interleaved in
  rotating order, each after an untimed reset of the state; the median of each round's own ratio
  (adapters / base of the same round).
- **prefill**: one request of ``--prefill`` tokens with an adapter against the same without, likewise.
- **apply**: ``NamedAdapters.apply`` (the named rows put in place after the base lookup), timed inside
  the adapter steps: what the adapters add to a step, in ms and as a share of the base step; and its
  last call made again back to back outside the step ("apply alone").
- **memory** (in a child process of its own, so that what the timing left in the allocator is not
  counted): resident memory (``VmRSS``, ``RssAnon``) of the model alone, then with 1, 8 and 64
  adapters (``--counts``) of ``--rows`` rows loaded (the files loaded under several names each), the
  adapters' own bytes (``NamedAdapters.nbytes``) and bytes per adapter row; then a session of
  ``--requests`` requests stepped on the base, the same steps with each request on an adapter, then
  both again (RSS after each): what choosing adapters leaves behind.
- **load**: ``load_adapter(model, path, name=...)`` of one adapter of ``--load-rows`` rows (bf16 rows;
  the file written once and in the page cache), median of ``--load-repeat`` (each removed after).

``--quick``: a small geometry (H 256, a table of 100,000 rows) and sizes, for a smoke test.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from session_floor import build_layer, interleaved, published  # noqa: E402
from train_bench import cpu_isa  # noqa: E402

from ple import PLEConfig, PLELayer, Session, tune_host_allocator  # noqa: E402
from ple.commands.bench.runner import machine_info, versions  # noqa: E402
from ple.ngram import ngram_ids  # noqa: E402
from ple.table.tiers.adapted import AdaptedTable, RowOverlay  # noqa: E402
from ple.table.tiers.named import NamedAdapters  # noqa: E402
from ple.train import load_adapter, remove_adapter, save_adapter  # noqa: E402

PROMPT = 16
"""Tokens of each decode request's prompt (prefilled before the timed steps)."""


def quick_config() -> PLEConfig:
    return PLEConfig(
        hidden_size=256,
        hc_count=4,
        ple_embed_dim=256,
        ngram_size=3,
        heads_per_ngram=8,
        vocab_size=248320,
        eos_token_id=248044,
        ngram_vocab_size_base=6250,
        make_ngram_vocab_size_divisible_by=128,
        ple_layer_ids=(2,),
    )


def make_layer(args) -> PLELayer:
    cfg = quick_config() if args.quick else published(args.table_base)
    return build_layer(cfg, torch.bfloat16)


# ---------------------------------------------------------------------------------------------- inputs
class Inputs:
    """The tokens and hidden states of the decode and prefill parts (fixed seeds), and the table rows
    each adapter's requests read."""

    def __init__(self, layer: PLELayer, requests: int, adapters: int, steps: int, prefill: int) -> None:
        cfg = layer.config
        c, dtype = cfg.hc_hidden_size, layer.dtype
        g = torch.Generator().manual_seed(1)
        self.requests, self.adapters, self.steps = requests, adapters, steps
        self.prompt_t = torch.randint(0, cfg.vocab_size, (requests, PROMPT), generator=g)
        self.prompt_h = torch.randn(requests, PROMPT, c, generator=g).to(dtype)
        self.step_t = torch.randint(0, cfg.vocab_size, (steps, requests), generator=g)
        self.step_h = torch.randn(steps, requests, c, generator=g).to(dtype)
        self.prefill_t = torch.randint(0, cfg.vocab_size, (prefill,), generator=g)
        self.prefill_h = torch.randn(prefill, c, generator=g).to(dtype)
        # the rows read: each request's whole sequence (prompt + decode tokens) from a fresh context
        seqs = torch.cat([self.prompt_t, self.step_t.T], dim=1)
        per_request = self._ids(layer, seqs).view(requests, -1)
        self.read = [
            torch.unique(torch.cat([per_request[r] for r in range(requests) if r % adapters == k]))
            for k in range(adapters)
        ]
        if prefill:  # the prefill request reads adapter 0
            self.read[0] = torch.unique(torch.cat([self.read[0], self._ids(layer, self.prefill_t.view(1, -1))]))

    @staticmethod
    def _ids(layer: PLELayer, seqs: torch.Tensor) -> torch.Tensor:
        cfg = layer.config
        n, length = seqs.shape
        qsl = torch.arange(0, n * length + 1, length, dtype=torch.int64)
        ctx = torch.full((n, cfg.ngram_size - 1), cfg.eos_token_id, dtype=torch.int64)
        return ngram_ids(seqs.reshape(-1), qsl, ctx, layer.layout, cfg.eos_token_id).reshape(-1)


def name_of(k: int) -> str:
    return f"a{k}"


def adapter_ids(table_rows: int, need: torch.Tensor, rows: int, g: torch.Generator) -> torch.Tensor:
    """``rows`` distinct row ids: ``need`` and random others (``need`` alone when it has ``rows`` or more)."""
    extra = rows - need.numel()
    if extra <= 0:
        return need
    pick = torch.randperm(table_rows, generator=g)[: rows + need.numel()]
    pick = pick[~torch.isin(pick, need)][:extra]
    return torch.cat([need, pick])


def write_adapter(layer: PLELayer, path: Path, ids: torch.Tensor, g: torch.Generator) -> Path:
    """An adapter file of bf16 rows at ``ids`` over ``layer``'s table (random values), written as a
    trained adapter is: an :class:`AdaptedTable` over the base, then ``save_adapter``."""
    base = layer.table
    overlay = RowOverlay(base.rows, base.head_dim, torch.bfloat16)
    for a in range(0, ids.numel(), 1 << 17):
        part = ids[a : a + (1 << 17)]
        overlay.put(part, (0.3 * torch.randn(part.numel(), base.head_dim, generator=g)).to(torch.bfloat16))
    layer.set_table(AdaptedTable(base, overlay))
    try:
        save_adapter(path, layer, dtype=torch.bfloat16)
    finally:
        remove_adapter(layer)
    return path


# ---------------------------------------------------------------------------------------------- timing
def _paired(samples: dict[str, list[float]], over: str, base: str) -> float:
    return statistics.median(a / b for a, b in zip(samples[over], samples[base]))


def decode_case(layer: PLELayer, inp: Inputs, repeat: int) -> dict:
    """``Session.step`` and ``begin``/``run``/``end`` decode steps, requests spread over the adapters,
    against the same on the base; interleaved."""
    R, steps = inp.requests, inp.steps
    sessions, saved = {}, {}
    for variant in ("base", "adapters"):
        s = Session(layer, R)
        for r in range(R):
            s.add(r, adapter=name_of(r % inp.adapters) if variant == "adapters" else None)
        with torch.no_grad():
            s.step({r: (inp.prompt_h[r], inp.prompt_t[r]) for r in range(R)})
        sessions[variant] = s
        saved[variant] = {r: s.prefix_state(r) for r in range(R)}
    inputs = [{r: (inp.step_h[s, r : r + 1], inp.step_t[s, r : r + 1]) for r in range(R)} for s in range(steps)]
    chunks = [{r: inp.step_t[s, r : r + 1] for r in range(R)} for s in range(steps)]

    def reset(variant):
        s = sessions[variant]
        for r in range(R):
            s.finish(r)
            s.add(r, from_state=saved[variant][r], adapter=name_of(r % inp.adapters) if variant == "adapters" else None)

    def by_step(variant):
        s = sessions[variant]
        return [torch.cat(list(s.step(inputs[i]).values())) for i in range(steps)]

    def by_phases(variant):
        s, outs = sessions[variant], []
        for i in range(steps):
            st = s.begin(chunks[i])
            outs.append(s.run(st, 0, inp.step_h[i]))
            s.end(st)
        return outs

    out = side_by_side(reset, by_step, by_phases, repeat, repeat, steps)
    for s in sessions.values():
        for r in range(R):
            s.finish(r)
    return {"case": f"decode {R} x 1, {steps} steps, {inp.adapters} adapters", **out}


def side_by_side(reset, by_step, by_phases, repeat: int, apply_repeat: int, steps: int) -> dict:
    """``by_step(variant)`` and ``by_phases(variant)`` (each a list of outputs) of both variants, "base"
    and "adapters": checked (the two ways give the same outputs; the adapters' differ from the base's in
    every output: their rows were read), then timed interleaved, each run after its ``reset(variant)``;
    then ``NamedAdapters.apply`` timed inside ``by_phases("adapters")``."""
    with torch.no_grad():
        checks = {}
        for variant in ("base", "adapters"):
            reset(variant)
            a = by_step(variant)
            reset(variant)
            checks[variant] = (a, by_phases(variant))
        same = all(torch.equal(x, y) for v in checks.values() for x, y in zip(*v))
        read = all(not torch.equal(x, y) for x, y in zip(checks["base"][0], checks["adapters"][0]))
        fns, resets = {}, {}
        for way, fn in (("Session.step", by_step), ("begin/run/end", by_phases)):
            for variant in ("base", "adapters"):
                fns[f"{variant}, {way}"] = functools.partial(fn, variant)
                resets[f"{variant}, {way}"] = functools.partial(reset, variant)
        samples = interleaved(fns, resets, repeat)
        apply_s, alone_s = time_apply(lambda: (reset("adapters"), by_phases("adapters")), apply_repeat, steps)
    return {
        "steps": steps,
        "outputs_equal": same,
        "adapter_rows_read": read,
        "samples": samples,
        "apply_s_per_step": apply_s,
        "apply_alone_s": alone_s,
    }


def prefill_case(layer: PLELayer, inp: Inputs, repeat: int) -> dict:
    """One prompt of ``--prefill`` tokens through adapter 0 against the same on the base."""
    tokens = inp.prefill_t.numel()
    session = Session(layer, 1)

    def reset(variant):
        for r in list(session.request_ids):
            session.finish(r)
        session.add(0, adapter=name_of(0) if variant == "adapters" else None)

    def by_step(variant):
        return [session.step({0: (inp.prefill_h, inp.prefill_t)})[0]]

    def by_phases(variant):
        st = session.begin({0: inp.prefill_t})
        out = session.run(st, 0, inp.prefill_h)
        session.end(st)
        return [out]

    out = side_by_side(reset, by_step, by_phases, repeat, max(3, repeat // 2), 1)
    for r in list(session.request_ids):
        session.finish(r)
    return {"case": f"prefill 1 x {tokens}, 1 adapter", **out}


def time_apply(run, repeat: int, steps: int) -> tuple[float, float]:
    """``NamedAdapters.apply`` per step: the median seconds of it timed inside ``run()`` (``steps`` steps a
    run; one untimed run first), and the median of its last call made again ``4 * repeat`` times back to
    back outside the step (the same arguments; what it costs without the step's other work around it)."""
    spent: list[float] = []
    last: list = []
    original = NamedAdapters.apply

    def timed(self, *a, **k):
        last[:] = [self, a, k]
        t0 = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            spent.append(time.perf_counter() - t0)

    NamedAdapters.apply = timed  # type: ignore[method-assign]
    try:
        run()
        spent.clear()
        per_run = []
        for _ in range(repeat):
            n = len(spent)
            run()
            per_run.append(sum(spent[n:]) / steps)
    finally:
        NamedAdapters.apply = original  # type: ignore[method-assign]
    self, a, k = last
    alone = []
    for _ in range(4 * repeat):  # the rows are overwritten in place with the same values each time
        t0 = time.perf_counter()
        original(self, *a, **k)
        alone.append(time.perf_counter() - t0)
    return statistics.median(per_run), statistics.median(alone)


def load_case(layer: PLELayer, folder: Path, rows: int, repeat: int) -> dict:
    """The time to load one adapter of ``rows`` rows by name (the file written once, then loaded
    ``repeat`` times, each removed after; the first load untimed)."""
    g = torch.Generator().manual_seed(5)
    path = folder / "load.safetensors"
    ids = torch.randperm(layer.table.rows, generator=g)[:rows]
    t0 = time.perf_counter()
    write_adapter(layer, path, ids, g)
    written = time.perf_counter() - t0
    times = []
    try:
        for i in range(repeat + 1):
            gc.collect()
            t0 = time.perf_counter()
            load_adapter(layer, path, name="load")
            dt = time.perf_counter() - t0
            held = layer.table_ref.adapters.find("load").overlay
            assert len(held) == rows, (len(held), rows)
            remove_adapter(layer, name="load")
            if i:
                times.append(dt)
    finally:
        size = path.stat().st_size
        path.unlink()
    return {"rows": rows, "file_bytes": size, "write_s": written, "load_s": times, "median_s": statistics.median(times)}


# ---------------------------------------------------------------------------------------------- memory
def _proc_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rss() -> dict:
    gc.collect()
    return {"rss_bytes": _proc_kb("VmRSS") * 1024, "anon_bytes": _proc_kb("RssAnon") * 1024}


def memory_child(args) -> dict:
    """In a process of its own: the model's resident memory, then with ``args.counts`` adapters
    loaded (the files of ``args.files``, each under several names), then a session stepped on the base
    and with every request on an adapter."""
    tune_host_allocator()
    layer = make_layer(args)
    files = sorted(Path(args.files).glob("a*.safetensors"))
    out: dict = {"model": rss(), "table_bytes": layer.table.nbytes, "loaded": []}
    named = 0
    for count in args.counts:
        while named < count:
            load_adapter(layer, files[named % len(files)], name=f"m{named}")
            named += 1
        held = layer.table_ref.adapters
        rows = sum(len(a.overlay) for a in held.entries())
        out["loaded"].append({"adapters": count, "rows": rows, "adapters_nbytes": held.nbytes, **rss()})
    cfg = layer.config
    R = args.requests
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(PROMPT + args.steps, R, cfg.hc_hidden_size, generator=g).to(layer.dtype)
    tokens = torch.randint(0, cfg.vocab_size, (PROMPT + args.steps, R), generator=g)
    session = Session(layer, R)
    out["session"] = []
    for variant in ("base", "adapters", "adapters", "base"):  # again each: what stays is no request's
        for r in range(R):
            session.add(r, adapter=f"m{r % named}" if variant == "adapters" else None)
        with torch.no_grad():
            session.step({r: (hidden[:PROMPT, r], tokens[:PROMPT, r]) for r in range(R)})
            for s in range(PROMPT, PROMPT + args.steps):
                session.step({r: (hidden[s : s + 1, r], tokens[s : s + 1, r]) for r in range(R)})
        out["session"].append({"variant": variant, **rss()})
        for r in range(R):
            session.finish(r)
    return out


def memory_case(args, folder: Path) -> dict:
    cmd = [sys.executable, __file__, "--child-memory", str(folder), "--counts", *map(str, args.counts),
           "--requests", str(args.requests), "--steps", str(args.steps), "--table-base", str(args.table_base)]  # fmt: skip
    if args.quick:
        cmd.append("--quick")
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if done.returncode != 0:
        raise RuntimeError(f"the memory child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- report
def report(res: dict) -> str:
    m = res["machine"]
    flags = ", ".join(sorted(m.get("cpu_flags") or [])) or "none of amx_tile, avx512_bf16, avx2"
    lines = [
        f"{m.get('cpu_model')} ({res['isa']}; flags {flags}), {m.get('cores')} cores, torch {res['versions']['torch']}, "
        f"{res['threads']} threads, bf16, CPU kernels {res['versions']['cpu_kernels']}; {res['geometry']}; "
        f"load average {res['load_start']} -> {res['load_end']}",
        "",
        "| case | base ms | adapters ms | adapters / base (median of the rounds' ratios) | goal | "
        "`NamedAdapters.apply` ms a step | apply / base step | apply alone ms | outputs equal, adapters read |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in res["timed"]:
        s = r["samples"]
        for how in ("Session.step", "begin/run/end"):
            base = statistics.median(s[f"base, {how}"]) / r["steps"] * 1e3
            over = statistics.median(s[f"adapters, {how}"]) / r["steps"] * 1e3
            ratio = _paired(s, f"adapters, {how}", f"base, {how}")
            apply_ms = r["apply_s_per_step"] * 1e3
            met = "met" if ratio <= 1.05 else "not met"
            lines.append(
                f"| {r['case']}, {how} | {base:.2f} | {over:.2f} | {ratio:.3f} | <= 1.05: {met} | {apply_ms:.3f} | "
                f"{100 * apply_ms / base:.1f} % | {r['apply_alone_s'] * 1e3:.3f} | {'yes' if r['outputs_equal'] else 'NO'}, "
                f"{'yes' if r['adapter_rows_read'] else 'NO'} |"
            )
    if "memory" in res:
        mem = res["memory"]
        mb = 1e6
        model = mem["model"]
        lines += [
            "",
            f"resident memory (a process of its own); the model alone: RSS {model['rss_bytes'] / mb:,.0f} MB, "
            f"anonymous {model['anon_bytes'] / mb:,.0f} MB (its table {mem['table_bytes'] / mb:,.0f} MB)",
            "",
            "| adapters loaded | rows | `NamedAdapters.nbytes` MB | bytes / adapter row | RSS MB | RSS - model MB "
            "| (RSS - model) / adapter row |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for e in mem["loaded"]:
            grown = e["rss_bytes"] - model["rss_bytes"]
            lines.append(
                f"| {e['adapters']} | {e['rows']:,} | {e['adapters_nbytes'] / mb:,.1f} | "
                f"{e['adapters_nbytes'] / e['rows']:.1f} | {e['rss_bytes'] / mb:,.0f} | {grown / mb:,.1f} | "
                f"{grown / e['rows']:.1f} |"
            )
        rounds = ", ".join(f"{e['variant']} {e['rss_bytes'] / mb:,.1f}" for e in mem["session"])
        lines += [
            "",
            f"a session of {res['requests']} requests ({PROMPT}-token prompts, {res['args']['steps']} decode steps), "
            f"stepped on the base, then each request on an adapter, then both again: RSS after each (MB) {rounds}",
        ]
    if "load" in res:
        ld = res["load"]
        lines += [
            "",
            f"load_adapter(model, path, name=...) of {ld['rows']:,} bf16 rows ({ld['file_bytes'] / 1e6:,.0f} MB file, "
            f"in the page cache): median {ld['median_s'] * 1e3:,.0f} ms of {len(ld['load_s'])} "
            f"({ld['rows'] / ld['median_s'] / 1e6:.2f} M rows/s, {ld['file_bytes'] / ld['median_s'] / 1e9:.2f} GB/s); "
            f"runs {', '.join(f'{t * 1e3:,.0f}' for t in ld['load_s'])} ms",
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8, help="adapters the decode requests are spread over")
    p.add_argument("--steps", type=int, default=4, help="decode steps a timed run")
    p.add_argument("--prefill", type=int, default=2048, help="prefill tokens (0: no prefill case)")
    p.add_argument("--repeat", type=int, default=9, help="timed rounds")
    p.add_argument("--rows", type=int, default=100_000, help="rows of each adapter")
    p.add_argument("--counts", type=int, nargs="+", default=[1, 8, 64], help="memory: adapters loaded, in turn")
    p.add_argument("--load-rows", type=int, default=1_000_000, help="rows of the adapter whose load is timed")
    p.add_argument("--load-repeat", type=int, default=3)
    p.add_argument("--table-base", type=int, default=300_000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the adapter files go (removed at the end)")
    p.add_argument("--part", nargs="+", choices=["decode", "prefill", "memory", "load"], default=None)
    p.add_argument("--quick", action="store_true", help="a small geometry and sizes (a smoke test)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--child-memory", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_memory is not None:
        args.files = args.child_memory
        print(json.dumps(memory_child(args)))
        return 0
    if args.quick:
        args.requests, args.adapters, args.steps, args.prefill = min(args.requests, 8), min(args.adapters, 4), 2, 64
        args.repeat, args.rows, args.counts = min(args.repeat, 3), 4000, [1, 4, 8]
        args.load_rows, args.load_repeat = 20_000, 2
    parts = set(args.part or ["decode", "prefill", "memory", "load"])
    tune_host_allocator()
    layer = make_layer(args)
    cfg = layer.config
    geometry = (
        f"H {cfg.hidden_size}, HC {cfg.hc_count}, E {cfg.ple_embed_dim}, {layer.layout.num_heads} heads of "
        f"{layer.layout.head_dim}, table {layer.table.rows:,} rows ({layer.table.nbytes / 1e9:.2f} GB)"
    )
    res: dict = {"machine": machine_info(), "isa": cpu_isa(), "versions": versions(), "geometry": geometry,
                 "threads": torch.get_num_threads(), "requests": args.requests, "args": vars(args), "timed": []}  # fmt: skip
    res["load_start"] = list(os.getloadavg())
    ok = True
    with tempfile.TemporaryDirectory(prefix="adapters-bench-", dir=args.dir) as tmp:
        folder = Path(tmp)
        inp = Inputs(layer, args.requests, args.adapters, args.steps, args.prefill)
        g = torch.Generator().manual_seed(4)
        res["adapter_rows"], res["adapter_rows_read"] = [], [int(r.numel()) for r in inp.read]
        for k in range(args.adapters):
            ids = adapter_ids(layer.table.rows, inp.read[k], args.rows, g)
            write_adapter(layer, folder / f"{name_of(k)}.safetensors", ids, g)
            res["adapter_rows"].append(int(ids.numel()))
        if parts & {"decode", "prefill"}:
            for k in range(args.adapters):
                load_adapter(layer, folder / f"{name_of(k)}.safetensors", name=name_of(k))
            if "decode" in parts and args.requests > 0:
                res["timed"].append(decode_case(layer, inp, args.repeat))
            if "prefill" in parts and args.prefill > 0:
                res["timed"].append(prefill_case(layer, inp, args.repeat))
            for k in range(args.adapters):
                remove_adapter(layer, name=name_of(k))
        if "load" in parts:
            res["load"] = load_case(layer, folder, args.load_rows, args.load_repeat)
        ok = all(r["outputs_equal"] and r["adapter_rows_read"] for r in res["timed"])
        if "memory" in parts:
            del layer, inp
            gc.collect()
            res["memory"] = memory_case(args, folder)
    res["load_end"] = list(os.getloadavg())
    print(report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
