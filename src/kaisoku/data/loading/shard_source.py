"""Where a dataset reads its shards: the shard files' mmaps or a node cache's opener, and its counters."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kaisoku.data.loading.counters import LoaderCounters


class ShardOpener(Protocol):
    """Returns the bytes of a whole shard file (any buffer-protocol object) by shard id."""

    def __call__(self, shard_id: int) -> Any:
        """The buffer holding shard ``shard_id``."""
        ...


def open_shard_mmap(path: Path) -> Any:
    """A read-only mmap of the file at ``path`` (``b""`` for an empty file)."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return b""
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)


class ShardSource:
    """Where a dataset reads its shards, and where it counts what it read.

    Until a node cache is attached, shards are the packed files (an mmap each); once the loader attaches
    one (it needs the run's token, known only after the process group exists), reads go through the
    cache's tiers and each read's bytes are counted under the tier that served them. The source is built
    with the dataset and shared with its loader: the dataset's attributes are never patched from outside.
    """

    def __init__(self, counters: LoaderCounters | None = None, opener: ShardOpener | None = None) -> None:
        self.counters = counters
        """Where reads and skips are counted for the loader's ``epoch_stats`` (None: not counted)."""
        self.opener = opener
        """``shard_id -> buffer`` holding the whole shard file (None: the shard file's mmap)."""
        self.tier_of: Callable[[int], str] | None = None
        """The tier a shard was last read from (the node cache's), to count bytes served per tier."""

    def attach_cache(self, opener: ShardOpener, tier_of: Callable[[int], str]) -> None:
        """Read through a node cache from now on (see :class:`~kaisoku.data.node_cache.cache.NodeCache`)."""
        self.opener, self.tier_of = opener, tier_of
