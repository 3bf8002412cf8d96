"""``ple inspect``: what a path is and what it holds (:func:`run`); the rows of a table are never read
(``ple verify`` recomputes their checksums)."""

from __future__ import annotations

import argparse
import os
import struct
from typing import Any

from ple.checkpoint import classify as paths
from ple.checkpoint import scan_checkpoint
from ple.checkpoint.gguf import ple_table, read_gguf
from ple.commands.report import GGUF_FILE, add_json_argument, emit_json, human, short
from ple.common.files import open_regular, pread_exact
from ple.errors import InvalidArgumentError
from ple.table import FORMATS, format_info
from ple.table.files.table_file import TableFileError

__all__ = ["HELP", "add_arguments", "run", "table_bytes"]

HELP = (
    "what a path is and holds: layout per PLE layer; for a checkpoint, a check of its headers and small "
    "tensors; for a training checkpoint, its trained rows; for a GGUF model, its PLE metadata and table "
    "tensor; for a table file, its header and what it was made from; for a table folder, its table files; "
    "for an adapter, its layers"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path",
        help="config.json, model directory (a Trainer checkpoint-N folder too), model.safetensors.index.json, a "
        f"{GGUF_FILE}, a .pletable table file, a folder of table files or an adapter file",
    )
    add_json_argument(p)


def table_bytes(layout, fmt: str) -> int:
    """Bytes of a layer's table in format ``fmt``: rows plus scales (one global, or one per row)."""
    info = format_info(fmt)
    n = layout.padded_rows * info.row_nbytes(layout.head_dim)
    return n + {"none": 0, "global": 4, "row": 4 * layout.padded_rows}[info.scale_kind]


def run(args: argparse.Namespace) -> int:
    """What the path is (:func:`ple.checkpoint.classify.classify`) and what it holds: the layout of
    every PLE layer, and for a checkpoint the scan (headers and small tensors, never the table; exit 1
    on problems), for a training checkpoint its trained rows; for a GGUF file, its PLE metadata and
    table tensor; for a table file, its validated header and what it was made from; for a table
    folder, its table files; for an adapter, its layers."""
    info = paths.classify(args.path, also="a GGUF file or a .pletable table file")
    if info.kind == paths.GGUF:
        return _inspect_gguf(args)
    if info.kind in (paths.TABLE_FILE, paths.MERGED_TABLE):
        return _inspect_table(args, info)
    if info.kind in (paths.TABLE_FOLDER, paths.ADAPTER):
        return _inspect_folder_or_adapter(args, info)
    cfg, ckpt = info.config, info.weights
    if cfg is None:  # not ple's: the model reader's reason
        raise info.refusal("a model")
    if not cfg.ple_layer_ids:
        raise InvalidArgumentError(
            f"{args.path}: the config has no PLE layers (ple_layer_ids is empty or missing); "
            "is it a qwen4_exp model with PLE?"
        )
    scan = scan_checkpoint(ckpt, cfg) if ckpt is not None else None
    entries = {e.ple_layer_index: e for e in scan.layers} if scan else {}
    trained = {t.decoder_layer: t.trained_rows for t in info.trained}  # a training checkpoint's
    layers = []
    for idx in range(cfg.num_ple_layers):
        lay = cfg.layout(idx)
        e = entries.get(idx)
        explained = paths.explained_by_training(e) if e else []
        layers.append(
            {
                "ple_layer_index": idx,
                "decoder_layer": cfg.ple_layer_ids[idx] - 1,
                "prefix": e.prefix if e else cfg.layer_prefix(idx),
                **{k: v for k, v in lay.to_dict().items() if k != "ple_layer_index"},
                "table_format": e.table_format if e else None,
                "trained_rows": trained.get(cfg.ple_layer_ids[idx] - 1),
                "bytes": {f: table_bytes(lay, f) for f in FORMATS if lay.head_dim % format_info(f).block == 0},
                "problems": [q for q in e.problems if q not in explained] if e else [],
            }
        )
    problems = (scan.problems if scan else []) + [q for d in layers for q in d["problems"]]
    if args.json:
        doc: dict[str, Any] = {"path": str(args.path), "kind": info.kind, "layers": layers}
        doc["problems"] = scan.problems if scan else []
        if info.kind == paths.TRAINING:
            doc.update(what=info.what, trainer_step=info.trainer_step)
        emit_json(doc)
        return 1 if problems else 0
    print(
        f"config: {args.path}   hidden {cfg.hidden_size} x hc {cfg.hc_count}, E {cfg.ple_embed_dim}, "
        f"N {cfg.ngram_size}, {cfg.num_heads} heads of {cfg.head_dim}, K {cfg.ple_conv_kernel_size}, "
        f"eos {cfg.eos_token_id}, seed {cfg.seed}"
    )
    if info.kind == paths.TRAINING:
        print(
            f"{info.what}: load the base model with from_pretrained, then model.load_state_dict of these weights "
            "(or resume with Trainer(resume_from_checkpoint=...))"
        )
    for d in layers:
        print(f"\nPLE layer {d['ple_layer_index']} (decoder layer {d['decoder_layer']})  prefix {d['prefix']}")
        print(f"  multipliers  {d['multipliers']}")
        print(f"  head sizes   {d['head_sizes'][0]} .. {d['head_sizes'][-1]} ({len(d['head_sizes'])} primes)")
        print(f"  rows         {d['rows']:,} (padded {d['padded_rows']:,}) x {d['head_dim']}")
        print(f"  shards       {d['split_parts']} x {d['shard_rows']:,} rows")
        print("  size         " + ", ".join(f"{f} {human(b)}" for f, b in d["bytes"].items()))
        if ckpt is not None:
            held = f"table {d['table_format'] or '-'}"
            if d["trained_rows"] is not None:
                held = f"{d['trained_rows']:,} trained rows (the table is the base model's)"
            print(f"  checkpoint   {held}; " + ("OK" if not d["problems"] else "PROBLEMS:"))
            for q in d["problems"]:
                print(f"    - {q}")
    for q in scan.problems if scan else []:
        print(f"problem: {q}")
    return 1 if problems else 0


