"""What the ``ple`` subcommands ``inspect``, ``ids``, ``convert``, ``verify`` and ``stats`` do.

Each function takes the parsed arguments (see :mod:`ple.commands.cli`), prints its result (text, or one
JSON document on stdout with ``--json``) and returns the exit status: 0 when all is well, 1 when the
input has problems (listed). Errors ple raises on purpose propagate to :func:`ple.commands.cli.main`, which
prints them as one line.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ple.checkpoint import (
    CheckpointError,
    check_checkpoint,
    open_layer_table,
    resolve_model,
    scan_checkpoint,
    table_file_name,
    table_shards,
    write_layer_table,
)
from ple.checkpoint import classify as paths
from ple.checkpoint.gguf import (
    PLE_KEYS,
    GGUFError,
    GGUFModel,
    GGUFRows,
    GGUFTensor,
    ple_metadata_problems,
    ple_table,
    read_gguf,
)
from ple.common.argtypes import parse_int, shown
from ple.common.files import open_regular, pread_exact
from ple.config import PLEConfig
from ple.convert.folder import made_from, record_table, source_identity
from ple.errors import CommandLineError, InvalidArgumentError, PLEError
from ple.table import FORMATS, format_info, read_table_header, verify_table_file
from ple.table.files.table_file import TABLE_SUFFIX, TableFileError, hash_layout
from ple.table.files.transcode import compare_with_source, convert_layer, table_amax, target_format
from ple.table.formats.blocks import nvfp4_global_scale

__all__ = ["inspect", "ids", "convert", "verify", "stats", "parse_tokens", "show_progress"]


def show_progress() -> bool:
    """Progress bars only when someone watches: stderr is a terminal."""
    return sys.stderr.isatty()


def _emit_json(doc: Any) -> None:
    print(json.dumps(doc, indent=1))


def _human(n: float) -> str:
    """Bytes in binary units, as the README's tables give them (``47.7 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def table_bytes(layout, fmt: str) -> int:
    """Bytes of a layer's table in format ``fmt``: rows plus scales (one global, or one per row)."""
    info = format_info(fmt)
    n = layout.padded_rows * info.row_nbytes(layout.head_dim)
    return n + {"none": 0, "global": 4, "row": 4 * layout.padded_rows}[info.scale_kind]


def _layer_index_help(cfg: PLEConfig) -> str:
    ids = list(cfg.ple_layer_ids)
    if not ids:
        return "the config has no ple_layer_ids"
    pairs = ", ".join(f"{i} (decoder layer {d - 1}, ple_layer_ids[{i}] = {d})" for i, d in enumerate(ids))
    return f"PLE layer indexes are positions in ple_layer_ids: {pairs}"


def _check_layer_index(cfg: PLEConfig, idx: int) -> None:
    if not 0 <= idx < cfg.num_ple_layers:
        raise CommandLineError(f"--layer {idx}: no such PLE layer; {_layer_index_help(cfg)}")


# ---------------------------------------------------------------------------------------------- inspect


def inspect(args: argparse.Namespace) -> int:
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
        _emit_json(doc)
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
        print("  size         " + ", ".join(f"{f} {_human(b)}" for f, b in d["bytes"].items()))
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
        _emit_json(doc)
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
        f"  rows      {h['rows']:,} x {h['head_dim']} values, {h['row_nbytes']} B a row; "
        f"file {_human(h['file_nbytes'])}"
    )
    print(f"  source    {doc['source']}")
    print(f"  identity  {identity.describe()}")
    if kind.kind == paths.MERGED_TABLE:
        print(f"  merged    {paths.merge_phrase(h['merged'])}")
    print(f"  layout    hash {h['layout_hash']}")
    fields = layout.get("gguf", layout) if isinstance(layout, dict) else {}
    for k, v in fields.items():
        print(f"            {k:34s} {_short(v)}")
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
        _emit_json(doc)
    else:
        print("\n".join(lines))
    return 1 if doc.get("problems") else 0


# ---------------------------------------------------------------------------------------------- ids

_TOKEN_SEP = re.compile(r"[,\s]+")


