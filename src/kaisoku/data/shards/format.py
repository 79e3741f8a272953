"""The shard format: the directory layout and the versioned JSON index.

A packed dataset is a directory::

    DIR/index.json            the index (this module's schema, version FORMAT_VERSION)
    DIR/index.tables          per-record tables (version 2; :mod:`kaisoku.data.shards.tables`)
    DIR/shard-00000.kshard    records back to back, no header or padding
    DIR/shard-00001.kshard
    ...

The records and their checksums are :mod:`kaisoku.data.shards.records`'; ``kaisoku inspect`` is
:mod:`kaisoku.data.shards.inspect`.

The index holds, per shard, the file name, sample count, byte size, a CRC32 of the whole file,
``offsets`` (n + 1 byte offsets: record i is ``[offsets[i], offsets[i+1])``) and a CRC32 of each
stored record; and, for every ``int`` field, the whole column (e.g. the labels) so that labels are
known without reading a shard. No pickle: the index is plain JSON. Version 2 keeps the per-record
arrays (offsets, record CRCs, int columns) as little-endian tables in ``index.tables``, memory-mapped
and shared by a node's processes; version 1 kept them as JSON lists inside ``index.json`` (still read,
with a note suggesting ``kaisoku pack --upgrade``, which rewrites the index and leaves the shards).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.shards.checksum import crc32
from kaisoku.data.shards.codecs import codec_names
from kaisoku.data.shards.index_checks import (
    check_int_columns,
    check_labels,
    check_num_samples,
    check_shard_name,
    check_table_offsets,
    check_tables,
    check_task,
    check_v1_shard,
    require,
)
from kaisoku.data.shards.schema import (
    FIELD_KINDS,  # noqa: F401  (its public home was this module)
    TASKS,  # noqa: F401  (its public home was this module)
    Field,
    task_of,
)
from kaisoku.data.shards.tables import TABLES_NAME, column_table, describe_tables, map_tables, write_tables
from kaisoku.errors import DamagedDataError, KaisokuError
from kaisoku.fsutil import atomic_open, atomic_write_text

log = logging.getLogger(__name__)

FORMAT_NAME = "kaisoku-shards"
"""The ``format`` value of every index; anything else is not ours."""

FORMAT_VERSION = 2
"""The index and record layout version this code writes."""

READABLE_VERSIONS = (1, 2)
"""Index versions this code reads (1: per-record lists inside index.json)."""

_NOTED_V1: set[str] = set()  # index paths whose version-1 note was given in this process

INDEX_NAME = "index.json"
"""File name of the index inside a packed dataset directory."""

SHARD_SUFFIX = ".kshard"
"""File name suffix of shard files."""


def shard_file_name(shard_id: int) -> str:
    """The file name of shard ``shard_id``."""
    return f"shard-{shard_id:05d}{SHARD_SUFFIX}"


# ---------------------------------------------------------------------------------------------
# Schema and index
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class ShardInfo:
    """What the index records about one shard file."""

    file: str
    """File name, relative to the dataset directory."""

    samples: int
    """Number of records in the shard."""

    nbytes: int
    """Exact file size in bytes."""

    crc32: int
    """CRC32 of the whole file (for a cache tier that copies shards whole)."""

    offsets: np.ndarray
    """int64, ``samples + 1`` entries: record ``i`` is ``[offsets[i], offsets[i+1])``; the last equals
    ``nbytes``."""

    record_crc32: np.ndarray
    """uint32, one CRC32 per stored record."""

    def to_json(self) -> dict[str, Any]:
        """The shard entry as it appears in the index (version 2: the per-record arrays are tables)."""
        return {"file": self.file, "samples": self.samples, "bytes": self.nbytes, "crc32": self.crc32}


@dataclass(frozen=True, kw_only=True, eq=False)
class Index:
    """A parsed, validated index of a packed dataset."""

    root: Path
    """Directory holding ``index.json`` and the shards."""

    codec: str
    """Codec of the compressible fields (``raw``, ``zstd``, ``lz4``)."""

    fields: tuple[Field, ...]
    """Record schema, in stored order."""

    shards: tuple[ShardInfo, ...]
    """Shards in global sample order."""

    columns: Mapping[str, np.ndarray]
    """Whole columns of the ``int`` fields (int64, one entry per sample), e.g. the labels."""

    classes: tuple[str, ...] | None = None
    """Class names by label, when the source had them (ImageFolder)."""

    source: str = ""
    """What was packed: ``imagefolder``, ``npz:<split>``, ``records``."""

    pack: Mapping[str, Any] = field(default_factory=dict)
    """Packing parameters (shard_bytes, shuffle, seed) that reproduce the shards."""

    skipped: tuple[str, ...] = ()
    """Source items left out as unreadable when packing with skip_corrupt."""

    version: int = FORMAT_VERSION
    """Format version of the index as read (what :meth:`dumps` writes is always :data:`FORMAT_VERSION`)."""

    tables: Mapping[str, Any] | None = None
    """The ``tables`` entry of a version-2 index (layout, size, CRC32 of ``index.tables``) once written or
    read; None for an index not yet written or read from version 1."""

    task: str | None = None
    """What the dataset is for: ``classification`` (an int ``label``) or ``regression`` (float targets in
    the ``target`` field); None (when packing) takes it from the schema (:func:`task_of`). Written only
    for regression, so classification indexes are unchanged and one without the key reads as
    classification."""

    target: str | None = None
    """The field training predicts: ``label`` for classification, the float array field for regression."""

    def __post_init__(self) -> None:
        if self.task is None:
            for key, value in task_of(self.fields).items():
                object.__setattr__(self, key, value)

    def __reduce__(self) -> Any:
        # Read from disk: a new process maps the same tables file (shared pages) instead of receiving a
        # private copy of every per-record array.
        if self.version >= 2 and self.tables is not None and (self.root / INDEX_NAME).is_file():
            return (read_index, (self.root / INDEX_NAME,))
        return super().__reduce__()

    @property
    def num_samples(self) -> int:
        """Total number of samples."""
        return int(sum(shard.samples for shard in self.shards))

    @property
    def nbytes(self) -> int:
        """Total size of all shard files."""
        return int(sum(shard.nbytes for shard in self.shards))

    def shard_sizes(self) -> np.ndarray:
        """Samples per shard (int64)."""
        return np.fromiter((s.samples for s in self.shards), dtype=np.int64, count=len(self.shards))

    def shard_nbytes(self) -> np.ndarray:
        """Bytes per shard file (int64)."""
        return np.fromiter((s.nbytes for s in self.shards), dtype=np.int64, count=len(self.shards))

    def shard_starts(self) -> np.ndarray:
        """Global index of each shard's first sample, plus the total at the end (int64, shards + 1)."""
        return np.concatenate([[0], np.cumsum(self.shard_sizes())]).astype(np.int64)

    def shard_path(self, shard_id: int) -> Path:
        """Path of shard ``shard_id``."""
        return self.root / self.shards[shard_id].file

    def field(self, name: str) -> Field:
        """The field called ``name``."""
        for candidate in self.fields:
            if candidate.name == name:
                return candidate
        raise KaisokuError(
            f"{self.root} has no field {name!r}; its fields are {', '.join(f.name for f in self.fields)}"
        )

    def write(self, directory: Path) -> Index:
        """Write this index as version 2 into ``directory``: ``index.tables``, then ``index.json`` (atomic).

        Returns the index as written (with its ``tables`` entry). The shards are not touched.
        """
        tables = write_tables(directory, self.per_record_arrays())
        written = replace(self, root=directory, version=FORMAT_VERSION, tables=tables)
        atomic_write_text(directory / INDEX_NAME, written.dumps())
        return written

    def per_record_arrays(self) -> dict[str, np.ndarray]:
        """The arrays that go into ``index.tables``: offsets, record CRCs and int columns, by table name."""
        arrays = {
            "offsets": np.concatenate([s.offsets for s in self.shards]),
            "record_crc32": np.concatenate([s.record_crc32 for s in self.shards]),
        }
        arrays.update({column_table(name): column for name, column in self.columns.items()})
        return arrays

    def to_json(self) -> dict[str, Any]:
        """The version-2 index document (deterministic: no paths, no times)."""
        tables = self.tables if self.tables is not None else describe_tables(self.per_record_arrays())
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "codec": self.codec,
            "fields": [f.to_json() for f in self.fields],
            "num_samples": self.num_samples,
            "classes": list(self.classes) if self.classes is not None else None,
            "source": self.source,
            "pack": dict(self.pack),
            "skipped": list(self.skipped),
            "columns": sorted(self.columns),
            "tables": dict(tables),
            "shards": [shard.to_json() for shard in self.shards],
            **({"task": self.task, "target": self.target} if self.task != "classification" else {}),
        }

    def dumps(self) -> str:
        """The index serialised as compact, deterministic JSON."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")) + "\n"


def index_from_json(document: Any, root: Path, *, index_path: Path | None = None) -> Index:
    """Validate a parsed index document and build an :class:`Index` (shards under ``root``)."""
    where = index_path or root / INDEX_NAME
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise KaisokuError(f'{where} is not a kaisoku shard index (no "format": "{FORMAT_NAME}")')
    version = document.get("version")
    if version not in READABLE_VERSIONS:
        if isinstance(version, int) and version > FORMAT_VERSION:
            advice = "it was written by a newer kaisoku; upgrade kaisoku to read it"
        else:
            advice = "re-pack the dataset with this kaisoku"
        raise KaisokuError(
            f"{where} has format version {version!r}, this kaisoku reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}: {advice}"
        )
    if version == 1 and str(where) not in _NOTED_V1:
        _NOTED_V1.add(str(where))
        log.warning(
            "%s is index format version 1 (per-record lists parsed by every process); "
            "kaisoku pack --upgrade %s rewrites it as version %d (the shards stay as they are)",
            where,
            root,
            FORMAT_VERSION,
        )
    try:
        if version >= 2:
            return _checked_labels(_index_v2(document, root, where), where)
        codec, fields = _header(document, where)
        shards = []
        for position, entry in enumerate(document["shards"]):
            name = entry["file"]
            check_shard_name(position, name, where)
            samples = int(entry["samples"])
            offsets = np.asarray(entry["offsets"], dtype=np.int64)
            record_crc = np.asarray(entry["record_crc32"], dtype=np.uint32)
            nbytes = int(entry["bytes"])
            check_v1_shard(name, samples, offsets, record_crc, nbytes, where)
            shards.append(
                ShardInfo(
                    file=name,
                    samples=samples,
                    nbytes=nbytes,
                    crc32=int(entry["crc32"]),
                    offsets=offsets,
                    record_crc32=record_crc,
                )
            )
        total = sum(s.samples for s in shards)
        check_num_samples(document, total, where)
        columns = {}
        for name, values in (document.get("columns") or {}).items():
            column = np.asarray(values, dtype=np.int64)
            require(
                column.shape == (total,), where, f"column {name!r} has {column.size} entries, not {total}"
            )
            columns[name] = column
        check_int_columns((f.name for f in fields if f.kind == "int"), columns, where)
        classes = document.get("classes")
        return _checked_labels(
            Index(
                root=root,
                codec=codec,
                fields=fields,
                shards=tuple(shards),
                columns=columns,
                classes=tuple(str(c) for c in classes) if classes is not None else None,
                source=str(document.get("source", "")),
                pack=dict(document.get("pack") or {}),
                skipped=tuple(str(s) for s in document.get("skipped") or ()),
                version=version,
                **check_task(document, {f.name for f in fields}, where),
            ),
            where,
        )
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        if isinstance(error, KaisokuError):
            raise
        raise DamagedDataError(
            f"index {where} is damaged: {type(error).__name__}: {error}; re-pack the dataset"
        ) from None


def _checked_labels(index: Index, where: Path) -> Index:
    """``index`` once its labels fit its own ``classes`` (:func:`check_labels`)."""
    check_labels(index.columns, index.task, index.classes, where)
    return index


def _header(document: Mapping[str, Any], where: Path) -> tuple[str, tuple[Field, ...]]:
    codec = document["codec"]
    require(str(codec).partition("@")[0] in codec_names(), where, f"unknown codec {codec!r}")
    fields = tuple(
        Field(
            name=f["name"],
            kind=f["kind"],
            dtype=f.get("dtype"),
            shape=tuple(int(d) for d in f["shape"]) if f.get("shape") is not None else None,
        )
        for f in document["fields"]
    )
    require(len(fields) > 0, where, "no fields")
    require(len({f.name for f in fields}) == len(fields), where, "duplicate field names")
    return codec, fields


def _index_v2(document: Mapping[str, Any], root: Path, where: Path) -> Index:
    """Version 2: per-shard entries in JSON, the per-record arrays mapped from ``index.tables``."""
    codec, fields = _header(document, where)
    entries = document["shards"]
    names = [entry["file"] for entry in entries]
    for position, name in enumerate(names):
        check_shard_name(position, name, where)
    samples = np.fromiter((int(e["samples"]) for e in entries), dtype=np.int64, count=len(entries))
    nbytes = np.fromiter((int(e["bytes"]) for e in entries), dtype=np.int64, count=len(entries))
    require(bool(np.all(samples > 0)), where, "a shard has no samples")
    total = int(samples.sum())
    check_num_samples(document, total, where)
    described = document["tables"]
    tables = map_tables(root, described, where)
    table_path = root / str(described.get("file", TABLES_NAME))
    column_names = list(document.get("columns") or [])
    check_tables(
        tables,
        num_shards=len(entries),
        total=total,
        column_names=column_names,
        table_path=table_path,
        where=where,
    )
    check_int_columns((f.name for f in fields if f.kind == "int"), column_names, where)
    firsts = np.zeros(len(entries), dtype=np.int64)
    np.cumsum(samples[:-1] + 1, out=firsts[1:])
    offsets, record_crc = tables["offsets"], tables["record_crc32"]
    check_table_offsets(offsets, firsts, samples, nbytes, names, table_path)
    starts = firsts - np.arange(len(entries), dtype=np.int64)
    shards = tuple(
        ShardInfo(
            file=names[s],
            samples=int(samples[s]),
            nbytes=int(nbytes[s]),
            crc32=int(entries[s]["crc32"]),
            offsets=offsets[int(firsts[s]) : int(firsts[s] + samples[s]) + 1],
            record_crc32=record_crc[int(starts[s]) : int(starts[s] + samples[s])],
        )
        for s in range(len(entries))
    )
    classes = document.get("classes")
    return Index(
        root=root,
        codec=codec,
        fields=fields,
        shards=shards,
        columns={name: tables[column_table(name)] for name in column_names},
        classes=tuple(str(c) for c in classes) if classes is not None else None,
        source=str(document.get("source", "")),
        pack=dict(document.get("pack") or {}),
        skipped=tuple(str(s) for s in document.get("skipped") or ()),
        version=2,
        tables=dict(described),
        **check_task(document, {f.name for f in fields}, where),
    )


def upgrade_index(path: str | Path) -> tuple[Index, int]:
    """Rewrite the index of the dataset at ``path`` as the current version; ``(index, old version)``.

    Only ``index.json`` and ``index.tables`` are written; the shards stay as they are. A current index is
    left alone.
    """
    _NOTED_V1.add(str(resolve_index_path(path)))  # no advice to upgrade while upgrading
    index = read_index(path)
    if index.version == FORMAT_VERSION:
        return index, index.version
    return index.write(index.root), index.version


def split_dirs(path: Path) -> list[Path]:
    """Sub-directories of ``path`` that hold an index (the per-split layout of a packed .npz)."""
    if not path.is_dir():
        return []
    return sorted(child for child in path.iterdir() if (child / INDEX_NAME).is_file())


def resolve_index_path(path: str | Path) -> Path:
    """The ``index.json`` for ``path`` (a dataset directory or the index file itself)."""
    path = Path(path)
    if path.is_file():
        return path
    candidate = path / INDEX_NAME
    if candidate.is_file():
        return candidate
    if not path.exists():
        raise KaisokuError(f"dataset path {path} does not exist")
    splits = split_dirs(path)
    if splits:
        names = ", ".join(s.name for s in splits)
        raise KaisokuError(
            f"{path} holds several splits ({names}); give one of them, e.g. {path / splits[0].name}"
        )
    raise KaisokuError(
        f"no {INDEX_NAME} in {path}: not a packed kaisoku dataset, or packing did not finish; "
        "run kaisoku pack SRC DST"
    )


def read_index(path: str | Path) -> Index:
    """Read and validate the index of the dataset at ``path`` (directory or ``index.json``).

    Raises :class:`KaisokuError` with the path and what to do for a missing, unparsable, foreign,
    damaged or wrong-version index.
    """
    index_path = resolve_index_path(path)
    try:
        text = index_path.read_bytes()
    except OSError as error:
        raise KaisokuError(f"cannot read {index_path}: {error.strerror or error}") from None
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise KaisokuError(f"index {index_path} is not valid JSON ({error}); re-pack the dataset") from None
    return index_from_json(document, index_path.parent, index_path=index_path)


def write_shard(directory: Path, shard_id: int, records: Sequence[bytes]) -> ShardInfo:
    """Write ``records`` back to back into shard ``shard_id`` under ``directory``, atomically."""
    name = shard_file_name(shard_id)
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    record_crc = np.zeros(len(records), dtype=np.uint32)
    file_crc = 0
    position = 0
    with atomic_open(directory / name, "wb") as handle:
        for i, record in enumerate(records):
            handle.write(record)
            record_crc[i] = crc32(record)
            file_crc = crc32(record, file_crc)
            position += len(record)
            offsets[i + 1] = position
    return ShardInfo(
        file=name,
        samples=len(records),
        nbytes=position,
        crc32=file_crc,
        offsets=offsets,
        record_crc32=record_crc,
    )
