"""The ``torch.ops.ple`` operators refuse operands on different devices, the meta device included.

The dispatcher sends a call with one tensor on the meta device to the operator's fake implementation
(its ``Meta`` kernel), whatever the devices of the others: without a check, ``gather_dequant`` returned
without writing ``out``, ``gate_conv`` returned uninitialized CPU tensors and ``dilated_conv`` left the
state pool as it was. Each call below moves one tensor argument to the meta device and expects a ple
error naming the devices, and every tensor the operator writes left as it was.
"""

from __future__ import annotations

import pytest
import torch

from ple.errors import InvalidArgumentError
from ple.kernels.registry import OPERATORS
from ple.table.lookup import gather_dequant
from tests.kernels.test_operators import SAMPLES, _mutated, _params

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tensor_positions(name: str) -> list[int]:
    args = SAMPLES[name](0, "cpu")
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


CASES = [
    (name, i)
    for name in sorted(SAMPLES)
    if name != "table_lookup"  # its one tensor is the ids: on meta, every tensor is (shapes only)
    for i in _tensor_positions(name)
]


@pytest.mark.parametrize(("name", "position"), CASES, ids=[f"{n}-{_params(OPERATORS[n].schema)[i]}" for n, i in CASES])
def test_a_meta_tensor_beside_cpu_tensors_is_refused(name, position):
    args = list(SAMPLES[name](0, "cpu"))
    param = _params(OPERATORS[name].schema)[position].split()[-1]
    args[position] = args[position].to("meta")
    written = {i: args[i].clone() for i in _mutated(OPERATORS[name].schema) if args[i].device.type == "cpu"}
    with pytest.raises(InvalidArgumentError, match=rf"{name}: operands on different devices \(.*{param} on meta"):
        getattr(torch.ops.ple, name)(*args)
    for i, before in written.items():
        assert _same_bytes(args[i], before), f"{name} wrote argument {i} although it refused the call"


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_gather_dequant_with_table_data_on_meta_names_both_devices():
    """The reported case: data on meta, ids and out on the CPU."""
    data = torch.randn(10, 4, device="meta")
    ids = torch.zeros(2, 3, dtype=torch.int64)
    out = torch.full((2, 12), 7.0)
    with pytest.raises(InvalidArgumentError, match=r"data on meta, ids on cpu, out on cpu"):
        torch.ops.ple.gather_dequant(data, None, ids, torch.float32, out, True, None)
    assert bool((out == 7.0).all())


def test_tensors_all_on_meta_run_the_fake():
    """Tensors all on the meta device are shapes only: the fake gives the result's shape, as for any op."""
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in SAMPLES["grouped_rms_norm"](0, "cpu")]
    out = torch.ops.ple.grouped_rms_norm(*args)
    assert out.device.type == "meta" and out.shape == args[0].shape
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in SAMPLES["gather_dequant"](0, "cpu")]
    torch.ops.ple.gather_dequant(*args)


@pytest.mark.parametrize("which", ["data", "scale", "out"])
def test_the_python_lookup_refuses_operands_off_the_ids_device(which):
    """``gather_dequant`` (what the tiers call) runs the ids' device's kernel: table data, scale and
    ``out`` elsewhere are refused by name, not read or left unwritten."""
    data, scale, ids, dtype, out, _, fmt = SAMPLES["gather_dequant"](1, "cpu")  # fp8_row: a per-row scale
    kw = {"data": data, "scale": scale, "out": out}
    kw[which] = kw[which].to("meta")
    with pytest.raises(InvalidArgumentError, match="on meta"):
        gather_dequant(kw["data"], kw["scale"], ids, dtype, out=kw["out"], format=fmt)


@needs_cuda
def test_cuda_lookups_refuse_operands_on_other_devices():
    data, scale, ids, dtype, out, check, fmt = SAMPLES["gather_dequant"](1, "cuda")
    op = torch.ops.ple.gather_dequant
    with pytest.raises(InvalidArgumentError, match="out is on cpu, the ids on cuda"):
        op(data, scale, ids, dtype, out.cpu(), check, fmt)
    with pytest.raises(InvalidArgumentError, match="the scale is on cpu, the table data on cuda"):
        op(data, scale.cpu(), ids, dtype, out, check, fmt)
    with pytest.raises(InvalidArgumentError, match="need the table data on that device or in pinned host memory"):
        op(data.cpu(), scale.cpu(), ids, dtype, out, check, fmt)
    with pytest.raises(InvalidArgumentError, match="need the table data on the CPU"):
        op(data, scale, ids.cpu(), dtype, out.cpu(), check, fmt)