def parse_tokens(text: str) -> list[int]:
    """Token ids from ``"3,17,248044"`` or ``"3 17 248044"``; refuses empty lists, anything but ASCII
    digits (``"+5"``, ``"1_0"``, ``"٣"``: :func:`ple.common.argtypes.parse_int`) and negative ids, naming the
    offending entry (a :class:`~ple.errors.CommandLineError`: exit status 2)."""
    parts = [t for t in _TOKEN_SEP.split(text.strip()) if t]
    if not parts:
        raise CommandLineError(f"--tokens: no token ids in {text!r} (expected e.g. 3,17,248044,9)")
    out = []
    for i, t in enumerate(parts):
        v = parse_int(t)
        if v is None:
            raise CommandLineError(f"--tokens: entry {i} is {shown(t)}, not an integer token id")
        if v < 0:
            raise CommandLineError(f"--tokens: entry {i} is {v}; token ids are >= 0")
        out.append(v)
    return out


def ids(args: argparse.Namespace) -> int:
    """The table rows each token of a fresh request reads, per n-gram order and head."""
    import torch

    from ple.ngram import fresh_context, ngram_ids

    cfg, _ = resolve_model(args.path)
    tokens = parse_tokens(args.tokens)
    _check_layer_index(cfg, args.layer)
    lay = cfg.layout(args.layer)
    bad = [(i, t) for i, t in enumerate(tokens) if t >= cfg.vocab_size]
    if bad:
        i, t = bad[0]
        raise CommandLineError(f"--tokens: entry {i} is {t}, outside [0, vocab_size={cfg.vocab_size})")
    x = torch.tensor(tokens, dtype=torch.int64)
    rows = ngram_ids(x, torch.tensor([0, len(tokens)]), fresh_context(1, lay, cfg.eos_token_id), lay, cfg.eos_token_id)
    if args.json:
        _emit_json({"ple_layer_index": args.layer, "tokens": tokens, "ids": rows.tolist()})
        return 0
    hpn = cfg.heads_per_ngram
    table = rows.tolist()
    lines = []
    for t, (tok, y) in enumerate(zip(tokens, hashed_windows(tokens, cfg.ngram_size, cfg.eos_token_id))):
        lines.append(f"token {t}: {tok}")
        row = table[t]
        for order in range(2, cfg.ngram_size + 1):
            gram = list(reversed(y[:order]))
            g0 = (order - 2) * hpn
            heads = ", ".join(f"h{g0 + j}:{row[g0 + j]}" for j in range(hpn))
            lines.append(f"  {order}-gram {gram}: {heads}")
    print("\n".join(lines))
    return 0


def hashed_windows(tokens: list[int], ngram_size: int, eos_token_id: int):
    """Per token of a fresh request, ``[y_0, ..., y_{N-1}]`` as the hash sees them (itself, then its
    predecessors; EOS at or before the most recent earlier EOS, and before the start): what
    :func:`ple.ngram.reference.ngram_tokens` defines, in one pass (time linear in the tokens)."""
    last_eos = -1  # the most recent EOS strictly before t
    for t, tok in enumerate(tokens):
        yield [tokens[t - s] if t - s > last_eos and t - s >= 0 else eos_token_id for s in range(ngram_size)]
        if tok == eos_token_id:
            last_eos = t


# ---------------------------------------------------------------------------------------------- convert


def _parse_layers(text: str | None, cfg: PLEConfig) -> list[int] | None:
    if text is None:
        return None
    out = []
    for part in [p for p in _TOKEN_SEP.split(text.strip()) if p]:
        idx = parse_int(part)
        if idx is None:
            raise CommandLineError(f"--layers: {shown(part)} is not a PLE layer index")
        if not 0 <= idx < cfg.num_ple_layers:
            raise CommandLineError(f"--layers: no PLE layer {idx}; {_layer_index_help(cfg)}")
        out.append(idx)
    if not out:
        raise CommandLineError(f"--layers: no index given; {_layer_index_help(cfg)}")
    return out


# ---------------------------------------------------------------------------------------------- GGUF


def _short(v: Any) -> str:
    text = str(v)
    return text if len(text) <= 120 else text[:117] + "..."


def _gguf_config_problems(model: GGUFModel, table: GGUFTensor, cfg: PLEConfig) -> list[str]:
    """Where the GGUF's PLE metadata (and its table's shape) disagrees with the config's layer 0."""
    lay = cfg.layout(0)
    meta = model.ple_metadata()
    want = {
        "ple.layers": [i - 1 for i in cfg.ple_layer_ids[:1]],
        "ple.ngram_size": cfg.ngram_size,
        "ple.heads_per_ngram": cfg.heads_per_ngram,
        "ple.conv_kernel": cfg.ple_conv_kernel_size,
        "ple.eos_token_id": cfg.eos_token_id,
        "ple.layer_multipliers": list(lay.multipliers),
        "ple.head_offsets": list(lay.head_offsets),
        "ple.head_vocab_sizes": list(lay.head_sizes),
        "embedding_length_per_layer_input": lay.head_dim,
    }
    problems = [
        f"{model.arch}.{k} is {_short(meta[k])}, the config gives {_short(v)}"
        for k, v in want.items()
        if k in meta and meta[k] != v
    ]
    if table.dims != (lay.head_dim, lay.padded_rows):
        problems.append(
            f"tensor {table.name} is [{table.dims[0]}, {table.dims[1]}] ([head_dim, rows]), the config's table is "
            f"[{lay.head_dim}, {lay.padded_rows}]"
        )
    return problems