def _global_scale(path: str, header: dict[str, Any]) -> float | None:
    if header["scale"]["kind"] != "global":
        return None
    fd = open_regular(path, "table file", TableFileError)
    try:
        blob = pread_exact(fd, 4, header["scale"]["offset"], lambda at: TableFileError(f"{path}: ends at byte {at}"))
    finally:
        os.close(fd)
    return float(struct.unpack("<f", blob)[0])


def _inspect_table(args: argparse.Namespace, kind: paths.PathInfo) -> int:
    """``ple inspect FILE.pletable``: what the file's (validated) header says, and what the table was
    made from; its rows are not read (``ple verify`` recomputes their checksums)."""
    h = kind.header
    assert h is not None
    identity = kind.identity()
    assert identity is not None
    info = format_info(h["format"])
    layout = h.get("layout")
    doc: dict[str, Any] = {
        "path": str(args.path),
        "kind": kind.kind,
        "identity": identity.describe(),
        "merged": h.get("merged"),
        "format": h["format"],
        "storage_dtype": h["storage_dtype"],
        "block": info.block,
        "rows": h["rows"],
        "head_dim": h["head_dim"],
        "row_nbytes": h["row_nbytes"],
        "file_nbytes": h["file_nbytes"],
        "complete": h["complete"],
        "sparse": h["sparse"],
        "scale": {"kind": h["scale"]["kind"], "value": _global_scale(args.path, h)},
        "source": paths.layout_source(layout),
        "layout_hash": h["layout_hash"],
        "layout": layout,
        "shard_rows": h["shard_rows"],
        "num_shards": h["num_shards"],
        "checksums": {k: h["checksum"][k] for k in ("algorithm", "shards", "scale")},
    }
    if args.json:
        emit_json(doc)
        return 0
    blocks = f"blocks of {info.block} values, {info.block_nbytes} B each, " if info.blocked else ""
    scale = {
        "none": "no scale",
        "global": f"one global scale {doc['scale']['value']!r}",
        "row": "a float32 scale per row",
    }[h["scale"]["kind"]]
    state = "complete" if h["complete"] else "INCOMPLETE: its writer never finished"
    print(f"table file {args.path}: {state}" + ("; sparse (no checksums)" if h["sparse"] else ""))
    print(f"  format    {h['format']} ({blocks}stored as {h['storage_dtype']}); {scale}")
    print(
        f"  rows      {h['rows']:,} x {h['head_dim']} values, {h['row_nbytes']} B a row; file {human(h['file_nbytes'])}"
    )
    print(f"  source    {doc['source']}")
    print(f"  identity  {identity.describe()}")
    if kind.kind == paths.MERGED_TABLE:
        print(f"  merged    {paths.merge_phrase(h['merged'])}")
    print(f"  layout    hash {h['layout_hash']}")
    fields = layout.get("gguf", layout) if isinstance(layout, dict) else {}
    for k, v in fields.items():
        print(f"            {k:34s} {short(v)}")
    sums = h["checksum"]["shards"]
    print(
        f"  shards    {h['num_shards']} of {h['shard_rows']:,} rows"
        + ("" if sums is None else f"; {h['checksum']['algorithm']}:")
    )
    shown_sums = sums if sums is None or len(sums) <= 16 else sums[:16]
    for k, c in enumerate(shown_sums or []):
        print(f"            {k:5d} {c}")
    if sums is not None and len(sums) > len(shown_sums or []):
        print(f"            ... {len(sums) - 16} more (--json lists them all)")
    if h["checksum"]["scale"] is not None:
        print(f"            scale {h['checksum']['scale']}")
    return 0


def _inspect_folder_or_adapter(args: argparse.Namespace, info: paths.PathInfo) -> int:
    """``ple inspect`` of a table folder or an adapter file (:func:`ple.checkpoint.classify.report`)."""
    doc, lines = paths.report(info)
    if args.json:
        emit_json(doc)
    else:
        print("\n".join(lines))
    return 1 if doc.get("problems") else 0


def _inspect_gguf(args: argparse.Namespace) -> int:
    model = read_gguf(args.path)
    t = ple_table(model)
    info = format_info(t.format or "fp32")
    doc: dict[str, Any] = {
        "path": str(args.path),
        "files": [str(p) for p in model.paths],
        "version": model.version,
        "architecture": model.arch,
        "ple": model.ple_metadata(),
        "table": {
            "tensor": t.name,
            "type": t.type_name,
            "format": t.format,
            "rows": t.dims[1],
            "head_dim": t.dims[0],
            "row_nbytes": info.row_nbytes(t.dims[0]),
            "nbytes": t.nbytes,
        },
    }
    if args.json:
        emit_json(doc)
        return 0
    print(f"GGUF {args.path}: version {model.version}, {len(model.paths)} file(s), architecture {model.arch}")
    for k, v in doc["ple"].items():
        print(f"  {k:34s} {short(v)}")
    tab = doc["table"]
    print(
        f"  table {t.name}: {t.type_name} ({t.format}), {tab['rows']:,} rows x {tab['head_dim']}, "
        f"{tab['row_nbytes']} B/row, {human(t.nbytes or 0)}"
    )
    return 0
