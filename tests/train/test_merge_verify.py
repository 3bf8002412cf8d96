"""A merged table verifies on its own: its header's merge record holds the trained rows' ids and digests
of their stored bytes (:mod:`ple.train.merge_record`), so ``ple verify FILE --checkpoint DIR`` compares
the untouched rows with the checkpoint and the trained rows with the record, with no adapter file.

- ``merge_model``'s files (merged from a model's memory: no adapter file ever named) verify (exit 0);
  a trained row changed (the file's checksums made to match) fails, naming the row.
- ``merge_table_file`` with an adapter file verifies against the adapter while it is there, and against
  the record once it is gone.
- A record that is wrong (a field's type, a row count, ids out of range, another PLE layer) is one line
  naming the field (exit 1), never a traceback; an adapter layer of another geometry is refused by
  ``check_merged_rows``, not an IndexError.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import shutil
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ple.commands.cli import main
from ple.errors import InvalidArgumentError
from ple.integrations.demo_model import save_published
from ple.integrations.transformers import from_pretrained
from ple.table import MmapTable, read_table_header
from ple.table.files.table_file import TableFileError
from ple.table.files.writer import TableFileWriter
from ple.train import SparseAdam, merge_model, merge_record, merge_table_file, read_adapter, save_adapter, trainable
from ple.train.merge import check_merged_rows, merged_rows
from ple.train.merge_record import MODEL_ADAPTER, RecordedRows, encode_ids, recorded_rows
from tests.integrations.conftest import _one_thread  # noqa: F401 (autouse: one torch thread, as the tiny models want)
from tests.integrations.helpers import EOS, VOCAB, tiny_config, tiny_model

CFG = tiny_config(ple_embed_dim=128)
P0, P1 = "model.layers.0.ple.pletable", "model.layers.1.ple.pletable"


def _trained(ck: Path, tables: Path, **kw):
    model = from_pretrained(ck, table_dir=tables, **kw)
    model.requires_grad_(False)  # the tables alone train
    opt = SparseAdam(trainable(model), lr=0.1)
    for i in range(2):
        ids = torch.randint(EOS + 1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(i))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """An fp8 checkpoint; a model trained over its table folder merged by ``merge_model`` (fp8, and int8_row:
    per-row scales), and an adapter of it."""
    root = tmp_path_factory.mktemp("merge-verify")
    ck = root / "ck"
    save_published(tiny_model(CFG, seed=1), ck)
    model = _trained(ck, root / "tables")
    adapter = save_adapter(root / "adapter.safetensors", model)
    merge_model(model, root / "merged")
    merge_model(_trained(ck, root / "tables-int8", table_format="int8_row"), root / "merged-int8")
    return SimpleNamespace(root=root, ck=ck, tables=root / "tables", adapter=adapter, merged=root / "merged")


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _rewrite(src: Path, dst: Path, record: dict | None = None, row: int | None = None) -> Path:
    """A sound table file (its checksums its own) holding ``src``'s rows and header, with the merge record
    ``record`` and, given ``row``, that row's first byte changed."""
    dst.parent.mkdir(exist_ok=True)
    h = read_table_header(src)
    table = MmapTable.open(src, random_access=False)
    try:
        data = table.data.clone()
        scale = None if table.scale is None else table.scale.clone()
    finally:
        table.close()
    if row is not None:
        raw = data.view(torch.uint8).reshape(h["rows"], -1)
        raw[row, 0] = 0x11 if int(raw[row, 0]) == 0x10 else 0x10  # finite in every format
    kind = h["scale"]["kind"]
    merged = h["merged"] if record is None else record
    with TableFileWriter(dst, h["rows"], h["head_dim"], h["format"], h["shard_rows"], h["layout"], merged=merged) as w:
        for k in range(w.num_shards):
            a, b = w.shard_range(k)
            w.write_shard(k, data[a:b], scale[a:b] if kind == "row" else scale)
    return dst