def _open_gguf(path: str, metadata: bool = True) -> tuple[GGUFModel, GGUFTensor]:
    model = read_gguf(path)
    return model, ple_table(model, metadata=metadata)


def _inspect_gguf(args: argparse.Namespace) -> int:
    model, t = _open_gguf(args.path)
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
        _emit_json(doc)
        return 0
    print(f"GGUF {args.path}: version {model.version}, {len(model.paths)} file(s), architecture {model.arch}")
    for k, v in doc["ple"].items():
        print(f"  {k:34s} {_short(v)}")
    tab = doc["table"]
    print(
        f"  table {t.name}: {t.type_name} ({t.format}), {tab['rows']:,} rows x {tab['head_dim']}, "
        f"{tab['row_nbytes']} B/row, {_human(t.nbytes or 0)}"
    )
    return 0


def _convert_gguf(args: argparse.Namespace) -> int:
    """``ple convert model.gguf OUT``: the GGUF's table, its bytes copied, as one table file."""
    # with a config, the PLE keys present must equal what it gives (which makes them consistent)
    model, t = _open_gguf(args.checkpoint, metadata=not args.config)
    assert t.format is not None
    if args.to is not None and target_format(args.to, t.format) is not None:
        raise CommandLineError(
            f"--to {args.to}: a GGUF table is written in its own type ({t.type_name}, ple format {t.format}), "
            f"never requantized: drop --to {args.to}"
        )
    if args.layers not in (None, "0"):
        raise CommandLineError(f"--layers {args.layers}: a GGUF model has one PLE table (layer 0)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"output {out} exists and is not a folder")
    head_dim, rows = t.dims
    if args.config:
        cfg = PLEConfig.from_pretrained(args.config)
        problems = _gguf_config_problems(model, t, cfg)
        if problems:
            raise GGUFError(f"{args.checkpoint} does not match {args.config}: " + "; ".join(problems))
        layout: dict[str, Any] = cfg.layout_fields(0)
        shard_rows = cfg.layout(0).shard_rows
        path = out / table_file_name(cfg.layer_prefix(0))
    else:
        meta = model.ple_metadata()
        needed = (
            "ple.layer_multipliers",
            "ple.head_offsets",
            "ple.head_vocab_sizes",
            "ple.ngram_size",
            "ple.heads_per_ngram",
        )
        missing = [f"{model.arch}.{k}" for k in needed if k not in meta]
        if missing:
            raise GGUFError(
                f"{args.checkpoint} lacks the PLE metadata {', '.join(missing)}: name the model's config.json with --config"
            )
        layout = {"gguf": {k: meta[k] for k in PLE_KEYS if k in meta}, "ple_layer_index": 0}
        shard_rows = min(rows, 1 << 20)
        path = out / ("per_layer_token_embd" + TABLE_SUFFIX)
    if path.exists() and not args.force:
        raise FileExistsError(f"table file {path} exists: pass --force to replace it")
    source = GGUFRows(t, shard_rows)  # bytes copied, values checked finite, resumable
    with _output_folder(out):
        convert_layer(source, path, layout, rows, head_dim, shard_rows, force=args.force, progress=show_progress())
    stats = {"ple_layer_index": 0, "path": str(path), "format": t.format, "source_format": f"gguf {t.type_name}"}
    stats["rows"] = rows
    if args.json:
        _emit_json({"checkpoint": str(args.checkpoint), "out": str(out), "layers": [stats]})
    else:
        print(f"PLE layer 0: wrote {path} (GGUF {t.type_name} -> {t.format}, bytes copied)")
    return 0


def convert(args: argparse.Namespace) -> int:
    """One memory-mappable table file per PLE layer, written atomically and streamed shard by shard.

    The checkpoint passes the loader's validation first (:func:`ple.checkpoint.check_checkpoint`, dense
    weights included): what the loader refuses is never converted. A GGUF model (one file or a split
    set) gives its table in its own type, bytes copied."""
    info = paths.classify(args.checkpoint)
    if info.kind == paths.GGUF:
        return _convert_gguf(args)
    info.require(
        paths.CHECKPOINT, paths.CONFIG, wanted="a checkpoint (a model folder) or a GGUF model, what ple convert reads"
    )
    cfg, ckpt = info.config, info.weights
    assert cfg is not None
    if args.config:
        cfg = PLEConfig.from_pretrained(args.config)
    if ckpt is None:
        raise CheckpointError(f"{args.checkpoint}: no safetensors weights found")
    wanted = _parse_layers(args.layers, cfg)
    _check_target_fits(args.to, cfg.head_dim)
    scan = check_checkpoint(ckpt, cfg, layers=wanted, dense_values=True)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"output {out} exists and is not a folder")
    entries = [e for e in scan.layers if wanted is None or e.ple_layer_index in wanted]
    for e in entries:  # a merged table is never converted over, --force or not
        merged = paths.merged_table(out / table_file_name(e.prefix))
        if merged is not None:
            raise InvalidArgumentError(
                f"table file {merged.path} is {merged.what}: ple convert never writes over a merged table; "
                "convert into another folder, or move it out of this one"
            )
    done: set[int] = set()  # layers whose file an earlier run of this conversion finished: kept
    for e in entries if not args.force else []:
        path = out / table_file_name(e.prefix)
        if os.path.lexists(path):
            fmt = target_format(args.to, e.table_format or "") or e.table_format or ""
            why = made_from(path, e, cfg, fmt)
            if why is not None:
                raise FileExistsError(f"table file {path} exists and is not kept ({why}): pass --force to replace it")
            done.add(e.ple_layer_index)
    results: list[dict[str, Any]] = []
    with _output_folder(out):
        _convert_layers(args, cfg, entries, out, results, done)
    if args.json:
        _emit_json({"checkpoint": str(args.checkpoint), "out": str(out), "layers": results})
    return 0


