"""``ple_adapters=``: a patched transformers model serving a named adapter per batch row, in calls and
in ``generate``; each row exactly as the same batch on a model serving that row's adapter as its default."""

from __future__ import annotations

import pytest
import torch

from ple.errors import InvalidArgumentError
from ple.integrations.transformers import patch, unpatch
from ple.table.tiers.adapted import AdaptedTable, RowOverlay
from ple.train import adapter_names, load_adapter, ple_layers, remove_adapter, save_adapter
from tests.integrations.helpers import VOCAB, tiny_model


def _adapter(model, path, seed):
    g = torch.Generator().manual_seed(seed)
    for layer in ple_layers(model):
        base = layer.table
        overlay = RowOverlay(base.rows, base.head_dim)
        ids = torch.randperm(base.rows, generator=g)[: base.rows // 2]
        overlay.put(ids, torch.randn(ids.numel(), base.head_dim, generator=g) * 2)
        layer.set_table(AdaptedTable(base, overlay))
    save_adapter(path, model)
    remove_adapter(model)
    return path


@pytest.fixture
def served(tmp_path):
    model = patch(tiny_model(seed=3))
    files = {k: _adapter(model, tmp_path / f"{k}.safetensors", seed) for seed, k in enumerate(("a", "b"))}
    load_adapter(model, files["a"], name="legal")
    load_adapter(model, files["b"], name="medical")
    return model, files


ROWS = ["legal", None, "medical"]


def _as_default(model, files, name):
    if name is None:
        remove_adapter(model)
    else:
        load_adapter(model, files["a" if name == "legal" else "b"])


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_each_row_reads_its_adapter(served, grad):
    model, files = served
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.set_grad_enabled(grad):
        mixed = model(input_ids=ids, ple_adapters=ROWS).logits
        for row, name in enumerate(ROWS):
            _as_default(model, files, name)
            alone = model(input_ids=ids).logits
            assert torch.equal(mixed[row], alone[row]), (row, name)
        remove_adapter(model)
        plain = model(input_ids=ids).logits
    assert not torch.equal(mixed[0], plain[0]) and not torch.equal(mixed[2], plain[2])


def test_generate_takes_one_adapter_per_row(served):
    model, files = served
    ids = torch.randint(6, VOCAB, (3, 6), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    mixed = model.generate(ids, ple_adapters=ROWS, **kw)
    for row, name in enumerate(ROWS):
        _as_default(model, files, name)
        assert torch.equal(mixed[row], model.generate(ids, **kw)[row]), (row, name)
    # beams repeat each row: its adapter goes with it (row 1 reads the default: none again)
    remove_adapter(model)
    beams = model.generate(ids, ple_adapters=ROWS, num_beams=2, **kw)
    for row, name in enumerate(ROWS):
        _as_default(model, files, name)
        assert torch.equal(beams[row], model.generate(ids, num_beams=2, **kw)[row]), (row, name)


def test_refusals(served):
    model, _ = served
    ids = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with pytest.raises(InvalidArgumentError, match="names 2 rows, but the batch has 3"):
            model(input_ids=ids, ple_adapters=["legal", None])
        with pytest.raises(InvalidArgumentError, match="unknown adapter 'finance' \\(served: legal, medical\\)"):
            model(input_ids=ids, ple_adapters=["legal", "finance", None])
        with pytest.raises(InvalidArgumentError, match="one adapter name \\(or None\\) per batch row"):
            model(input_ids=ids, ple_adapters="legal")
        with pytest.raises(InvalidArgumentError, match="names 1 rows, but the batch has 3"):
            model.generate(ids, ple_adapters=["legal"], max_new_tokens=2)
        # a refused call leaves nothing behind: the next call without ple_adapters reads the default
        plain = model(input_ids=ids).logits
        remove_adapter(model, name="legal")
        remove_adapter(model, name="medical")
        assert adapter_names(model) == [] and torch.equal(model(input_ids=ids).logits, plain)


def test_unpatch_removes_the_keyword(served):
    model, _ = served
    remove_adapter(model, name="legal")
    remove_adapter(model, name="medical")
    unpatch(model)
    assert "generate" not in model.__dict__
    hooks = [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]
    assert not [h for h in hooks if getattr(h, "__module__", "") == "ple.integrations.row_adapters"]


def test_served_over_a_conversion_of_the_table_it_was_trained_over(tmp_path):
    """An adapter trained over a checkpoint's table file is served by name over a q4_0 copy of the same
    checkpoint table; over another checkpoint's table it is refused, naming both, with nothing changed."""
    from ple.integrations.transformers import from_pretrained
    from ple.train import AdapterFileError
    from tests.integrations.helpers import tiny_config

    paths = []
    for seed in (31, 32):
        path = tmp_path / f"ckpt{seed}"
        tiny_model(tiny_config(split_ngram_parts=3, ple_embed_dim=128), seed=seed).save_pretrained(path)
        paths.append(path)
    trained_over = from_pretrained(paths[0], table_dir=tmp_path / "t0")
    adapter = _adapter(trained_over, tmp_path / "a.safetensors", 4)
    copy = from_pretrained(paths[0], table_dir=tmp_path / "q4", table_format="q4_0")
    load_adapter(copy, adapter, name="x")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mixed = copy(input_ids=ids, ple_adapters=["x", None]).logits
        load_adapter(copy, adapter)
        assert torch.equal(mixed[0], copy(input_ids=ids).logits[0])
    other = from_pretrained(paths[1], table_dir=tmp_path / "t1")
    with pytest.raises(AdapterFileError, match="was trained over the table file .*t0"):
        load_adapter(other, adapter, name="x")
    assert adapter_names(other) == []


def test_threads_calling_one_model_each_read_their_own_adapters(served):
    """Two threads call the same model at once with different ``ple_adapters``: each call reads its own."""
    import threading

    model, _ = served
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    choices = (["legal", "medical"], ["medical", None])
    with torch.no_grad():
        want = [model(input_ids=ids, ple_adapters=c).logits for c in choices]
    got: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            with torch.no_grad():
                for _ in range(4):
                    got[k].append(model(input_ids=ids, ple_adapters=choices[k]).logits)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    workers = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    for k in (0, 1):
        assert all(torch.equal(x, want[k]) for x in got[k])
    with torch.no_grad():  # nothing left set: a plain call reads the default (none)
        assert torch.equal(model(input_ids=ids).logits[1], want[1][1])
