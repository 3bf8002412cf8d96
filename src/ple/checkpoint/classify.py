"""What a path is, judged once for every command and for ``from_pretrained``; and what a table is.

:func:`classify` names the kind of a path with the facts the commands need (:class:`PathInfo`):

- ``checkpoint``: a published model: ``config.json`` and safetensors weights holding the PLE tables;
- ``config``: a model config without weights (its layout only);
- ``training checkpoint``: a model saved while its PLE tables were being trained (transformers'
  ``Trainer``'s ``checkpoint-N`` folder, ``save_pretrained`` or the state dict of a trainable model):
  each trained layer holds its trained rows (``...ngram_embedding.trained_ids`` / ``trained_rows``,
  :data:`TRAINED_KEYS`) instead of a table. It is put back with ``load_state_dict`` on the base
  model (or by ``Trainer(resume_from_checkpoint=...)``), never loaded as a model of its own;
- ``table file``, ``merged table``: a ``.pletable`` file; a merged one's header records the merge
  (:func:`ple.train.merge_table_file`);
- ``table folder``: a folder of table files without a ``config.json`` (a ``table_dir``, ``ple
  convert``'s output, :func:`ple.train.merge_model`'s folder);
- ``adapter``: an adapter file of trained rows (:mod:`ple.train.adapter`);
- ``gguf``: a GGUF model file (one file, or a part of a split set);
- ``not ple's``: anything else, with why (:attr:`PathInfo.problem`).

**Table identity.** A table is what it was made from (:func:`table_identity`). A table file converted
from a checkpoint, in any format, by ``ple convert`` or a table folder, has a conversion record
beside it (``<file>.source.json``, :func:`read_record`; written by
:mod:`ple.convert.folder`): its identity is that source, the checkpoint's layer prefix and
table format and, for each safetensors file holding the table, its name, size, modification time and
header digest (what a copy of the same files keeps; change times and inodes are left out). A merged
table's header records the identity of the table merged into plus the adapter rows merged (digests
of their ids and values), so identities are carried through conversions and merges alike. A table
with neither says only itself (its header checksum). An adapter records the identity of the table
it was trained over; :func:`require_trained_over` lets it merge into the very table or any table of
the same identity (another format converted from the same checkpoint table), and refuses another,
naming both.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from ple.checkpoint.scan import LayerEntry, checkpoint_files, resolve_model
from ple.common.files import PARTIAL_SUFFIX, parse_json, read_json
from ple.common.safetensors import CheckpointError, read_header, read_safetensors_header
from ple.config import PLEConfig
from ple.errors import InvalidArgumentError, PLEError, UsageError
from ple.table.files.table_file import TABLE_SUFFIX, TableFileError, read_table_header

__all__ = [
    "ADAPTER",
    "ADAPTER_FORMAT",
    "CHECKPOINT",
    "CONFIG",
    "GGUF",
    "KINDS",
    "MERGED_TABLE",
    "OTHER",
    "RECORD_SUFFIX",
    "TABLE_FILE",
    "TABLE_FOLDER",
    "TRAINED_KEYS",
    "TRAINING",
    "PathInfo",
    "TableIdentity",
    "TrainedLayer",
    "classify",
    "explained_by_training",
    "folder_tables",
    "merge_phrase",
    "merged_identity",
    "merged_table",
    "layout_source",
    "report",
    "read_record",
    "record_path",
    "require_trained_over",
    "source_origin",
    "table_fields",
    "table_identity",
    "trained_over_identity",
    "training_refusal",
    "without_copy_fields",
]

CHECKPOINT = "checkpoint"
CONFIG = "config"
TRAINING = "training checkpoint"
TABLE_FILE = "table file"
MERGED_TABLE = "merged table"
TABLE_FOLDER = "table folder"
ADAPTER = "adapter"
GGUF = "gguf"
OTHER = "not ple's"
KINDS = (CHECKPOINT, CONFIG, TRAINING, TABLE_FILE, MERGED_TABLE, TABLE_FOLDER, ADAPTER, GGUF, OTHER)
"""Every kind :func:`classify` gives."""

ADAPTER_FORMAT = "ple-table-adapter"
"""The ``format`` an adapter file's safetensors metadata names."""
TRAINED_KEYS = ("trained_ids", "trained_rows")
"""The state-dict keys (after ``...ple_embedding.ngram_embedding.``) of a table being trained."""
_TABLE_KEYS = "ple_embedding.ngram_embedding."
_TRAINED_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>[0-9]{1,9})\.ple\.)ple_embedding\.ngram_embedding\."
    r"(?P<key>trained_ids|trained_rows)$"
)

