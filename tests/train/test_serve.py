"""Named adapters served at once, chosen per request: a mixed step equals, bit for bit, the same packed
steps on a model serving each request's adapter as its default (prefill chunks, decode, speculative
verification with rejected tokens, prefix reuse), on every tier and format; every refusal leaves the
model as it was; loading and removing while another thread steps."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ple.errors import InvalidArgumentError, PLEError, UsageError
from ple.runtime import Batch, Session, SessionError
from ple.table.tiers.adapted import AdaptedTable, RowOverlay
from ple.train import (
    AdapterFileError,
    adapter_index,
    adapter_names,
    load_adapter,
    remove_adapter,
    save_adapter,
)
from tests.train._helpers import CFG, make_tier, new_layer, write_table_file

LAYERS = (0, 1)


def _model(tmp: Path, tier: str = "memory", fmt: str = "fp32", dtype=torch.float32) -> nn.ModuleList:
    return nn.ModuleList(
        [new_layer(seed=i, index=i, dtype=dtype, table=make_tier(tier, fmt, tmp, index=i)) for i in LAYERS]
    )


def _write_adapter(model: nn.ModuleList, path: Path, seed: int, frac: float = 0.5) -> Path:
    """An adapter file over ``model``'s tables: random rows of ``frac`` of each layer's rows."""
    g = torch.Generator().manual_seed(seed)
    for layer in model:
        base = layer.table
        overlay = RowOverlay(base.rows, base.head_dim)
        ids = torch.randperm(base.rows, generator=g)[: int(base.rows * frac)]
        overlay.put(ids, torch.randn(ids.numel(), base.head_dim, generator=g))
        layer.set_table(AdaptedTable(base, overlay))
    save_adapter(path, model)
    remove_adapter(model)
    return path


class Script:
    """A fixed sequence of packed steps over four requests: two prefill chunks, a verify step whose
    drafts are partly rejected, decode steps; the same hidden states whatever serves the tables."""

    def __init__(self, requests: list[str], seed: int = 7, num_spec: int = 2):
        g = torch.Generator().manual_seed(seed)
        self.requests = requests
        self.num_spec = num_spec

        def tok(n):
            return torch.randint(0, CFG.vocab_size, (n,), generator=g)

        lens = (5, 7, 3, 6)
        self.steps: list[tuple[dict, frozenset, dict]] = []
        self.steps.append(({r: tok(n) for r, n in zip(requests, lens)}, frozenset(), {}))
        self.steps.append(({r: tok(n + 1) for r, n in zip(requests, lens)}, frozenset(), {}))
        spec = frozenset(requests[:2])
        self.steps.append(({r: tok(3 if r in spec else 1) for r in requests}, spec, {requests[0]: 1, requests[1]: 3}))
        for _ in range(2):
            self.steps.append(({r: tok(1) for r in requests}, frozenset(), {}))
        self.hidden = [
            torch.randn(sum(t.numel() for t in chunk.values()), CFG.hc_hidden_size, generator=g)
            for chunk, _, _ in self.steps
        ]

    def run(self, model, adapters: dict, dtype=torch.float32, keep_at: int | None = None, lookahead=False):
        """Outputs per step ``{request: rows}``, and the session (its prefix states kept at ``keep_at``)."""
        session = Session(list(model), 8, num_spec=self.num_spec, prefix_every=keep_at, lookahead=lookahead)
        for r in self.requests:
            session.add(r, adapter=adapters.get(r))
        outs = []
        with torch.no_grad():
            for (chunk, spec, accept), hidden in zip(self.steps, self.hidden):
                step = session.begin(chunk, speculative=spec)
                x = hidden.to(dtype)
                for k in range(len(model)):
                    x = session.run(step, k, x)
                session.end(step)
                outs.append(step.split(x))
                for r, kept in accept.items():
                    session.accept(r, kept)
        return outs, session


def _equal_for(requests, got, want) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        for r in requests:
            assert torch.equal(a[r], b[r]), f"request {r}, step {i}"


def _check_mixed(model, files: dict, script: Script, chosen: dict, default, dtype=torch.float32) -> list:
    """Serve ``files`` by name (``default``: the default adapter's file or None), run ``chosen`` mixed, and
    compare each request with the same steps on the model serving its adapter as the default."""
    for name, path in files.items():
        load_adapter(model, path, name=name)
    if default is not None:
        load_adapter(model, default)
    mixed, _ = script.run(model, chosen, dtype)
    for name in (*files, None):
        mine = [r for r in script.requests if chosen.get(r) == name]
        if not mine:
            continue
        source = files[name] if name is not None else default
        if source is None:
            remove_adapter(model)
        else:
            load_adapter(model, source)
        alone, _ = script.run(model, {}, dtype)
        _equal_for(mine, mixed, alone)
    remove_adapter(model)
    plain, _ = script.run(model, {}, dtype)
    assert not torch.equal(mixed[-1][script.requests[0]], plain[-1][script.requests[0]])  # the adapter was read
    return mixed


@pytest.fixture
def served(tmp_path):
    model = _model(tmp_path)
    files = {name: _write_adapter(model, tmp_path / f"{name}.safetensors", seed) for seed, name in enumerate("abc")}
    return model, files


def test_a_mixed_step_equals_each_adapter_served_as_the_default(served):
    model, files = served
    script = Script(["r0", "r1", "r2", "r3"])
    chosen = {"r0": "legal", "r2": "medical", "r3": "legal"}  # r1: the default
    # adapters whose rows overlap (half of each table's rows each), named ones over the base, never over the
    # default adapter (c) that r1 reads
    _check_mixed(model, {"legal": files["a"], "medical": files["b"]}, script, chosen, files["c"])
    assert adapter_names(model) == ["legal", "medical"]


def test_a_request_without_an_adapter_reads_the_base_where_there_is_no_default(served):
    model, files = served
    script = Script(["r0", "r1", "r2", "r3"])
    _check_mixed(model, {"legal": files["a"]}, script, {"r0": "legal", "r2": "legal"}, None)


def test_the_names_and_indices(served):
    model, files = served
    assert adapter_names(model) == []
    load_adapter(model, files["a"], name="legal")
    load_adapter(model, files["b"], name="medical")
    assert adapter_names(model) == ["legal", "medical"]
    assert (adapter_index(model, "legal"), adapter_index(model, "medical")) == (0, 1)
    remove_adapter(model, name="legal")
    load_adapter(model, files["c"], name="finance")  # the smallest free index
    assert adapter_names(model) == ["finance", "medical"] and adapter_index(model, "finance") == 0
    remove_adapter(model)  # the default only: named ones stay
    assert adapter_names(model) == ["finance", "medical"]
    with pytest.raises(InvalidArgumentError, match="unknown adapter 'legal'.*finance, medical"):
        adapter_index(model, "legal")


@pytest.mark.parametrize(
    ("tier", "fmt"), [("mmap", "fp32"), ("direct", "bf16"), ("memory", "q4_0"), ("mmap", "q4_0"), ("cached", "fp8")]
)
def test_every_tier_and_format(tmp_path, tier, fmt):
    model = _model(tmp_path, tier, fmt)
    files = {name: _write_adapter(model, tmp_path / f"{name}.safetensors", seed) for seed, name in enumerate("ab")}
    script = Script(["r0", "r1", "r2", "r3"], seed=3)
    _check_mixed(model, {"x": files["a"]}, script, {"r0": "x", "r3": "x"}, files["b"])


@pytest.mark.parametrize("tier", ["memory", "direct"])
def test_lookahead_reads_the_adapters_too(tmp_path, tier):
    """A session that starts its lookups at begin() (prefetch handles) puts the named rows in place too."""
    model = _model(tmp_path, tier, "bf16")
    files = {name: _write_adapter(model, tmp_path / f"{name}.safetensors", seed) for seed, name in enumerate("ab")}
    load_adapter(model, files["a"], name="x")
    load_adapter(model, files["b"], name="y")
    script = Script(["r0", "r1", "r2", "r3"], seed=9)
    chosen = {"r0": "x", "r1": "y", "r3": "x"}
    ahead, _ = script.run(model, chosen, lookahead=True)
    plain, _ = script.run(model, chosen)
    _equal_for(script.requests, ahead, plain)
    load_adapter(model, files["a"])
    alone, _ = script.run(model, {}, lookahead=True)
    _equal_for(["r0", "r3"], ahead, alone)


def test_a_memory_budget_per_adapter(served, tmp_path):
    """An adapter whose rows spill beyond its budget serves the same rows (the numpy path reads them)."""
    model, files = served
    load_adapter(model, files["a"], name="tight", memory_budget=4096, spill_dir=tmp_path)
    load_adapter(model, files["b"], name="roomy")
    tight = model[0].table_ref.adapters.get(adapter_index(model, "tight")).overlay
    assert tight.spilled_rows > 0
    script = Script(["r0", "r1", "r2", "r3"], seed=11)
    chosen = {"r0": "tight", "r1": "roomy", "r2": "tight"}
    mixed, _ = script.run(model, chosen)
    for name, path in (("tight", files["a"]), ("roomy", files["b"])):
        load_adapter(model, path)
        alone, _ = script.run(model, {})
        _equal_for([r for r, c in chosen.items() if c == name], mixed, alone)


def test_bf16_layers(tmp_path):
    model = _model(tmp_path, "memory", "bf16", dtype=torch.bfloat16)
    files = {name: _write_adapter(model, tmp_path / f"{name}.safetensors", seed) for seed, name in enumerate("ab")}
    script = Script(["r0", "r1", "r2", "r3"], seed=5)
    _check_mixed(model, {"x": files["a"], "y": files["b"]}, script, {"r0": "x", "r1": "y"}, None, torch.bfloat16)


def test_prefix_states_resume_only_under_their_adapter(served):
    model, files = served
    load_adapter(model, files["a"], name="legal")
    load_adapter(model, files["b"], name="medical")
    script = Script(["r0", "r1", "r2", "r3"])
    chosen = {"r0": "legal", "r1": "medical"}
    full, session = script.run(model, chosen, keep_at=4)
    state = session.prefix_states("r0")[4]
    assert state.adapter is not None and state.adapter[0] == "legal"
    with pytest.raises(SessionError, match="taken reading adapter 'legal', this request reads adapter 'medical'"):
        session.add("again", from_state=state, adapter="medical")
    with pytest.raises(SessionError, match="this request reads the base table"):
        session.add("again", from_state=state)
    assert "again" not in session.request_ids
    # resumed under its adapter: the rest of the request's history equals the uninterrupted one
    chunk = script.steps[0][0]["r0"]
    rest = torch.cat([chunk[4:], script.steps[1][0]["r0"]])
    session2 = Session(list(model), 2)
    session2.add("again", from_state=state, adapter="legal")
    hidden = torch.cat([script.hidden[0][4:5], script.hidden[1][0:6]])  # r0's rows of steps 0 and 1
    with torch.no_grad():
        step = session2.begin({"again": rest})
        x = hidden
        for k in range(len(model)):
            x = session2.run(step, k, x)
        session2.end(step)
    want = torch.cat([full[0]["r0"][4:], full[1]["r0"]])
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)  # other GEMM shapes: rounding may differ
    # an adapter loaded again under the same name is another adapter
    session.finish("r0")
    session.finish("r2")
    session.finish("r3")
    session.finish("r1")
    with pytest.raises(UsageError, match="live requests \\['again'\\]"):  # session2's request
        remove_adapter(model, name="legal")
    session2.finish("again")
    remove_adapter(model, name="legal")
    load_adapter(model, files["a"], name="legal")
    with pytest.raises(SessionError, match="an adapter loaded again is another"):
        session.add("again", from_state=state, adapter="legal")


def test_refusals_change_nothing(served, tmp_path):
    model, files = served
    load_adapter(model, files["a"], name="legal")
    tables = [layer.table for layer in model]
    session = Session(list(model), 4)
    with pytest.raises(SessionError, match="unknown adapter 'medical' \\(served: legal\\)"):
        session.add("r", adapter="medical")
    assert session.request_ids == []
    with pytest.raises(InvalidArgumentError, match="'legal' is already served"):
        load_adapter(model, files["b"], name="legal")
    for bad in ("", " x", 3):
        with pytest.raises(InvalidArgumentError, match="name must be a non-empty str"):
            load_adapter(model, files["b"], name=bad)
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(files["b"].read_bytes()[:-40])
    with pytest.raises(PLEError):
        load_adapter(model, damaged, name="medical")
    with pytest.raises(InvalidArgumentError, match="no adapter named 'medical'"):
        remove_adapter(model, name="medical")
    assert adapter_names(model) == ["legal"] and [layer.table for layer in model] == tables
    # a live request pins its adapter
    session.add("r7", adapter="legal")
    with pytest.raises(UsageError, match="live requests \\['r7'\\]"):
        remove_adapter(model, name="legal")
    assert adapter_names(model) == ["legal"]
    session.finish("r7")
    remove_adapter(model, name="legal")
    assert adapter_names(model) == [] and all(layer.table_ref.adapters is None for layer in model)


def test_an_adapter_of_another_table_file_is_refused(tmp_path):
    files = [write_table_file(tmp_path / f"s{seed}-{i}.pletable", "fp32", i, seed) for seed in (0, 1) for i in LAYERS]
    from ple.table import MmapTable

    trained_over = nn.ModuleList([new_layer(seed=i, index=i, table=MmapTable.open(files[i])) for i in LAYERS])
    adapter = _write_adapter(trained_over, tmp_path / "a.safetensors", 1)
    other = nn.ModuleList([new_layer(seed=i, index=i, table=MmapTable.open(files[2 + i])) for i in LAYERS])
    for name in ("x", None):
        with pytest.raises(AdapterFileError, match="was trained over the table file .*s0-0.pletable"):
            load_adapter(other, adapter, name=name)
        assert adapter_names(other) == [] and not isinstance(other[0].table, AdaptedTable)
    load_adapter(trained_over, adapter, name="x")  # the table it was trained over
    assert adapter_names(trained_over) == ["x"]


def test_a_hundred_adapters_at_once(served):
    model, files = served
    for k in range(100):
        load_adapter(model, files["abc"[k % 3]], name=f"n{k}", memory_budget=None)
    assert adapter_names(model) == [f"n{k}" for k in range(100)]
    held = model[0].table_ref.adapters
    one = held.get(0).overlay.nbytes
    assert held.nbytes == sum(held.get(k).overlay.nbytes for k in range(100)) and one > 0
    script = Script(["r0", "r1", "r2", "r3"])
    chosen = {"r0": "n0", "r1": "n97", "r2": "n50", "r3": "n4"}  # files a, b, c, b
    mixed, _ = script.run(model, chosen)
    for r, name in chosen.items():
        load_adapter(model, files["abc"[int(name[1:]) % 3]])
        alone, _ = script.run(model, {})
        _equal_for([r], mixed, alone)
    for k in range(100):
        remove_adapter(model, name=f"n{k}")
    assert adapter_names(model) == []


def test_load_and_remove_while_another_thread_steps(served):
    model, files = served
    load_adapter(model, files["a"], name="legal")
    script = Script(["r0", "r1", "r2", "r3"])
    chosen = {"r0": "legal", "r2": "legal"}
    want, _ = script.run(model, chosen)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn():
        try:
            while not stop.is_set():
                load_adapter(model, files["b"], name="other")
                remove_adapter(model, name="other")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(3):
            got, _ = script.run(model, chosen)
            _equal_for(script.requests, got, want)
    finally:
        stop.set()
        worker.join()
    assert not errors


def test_the_engine_call_takes_adapter_indices(served):
    model, files = served
    layer = model[0]
    load_adapter(model, files["a"], name="legal")
    load_adapter(model, files["b"], name="medical")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CFG.vocab_size, (12,), generator=g)
    hidden = torch.randn(12, CFG.hc_hidden_size, generator=g)
    ctx = torch.full((3, 2), CFG.eos_token_id)

    def call(adapter_indices):
        pool = layer.new_state_pool(3)
        b = Batch.build([4, 5, 3], [0, 1, 2], ctx, pool, adapter_indices=adapter_indices)
        with torch.no_grad():
            return layer(hidden, ids, b)

    mixed = call([1, -1, 0])
    assert torch.equal(mixed, call([1, -1, 0]))
    parts = {}
    for name, path in (("medical", files["b"]), (None, None), ("legal", files["a"])):
        if path is None:
            remove_adapter(model)
        else:
            load_adapter(model, path)
        parts[name] = call(None)
    remove_adapter(model)
    assert torch.equal(mixed[:4], parts["medical"][:4])
    assert torch.equal(mixed[4:9], parts[None][4:9])
    assert torch.equal(mixed[9:], parts["legal"][9:])
    with pytest.raises(InvalidArgumentError, match="adapter index 5 is not served"):
        call([5, -1, 0])
    with pytest.raises(PLEError, match="adapter index -2"):
        call([-2, -1, 0])
    with pytest.raises(InvalidArgumentError, match="rows= are used as given"):
        pool = layer.new_state_pool(3)
        b = Batch.build([4, 5, 3], [0, 1, 2], ctx, pool, adapter_indices=[0, 0, 0])
        layer(hidden, ids, b, rows=torch.zeros(12, layer.layout.embed_dim))


@pytest.mark.slow
def test_the_compiled_engine_call_reads_adapters_without_recompiling(served):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    model, files = served
    layer = model[0]
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend("inductor")

    @torch.compile(backend=cnt, fullgraph=True)
    def engine(layer, hidden, ids, batch):
        return layer(hidden, ids, batch)

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, CFG.vocab_size, (12,), generator=g)
    hidden = torch.randn(12, CFG.hc_hidden_size, generator=g)

    def run(fn, indices):
        pool = layer.new_state_pool(3)
        b = Batch.build([4, 5, 3], [0, 1, 2], torch.full((3, 2), CFG.eos_token_id), pool, adapter_indices=indices)
        with torch.no_grad():
            return fn(layer, hidden, ids, b)

    load_adapter(model, files["a"], name="legal")
    eager = run(lambda *a: a[0](*a[1:]), [0, -1, 0])
    assert torch.equal(run(engine, [0, -1, 0]), eager)
    load_adapter(model, files["b"], name="medical")
    got = run(engine, [1, 0, -1])
    assert torch.equal(got, run(lambda *a: a[0](*a[1:]), [1, 0, -1]))
    remove_adapter(model, name="legal")
    load_adapter(model, files["c"], name="legal")
    assert torch.equal(run(engine, [1, 0, -1]), run(lambda *a: a[0](*a[1:]), [1, 0, -1]))
    assert cnt.frame_count == 1 and not counters["graph_break"]


def test_a_fork_while_another_thread_loads_and_removes_adapters(served, tmp_path):
    """Forks taken while a thread loads and removes a named adapter and a session adds and finishes
    requests of it: every child finds the adapters' locks free and serves a mixed step as the parent."""
    from tests.table._helpers import run_forked

    model, files = served
    load_adapter(model, files["a"], name="legal")
    script = Script(["r0", "r1", "r2", "r3"])
    chosen = {"r0": "legal", "r2": "legal"}
    want, _ = script.run(model, chosen)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn():
        try:
            session = Session(list(model), 2)
            while not stop.is_set():
                load_adapter(model, files["b"], name="other")
                session.add("x", adapter="other")
                session.finish("x")
                remove_adapter(model, name="other")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def child():
        load_adapter(model, files["c"], name="child")
        got, _ = script.run(model, chosen)
        return [{r: o[r] for r in chosen} for o in got]

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for n in range(4):
            got = run_forked(child, tmp_path / f"child{n}.pkl")
            _equal_for(list(chosen), got, want)
    finally:
        stop.set()
        worker.join()
    assert not errors


def test_a_fork_waits_for_an_adapter_change_in_progress(served, tmp_path):
    """Another thread holds the adapters' locks (a load being installed) when the process forks: the fork
    waits for them, so the child can load and serve adapters (a lock copied held would hang it)."""
    from ple.table.tiers.named import ADAPTER_CHANGES
    from tests.table._helpers import run_forked

    model, files = served
    load_adapter(model, files["a"], name="legal")
    held = model[0].table_ref.adapters
    holding = threading.Event()

    def install():
        with ADAPTER_CHANGES, held._lock:
            holding.set()
            time.sleep(0.3)

    def child():
        load_adapter(model, files["b"], name="other")
        session = Session(list(model), 1)
        session.add("x", adapter="other")
        session.finish("x")
        remove_adapter(model, name="other")
        return adapter_names(model)

    worker = threading.Thread(target=install)
    worker.start()
    holding.wait()
    try:
        assert run_forked(child, tmp_path / "child.pkl", deadline=30) == ["legal"]
    finally:
        worker.join()
