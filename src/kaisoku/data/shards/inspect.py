"""``kaisoku inspect``: a packed dataset's summary and, with ``--verify``, every checksum checked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.shards.checksum import crc32
from kaisoku.data.shards.format import FORMAT_NAME, INDEX_NAME, Index, read_index, split_dirs
from kaisoku.data.shards.records import CorruptRecordError, record_view
from kaisoku.data.shards.tables import TABLES_NAME, tables_crc
from kaisoku.errors import KaisokuError
from kaisoku.units import format_bytes


@dataclass(kw_only=True)
class InspectReport:
    """What ``kaisoku inspect`` found: printable text and the problems (none when sound)."""

    text: str
    """The summary, several lines, ready to print."""

    problems: list[str]
    """The listed problems, one line per damaged file or record (verification only)."""

    count: int = 0
    """Every problem found: the listed ones and the damaged records past each shard's listing limit (the
    number the text's ``FAILED`` line gives)."""

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems


_MAX_RECORD_PROBLEMS = 10


def verify_shard(index: Index, shard_id: int, buffer: Any) -> tuple[list[str], int]:
    """Problems of one shard's bytes against the index: its size, every record's CRC32, the file's CRC32.

    Returns the listed problems and how many damaged records were found beyond them (listing stops at
    10 records a shard). A shorter file is one problem that names the records it cuts off.
    """
    shard = index.shards[shard_id]
    path = index.root / shard.file
    first_sample = int(index.shard_starts()[shard_id])
    view = memoryview(buffer)
    problems: list[str] = []
    readable = shard.samples  # records that end inside the file
    if len(view) < shard.nbytes:
        readable = int(np.searchsorted(shard.offsets[1:], len(view), side="right"))
        last = shard.samples - 1
        problems.append(
            f"{path}: {len(view)} bytes, the index says {shard.nbytes} (truncated): records {readable}..{last} "
            f"(samples {first_sample + readable}..{first_sample + last}) cut off"
        )
    elif len(view) > shard.nbytes:
        problems.append(f"{path}: {len(view)} bytes, the index says {shard.nbytes} (replaced or appended to)")
    bad = 0
    for record in range(readable):
        try:
            record_view(index, view, shard_id, record, verify=True)
        except CorruptRecordError:
            bad += 1
            if bad <= _MAX_RECORD_PROBLEMS:
                start, end = int(shard.offsets[record]), int(shard.offsets[record + 1])
                problems.append(
                    f"{path}: record {record} (sample {first_sample + record}, "
                    f"bytes {start}..{end}): checksum mismatch"
                )
    if not problems and crc32(view) != shard.crc32:
        problems.append(f"{path}: whole-file checksum mismatch although every record passed")
    return problems, max(0, bad - _MAX_RECORD_PROBLEMS)


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
    count = 0
    for target in targets:
        index = read_index(target)
        if lines:
            lines.append("")
        lines.extend(_summarise(index))
        if not verify:
            continue
        found: list[str] = []
        unlisted = 0  # damaged records past each shard's listing limit
        if index.tables is not None:
            crc, stored = tables_crc(index.root, index.tables), int(index.tables["crc32"])
            if crc != stored:
                found.append(
                    f"{index.root / TABLES_NAME}: CRC32 {crc:#010x}, the index says {stored:#010x}; re-pack"
                )
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
                listed, more = verify_shard(index, shard_id, buffer)
            finally:
                if hasattr(buffer, "close"):
                    buffer.close()
            found.extend(listed)
            if more:
                found.append(f"{shard_path}: {more} more records with a checksum mismatch (not listed)")
                unlisted += more - 1  # the line above stands for ``more`` problems
        if found:
            total = len(found) + unlisted
            lines.append(f"verify    FAILED: {total:,} problem{'' if total == 1 else 's'}")
            lines.extend(f"  {line}" for line in found)
        else:
            lines.append(f"verify    ok: {len(index.shards):,} shards, {index.num_samples:,} records checked")
        problems.extend(found)
        count += len(found) + unlisted
    return InspectReport(text="\n".join(lines), problems=problems, count=count)


def inspect_summary(path: str | Path, verify: bool = False) -> str:
    """The printable summary of :func:`inspect_dataset`; raises :class:`KaisokuError` on any problem."""
    report = inspect_dataset(path, verify=verify)
    if report.problems:
        raise KaisokuError(f"{path}: {report.count:,} verification problems, first: {report.problems[0]}")
    return report.text