RECORD_SUFFIX = ".source.json"
"""Suffix of the conversion record beside a table file: ``<table file name>.source.json``."""
RECORD_VERSION = 4  # 4: the file identities carry change times and inodes (ple.common.files.file_identity)
_MAX_RECORD_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------------- records
def record_path(path: str | os.PathLike) -> Path:
    """The conversion record of table file ``path``."""
    path = Path(path)
    return path.with_name(path.name + RECORD_SUFFIX)


def read_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The conversion record beside table file ``path``, or None (none, unreadable, another version)."""
    try:
        record = read_json(record_path(path), "table record", _MAX_RECORD_BYTES, TableFileError)
    except (OSError, PLEError):
        return None
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        return None
    return record


def table_fields(header: dict[str, Any]) -> dict[str, Any]:
    """What a record says of the table file it describes: geometry, layout and a digest of its checksums
    (which cover every row)."""
    checks = json.dumps(header.get("checksum"), sort_keys=True).encode()
    return {
        "format": header["format"],
        "rows": header["rows"],
        "head_dim": header["head_dim"],
        "layout_hash": header["layout_hash"],
        "file_nbytes": header["file_nbytes"],
        "checksums_sha256": hashlib.sha256(checks).hexdigest(),
    }


def without_copy_fields(source: dict[str, Any]) -> dict[str, Any]:
    """A record's ``source`` without what a copy of the same files changes (change times, inodes)."""
    files = [{k: v for k, v in f.items() if k not in ("ctime_ns", "inode")} for f in source.get("files", [])]
    return {**source, "files": files}


# ---------------------------------------------------------------------------------------------- identity
def _canon(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)


def source_origin(source: dict[str, Any]) -> dict[str, Any]:
    """The identity origin of a table made from a checkpoint whose table is ``source`` (a record's, or
    :func:`ple.convert.folder.source_identity` of the checkpoint's layer now)."""
    return {"source": without_copy_fields(source)}


@dataclasses.dataclass(frozen=True, eq=False)
class TableIdentity:
    """What a table is (see the module docstring): its ``origin`` (``{"source": ...}``, a checkpoint's
    table; or ``{"table": header checksum}``, itself) and the adapter ``merges`` on top, in order.
    ``checkpoint`` (the folder the source was read from) only names it in messages."""

    origin: dict[str, Any]
    merges: tuple[dict[str, Any], ...] = ()
    checkpoint: str | None = None

    def key(self) -> str:
        return _canon({"origin": self.origin, "merges": list(self.merges)})

    def same(self, other: TableIdentity) -> bool:
        """Whether both are the same table (same origin, same merges); ``checkpoint`` aside."""
        return self.key() == other.key()

    def to_json(self) -> dict[str, Any]:
        return {"origin": self.origin, "merges": list(self.merges), "checkpoint": self.checkpoint}

    @staticmethod
    def from_json(doc: Any) -> TableIdentity | None:
        if not isinstance(doc, dict) or not isinstance(doc.get("origin"), dict):
            return None
        merges = doc.get("merges", [])
        if not isinstance(merges, list) or not all(isinstance(m, dict) for m in merges):
            return None
        ck = doc.get("checkpoint")
        return TableIdentity(doc["origin"], tuple(merges), ck if isinstance(ck, str) else None)

    def describe(self) -> str:
        """One phrase: what the table was made from."""
        src = self.origin.get("source")
        if isinstance(src, dict):
            digest = hashlib.sha256(_canon(self.origin).encode()).hexdigest()[:12]
            where = f" of checkpoint {self.checkpoint}" if self.checkpoint else ""
            text = f"made from the {src.get('format')} table {src.get('prefix')}{where} (source {digest})"
        else:
            text = (
                f"a table of its own (header checksum {str(self.origin.get('table'))[:12]}...; "
                "no conversion record says what it was made from)"
            )
        n = len(self.merges)
        return text + (f", with {n} adapter merge{'s' * (n != 1)} on top" if n else "")


