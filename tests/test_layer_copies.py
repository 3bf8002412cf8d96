"""A layer pickled (``torch.save``, ``multiprocessing``), deep-copied or built inside
``torch.inference_mode()`` computes exactly what the original does, and follows its own weights."""

import copy
import io
import pickle

import pytest
import torch

from ple import Session
from ple.errors import UsageError
from ple.layer import PLELayer
from tests.conftest import hf_config, hf_ple_layer

DTYPES = [torch.float32, torch.bfloat16]


def _module(dtype):
    hf = hf_config(hidden_size=10, hc_count=3, ngram_size=3, heads_per_ngram=2, ple_embed_dim=8, seed=7)
    return hf_ple_layer(hf, 0, seed=7, dtype=dtype)


def _steps(layer, seed=0):
    """Outputs of a prefill of 3 requests and two decode steps through a fresh session (the native step
    on the CPU), concatenated."""
    cfg = layer.config
    g = torch.Generator().manual_seed(seed)
    session = Session(layer, 3)
    outs = []
    for i in range(3):
        session.add(i)
    for n in ((5, 2, 7), (1, 1, 1), (1, 1, 1)):
        step = {
            i: (
                torch.randn(k, cfg.hc_hidden_size, generator=g).to(layer.dtype),
                torch.randint(0, cfg.vocab_size, (k,), generator=g),
            )
            for i, k in enumerate(n)
        }
        outs += list(session.step(step).values())
    return torch.cat(outs)


def _changed(layer):
    """In-place changes of every parameter kind (as a weight update or a loader does)."""
    with torch.no_grad():
        layer.key_proj.mul_(-0.5)
        layer.norm_conv.add_(0.25)
        layer.conv_weight.mul_(2.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_save_and_pickle_round_trip_the_layer(dtype):
    layer = PLELayer.from_transformers(_module(dtype))
    want = _steps(layer)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (loaded, pickle.loads(pickle.dumps(layer))):
        assert torch.equal(_steps(other), want)
        assert other.table.rows == layer.table.rows
        # the copy follows its own weights, the original keeps its
        _changed(other)
        fresh = copy.deepcopy(layer)
        _changed(fresh)
        assert torch.equal(_steps(other), _steps(fresh))
        assert not torch.equal(_steps(other), want)
    assert torch.equal(_steps(layer), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_deep_copy_computes_on_its_own_table(dtype):
    layer = PLELayer.from_transformers(_module(dtype))
    want = _steps(layer)
    dup = copy.deepcopy(layer)
    assert torch.equal(_steps(dup), want)
    with torch.no_grad():
        dup.table.data.mul_(3.0)  # the copy's rows only
    assert not torch.equal(_steps(dup), want)
    assert torch.equal(_steps(layer), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_built_and_run_inside_inference_mode(dtype):
    mod = _module(dtype)
    plain = PLELayer.from_transformers(mod)
    want = _steps(plain)
    with torch.inference_mode():
        layer = PLELayer.from_transformers(mod)
        assert not layer.key_proj.is_inference() and not layer.kv_weight.is_inference()
        assert torch.equal(_steps(layer), want)
        _changed(layer)  # followed (the parameters keep their version counters)
        _changed(plain)
        want = _steps(plain)
        assert torch.equal(_steps(layer), want)
        wide = copy.deepcopy(layer).to(torch.float32)
        assert not wide.key_proj.is_inference()
    assert torch.equal(_steps(layer), want)
    assert torch.equal(_steps(wide), _steps(copy.deepcopy(plain).to(torch.float32)))


def test_an_inference_tensor_parameter_is_refused_by_name():
    layer = PLELayer.from_transformers(_module(torch.float32))
    with torch.inference_mode():
        layer.norm_key = torch.nn.Parameter(layer.norm_key.detach().clone())
    with pytest.raises(UsageError, match=r"\['norm_key'\] are inference tensors"):
        _steps(layer)


@pytest.mark.parametrize("dtype", DTYPES)
def test_changed_norms_or_conv_keep_the_projections_weight(dtype):
    """The eager call follows in-place changes; a change of the norms or the conv alone leaves
    ``kv_weight`` (and a packed copy of it) as it is."""
    mod = _module(dtype)
    layer, plain = PLELayer.from_transformers(mod), PLELayer.from_transformers(mod)
    kv, version = layer.kv_weight, layer.kv_weight._version
    with torch.no_grad():
        for m in (layer, plain):
            m.norm_conv.add_(0.5)
            m.conv_weight.mul_(-1.0)
    plain.refresh_weights()
    assert torch.equal(_steps(layer), _steps(plain))
    assert layer.kv_weight is kv and kv._version == version
    with torch.no_grad():
        for m in (layer, plain):
            m.value_proj.mul_(2.0)
    plain.refresh_weights()
    assert torch.equal(_steps(layer), _steps(plain))
    assert kv._version > version


def test_refresh_weights_recomputes_everything():
    """Changes the version counters do not see (through ``.data``) are taken by an explicit refresh."""
    mod = _module(torch.float32)
    layer, plain = PLELayer.from_transformers(mod), PLELayer.from_transformers(mod)
    layer.key_proj.data.mul_(-1.0)
    with torch.no_grad():
        plain.key_proj.mul_(-1.0)
    layer.refresh_weights()
    assert torch.equal(_steps(layer), _steps(plain))


def test_pickles_leave_out_what_is_derived_and_a_compiled_call():
    layer = PLELayer.from_transformers(_module(torch.float32))
    want = _steps(layer)
    state = layer.__getstate__()
    assert "kv_weight" not in state["_buffers"] and "conv_taps" not in state["_buffers"]
    assert state["_native_step"] is None
    layer.compile()  # lazy: nothing compiles until a call
    assert layer._compiled_call_impl is not None
    for dup in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert getattr(dup, "_compiled_call_impl", None) is None  # it would run the original's call
        assert torch.equal(dup.kv_weight, layer.kv_weight)
        with torch.no_grad():
            dup.value_proj.zero_()
        assert not torch.equal(_steps(dup), want)  # its own weights, not the original's


def test_a_layer_over_a_table_file_pickles_the_file_not_its_rows(tmp_path):
    from ple.table import MmapTable
    from ple.table.files.table_file import TableFileWriter

    layer = PLELayer.from_transformers(_module(torch.bfloat16))
    rows = layer.table.data
    path = tmp_path / "layer.pletable"
    fields = layer.config.layout_fields(layer.ple_layer_index)
    with TableFileWriter(path, rows.shape[0], rows.shape[1], "bf16", rows.shape[0], fields) as w:
        w.write_shard(0, rows)
    layer.table = MmapTable.open(path)
    want = _steps(layer)
    blob = pickle.dumps(layer)
    assert len(blob) < rows.numel() * rows.element_size()  # smaller than the rows alone
    copy_ = pickle.loads(blob)
    assert isinstance(copy_.table, MmapTable) and copy_.table is not layer.table
    assert torch.equal(_steps(copy_), want)
