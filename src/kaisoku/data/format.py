"""The shard format: record layout, the versioned JSON index, checksums, and ``kaisoku inspect``.

A packed dataset is a directory::

    DIR/index.json            the index (this module's schema, version FORMAT_VERSION)
    DIR/shard-00000.kshard    records back to back, no header or padding
    DIR/shard-00001.kshard
    ...

Record layout (little-endian), fields in the index's schema order:

    u32 stored length of each non-int field      (the record header)
    per field: int -> 8-byte signed integer; image -> the encoded image bytes as found;
               bytes/str/array -> the payload after the dataset's codec (raw, zstd, lz4)

The index holds, per shard, the file name, sample count, byte size, a CRC32 of the whole file,
``offsets`` (n + 1 byte offsets: record i is ``[offsets[i], offsets[i+1])``) and a CRC32 of each
stored record; and, for every ``int`` field, the whole column (e.g. the labels) so that labels are
known without reading a shard. No pickle: arrays are stored as raw bytes with an explicit dtype
and shape, and the index is plain JSON.

CRC32 (``zlib.crc32``) is the checksum: it is in the standard library, detects every burst error
up to 32 bits and any odd number of flipped bits, and runs at GB/s, far below the cost of
decoding the image it protects. Its purpose is detecting damage in storage and transfer, not
tampering.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.codecs import codec_names, get_codec
from kaisoku.errors import ConfigError, KaisokuError

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
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_SHARD_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def shard_file_name(shard_id: int) -> str:
    """The file name of shard ``shard_id``."""
    return f"shard-{shard_id:05d}{SHARD_SUFFIX}"


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Parse a byte size such as ``"64MiB"``, ``"2GiB"``, ``"1.5G"``, ``"500MB"`` or ``"4096"``.

    KiB/MiB/GiB/TiB and the bare K/M/G/T are powers of 1024; kB/MB/GB/TB are powers of 1000
    (case does not matter). Raises :class:`ConfigError` on anything else or a negative size.
    """
    if isinstance(text, bool):
        raise ConfigError(f"not a byte size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"a byte size cannot be negative: {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"not a byte size: {text!r}; write a number with an optional unit, e.g. 64MiB, 2GiB, 500MB"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ConfigError(f"not a byte size: {text!r}")
    return int(round(value))


def format_bytes(size: int) -> str:
    """A byte count for humans, in binary units: ``"64.0 MiB"``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


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


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


class CorruptRecordError(KaisokuError):
    """A record whose bytes are missing or do not match their checksum."""

    def __init__(self, message: str, *, file: str, record: int) -> None:
        super().__init__(message)
        self.file = file
        self.record = record

    def __reduce__(self) -> tuple[Any, ...]:
        return (_corrupt_record_error, (str(self), self.file, self.record))


def _corrupt_record_error(message: str, file: str, record: int) -> CorruptRecordError:
    return CorruptRecordError(message, file=file, record=record)


class RecordCodec:
    """Encodes sample dicts to stored record bytes and back, for one schema and codec."""

    def __init__(self, fields: Sequence[Field], codec: str) -> None:
        self.fields = tuple(fields)
        self.codec_name = codec
        get_codec(codec)  # fail early on an unavailable codec
        self._sized = [f for f in self.fields if f.kind != "int"]
        self._header = struct.Struct("<" + "I" * len(self._sized))

    def __reduce__(self) -> tuple[Any, ...]:
        return (RecordCodec, (self.fields, self.codec_name))

    def encode(self, sample: Mapping[str, Any]) -> tuple[bytes, int]:
        """Stored bytes of one record, and its logical size (the size with raw payloads).

        The logical size does not depend on the codec, so shard boundaries (cut on logical size)
        are the same for every codec and computable before compressing.
        """
        codec = get_codec(self.codec_name)
        payloads: list[bytes] = []
        lengths: list[int] = []
        logical = self._header.size
        for f in self.fields:
            if f.name not in sample:
                raise KaisokuError(f"sample has no field {f.name!r} (fields: {', '.join(sorted(sample))})")
            raw = _field_bytes(f, sample[f.name])
            logical += len(raw)
            stored = codec.encode(raw) if f.compressed else raw
            if f.kind != "int":
                lengths.append(len(stored))
            payloads.append(stored)
        return self._header.pack(*lengths) + b"".join(payloads), logical

    def logical_size(self, payload_sizes: Mapping[str, int]) -> int:
        """Logical size of a record from the raw byte size of each non-int field."""
        return self._header.size + sum(
            8 if f.kind == "int" else int(payload_sizes[f.name]) for f in self.fields
        )

    def decode(self, data: bytes | memoryview) -> dict[str, Any]:
        """The sample dict of one stored record; images stay encoded bytes, arrays are writable copies."""
        view = memoryview(data)
        lengths = iter(self._header.unpack_from(view, 0))
        position = self._header.size
        codec = get_codec(self.codec_name)
        sample: dict[str, Any] = {}
        for f in self.fields:
            if f.kind == "int":
                sample[f.name] = _I64.unpack_from(view, position)[0]
                position += 8
                continue
            size = next(lengths)
            payload = view[position : position + size]
            if len(payload) != size:
                raise ValueError("record shorter than its header says")
            position += size
            raw = codec.decode(payload) if f.compressed and self.codec_name != "raw" else payload
            if f.kind == "image" or f.kind == "bytes":
                sample[f.name] = bytes(raw)
            elif f.kind == "str":
                sample[f.name] = bytes(raw).decode("utf-8")
            else:
                array = np.frombuffer(raw, dtype=np.dtype(f.dtype))
                sample[f.name] = array.reshape(f.shape or ()).copy()
        if position != len(view):
            raise ValueError("record longer than its header says")
        return sample


def _field_bytes(f: Field, value: Any) -> bytes:
    if f.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise KaisokuError(f"field {f.name!r} is an int field, got {type(value).__name__}")
        return _I64.pack(int(value))
    if f.kind in ("image", "bytes"):
        if not isinstance(value, bytes | bytearray | memoryview):
            raise KaisokuError(f"field {f.name!r} holds bytes, got {type(value).__name__}")
        return bytes(value)
    if f.kind == "str":
        if not isinstance(value, str):
            raise KaisokuError(f"field {f.name!r} holds text, got {type(value).__name__}")
        return value.encode("utf-8")
    array = np.asarray(value)
    if array.shape != tuple(f.shape or ()) or array.dtype != np.dtype(f.dtype):
        raise KaisokuError(
            f"field {f.name!r} holds arrays of {np.dtype(f.dtype)} {tuple(f.shape or ())}, "
            f"got {array.dtype} {array.shape}"
        )
    return np.ascontiguousarray(array).tobytes()


def record_view(index: Index, buffer: Any, shard_id: int, record: int, *, verify: bool = True) -> memoryview:
    """The stored bytes of record ``record`` of shard ``shard_id`` inside ``buffer`` (that shard's bytes).

    ``buffer`` is any buffer-protocol object holding the shard file (an mmap, bytes from a RAM or
    disk cache, a shared-memory view); nothing is copied. With ``verify`` the record's CRC32 is
    checked. A record beyond the end of ``buffer`` or with a wrong checksum raises
    :class:`CorruptRecordError` naming the file, the record and the global sample index.
    """
    shard = index.shards[shard_id]
    start = int(shard.offsets[record])
    end = int(shard.offsets[record + 1])
    view = memoryview(buffer)[start:end]
    if len(view) != end - start:
        raise CorruptRecordError(
            f"{index.root / shard.file} is truncated: {len(memoryview(buffer))} of {shard.nbytes} bytes, "
            f"record {record} (sample {int(index.shard_starts()[shard_id]) + record}) is cut off; "
            "re-pack or re-stage the shard, or use skip_corrupt to leave such records out",
            file=shard.file,
            record=record,
        )
    if verify:
        _check_crc(index, view, shard_id, record)
    return view


def check_record(index: Index, data: bytes | memoryview, shard_id: int, record: int) -> memoryview:
    """Check record bytes obtained on their own (from another rank, a cache) against the index.

    Their length and CRC32 must match record ``record`` of shard ``shard_id``; otherwise raises
    :class:`CorruptRecordError`. Returns a memoryview of ``data``.
    """
    shard = index.shards[shard_id]
    view = memoryview(data)
    expected = int(shard.offsets[record + 1]) - int(shard.offsets[record])
    if len(view) != expected:
        raise CorruptRecordError(
            f"{index.root / shard.file} record {record} "
            f"(sample {int(index.shard_starts()[shard_id]) + record}): got {len(view)} bytes, "
            f"the index says {expected}",
            file=shard.file,
            record=record,
        )
    _check_crc(index, view, shard_id, record)
    return view


def _check_crc(index: Index, view: memoryview, shard_id: int, record: int) -> None:
    shard = index.shards[shard_id]
    computed = zlib.crc32(view)
    if computed != int(shard.record_crc32[record]):
        raise CorruptRecordError(
            f"{index.root / shard.file} record {record} "
            f"(sample {int(index.shard_starts()[shard_id]) + record}) fails its checksum "
            f"(stored {int(shard.record_crc32[record]):#010x}, computed {computed:#010x}); "
            "re-pack or re-stage the shard, or use skip_corrupt to leave such records out",
            file=shard.file,
            record=record,
        )


# ---------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class InspectReport:
    """What ``kaisoku inspect`` found: printable text and the list of problems (empty when sound)."""

    text: str
    """The summary, several lines, ready to print."""

    problems: list[str]
    """One line per damaged file or record (verification only)."""

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


_MAX_RECORD_PROBLEMS = 10


def verify_shard(index: Index, shard_id: int, buffer: Any) -> list[str]:
    """Problems of one shard's bytes against the index: size, every record CRC32, the file CRC32."""
    shard = index.shards[shard_id]
    path = index.root / shard.file
    first_sample = int(index.shard_starts()[shard_id])
    view = memoryview(buffer)
    problems: list[str] = []
    if len(view) != shard.nbytes:
        problems.append(f"{path}: {len(view)} bytes, the index says {shard.nbytes} (truncated or replaced)")
    bad = 0
    for record in range(shard.samples):
        try:
            record_view(index, view, shard_id, record, verify=True)
        except CorruptRecordError:
            bad += 1
            if bad <= _MAX_RECORD_PROBLEMS:
                start, end = int(shard.offsets[record]), int(shard.offsets[record + 1])
                reason = "cut off" if end > len(view) else "checksum mismatch"
                problems.append(
                    f"{path}: record {record} (sample {first_sample + record}, "
                    f"bytes {start}..{end}): {reason}"
                )
    if bad > _MAX_RECORD_PROBLEMS:
        problems.append(f"{path}: {bad - _MAX_RECORD_PROBLEMS} more damaged records")
    if not problems and zlib.crc32(view) != shard.crc32:
        problems.append(f"{path}: whole-file checksum mismatch although every record passed")
    return problems


def _open_for_verify(path: Path) -> Any:
    import mmap

    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        if size == 0:
            return b""
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)


def _summarise(index: Index) -> list[str]:
    sizes = index.shard_sizes()
    nbytes = index.shard_nbytes()
    lines = [
        f"dataset   {index.root}  ({FORMAT_NAME} version {index.version}, source {index.source or '?'})",
        f"samples   {index.num_samples:,} in {len(index.shards):,} shards "
        f"({int(sizes.min()) if sizes.size else 0:,}..{int(sizes.max()) if sizes.size else 0:,} per shard)",
        f"bytes     {format_bytes(index.nbytes)} "
        f"(shards {format_bytes(int(nbytes.min()) if nbytes.size else 0)}.."
        f"{format_bytes(int(nbytes.max()) if nbytes.size else 0)})",
        f"codec     {index.codec}",
    ]
    described = []
    for f in index.fields:
        if f.kind == "array":
            described.append(f"{f.name} (array {np.dtype(f.dtype).name} {list(f.shape or ())})")
        else:
            described.append(f"{f.name} ({f.kind})")
    lines.append(f"fields    {', '.join(described)}")
    for name, column in index.columns.items():
        if column.size:
            values, counts = np.unique(column, return_counts=True)
            lines.append(
                f"{name:<9} {values.size} distinct, {int(values.min())}..{int(values.max())}, "
                f"{int(counts.min()):,}..{int(counts.max()):,} samples each"
            )
    if index.classes is not None:
        shown = ", ".join(index.classes[:8]) + (", ..." if len(index.classes) > 8 else "")
        lines.append(f"classes   {len(index.classes)}: {shown}")
    if index.pack:
        lines.append("packed    " + ", ".join(f"{k}={v}" for k, v in sorted(index.pack.items())))
    if index.skipped:
        shown = ", ".join(index.skipped[:5]) + (", ..." if len(index.skipped) > 5 else "")
        lines.append(f"skipped   {len(index.skipped)} unreadable source items: {shown}")
    return lines


def inspect_dataset(path: str | Path, verify: bool = False) -> InspectReport:
    """Summarise the packed dataset at ``path``; with ``verify`` check every shard and record checksum.

    A directory holding several splits (a packed .npz) is summarised split by split. A problem in
    the index itself raises :class:`KaisokuError`; damaged or missing shards are reported in
    ``problems`` with the file, the record and the global sample index.
    """
    path = Path(path)
    targets = [path] if (path.is_file() or (path / INDEX_NAME).is_file()) else split_dirs(path) or [path]
    lines: list[str] = []
    problems: list[str] = []
    for target in targets:
        index = read_index(target)
        if lines:
            lines.append("")
        lines.extend(_summarise(index))
        if not verify:
            continue
        found: list[str] = []
        for shard_id, shard in enumerate(index.shards):
            shard_path = index.root / shard.file
            try:
                buffer = _open_for_verify(shard_path)
            except FileNotFoundError:
                start = int(index.shard_starts()[shard_id])
                found.append(f"{shard_path}: missing (samples {start}..{start + shard.samples - 1})")
                continue
            except OSError as error:
                found.append(f"{shard_path}: unreadable: {error.strerror or error}")
                continue
            try:
                found.extend(verify_shard(index, shard_id, buffer))
            finally:
                if hasattr(buffer, "close"):
                    buffer.close()
        if found:
            lines.append(f"verify    FAILED: {len(found)} problems")
            lines.extend(f"  {line}" for line in found)
        else:
            lines.append(f"verify    ok: {len(index.shards):,} shards, {index.num_samples:,} records checked")
        problems.extend(found)
    return InspectReport(text="\n".join(lines), problems=problems)


def inspect_summary(path: str | Path, verify: bool = False) -> str:
    """The printable summary of :func:`inspect_dataset`; raises :class:`KaisokuError` on any problem."""
    report = inspect_dataset(path, verify=verify)
    if report.problems:
        raise KaisokuError(
            f"{path}: {len(report.problems)} verification problems, first: {report.problems[0]}"
        )
    return report.text
