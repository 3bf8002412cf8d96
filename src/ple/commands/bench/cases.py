"""Named benchmark cases: each builds its inputs once and hands the runner callables to time.

A case compares three things on the same rows:

- ``ple``: :class:`ple.layer.PLELayer` called the way an engine calls it (a packed
  :class:`ple.runtime.Batch` and a state pool), or :func:`ple.ngram.ngram_ids` for ``ids``; the
  ``session-*`` cases run the same steps through the public :class:`ple.Session` (per-request
  inputs and outputs, contexts and states kept by the session);
- ``transformers``: ``Qwen4ExpTextPLELayer`` run as transformers runs it (padded
  ``[B, S, HC*H]`` tensors, ``hidden + module(hidden, ids, cache)``, its ``DynamicCache`` for decode);
- ``floor``: the two projections alone (``[T, E]`` with ``[HC*H + H, E]`` in the same dtype, the GEMM
  the layer runs: ``F.linear``, or on a CPU where :mod:`ple.kernels.cpu_gemm` packs bf16 weights, the packed
  GEMM for steps of up to its ``max_rows()`` rows), the arithmetic no implementation of the layer can avoid.

Before anything is timed the runner calls ``check(ple(), transformers())``: fp32 outputs must agree
within ``1e-4 * (1 + max|out|)``; bf16 outputs are judged against transformers run in fp32 on the same
(bf16-representable) weights and inputs: ple's error must be at most twice transformers' bf16 error
plus 1e-3. ``ids`` are compared exactly.

Geometry: the published one (H 2560, HC 4, E 2560, N 3, 8 heads per order, K 4, vocab 248320,
eos 248044) with a reduced table (``ngram_vocab_size_base`` 300,000: 16 heads of ~300k rows, 4.8 M
rows x 160; 3.1 GB in fp32, 1.5 GB in bf16), or the tiny :data:`QUICK` one for smoke runs.

Tokens: real text by default (:mod:`ple.data.realtext`: Qwen's BPE over Python's documentation; each
case's streams are consecutive pieces of it, the piece chosen by the case's salt), or uniform
random tokens with a fraction ``eos_rate`` of EOS (``token_source="synthetic"``, ``ple bench
--synthetic-tokens``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ple import ngram as ple_ngram
from ple.commands.bench.checks import BF16_ATOL, FP32_TOL, CheckResult, compare_outputs, dtype_name
from ple.config import PLEConfig
from ple.errors import InvalidArgumentError
from ple.kernels import cpu_gemm

__all__ = [
    "CASES",
    "Case",
    "BF16_ATOL",
    "CheckResult",
    "FP32_TOL",
    "compare_outputs",
    "Fixture",
    "Geometry",
    "Prepared",
    "PUBLISHED",
    "QUICK",
    "Targets",
    "gemm_tokens",
    "dtype_name",
    "select_cases",
    "step_traffic",
    "traffic_copy",
]


# ---------------------------------------------------------------------------------------------- geometry


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Model geometry and the shapes of every case."""

    hidden_size: int = 2560
    hc_count: int = 4
    embed_dim: int = 2560
    ngram_size: int = 3
    heads_per_ngram: int = 8
    conv_kernel_size: int = 4
    vocab_size: int = 248320
    eos_token_id: int = 248044
    table_base: int = 300_000
    table_divisor: int = 128
    seed: int = 1234
    eos_rate: float = 0.01  # fraction of EOS tokens in the random streams
    ids_shape: tuple[int, int] = (64, 1024)  # requests x tokens
    prefill_long: tuple[int, int] = (1, 2048)
    prefill_batch: tuple[int, int] = (8, 512)
    decode_requests: int = 64
    decode_steps: int = 32
    history: int = 16  # tokens of history each request has before decode / mixed steps
    mixed_decode: int = 56
    mixed_prefill: tuple[int, int] = (8, 256)  # continuation chunks: requests x tokens
    token_source: str = "real"  # "real" (ple.data.realtext) or "synthetic" (uniform random tokens)

    @property
    def config(self) -> PLEConfig:
        """The model's PLE fields as ple reads them (derived sizes: ``hc_hidden_size``, ``num_heads``, ...)."""
        return PLEConfig(
            hidden_size=self.hidden_size,
            hc_count=self.hc_count,
            ple_layer_ids=(2,),
            ple_embed_dim=self.embed_dim,
            ngram_size=self.ngram_size,
            heads_per_ngram=self.heads_per_ngram,
            ple_conv_kernel_size=self.conv_kernel_size,
            ngram_vocab_size_base=self.table_base,
            make_ngram_vocab_size_divisible_by=self.table_divisor,
            vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id,
            seed=self.seed,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line naming the geometry (which one ran is part of every report)."""
        base = dataclasses.replace(self, token_source="real")
        name = "published" if base == PUBLISHED else "quick" if base == QUICK else "custom"
        cfg = self.config
        lay = cfg.layout(0)
        return (
            f"geometry: {name} (H {self.hidden_size}, HC {self.hc_count}, E {self.embed_dim}, N {self.ngram_size}, "
            f"{lay.num_heads} heads of {lay.head_dim}, K {self.conv_kernel_size}; table base {self.table_base:,} = "
            f"{lay.padded_rows:,} rows); {self.token_source} tokens"
        )


PUBLISHED = Geometry()
QUICK = Geometry(
    hidden_size=40,
    embed_dim=48,
    table_base=1000,
    table_divisor=16,
    eos_rate=0.05,
    ids_shape=(8, 64),
    prefill_long=(1, 64),
    prefill_batch=(4, 16),
    decode_requests=8,
    decode_steps=4,
    history=5,
    mixed_decode=6,
    mixed_prefill=(2, 16),
)


# ---------------------------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Targets:
    """What a case should reach (None: no target). Ratios of medians."""

    speedup_min: float | None = None  # transformers / ple >= this
    floor_max: float | None = None  # ple / floor <= this

    def describe(self) -> str:
        parts = []
        if self.speedup_min is not None:
            parts.append(f">={self.speedup_min:g}x vs tf")
        if self.floor_max is not None:
            parts.append(f"<={self.floor_max:g}x floor")
        return ", ".join(parts) or "-"

    def met(self, speedup: float | None, over_floor: float | None) -> bool | None:
        if self.speedup_min is None and self.floor_max is None:
            return None
        ok = True
        if self.speedup_min is not None:
            ok &= speedup is not None and speedup >= self.speedup_min
        if self.floor_max is not None:
            ok &= over_floor is not None and over_floor <= self.floor_max
        return ok


@dataclasses.dataclass
class Prepared:
    """A built case: callables over inputs that already exist.

    ``ple`` and ``transformers`` return their outputs (the runner hands them to ``check``);
    ``reset`` restores the state both read (state pools, caches) and runs untimed before every
    call; ``aux`` are extra ple-side timings reported beside the main ones (e.g. building the
    step metadata).
    """

    shape: str
    tokens: int
    ple: Callable[[], Any]
    transformers: Callable[[], Any]
    check: Callable[[Any, Any], CheckResult]
    floor: Callable[[], Any] | None = None
    reset: Callable[[], None] | None = None
    aux: dict[str, Callable[[], Any]] = dataclasses.field(default_factory=dict)
    layer: Any = None  # the PLELayer the ple callable runs (for profiling)
    notes: str = ""


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str
    dtype: torch.dtype | None
    targets: Targets
    build: Callable[[Fixture], Prepared]
    description: str


# ---------------------------------------------------------------------------------------------- fixture


@contextlib.contextmanager
def _no_weight_init():
    """Skip ``nn.Embedding``/``nn.Linear`` random init: the fixture fills every weight itself, and
    initializing a multi-GB table only to overwrite it costs seconds."""
    saved = nn.Embedding.reset_parameters, nn.Linear.reset_parameters
    nn.Embedding.reset_parameters = lambda self: None
    nn.Linear.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Embedding.reset_parameters, nn.Linear.reset_parameters = saved


class _IdsOnly(nn.Module):
    """Stands in for transformers' ``nn.Embedding`` so its n-gram module returns the row ids.

    ``forward`` receives ``ids [B, S, G]`` and returns ``[B, S, G, 1]``, which the caller flattens
    to ``[B, S, G]``: everything before the lookup runs unchanged, the lookup costs nothing.
    """

    def __init__(self, device: torch.device):
        super().__init__()
        self.weight = torch.empty(0, device=device)  # the caller reads .weight.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.unsqueeze(-1)


class Fixture:
    """Lazily built models and inputs shared by the cases of one run.

    The transformers module is built once per dtype with the same bf16-representable weights
    (so fp32 runs on the bf16 weights are exact references for the bf16 check); its table is
    shared with the ple layer (:meth:`ple.layer.PLELayer.from_transformers`), never copied.
    """

    def __init__(
        self,
        geometry: Geometry,
        device: str | torch.device = "cpu",
        seed: int = 0,
        memory_budget: int | None = None,
    ):
        self.geometry = geometry
        self.device = torch.device(device)
        self.seed = seed
        self.memory_budget = memory_budget
        self._hf_config = None
        self._modules: dict[torch.dtype, nn.Module] = {}
        self._layers: dict[torch.dtype, Any] = {}
        self.direct_tables: dict[torch.dtype, Any] = {}
        """With ``memory_budget``: the direct tier serving each dtype's ple layer."""

    # ---------------------------------------------------------------- transformers side
    @property
    def hf_config(self):
        if self._hf_config is None:
            from transformers import Qwen4ExpTextConfig

            # the same fields under the same names as ple's config (checked in the tests)
            fields = dataclasses.asdict(self.geometry.config)
            fields = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items() if v is not None}
            self._hf_config = Qwen4ExpTextConfig(**fields, num_hidden_layers=2)
        return self._hf_config

    @property
    def ple_config(self) -> PLEConfig:
        return self.geometry.config

    @property
    def layer_idx(self) -> int:
        return self.hf_config.ple_layer_ids[0] - 1

    def module(self, dtype: torch.dtype) -> nn.Module:
        """transformers' ``Qwen4ExpTextPLELayer`` in ``dtype`` on the fixture's device."""
        if dtype not in self._modules:
            from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

            with _no_weight_init(), torch.device(self.device):
                mod = Qwen4ExpTextPLELayer(self.hf_config, self.layer_idx, 0)
            with torch.no_grad():
                for p in mod.parameters():
                    p.data = torch.empty(p.shape, dtype=dtype, device=self.device)
                _fill_weights(mod, self.seed)
            self._modules[dtype] = mod.eval()
        return self._modules[dtype]

    def layer(self, dtype: torch.dtype):
        """The ple layer sharing ``module(dtype)``'s weights and table (with ``memory_budget``:
        its table served by the direct tier instead, see :meth:`direct_table`)."""
        if dtype not in self._layers:
            from ple.layer import PLELayer

            layer = PLELayer.from_transformers(self.module(dtype))
            if self.memory_budget is not None:
                layer.table = self.direct_table(layer, dtype)
            self._layers[dtype] = layer
        return self._layers[dtype]

    def direct_table(self, layer, dtype: torch.dtype):
        """``layer``'s in-memory table written to a table file in a temporary folder (removed once
        open: the table keeps its descriptor) and served by :class:`~ple.table.DirectTable` with
        ``memory_budget`` bytes of rows in memory: half its cache pinned with the rows a warm-up
        stream reads most (100,000 tokens of the same source, away from the cases' text), the other
        half a running LRU cache; every other row read from disk (O_DIRECT) when a step needs it."""
        import os
        import shutil
        import tempfile
        from pathlib import Path

        from ple.table import DirectTable
        from ple.table.files.table_file import TABLE_SUFFIX, TableFileWriter

        mem = layer.table
        lay = layer.layout
        fields = layer.config.layout_fields(layer.ple_layer_index)
        folder = Path(tempfile.mkdtemp(prefix="ple-bench-table-"))
        path = folder / ("table" + TABLE_SUFFIX)
        try:
            with TableFileWriter(path, mem.rows, mem.head_dim, mem.format, lay.shard_rows, fields, force=True) as w:
                for k in range(-(-mem.rows // lay.shard_rows)):
                    lo = k * lay.shard_rows
                    w.write_shard(k, mem.data[lo : lo + lay.shard_rows].cpu())
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written pages leave the page cache
            finally:
                os.close(fd)
            assert self.memory_budget is not None
            table = DirectTable(path, fields, memory_budget=self.memory_budget)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        geo = self.geometry
        if geo.token_source == "real":
            from ple.data.realtext import token_stream

            warm = torch.from_numpy(token_stream(400_000, geo.eos_token_id)[300_000:])
        else:
            warm = self.tokens((100_000,), salt=4242).cpu()
        ids = ple_ngram.ngram_ids(
            warm,
            torch.tensor([0, warm.numel()]),
            ple_ngram.fresh_context(1, lay, geo.eos_token_id),
            lay,
            geo.eos_token_id,
        )
        table.pin(DirectTable.hot_rows(ids, table.cache_slots // 2))
        table.hits = table.misses = 0
        self.direct_tables[dtype] = table
        return table

    def table_report(self) -> dict[str, Any] | None:
        """What served ple's tables with ``memory_budget``: the tier, its budget, pinned rows and
        the hit rate of its cache over the run (per dtype); None for the in-memory table."""
        if self.memory_budget is None:
            return None
        out: dict[str, Any] = {"tier": "direct", "memory_budget_bytes": self.memory_budget}
        for dtype, t in self.direct_tables.items():
            seen = t.hits + t.misses
            out[dtype_name(dtype)] = {
                "cache_slots": t.cache_slots,
                "pinned_rows": t.pinned_rows,
                "hit_rate": t.hits / seen if seen else None,
                "rows_read": t.misses,
                "reader": t.reader_kind,
                "io": t.direct,
            }
        return out

    def ngram_module(self) -> nn.Module:
        """transformers' ``Qwen4ExpTextNGramEmbedding`` whose forward returns ``[B, S, G]`` row ids."""
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

        with _no_weight_init(), torch.device(self.device):
            emb = Qwen4ExpTextNGramEmbedding(self.hf_config, self.geometry.embed_dim, self.layer_idx, 0)
        emb.ngram_embedding = _IdsOnly(self.device)  # type: ignore[assignment]  # frees the (never touched) table
        return emb.eval()

    def new_cache(self):
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.hf_config)

    # ---------------------------------------------------------------- inputs
    def _gen(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + salt)

    def tokens(self, shape: tuple[int, ...], salt: int) -> torch.Tensor:
        """int64 tokens ``shape`` on the device: consecutive real text from a place set by ``salt``
        (``token_source="real"``), or uniform in ``[0, vocab)`` with a fraction ``eos_rate`` of EOS."""
        geo = self.geometry
        if geo.token_source == "real":
            from ple.data.realtext import token_stream

            n = math.prod(shape)
            skip = (salt * 7919) % 150_000
            flat = torch.from_numpy(token_stream(skip + n, geo.eos_token_id)[skip:])
            return flat.reshape(shape).to(self.device)
        if geo.token_source != "synthetic":
            raise InvalidArgumentError(f"token_source must be 'real' or 'synthetic', got {geo.token_source!r}")
        g = self._gen(salt)
        t = torch.randint(0, geo.vocab_size, shape, generator=g)
        eos = torch.rand(shape, generator=g) < geo.eos_rate
        return torch.where(eos, geo.eos_token_id, t).to(self.device)

    def hidden(self, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
        """Layer inputs ``N(0, 1)``, bf16-representable, in ``dtype`` on the device."""
        g = self._gen(salt)
        return torch.randn(shape, generator=g).bfloat16().to(device=self.device, dtype=dtype)

    def floor(self, rows: list[int], dtype: torch.dtype) -> Callable[[], Any]:
        """The projections alone: ``[n, E] x [HC*H + H, E]`` for each ``n`` in ``rows``, through the GEMM the
        layer runs (``F.linear``, or the packed one of :mod:`ple.kernels.cpu_gemm` where the layer takes it)."""
        geo = self.geometry
        g = self._gen(99)
        w = (
            torch.randn(geo.config.hc_hidden_size + geo.hidden_size, geo.embed_dim, generator=g) / geo.embed_dim**0.5
        ).to(device=self.device, dtype=dtype)
        xs = [torch.randn(n, geo.embed_dim, generator=g).to(device=self.device, dtype=dtype) for n in rows]
        packed = cpu_gemm.PackedWeight(w) if w.device.type == "cpu" and cpu_gemm.packing(dtype) else None

        def run():
            return [cpu_gemm.linear(x, w, packed) if cpu_gemm.use_packed(x, packed) else F.linear(x, w) for x in xs]

        return run


def _fill_weights(mod: nn.Module, seed: int) -> None:
    """Deterministic bf16-representable weights (the same values in every dtype), non-zero conv."""
    g = torch.Generator().manual_seed(seed)
    for name, p in mod.named_parameters():
        if name.endswith("ngram_embedding.weight"):
            _fill_table(p, g)
            continue
        if name.startswith("norm_"):
            v = 0.3 * torch.randn(p.shape, generator=g)
        elif name == "conv1d.weight":
            v = 0.5 * torch.randn(p.shape, generator=g)
        else:
            v = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
        p.copy_(v.bfloat16())


def _fill_table(table: torch.Tensor, g: torch.Generator, block_rows: int = 65537) -> None:
    """Random rows, tiled from one block of a prime number of rows (filling GBs of fresh normal
    samples would dominate the setup; a prime period never lines up with a head's offset)."""
    n = min(block_rows, table.shape[0])
    block = torch.randn(n, table.shape[1], generator=g).bfloat16().to(device=table.device, dtype=table.dtype)
    for start in range(0, table.shape[0], n):
        m = min(n, table.shape[0] - start)
        table[start : start + m].copy_(block[:m])


# ---------------------------------------------------------------------------------------------- builders


def _build_ids(fx: Fixture) -> Prepared:
    geo = fx.geometry
    r, s = geo.ids_shape
    tokens = fx.tokens((r, s), salt=1)
    flat = tokens.reshape(-1)
    qsl = torch.arange(0, r * s + 1, s, dtype=torch.int64, device=fx.device)
    layout = fx.ple_config.layout(0)
    ctx = ple_ngram.fresh_context(r, layout, geo.eos_token_id, device=fx.device)
    emb = fx.ngram_module()

    def ple():
        return ple_ngram.ngram_ids(flat, qsl, ctx, layout, geo.eos_token_id)

    def ple_unchecked():
        return ple_ngram.ngram_ids(flat, qsl, ctx, layout, geo.eos_token_id, check=False)

    def transformers():
        with torch.no_grad():
            return emb(tokens, None)

    def check(p, t):
        t = t.reshape(-1, geo.config.num_heads)
        if p.shape != t.shape or p.dtype != t.dtype:
            return CheckResult(False, f"ple ids {tuple(p.shape)} {p.dtype}, transformers {tuple(t.shape)} {t.dtype}")
        diff = int((p != t).sum())
        return CheckResult(diff == 0, "ids equal" if diff == 0 else f"{diff} ids differ", {"ids_differing": diff})

    return Prepared(
        shape=f"{r}x{s}",
        tokens=r * s,
        ple=ple,
        transformers=transformers,
        check=check,
        aux={"ple_ids_unchecked": ple_unchecked},
        notes="transformers: Qwen4ExpTextNGramEmbedding.forward with its embedding replaced by an identity "
        "(returns the ids); ple: the checked entry point ple.ngram.ngram_ids (aux: check=False)",
    )


def _prefill_references(fx: Fixture, mod, hidden: torch.Tensor, tokens: torch.Tensor):
    """transformers' module on fresh prompts ``hidden [R, S, HC*H]``, ``tokens [R, S]`` in the case's
    dtype, and the fp32 module on the same inputs (the reference both are judged against)."""

    def transformers():
        with torch.no_grad():
            return hidden + mod(hidden, tokens, None)

    def reference():
        m32 = fx.module(torch.float32)
        h32 = hidden.float()
        with torch.no_grad():
            return h32 + m32(h32, tokens, None)

    return transformers, reference


def _decode_references(fx: Fixture, hf, hist_h, hist_t, step_h: torch.Tensor, step_t: torch.Tensor):
    """Decode steps ``step_h [steps, R, HC*H]``, ``step_t [steps, R]`` through transformers' module
    (``hf``, an ``_HFRequests`` after the history ``hist_h``/``hist_t``), and through the fp32 module
    from the same history (the reference)."""
    steps = step_t.shape[0]

    def transformers():
        with torch.no_grad():
            return [hf(step_h[s][:, None], step_t[s][:, None]) for s in range(steps)]

    def reference():
        hf32 = _HFRequests(fx, fx.module(torch.float32), hist_h.float(), hist_t)
        with torch.no_grad():
            return [hf32(step_h[s][:, None].float(), step_t[s][:, None]) for s in range(steps)]

    return transformers, reference


def _prefill_builder(which: str, dtype: torch.dtype) -> Callable[[Fixture], Prepared]:
    def build(fx: Fixture) -> Prepared:
        from ple.runtime import Batch

        geo = fx.geometry
        r, s = geo.prefill_long if which == "long" else geo.prefill_batch
        c = geo.config.hc_hidden_size
        layer, mod = fx.layer(dtype), fx.module(dtype)
        tokens = fx.tokens((r, s), salt=10 + r)
        hidden = fx.hidden((r, s, c), dtype, salt=20 + r)
        flat_h, flat_t = hidden.reshape(r * s, c), tokens.reshape(-1)
        pool = layer.new_state_pool(r)
        ctx = ple_ngram.fresh_context(r, layer.layout, geo.eos_token_id)
        batch = Batch.build([s] * r, list(range(r)), ctx, pool, conv_window=layer.config.conv_window)

        def ple():
            with torch.no_grad():
                return layer(flat_h, flat_t, batch)

        transformers, reference = _prefill_references(fx, mod, hidden, tokens)

        return Prepared(
            shape=f"{r}x{s}",
            tokens=r * s,
            ple=ple,
            transformers=transformers,
            check=lambda p, t: compare_outputs(p, t, dtype, reference),
            floor=fx.floor([r * s], dtype),
            layer=layer,
            notes="ple: one packed batch of fresh requests; transformers: hidden + module(hidden [B, S, HC*H], ids, None)",
        )

    return build


def _restore_hf_cache(cache, layer_idx: int, snapshot: dict[int, torch.Tensor]) -> None:
    lay = cache.layers[layer_idx]
    for i, t in snapshot.items():
        lay.conv_states[i].copy_(t)


def _snapshot_hf_cache(cache, layer_idx: int) -> dict[int, torch.Tensor]:
    lay = cache.layers[layer_idx]
    return {i: lay.conv_states[i].clone() for i in (1, 2)}


class _HFRequests:
    """transformers' module with one ``DynamicCache`` holding a batch of requests' history."""

    def __init__(self, fx: Fixture, mod: nn.Module, hist_hidden: torch.Tensor, hist_tokens: torch.Tensor):
        self.fx, self.mod = fx, mod
        self.cache = fx.new_cache()
        with torch.no_grad():
            mod(hist_hidden, hist_tokens, self.cache)
        self.snapshot = _snapshot_hf_cache(self.cache, fx.layer_idx)

    def reset(self) -> None:
        _restore_hf_cache(self.cache, self.fx.layer_idx, self.snapshot)

    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return hidden + self.mod(hidden, tokens, self.cache)


def _warm_ple(fx: Fixture, layer, hist_hidden: torch.Tensor, hist_tokens: torch.Tensor):
    """Run every request's history through ``layer``: returns (state pool, ngram contexts [R, N-1])."""
    from ple.runtime import Batch

    geo = fx.geometry
    r, p = hist_tokens.shape
    pool = layer.new_state_pool(r)
    ctx = ple_ngram.fresh_context(r, layer.layout, geo.eos_token_id, device=fx.device)
    batch = Batch.build([p] * r, list(range(r)), ctx, pool, conv_window=layer.config.conv_window)
    flat_t = hist_tokens.reshape(-1)
    with torch.no_grad():
        layer(hist_hidden.reshape(r * p, -1), flat_t, batch)
    return pool, ple_ngram.next_ngram_context(flat_t, batch.query_start_loc, ctx)


def _decode_builder(dtype: torch.dtype) -> Callable[[Fixture], Prepared]:
    def build(fx: Fixture) -> Prepared:
        from ple.runtime import Batch

        geo = fx.geometry
        r, steps, p, c = geo.decode_requests, geo.decode_steps, geo.history, geo.config.hc_hidden_size
        layer, mod = fx.layer(dtype), fx.module(dtype)
        hist_t = fx.tokens((r, p), salt=30)
        hist_h = fx.hidden((r, p, c), dtype, salt=31)
        step_t = fx.tokens((steps, r), salt=32)
        step_h = fx.hidden((steps, r, c), dtype, salt=33)
        window = layer.config.conv_window

        pool, ctx0 = _warm_ple(fx, layer, hist_h, hist_t)
        pool_snapshot = pool.clone()
        one = torch.arange(r + 1, device=fx.device)

        def build_batches():
            out, ctx = [], ctx0
            for s in range(steps):
                out.append(Batch.build([1] * r, list(range(r)), ctx, pool, conv_window=window))
                ctx = ple_ngram.next_ngram_context(step_t[s], one, ctx)
            return out

        batches = build_batches()
        hf = _HFRequests(fx, mod, hist_h, hist_t)

        def reset():
            pool.copy_(pool_snapshot)
            hf.reset()

        def ple():
            with torch.no_grad():
                return [layer(step_h[s], step_t[s], batches[s]) for s in range(steps)]

        transformers, reference = _decode_references(fx, hf, hist_h, hist_t, step_h, step_t)

        return Prepared(
            shape=f"{r}x1 x{steps} steps",
            tokens=r * steps,
            ple=ple,
            transformers=transformers,
            check=lambda a, b: compare_outputs(a, b, dtype, reference),
            floor=fx.floor([r] * steps, dtype),
            reset=reset,
            aux={"ple_step_metadata": build_batches},
            layer=layer,
            notes=f"{r} requests with {p} tokens of history each, then {steps} steps of one token; times are per "
            f"{steps} steps. ple: decode Batch rows + state pool (metadata built outside the timed region; "
            "aux ple_step_metadata = Batch.build + next_ngram_context for all steps); transformers: its module "
            f"with DynamicCache(config) of batch {r}",
        )

    return build


def _mixed_builder(dtype: torch.dtype) -> Callable[[Fixture], Prepared]:
    def build(fx: Fixture) -> Prepared:
        from ple.runtime import DECODE, PREFILL, Batch

        geo = fx.geometry
        rd, (rp, chunk), p, c = geo.mixed_decode, geo.mixed_prefill, geo.history, geo.config.hc_hidden_size
        r = rd + rp
        layer, mod = fx.layer(dtype), fx.module(dtype)
        hist_t = fx.tokens((r, p), salt=40)
        hist_h = fx.hidden((r, p, c), dtype, salt=41)
        dec_t = fx.tokens((rd,), salt=42)
        dec_h = fx.hidden((rd, c), dtype, salt=43)
        pre_t = fx.tokens((rp, chunk), salt=44)
        pre_h = fx.hidden((rp, chunk, c), dtype, salt=45)

        pool, ctx = _warm_ple(fx, layer, hist_h, hist_t)
        pool_snapshot = pool.clone()
        batch = Batch.build(
            [1] * rd + [chunk] * rp,
            list(range(r)),
            ctx,
            pool,
            kinds=[DECODE] * rd + [PREFILL] * rp,
            has_initial_state=[True] * r,
            conv_window=layer.config.conv_window,
        )
        flat_h = torch.cat([dec_h, pre_h.reshape(rp * chunk, c)])
        flat_t = torch.cat([dec_t, pre_t.reshape(-1)])
        hf_dec = _HFRequests(fx, mod, hist_h[:rd], hist_t[:rd])
        hf_pre = _HFRequests(fx, mod, hist_h[rd:], hist_t[rd:])

        def reset():
            pool.copy_(pool_snapshot)
            hf_dec.reset()
            hf_pre.reset()

        def ple():
            with torch.no_grad():
                return layer(flat_h, flat_t, batch)

        def transformers():
            with torch.no_grad():
                return [hf_dec(dec_h[:, None], dec_t[:, None]), hf_pre(pre_h, pre_t)]

        def reference():
            m32 = fx.module(torch.float32)
            d32 = _HFRequests(fx, m32, hist_h[:rd].float(), hist_t[:rd])
            p32 = _HFRequests(fx, m32, hist_h[rd:].float(), hist_t[rd:])
            with torch.no_grad():
                return [d32(dec_h[:, None].float(), dec_t[:, None]), p32(pre_h.float(), pre_t)]

        return Prepared(
            shape=f"{rd}x1 + {rp}x{chunk}",
            tokens=rd + rp * chunk,
            ple=ple,
            transformers=transformers,
            check=lambda a, b: compare_outputs(a, b, dtype, reference),
            floor=fx.floor([rd + rp * chunk], dtype),
            reset=reset,
            layer=layer,
            notes=f"all {r} requests have {p} tokens of history; one step: {rd} decode rows + {rp} continuation "
            f"chunks of {chunk}. ple: one packed batch. transformers runs it as it must be run: two calls, the "
            f"decode rows with their cache (batch {rd}) and the chunks with theirs (batch {rp}). Padding all "
            f"rows to {chunk} in one call is not an option: transformers replaces padded ids with EOS (cutting "
            "the decode rows' n-gram history) and zero-pads the conv input between the cached window and the "
            "new token, so the decode rows' outputs would be wrong (and it would compute 64x256 rows).",
        )

    return build


def step_traffic(layer, tokens: int, requests: int, history_taps: int) -> tuple[int, int]:
    """(bytes read, bytes written) by the work beside the GEMM of one step of ``tokens`` tokens over
    ``requests`` requests, each token reading ``history_taps`` conv taps from the state (decode: K-1;
    a fresh prefill: 0), from the shapes and dtypes."""
    cfg, lay = layer.config, layer.layout
    act = layer.dtype.itemsize
    tab = layer.table.storage_dtype.itemsize
    c, h, g, e = cfg.hc_hidden_size, cfg.hidden_size, lay.num_heads, lay.embed_dim
    ctx = requests * (cfg.ngram_size - 1) * 8
    read = (
        tokens * 8  # tokens
        + ctx  # contexts
        + tokens * g * 8  # row ids
        + tokens * g * lay.head_dim * tab  # table rows
        + tokens * (c + h) * act  # the projections' outputs
        + tokens * c * act  # hidden
        + tokens * history_taps * c * act  # state taps
    )
    state_cols = min(tokens, requests * cfg.conv_window) if history_taps else min(tokens, cfg.conv_window)
    written = (
        tokens * g * 8  # row ids
        + tokens * e * act  # gathered rows (the GEMM's input)
        + tokens * c * act  # outputs
        + state_cols * c * act  # new state columns
        + ctx  # contexts
    )
    return read, written


def traffic_copy(nbytes: int, device: torch.device | str = "cpu") -> Callable[[], Any]:
    """A plain copy of ``nbytes`` bytes in all (half read, half written)."""
    half = max(1, nbytes // 2)
    src = torch.ones(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _session_decode_builder(dtype: torch.dtype) -> Callable[[Fixture], Prepared]:
    def build(fx: Fixture) -> Prepared:
        from ple.runtime import Session

        geo = fx.geometry
        r, steps, p, c = geo.decode_requests, geo.decode_steps, geo.history, geo.config.hc_hidden_size
        layer, mod = fx.layer(dtype), fx.module(dtype)
        hist_t = fx.tokens((r, p), salt=30)
        hist_h = fx.hidden((r, p, c), dtype, salt=31)
        step_t = fx.tokens((steps, r), salt=32)
        step_h = fx.hidden((steps, r, c), dtype, salt=33)
        session = Session(layer, r)
        for i in range(r):
            session.add(i)
        session.step({i: (hist_h[i], hist_t[i]) for i in range(r)})
        saved = {i: session.prefix_state(i) for i in range(r)}
        inputs = [{i: (step_h[s][i : i + 1], step_t[s][i : i + 1]) for i in range(r)} for s in range(steps)]
        hf = _HFRequests(fx, mod, hist_h, hist_t)
        copy = traffic_copy(sum(step_traffic(layer, r, r, geo.config.ple_conv_kernel_size - 1)), fx.device)

        def reset():
            for i in range(r):
                session.finish(i)
                session.add(i, from_state=saved[i])
            hf.reset()

        def ple():  # Session.step alone: the check joins its outputs, untimed
            with torch.no_grad():
                return [session.step(inputs[s]) for s in range(steps)]

        def joined(outs: list) -> list[torch.Tensor]:
            return [torch.cat(list(out.values())) for out in outs]

        transformers, reference = _decode_references(fx, hf, hist_h, hist_t, step_h, step_t)

        return Prepared(
            shape=f"{r}x1 x{steps} steps",
            tokens=r * steps,
            ple=ple,
            transformers=transformers,
            check=lambda a, b: compare_outputs(joined(a), b, dtype, reference),
            floor=fx.floor([r] * steps, dtype),
            reset=reset,
            aux={"traffic": lambda: [copy() for _ in range(steps)]},
            layer=layer,
            notes=f"{r} requests with {p} tokens of history each, then {steps} steps of one token through "
            "ple.Session.step ({request: (hidden, tokens)} in, {request: new hidden} out; the session packs the "
            "batch, keeps contexts and states); times are per "
            f"{steps} steps. transformers: its module with DynamicCache(config) of batch {r}. aux 'traffic': a plain "
            "copy of the bytes the work beside the GEMM must read and write (step_traffic), the traffic floor",
        )

    return build


def _session_prefill_builder(dtype: torch.dtype) -> Callable[[Fixture], Prepared]:
    def build(fx: Fixture) -> Prepared:
        from ple.runtime import Session

        geo = fx.geometry
        r, s, c = *geo.prefill_long, geo.config.hc_hidden_size
        layer, mod = fx.layer(dtype), fx.module(dtype)
        tokens = fx.tokens((r, s), salt=10 + r)
        hidden = fx.hidden((r, s, c), dtype, salt=20 + r)
        session = Session(layer, r)
        inputs = {i: (hidden[i], tokens[i]) for i in range(r)}

        def reset():
            for i in list(session.request_ids):
                session.finish(i)
            for i in range(r):
                session.add(i)

        def ple():
            with torch.no_grad():
                return list(session.step(inputs).values())

        transformers, reference = _prefill_references(fx, mod, hidden, tokens)

        return Prepared(
            shape=f"{r}x{s}",
            tokens=r * s,
            ple=ple,
            transformers=transformers,
            check=lambda p, t: compare_outputs(p, t, dtype, reference),
            floor=fx.floor([r * s], dtype),
            reset=reset,
            layer=layer,
            notes="ple: fresh requests' prompts through ple.Session.step; transformers: hidden + module(hidden, ids, None)",
        )

    return build


# The targets are the goals: what ple adds to the GEMM it cannot avoid (ple / floor, bf16, the dtype
# served). Speed-ups against transformers are reported, not targeted: they measure transformers.
CASES: tuple[Case, ...] = (
    Case("ids", "ids", None, Targets(), _build_ids, "n-gram row ids of a [R, S] token batch"),
    Case(
        "prefill-long-bf16",
        "prefill",
        torch.bfloat16,
        Targets(floor_max=1.3),
        _prefill_builder("long", torch.bfloat16),
        "one long fresh prompt",
    ),
    Case(
        "prefill-batch-bf16",
        "prefill",
        torch.bfloat16,
        Targets(floor_max=1.3),
        _prefill_builder("batch", torch.bfloat16),
        "a batch of fresh prompts",
    ),
    Case(
        "prefill-long-fp32",
        "prefill",
        torch.float32,
        Targets(),
        _prefill_builder("long", torch.float32),
        "one long fresh prompt",
    ),
    Case(
        "prefill-batch-fp32",
        "prefill",
        torch.float32,
        Targets(),
        _prefill_builder("batch", torch.float32),
        "a batch of fresh prompts",
    ),
    Case(
        "decode-bf16",
        "decode",
        torch.bfloat16,
        Targets(floor_max=1.3),
        _decode_builder(torch.bfloat16),
        "decode steps",
    ),
    Case("decode-fp32", "decode", torch.float32, Targets(), _decode_builder(torch.float32), "decode steps"),
    Case(
        "session-decode-bf16",
        "decode",
        torch.bfloat16,
        Targets(floor_max=1.15),
        _session_decode_builder(torch.bfloat16),
        "decode steps through ple.Session",
    ),
    Case(
        "session-decode-fp32",
        "decode",
        torch.float32,
        Targets(floor_max=1.15),
        _session_decode_builder(torch.float32),
        "decode steps through ple.Session",
    ),
    Case(
        "session-prefill-bf16",
        "prefill",
        torch.bfloat16,
        Targets(floor_max=1.1),
        _session_prefill_builder(torch.bfloat16),
        "one long prompt through ple.Session",
    ),
    Case(
        "mixed-bf16",
        "mixed",
        torch.bfloat16,
        Targets(),
        _mixed_builder(torch.bfloat16),
        "decode rows and continuation chunks in one step",
    ),
)


def gemm_tokens(case: Case, geo: Geometry) -> int:
    """Rows one call of ``case`` sends through the projections' GEMM (0 for ``ids``): what its run
    time scales with, for the runner's estimate before anything is built."""
    if case.kind == "ids":
        return 0
    if case.kind == "prefill":
        r, s = geo.prefill_batch if "batch" in case.name else geo.prefill_long
        return r * s
    if case.kind == "decode":
        return geo.decode_requests * geo.decode_steps
    return geo.mixed_decode + geo.mixed_prefill[0] * geo.mixed_prefill[1]


def select_cases(spec: str | None) -> list[Case]:
    """Cases named by a comma-separated list of names, prefixes (``prefill``) or globs (``*-bf16``);
    None or ``all`` selects every case. Unknown names raise ``ValueError`` listing the known ones, and
    so does an empty list (say ``all``: an unset variable in a script must not select every case)."""
    import fnmatch

    if spec is None or spec.strip() == "all":
        return list(CASES)
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise InvalidArgumentError(
            f"--cases {spec!r} names no case (say 'all' for every case); known cases: {', '.join(c.name for c in CASES)}"
        )
    chosen: list[Case] = []
    for part in parts:
        hits = [c for c in CASES if c.name == part or c.name.startswith(part + "-") or fnmatch.fnmatch(c.name, part)]
        if not hits:
            raise InvalidArgumentError(
                f"no benchmark case matches {part!r}; known cases: {', '.join(c.name for c in CASES)}"
            )
        chosen.extend(c for c in hits if c not in chosen)
    return chosen