def table_identity(path: str | os.PathLike, header: dict[str, Any] | None = None) -> TableIdentity:
    """The identity of table file ``path`` (``header``: its validated header, read when not given):
    a merged table's as its header records it; a converted table's source, when the record beside it
    describes this very file (its checksums); else the table itself."""
    path = Path(path)
    header = read_table_header(path) if header is None else header
    own = TableIdentity({"table": header["header_checksum"]})
    merged = header.get("merged")
    if isinstance(merged, dict):
        return TableIdentity.from_json(merged.get("identity")) or own
    record = read_record(path)
    if record is None or record.get("table") != table_fields(header) or not isinstance(record.get("source"), dict):
        return own
    ck = record.get("checkpoint")
    return TableIdentity(source_origin(record["source"]), (), ck if isinstance(ck, str) else None)


def merged_identity(into: TableIdentity, ids_digest: str, rows_digest: str) -> TableIdentity:
    """The identity of ``into`` with an adapter's rows merged (digests of their ids and values)."""
    return TableIdentity(into.origin, (*into.merges, {"ids": ids_digest, "rows": rows_digest}), into.checkpoint)


def trained_over_identity(base: dict[str, Any]) -> TableIdentity:
    """The identity of the table an adapter layer was trained over (its ``base`` record): as recorded;
    for an adapter that recorded none, that of the file it names when it still holds those rows; else
    the table itself."""
    got = TableIdentity.from_json(base.get("identity"))
    if got is not None:
        return got
    file = base.get("file")
    if isinstance(file, str):
        try:
            header = read_table_header(file)
        except (TableFileError, OSError):
            header = None
        if header is not None and header["header_checksum"] == base.get("header_checksum"):
            return table_identity(file, header)
    return TableIdentity({"table": base.get("header_checksum")})


def trained_over_mismatch(base: dict[str, Any], have: TableIdentity, header: dict[str, Any]) -> TableIdentity | None:
    """None when a table of identity ``have`` (header ``header``) is one an adapter layer trained over the
    table ``base`` records may read or be merged into: that very table (the same header checksum) or one
    of the same identity (a conversion of the same checkpoint table); else the identity it was trained
    over (for the caller's message)."""
    if base.get("header_checksum") == header["header_checksum"]:
        return None
    want = trained_over_identity(base)
    return None if want.same(have) else want


def require_trained_over(
    adapter: str | os.PathLike, index: int, base: dict[str, Any], table: str | os.PathLike, header: dict[str, Any]
) -> TableIdentity:
    """The identity of ``table`` (header ``header``) when adapter ``adapter``'s PLE layer ``index``,
    trained over the table ``base`` records, may be merged into it: the very table (the same header
    checksum), or one of the same identity; else :class:`InvalidArgumentError` naming both."""
    have = table_identity(table, header)
    mismatch = trained_over_mismatch(base, have, header)
    if mismatch is None:
        return have
    want = mismatch
    raise InvalidArgumentError(
        f"{adapter}: PLE layer {index} was trained over the table file {base.get('file')} ({base.get('format')}, "
        f"{want.describe()}), not {table} ({header['format']}, {have.describe()}): the rows it did not train are "
        "another table's (another checkpoint, or a table changed since); merge it into the table it was trained "
        "over, or into a conversion of the same checkpoint table (ple convert CHECKPOINT DIR --to FORMAT)"
    )


