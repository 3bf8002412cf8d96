import importlib
import inspect

import pytest

import ple.ops

OPS = {"norm": "grouped_rms_norm", "gate": "ngram_gate", "conv": "dilated_conv"}


def test_public_api_is_pinned():
    assert sorted(ple.ops.__all__) == ["dilated_conv", "gate_conv", "grouped_rms_norm", "ngram_gate"]
    for folder, name in OPS.items():
        package = importlib.import_module(f"ple.ops.{folder}")
        assert getattr(ple.ops, name) is getattr(package, name)
        assert sorted(package.__all__) == sorted([name, "reference", "torch_impl"])


@pytest.mark.parametrize("folder", sorted(OPS))
def test_twins_share_one_signature(folder):
    name = OPS[folder]
    package = importlib.import_module(f"ple.ops.{folder}")
    impls = [package, importlib.import_module(f"ple.ops.{folder}.reference"), package.torch_impl]
    try:
        impls.append(importlib.import_module(f"ple.ops.{folder}.triton_impl"))
    except ImportError:  # triton is optional
        pass
    signatures = {str(inspect.signature(getattr(m, name))) for m in impls}
    assert len(signatures) == 1, signatures
    for m in impls:
        assert getattr(m, name).__doc__, f"{m.__name__}.{name} has no docstring"


def test_fused_twins_share_the_reference_parameters():
    from ple.ops import fused
    from ple.ops.fused import _compose, native, reference

    assert ple.ops.gate_conv is fused.gate_conv
    assert sorted(fused.__all__) == ["gate_conv", "native", "reference", "torch_impl"]
    names = list(inspect.signature(reference.gate_conv).parameters)
    assert list(inspect.signature(fused.gate_conv).parameters) == names
    assert list(inspect.signature(_compose.compose).parameters)[2:] == names
    assert list(inspect.signature(native.gate_conv).parameters) == [*names, "threads"]
