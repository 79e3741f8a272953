"""The pure staging planner of the node cache: which shards each tier holds when, in future order.

No files, threads or torch here: every function is a pure function of its inputs, tested alone.

Tiered shard cache: source (any path) -> node-local directory -> RAM, staged ahead by one stager per node.

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

:class:`CacheSettings` are the config's cache settings, checked on construction.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kaisoku.data.order.shuffle import as_shard_sizes, shard_of
from kaisoku.errors import ConfigError, KaisokuError

if TYPE_CHECKING:
    from kaisoku.data.order.sampler import EpochSampler

NEVER = np.iinfo(np.int64).max
"""Next-use position of a shard that is not used again in the trace."""


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
        if spec.partitioned and sampler.layout_matches(epoch):
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


@dataclass(kw_only=True)
class CacheSettings:
    """Where the node cache stages shards (``data.local_cache`` etc.); all off by default.

    Capacities are bytes (the config parses strings such as ``"2GiB"`` with
    :func:`kaisoku.units.parse_bytes`). Checked on construction: a wrong value raises a one-line
    :class:`ConfigError` naming the config key.
    """

    local_dir: str = ""
    """Node-local directory for the disk tier (``data.local_cache``); empty: no disk tier."""
    local_capacity: int = 0
    """Bytes the disk tier may use (``data.local_capacity``); 0 with a ``local_dir``: the free space of
    its file system minus a margin (:func:`kaisoku.data.node_cache.tier_dirs.auto_local_capacity`)."""
    ram_dir: str = "/dev/shm/kaisoku"
    """Directory for the RAM tier and the cache's control files (``data.ram_dir``)."""
    ram_capacity: int = 0
    """Bytes of RAM for staged shards (``data.ram_capacity``)."""

    def __post_init__(self) -> None:
        for key, value in (("local_capacity", self.local_capacity), ("ram_capacity", self.ram_capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"data.{key} must be a byte count >= 0 (got {value!r})")
        if self.local_capacity > 0 and not self.local_dir:
            raise ConfigError(
                "data.local_capacity needs data.local_cache, the node-local directory to stage into"
            )
        if self.ram_capacity > 0 and not self.ram_dir:
            raise ConfigError("data.ram_capacity needs data.ram_dir, the directory of the RAM tier")

    @property
    def enabled(self) -> bool:
        """True when any tier has a capacity, or a local directory (whose capacity is then its free space)."""
        return self.local_capacity > 0 or self.ram_capacity > 0 or bool(self.local_dir)
