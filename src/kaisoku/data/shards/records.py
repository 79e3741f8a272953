"""Stored records: the record codec (sample dict <-> bytes) and the per-record CRC32 checks.

Record layout (little-endian), fields in the index's schema order:

    u32 stored length of each non-int field      (the record header)
    per field: int -> 8-byte signed integer; image -> the encoded image bytes as found;
               bytes/str/array -> the payload after the dataset's codec (raw, zstd, lz4)

CRC32 (``zlib.crc32``) is the checksum: it is in the standard library, detects every burst error
up to 32 bits and any odd number of flipped bits, and runs at GB/s, far below the cost of
decoding the image it protects. Its purpose is detecting damage in storage and transfer, not
tampering.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kaisoku.data.shards.checksum import crc32
from kaisoku.data.shards.codecs import get_codec
from kaisoku.data.shards.format import Field, Index
from kaisoku.errors import KaisokuError

_I64 = struct.Struct("<q")


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
        # What decoding does per field, worked out once: (name, kind, decompressed, dtype, shape).
        self._plan = tuple(
            (f.name, f.kind, f.compressed and codec != "raw", np.dtype(f.dtype) if f.kind == "array" else None,
             tuple(f.shape or ()))
            for f in self.fields
        )  # fmt: skip
        self._decompresses = any(decompressed for _, _, decompressed, _, _ in self._plan)

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
            stored = raw
            if f.compressed:
                by_shape = getattr(codec, "encode_array", None) if f.kind == "array" else None
                stored = by_shape(raw, f.dtype, f.shape) if by_shape else codec.encode(raw)
            if f.kind != "int":
                lengths.append(len(stored))
            payloads.append(stored)
        return self._header.pack(*lengths) + b"".join(payloads), logical

    def logical_size(self, payload_sizes: Mapping[str, int]) -> int:
        """Logical size of a record from the raw byte size of each non-int field."""
        return self._header.size + sum(
            8 if f.kind == "int" else int(payload_sizes[f.name]) for f in self.fields
        )

    def decode(self, data: bytes | memoryview, *, views: bool = False) -> dict[str, Any]:
        """The sample dict of one stored record; images stay encoded bytes, arrays are writable copies.

        ``views``: image and bytes fields stored as they are come back as read-only memoryviews of ``data``
        (no copy): for a caller that is done with them before it drops ``data``'s buffer. A view keeps
        that buffer (an mmap) alive, so a shard dropped by a cache meanwhile stays readable."""
        view = memoryview(data)
        lengths = self._header.unpack_from(view, 0)
        position = self._header.size
        codec = get_codec(self.codec_name) if self._decompresses else None
        sample: dict[str, Any] = {}
        sized = 0
        for name, kind, decompressed, dtype, shape in self._plan:
            if kind == "int":
                sample[name] = _I64.unpack_from(view, position)[0]
                position += 8
                continue
            size = lengths[sized]
            sized += 1
            payload = view[position : position + size]
            if len(payload) != size:
                raise ValueError("record shorter than its header says")
            position += size
            raw = codec.decode(payload) if decompressed and codec is not None else payload
            if kind == "image" or kind == "bytes":
                sample[name] = raw if views and isinstance(raw, memoryview) else bytes(raw)
            elif kind == "str":
                sample[name] = bytes(raw).decode("utf-8")
            else:
                sample[name] = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        if position != len(view):
            raise ValueError("record longer than its header says")
        return sample

    def decode_or_none(self, data: bytes | memoryview, *, views: bool = False) -> dict[str, Any] | None:
        """:meth:`decode`, or None for a record it cannot parse (the caller's checked path names it)."""
        try:
            return self.decode(data, views=views)
        except Exception:  # any malformation: struct, codec and numpy errors alike
            return None


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
    computed = crc32(view)
    if computed != int(shard.record_crc32[record]):
        raise CorruptRecordError(
            f"{index.root / shard.file} record {record} "
            f"(sample {int(index.shard_starts()[shard_id]) + record}) fails its checksum "
            f"(stored {int(shard.record_crc32[record]):#010x}, computed {computed:#010x}); "
            "re-pack or re-stage the shard, or use skip_corrupt to leave such records out",
            file=shard.file,
            record=record,
        )


def encode_rows(
    encoder: RecordCodec, columns: Mapping[str, np.ndarray]
) -> tuple[list[bytes], dict[str, list[int]]]:
    """Rows of equal-length ``columns`` (one per field) as records, and the ``int`` fields' values."""
    count = len(next(iter(columns.values())))
    records = []
    ints: dict[str, list[int]] = {f.name: [] for f in encoder.fields if f.kind == "int"}
    for i in range(count):
        sample = {}
        for f in encoder.fields:
            value = columns[f.name][i]
            if f.kind == "int":
                value = int(value)
                ints[f.name].append(value)
            sample[f.name] = value
        records.append(encoder.encode(sample)[0])
    return records, ints