def _check_target_fits(to: str | None, head_dim: int) -> None:
    """``--to`` names a format whose blocks divide rows of ``head_dim`` values: one that does not is a
    command-line value out of range for this checkpoint (exit status 2). (A source already in that
    format is copied, and its rows fit by construction.)"""
    target = target_format(to, "")
    if target is None:
        return
    block = format_info(target).block
    if head_dim % block:
        fits = [f for f in FORMATS if head_dim % format_info(target_format(f, "") or f).block == 0]
        raise CommandLineError(
            f"--to {to}: the checkpoint's rows are {head_dim} values (head_dim), not whole {target} blocks of "
            f"{block} values; formats these rows fit: {', '.join(fits)}"
        )


@contextmanager
def _output_folder(out: Path) -> Iterator[None]:
    """Make the output folder ``out`` (and its missing parents) for the block's writing; when the block
    fails, remove those of them that are still empty (a folder that existed before is never removed;
    table files already published stay, each complete)."""
    made: list[Path] = []
    p = out
    while not os.path.lexists(p) and p != p.parent:
        made.append(p)  # deepest first
        p = p.parent

    def remove_made() -> None:
        for q in made:
            try:
                q.rmdir()
            except FileNotFoundError:  # never made (a parent could not be)
                continue
            except OSError:  # not empty: leave it, and its parents
                break

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        remove_made()
        where = "" if e.filename in (None, str(out)) else f" ({e.filename})"
        raise PLEError(f"cannot create the output folder {out}{where}: {e.strerror}") from e
    try:
        yield
    except BaseException:
        remove_made()
        raise


