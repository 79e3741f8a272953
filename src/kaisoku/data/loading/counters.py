"""What the data path did, counted per process and summed: the numbers behind ``epoch_stats()``.

A rank's loader and its DataLoader workers all count into one small int64 table in shared memory (a
torch tensor moved to shared memory, so it is shared with forked workers and passed by handle to spawned
ones). Each process writes only its own row (the main process row 0, worker ``w`` row ``w + 1``) and a
lock orders the threads of one process, so no update is ever lost to a concurrent ``+=``; readers sum
the rows.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torch.utils.data

COUNTER_NAMES = (
    "skipped_records",
    "source_records",
    "served_ram_bytes",
    "served_local_bytes",
    "served_source_bytes",
    "exchanged_bytes",
    "read_ns",
)
"""Columns: damaged records skipped; records served from the source; record bytes served per tier; record
bytes received from other nodes; nanoseconds spent reading files (the image-folder path)."""

_COLUMNS = {name: column for column, name in enumerate(COUNTER_NAMES)}
_LOCK = threading.Lock()  # one per process: orders the threads that decode in this process


def worker_slot(slots: int) -> int:
    """This process's row among ``slots``: 0 in the main process, ``worker id + 1`` in a DataLoader worker."""
    info = torch.utils.data.get_worker_info()
    return 0 if info is None else (info.id + 1) % slots


class LoaderCounters:
    """Counters of one rank's data path: one row per process (main + ``workers``), summed on read."""

    def __init__(self, workers: int = 0) -> None:
        """Counters for a rank whose loader runs ``workers`` DataLoader worker processes."""
        self.slots = max(0, int(workers)) + 1
        self.table = torch.zeros(self.slots, len(COUNTER_NAMES), dtype=torch.int64).share_memory_()
        self._array = self.table.numpy()  # the same shared memory: numpy's scalar updates cost ~0.1 us
        self._baseline = np.zeros(len(COUNTER_NAMES), dtype=np.int64)

    def __getstate__(self) -> dict[str, Any]:
        return {"slots": self.slots, "table": self.table, "_baseline": self._baseline}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._array = self.table.numpy()

    def add(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name`` in this process's row."""
        column = _COLUMNS[name]
        row = worker_slot(self.slots) if self.slots > 1 else 0
        with _LOCK:
            self._array[row, column] += amount

    def totals(self) -> dict[str, int]:
        """Every counter summed over the rank's processes, since the counters were made."""
        summed = self._array.sum(axis=0).tolist()
        return dict(zip(COUNTER_NAMES, (int(v) for v in summed), strict=True))

    def since_last(self) -> dict[str, int]:
        """The counters' growth since the previous call (or since they were made)."""
        now = self._array.sum(axis=0)
        delta = now - self._baseline
        self._baseline = now.copy()
        return dict(zip(COUNTER_NAMES, (int(v) for v in delta), strict=True))
