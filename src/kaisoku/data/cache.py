"""Tiered shard cache: source (any path) -> node-local directory -> RAM, staged ahead by one stager per node.

The pure part:

- :func:`node_trace` turns an epoch's order into the node's *access trace*: for every step, the shards
  that the node's ranks read in it (first appearance first). For ``partial`` it keeps only the node's home
  shards, and puts the samples the node sends away (read once, at the epoch's first step) in front.
- :func:`first_use_order` lists the shards of a trace in order of first use: the order the stager loads
  them when everything fits.
- :func:`belady_evictions` is a plain reference simulator of clairvoyant caching on a trace (Belady's MIN
  with bypass): on a miss that needs room it evicts the resident shards whose next use is farthest (never
  used again counts as farthest; ties to the higher shard id), unless the incoming shard itself is needed
  no sooner than the nearest of those, in which case it is a *bypass*: that access is read from the
  source and the residents stay. Shards used in the current step are pinned; a shard that cannot fit
  beside the step's pinned shards is a bypass too.
- :func:`plan_staging` is the heap-based planner the stager executes. It makes the same decisions as the
  simulator and adds, for every eviction, the step after which it is safe.

The runtime part, :class:`NodeCache`: every rank of a node builds one with the same directories. Local
rank 0 prepares the node's control files in the RAM directory (``/dev/shm/...``: shard-state flags, each
rank's progress, each shard's next planned load, counters) and runs the stager thread; all ranks read.
The stager computes the node's trace from (seed, epoch) for the current epoch with the next epoch as
look-ahead, plans each tier with :func:`plan_staging`, and executes the plan: it reads whole shards
sequentially from the source (or from the local tier into RAM), writes them to a temporary name and
renames, and it runs ahead of training as far as the capacities allow. An eviction waits until every rank
of the node has reported (through :meth:`NodeCache.mark_progress`) that it finished the step of the
victim's last use before the eviction.

Readers memory-map RAM or local files. A shard that is not staged is waited for when its load comes no
later than the step the reader's rank has reached (so a shard the plan loads is never read from the
source, whatever the timing), or when its load needs no more reader progress at all (the stager's open
window: reads ahead of the reported progress, e.g. in DataLoader workers); anything else, in particular
an access the plan bypasses, is read from the source. No wait can deadlock: every action before a load
for step ``t`` is gated on progress to step ``t`` at most, which the slowest rank of the node reaches
without waiting on anything later than its own step. When the local directory is full or unwritable,
staging into it stops with one warning and training goes on from RAM or the source. Counters (source
reads and bytes, per process, summed per node) let a test or a benchmark check that an epoch read
nothing from the source.

Every rank of a node calls, in order: ``NodeCache.for_sampler(...)`` (after ``sampler.load_state_dict``
when resuming), then per epoch ``sampler.set_epoch(e)`` and ``cache.mark_progress(e, sampler.step)``, and
``cache.mark_progress(e, k)`` as batch ``k - 1`` reaches the training loop; at the end a barrier and
``cache.close()``. The dataset reads through ``cache.shard_buffer`` (its ``shard_opener``).
"""

from __future__ import annotations

import errno
import heapq
import logging
import mmap
import os
import shutil
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kaisoku.data.shuffle import as_shard_sizes, shard_of
from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_write_text

if TYPE_CHECKING:
    from kaisoku.data.sampler import EpochSampler

log = logging.getLogger(__name__)

NEVER = np.iinfo(np.int64).max
"""Next-use position of a shard that is not used again in the trace."""

# ----------------------------------------------------------------------------------------------- pure part


@dataclass(frozen=True)
class Trace:
    """A node's shard accesses in order: ``shards[i]`` is read during step ``steps[i]``."""

    steps: np.ndarray
    shards: np.ndarray

    def __len__(self) -> int:
        return int(self.shards.size)

    @classmethod
    def of(cls, trace: Trace | Iterable[int]) -> Trace:
        """A Trace as is, or a plain sequence of shard ids with every access its own step."""
        if isinstance(trace, Trace):
            return trace
        shards = np.asarray(list(trace), dtype=np.int64)
        return cls(np.arange(shards.size, dtype=np.int64), shards)

    def then(self, other: Trace) -> Trace:
        """This trace followed by ``other`` (its steps shifted to come after this trace's steps)."""
        offset = int(self.steps[-1]) + 1 - (int(other.steps[0]) if len(other) else 0) if len(self) else 0
        return Trace(
            np.concatenate([self.steps, other.steps + offset]).astype(np.int64),
            np.concatenate([self.shards, other.shards]).astype(np.int64),
        )