# ---------------------------------------------------------------------------------------------- merge_model
@pytest.mark.parametrize("folder", ["merged", "merged-int8"])
def test_merge_model_files_verify_on_their_own(world, capsys, folder):
    merged = world.root / folder
    names = sorted(p.name for p in merged.iterdir())  # no adapter file, hidden or not
    suffix = "" if folder == "merged" else "int8_row."
    assert names == [f"model.layers.{i}.ple.{suffix}pletable" for i in (0, 1)]
    for name in names:
        header = read_table_header(merged / name)
        record = header["merged"]
        assert record["adapter"] == MODEL_ADAPTER
        rows = recorded_rows(merged / name, header)
        assert isinstance(rows, RecordedRows) and rows.trained_rows == record["trained_rows"] > 0
        assert rows.group == 1 and len(rows.digests) == 8 * rows.trained_rows
        assert bool((np.diff(rows.ids) > 0).all()) and 0 <= int(rows.ids[0]) and int(rows.ids[-1]) < header["rows"]
        _, trained, source, why = merged_rows(merged / name)
        assert why == "" and isinstance(source, RecordedRows) and trained is source
        assert np.array_equal(source.ids, rows.ids) and source.digests == rows.digests
        assert check_merged_rows(merged / name, source, record["ple_layer_index"]) == []
        code, out, err = run(capsys, "verify", merged / name, "--checkpoint", world.ck)
        assert (code, err) == (0, "")
        assert out == (
            f"{merged / name}: OK (a merge of {MODEL_ADAPTER} (PLE layer {record['ple_layer_index']}): "
            f"{record['trained_rows']:,} rows trained, equal to their recorded digests; the rest equal to the checkpoint's)\n"
        )
    code, out, _ = run(capsys, "verify", merged, "--checkpoint", world.ck)
    assert code == 0 and out.endswith("2 files: all OK\n")


