"""The shard format: the directory layout and the versioned JSON index.

A packed dataset is a directory::

    DIR/index.json            the index (this module's schema, version FORMAT_VERSION)
    DIR/shard-00000.kshard    records back to back, no header or padding
    DIR/shard-00001.kshard
    ...

The records and their checksums are :mod:`kaisoku.data.records`'; ``kaisoku inspect`` is
:mod:`kaisoku.data.inspect`.

The index holds, per shard, the file name, sample count, byte size, a CRC32 of the whole file,
``offsets`` (n + 1 byte offsets: record i is ``[offsets[i], offsets[i+1])``) and a CRC32 of each
stored record; and, for every ``int`` field, the whole column (e.g. the labels) so that labels are
known without reading a shard. No pickle: arrays are stored as raw bytes with an explicit dtype
and shape, and the index is plain JSON.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.codecs import codec_names
from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_open

FORMAT_NAME = "kaisoku-shards"
"""The ``format`` value of every index; anything else is not ours."""

FORMAT_VERSION = 1
"""The index and record layout version this code writes and reads."""

INDEX_NAME = "index.json"
"""File name of the index inside a packed dataset directory."""

SHARD_SUFFIX = ".kshard"
"""File name suffix of shard files."""

FIELD_KINDS = ("image", "int", "bytes", "str", "array")
"""Field kinds: ``image`` encoded image bytes (never compressed again, decoded late); ``int`` a
64-bit integer (also kept as an index column); ``bytes``/``str``/``array`` payloads passed through
the codec (``array`` has a fixed dtype and shape)."""

_ARRAY_DTYPE_KINDS = "biufc"  # numeric only: no object dtype, so nothing can smuggle pickle in
_SHARD_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def shard_file_name(shard_id: int) -> str:
    """The file name of shard ``shard_id``."""
    return f"shard-{shard_id:05d}{SHARD_SUFFIX}"


# ---------------------------------------------------------------------------------------------
# Schema and index
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Field:
    """One named field of every record."""

    name: str
    """Field name, the key in a sample dict (e.g. ``image``, ``label``)."""

    kind: str
    """One of :data:`FIELD_KINDS`."""

    dtype: str | None = None
    """``array`` fields only: numpy dtype string with explicit byte order (``"|u1"``, ``"<f4"``)."""

    shape: tuple[int, ...] | None = None
    """``array`` fields only: the shape of every value."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise KaisokuError(f"field names must be non-empty strings, got {self.name!r}")
        if self.kind not in FIELD_KINDS:
            raise KaisokuError(
                f"field {self.name!r} has unknown kind {self.kind!r}; use one of {', '.join(FIELD_KINDS)}"
            )
        if self.kind == "array":
            if self.dtype is None or self.shape is None:
                raise KaisokuError(f"array field {self.name!r} needs a dtype and a shape")
            dtype = np.dtype(self.dtype)
            if dtype.kind not in _ARRAY_DTYPE_KINDS or dtype.fields is not None:
                raise KaisokuError(
                    f"array field {self.name!r} has dtype {self.dtype!r}; "
                    "only plain numeric dtypes are stored"
                )
            if any(int(d) < 0 for d in self.shape):
                raise KaisokuError(f"array field {self.name!r} has a negative dimension in {self.shape}")
        elif self.dtype is not None or self.shape is not None:
            raise KaisokuError(f"field {self.name!r} of kind {self.kind!r} takes no dtype or shape")

    @property
    def compressed(self) -> bool:
        """Whether this field's payload goes through the codec."""
        return self.kind in ("bytes", "str", "array")

    def to_json(self) -> dict[str, Any]:
        """The field as it appears in the index."""
        out: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "array":
            out["dtype"] = self.dtype
            out["shape"] = list(self.shape or ())
        return out


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
        """The shard entry as it appears in the index."""
        return {
            "file": self.file,
            "samples": self.samples,
            "bytes": self.nbytes,
            "crc32": self.crc32,
            "offsets": self.offsets.tolist(),
            "record_crc32": self.record_crc32.tolist(),
        }


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
    """Format version of the index."""

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

    def to_json(self) -> dict[str, Any]:
        """The index document (deterministic: no paths, no times)."""
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "codec": self.codec,
            "fields": [f.to_json() for f in self.fields],
            "num_samples": self.num_samples,
            "classes": list(self.classes) if self.classes is not None else None,
            "source": self.source,
            "pack": dict(self.pack),
            "skipped": list(self.skipped),
            "columns": {name: column.tolist() for name, column in self.columns.items()},
            "shards": [shard.to_json() for shard in self.shards],
        }

    def dumps(self) -> str:
        """The index serialised as compact, deterministic JSON."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")) + "\n"


def _require(condition: bool, path: Path, what: str) -> None:
    if not condition:
        raise KaisokuError(f"index {path} is damaged: {what}; re-pack the dataset")


def index_from_json(document: Any, root: Path, *, index_path: Path | None = None) -> Index:
    """Validate a parsed index document and build an :class:`Index` (shards under ``root``)."""
    where = index_path or root / INDEX_NAME
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise KaisokuError(f'{where} is not a kaisoku shard index (no "format": "{FORMAT_NAME}")')
    version = document.get("version")
    if version != FORMAT_VERSION:
        if isinstance(version, int) and version > FORMAT_VERSION:
            advice = "it was written by a newer kaisoku; upgrade kaisoku to read it"
        else:
            advice = "re-pack the dataset with this kaisoku"
        raise KaisokuError(
            f"{where} has format version {version!r}, this kaisoku reads version {FORMAT_VERSION}: {advice}"
        )
    try:
        codec = document["codec"]
        _require(codec in codec_names(), where, f"unknown codec {codec!r}")
        fields = tuple(
            Field(
                name=f["name"],
                kind=f["kind"],
                dtype=f.get("dtype"),
                shape=tuple(int(d) for d in f["shape"]) if f.get("shape") is not None else None,
            )
            for f in document["fields"]
        )
        _require(len(fields) > 0, where, "no fields")
        _require(len({f.name for f in fields}) == len(fields), where, "duplicate field names")
        shards = []
        for position, entry in enumerate(document["shards"]):
            name = entry["file"]
            _require(
                isinstance(name, str) and bool(_SHARD_NAME.match(name)) and name not in (".", ".."),
                where,
                f"shard {position} has a bad file name {name!r}",
            )
            samples = int(entry["samples"])
            offsets = np.asarray(entry["offsets"], dtype=np.int64)
            record_crc = np.asarray(entry["record_crc32"], dtype=np.uint32)
            nbytes = int(entry["bytes"])
            _require(samples > 0, where, f"shard {name} has no samples")
            _require(offsets.shape == (samples + 1,), where, f"shard {name} needs {samples + 1} offsets")
            _require(record_crc.shape == (samples,), where, f"shard {name} needs {samples} record checksums")
            _require(
                int(offsets[0]) == 0 and int(offsets[-1]) == nbytes and bool(np.all(np.diff(offsets) > 0)),
                where,
                f"shard {name} has offsets that do not tile its {nbytes} bytes",
            )
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
        declared = int(document.get("num_samples", total))
        _require(declared == total, where, f"num_samples {declared} != {total}, the sum over shards")
        columns = {}
        for name, values in (document.get("columns") or {}).items():
            column = np.asarray(values, dtype=np.int64)
            _require(
                column.shape == (total,), where, f"column {name!r} has {column.size} entries, not {total}"
            )
            columns[name] = column
        for f in fields:
            _require(f.kind != "int" or f.name in columns, where, f"int field {f.name!r} has no column")
        classes = document.get("classes")
        return Index(
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
        )
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        if isinstance(error, KaisokuError):
            raise
        raise KaisokuError(
            f"index {where} is damaged: {type(error).__name__}: {error}; re-pack the dataset"
        ) from None


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
            record_crc[i] = zlib.crc32(record)
            file_crc = zlib.crc32(record, file_crc)
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
