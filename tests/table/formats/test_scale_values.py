"""Scales are positive finite numbers wherever they enter a table: construction, conversion, table files
(the file side is in test_table_file.py, the checkpoint side in test_checkpoint.py)."""

from __future__ import annotations

import pytest
import torch

from ple.errors import InvalidArgumentError
from ple.table import MemoryTable, MmapTable
from ple.table.files.transcode import convert_layer
from ple.table.lookup import gather_dequant_reference
from tests.table._helpers import make_table, random_ids, shard_parts

BAD = [0.0, -0.0, -1.5, float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("value", BAD)
def test_memory_table_refuses_a_bad_global_scale(value):
    data, _ = make_table("fp8", 10, 4)
    with pytest.raises(InvalidArgumentError, match=f"'fp8' table: the scale is {value}, not a positive finite number"):
        MemoryTable(data, torch.tensor([value]))
    with pytest.raises(InvalidArgumentError, match="not a positive finite number"):
        MemoryTable(data, torch.tensor(value))  # a scalar global scale


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("fmt", ["fp8_row", "int8_row"])
def test_memory_table_refuses_a_bad_row_scale(fmt, value):
    data, scale = make_table(fmt, 10, 4)
    scale[6] = value
    with pytest.raises(InvalidArgumentError, match=f"the scale of row 6 is {value}"):
        MemoryTable(data, scale)


def test_empty_table_is_filled_then_serves():
    """``MemoryTable.empty`` starts with NaN scales on purpose (a loader fills them): not refused."""
    data, scale = make_table("int8_row", 12, 4)
    t = MemoryTable.empty(12, 4, "int8_row")
    assert t.scale.isnan().all()
    t.data.copy_(data)
    t.scale.copy_(scale)
    ids = random_ids(12, 3, 2)
    assert torch.equal(t.lookup(ids, torch.float32), gather_dequant_reference(data, scale, ids, torch.float32))


@pytest.mark.parametrize("to", [None, "int8_row"])
@pytest.mark.parametrize("fmt", ["fp8", "fp8_row"])
def test_convert_refuses_a_bad_source_scale(tmp_path, fmt, to):
    """A zero or NaN source scale is refused before it is copied or requantized (requantizing a row
    dequantized with scale 0 would give a valid-looking all-zero row)."""
    data, scale = make_table(fmt, 40, 4)
    if fmt == "fp8":
        scale = torch.zeros(1)
        want = "source shard 0: the scale is 0.0"
    else:
        scale[25] = float("nan")
        want = "source shard 2: the scale of row 25 is nan"
    with pytest.raises(InvalidArgumentError, match=want):
        convert_layer(shard_parts(data, scale, 10), tmp_path / "t.ple", "h", 40, 4, 10, to=to, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_good_scales_still_convert(tmp_path):
    data, scale = make_table("fp8_row", 40, 4)
    convert_layer(shard_parts(data, scale, 10), tmp_path / "t.ple", "h", 40, 4, 10, progress=False)
    assert torch.equal(MmapTable.open(tmp_path / "t.ple").scale, scale)
