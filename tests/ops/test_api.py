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
        assert getattr(ple.ops, name) is getattr(ple.ops.library, name)  # calls the operator
        assert sorted(package.__all__) == ["reference", "torch_impl"]  # the twins, no dispatcher


@pytest.mark.parametrize("folder", sorted(OPS))
def test_twins_share_one_signature(folder):
    name = OPS[folder]
    package = importlib.import_module(f"ple.ops.{folder}")
    impls = [ple.ops, importlib.import_module(f"ple.ops.{folder}.reference"), package.torch_impl]
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
    from ple.ops.fused import composed, native, reference

    assert getattr(ple.ops, name) is getattr(ple.ops.library, name)
    assert sorted(fused.__all__) == ["composed", "native", "reference"]  # no dispatcher
    names = list(inspect.signature(getattr(reference, name)).parameters)
    assert list(inspect.signature(getattr(ple.ops, name)).parameters) == names
    assert list(inspect.signature(getattr(native, name)).parameters) == [*names, "threads"]
    method = getattr(composed.Composed, name)  # the PyTorch and Triton paths: positional records, keyword options
    records = [p for p in names if p not in ("token_mask", "add_hidden", "return_conv_input", "validate")]
    assert list(inspect.signature(method).parameters) == ["self", *records, "options"]
    assert method.__doc__
    functions = {"gate_conv": composed.compose, "gate_stage": composed.gate_stage, "conv_stage": composed.conv_stage}
    skip = 2 if name == "gate_conv" else 1
    assert list(inspect.signature(functions[name]).parameters)[skip:] == names