def _convert_layers(
    args: argparse.Namespace, cfg: PLEConfig, entries: list, out: Path, results: list[dict[str, Any]], done: set[int]
) -> None:
    for e in entries:
        path = out / table_file_name(e.prefix)
        to = target_format(args.to, e.table_format or "")
        if e.ple_layer_index in done:
            fmt = to or e.table_format
            print(
                f"PLE layer {e.ple_layer_index}: kept {path}: its record says it holds this conversion of the "
                "checkpoint as it is now (--force converts it again)",
                file=sys.stderr,
            )
            results.append({"ple_layer_index": e.ple_layer_index, "path": str(path), "format": fmt, "kept": True})
            continue
        source = source_identity(e)  # before the rows are read: a checkpoint changed meanwhile does not match
        g = None
        if to == "nvfp4":
            rows = cfg.layout(e.ple_layer_index).padded_rows
            g = nvfp4_global_scale(table_amax(table_shards(e), show_progress(), rows, path.name))
        stats = write_layer_table(
            table_shards(e),
            path,
            cfg,
            e.ple_layer_index,
            to=to,
            force=args.force,
            progress=show_progress(),
            global_scale=g,
        )
        record_table(path, e, source)  # from_pretrained(table_dir=out) reuses the file without a comparison
        results.append({"ple_layer_index": e.ple_layer_index, **stats, "kept": False})
        if args.json:
            continue
        print(f"PLE layer {e.ple_layer_index}: wrote {path} ({e.table_format} -> {stats['format']})")
        if to:
            tot = stats["error"]
            print(f"  quantization error (relative to the source): max {tot['max_rel']:.3e}, rms {tot['rms_rel']:.3e}")
            for h, row in enumerate(stats["per_head"]):
                print(f"  head {h:2d}: max {row['max_rel']:.3e}  rms {row['rms_rel']:.3e}")


# ---------------------------------------------------------------------------------------------- verify


def verify(args: argparse.Namespace) -> int:
    """Recompute the checksums of one or more table files; with ``--checkpoint``, compare each with its
    source (each file is matched to the PLE layer its header names). Exit 1 when any file has a problem.

    A file that cannot be read at all (missing, no permission) is one line on stderr before anything is
    verified, as for every command; what is wrong inside a file it can read is listed on stdout."""
    files: list[str] = []
    for f in args.files:
        os.stat(f)  # FileNotFoundError, NotADirectoryError, PermissionError: ple.commands.cli's one line
        if not os.access(f, os.R_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(f))
        folder = paths.classify(f) if os.path.isdir(f) else None
        files += [str(t) for t in folder.tables] if folder is not None and folder.kind == paths.TABLE_FOLDER else [f]
    if args.checkpoint:  # a training checkpoint is said so, as every command says it
        paths.classify(args.checkpoint).require(
            paths.CHECKPOINT, paths.CONFIG, wanted="a checkpoint to compare table files with"
        )
    results: list[dict[str, Any]] = []
    for f in files:
        problems = verify_table_file(f, progress=show_progress())
        note = ""
        if not problems:
            problems += _recorded_gguf_problems(f)
        if args.checkpoint and not problems:
            found, note = _compare_with_checkpoint(f, args.checkpoint)
            problems += found
        elif not problems:
            record = read_table_header(f).get("merged")
            if isinstance(record, dict):
                note = (
                    f"a merge of {record.get('adapter')} (PLE layer {record.get('ple_layer_index')}, "
                    f"{record.get('trained_rows')} rows trained; --checkpoint compares them and the rest)"
                )
        results.append({"file": str(f), "ok": not problems, "problems": problems, **({"note": note} if note else {})})
    ok = all(r["ok"] for r in results)
    if args.json:
        if len(results) == 1:
            _emit_json(results[0])
        else:
            _emit_json({"ok": ok, "files": results})
    elif len(results) == 1:
        for q in results[0]["problems"]:
            print(f"problem: {q}")
        if results[0]["ok"]:
            noted = results[0].get("note")
            print(f"{results[0]['file']}: OK" + (f" ({noted})" if noted else ""))
    else:
        for r in results:
            n = len(r["problems"])
            fine = "OK" + (f" ({r['note']})" if r.get("note") else "")
            print(f"{r['file']}: " + (fine if r["ok"] else f"{n} problem{'s' * (n != 1)}"))
            for q in r["problems"]:
                print(f"  problem: {q}")
        bad = sum(not r["ok"] for r in results)
        print(f"{len(results)} files: " + ("all OK" if ok else f"{bad} with problems"))
    return 0 if ok else 1


def _recorded_gguf_problems(file: str) -> list[str]:
    """For a table file converted from a GGUF without a config: whether the PLE metadata its header
    records addresses rows the file has (see :func:`ple.checkpoint.gguf.ple_metadata_problems`)."""
    header = read_table_header(file)
    layout = header.get("layout")
    recorded = layout.get("gguf") if isinstance(layout, dict) else None
    if not isinstance(recorded, dict):
        return []
    found = ple_metadata_problems(recorded, header["rows"], header["head_dim"])
    return [f"{file}: the GGUF metadata its header records: {q}" for q in found]