# ---------------------------------------------------------------------------------------------- training
@dataclasses.dataclass(frozen=True)
class TrainedLayer:
    """A PLE layer of a training checkpoint: its tensor ``prefix``, decoder layer, and trained rows."""

    prefix: str
    decoder_layer: int
    trained_rows: int


def _trained_layers(files: list[Path]) -> tuple[TrainedLayer, ...]:
    found: dict[str, TrainedLayer] = {}
    for fp in files:
        infos, _ = read_safetensors_header(fp)  # a damaged file: the scan says what is wrong
        for name, info in infos.items():
            m = _TRAINED_RE.match(name)
            if m is None or (m["key"] != TRAINED_KEYS[0] and m["prefix"] in found):
                continue
            rows = int(info.shape[0]) if info.shape else 0
            found[m["prefix"]] = TrainedLayer(m["prefix"], int(m["layer"]), rows)
    return tuple(sorted(found.values(), key=lambda t: t.decoder_layer))


def explained_by_training(entry: LayerEntry) -> list[str]:
    """The problems of a checkpoint layer that its being trained explains: its trained rows (names
    the scan does not expect) in place of its table (missing). [] for a layer that holds no trained rows."""
    names = {f"unexpected tensor {entry.prefix}{_TABLE_KEYS}{k}" for k in TRAINED_KEYS}
    if not names & set(entry.problems):
        return []
    return [q for q in entry.problems if q in names or q.startswith("missing table: ")]


def training_refusal(path: str | os.PathLike) -> UsageError:
    """The one answer to loading a training checkpoint as a model, or converting or comparing it."""
    return UsageError(
        f"{path} is a training checkpoint (saved while the PLE tables were being trained: their trained rows, "
        "not the tables): load the base model with from_pretrained, then model.load_state_dict of this "
        "checkpoint's weights (or resume with Trainer(resume_from_checkpoint=...)); to save the tables "
        "themselves, call ple.train.freeze(model) before save_pretrained"
    )


def _trainer_step(folder: Path) -> int | None:
    """The step of a transformers ``Trainer`` checkpoint folder (its ``trainer_state.json``), or None."""
    try:
        state = read_json(folder / "trainer_state.json", "trainer state")
    except (OSError, PLEError):
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


# ---------------------------------------------------------------------------------------------- classify
@dataclasses.dataclass(frozen=True)
class PathInfo:
    """What :func:`classify` found at ``path``: its ``kind`` (:data:`KINDS`), ``what`` it is in words,
    and the facts of that kind: a model's ``config`` and ``weights`` (:func:`ple.checkpoint.resolve_model`'s
    checkpoint), a training checkpoint's ``trained`` layers and ``trainer_step``, a table file's
    validated ``header``, a table folder's ``tables``, an adapter's metadata (``adapter``: ``layers``,
    ``optimizer``), and for a path that is not ple's the error saying why (``problem``)."""

    path: Path
    kind: str
    what: str
    config: PLEConfig | None = None
    weights: Path | None = None
    trained: tuple[TrainedLayer, ...] = ()
    trainer_step: int | None = None
    header: dict[str, Any] | None = None
    tables: tuple[Path, ...] = ()
    adapter: dict[str, Any] | None = None
    problem: Exception | None = None

    def identity(self) -> TableIdentity | None:
        """A table file's identity (:func:`table_identity`); None for other kinds."""
        return None if self.header is None else table_identity(self.path, self.header)

    def refusal(self, wanted: str) -> Exception:
        """The error of a command that needs ``wanted`` and was given this path."""
        if self.kind == TRAINING:
            return training_refusal(self.path)
        if self.kind == OTHER and self.problem is not None:
            return self.problem
        return InvalidArgumentError(f"{self.path} is {self.what}, not {wanted}")

    def require(self, *kinds: str, wanted: str) -> PathInfo:
        """This, when it is of one of ``kinds``; else :meth:`refusal` raised."""
        if self.kind not in kinds:
            raise self.refusal(wanted)
        return self


