import importlib
import inspect

import pytest

import ple.ops

OPS = {"norm": "grouped_rms_norm", "gate": "ngram_gate", "conv": "dilated_conv"}


def test_public_api_is_pinned():
    assert sorted(ple.ops.__all__) == sorted(
        [
            "ConvWeights",
            "GateWeights",
            "StepMeta",
            "conv_stage",
            "dilated_conv",
            "gate_conv",
            "gate_stage",
            "grouped_rms_norm",
            "ngram_gate",
        ]
    )
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


@pytest.mark.parametrize("name", ["gate_conv", "gate_stage", "conv_stage"])
def test_fused_twins_share_the_reference_parameters(name):
    from ple.ops import fused
    from ple.ops.fused import _compose, native, reference, torch_impl

    assert getattr(ple.ops, name) is getattr(fused, name)
    assert sorted(fused.__all__) == ["conv_stage", "gate_conv", "gate_stage", "native", "reference", "torch_impl"]
    names = list(inspect.signature(getattr(reference, name)).parameters)
    assert list(inspect.signature(getattr(fused, name)).parameters) == names
    assert list(inspect.signature(getattr(native, name)).parameters) == [*names, "threads"]
    twins = [torch_impl]
    try:
        from ple.ops.fused import triton_impl

        twins.append(triton_impl)
    except ImportError:  # triton is optional
        pass
    for m in twins:  # they take the reference's arguments (positional records, keyword options)
        assert getattr(m, name).__doc__
    composed = {"gate_conv": _compose.compose, "gate_stage": _compose.gate_stage, "conv_stage": _compose.conv_stage}
    skip = 2 if name == "gate_conv" else 1
    assert list(inspect.signature(composed[name]).parameters)[skip:] == names
