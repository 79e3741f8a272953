"""A reader process's own state: the shards it holds (bounded) and the batch each thread reads for."""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

import numpy as np

from kaisoku.data.node_cache.stager import FLAG_LOCAL, FLAG_RAM


class StopFlag(Protocol):
    """What tells a read ahead of training that its batch is no longer wanted: a ``threading.Event``, or a
    ``multiprocessing`` one for DataLoader workers."""

    def is_set(self) -> bool:
        """True once the batches being read are dropped."""
        ...


class ReadingTicket(threading.local):
    """Per thread: the progress ticket of the batch it reads (see
    :meth:`~kaisoku.data.node_cache.cache.NodeCache.reading_for`), or -1, and the flag that withdraws it."""

    ticket: int = -1
    stop: StopFlag | None = None

    def current(self) -> int:
        """The ticket, or -1 once its batch is dropped."""
        return -1 if self.stop is not None and self.stop.is_set() else self.ticket


def staged_tier(flags: int) -> str | None:
    """The tier a shard's state ``flags`` say it is staged in (ram before local), or None."""
    if flags & FLAG_RAM:
        return "ram"
    if flags & FLAG_LOCAL:
        return "local"
    return None


def map_file(path: Path) -> memoryview:
    """The bytes of the file at ``path``, memory-mapped read-only (empty for an empty file)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))


class HeldShards:
    """The shards one process holds, least recently used first: tier files it mapped and private copies of
    shards read from the source.

    At most ``max_open`` shards are held and at most ``max_source_bytes`` of source copies, but never fewer
    than the one last added (the one in use). Not thread-safe: the caller holds its lock.
    """

    def __init__(self, max_open: int, max_source_bytes: int) -> None:
        self.max_open = max_open
        self.max_source_bytes = max_source_bytes
        self._views: OrderedDict[int, tuple[str, memoryview]] = OrderedDict()
        self.source_bytes = 0
        """Bytes of the source copies held."""

    def get(self, shard: int, flags: np.ndarray) -> memoryview | None:
        """The held bytes of ``shard`` while its tier still has it (``flags``: the node's shard-state flags),
        marked as most recently used; None when not held or evicted from that tier since."""
        entry = self._views.get(shard)
        if entry is None:
            return None
        tier, view = entry
        state = int(flags[shard])
        still_there = (tier == "ram" and state & FLAG_RAM) or (tier == "local" and state & FLAG_LOCAL)
        if tier == "source" or still_there:
            self._views.move_to_end(shard)
            return view
        self.drop(shard)  # evicted from that tier: drop the mapping so its memory can be freed
        return None

    def add(self, shard: int, tier: str, view: memoryview) -> memoryview:
        """Hold ``view`` as ``shard``'s bytes from ``tier``, dropping the least recently used beyond the
        bounds; returns ``view``."""
        self.drop(shard)
        self._views[shard] = (tier, view)
        if tier == "source":
            self.source_bytes += len(view)
        # Bounded by count (mappings) and by bytes (private copies of source shards); never the newest.
        while len(self._views) > 1 and (
            len(self._views) > self.max_open or self.source_bytes > self.max_source_bytes
        ):
            self.drop(next(iter(self._views)))
        return view

    def drop(self, shard: int) -> None:
        """Stop holding ``shard`` (nothing when it is not held)."""
        entry = self._views.pop(shard, None)
        if entry is not None and entry[0] == "source":
            self.source_bytes -= len(entry[1])

    def tier_of(self, shard: int) -> str | None:
        """The tier ``shard`` is held from, or None when it is not held."""
        entry = self._views.get(shard)
        return entry[0] if entry is not None else None

    def clear(self) -> None:
        """Hold nothing."""
        self._views.clear()
        self.source_bytes = 0