def _is_table_name(name: str) -> bool:
    return name.endswith(TABLE_SUFFIX) or (name.endswith(PARTIAL_SUFFIX) and TABLE_SUFFIX in name)


def merge_phrase(record: dict[str, Any]) -> str:
    """A merge record in words: the PLE layer of which adapter, how many rows, merged into which table."""
    into = record.get("into")
    into = into if isinstance(into, dict) else {}
    return (
        f"PLE layer {record.get('ple_layer_index')} of {record.get('adapter')} ({record.get('trained_rows')} trained "
        f"rows) merged into {into.get('file')}"
    )


def _table(path: Path) -> PathInfo:
    h = read_table_header(path)
    shape = f"{h['format']}, {h['rows']:,} rows x {h['head_dim']}"
    merged = h.get("merged")
    if isinstance(merged, dict):
        return PathInfo(path, MERGED_TABLE, f"a merged table file ({shape}: {merge_phrase(merged)})", header=h)
    return PathInfo(path, TABLE_FILE, f"a table file ({shape})", header=h)


def _adapter(path: Path) -> PathInfo | None:
    try:
        md = read_header(path).metadata
    except CheckpointError:
        return None  # not a sound safetensors file: read as a checkpoint's, whose scan says why
    if md.get("format") != ADAPTER_FORMAT:
        return None
    try:
        layers = parse_json(md.get("layers", "[]"), f"{path}: the adapter metadata 'layers'")
    except PLEError:
        layers = None
    layers = [d for d in layers if isinstance(d, dict)] if isinstance(layers, list) else []
    facts = {"layers": layers, "optimizer": "optimizer" in md}
    names = ", ".join(str(d.get("ple_layer_index")) for d in layers) or "none"
    states = ", with the optimizer's states" if facts["optimizer"] else ""
    return PathInfo(path, ADAPTER, f"an adapter file (trained rows of PLE layers {names}{states})", adapter=facts)


def classify(path: str | os.PathLike, *, also: str = "") -> PathInfo:
    """What ``path`` is (see the module docstring). Reads headers and small JSON files only.

    Raises ``FileNotFoundError`` for a path that does not exist, :class:`~ple.table.TableFileError`
    for a table file whose header is damaged, and ``OSError`` for one that cannot be read; a path that
    is not ple's is returned as such (kind ``"not ple's"``), with the model reader's error (which
    names ``also``, what else the caller takes) as its ``problem``."""
    p = Path(path)
    if not os.path.lexists(p):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(p))
    folder = p.is_dir()
    if p.name.endswith(".gguf") and not folder:
        return PathInfo(p, GGUF, "a GGUF model file")
    if _is_table_name(p.name) and not folder:
        return _table(p)
    if folder and not os.path.lexists(p / "config.json"):
        tables = tuple(sorted(q for q in p.iterdir() if q.name.endswith(TABLE_SUFFIX) and q.is_file()))
        if tables:
            what = f"a table folder ({len(tables)} table file{'s' * (len(tables) != 1)}, no config.json)"
            return PathInfo(p, TABLE_FOLDER, what, tables=tables)
    if p.name.endswith(".safetensors") and p.is_file():
        adapter = _adapter(p)
        if adapter is not None:
            return adapter
    try:
        config, weights = resolve_model(p, also)
    except PLEError as e:
        return PathInfo(p, OTHER, f"not a path ple reads ({e})", problem=e)
    if weights is None:
        return PathInfo(p, CONFIG, "a model config without weights", config=config)
    try:
        trained = _trained_layers(checkpoint_files(weights))
    except (PLEError, OSError):
        trained = ()  # files the scan refuses (pickled, missing): it says why
    if not trained:
        what = "a checkpoint (config.json and safetensors weights)"
        return PathInfo(p, CHECKPOINT, what, config=config, weights=weights)
    step = _trainer_step(weights if weights.is_dir() else weights.parent)
    by = f"transformers Trainer's, at step {step}" if step is not None else "saved while its tables were trained"
    rows = ", ".join(f"{t.trained_rows:,}" for t in trained)
    what = f"a training checkpoint ({by}: its PLE layers hold their trained rows ({rows}), not tables)"
    return PathInfo(p, TRAINING, what, config=config, weights=weights, trained=trained, trainer_step=step)