def _compare_with_checkpoint(file: str, checkpoint: str) -> tuple[list[str], str]:
    """``(problems, a note for the report)``: the file compared with its PLE layer in ``checkpoint``;
    a merged table file's trained rows with the adapter it names instead (:mod:`ple.train.merge`)."""
    from ple.train.merge import check_merged_rows, merged_rows

    header = read_table_header(file)
    fields = header.get("layout")
    if not isinstance(fields, dict) or not isinstance(fields.get("ple_layer_index"), int):
        return ["the file's header records no layout fields: it cannot be matched to a checkpoint layer"], ""
    cfg, ckpt = resolve_model(checkpoint)
    idx = fields["ple_layer_index"]
    if not 0 <= idx < cfg.num_ple_layers:
        return [f"the file is for PLE layer {idx}, which {checkpoint}'s config does not have"], ""
    want = cfg.layout_fields(idx)
    if fields != want or header.get("layout_hash") != hash_layout(want):
        return [f"the file was made for another layout than {checkpoint}'s config (PLE layer {idx})"], ""
    if ckpt is None:
        return [f"{checkpoint}: no safetensors weights to compare with"], ""
    try:
        scan = check_checkpoint(ckpt, cfg, layers=[idx])
    except CheckpointError as e:
        return e.problems, ""
    entry = next(e for e in scan.layers if e.ple_layer_index == idx)
    open_layer_table(file, cfg, idx).close()  # the layout hash as the loader checks it
    record, trained, adapter, why = merged_rows(file)
    if record is None:
        return compare_with_source(file, table_shards(entry), progress=show_progress()), ""
    what = f"a merge of {record.get('adapter')} (PLE layer {record.get('ple_layer_index')})"
    if trained is None or adapter is None:  # the trained rows cannot be told apart from damage
        problems = compare_with_source(file, table_shards(entry), progress=show_progress())
        return [f"the file is {what}: {why}; the rows below include the trained ones", *problems], ""
    import numpy as np

    ids = np.concatenate([i.numpy() for i, _ in adapter.chunks(trained.ple_layer_index)] or [np.empty(0, np.int64)])
    problems = check_merged_rows(file, adapter, trained.ple_layer_index)
    problems += compare_with_source(file, table_shards(entry), progress=show_progress(), skip_rows=ids)
    return (
        problems,
        f"{what}: {trained.trained_rows:,} rows trained, equal to the adapter's; the rest equal to the checkpoint's",
    )


# ---------------------------------------------------------------------------------------------- stats


def stats(args: argparse.Namespace) -> int:
    """Row traffic of a token stream: distinct rows, reuse, bucket load, decode reuse, cache hit rates."""
    from ple.data.stats import row_traffic
    from ple.data.tokens import read_tokens

    cfg, _ = resolve_model(args.path)
    _check_layer_index(cfg, args.layer)
    chunks = read_tokens(args, cfg.vocab_size, cfg.eos_token_id)
    res = row_traffic(
        chunks, cfg, args.layer, batch=args.batch, request_tokens=args.request_tokens, cache_rows=args.cache_rows
    )
    if args.json:
        _emit_json(res)
        return 0
    print(
        f"{res['tokens']} tokens, {res['lookups']} lookups, {res['total']['distinct_rows']} distinct rows; "
        f"top 1% of rows serve {res['total']['top1_share']:.1%}, top 10% serve {res['total']['top10_share']:.1%}"
    )
    print("head order  distinct rows  top1%   top10%  distinct n-grams  shared rows  max load")
    for h in res["heads"]:
        print(
            f"{h['head']:4d} {h['order']:5d} {h['distinct_rows']:14d} {h['top1_share']:6.1%} {h['top10_share']:7.1%} "
            f"{h['distinct_ngrams']:17d} {h['shared_rows']:12d} {h['max_bucket_load']:9d}"
        )
    d = res["decode"]
    print(
        f"decode: {d['requests']} requests of {d['request_tokens']} tokens, {d['batch']} at a time, {d['steps']} steps, "
        f"{d['distinct_rows_per_step']:.1f} distinct rows per step"
    )
    print("order  rows/step  within step  within request  across requests     new")
    for o in d["orders"]:
        print(
            f"{o['order']:5d} {o['distinct_rows_per_step']:10.1f} {o['within_step']:12.1%} {o['within_request']:15.1%} "
            f"{o['across_requests']:16.1%} {o['new']:7.1%}"
        )
    for c in d["cache"]:
        per = "  ".join(f"order {k + 2}: {v:.1%}" for k, v in enumerate(c["per_order"]))
        print(f"LRU cache of {c['rows']} rows: hit rate {c['hit_rate']:.1%} ({per})")
    return 0
