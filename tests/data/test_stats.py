"""ple stats: the decode view against a literal reference, streamed input, bounded memory."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from ple.commands.cli import main
from ple.config import PLEConfig
from ple.data import tokens as tokens_mod
from ple.data.stats import row_traffic
from ple.data.tokens import iter_token_file
from ple.ngram import fresh_context, reference
from tests.conftest import SMALL


def _decode_reference(tokens: list[int], cfg: PLEConfig, batch: int, length: int, caches: list[int]) -> dict:
    """Token by token: each lookup's class, the step's distinct rows, LRU caches over them."""
    lay = cfg.layout(0)
    eos = cfg.eos_token_id
    G, hpn, orders = lay.num_heads, lay.heads_per_ngram, lay.ngram_size - 1
    pieces = [tokens[k : k + length] for k in range(0, len(tokens), length)]
    seen: set[int] = set()
    classes = np.zeros((4, orders), dtype=np.int64)
    lookups = np.zeros(orders, dtype=np.int64)
    lrus = [collections.OrderedDict() for _ in caches]
    hits = np.zeros((len(caches), orders), dtype=np.int64)
    reads = np.zeros(orders, dtype=np.int64)
    steps = 0
    for w in range(0, len(pieces), batch):
        win = pieces[w : w + batch]
        ids = [
            reference.ngram_ids(torch.tensor(p), torch.tensor([0, len(p)]), fresh_context(1, lay, eos), lay, eos)
            for p in win
        ]
        own = [set() for _ in win]
        steps += max(len(p) for p in win)
        for s in range(max(len(p) for p in win)):
            in_step: set[int] = set()
            step_reads = []
            for i, p in enumerate(win):
                if s >= len(p):
                    continue
                for g in range(G):
                    r, o = int(ids[i][s, g]), g // hpn
                    lookups[o] += 1
                    if r in in_step:
                        c = 0
                    elif r in own[i]:
                        c = 1
                    elif r in seen:
                        c = 2
                    else:
                        c = 3
                    classes[c, o] += 1
                    if r not in in_step:
                        in_step.add(r)
                        step_reads.append((r, o))
                    own[i].add(r)
                    seen.add(r)
            for r, o in step_reads:
                reads[o] += 1
                for k, lru in enumerate(lrus):
                    if r in lru:
                        hits[k, o] += 1
                        lru.move_to_end(r)
                    else:
                        lru[r] = None
                        if len(lru) > caches[k]:
                            lru.popitem(last=False)
    return {"classes": classes, "lookups": lookups, "hits": hits, "reads": reads, "steps": steps}


@pytest.mark.parametrize("chunks", [[1000], [7, 300, 1, 692], [150] * 6 + [100]])
def test_decode_view_matches_the_reference(chunks):
    cfg = PLEConfig(**SMALL)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 30, (1000,), generator=g)  # a small alphabet: rows are reused
    tokens[::41] = cfg.eos_token_id
    parts = list(np.split(tokens.numpy(), np.cumsum(chunks)[:-1]))
    res = row_traffic(parts, cfg, 0, batch=3, request_tokens=50, cache_rows=[5, 60])
    ref = _decode_reference(tokens.tolist(), cfg, 3, 50, [5, 60])
    d = res["decode"]
    assert d["requests"] == 20 and d["steps"] == ref["steps"] == 7 * 50
    names = ("within_step", "within_request", "across_requests", "new")
    for o, order in enumerate(d["orders"]):
        assert order["lookups"] == ref["lookups"][o]
        for c, name in enumerate(names):
            assert order[name] == pytest.approx(ref["classes"][c, o] / ref["lookups"][o], abs=1e-12), (o, name)
        assert order["distinct_rows_per_step"] == pytest.approx(ref["reads"][o] / ref["steps"])
    assert all(ref["classes"][c].sum() > 0 for c in range(4))  # every class occurs: the test discriminates
    for k, cache in enumerate(d["cache"]):
        assert cache["hit_rate"] == pytest.approx(ref["hits"][k].sum() / ref["reads"].sum())
        assert cache["per_order"] == pytest.approx(list(ref["hits"][k] / ref["reads"]))
    assert 0 < d["cache"][0]["hit_rate"] < d["cache"][1]["hit_rate"] < 1
    # the per-head view is the same whichever way the stream is chunked
    whole = row_traffic(tokens, cfg, 0, batch=3, request_tokens=50, cache_rows=[5])
    assert whole["heads"] == res["heads"] and whole["total"] == res["total"]


def test_token_files_are_read_in_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens_mod, "_TEXT_BLOCK", 64)  # numbers cut across blocks are joined again
    values = np.random.default_rng(0).integers(0, 100000, 3000)
    p = tmp_path / "t.txt"
    p.write_text("\n".join(", ".join(map(str, values[k : k + 7])) for k in range(0, 3000, 7)))
    chunks = list(iter_token_file(p, chunk_tokens=1000))
    assert [c.size for c in chunks] == [c.size for c in chunks if c.size <= 1000]
    assert np.concatenate(chunks).tolist() == values.tolist()
    np.save(tmp_path / "t.npy", values.astype(np.int32).reshape(30, 100))
    chunks = list(iter_token_file(tmp_path / "t.npy", chunk_tokens=256))
    assert [c.size for c in chunks] == [256] * 11 + [184]
    assert np.concatenate(chunks).tolist() == values.tolist()
    p.write_text("1 2 3 " * 40 + "4 x")  # the bad entry is named by its index in the whole stream
    with pytest.raises(Exception, match="entry 121 is 'x'"):
        list(iter_token_file(p))


_MEMORY_LIMITED = textwrap.dedent(
    """
    import json, resource, sys
    from ple.commands.cli import main
    main(["stats", sys.argv[1], "--tokens", sys.argv[2], "--json", "--cache-rows", "64"])  # warm: imports, threads
    with open("/proc/self/status") as f:
        vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), vm + (256 << 20)))
    try:
        code = main(["stats", sys.argv[1], "--tokens", sys.argv[3], "--cache-rows", "64"])
    except MemoryError:
        code = "MemoryError"
    print("EXIT", code)
    """
)


@pytest.mark.slow
def test_stats_streams_a_token_file_larger_than_its_memory(tmp_path):
    """Address space limited to 256 MiB above what the process already holds; the token file's
    numbers alone would take ~0.35 GB as Python strings (48 MB as int64): it is streamed."""
    cfg = PLEConfig(**SMALL)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "small.txt").write_text("5 6 7 8 " * 100)
    big = tmp_path / "big.txt"
    with open(big, "w") as f:
        line = "5 6 7 8 9 10 11 12 " * 1000 + "\n"
        for _ in range(750):  # 6 M tokens, 16 MB of text
            f.write(line)
    r = subprocess.run(
        [sys.executable, "-c", _MEMORY_LIMITED, str(tmp_path), str(tmp_path / "small.txt"), str(big)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "EXIT 0", r.stdout[-500:]
    assert "\n6000000 tokens, 24000000 lookups" in r.stdout


def test_stats_command_on_real_text(tmp_path, capsys):
    cfg = PLEConfig(**{**SMALL, "vocab_size": 248320, "eos_token_id": 248044, "ngram_vocab_size_base": 1000003})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert main(["stats", str(tmp_path), "--real-text", "20000", "--batch", "8", "--request-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "decode: 313 requests of 64 tokens, 8 at a time" in out and "LRU cache of 65536 rows" in out
    assert main(["stats", str(tmp_path), "--real-text", "20000", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["decode"]
    o2, o3 = d["orders"]
    # real text: bigrams repeat across requests far more than trigrams
    assert o2["across_requests"] > o3["across_requests"] > 0 and o3["new"] > o2["new"]
    text = tmp_path / "doc.txt"
    text.write_text("the cat sat on the mat\n" * 50)
    assert main(["stats", str(tmp_path), "--text", str(text), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 50 * 7