def folder_tables(info: PathInfo) -> list[dict[str, Any]]:
    """Per table file of a table folder: its name, kind, format and geometry, what it was made from and,
    for a merged one, the merge; a file whose header cannot be read: its ``problem``."""
    out: list[dict[str, Any]] = []
    for path in info.tables:
        try:
            t = _table(path)
        except (TableFileError, OSError) as e:
            out.append({"file": path.name, "kind": None, "problem": str(e)})
            continue
        h = t.header
        assert h is not None
        identity = table_identity(path, h)
        out.append(
            {
                "file": path.name,
                "kind": t.kind,
                "format": h["format"],
                "rows": h["rows"],
                "head_dim": h["head_dim"],
                "complete": h["complete"],
                "identity": identity.describe(),
                "merged": merge_phrase(h["merged"]) if t.kind == MERGED_TABLE else None,
            }
        )
    return out


def merged_table(path: str | os.PathLike) -> PathInfo | None:
    """``path`` classified, when it is a merged table file; else None (nothing there, another file)."""
    if not os.path.lexists(path):
        return None
    try:
        info = classify(path)
    except (TableFileError, OSError):
        return None
    return info if info.kind == MERGED_TABLE else None


def layout_source(layout: Any) -> str:
    """What a table header's ``layout`` fields say the table's layout came from."""
    if isinstance(layout, dict) and isinstance(layout.get("gguf"), dict):
        return "the PLE metadata of a GGUF model (converted without a config)"
    if isinstance(layout, dict) and isinstance(layout.get("ple_layer_index"), int):
        return f"a checkpoint's config, PLE layer {layout['ple_layer_index']}"
    return "not recorded (the header holds only the layout hash)"


def report(info: PathInfo) -> tuple[dict[str, Any], list[str]]:
    """``ple inspect``'s JSON document and text lines for a table folder (each table file: kind, format,
    rows, what it was made from, the merge) or an adapter file (each layer's trained rows and the table
    they were trained over). The document's ``problems``: table files whose header cannot be read."""
    doc: dict[str, Any] = {"path": str(info.path), "kind": info.kind, "what": info.what}
    lines = [f"{info.path}: {info.what}"]
    if info.kind == TABLE_FOLDER:
        doc["tables"] = folder_tables(info)
    else:
        doc.update(info.adapter or {})
    doc["problems"] = [f"{t['file']}: {t['problem']}" for t in doc.get("tables", []) if t.get("problem")]
    for t in doc.get("tables", []):
        if not t.get("problem"):
            merged = f"; {t['merged']}" if t["merged"] else ""
            shape = f"{t['format']}, {t['rows']:,} rows x {t['head_dim']}"
            lines.append(f"  {t['file']}: {t['kind']}, {shape}; {t['identity']}{merged}")
    for d in doc.get("layers", []):
        base = d.get("base") if isinstance(d.get("base"), dict) else {}
        over = f"the table file {base['file']}" if base.get("file") else "a table not read from a file"
        lines.append(
            f"  PLE layer {d.get('ple_layer_index')}: {d.get('trained_rows')} trained rows of [{d.get('rows')}, "
            f"{d.get('head_dim')}], trained over {over} ({d.get('base_format')})"
        )
    lines += [f"problem: {q}" for q in doc["problems"]]
    return doc, lines