def first_use_order(trace: Trace | Iterable[int]) -> np.ndarray:
    """The shards of ``trace`` in order of first use."""
    shards = Trace.of(trace).shards
    _, first = np.unique(shards, return_index=True)
    return shards[np.sort(first)]


def next_uses(shards: np.ndarray) -> np.ndarray:
    """For each position, the next position reading the same shard (``NEVER`` if none)."""
    shards = np.asarray(shards, dtype=np.int64)
    order = np.lexsort((np.arange(shards.size), shards))
    result = np.full(shards.size, NEVER, dtype=np.int64)
    same = shards[order[:-1]] == shards[order[1:]]
    result[order[:-1][same]] = order[1:][same]
    return result


@dataclass(frozen=True)
class CacheEvent:
    """One cache decision at trace position ``position``: ``load``, ``evict`` or ``bypass`` of ``shard``."""

    position: int
    kind: str
    shard: int


@dataclass(frozen=True)
class StagingAction:
    """A planned cache decision with what the stager needs to execute it safely.

    ``step`` is the step of ``position``; for an eviction, ``after_step`` is the step of the victim's last
    use earlier in this trace (-1: none, then its last use in an earlier epoch gates it).
    """

    position: int
    kind: str
    shard: int
    step: int
    after_step: int = -1

    def event(self) -> CacheEvent:
        """The decision without its gate."""
        return CacheEvent(self.position, self.kind, self.shard)


def _check_capacity(capacity_bytes: int, shard_bytes: Any) -> np.ndarray:
    if capacity_bytes < 0:
        raise KaisokuError(f"cache capacity must be >= 0 bytes, got {capacity_bytes}")
    sizes = np.asarray(shard_bytes, dtype=np.int64)
    if (sizes < 0).any():
        raise KaisokuError("shard byte sizes must be >= 0")
    return sizes


