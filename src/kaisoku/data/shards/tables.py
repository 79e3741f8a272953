"""The per-record tables of an index (format version 2): little-endian arrays in one file beside index.json.

``index.json`` keeps the per-shard and schema information; ``index.tables`` holds, back to back (each
start aligned to :data:`ALIGN` bytes), every per-record array: ``offsets`` (int64, each shard's
``samples + 1`` record offsets, shard after shard), ``record_crc32`` (uint32, one per record) and
``column:<name>`` (int64, one per record) for each ``int`` field. The index names each table's dtype,
start and length, and the file's size and CRC32. Readers memory-map the file read-only, so every process
of a node shares one copy of the tables in the page cache and opening costs no parsing: a 100M-sample
index opens as fast as a small one.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.shards.checksum import crc32, file_crc32
from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_open

TABLES_NAME = "index.tables"
"""File name of the per-record tables inside a packed dataset directory."""

ALIGN = 64
"""Every table starts at a multiple of this many bytes."""

TABLE_DTYPES = {"offsets": "<i8", "record_crc32": "<u4"}
"""Fixed tables and their dtypes; ``column:<name>`` tables are ``<i8``."""

_CRC_CHUNK = 64 << 20


def column_table(name: str) -> str:
    """The table name of the int column ``name``."""
    return f"column:{name}"


def _layout(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, dict[str, Any]], int]:
    entries: dict[str, dict[str, Any]] = {}
    position = 0
    for name in sorted(arrays):
        array = arrays[name]
        position = -(-position // ALIGN) * ALIGN
        entries[name] = {"dtype": array.dtype.str, "start": position, "count": int(array.size)}
        position += array.nbytes
    return entries, position


def _little_endian(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, array in arrays.items():
        dtype = np.dtype(TABLE_DTYPES.get(name, "<i8"))
        out[name] = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
    return out


def _chunks(arrays: Mapping[str, np.ndarray], entries: Mapping[str, Mapping[str, Any]]) -> Any:
    """The file's bytes in order: each table, preceded by zero padding up to its start."""
    position = 0
    for name in sorted(arrays):
        start = int(entries[name]["start"])
        if start > position:
            yield bytes(start - position)
        view = memoryview(arrays[name]).cast("B")
        for offset in range(0, len(view), _CRC_CHUNK):
            yield view[offset : offset + _CRC_CHUNK]
        position = start + arrays[name].nbytes


def describe_tables(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The ``tables`` entry of an index holding ``arrays`` (layout, size and CRC32), without writing."""
    arrays = _little_endian(arrays)
    entries, total = _layout(arrays)
    crc = 0
    for chunk in _chunks(arrays, entries):
        crc = crc32(chunk, crc)
    return {"file": TABLES_NAME, "bytes": total, "crc32": crc, "tables": entries}


def write_tables(directory: Path, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Write ``arrays`` to ``directory/index.tables`` atomically; the index's ``tables`` entry."""
    arrays = _little_endian(arrays)
    entries, total = _layout(arrays)
    crc = 0
    with atomic_open(directory / TABLES_NAME, "wb") as handle:
        for chunk in _chunks(arrays, entries):
            handle.write(chunk)
            crc = crc32(chunk, crc)
    return {"file": TABLES_NAME, "bytes": total, "crc32": crc, "tables": entries}


def map_tables(directory: Path, described: Mapping[str, Any], where: Path) -> dict[str, np.ndarray]:
    """Memory-map the tables ``described`` (an index's ``tables`` entry) read-only; views by name.

    A file of the wrong size, or a table outside it, raises :class:`KaisokuError` naming the file and
    what differs (``where`` is the index that describes it).
    """
    path = directory / str(described.get("file", TABLES_NAME))
    expected = int(described["bytes"])
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size != expected:
                raise KaisokuError(
                    f"index table file {path} has {size} bytes, {where} says {expected}: it belongs to "
                    "another pack or was cut off; re-pack the dataset"
                )
            buffer: Any = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except FileNotFoundError:
        raise KaisokuError(
            f"index table file {path} is missing ({where} needs it); copy it with the dataset or re-pack"
        ) from None
    views: dict[str, np.ndarray] = {}
    for name, entry in described["tables"].items():
        dtype = np.dtype(entry["dtype"])
        start, count = int(entry["start"]), int(entry["count"])
        if dtype.kind not in "iu" or start < 0 or start + count * dtype.itemsize > size:
            raise KaisokuError(
                f"index table {name!r} in {path} lies outside the file ({start} + {count} x "
                f"{dtype.itemsize} bytes > {size}); re-pack the dataset"
            )
        views[name] = np.frombuffer(buffer, dtype=dtype, count=count, offset=start)
    return views


def tables_crc(directory: Path, described: Mapping[str, Any]) -> int:
    """CRC32 of the tables file as it is on disk (for ``kaisoku inspect --verify``)."""
    return file_crc32(directory / str(described.get("file", TABLES_NAME)))


def check_offsets(
    offsets: np.ndarray, firsts: np.ndarray, samples: np.ndarray, nbytes: np.ndarray, names: list[str]
) -> str | None:
    """What is wrong with the offsets table against the shards, or None when it tiles every shard.

    Shard ``s`` owns ``offsets[firsts[s] : firsts[s] + samples[s] + 1]``: it must start at 0, end at the
    shard's ``nbytes[s]`` and rise strictly in between. Checked in chunks, so that a 100M-record table
    needs no table-sized temporary.
    """
    if offsets.size != int(samples.sum()) + samples.size:
        return f"the offsets table has {offsets.size} entries, the shards need {int(samples.sum()) + samples.size}"
    lasts = firsts + samples
    heads = offsets[firsts]
    if np.any(heads != 0):
        s = int(np.flatnonzero(heads != 0)[0])
        return f"offsets of {names[s]} start at {int(heads[s])}, not 0"
    tails = offsets[lasts]
    if np.any(tails != nbytes):
        s = int(np.flatnonzero(tails != nbytes)[0])
        return f"offsets of {names[s]} end at {int(tails[s])} bytes, the index says the file has {int(nbytes[s])}"
    chunk = 1 << 20
    for begin in range(0, offsets.size - 1, chunk):
        end = min(begin + chunk + 1, offsets.size)
        bad = np.flatnonzero(np.diff(offsets[begin:end]) <= 0) + begin
        if bad.size:
            # A fall from a shard's last offset to the next shard's 0 is the boundary, not damage.
            bad = bad[~np.isin(bad, lasts)]
        if bad.size:
            s = int(np.searchsorted(firsts, bad[0], side="right")) - 1
            return f"offsets of {names[s]} do not rise at record {int(bad[0] - firsts[s])}"
    return None
