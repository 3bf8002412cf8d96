"""The serving part's adapters: requests of two named adapters and of the base table in one session.

Two adapters are made over the serving layer's table (``ple.train.save_adapter``: random rows for an
overlapping half each of the rows the requests read), loaded by name (``ple.train.load_adapter(layer,
path, name=...)``), and six requests (two per adapter, two naming none) run together through chunked
prefill and decode steps. Each request's outputs must equal, bit for bit, those of the same packed
steps on the layer serving that request's adapter as its default (and the base, for the two naming
none); the files are removed at the end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["serve_adapters"]

_NAMES = ("legal", "medical")
_CHOSEN = ("legal", None, "medical", "legal", None, "medical")  # one request each
_PROMPTS = (23, 9, 31, 14, 17, 40)
_CHUNK = 16
_DECODE_STEPS = 6


def _steps(layer, seed: int) -> list[tuple[dict[int, torch.Tensor], torch.Tensor]]:
    """The packed steps: chunked prefill (``_CHUNK`` tokens a step) then decode; hidden per step."""
    cfg = layer.config
    g = torch.Generator().manual_seed(seed)
    prompts = {r: torch.randint(0, cfg.vocab_size, (n,), generator=g) for r, n in enumerate(_PROMPTS)}
    steps = []
    done = dict.fromkeys(prompts, 0)
    while any(done[r] < n for r, n in enumerate(_PROMPTS)):
        chunk = {}
        for r, n in enumerate(_PROMPTS):
            take = min(_CHUNK, n - done[r])
            chunk[r] = (
                prompts[r][done[r] : done[r] + take] if take else torch.randint(0, cfg.vocab_size, (1,), generator=g)
            )
            done[r] += take
        steps.append(chunk)
    steps += [{r: torch.randint(0, cfg.vocab_size, (1,), generator=g) for r in prompts} for _ in range(_DECODE_STEPS)]
    return [(c, torch.randn(sum(t.numel() for t in c.values()), cfg.hc_hidden_size, generator=g)) for c in steps]


def _run(layer, steps, chosen) -> list[dict]:
    from ple.runtime import Session

    session = Session(layer, max_requests=len(_PROMPTS))
    for r, name in enumerate(chosen):
        session.add(r, adapter=name)
    outs = []
    with torch.no_grad():
        for chunk, hidden in steps:
            step = session.begin(chunk)
            out = session.run(step, 0, hidden.to(layer.dtype))
            session.end(step)
            outs.append(step.split(out))
    for r in range(len(chosen)):
        session.finish(r)
    return outs


def _write(layer, steps, path: Path, seed: int) -> Path:
    """An adapter file over the layer's table: random rows for a random half of the rows ``steps`` read."""
    from ple.runtime import Batch
    from ple.table.tiers.adapted import AdaptedTable, RowOverlay
    from ple.train import remove_adapter, save_adapter

    cfg = layer.config
    read = []
    for chunk, _ in steps:
        tokens = torch.cat(list(chunk.values()))
        lens = [t.numel() for t in chunk.values()]
        batch = Batch.build(lens, [-1] * len(lens), torch.full((len(lens), cfg.ngram_size - 1), cfg.eos_token_id),
                            layer.new_state_pool(1))  # fmt: skip
        read.append(layer.ngram_ids(tokens, batch).reshape(-1))
    ids = torch.unique(torch.cat(read))
    g = torch.Generator().manual_seed(seed)
    ids = ids[torch.randperm(ids.numel(), generator=g)[: ids.numel() // 2]]
    base = layer.table
    overlay = RowOverlay(base.rows, base.head_dim)
    overlay.put(ids, torch.randn(ids.numel(), base.head_dim, generator=g))
    layer.set_table(AdaptedTable(base, overlay))
    try:
        save_adapter(path, layer)
    finally:
        remove_adapter(layer)
    return path


def serve_adapters(layer, work: Path, seed: int = 0) -> dict[str, Any]:
    """Run the check (see the module docstring); ``{"ok", "requests", "adapters", "rows", "seconds"}``."""
    from ple.train import load_adapter, read_adapter, remove_adapter

    t0 = time.perf_counter()
    steps = _steps(layer, seed)
    files = {
        name: _write(layer, steps, work / f"adapter-{name}.safetensors", seed + k + 1) for k, name in enumerate(_NAMES)
    }
    try:
        for named, path in files.items():
            load_adapter(layer, path, name=named)
        mixed = _run(layer, steps, _CHOSEN)
        equal = True
        for chosen in (*_NAMES, None):
            if chosen is None:
                remove_adapter(layer)
            else:
                load_adapter(layer, files[chosen])  # served alone, as the default
            alone = _run(layer, steps, (None,) * len(_CHOSEN))
            mine = [r for r, c in enumerate(_CHOSEN) if c == chosen]
            equal &= all(torch.equal(a[r], b[r]) for a, b in zip(mixed, alone) for r in mine)
        remove_adapter(layer)
        differs = not torch.equal(mixed[-1][0], alone[-1][0])  # the adapters were read
        rows = sum(e.trained_rows for path in files.values() for e in read_adapter(path).layers.values())
        for named in _NAMES:
            remove_adapter(layer, name=named)
    finally:
        for path in files.values():
            path.unlink(missing_ok=True)
    return {
        "ok": bool(equal and differs),
        "requests": len(_CHOSEN),
        "adapters": list(_NAMES),
        "rows": rows,
        "seconds": time.perf_counter() - t0,
    }
