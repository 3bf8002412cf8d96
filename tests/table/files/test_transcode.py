"""convert_layer / compare_with_source on small tables of every source kind."""

from __future__ import annotations

import pytest
import torch

from ple.table import MmapTable, dequantize, quantize_rows, read_table_header, verify_table_file
from ple.table.files.transcode import compare_with_source, convert_layer
from ple.table.formats.quantize import quantization_error
from tests.table._helpers import flip_byte, make_table, shard_parts

ROWS, D, S = 70, 12, 16  # 5 shards, the last one short
HEADS = [(0, 23), (23, 47), (47, 70)]


def source(fmt, seed=0, order=(4, 1, 3, 0, 2)):
    data, scale = make_table(fmt, ROWS, D, seed=seed)
    parts = list(shard_parts(data, scale, S))
    return data, scale, [parts[i] for i in order]


@pytest.mark.parametrize("src_fmt", ["bf16", "fp16", "fp32", "fp8", "fp8_row", "int8_row"])
def test_copy_keeps_the_source(tmp_path, src_fmt):
    data, scale, parts = source(src_fmt)
    stats = convert_layer(iter(parts), tmp_path / "t.ple", "h", ROWS, D, S, progress=False, head_ranges=HEADS)
    assert stats["format"] == stats["source_format"] == src_fmt
    assert stats["error"] == {"max_rel": 0.0, "rms_rel": 0.0, "rows": ROWS}
    assert [h["rows"] for h in stats["per_head"]] == [23, 24, 23]
    t = MmapTable.open(tmp_path / "t.ple", expected_layout_hash="h")
    assert torch.equal(t.data.view(torch.uint8), data.view(torch.uint8))
    assert compare_with_source(tmp_path / "t.ple", parts) == []
    assert verify_table_file(tmp_path / "t.ple") == []


@pytest.mark.parametrize("src_fmt", ["bf16", "fp32", "fp8", "int8_row"])
@pytest.mark.parametrize("to", ["fp8_row", "int8_row"])
def test_requantize(tmp_path, src_fmt, to):
    data, scale, parts = source(src_fmt, seed=3)
    path = tmp_path / "t.ple"
    stats = convert_layer(parts, path, {"seed": 1}, ROWS, D, S, to=to, progress=True, head_ranges=HEADS)
    assert stats["format"] == to and stats["source_format"] == src_fmt
    x = dequantize(data, None if scale is None else scale.float(), torch.float32)  # global scale applied first
    q, s = quantize_rows(x, to)
    t = MmapTable.open(path)
    assert t.format == to
    assert torch.equal(t.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(t.scale, s)
    for (a, b), h in zip(HEADS, stats["per_head"]):
        want = quantization_error(x[a:b], q[a:b], s[a:b])
        assert (h["start"], h["stop"], h["rows"]) == (a, b, b - a)
        assert h["max_rel"] == pytest.approx(want.max_rel, rel=1e-12)
        assert h["rms_rel"] == pytest.approx(want.rms_rel, rel=1e-9)
        assert h["rms_rel"] < (0.05 if to == "fp8_row" else 0.01)
        assert h["rms_rel"] > 0 or src_fmt == to  # requantizing int8 rows per row is lossless
    whole = quantization_error(x, q, s)
    assert stats["error"]["rms_rel"] == pytest.approx(whole.rms_rel, rel=1e-9)
    assert compare_with_source(path, parts) == []


def test_compare_reports_changed_rows_and_missing_shards(tmp_path):
    data, scale, parts = source("bf16", seed=5)
    path = tmp_path / "t.ple"
    convert_layer(parts, path, "h", ROWS, D, S, to="int8_row", progress=False)
    h = read_table_header(path)
    flip_byte(path, h["data_offset"] + 37 * h["row_nbytes"])  # row 37, shard 2
    problems = compare_with_source(path, [p for p in parts if p[0] != 4])
    assert any("shard 2 (rows [32, 48)): 1 rows differ from the source, first at row 37" in p for p in problems)
    assert any("shard 4 (rows [64, 70)) is in the file but not in the source" in p for p in problems)
    assert len(problems) == 2
    other = [(k, r + 1 if r.dtype == torch.bfloat16 else r, s) for k, r, s in parts]
    assert len(compare_with_source(path, other)) == 5


def test_convert_refuses_mixed_or_bad_sources(tmp_path):
    _, _, parts = source("bf16")
    k, rows, s = parts[1]
    mixed = [parts[0], (k, rows.float(), s)] + parts[2:]
    with pytest.raises(ValueError, match=r"source shard 1 is 'fp32', but shard 4 was 'bf16'"):
        convert_layer(mixed, tmp_path / "t.ple", "h", ROWS, D, S, progress=False)
    assert not (tmp_path / "t.ple").exists() and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="never written"):
        convert_layer(parts[:3], tmp_path / "t.ple", "h", ROWS, D, S, to="fp8_row", progress=False)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="to must be"):
        convert_layer(parts, tmp_path / "t.ple", "h", ROWS, D, S, to="fp8", progress=False)
    with pytest.raises(ValueError, match="head range"):
        convert_layer(parts, tmp_path / "t.ple", "h", ROWS, D, S, progress=False, head_ranges=[(0, ROWS + 1)])
    with pytest.raises(ValueError, match="no shards"):
        convert_layer([], tmp_path / "t.ple", "h", ROWS, D, S, progress=False)
    convert_layer(parts, tmp_path / "t.ple", "h", ROWS, D, S, progress=False)
    with pytest.raises(FileExistsError):
        convert_layer(parts, tmp_path / "t.ple", "h", ROWS, D, S, progress=False)
    convert_layer(parts, tmp_path / "t.ple", "h", ROWS, D, S, to="int8_row", progress=False, force=True)
    assert MmapTable.open(tmp_path / "t.ple").format == "int8_row"
