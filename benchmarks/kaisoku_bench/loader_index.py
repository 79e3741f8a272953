"""The index part of ``kaisoku bench loader``: opening a 10M-record dataset, time and private memory.

A synthetic packed dataset is written the way ``kaisoku pack`` writes one (format version 2: per-shard
entries in ``index.json``, the per-record offsets, CRCs and labels in ``index.tables``), with sparse shard
files of the sizes the index gives, so no image is needed. A fresh process (forked before anything is
opened) then times ``ShardedDataset(path)`` exactly as training builds it (every shard file checked), locates
a sample in every shard, and reports the growth of its private dirty memory (``Private_Dirty`` of
``/proc/self/smaps_rollup``: what the process allocated itself; the memory-mapped tables are clean file
pages that every process of a node shares through the page cache, so they do not count).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.loading.dataset import ShardedDataset
from kaisoku.data.shards.format import INDEX_NAME, Field, Index, ShardInfo, read_index, shard_file_name
from kaisoku_bench.common import goal

RECORD_BYTES = 110_000
"""Bytes per synthetic record (an ImageNet JPEG's typical size): only the shard sizes depend on it."""
PER_SHARD = 1000
"""Records per synthetic shard."""

_FORK = mp.get_context("fork")


def private_dirty_bytes() -> int:
    """This process's private dirty memory (``/proc/self/smaps_rollup``), bytes; 0 where unavailable."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("Private_Dirty:"):
            return int(line.split()[1]) * 1024
    return 0


def synthetic_index(directory: Path, records: int) -> Path:
    """A packed dataset of ``records`` synthetic records under ``directory`` (reused when already there)."""
    if (directory / INDEX_NAME).is_file() and read_index(directory).num_samples == records:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    offsets = np.arange(PER_SHARD + 1, dtype=np.int64) * RECORD_BYTES
    rng = np.random.Generator(np.random.PCG64(7))
    for shard_id in range(-(-records // PER_SHARD)):
        samples = min(PER_SHARD, records - shard_id * PER_SHARD)
        name = shard_file_name(shard_id)
        nbytes = samples * RECORD_BYTES
        with open(directory / name, "wb") as handle:
            handle.truncate(nbytes)  # sparse: the index is what is measured
        shards.append(
            ShardInfo(
                file=name,
                samples=samples,
                nbytes=nbytes,
                crc32=0,
                offsets=offsets[: samples + 1],
                record_crc32=rng.integers(0, 2**32, samples, dtype=np.uint32),
            )
        )
    labels = rng.integers(0, 1000, records, dtype=np.int64)
    index = Index(
        root=directory,
        codec="raw",
        fields=(Field(name="image", kind="image"), Field(name="label", kind="int")),
        shards=tuple(shards),
        columns={"label": labels},
        source="synthetic",
    )
    index.write(directory)
    return directory


def _open_in_child(path: Path, queue: Any) -> None:
    before = private_dirty_bytes()
    start = time.perf_counter()
    dataset = ShardedDataset(path)
    opened = time.perf_counter() - start
    starts = dataset.index.shard_starts()[:-1]
    shard_ids, _ = dataset.locate(starts)
    touched = sum(int(dataset.index.shards[s].offsets[1]) for s in shard_ids.tolist())
    queue.put((opened, private_dirty_bytes() - before, len(dataset), touched > 0))


def measure_open(path: Path) -> tuple[float, int, int]:
    """``(open seconds, private bytes, records)`` of opening ``path`` in a fresh forked process."""
    queue = _FORK.Queue()
    proc = _FORK.Process(target=_open_in_child, args=(path, queue))
    proc.start()
    opened, private, records, ok = queue.get(timeout=300)
    proc.join(60)
    if not ok:
        raise RuntimeError("the opened index gave no offsets")
    return opened, private, records


def index_part(root: Path, records: int, repeats: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows and summary entries of the index part: ``repeats`` opens of a ``records``-record index."""
    start = time.perf_counter()
    path = synthetic_index(root / f"index-{records}", records)
    written = time.perf_counter() - start
    opens = [measure_open(path) for _ in range(repeats)]
    seconds = float(np.median([o[0] for o in opens]))
    per_record = float(np.median([o[1] for o in opens])) / records
    table_bytes = (path / "index.tables").stat().st_size
    rows = [
        {
            "part": "index",
            "row": f"ShardedDataset open, {records:,} records",
            "records": records,
            "shards": -(-records // PER_SHARD),
            "open_s": round(seconds, 4),
            "open_runs_s": [round(o[0], 4) for o in opens],
            "private_bytes_per_record": round(per_record, 3),
            "index_json_bytes": (path / INDEX_NAME).stat().st_size,
            "tables_bytes": table_bytes,
            "write_s": round(written, 2),
        }
    ]
    scale = "" if records >= 10_000_000 else f" (measured at {records:,} records, not 10M: --quick)"
    summary = {
        "index_open_s_10M": goal(
            seconds,
            "<= 0.5",
            samples=[o[0] for o in opens],
            reason=scale.strip(" ()") if scale else "",
        ),
        "index_private_bytes_per_record": goal(
            per_record, "<= 16", samples=[o[1] / records for o in opens], records=records
        ),
    }
    return rows, summary
