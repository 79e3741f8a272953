"""The local tier at start-up: emptied, or the shards an earlier run staged there checked and kept."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from kaisoku.data.node_cache.stager import staged_shard
from kaisoku.data.shards.checksum import file_crc32

# The node cache's logger: the message is the cache's, wherever the check runs.
log = logging.getLogger("kaisoku.data.node_cache.cache")


def prepare_local_tier(
    local: Path,
    *,
    source_paths: Sequence[Path],
    shard_bytes: Sequence[int] | None,
    crcs: Sequence[int] | None,
    capacity: int,
    kept: list[int],
) -> None:
    """Make the local tier's directory ``local``: emptied first without ``crcs`` (the index's whole-file
    CRC32s), else keeping the staged shards that check out (:func:`reuse_staged_shards`; sizes from
    ``shard_bytes``, or from the files at ``source_paths``). ``OSError`` when it cannot be written."""
    if crcs is None:
        shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True, exist_ok=True)
    if crcs is not None:
        sizes = shard_bytes or [os.stat(p).st_size for p in source_paths]
        reuse_staged_shards(
            local, num_shards=len(source_paths), sizes=sizes, crcs=crcs, capacity=capacity, kept=kept
        )


def reuse_staged_shards(
    local: Path, *, num_shards: int, sizes: Sequence[int], crcs: Sequence[int], capacity: int, kept: list[int]
) -> None:
    """Keep the shards staged in ``local`` (of ``num_shards``) whose size and CRC32 match ``sizes`` and
    ``crcs`` (the index's, by shard), up to ``capacity`` bytes, appending each to ``kept`` as it is
    checked; delete the rest of the directory's entries. One warning names what was kept."""
    budget, kept_bytes, start = capacity, 0, time.perf_counter()
    for path in sorted(local.iterdir()):
        shard = staged_shard(path.name)
        shard = shard if shard is not None and shard < num_shards and path.is_file() else None
        if (
            shard is not None
            and path.stat().st_size == sizes[shard] <= budget
            and (file_crc32(path) == crcs[shard])
        ):
            kept.append(shard)
            budget -= sizes[shard]
            kept_bytes += sizes[shard]
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if kept:
        log.warning(
            "reusing %d shards (%d bytes) staged in %s by an earlier run (size and CRC32 checked in %.1f s)",
            len(kept),
            kept_bytes,
            local,
            time.perf_counter() - start,
        )