@pytest.mark.parametrize("folder", ["merged", "merged-int8"])
def test_a_changed_trained_row_is_named(world, tmp_path, capsys, folder):
    src = next(iter(sorted((world.root / folder).iterdir())))
    ids = recorded_rows(src, read_table_header(src)).ids
    at = int(ids[len(ids) // 2])
    bad = _rewrite(src, tmp_path / src.name, row=at)
    assert run(capsys, "verify", bad)[0] == 0  # its checksums hold: only the record tells
    code, out, err = run(capsys, "verify", bad, "--checkpoint", world.ck)
    assert (code, err) == (1, "")
    assert out == (
        f"problem: {bad}: the trained rows differ from the stored digests of its merge record: 1 row, "
        f"first at row {at}\n"
    )
    untrained = next(r for r in range(read_table_header(src)["rows"]) if r not in set(ids.tolist()))
    other = _rewrite(src, tmp_path / "other" / src.name, row=untrained)
    code, out, _ = run(capsys, "verify", other, "--checkpoint", world.ck)
    assert code == 1 and "rows differ from the source" in out and "merge record" not in out


# ---------------------------------------------------------------------------------------------- merge_table_file
def test_merge_table_file_verifies_with_its_adapter_and_without_it(world, tmp_path, capsys):
    out = merge_table_file(world.tables / P0, world.adapter, tmp_path / P0)
    record = read_table_header(out)["merged"]
    assert record["adapter"] == str(world.adapter.resolve())
    _, entry, file, why = merged_rows(out)
    assert why == "" and file is not None and file.path == world.adapter  # the adapter itself, while there
    assert entry is not None and not isinstance(file, RecordedRows) and check_merged_rows(out, file, 0) == []
    assert run(capsys, "verify", out, "--checkpoint", world.ck)[0] == 0
    moved = tmp_path / "elsewhere.safetensors"
    shutil.copy(world.adapter, moved)
    world.adapter.unlink()
    try:
        _, entry, file, why = merged_rows(out)
        assert why == "" and isinstance(file, RecordedRows) and entry is file  # the record's own rows
        code, said, _ = run(capsys, "verify", out, "--checkpoint", world.ck)
        assert code == 0 and f"{record['trained_rows']:,} rows trained" in said
        # a merge recorded before records held the rows: the adapter is needed, as it was
        old = _rewrite(out, tmp_path / "old" / P0, {k: v for k, v in record.items() if k != "rows"})
        code, said, _ = run(capsys, "verify", old, "--checkpoint", world.ck)
        assert code == 1 and f"the adapter it names, {world.adapter.resolve()}, is not there" in said
    finally:
        shutil.copy(moved, world.adapter)

    # an adapter whose layer is of another row count than the file's: refused naming both, not an IndexError
    file = read_adapter(world.adapter)
    rows = read_table_header(out)["rows"]
    other = dataclasses.replace(file, layers={0: dataclasses.replace(file.layers[0], rows=rows * 2)})
    with pytest.raises(InvalidArgumentError) as refused:
        check_merged_rows(out, other, 0)
    assert (
        str(refused.value)
        == f"{world.adapter}: its PLE layer 0 ([{rows * 2}, 32] rows) is not for {out} ([{rows}, 32])"
    )


def test_many_trained_rows_share_a_digest(world, tmp_path, monkeypatch):
    """Past ``MAX_DIGESTS`` trained rows a digest covers a group of rows (a power of two): a changed row
    is named by its group."""
    monkeypatch.setattr(merge_record, "MAX_DIGESTS", 16)
    out = merge_table_file(world.tables / P0, world.adapter, tmp_path / P0)
    rows = recorded_rows(out, read_table_header(out))
    assert rows is not None and rows.trained_rows > 64
    group = rows.group
    assert group & (group - 1) == 0 and -(-rows.trained_rows // group) <= 16 < -(-rows.trained_rows // (group // 2))
    assert len(rows.digests) == 8 * -(-rows.trained_rows // group) and rows.problems() == []
    at = int(rows.ids[group + 1])  # in the second group
    bad = _rewrite(out, tmp_path / "bad" / P0, row=at)
    (problem,) = recorded_rows(bad, read_table_header(bad)).problems()
    assert problem == (
        f"{bad}: the trained rows differ from the stored digests of its merge record: 1 group of {group} rows, "
        f"the first among rows {int(rows.ids[group])}..{int(rows.ids[2 * group - 1])}"
    )


# ---------------------------------------------------------------------------------------------- bad records
def _ids_blob(ids) -> str:
    return encode_ids(np.asarray(ids, dtype=np.int64))


def _raw_blob(values) -> str:
    return base64.b64encode(zlib.compress(np.asarray(values, "<i8").tobytes())).decode()


BAD = {
    "another PLE layer": (lambda r, n, rows: r.update(ple_layer_index=1), "ple_layer_index", "1"),
    "a negative PLE layer": (lambda r, n, rows: r.update(ple_layer_index=-1), "ple_layer_index", "-1"),
    "index a string": (lambda r, n, rows: r.update(ple_layer_index="0"), "ple_layer_index", "'0'"),
    "rows a float": (lambda r, n, rows: r.update(trained_rows=1.5), "trained_rows", "1.5"),
    "rows past the table": (lambda r, n, rows: r.update(trained_rows=rows + 1), "trained_rows", None),
    "one row more": (lambda r, n, rows: r.update(trained_rows=n + 1), "trained_rows", None),
    "adapter a number": (lambda r, n, rows: r.update(adapter=5), "adapter", "5"),
    "ids digest": (lambda r, n, rows: r.update(ids_digest="xyz"), "ids_digest", "'xyz'"),
    "into format": (lambda r, n, rows: r["into"].update(format="q4_0"), "into.format", "'q4_0'"),
    "identity": (lambda r, n, rows: r.update(identity={}), "identity", "{}"),
    "rows a list": (lambda r, n, rows: r.update(rows=[]), "rows", "[]"),
    "group a bool": (lambda r, n, rows: r["rows"].update(group=True), "rows.group", "True"),
    "group zero": (lambda r, n, rows: r["rows"].update(group=0), "rows.group", "0"),
    "digests not base64": (lambda r, n, rows: r["rows"].update(digests="not base64!"), "rows.digests", None),
    "digests short": (lambda r, n, rows: r["rows"].update(digests="AAAA"), "rows.digests", None),
    "ids not zlib": (lambda r, n, rows: r["rows"].update(ids="AAAA"), "rows.ids", None),
    "an id past the table": (
        lambda r, n, rows: r["rows"].update(ids=_ids_blob([*range(n - 1), rows])),
        "rows.ids",
        None,
    ),
    "a negative id": (lambda r, n, rows: r["rows"].update(ids=_raw_blob([-1] + [1] * (n - 1))), "rows.ids", None),
    "ids unsorted": (lambda r, n, rows: r["rows"].update(ids=_raw_blob([5, -1] + [3] * (n - 2))), "rows.ids", None),
    "other ids": (lambda r, n, rows: r["rows"].update(ids=_ids_blob(range(n))), "rows.ids", None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_wrong_merge_record_is_one_line_naming_the_field(world, tmp_path, capsys, case):
    change, field, shown = BAD[case]
    src = world.merged / P0
    header = read_table_header(src)
    record = copy.deepcopy(header["merged"])
    change(record, record["trained_rows"], header["rows"])
    bad = _rewrite(src, tmp_path / P0, record)
    code, out, err = run(capsys, "verify", bad, "--checkpoint", world.ck)
    assert (code, out) == (1, "") and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"ple verify: {bad}: header field 'merged.{field}' is ")
    if shown is not None:
        assert err.startswith(f"ple verify: {bad}: header field 'merged.{field}' is {shown}, expected ")
    with pytest.raises(TableFileError) as raised:  # the library says the same
        merged_rows(bad)
    assert str(raised.value) == err.removeprefix("ple verify: ").rstrip("\n")
    code, out, err = run(capsys, "verify", bad)  # without the checkpoint: the record is checked all the same
    assert code == 1 and err == "" and f"problem: {bad}: header field 'merged.{field}' is " in out
