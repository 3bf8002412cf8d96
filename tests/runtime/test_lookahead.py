"""Session lookahead: every layer's lookup starts at begin(); prefetch() starts the next chunk's."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ple.layer import PLELayer
from ple.runtime import Session, SessionError
from ple.table import MemoryTable
from tests.conftest import hf_config, hf_ple_layer


class _Counting(MemoryTable):
    """A memory table that counts its lookups and records which threads ran them."""

    def __init__(self, table):
        super().__init__(table.data, table.scale, table.format)
        self.calls = 0
        self.threads: set[str] = set()

    def _lookup_into(self, ids, out):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        super()._lookup_into(ids, out)


def _layers():
    hf = hf_config(
        vocab_size=40,
        eos_token_id=3,
        ple_layer_ids=[1, 2],
        hidden_size=10,
        hc_count=2,
        ngram_size=3,
        heads_per_ngram=2,
        ple_embed_dim=12,
        ple_conv_kernel_size=3,
    )
    out = []
    for k in range(2):
        layer = PLELayer.from_transformers(hf_ple_layer(hf, k, seed=20 + k))
        layer.table = _Counting(layer.table)
        out.append(layer)
    return out


def _serve(session: Session, schedule, width: int, prefetch_next: bool = False):
    outs = []
    g = torch.Generator().manual_seed(3)
    for n, (tokens, spec, kept) in enumerate(schedule):
        step = session.begin(tokens, speculative=spec)
        if prefetch_next and n + 1 < len(schedule) and not schedule[n + 1][1]:
            nxt = schedule[n + 1][0]
            if not any(rid in spec for rid in nxt):
                session.prefetch(nxt)
        h = torch.randn(step.num_tokens, width, generator=g)
        for k in range(len(session.layers)):
            h = session.run(step, k, h)
        session.end(step)
        for rid, k in kept.items():
            session.accept(rid, k)
        outs.append(h)
    return outs


def _schedule():
    g = torch.Generator().manual_seed(0)

    def t(n):
        return torch.randint(0, 40, (n,), generator=g)

    return [
        ({"a": t(9), "b": t(5)}, (), {}),  # prefill
        ({"a": t(7)}, (), {}),  # a's next prefill chunk
        ({"a": t(1), "b": t(1)}, (), {}),  # decode
        ({"a": t(3), "b": t(1)}, ("a",), {"a": 2}),  # a verifies drafted tokens
        ({"a": t(1), "b": t(1)}, (), {}),
    ]


def test_lookahead_outputs_equal_and_reads_start_at_begin():
    schedule = _schedule()
    width = None
    results = []
    for lookahead, prefetch_next in ((False, False), (True, False), (True, True), (False, True)):
        layers = _layers()
        width = layers[0].config.hc_hidden_size
        s = Session(layers, 4, num_spec=2, lookahead=lookahead)
        s.add("a")
        s.add("b")
        results.append(_serve(s, schedule, width, prefetch_next))
        if lookahead or prefetch_next:
            assert all(any(n != "MainThread" for n in x.table.threads) for x in layers)
        else:
            assert all(x.table.threads == {"MainThread"} for x in layers)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_reads_begin_before_any_layer_runs_and_prefetch_is_adopted():
    layers = _layers()
    s = Session(layers, 2, lookahead=True)
    s.add("a")
    c = layers[0].config.hc_hidden_size
    step = s.begin({"a": torch.tensor([5, 6, 7, 8])})
    assert step.lookups is not None and len(step.lookups) == 2
    for h in step.lookups:
        h.wait()  # the lookups were started by begin(): they finish without run()
        h.release()
    step.lookups = None  # (run() would then read again; here we check the next step instead)
    nxt = {"a": torch.tensor([9, 10, 11])}
    s.prefetch(nxt)
    for k in range(2):
        s.run(step, k, torch.zeros(4, c))
    s.end(step)
    # the prefetched reads run on a worker thread: count once they are done (a busy machine delays them)
    deadline = time.monotonic() + 60
    while not all(handle.done() for _, handle in s._ahead) and time.monotonic() < deadline:
        time.sleep(0.001)
    calls = [x.table.calls for x in layers]
    step = s.begin(nxt)
    for k in range(2):
        s.run(step, k, torch.zeros(3, c))
    s.end(step)
    assert [x.table.calls for x in layers] == calls  # begin() adopted the prefetched reads
    # a prefetch for other tokens than the next step's is dropped and read again
    s.prefetch({"a": torch.tensor([1, 2])})
    step = s.begin({"a": torch.tensor([1, 3])})
    for k in range(2):
        s.run(step, k, torch.zeros(2, c))
    s.end(step)
    assert [x.table.calls for x in layers] == [n + 2 for n in calls]


def test_prefetch_refuses_what_it_cannot_foresee():
    layers = _layers()
    s = Session(layers, 2, num_spec=2)
    s.add("a")
    with pytest.raises(SessionError, match="unknown request 'z'"):
        s.prefetch({"z": torch.tensor([1])})
    step = s.begin({"a": torch.tensor([1, 2])}, speculative={"a"})
    with pytest.raises(SessionError, match="speculative chunk: its next context is unknown"):
        s.prefetch({"a": torch.tensor([1])})
    s.drop_prefetch()
    for k in range(2):
        s.run(step, k, torch.zeros(2, layers[0].config.hc_hidden_size))
    s.end(step)


def test_direct_tables_with_lookahead_equal_memory(tmp_path):
    """Layers whose tables are files read by DirectTable, lookahead on: outputs equal the in-memory run."""
    from ple.table import DirectTable
    from ple.table.files.table_file import TableFileWriter

    mem_layers = _layers()
    disk_layers = _layers()
    for k, layer in enumerate(disk_layers):
        t = layer.table
        path = tmp_path / f"layer{k}.pletable"
        fields = layer.config.layout_fields(layer.ple_layer_index)
        with TableFileWriter(path, t.rows, t.head_dim, t.format, 1 << 10, fields) as w:
            for s in range(-(-t.rows // (1 << 10))):
                a, b = s << 10, min(t.rows, (s + 1) << 10)
                w.write_shard(s, t.data[a:b], None if t.scale is None or t.scale.dim() == 1 else t.scale[a:b])
            if t.scale is not None and t.scale.dim() == 1:
                w.set_global_scale(t.scale)
        layer.table = DirectTable(path, memory_budget=4096, queue_depth=4)
    width = mem_layers[0].config.hc_hidden_size
    outs = []
    for layers, lookahead in ((mem_layers, False), (disk_layers, True)):
        s = Session(layers, 4, num_spec=2, lookahead=lookahead)
        s.add("a")
        s.add("b")
        outs.append(_serve(s, _schedule(), width, prefetch_next=lookahead))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert all(x.table.reads > 0 for x in disk_layers)
    for x in disk_layers:
        x.table.close()
