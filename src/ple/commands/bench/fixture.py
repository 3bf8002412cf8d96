"""What every benchmark case is built from: the geometry (published or quick), the targets, a case's
record, and :class:`Fixture`, which makes each layer, transformers module, table and input once, with
deterministic contents, for the cases that ask for them."""

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
from ple.commands.bench.checks import CheckResult, dtype_name
from ple.config import PLEConfig
from ple.errors import InvalidArgumentError
from ple.kernels import cpu_gemm


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


@contextlib.contextmanager
def no_weight_init():
    """Skip ``nn.Embedding``/``nn.Linear`` random init: the fixture fills every weight itself, and
    initializing a multi-GB table only to overwrite it costs seconds."""
    saved = nn.Embedding.reset_parameters, nn.Linear.reset_parameters
    nn.Embedding.reset_parameters = lambda self: None
    nn.Linear.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Embedding.reset_parameters, nn.Linear.reset_parameters = saved


class IdsOnly(nn.Module):
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

            with no_weight_init(), torch.device(self.device):
                mod = Qwen4ExpTextPLELayer(self.hf_config, self.layer_idx, 0)
            with torch.no_grad():
                for p in mod.parameters():
                    p.data = torch.empty(p.shape, dtype=dtype, device=self.device)
                fill_weights(mod, self.seed)
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
        from ple.table.files.table_file import TABLE_SUFFIX
        from ple.table.files.writer import TableFileWriter
        from ple.table.tiers.open import open_table

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
            table = open_table(path, "direct", memory_budget=self.memory_budget, expected_layout_hash=fields)
            assert isinstance(table, DirectTable)
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

        with no_weight_init(), torch.device(self.device):
            emb = Qwen4ExpTextNGramEmbedding(self.hf_config, self.geometry.embed_dim, self.layer_idx, 0)
        emb.ngram_embedding = IdsOnly(self.device)  # type: ignore[assignment]  # frees the (never touched) table
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


def fill_weights(mod: nn.Module, seed: int) -> None:
    """Deterministic bf16-representable weights (the same values in every dtype), non-zero conv."""
    g = torch.Generator().manual_seed(seed)
    for name, p in mod.named_parameters():
        if name.endswith("ngram_embedding.weight"):
            fill_table(p, g)
            continue
        if name.startswith("norm_"):
            v = 0.3 * torch.randn(p.shape, generator=g)
        elif name == "conv1d.weight":
            v = 0.5 * torch.randn(p.shape, generator=g)
        else:
            v = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
        p.copy_(v.bfloat16())


def fill_table(table: torch.Tensor, g: torch.Generator, block_rows: int = 65537) -> None:
    """Random rows, tiled from one block of a prime number of rows (filling GBs of fresh normal
    samples would dominate the setup; a prime period never lines up with a head's offset)."""
    n = min(block_rows, table.shape[0])
    block = torch.randn(n, table.shape[1], generator=g).bfloat16().to(device=table.device, dtype=table.dtype)
    for start in range(0, table.shape[0], n):
        m = min(n, table.shape[0] - start)
        table[start : start + m].copy_(block[:m])
