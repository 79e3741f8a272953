"""The node cache's stager thread and the control files it shares with the node's readers.

Local rank 0 of a node runs one :class:`Stager`. It computes the node's trace from (seed, epoch) for the
current epoch with the next epoch as look-ahead, plans each tier with
:func:`~kaisoku.data.node_cache.staging.plan_staging`, and executes the plan: it reads whole shards sequentially from
the source (or from the local tier into RAM), writes them to a temporary name and renames, and it runs
ahead of training as far as the capacities allow. An eviction waits until every rank of the node has
reported that it finished the step of the victim's last use before the eviction. When a tier is full or
unwritable, staging into it stops with one warning.

The :class:`ControlFiles` in the node's RAM directory are how the stager and the readers
(:class:`~kaisoku.data.node_cache.cache.NodeCache`) talk: per-shard state flags and next planned load, each rank's
progress (a :func:`progress_ticket`), the stager's state, and counters.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.node_cache.staging import (
    NEVER,
    CacheEvent,
    StagingAction,
    StagingPlan,
    StagingSchedule,
    Trace,
    plan_staging,
)

log = logging.getLogger(__name__)

FLAG_RAM = 1
FLAG_LOCAL = 2
FLAG_PENDING = 4

STATE_SLOT, EPOCH_SLOT, RAM_ON_SLOT, LOCAL_ON_SLOT = range(4)
"""Slots of ``control.bin``: stager state, the epoch readers may use, whether each tier is on."""
STATE_IDLE, STATE_RUNNING, STATE_DONE, STATE_FAILED = range(4)
COUNTERS = ("source_reads", "source_bytes", "ram_opens", "local_opens", "staged_bytes", "waits")
"""Per-process counters: source reads and bytes, shard files mapped per tier, bytes staged, waits."""
EPOCH_SHIFT = 32
_COUNT_LOCK = threading.Lock()  # orders the threads of one process; other processes own other rows


def progress_ticket(epoch: int, steps_done: int) -> int:
    """Progress as one integer: epoch in the high bits, steps finished in it in the low bits."""
    return (int(epoch) << EPOCH_SHIFT) | int(steps_done)


@dataclass(frozen=True)
class ControlFiles:
    """The node's shared control arrays, memory-mapped from files in its RAM directory."""

    flags: np.ndarray
    """Per shard: FLAG_RAM, FLAG_LOCAL (staged there) or FLAG_PENDING (a load is under way)."""
    next_load: np.ndarray
    """Per shard, the progress ticket of the step of its next load that the stager has not executed."""
    control: np.ndarray
    """The ``*_SLOT`` values."""
    progress: np.ndarray
    """Per local rank, the progress ticket it reported."""
    counters: np.ndarray
    """Rows: ``slots`` per local rank (its main process, then one per DataLoader worker: every process
    writes only its own row, so no update is lost), then the stager's; columns: :data:`COUNTERS`."""

    @staticmethod
    def layout(num_shards: int, ranks_per_node: int, slots: int = 1) -> list[tuple[str, Any, int]]:
        """``(file name, dtype, length)`` of each control file."""
        return [
            ("flags.bin", np.uint8, num_shards),
            ("next_load.bin", np.int64, num_shards),
            ("control.bin", np.int64, 4),
            ("progress.bin", np.int64, ranks_per_node),
            ("counters.bin", np.int64, (ranks_per_node * slots + 1) * len(COUNTERS)),
        ]

    @classmethod
    def create(
        cls,
        directory: Path,
        num_shards: int,
        ranks_per_node: int,
        *,
        ram_on: bool,
        local_on: bool,
        slots: int = 1,
    ) -> None:
        """Write fresh control files: nothing staged, no load planned, no progress, tiers as given."""
        for name, dtype, count in cls.layout(num_shards, ranks_per_node, slots):
            np.zeros(count, dtype=dtype).tofile(directory / name)
        files = cls.open(directory, ranks_per_node, slots)
        files.control[RAM_ON_SLOT] = int(ram_on)
        files.control[LOCAL_ON_SLOT] = int(local_on)
        files.control[EPOCH_SLOT] = -1
        files.next_load[:] = NEVER
        files.progress[:] = -1
        for array in (files.control, files.next_load, files.progress):
            array.flush()

    @classmethod
    def open(cls, directory: Path, ranks_per_node: int, slots: int = 1) -> ControlFiles:
        """Map the control files written by :meth:`create` (with the same ``slots``)."""
        return cls(
            flags=np.memmap(directory / "flags.bin", dtype=np.uint8, mode="r+"),
            next_load=np.memmap(directory / "next_load.bin", dtype=np.int64, mode="r+"),
            control=np.memmap(directory / "control.bin", dtype=np.int64, mode="r+"),
            progress=np.memmap(directory / "progress.bin", dtype=np.int64, mode="r+"),
            counters=np.memmap(directory / "counters.bin", dtype=np.int64, mode="r+").reshape(
                ranks_per_node * slots + 1, len(COUNTERS)
            ),
        )

    def count(self, row: int, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name`` of ``row`` (a reader process's row, or the stager's)."""
        with _COUNT_LOCK:
            self.counters[row, COUNTERS.index(name)] += amount

    def tier_on(self, tier: str) -> bool:
        """Whether ``tier`` (ram or local) is staging."""
        return bool(self.control[RAM_ON_SLOT if tier == "ram" else LOCAL_ON_SLOT])


def read_whole(path: Path) -> bytes:
    """The whole file at ``path``, read sequentially."""
    with open(path, "rb") as handle:
        return handle.read()


def staged_name(shard: int) -> str:
    """The file name of a staged shard in a tier."""
    return f"shard-{shard:06d}"


def staged_shard(name: str) -> int | None:
    """The shard id of a staged file's name (:func:`staged_name`), or None for any other name."""
    if len(name) == 12 and name.startswith("shard-") and name[6:].isdigit():
        return int(name[6:])
    return None


@dataclass(frozen=True)
class TierPaths:
    """Where each copy of a shard lives: on the source, in the RAM tier, in the local tier."""

    source: list[Path]
    ram: Path
    local: Path | None

    def path(self, tier: str, shard: int) -> Path:
        """The file of ``shard`` in ``tier`` (ram, local or source)."""
        if tier == "ram":
            return self.ram / staged_name(shard)
        if tier == "local" and self.local is not None:
            return self.local / staged_name(shard)
        return self.source[shard]


class Stager:
    """The thread of local rank 0 that stages the node's shards into its tiers, plan by plan.

    ``capacities`` are the tiers' bytes, ``tier_dirs`` the directories named in warnings,
    ``stager_row`` its row in the counters; ``warn_once`` and ``warn_tier_off`` log through the cache,
    so that a warning is given once per process whichever side notices first.
    """

    def __init__(
        self,
        files: ControlFiles,
        paths: TierPaths,
        *,
        capacities: dict[str, int],
        tier_dirs: dict[str, Path | None],
        shard_bytes: Sequence[int],
        stager_row: int,
        warn_once: Callable[[str, str], None],
        warn_tier_off: Callable[[str, str], None],
        reader: Callable[[Path], bytes] | None = None,
        initial_local: Sequence[int] = (),
    ) -> None:
        self.files = files
        self.paths = paths
        self.capacities = capacities
        self.tier_dirs = tier_dirs
        self.shard_bytes = np.array(shard_bytes, dtype=np.int64)
        self.stager_row = stager_row
        self.warn_once = warn_once
        self.warn_tier_off = warn_tier_off
        self.log: list[tuple[int, str, CacheEvent]] = []
        """(epoch, tier, event) of every action executed."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._staged = threading.Condition()
        self._staged_epoch = -1
        self._stalled_on: int | None = None
        self.reader = reader or read_whole
        self.initial_local = list(initial_local)
        self._ahead: tuple[int, Future[bytes]] | None = None
        self._ahead_pool: ThreadPoolExecutor | None = None

    def start(self, schedule: StagingSchedule) -> None:
        """Start the stager thread on ``schedule``."""
        self.files.control[STATE_SLOT] = STATE_RUNNING
        self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="kaisoku-read-ahead")
        self._thread = threading.Thread(
            target=self._stage,
            args=(schedule.trace_of_epoch, schedule.first_epoch, schedule.start_step, schedule.num_epochs),
            name="kaisoku-stager",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (after its current copy) and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=True, cancel_futures=True)
            self._ahead_pool = None
        self._ahead = None

    def wait_staged(self, epoch: int, timeout: float = 60.0) -> bool:
        """Block until the stager has executed every action of ``epoch``'s plan (or stopped)."""
        deadline = time.monotonic() + timeout
        with self._staged:
            while self._staged_epoch < epoch and self._thread is not None and self._thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._staged.wait(remaining)
        return self._staged_epoch >= epoch

    def wait_stalled(self, timeout: float = 60.0) -> int | None:
        """Block until the stager can do nothing more without reader progress; the ticket it waits for.

        The ticket (see :func:`progress_ticket`) is the progress every rank of the node must report with
        :meth:`mark_progress` before the stager's next eviction may run. None when the stager finished or
        stopped first, when there is none (not local rank 0, or both capacities 0), or after ``timeout``
        seconds.
        """
        deadline = time.monotonic() + timeout
        with self._staged:
            while self._stalled_on is None and self._thread is not None and self._thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._staged.wait(remaining)
            return self._stalled_on

    def _stage(
        self,
        trace_of_epoch: Callable[[int, int], Trace],
        first_epoch: int,
        start_step: int,
        num_epochs: int | None,
    ) -> None:
        stager_row = self.stager_row
        # Per tier, the resident shards in load order (dicts as ordered sets).
        resident: dict[str, dict[int, None]] = {"local": dict.fromkeys(self.initial_local), "ram": {}}
        last_use: dict[int, int] = {}
        state = STATE_DONE
        try:
            epoch, start = first_epoch, start_step
            while not self._stop.is_set() and (num_epochs is None or epoch < num_epochs):
                trace = trace_of_epoch(epoch, start)
                has_next = num_epochs is None or epoch + 1 < num_epochs
                combined = trace.then(trace_of_epoch(epoch + 1, 0)) if has_next and len(trace) else trace
                if not self._run_epoch(epoch, trace, combined, resident, last_use, stager_row):
                    break
                if len(trace):
                    shards, last = np.unique(trace.shards[::-1], return_index=True)
                    steps = trace.steps[::-1][last]
                    last_use.update(zip(shards.tolist(), (progress_ticket(epoch, t) for t in steps.tolist())))
                with self._staged:
                    self._staged_epoch = epoch
                    self._staged.notify_all()
                epoch, start = epoch + 1, 0
        except Exception:
            state = STATE_FAILED
            log.exception("the node's stager failed; training goes on reading from %s", "the source")
        finally:
            self.files.control[STATE_SLOT] = state
            np.bitwise_and(self.files.flags, 0xFF & ~FLAG_PENDING, out=self.files.flags)
            self.files.next_load[:] = NEVER
            with self._staged:
                self._staged.notify_all()

    def _tier_on(self, tier: str) -> bool:
        return bool(self.files.control[RAM_ON_SLOT if tier == "ram" else LOCAL_ON_SLOT])

    def _set_flags(self, shard: int, resident: dict[str, dict[int, None]], pending: dict[int, int]) -> None:
        flags = (FLAG_RAM if shard in resident["ram"] else 0) | (
            FLAG_LOCAL if shard in resident["local"] else 0
        )
        if not flags and pending.get(shard, 0) > 0:
            flags = FLAG_PENDING
        self.files.flags[shard] = flags

    def _gate(self, epoch: int, action: StagingAction, last_use: dict[int, int]) -> int:
        """The progress ticket every rank must pass before ``action`` (an eviction) may run."""
        if action.after_step >= 0:
            return progress_ticket(epoch, action.after_step)
        return last_use.get(action.shard, -1)

    def _run_epoch(
        self,
        epoch: int,
        trace: Trace,
        combined: Trace,
        resident: dict[str, dict[int, None]],
        last_use: dict[int, int],
        stager_row: int,
    ) -> bool:
        """Plan ``epoch`` for every staging tier and execute the plans; False if the cache is closing.

        Before readers see the epoch, every shard's next load is published (the ticket of its step), so a
        reader that has reached that step waits for the load instead of reading the source: everything
        the plan executes before that load is gated on progress up to that step at most. The plan runs
        in windows: from the current action up to the next eviction whose gate is still closed. The loads
        of the open window are also flagged pending, so a reader ahead of its reported progress waits for
        them too (they need no further progress from any reader); a shard whose load lies beyond both is
        read from the source if a reader ahead of its progress needs it first.
        """
        capacities = self.capacities
        tiers = [t for t in ("local", "ram") if capacities[t] > 0 and self.files.tier_on(t)]
        merged: list[tuple[int, int, int, str, StagingAction]] = []
        for rank, tier in enumerate(tiers):
            plan = plan_staging(
                combined, capacities[tier], self.shard_bytes, initial=list(resident[tier]), horizon=len(trace)
            )
            merged.extend((a.position, rank, n, tier, a) for n, a in enumerate(plan.actions))
            self._warn_if_thrashing(epoch, tier, trace, plan)
        # Per position: local-tier actions first, so a RAM load can copy the shard just written locally.
        merged.sort(key=lambda item: item[:3])
        actions = [(tier, action) for *_, tier, action in merged]
        loads = self._publish_next_loads(epoch, actions, 0, set())
        pending: dict[int, int] = {}
        teed: set[int] = set()
        window_end = 0
        for index, (tier, action) in enumerate(actions):
            if self._stop.is_set():
                return False
            if index >= window_end:
                if action.kind == "evict" and self.files.tier_on(tier):
                    # Readers of this epoch must see it before the stager waits for their progress.
                    self.files.control[EPOCH_SLOT] = epoch
                    if not self._wait_progress(self._gate(epoch, action, last_use)):
                        return False
                window_end = self._open_window(actions, index, epoch, last_use, resident, pending)
                self.files.control[EPOCH_SLOT] = epoch
            if not self.files.tier_on(tier):
                continue
            if action.kind == "evict":
                self.paths.path(tier, action.shard).unlink(missing_ok=True)
                del resident[tier][action.shard]
            elif action.kind == "load":
                pending[action.shard] -= 1
                loads[action.shard].popleft()
                if tier == "ram" and action.shard in teed:
                    teed.discard(action.shard)  # written by the local load just before: one source read
                    loaded = True
                else:
                    tee = self._tees(actions, index)
                    ahead = self._next_source_load(actions, index, resident, tee)
                    loaded = self._load(tier, action.shard, resident, stager_row, tee=tee, ahead=ahead)
                    if loaded and tee and self.paths.path("ram", action.shard).exists():
                        teed.add(action.shard)
                if loaded:
                    resident[tier][action.shard] = None
                else:
                    # The tier is full or unwritable: forget its loads so that no reader waits on them.
                    self.files.control[RAM_ON_SLOT if tier == "ram" else LOCAL_ON_SLOT] = 0
                    stale = set(pending)
                    pending.clear()
                    for later_tier, later in actions[index + 1 : window_end]:
                        if later.kind == "load" and self.files.tier_on(later_tier):
                            pending[later.shard] = pending.get(later.shard, 0) + 1
                    for shard in stale | set(pending):
                        self._set_flags(shard, resident, pending)
                    loads = self._publish_next_loads(epoch, actions, index + 1, set(loads))
                    continue
            self._set_flags(action.shard, resident, pending)
            if action.kind == "load":
                # After the flags: a reader that sees the next load moved on also sees the shard staged.
                queue = loads[action.shard]
                self.files.next_load[action.shard] = queue[0] if queue else NEVER
            self.log.append((epoch, tier, action.event()))
        self.files.control[EPOCH_SLOT] = epoch
        return True

    def _publish_next_loads(
        self, epoch: int, actions: Sequence[tuple[str, StagingAction]], start: int, previous: set[int]
    ) -> dict[int, deque[int]]:
        """Per shard, the tickets of its loads in ``actions[start:]`` (tiers on); the first one published.

        Shards in ``previous`` that have no load left are published as never loaded again.
        """
        loads: dict[int, deque[int]] = {}
        for tier, action in actions[start:]:
            if action.kind == "load" and self.files.tier_on(tier):
                loads.setdefault(action.shard, deque()).append(progress_ticket(epoch, action.step))
        for shard in previous - set(loads):
            self.files.next_load[shard] = NEVER
        for shard, tickets in loads.items():
            self.files.next_load[shard] = tickets[0]
        return loads

    def _open_window(
        self,
        actions: Sequence[tuple[str, StagingAction]],
        start: int,
        epoch: int,
        last_use: dict[int, int],
        resident: dict[str, dict[int, None]],
        pending: dict[int, int],
    ) -> int:
        """Flag the loads from ``start`` up to the next closed eviction gate as pending; return that index.

        ``actions[start]`` itself is runnable (its gate, if any, was just waited for).
        """
        slowest = int(np.asarray(self.files.progress).min())
        end = start
        while end < len(actions):
            tier, action = actions[end]
            if not self.files.tier_on(tier):
                end += 1
                continue
            if action.kind == "evict" and end > start and self._gate(epoch, action, last_use) >= slowest:
                break
            if action.kind == "load":
                pending[action.shard] = pending.get(action.shard, 0) + 1
                self._set_flags(action.shard, resident, pending)
            end += 1
        return end

    def _warn_if_thrashing(self, epoch: int, tier: str, trace: Trace, plan: StagingPlan) -> None:
        """One warning when a tier is too small for the order: many reloads, or many source reads."""
        if not len(trace):
            return
        needed = int(self.shard_bytes[np.unique(trace.shards)].sum())
        loaded = sum(int(self.shard_bytes[a.shard]) for a in plan.actions if a.kind == "load")
        bypassed = sum(1 for a in plan.actions if a.kind == "bypass") / len(trace)
        if loaded > 2 * needed or bypassed > 0.1:
            capacity = self.capacities[tier]
            self.warn_once(
                f"thrash-{tier}",
                f"the {tier} cache ({capacity} bytes) is too small for this order: epoch {epoch} stages "
                f"{loaded / max(needed, 1):.1f}x the {needed} bytes the node reads and leaves "
                f"{100 * bypassed:.0f}% of its shard accesses to the source; raise the capacity or use "
                "data.shuffle=block or partial, whose working set is smaller",
            )

    def _wait_progress(self, gate: int) -> bool:
        """Wait until every rank of the node has passed ticket ``gate``; False if the cache is closing."""
        if gate < 0 or int(np.asarray(self.files.progress).min()) > gate:
            return True
        with self._staged:
            self._stalled_on = gate + 1
            self._staged.notify_all()
        try:
            delay = 0.001
            while int(np.asarray(self.files.progress).min()) <= gate:
                if self._stop.wait(delay):
                    return False
                delay = min(delay * 2, 0.02)
            return True
        finally:
            with self._staged:
                self._stalled_on = None

    def _tees(self, actions: Sequence[tuple[str, StagingAction]], index: int) -> bool:
        """Whether the local load at ``index`` is followed by the same shard's RAM load: write both at once."""
        tier, action = actions[index]
        if tier != "local" or index + 1 >= len(actions) or not self.files.tier_on("ram"):
            return False
        next_tier, following = actions[index + 1]
        return next_tier == "ram" and following.kind == "load" and following.shard == action.shard

    def _next_source_load(
        self,
        actions: Sequence[tuple[str, StagingAction]],
        index: int,
        resident: dict[str, dict[int, None]],
        tee: bool,
    ) -> int | None:
        """The shard of the next load after ``index`` that reads the source (the read-ahead's target)."""
        for tier, action in actions[index + 1 + int(tee) : index + 65]:
            if action.kind != "load" or not self.files.tier_on(tier):
                continue
            if tier == "local" or action.shard not in resident["local"]:
                return action.shard
        return None

    def _source_bytes(self, shard: int, stager_row: int) -> bytes:
        """Shard ``shard`` from the source: the read-ahead's bytes when it read this shard, else read now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == shard:
            return ahead[1].result()
        if ahead is not None:
            ahead[1].result()  # a read the plan no longer needs: finish it (counted) and drop it
        return self._read_counted(shard, stager_row)

    def _read_counted(self, shard: int, stager_row: int) -> bytes:
        data = self.reader(self.paths.source[shard])
        self.files.count(stager_row, "source_reads")
        self.files.count(stager_row, "source_bytes", len(data))
        return data

    def _load(
        self,
        tier: str,
        shard: int,
        resident: dict[str, dict[int, None]],
        stager_row: int,
        *,
        tee: bool = False,
        ahead: int | None = None,
    ) -> bool:
        """Copy one whole shard into ``tier``; False (after one warning) if the tier cannot take it.

        A source read feeds the local tier and, with ``tee``, the RAM tier too (the next action loads the
        same shard there); ``ahead`` is the next shard read from the source, whose read starts before this
        one's writes, so the link never waits on a tier. A failure to read the source is raised (it is
        not the cache's to hide); a failure to write the tier switches the tier off.
        """
        from_local = tier == "ram" and shard in resident["local"]
        if from_local:
            data = read_whole(self.paths.path("local", shard))
        else:
            data = self._source_bytes(shard, stager_row)
        if ahead is not None and ahead != shard and self._ahead_pool is not None:
            self._ahead = (ahead, self._ahead_pool.submit(self._read_counted, ahead, stager_row))
        if not self._write(tier, shard, data):
            return False
        self.files.count(stager_row, "staged_bytes", len(data))
        if tee and self._write("ram", shard, data, quiet=True):
            self.files.count(stager_row, "staged_bytes", len(data))
        return True

    def _write(self, tier: str, shard: int, data: bytes, *, quiet: bool = False) -> bool:
        """Write ``data`` as ``shard`` in ``tier`` (temporary name, then rename); False if it cannot."""
        target = self.paths.path(tier, shard)
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            with open(tmp, "wb") as dst:
                dst.write(data)
            os.replace(tmp, target)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            # A failed tee is left to the RAM load that follows it, which reports it the usual way.
            return False if quiet else self._tier_failed(tier, error)
        return True

    def _tier_failed(self, tier: str, error: OSError) -> bool:
        where = self.tier_dirs[tier]
        what = "full" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "not writable"
        self.warn_tier_off(tier, f"{tier} cache {where} is {what} ({error.strerror or error})")
        return False