def _step_bounds(steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each position, the first and one-past-last position of its step."""
    change = np.flatnonzero(np.diff(steps)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [steps.size]])
    group = np.repeat(np.arange(starts.size), ends - starts)
    return starts[group], ends[group]


def belady_evictions(
    trace: Trace | Iterable[int],
    capacity_bytes: int,
    shard_bytes: Any,
    *,
    initial: Sequence[int] = (),
    horizon: int | None = None,
) -> list[CacheEvent]:
    """Reference Belady simulator: the loads, evictions and bypasses of the first ``horizon`` accesses.

    Positions from ``horizon`` on are look-ahead only: they count as future uses, nothing is decided there.
    ``initial`` shards are resident at the start. Straightforward and slow (a scan per decision); the
    stager uses :func:`plan_staging`, which must agree with this.
    """
    tr = Trace.of(trace)
    sizes = _check_capacity(capacity_bytes, shard_bytes)
    shards = tr.shards.tolist()
    steps = tr.steps.tolist()
    stop = len(shards) if horizon is None else min(horizon, len(shards))
    resident: list[int] = list(dict.fromkeys(int(s) for s in initial))
    used = sum(int(sizes[s]) for s in resident)
    events: list[CacheEvent] = []

    def next_use_after(shard: int, position: int) -> int:
        for j in range(position + 1, len(shards)):
            if shards[j] == shard:
                return j
        return int(NEVER)

    for i in range(stop):
        shard = shards[i]
        if shard in resident:
            continue
        size = int(sizes[shard])
        in_step = {shards[j] for j in range(len(shards)) if steps[j] == steps[i]}
        pinned = sum(int(sizes[v]) for v in resident if v in in_step)
        if size + pinned > capacity_bytes:
            events.append(CacheEvent(i, "bypass", shard))
            continue
        candidates = sorted(
            (v for v in resident if v not in in_step), key=lambda v: (next_use_after(v, i), v), reverse=True
        )
        victims: list[int] = []
        freed = 0
        for victim in candidates:
            if used - freed + size <= capacity_bytes:
                break
            victims.append(victim)
            freed += int(sizes[victim])
        if victims and next_use_after(shard, i) >= next_use_after(victims[-1], i):
            events.append(CacheEvent(i, "bypass", shard))  # it is needed last: keep the residents
            continue
        for victim in victims:
            resident.remove(victim)
            events.append(CacheEvent(i, "evict", victim))
        used -= freed
        resident.append(shard)
        used += size
        events.append(CacheEvent(i, "load", shard))
    return events


@dataclass(frozen=True)
class StagingPlan:
    """What a stager does for one tier: actions in order, and the shards resident at the end."""

    actions: tuple[StagingAction, ...]
    resident: tuple[int, ...]

    def events(self) -> list[CacheEvent]:
        """The decisions, comparable with :func:`belady_evictions`."""
        return [a.event() for a in self.actions]


def plan_staging(
    trace: Trace | Iterable[int],
    capacity_bytes: int,
    shard_bytes: Any,
    *,
    initial: Sequence[int] = (),
    horizon: int | None = None,
) -> StagingPlan:
    """Belady plan of the first ``horizon`` accesses of ``trace`` (same decisions as the simulator).

    O(n log n): next uses precomputed, residents in a max-heap keyed by (next use, shard) with lazy
    deletion, shards of the current step set aside while choosing a victim.
    """
    tr = Trace.of(trace)
    sizes = _check_capacity(capacity_bytes, shard_bytes).tolist()
    shards = tr.shards.tolist()
    steps = tr.steps.tolist()
    stop = len(tr) if horizon is None else min(horizon, len(tr))
    nxt = next_uses(tr.shards).tolist()
    first_pos: dict[int, int] = {}
    for position, shard in enumerate(shards):
        first_pos.setdefault(shard, position)
    step_start, step_end = (b.tolist() for b in (_step_bounds(tr.steps) if len(tr) else (tr.steps, tr.steps)))

    # Insertion-ordered: the keys are the residents in load order, the values their next use.
    resident_next: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    used = 0
    for shard in dict.fromkeys(int(s) for s in initial):
        key = first_pos.get(shard, int(NEVER))
        resident_next[shard] = key
        heapq.heappush(heap, (-key, -shard))
        used += sizes[shard]
    last_step: dict[int, int] = {}
    actions: list[StagingAction] = []
    step_set: set[int] = set()
    step_set_start = -1
    pinned = 0  # bytes of resident shards used in the current step
    set_aside: list[tuple[int, int]] = []  # heap entries of pinned shards, back in the heap after the step

    for i in range(stop):
        shard = shards[i]
        step = steps[i]
        if step_start[i] != step_set_start:
            for entry in set_aside:
                heapq.heappush(heap, entry)
            set_aside = []
            step_set_start = step_start[i]
            step_set = set(shards[step_set_start : step_end[i]])
            pinned = sum(sizes[v] for v in step_set if v in resident_next)
        if shard in resident_next:
            resident_next[shard] = nxt[i]
            heapq.heappush(heap, (-nxt[i], -shard))
            last_step[shard] = step
            continue
        size = sizes[shard]
        if size + pinned > capacity_bytes:
            actions.append(StagingAction(i, "bypass", shard, step))
            last_step[shard] = step
            continue
        victims: list[tuple[int, int]] = []
        freed = 0
        while used - freed + size > capacity_bytes:
            neg_next, neg_shard = heapq.heappop(heap)
            if resident_next.get(-neg_shard) != -neg_next:
                continue  # stale heap entry
            if -neg_shard in step_set:
                set_aside.append((neg_next, neg_shard))
                continue
            victims.append((neg_next, neg_shard))
            freed += sizes[-neg_shard]
        if victims and nxt[i] >= -victims[-1][0]:
            # The incoming shard is needed last: keep the residents, serve this access from the source.
            for entry in victims:
                heapq.heappush(heap, entry)
            actions.append(StagingAction(i, "bypass", shard, step))
            last_step[shard] = step
            continue
        for _, neg_shard in victims:
            victim = -neg_shard
            del resident_next[victim]
            actions.append(StagingAction(i, "evict", victim, step, last_step.get(victim, -1)))
        used -= freed
        resident_next[shard] = nxt[i]
        heapq.heappush(heap, (-nxt[i], -shard))
        used += size
        pinned += size
        last_step[shard] = step
        actions.append(StagingAction(i, "load", shard, step))
    return StagingPlan(tuple(actions), tuple(resident_next))


def node_trace(
    order: np.ndarray,
    *,
    global_batch: int,
    world_size: int,
    ranks_per_node: int,
    node: int,
    shard_sizes: Any,
    start_step: int = 0,
    home_shards: np.ndarray | None = None,
) -> Trace:
    """The shards node ``node``'s ranks read, step by step, from ``start_step`` of an epoch's ``order``.

    Ranks are numbered contiguously per node, so the node reads columns
    ``node * R * b .. (node + 1) * R * b - 1`` of every global batch (``b = global_batch / world_size``).
    With ``home_shards`` (a boolean mask over shards; the ``partial`` shuffle), the node reads only
    samples of its home shards, and at ``start_step`` also the home samples that other nodes consume,
    which it sends them through the exchange.
    """
    sizes = as_shard_sizes(shard_sizes)
    if world_size % ranks_per_node or global_batch % world_size:
        raise KaisokuError(
            f"world size {world_size} must be a multiple of ranks per node {ranks_per_node}, and the global "
            f"batch {global_batch} a multiple of the world size"
        )
    width = ranks_per_node * (global_batch // world_size)
    steps = len(order) // global_batch
    grid = np.asarray(order[: steps * global_batch]).reshape(steps, global_batch)[start_step:]
    own = grid[:, node * width : (node + 1) * width]
    own_shards = shard_of(own, sizes)
    own_steps = np.broadcast_to(np.arange(start_step, steps, dtype=np.int64)[:, None], own.shape)
    step_parts = [own_steps.reshape(-1)]
    shard_parts = [own_shards.reshape(-1)]
    if home_shards is not None:
        mask = np.asarray(home_shards, dtype=bool)
        keep = mask[shard_parts[0]]
        step_parts = [step_parts[0][keep]]
        shard_parts = [shard_parts[0][keep]]
        others = shard_of(np.delete(grid, np.s_[node * width : (node + 1) * width], axis=1), sizes).reshape(
            -1
        )
        sent = others[mask[others]]
        step_parts.insert(0, np.full(sent.size, start_step, dtype=np.int64))
        shard_parts.insert(0, sent)
    all_steps = np.concatenate(step_parts)
    all_shards = np.concatenate(shard_parts)
    # One access per (step, shard), in order of first appearance.
    _, first = np.unique(all_steps * sizes.size + all_shards, return_index=True)
    first.sort()
    return Trace(all_steps[first].astype(np.int64), all_shards[first].astype(np.int64))


def sampler_trace_fn(sampler: EpochSampler, *, node: int, ranks_per_node: int) -> Callable[[int, int], Trace]:
    """``trace(epoch, start_step)`` of node ``node`` for a :class:`StagingSchedule`, from a sampler."""

    def trace(epoch: int, start_step: int) -> Trace:
        spec = sampler.spec_for(epoch)
        home = None
        if spec.name == "partial" and spec.num_nodes > 1 and sampler.layout_matches(epoch):
            home = sampler.partial_plan(epoch).home_of_shard == node
        return node_trace(
            sampler.epoch_order(epoch),
            global_batch=sampler.global_batch,
            world_size=sampler.world_size,
            ranks_per_node=ranks_per_node,
            node=node,
            shard_sizes=sampler.shard_sizes,
            start_step=start_step,
            home_shards=home,
        )

    return trace


# -------------------------------------------------------------------------------------------- runtime part


@dataclass(frozen=True)
class StagingSchedule:
    """What the node's stager stages: the node's trace per epoch, from where, for how many epochs.

    ``trace_of_epoch(epoch, start_step)`` gives the node's accesses (:func:`sampler_trace_fn`). Each epoch
    is planned with the next one as look-ahead, until ``num_epochs`` (None: until the cache is closed).
    """

    trace_of_epoch: Callable[[int, int], Trace]
    first_epoch: int = 0
    start_step: int = 0
    num_epochs: int | None = None


FLAG_RAM = 1
FLAG_LOCAL = 2
FLAG_PENDING = 4

_STATE_SLOT, _EPOCH_SLOT, _RAM_ON_SLOT, _LOCAL_ON_SLOT = range(4)
_STATE_IDLE, _STATE_RUNNING, _STATE_DONE, _STATE_FAILED = range(4)
COUNTERS = ("source_reads", "source_bytes", "ram_opens", "local_opens", "staged_bytes", "waits")
"""Per-process counters: source reads and bytes, shard files mapped per tier, bytes staged, waits."""
_EPOCH_SHIFT = 32
_COPY_CHUNK = 8 << 20


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: str | int) -> int:
    """A byte count from an int or a string such as ``"2GiB"``, ``"512MB"``, ``"1.5 GiB"`` or ``"0"``."""
    if isinstance(value, int):
        if value < 0:
            raise KaisokuError(f"byte size {value} is negative")
        return value
    text = value.strip().lower().replace(" ", "").replace("_", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _UNITS or amount < 0:
        raise KaisokuError(f"cannot read {value!r} as a byte size; write e.g. 2GiB, 512MB or 0")
    return int(amount * _UNITS[unit])


def progress_ticket(epoch: int, steps_done: int) -> int:
    """Progress as one integer: epoch in the high bits, steps finished in it in the low bits."""
    return (int(epoch) << _EPOCH_SHIFT) | int(steps_done)


def _shard_name(shard: int) -> str:
    return f"shard-{shard:06d}"


class NodeCache:
    """The node's tiered shard cache, as seen by one rank (local rank 0 also owns the stager).

    ``source_paths[s]`` is shard ``s``'s file on the source. ``ram_dir`` holds the control files and, when
    ``ram_capacity > 0``, the RAM tier (put it on /dev/shm); every rank of a node must pass the same
    ``ram_dir``, ``local_dir`` and ``run_token`` (a value unique to the run, e.g. the rendezvous id).
    Local rank 0 starts the stager with ``schedule`` (the other ranks' ``schedule`` is ignored); with both
    capacities 0 there is no stager and every read goes to the source. ``shard_bytes`` (file sizes, e.g.
    from the dataset's index) saves the stager a ``stat`` per shard on the source.
    ``shard_buffer`` is the dataset's ``shard_opener``; ``read_range`` serves a record alone.
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
        self._given_shard_bytes = None if shard_bytes is None else [int(b) for b in shard_bytes]
        if self._given_shard_bytes is not None and len(self._given_shard_bytes) != self.num_shards:
            raise KaisokuError(
                f"{len(self._given_shard_bytes)} shard sizes for {self.num_shards} shard paths"
            )
        self.stager_log: list[tuple[int, str, CacheEvent]] = []
        """(epoch, tier, event) of every action the stager executed (local rank 0 only)."""
        self._maps: OrderedDict[int, tuple[str, memoryview]] = OrderedDict()
        self._source_fds: OrderedDict[int, int] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._staged = threading.Condition()
        self._staged_epoch = -1
        self._stalled_on: int | None = None
        self._warned: set[str] = set()
        # Only the process that prepared the node (not a forked DataLoader worker) stages or deletes files.
        self._owner_pid = os.getpid() if local_rank == 0 else None
        if local_rank == 0:
            self._initialise()
            self._open_control()
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
        )

    # ---------------------------------------------------------------- control files

    @property
    def _ram_shards(self) -> Path:
        return self.ram_dir / "shards"

    @property
    def _local_shards(self) -> Path | None:
        return self.local_dir / "kaisoku-shards" if self.local_dir else None

    def _initialise(self) -> None:
        try:
            self.ram_dir.mkdir(parents=True, exist_ok=True)
            (self.ram_dir / "ready").unlink(missing_ok=True)
            shutil.rmtree(self._ram_shards, ignore_errors=True)
            self._ram_shards.mkdir()
            for name, dtype, count in self._control_layout():
                np.zeros(count, dtype=dtype).tofile(self.ram_dir / name)
        except OSError as error:
            raise KaisokuError(
                f"cannot prepare the node cache in {self.ram_dir} ({error.strerror or error}); "
                "set data.ram_dir to a writable directory (e.g. under /dev/shm)"
            ) from error
        local_on = 0
        if self._local_shards is not None and self.local_capacity > 0:
            try:
                shutil.rmtree(self._local_shards, ignore_errors=True)
                self._local_shards.mkdir(parents=True)
                local_on = 1
            except OSError as error:
                self._warn_tier_off(
                    "local", f"local cache {self.local_dir} is not writable ({error.strerror or error})"
                )
        control = np.memmap(self.ram_dir / "control.bin", dtype=np.int64, mode="r+")
        control[_RAM_ON_SLOT] = int(self.ram_capacity > 0)
        control[_LOCAL_ON_SLOT] = local_on
        control[_EPOCH_SLOT] = -1
        control.flush()
        del control
        next_load = np.memmap(self.ram_dir / "next_load.bin", dtype=np.int64, mode="r+")
        next_load[:] = NEVER
        next_load.flush()
        del next_load
        progress = np.memmap(self.ram_dir / "progress.bin", dtype=np.int64, mode="r+")
        progress[:] = -1
        progress.flush()
        del progress

    def _control_layout(self) -> list[tuple[str, Any, int]]:
        return [
            ("flags.bin", np.uint8, self.num_shards),
            ("next_load.bin", np.int64, self.num_shards),
            ("control.bin", np.int64, 4),
            ("progress.bin", np.int64, self.ranks_per_node),
            ("counters.bin", np.int64, (self.ranks_per_node + 1) * len(COUNTERS)),
        ]

    def _attach(self) -> None:
        ready = self.ram_dir / "ready"
        deadline = time.monotonic() + self.wait_timeout
        delay = 0.002
        while True:
            try:
                if ready.read_text() == self.run_token:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise KaisokuError(
                    f"the node cache in {self.ram_dir} was not prepared by local rank 0 within "
                    f"{self.wait_timeout:.0f} s; every rank of a node must use the same data.ram_dir and run"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        self._open_control()

    def _open_control(self) -> None:
        self._flags = np.memmap(self.ram_dir / "flags.bin", dtype=np.uint8, mode="r+")
        # Per shard, the progress ticket of the step of its next load that the stager has not executed.
        self._next_load = np.memmap(self.ram_dir / "next_load.bin", dtype=np.int64, mode="r+")
        self._control = np.memmap(self.ram_dir / "control.bin", dtype=np.int64, mode="r+")
        self._progress = np.memmap(self.ram_dir / "progress.bin", dtype=np.int64, mode="r+")
        self._counters = np.memmap(self.ram_dir / "counters.bin", dtype=np.int64, mode="r+").reshape(
            self.ranks_per_node + 1, len(COUNTERS)
        )

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
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.stager_log = []
        self._maps = OrderedDict()
        self._source_fds = OrderedDict()
        self._thread = None
        self._stop = threading.Event()
        self._staged = threading.Condition()
        self._staged_epoch = -1
        self._stalled_on: int | None = None
        self._warned = set()
        self._owner_pid = None
        self._attach()

    def _count(self, name: str, amount: int = 1, row: int | None = None) -> None:
        self._counters[self.local_rank if row is None else row, COUNTERS.index(name)] += amount

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
        self._progress[self.local_rank] = progress_ticket(epoch, steps_done)

    @staticmethod
    def _staged_tier(flags: int) -> str | None:
        if flags & FLAG_RAM:
            return "ram"
        if flags & FLAG_LOCAL:
            return "local"
        return None

    def _resolve(self, shard: int) -> str:
        """The tier holding ``shard`` now: ram, local, or source; waits while it is being staged.

        It waits while the stager has not planned this rank's epoch yet, while the shard's load is in the
        stager's open window, or while its next load is for a step this rank has reached (the plan serves
        that access from a tier). The stager writes a shard's flags before its next load and an epoch's
        next loads before publishing the epoch; read here in the opposite order, so a load that finishes
        between the reads is seen.
        """
        if not 0 <= shard < self.num_shards:
            raise KaisokuError(f"shard {shard} is outside 0..{self.num_shards - 1}")
        deadline: float | None = None
        delay = 0.001
        while True:
            tier = self._staged_tier(int(self._flags[shard]))
            if tier is not None:
                return tier
            running = int(self._control[_STATE_SLOT]) == _STATE_RUNNING
            mine = int(self._progress[self.local_rank])
            planning_behind = int(self._control[_EPOCH_SLOT]) < mine >> _EPOCH_SHIFT
            due = mine >= 0 and int(self._next_load[shard]) <= mine
            flags = int(self._flags[shard])
            tier = self._staged_tier(flags)
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

    def _tier_path(self, tier: str, shard: int) -> Path:
        if tier == "ram":
            return self._ram_shards / _shard_name(shard)
        if tier == "local" and self._local_shards is not None:
            return self._local_shards / _shard_name(shard)
        return self.source_paths[shard]

    def _cached_map(self, shard: int) -> memoryview | None:
        entry = self._maps.get(shard)
        if entry is None:
            return None
        tier, view = entry
        flags = int(self._flags[shard])
        still_there = (tier == "ram" and flags & FLAG_RAM) or (tier == "local" and flags & FLAG_LOCAL)
        if tier == "source" or still_there:
            self._maps.move_to_end(shard)
            return view
        del self._maps[shard]  # evicted from that tier: drop the mapping so its memory can be freed
        return None

    def _remember(self, shard: int, tier: str, view: memoryview) -> memoryview:
        self._maps[shard] = (tier, view)
        while len(self._maps) > self.max_open:
            self._maps.popitem(last=False)
        return view

    def _map_file(self, path: Path) -> memoryview:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))

    def shard_buffer(self, shard: int) -> memoryview:
        """The whole shard's bytes: mapped from RAM or local disk, else read from the source (counted)."""
        view = self._cached_map(shard)
        if view is not None:
            return view
        for _ in range(3):
            tier = self._resolve(shard)
            if tier == "source":
                return self._remember(shard, "source", memoryview(self._read_source(shard)))
            try:
                view = self._map_file(self._tier_path(tier, shard))
            except FileNotFoundError:
                continue  # evicted between the flag check and the open: look again
            self._count(f"{tier}_opens")
            return self._remember(shard, tier, view)
        return self._remember(shard, "source", memoryview(self._read_source(shard)))

    def _read_source(self, shard: int) -> bytes:
        data = self.source_paths[shard].read_bytes()
        self._count("source_reads")
        self._count("source_bytes", len(data))
        return data

    def read_range(self, shard: int, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of a shard: from a staged copy, else one source read (counted)."""
        view = self._cached_map(shard)
        if view is None and self._resolve(shard) != "source":
            view = self.shard_buffer(shard)
        if view is not None:
            if offset + length > len(view):
                raise KaisokuError(
                    f"{self.source_paths[shard]}: record at {offset}+{length} is past the shard's end"
                )
            return bytes(view[offset : offset + length])
        fd = self._source_fds.get(shard)
        if fd is None:
            fd = os.open(self.source_paths[shard], os.O_RDONLY)
            self._source_fds[shard] = fd
            while len(self._source_fds) > 16:
                os.close(self._source_fds.popitem(last=False)[1])
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise KaisokuError(
                f"{self.source_paths[shard]}: record at {offset}+{length} is past the shard's end"
            )
        self._count("source_reads")
        self._count("source_bytes", length)
        return data

    def node_stats(self) -> dict[str, int]:
        """Counters summed over the node's readers and its stager (source reads, bytes, tier hits...)."""
        totals = np.asarray(self._counters).sum(axis=0)
        return {name: int(totals[i]) for i, name in enumerate(COUNTERS)}

    def stats(self) -> dict[str, int]:
        """This rank's reader counters."""
        row = np.asarray(self._counters[self.local_rank])
        return {name: int(row[i]) for i, name in enumerate(COUNTERS)}

    def tiers_enabled(self) -> dict[str, bool]:
        """Which tiers are staging (a full or unwritable tier switches itself off)."""
        return {"ram": bool(self._control[_RAM_ON_SLOT]), "local": bool(self._control[_LOCAL_ON_SLOT])}

    # ---------------------------------------------------------------- stager (local rank 0)

    def _start_staging(self, schedule: StagingSchedule) -> None:
        if self.ram_capacity == 0 and self.local_capacity == 0:
            return
        sizes = self._given_shard_bytes or [os.stat(p).st_size for p in self.source_paths]
        self.shard_bytes = np.array(sizes, dtype=np.int64)
        self._control[_STATE_SLOT] = _STATE_RUNNING
        self._thread = threading.Thread(
            target=self._stage,
            args=(schedule.trace_of_epoch, schedule.first_epoch, schedule.start_step, schedule.num_epochs),
            name="kaisoku-stager",
            daemon=True,
        )
        self._thread.start()

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
        stager_row = self.ranks_per_node
        # Per tier, the resident shards in load order (dicts as ordered sets).
        resident: dict[str, dict[int, None]] = {"local": {}, "ram": {}}
        last_use: dict[int, int] = {}
        state = _STATE_DONE
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
            state = _STATE_FAILED
            log.exception("the node's stager failed; training goes on reading from %s", "the source")
        finally:
            self._control[_STATE_SLOT] = state
            np.bitwise_and(self._flags, 0xFF & ~FLAG_PENDING, out=self._flags)
            self._next_load[:] = NEVER
            with self._staged:
                self._staged.notify_all()

    def _tier_on(self, tier: str) -> bool:
        return bool(self._control[_RAM_ON_SLOT if tier == "ram" else _LOCAL_ON_SLOT])

    def _set_flags(self, shard: int, resident: dict[str, dict[int, None]], pending: dict[int, int]) -> None:
        flags = (FLAG_RAM if shard in resident["ram"] else 0) | (
            FLAG_LOCAL if shard in resident["local"] else 0
        )
        if not flags and pending.get(shard, 0) > 0:
            flags = FLAG_PENDING
        self._flags[shard] = flags

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
        capacities = {"local": self.local_capacity, "ram": self.ram_capacity}
        tiers = [t for t in ("local", "ram") if capacities[t] > 0 and self._tier_on(t)]
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
        window_end = 0
        for index, (tier, action) in enumerate(actions):
            if self._stop.is_set():
                return False
            if index >= window_end:
                if action.kind == "evict" and self._tier_on(tier):
                    # Readers of this epoch must see it before the stager waits for their progress.
                    self._control[_EPOCH_SLOT] = epoch
                    if not self._wait_progress(self._gate(epoch, action, last_use)):
                        return False
                window_end = self._open_window(actions, index, epoch, last_use, resident, pending)
                self._control[_EPOCH_SLOT] = epoch
            if not self._tier_on(tier):
                continue
            if action.kind == "evict":
                self._tier_path(tier, action.shard).unlink(missing_ok=True)
                del resident[tier][action.shard]
            elif action.kind == "load":
                pending[action.shard] -= 1
                loads[action.shard].popleft()
                if self._load(tier, action.shard, resident, stager_row):
                    resident[tier][action.shard] = None
                else:
                    # The tier is full or unwritable: forget its loads so that no reader waits on them.
                    self._control[_RAM_ON_SLOT if tier == "ram" else _LOCAL_ON_SLOT] = 0
                    stale = set(pending)
                    pending.clear()
                    for later_tier, later in actions[index + 1 : window_end]:
                        if later.kind == "load" and self._tier_on(later_tier):
                            pending[later.shard] = pending.get(later.shard, 0) + 1
                    for shard in stale | set(pending):
                        self._set_flags(shard, resident, pending)
                    loads = self._publish_next_loads(epoch, actions, index + 1, set(loads))
                    continue
            self._set_flags(action.shard, resident, pending)
            if action.kind == "load":
                # After the flags: a reader that sees the next load moved on also sees the shard staged.
                queue = loads[action.shard]
                self._next_load[action.shard] = queue[0] if queue else NEVER
            self.stager_log.append((epoch, tier, action.event()))
        self._control[_EPOCH_SLOT] = epoch
        return True

    def _publish_next_loads(
        self, epoch: int, actions: Sequence[tuple[str, StagingAction]], start: int, previous: set[int]
    ) -> dict[int, deque[int]]:
        """Per shard, the tickets of its loads in ``actions[start:]`` (tiers on); the first one published.

        Shards in ``previous`` that have no load left are published as never loaded again.
        """
        loads: dict[int, deque[int]] = {}
        for tier, action in actions[start:]:
            if action.kind == "load" and self._tier_on(tier):
                loads.setdefault(action.shard, deque()).append(progress_ticket(epoch, action.step))
        for shard in previous - set(loads):
            self._next_load[shard] = NEVER
        for shard, tickets in loads.items():
            self._next_load[shard] = tickets[0]
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
        slowest = int(np.asarray(self._progress).min())
        end = start
        while end < len(actions):
            tier, action = actions[end]
            if not self._tier_on(tier):
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
            capacity = self.ram_capacity if tier == "ram" else self.local_capacity
            self._warn_once(
                f"thrash-{tier}",
                f"the {tier} cache ({capacity} bytes) is too small for this order: epoch {epoch} stages "
                f"{loaded / max(needed, 1):.1f}x the {needed} bytes the node reads and leaves "
                f"{100 * bypassed:.0f}% of its shard accesses to the source; raise the capacity or use "
                "data.shuffle=block or partial, whose working set is smaller",
            )

    def _wait_progress(self, gate: int) -> bool:
        """Wait until every rank of the node has passed ticket ``gate``; False if the cache is closing."""
        if gate < 0 or int(np.asarray(self._progress).min()) > gate:
            return True
        with self._staged:
            self._stalled_on = gate + 1
            self._staged.notify_all()
        try:
            delay = 0.001
            while int(np.asarray(self._progress).min()) <= gate:
                if self._stop.wait(delay):
                    return False
                delay = min(delay * 2, 0.02)
            return True
        finally:
            with self._staged:
                self._stalled_on = None

    def _load(self, tier: str, shard: int, resident: dict[str, dict[int, None]], stager_row: int) -> bool:
        """Copy one whole shard into ``tier``; False (after one warning) if the tier cannot take it.

        A failure to read the source is raised (it is not the cache's to hide); a failure to write the
        tier switches the tier off.
        """
        from_local = tier == "ram" and shard in resident["local"]
        source = self._tier_path("local", shard) if from_local else self.source_paths[shard]
        target = self._tier_path(tier, shard)
        tmp = target.with_name(f".{target.name}.tmp")
        copied = 0
        with open(source, "rb") as src:
            try:
                dst = open(tmp, "wb")  # closed by the with-block below
            except OSError as error:
                return self._tier_failed(tier, error)
            try:
                with dst:
                    while chunk := src.read(_COPY_CHUNK):
                        dst.write(chunk)
                        copied += len(chunk)
                os.replace(tmp, target)
            except OSError as error:
                tmp.unlink(missing_ok=True)
                return self._tier_failed(tier, error)
        if not from_local:
            self._count("source_reads", 1, stager_row)
            self._count("source_bytes", copied, stager_row)
        self._count("staged_bytes", copied, stager_row)
        return True

    def _tier_failed(self, tier: str, error: OSError) -> bool:
        where = self.ram_dir if tier == "ram" else self.local_dir
        what = "full" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "not writable"
        self._warn_tier_off(tier, f"{tier} cache {where} is {what} ({error.strerror or error})")
        return False

    def close(self, remove_files: bool = True) -> None:
        """Stop the stager and drop mappings; local rank 0 also deletes the staged files (by default).

        Call it on every rank of the node after a barrier, so that no rank still reads a staged file.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        self._maps.clear()
        for fd in self._source_fds.values():
            os.close(fd)
        self._source_fds.clear()
        if remove_files and self._owner_pid == os.getpid():
            shutil.rmtree(self._ram_shards, ignore_errors=True)
            if self._local_shards is not None:
                shutil.rmtree(self._local_shards, ignore_errors=True)
