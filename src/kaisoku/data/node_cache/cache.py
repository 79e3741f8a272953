"""The node cache: source (any path) -> node-local directory -> RAM, as one rank of a node sees it.

The plan is :mod:`kaisoku.data.node_cache.staging`'s (pure); the thread that executes it and the control files are
:mod:`kaisoku.data.node_cache.stager`'s.

:class:`NodeCache`: every rank of a node builds one with the same directories. Local
rank 0 prepares the node's control files in the RAM directory (``/dev/shm/...``: shard-state flags, each
rank's progress, each shard's next planned load, counters) and runs the stager thread; all ranks read.
Ranks report their progress through :meth:`NodeCache.mark_progress`; the stager's evictions wait
for it.

Readers memory-map RAM or local files. A shard that is not staged is waited for when its load comes no
later than the step being read: the step the reader's rank has reached, or, for a read inside
:meth:`NodeCache.reading_for` (the loader's prefetching threads and workers), the step of the batch it
reads; so a shard the plan loads is never read from the source, whatever the timing. It is also waited
for when its load needs no more reader progress at all (the stager's open window). Anything else, in
particular an access the plan bypasses, is read from the source. No wait can deadlock: every action
before a load for step ``t`` is gated on progress to step ``t`` at most, which the slowest rank of the
node reaches without waiting on anything later than its own step (batches are read in order, so the
batches before step ``t`` never wait on step ``t``'s). When the local directory is full or unwritable,
staging into it stops with one warning and training goes on from RAM or the source. Counters (source
reads and bytes, per process, summed per node) let a test or a benchmark check that an epoch read
nothing from the source.

Every rank of a node calls, in order: ``NodeCache.for_sampler(...)`` (after ``sampler.load_state_dict``
when resuming), then per epoch ``sampler.set_epoch(e)`` and ``cache.mark_progress(e, sampler.step)``, and
``cache.mark_progress(e, k)`` as batch ``k - 1`` reaches the training loop; at the end a barrier and
``cache.close()``. The dataset reads through ``cache.shard_buffer`` (its ``shard_opener``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kaisoku.data.loading.counters import worker_slot
from kaisoku.data.node_cache.local_tier import prepare_local_tier
from kaisoku.data.node_cache.reader_state import HeldShards, ReadingTicket, StopFlag, map_file, staged_tier
from kaisoku.data.node_cache.stager import (
    COUNTERS,
    EPOCH_SHIFT,
    EPOCH_SLOT,
    FLAG_LOCAL,
    FLAG_PENDING,
    LOCAL_ON_SLOT,
    RAM_ON_SLOT,
    STATE_RUNNING,
    STATE_SLOT,
    ControlFiles,
    Stager,
    TierPaths,
    progress_ticket,
)
from kaisoku.data.node_cache.staging import CacheEvent, StagingSchedule, sampler_trace_fn
from kaisoku.data.node_cache.tier_dirs import unwritable_ram_dir, wait_until_prepared
from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_write_text

if TYPE_CHECKING:
    from kaisoku.data.order.sampler import EpochSampler

log = logging.getLogger(__name__)


class NodeCache:
    """The node's tiered shard cache, as seen by one rank (local rank 0 also owns the stager).

    ``source_paths[s]`` is shard ``s``'s file on the source. ``ram_dir`` holds the control files and, when
    ``ram_capacity > 0``, the RAM tier (put it on /dev/shm); every rank of a node must pass the same
    ``ram_dir``, ``local_dir`` and ``run_token`` (a value unique to the run, e.g. the rendezvous id).
    Local rank 0 starts the stager with ``schedule`` (the other ranks' ``schedule`` is ignored); with both
    capacities 0 there is no stager and every read goes to the source. ``shard_bytes`` (file sizes, e.g.
    from the dataset's index) saves the stager a ``stat`` per shard on the source.
    ``shard_buffer`` is the dataset's ``shard_opener``. ``reader_slots`` is the processes reading for
    each rank (1 + its DataLoader workers): each counts in its own row. A process keeps at most
    ``max_open`` shards mapped and at most ``max_source_bytes`` of shards read whole from the source
    (always the one in use), so a cache too small for the order cannot fill a worker's memory.
    ``shard_crcs`` (the index's whole-file CRC32s) let a restart reuse the local tier's staged shards
    whose size and CRC match; with them the local tier outlives :meth:`close` (the next run checks it),
    without them it is emptied. The RAM tier and the control files are removed by :meth:`close`.
    """

    def __init__(
        self,
        source_paths: Sequence[str | os.PathLike[str]],
        *,
        ram_dir: str | os.PathLike[str],
        ram_capacity: int = 0,
        local_dir: str | os.PathLike[str] | None = None,
        local_capacity: int = 0,
        local_rank: int = 0,
        ranks_per_node: int = 1,
        run_token: str = "",
        wait_timeout: float = 600.0,
        max_open: int = 64,
        schedule: StagingSchedule | None = None,
        shard_bytes: Sequence[int] | None = None,
        reader_slots: int = 1,
        max_source_bytes: int = 256 << 20,
        shard_crcs: Sequence[int] | None = None,
        source_reader: Callable[[Path], bytes] | None = None,
    ) -> None:
        if not 0 <= local_rank < ranks_per_node:
            raise KaisokuError(f"local rank {local_rank} is outside 0..{ranks_per_node - 1}")
        if ram_capacity < 0 or local_capacity < 0:
            raise KaisokuError("cache capacities must be >= 0 bytes")
        self.source_paths = [Path(p) for p in source_paths]
        if not self.source_paths:
            raise KaisokuError("the cache needs at least one shard path")
        self.num_shards = len(self.source_paths)
        self.ram_dir = Path(ram_dir)
        self.local_dir = Path(local_dir) if local_dir else None
        self.ram_capacity = int(ram_capacity)
        self.local_capacity = int(local_capacity) if self.local_dir else 0
        self.local_rank = local_rank
        self.ranks_per_node = ranks_per_node
        self.run_token = run_token or "kaisoku"
        self.wait_timeout = wait_timeout
        self.max_open = max_open
        self.reader_slots = max(1, int(reader_slots))
        self.max_source_bytes = int(max_source_bytes)
        self._shard_crcs = None if shard_crcs is None else [int(c) for c in shard_crcs]
        self.reused_local: list[int] = []
        self._source_reader = source_reader  # the stager's way to read a source file (default: read it)
        """Shards found staged in the local tier at start-up (size and CRC checked) and kept."""
        self._given_shard_bytes = None if shard_bytes is None else [int(b) for b in shard_bytes]
        if self._given_shard_bytes is not None and len(self._given_shard_bytes) != self.num_shards:
            raise KaisokuError(
                f"{len(self._given_shard_bytes)} shard sizes for {self.num_shards} shard paths"
            )
        self.paths = TierPaths(
            self.source_paths,
            self.ram_dir / "shards",
            self.local_dir / "kaisoku-shards" if self.local_dir else None,
        )
        self._held = HeldShards(self.max_open, self.max_source_bytes)
        self._lock = threading.RLock()
        self._reading = ReadingTicket()
        self._stager: Stager | None = None
        self._warned: set[str] = set()
        # Only the process that prepared the node (not a forked DataLoader worker) stages or deletes files.
        self._owner_pid = os.getpid() if local_rank == 0 else None
        if local_rank == 0:
            self._initialise()
            self.files = ControlFiles.open(self.ram_dir, self.ranks_per_node, self.reader_slots)
            for shard in self.reused_local:
                self.files.flags[shard] = FLAG_LOCAL
            if schedule is not None:
                self._start_staging(schedule)
            # Readers attach only now, so none of them sees the node without its stager.
            atomic_write_text(self.ram_dir / "ready", self.run_token)
        else:
            self._attach()

    @classmethod
    def for_sampler(
        cls,
        sampler: EpochSampler,
        source_paths: Sequence[str | os.PathLike[str]],
        *,
        ranks_per_node: int,
        ram_dir: str | os.PathLike[str],
        ram_capacity: int = 0,
        local_dir: str | os.PathLike[str] | None = None,
        local_capacity: int = 0,
        run_token: str = "",
        num_epochs: int | None = None,
        shard_bytes: Sequence[int] | None = None,
        reader_slots: int = 1,
        shard_crcs: Sequence[int] | None = None,
    ) -> NodeCache:
        """The node cache of ``sampler``'s rank, staging from the sampler's epoch and step on.

        Build the sampler and load its state first, so that a resumed run stages from where it stopped.
        Node and local rank follow from contiguous rank numbers: ``rank // ranks_per_node`` and
        ``rank % ranks_per_node``.
        """
        node, local_rank = divmod(sampler.rank, ranks_per_node)
        schedule = StagingSchedule(
            sampler_trace_fn(sampler, node=node, ranks_per_node=ranks_per_node),
            first_epoch=sampler.epoch,
            start_step=sampler.step,
            num_epochs=num_epochs,
        )
        return cls(
            source_paths,
            ram_dir=ram_dir,
            ram_capacity=ram_capacity,
            local_dir=local_dir,
            local_capacity=local_capacity,
            local_rank=local_rank,
            ranks_per_node=ranks_per_node,
            run_token=run_token,
            schedule=schedule,
            shard_bytes=shard_bytes,
            reader_slots=reader_slots,
            shard_crcs=shard_crcs,
        )

    # ---------------------------------------------------------------- control files

    def _initialise(self) -> None:
        try:
            self.ram_dir.mkdir(parents=True, exist_ok=True)
            (self.ram_dir / "ready").unlink(missing_ok=True)
            shutil.rmtree(self.paths.ram, ignore_errors=True)
            self.paths.ram.mkdir()
            local_on = self._prepare_local()
            ControlFiles.create(
                self.ram_dir,
                self.num_shards,
                self.ranks_per_node,
                ram_on=self.ram_capacity > 0,
                local_on=local_on,
                slots=self.reader_slots,
            )
        except OSError as error:
            raise unwritable_ram_dir(self.ram_dir, error) from error

    def _prepare_local(self) -> bool:
        """Prepare the local tier's directory (keeping staged shards that check out, see the class docs);
        False (after one warning) when it cannot be written."""
        if self.paths.local is None or self.local_capacity == 0:
            return False
        try:
            prepare_local_tier(
                self.paths.local,
                source_paths=self.source_paths,
                shard_bytes=self._given_shard_bytes,
                crcs=self._shard_crcs,
                capacity=self.local_capacity,
                kept=self.reused_local,
            )
        except OSError as error:
            self._warn_tier_off(
                "local", f"local cache {self.local_dir} is not writable ({error.strerror or error})"
            )
            return False
        return True

    def _attach(self) -> None:
        wait_until_prepared(self.ram_dir, self.run_token, self.wait_timeout)
        self.files = ControlFiles.open(self.ram_dir, self.ranks_per_node, self.reader_slots)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled into DataLoader workers: a reader attached to the same control files, no stager."""
        keep = ("source_paths", "num_shards", "ram_dir", "local_dir", "ram_capacity", "local_capacity")
        state = {k: self.__dict__[k] for k in keep}
        state.update(
            local_rank=self.local_rank,
            ranks_per_node=self.ranks_per_node,
            run_token=self.run_token,
            wait_timeout=self.wait_timeout,
            max_open=self.max_open,
            reader_slots=self.reader_slots,
            max_source_bytes=self.max_source_bytes,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.paths = TierPaths(
            self.source_paths,
            self.ram_dir / "shards",
            self.local_dir / "kaisoku-shards" if self.local_dir else None,
        )
        self._held = HeldShards(self.max_open, self.max_source_bytes)
        self._lock = threading.RLock()
        self._reading = ReadingTicket()
        self._stager = None
        self._warned = set()
        self._owner_pid = None
        self._attach()

    def _row(self) -> int:
        return self.local_rank * self.reader_slots + worker_slot(self.reader_slots)

    def _count(self, name: str, amount: int = 1) -> None:
        self.files.count(self._row(), name, amount)

    def _warn_once(self, key: str, message: str) -> None:
        """Log ``message`` the first time ``key`` comes up in this process, never again."""
        if key in self._warned:
            return
        self._warned.add(key)
        log.warning("%s", message)

    def _warn_tier_off(self, tier: str, reason: str) -> None:
        fallback = "the source" if tier == "ram" or self.ram_capacity == 0 else "RAM and the source"
        self._warn_once(tier, f"{reason}; staging into it stops and training reads from {fallback}")

    # ---------------------------------------------------------------- readers

    def mark_progress(self, epoch: int, steps_done: int) -> None:
        """Report that this rank has received its first ``steps_done`` batches of ``epoch``.

        The stager evicts a shard only after every rank of the node has passed its last use; call this as
        each batch arrives in the training loop, and with ``steps_done = start`` when an epoch begins.
        """
        self.files.progress[self.local_rank] = progress_ticket(epoch, steps_done)

    @contextlib.contextmanager
    def reading_for(self, epoch: int, step: int, stop: StopFlag | None = None) -> Iterator[None]:
        """Reads of this thread inside the block are for the rank's batch at ``step`` of ``epoch``.

        A loader reading ahead of what training has received (prefetching threads, DataLoader workers)
        says so, so that a shard whose planned load is for that step or earlier is waited for rather than
        read from the source as well: without it, such a read looks ahead of the plan. Such a wait may need
        training to receive the batches before ``step``; once ``stop`` is set (the loader dropped its
        batches, e.g. at a layout switch) the read stops waiting for them and goes to the source.
        """
        previous = (self._reading.ticket, self._reading.stop)
        self._reading.ticket, self._reading.stop = progress_ticket(epoch, step), stop
        try:
            yield
        finally:
            self._reading.ticket, self._reading.stop = previous

    def _resolve(self, shard: int) -> str:
        """The tier holding ``shard`` now: ram, local, or source; waits while it is being staged.

        It waits while the stager has not planned this rank's epoch yet, while the shard's load is in the
        stager's open window, or while its next load is for a step no later than the one being read (this
        rank's reported progress, or the batch named by :meth:`reading_for` when that is further): the
        plan serves that access from a tier. The stager writes a shard's flags before its next load and an epoch's
        next loads before publishing the epoch; read here in the opposite order, so a load that finishes
        between the reads is seen.
        """
        if not 0 <= shard < self.num_shards:
            raise KaisokuError(f"shard {shard} is outside 0..{self.num_shards - 1}")
        deadline: float | None = None
        delay = 0.001
        while True:
            tier = staged_tier(int(self.files.flags[shard]))
            if tier is not None:
                return tier
            running = int(self.files.control[STATE_SLOT]) == STATE_RUNNING
            mine = max(int(self.files.progress[self.local_rank]), self._reading.current())
            planning_behind = int(self.files.control[EPOCH_SLOT]) < mine >> EPOCH_SHIFT
            due = mine >= 0 and int(self.files.next_load[shard]) <= mine
            flags = int(self.files.flags[shard])
            tier = staged_tier(flags)
            if tier is not None:
                return tier
            if not running or not (flags & FLAG_PENDING or planning_behind or due):
                return "source"
            if deadline is None:
                deadline = time.monotonic() + self.wait_timeout
                self._count("waits")
            elif time.monotonic() > deadline:
                self._warn_once(
                    "wait",
                    f"shard {shard} was not staged within {self.wait_timeout:.0f} s; reading it from source",
                )
                return "source"
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def held_bytes(self) -> int:
        """Bytes of shards this process holds as private copies read from the source."""
        return self._held.source_bytes

    def tier_of(self, shard: int) -> str:
        """The tier this process last read ``shard`` from (ram, local or source)."""
        with self._lock:
            tier = self._held.tier_of(shard)
        return tier if tier is not None else "source"

    def shard_buffer(self, shard: int) -> memoryview:
        """The whole shard's bytes: mapped from RAM or local disk, else read from the source (counted).

        Thread-safe: the decoding threads of one process share the mappings under one lock, which is not
        held while waiting for a shard to be staged or reading it, so other threads go on meanwhile.
        """
        with self._lock:
            view = self._held.get(shard, self.files.flags)
        if view is not None:
            return view
        for _ in range(3):
            tier = self._resolve(shard)
            if tier == "source":
                break
            try:
                view = map_file(self.paths.path(tier, shard))
            except FileNotFoundError:
                continue  # evicted between the flag check and the open: look again
            self._count(f"{tier}_opens")
            with self._lock:
                return self._held.add(shard, tier, view)
        data = memoryview(self._read_source(shard))
        with self._lock:
            return self._held.add(shard, "source", data)

    def _read_source(self, shard: int) -> bytes:
        data = self.source_paths[shard].read_bytes()
        self._count("source_reads")
        self._count("source_bytes", len(data))
        return data

    def node_stats(self) -> dict[str, int]:
        """Counters summed over the node's readers and its stager (source reads, bytes, tier hits...)."""
        totals = np.asarray(self.files.counters).sum(axis=0)
        return {name: int(totals[i]) for i, name in enumerate(COUNTERS)}

    def stats(self) -> dict[str, int]:
        """This rank's reader counters (its main process and its DataLoader workers)."""
        first = self.local_rank * self.reader_slots
        row = np.asarray(self.files.counters[first : first + self.reader_slots]).sum(axis=0)
        return {name: int(row[i]) for i, name in enumerate(COUNTERS)}

    @property
    def owns_stager(self) -> bool:
        """True in the process that prepared the node (local rank 0's main process)."""
        return self._owner_pid == os.getpid()

    def stager_stats(self) -> dict[str, int]:
        """The stager's counters (zeros on ranks other than local rank 0's view of its own stager)."""
        row = np.asarray(self.files.counters[self.ranks_per_node * self.reader_slots])
        return {name: int(row[i]) for i, name in enumerate(COUNTERS)}

    def tiers_enabled(self) -> dict[str, bool]:
        """Which tiers are staging (a full or unwritable tier switches itself off)."""
        return {
            "ram": bool(self.files.control[RAM_ON_SLOT]),
            "local": bool(self.files.control[LOCAL_ON_SLOT]),
        }

    # ---------------------------------------------------------------- stager (local rank 0)

    def _start_staging(self, schedule: StagingSchedule) -> None:
        if self.ram_capacity == 0 and self.local_capacity == 0:
            return
        self._stager = Stager(
            self.files,
            self.paths,
            capacities={"local": self.local_capacity, "ram": self.ram_capacity},
            tier_dirs={"local": self.local_dir, "ram": self.ram_dir},
            shard_bytes=self._given_shard_bytes or [os.stat(p).st_size for p in self.source_paths],
            stager_row=self.ranks_per_node * self.reader_slots,
            warn_once=self._warn_once,
            warn_tier_off=self._warn_tier_off,
            initial_local=self.reused_local,
            reader=self._source_reader,
        )
        self._stager.start(schedule)

    @property
    def stager_log(self) -> list[tuple[int, str, CacheEvent]]:
        """(epoch, tier, event) of every action the stager executed (local rank 0 only)."""
        return self._stager.log if self._stager is not None else []

    def wait_staged(self, epoch: int, timeout: float = 60.0) -> bool:
        """Block until the stager has executed every action of ``epoch``'s plan (or stopped)."""
        return self._stager is not None and self._stager.wait_staged(epoch, timeout)

    def wait_stalled(self, timeout: float = 60.0) -> int | None:
        """Block until the stager can do nothing more without reader progress; the ticket it waits for.

        See :meth:`Stager.wait_stalled`; None without a stager (not local rank 0, or both capacities 0).
        """
        return self._stager.wait_stalled(timeout) if self._stager is not None else None

    def close(self, remove_files: bool = True) -> None:
        """Stop the stager and drop mappings; local rank 0 also deletes the RAM tier and the control files
        (by default), and the local tier unless a restart can check it (``shard_crcs`` given).

        Call it on every rank of the node after a barrier, so that no rank still reads a staged file.
        """
        if self._stager is not None:
            self._stager.stop()
        self._held.clear()
        if remove_files and self._owner_pid == os.getpid():
            shutil.rmtree(self.paths.ram, ignore_errors=True)
            names = [name for name, _, _ in ControlFiles.layout(self.num_shards, self.ranks_per_node)]
            for name in [*names, "ready"]:
                (self.ram_dir / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # only once empty: nothing but our own files is removed
                self.ram_dir.rmdir()
                self.ram_dir.parent.rmdir()  # the run's directory, once its last node has gone
            if self.paths.local is not None and self._shard_crcs is None:
                shutil.rmtree(self.paths.local, ignore_errors=True)
