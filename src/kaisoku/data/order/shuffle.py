"""Epoch sample orders: pure numpy functions of (shard sizes, seed, epoch, world layout).

Samples are numbered globally in shard order: shard ``s`` holds the indices
``offsets[s] .. offsets[s + 1] - 1`` where ``offsets = shard_offsets(shard_sizes)``.

Three shuffles, chosen by name from :data:`SHUFFLES`:

``global``
    A uniform random permutation of every sample. Any sample may follow any other, so every rank reads
    from every shard each epoch: best randomness, needs random access to the whole dataset (a node-local
    cache that holds it, or a file system that serves random reads).

``block``
    The sequential-friendly order. Shards are permuted, the permuted list is cut into blocks of
    ``block_shards`` shards, and the samples of one block are shuffled together (one block is held in
    memory at a time). With ``buffer_size > 0`` a sliding window of that many samples then mixes samples
    across block boundaries: each sample moves forward by less than ``buffer_size`` positions, so a
    reader needs at most one block plus ``buffer_size`` samples in memory.

``partial``
    Partial local shuffling with exchange. Every node owns a fixed partition of the shards (a seed-keyed
    assignment, the same in every epoch, so that its node-local cache keeps it). Each epoch a fraction
    ``exchange`` (Q) of every node's samples is put in a common pool, the pool is permuted and dealt back
    to the nodes so that their sizes come out as equal as possible, and each node trains on a random
    permutation of what it then holds. Q = 0 is a purely local shuffle; Q = 1 makes each node's set a
    uniformly random share of the dataset, i.e. the partition of a global shuffle. The samples a node
    receives travel between ranks as bytes (:mod:`kaisoku.data.order.exchange`), never from the source.

How each one depends on the world:

- ``global`` and ``block`` depend on (shard sizes, seed, epoch) only. The sampler slices every global
  batch by rank, so the samples of a step, and the run's data, are the same for any world size.
- ``partial`` depends on the node count too, by nature: the partition, the exchange and the local orders
  are those of ``num_nodes`` nodes, and node ``n`` fills columns ``n * B / N .. (n + 1) * B / N - 1`` of
  every global batch of size ``B``. It does not depend on the number of ranks per node: the ranks of a
  node (contiguous rank numbers, as torchrun and Slurm assign them) split the node's share of each global
  batch. Changing the node count changes the data from the next epoch on; a run resumed mid-epoch on
  another node count finishes the epoch in the saved order (see :mod:`kaisoku.data.order.sampler`).

Every order is trimmed by :func:`epoch_order` to whole global batches: the tail shorter than one global
batch is dropped, so every rank gets the same number of batches.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kaisoku.errors import ConfigError, KaisokuError

# Independent random streams: each use of randomness has its own tag in the seed sequence.
_TAG_GLOBAL = 1
_TAG_BLOCK_SHARDS = 2
_TAG_BLOCK_SAMPLES = 3
_TAG_BUFFER = 4
_TAG_PARTITION = 5
_TAG_EXCHANGE = 6
_TAG_NODE_ORDER = 7


def _rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator keyed by explicit integers only (never time or process id)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), *map(int, keys)])))


def _check_seed_epoch(seed: int, epoch: int) -> None:
    if int(seed) < 0:
        raise KaisokuError(f"seed {seed} is negative; use a seed >= 0")
    if int(epoch) < 0:
        raise KaisokuError(f"epoch {epoch} is negative")


def as_shard_sizes(shard_sizes: Any) -> np.ndarray:
    """Validate ``shard_sizes`` (samples per shard) and return it as a 1-D int64 array."""
    sizes = np.asarray(shard_sizes)
    if sizes.ndim != 1 or sizes.size == 0:
        raise KaisokuError(
            f"shard sizes must be a non-empty 1-D list of sample counts, got shape {sizes.shape}"
        )
    if not np.issubdtype(sizes.dtype, np.integer):
        raise KaisokuError(f"shard sizes must be integers, got dtype {sizes.dtype}")
    sizes = sizes.astype(np.int64)
    if (sizes < 0).any():
        raise KaisokuError(f"shard {int(np.argmin(sizes))} has a negative sample count")
    if sizes.sum() == 0:
        raise KaisokuError("the dataset has no samples (every shard is empty)")
    return sizes


def shard_offsets(shard_sizes: Any) -> np.ndarray:
    """First global sample index of each shard, plus the total: length ``num_shards + 1``."""
    sizes = as_shard_sizes(shard_sizes)
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


def shard_of(indices: np.ndarray, shard_sizes: Any) -> np.ndarray:
    """The shard holding each global sample index."""
    offsets = shard_offsets(shard_sizes)
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= offsets[-1]):
        raise KaisokuError(f"sample index out of range 0..{offsets[-1] - 1}")
    return np.searchsorted(offsets, idx, side="right").astype(np.int64) - 1


def _samples_of_shards(shards: np.ndarray, shard_sizes: np.ndarray) -> np.ndarray:
    """Global sample indices of ``shards``, shard after shard, each shard's samples in file order."""
    offsets = shard_offsets(shard_sizes)
    lengths = shard_sizes[shards]
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    run_starts = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=run_starts[1:])
    return np.repeat(offsets[shards] - run_starts, lengths) + np.arange(total, dtype=np.int64)


def global_order(shard_sizes: Any, seed: int, epoch: int, *, unpacked: bool = False) -> np.ndarray:
    """``global`` shuffle: a uniform random permutation of all samples, keyed by (seed, epoch).

    ``unpacked`` selects the image-folder key, (seed, epoch) without the packed stream's tag.
    """
    _check_seed_epoch(seed, epoch)
    total = int(as_shard_sizes(shard_sizes).sum())
    rng = _rng(seed, epoch) if unpacked else _rng(seed, epoch, _TAG_GLOBAL)
    return rng.permutation(total).astype(np.int64)


def sequential_order(shard_sizes: Any) -> np.ndarray:
    """No shuffle: samples in file order (the reference point of the quality metric)."""
    return np.arange(int(as_shard_sizes(shard_sizes).sum()), dtype=np.int64)


def window_shuffle(order: np.ndarray, window: int, rng: np.random.Generator) -> np.ndarray:
    """Mix ``order`` inside a sliding window: sort by ``position + U[0, window)``.

    A sample moves forward by less than ``window`` positions, so a reader holding ``window`` samples can
    produce this order from ``order``. ``window <= 1`` returns ``order`` unchanged.
    """
    if window <= 1 or order.size < 2:
        return order
    keys = np.arange(order.size, dtype=np.float64) + rng.random(order.size) * window
    return order[np.argsort(keys, kind="stable")]


def block_order(
    shard_sizes: Any, seed: int, epoch: int, *, block_shards: int, buffer_size: int = 0
) -> np.ndarray:
    """``block`` shuffle: permuted shards, cut into blocks of ``block_shards``, shuffled within each block.

    With ``buffer_size > 0`` a sliding window of that many samples (:func:`window_shuffle`) then mixes
    across block boundaries. ``block_shards = 1`` with ``buffer_size = 0`` reads shard after shard with a
    within-shard shuffle; ``block_shards >= num_shards`` is a global shuffle.
    """
    _check_seed_epoch(seed, epoch)
    sizes = as_shard_sizes(shard_sizes)
    if block_shards < 1:
        raise KaisokuError(f"block_shards must be >= 1, got {block_shards}")
    if buffer_size < 0:
        raise KaisokuError(f"buffer_size must be >= 0, got {buffer_size}")
    shard_perm = _rng(seed, epoch, _TAG_BLOCK_SHARDS).permutation(sizes.size).astype(np.int64)
    samples = _samples_of_shards(shard_perm, sizes)
    block_of_sample = np.repeat(np.arange(sizes.size, dtype=np.int64) // block_shards, sizes[shard_perm])
    # Sorting by block + U[0, 1) keeps blocks in place and shuffles the samples inside each block.
    keys = block_of_sample + _rng(seed, epoch, _TAG_BLOCK_SAMPLES).random(samples.size)
    order = samples[np.argsort(keys, kind="stable")]
    return window_shuffle(order, buffer_size, _rng(seed, epoch, _TAG_BUFFER))


def node_partition(shard_sizes: Any, seed: int, num_nodes: int) -> np.ndarray:
    """The home node of each shard for ``partial``: fixed for a run (keyed by seed, not epoch).

    Shards are taken in a seed-keyed random order and each goes to the node holding the fewest samples so
    far (ties to the lowest node id), which balances the partitions to within one shard.
    """
    sizes = as_shard_sizes(shard_sizes)
    if num_nodes < 1:
        raise KaisokuError(f"num_nodes must be >= 1, got {num_nodes}")
    if sizes.size < num_nodes:
        raise KaisokuError(
            f"partial shuffle needs at least one shard per node: {sizes.size} shards for {num_nodes} nodes; "
            "pack the dataset into more (smaller) shards or use data.shuffle=global"
        )
    home = np.empty(sizes.size, dtype=np.int64)
    heap = [(0, node) for node in range(num_nodes)]
    for shard in _rng(seed, 0, _TAG_PARTITION).permutation(sizes.size):
        load, node = heapq.heappop(heap)
        home[shard] = node
        heapq.heappush(heap, (load + int(sizes[shard]), node))
    return home


def _water_fill(kept: np.ndarray, pool: int) -> np.ndarray:
    """How many pool samples each node receives so that ``kept + received`` is as level as possible."""
    order = np.argsort(kept, kind="stable")
    sorted_kept = kept[order].astype(np.int64)
    received = np.zeros(kept.size, dtype=np.int64)
    # Find the largest level L with sum(max(0, L - kept)) <= pool, fill to L, then share the rest by one.
    remaining = pool
    level = int(sorted_kept[0])
    count = 1
    while count <= kept.size:
        next_level = int(sorted_kept[count]) if count < kept.size else None
        if next_level is None or (next_level - level) * count > remaining:
            raise_by = remaining // count
            level += raise_by
            remaining -= raise_by * count
            break
        remaining -= (next_level - level) * count
        level = next_level
        count += 1
    filled = np.maximum(level - sorted_kept, 0)
    # The first `remaining` of the nodes at the level get one more, lowest kept first.
    at_level = np.flatnonzero(sorted_kept <= level)[:remaining]
    filled[at_level] += 1
    received[order] = filled
    return received


@dataclass(frozen=True)
class PartialPlan:
    """One epoch of the ``partial`` shuffle: what each node trains on, in which order.

    ``node_orders[n]`` is node ``n``'s order, trimmed to ``steps * node_batch`` samples;
    ``home_of_shard[s]`` the node whose local storage holds shard ``s``.
    """

    num_nodes: int
    global_batch: int
    steps: int
    home_of_shard: np.ndarray
    node_orders: tuple[np.ndarray, ...]

    @property
    def node_batch(self) -> int:
        """Samples each node contributes to every global batch."""
        return self.global_batch // self.num_nodes

    def global_order(self) -> np.ndarray:
        """The node orders interleaved so that global batch ``t`` is node 0's batch ``t``, node 1's, ..."""
        stacked = np.stack([o.reshape(self.steps, self.node_batch) for o in self.node_orders], axis=1)
        return stacked.reshape(-1).astype(np.int64)


def partial_plan(
    shard_sizes: Any,
    seed: int,
    epoch: int,
    *,
    num_nodes: int,
    exchange: float,
    global_batch: int,
) -> PartialPlan:
    """``partial`` shuffle for one epoch: local partitions, a fraction ``exchange`` pooled and re-dealt.

    Node ``n``'s home set is the samples of its shards (:func:`node_partition`). A random
    ``round(exchange * |home_n|)`` of them go to the pool; the permuted pool is dealt back so that node
    sizes come out level (:func:`_water_fill`); each node's set is then permuted. Every node runs
    ``steps = min_n |set_n| // (global_batch / num_nodes)`` steps; the rest of each node's set is this
    epoch's dropped tail.
    """
    _check_seed_epoch(seed, epoch)
    sizes = as_shard_sizes(shard_sizes)
    if not 0.0 <= exchange <= 1.0:
        raise KaisokuError(f"exchange fraction must be in [0, 1], got {exchange}")
    if global_batch < 1 or global_batch % num_nodes:
        raise KaisokuError(
            f"global batch {global_batch} must be a positive multiple of the node count {num_nodes} "
            "for the partial shuffle"
        )
    home_of_shard = node_partition(sizes, seed, num_nodes)
    homes = [_samples_of_shards(np.flatnonzero(home_of_shard == n), sizes) for n in range(num_nodes)]
    rng = _rng(seed, epoch, _TAG_EXCHANGE)
    sets: list[np.ndarray] = homes
    if exchange > 0.0 and num_nodes > 1:
        kept: list[np.ndarray] = []
        sent: list[np.ndarray] = []
        for home in homes:
            perm = rng.permutation(home.size)
            count = int(round(exchange * home.size))
            sent.append(home[perm[:count]])
            kept.append(np.sort(home[perm[count:]]))
        pool = rng.permutation(np.concatenate(sent))
        received = _water_fill(np.array([k.size for k in kept]), pool.size)
        starts = np.concatenate([[0], np.cumsum(received)])
        sets = [np.concatenate([kept[n], pool[starts[n] : starts[n + 1]]]) for n in range(num_nodes)]
    node_batch = global_batch // num_nodes
    steps = min(s.size for s in sets) // node_batch
    orders = tuple(
        _rng(seed, epoch, _TAG_NODE_ORDER, n).permutation(s)[: steps * node_batch].astype(np.int64)
        for n, s in enumerate(sets)
    )
    return PartialPlan(num_nodes, global_batch, steps, home_of_shard, orders)


@dataclass(frozen=True, kw_only=True)
class ShuffleSpec:
    """Which shuffle and its parameters: the part of the data config that decides the sample order.

    It checks itself on construction and raises :class:`ConfigError` naming the config key. Code outside
    this module asks it what the order needs (:attr:`depends_on_nodes`, :attr:`partitioned`,
    :attr:`exchanges`, :attr:`needs_shards`) rather than comparing shuffle names.
    """

    name: str = "global"
    """One of ``SHUFFLES``: global, block or partial."""
    block_shards: int = 8
    """block: shards whose samples are shuffled together (held in memory at once)."""
    buffer_size: int = 0
    """block: sliding-window size in samples that mixes across block boundaries (0: none)."""
    exchange: float = 0.0
    """partial: fraction Q of each node's samples exchanged with other nodes every epoch."""
    num_nodes: int = 1
    """partial: node count the partition is built for (the world's node count)."""
    unpacked: bool = False
    """global: the order of an image folder read file by file, keyed by (seed, epoch) alone; a packed
    dataset's global order is keyed by (seed, epoch) and its own stream tag. Both keys are kept so that
    every run replays the order it always had."""

    def __post_init__(self) -> None:
        if self.name not in SHUFFLES:
            raise ConfigError(
                f"data.shuffle must be one of {', '.join(sorted(SHUFFLES))} (got {self.name!r})"
            )
        if self.block_shards < 1:
            raise ConfigError(f"data.block_shards must be >= 1 (got {self.block_shards})")
        if self.buffer_size < 0:
            raise ConfigError(f"data.buffer_size must be >= 0 (got {self.buffer_size})")
        if not 0.0 <= self.exchange <= 1.0:
            raise ConfigError(f"data.exchange must be in [0, 1] (got {self.exchange})")
        if self.exchange > 0.0 and self.name != "partial":
            raise ConfigError(f"data.exchange needs --data.shuffle partial (got {self.name})")
        if self.num_nodes < 1:
            raise ConfigError(f"the node count must be >= 1 (got {self.num_nodes})")
        if self.unpacked and self.needs_shards:
            raise ConfigError(
                f"data.shuffle {self.name} needs a packed dataset; an image folder is global only"
            )

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for a state dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ShuffleSpec:
        """Inverse of :meth:`as_dict` (a state saved before ``unpacked`` existed reads as packed)."""
        return cls(**values)

    @property
    def depends_on_nodes(self) -> bool:
        """Whether the order depends on the node count (only ``partial`` does)."""
        return self.name == "partial"

    @property
    def needs_shards(self) -> bool:
        """Whether the order is built from shards (block, partial): only a packed dataset has them."""
        return self.name != "global"

    @property
    def partitioned(self) -> bool:
        """Whether each node reads only its home shards (``partial`` over several nodes)."""
        return self.depends_on_nodes and self.num_nodes > 1

    @property
    def exchanges(self) -> bool:
        """Whether epochs exchange samples between nodes (``partial``, Q > 0, several nodes)."""
        return self.partitioned and self.exchange > 0.0


ShuffleFn = Callable[[np.ndarray, int, int, ShuffleSpec, int], np.ndarray]


def _global(
    shard_sizes: np.ndarray, seed: int, epoch: int, spec: ShuffleSpec, global_batch: int
) -> np.ndarray:
    return global_order(shard_sizes, seed, epoch, unpacked=spec.unpacked)


def _block(
    shard_sizes: np.ndarray, seed: int, epoch: int, spec: ShuffleSpec, global_batch: int
) -> np.ndarray:
    return block_order(shard_sizes, seed, epoch, block_shards=spec.block_shards, buffer_size=spec.buffer_size)


def _partial(
    shard_sizes: np.ndarray, seed: int, epoch: int, spec: ShuffleSpec, global_batch: int
) -> np.ndarray:
    plan = partial_plan(
        shard_sizes, seed, epoch, num_nodes=spec.num_nodes, exchange=spec.exchange, global_batch=global_batch
    )
    return plan.global_order()


SHUFFLES: dict[str, ShuffleFn] = {"global": _global, "block": _block, "partial": _partial}
"""Shuffle name -> ``fn(shard_sizes, seed, epoch, spec, global_batch) -> order`` (int64 sample indices)."""


def epoch_order(shard_sizes: Any, seed: int, epoch: int, spec: ShuffleSpec, global_batch: int) -> np.ndarray:
    """The epoch's global order, trimmed to whole global batches (the short tail is dropped)."""
    sizes = as_shard_sizes(shard_sizes)
    if global_batch < 1:
        raise KaisokuError(f"global batch must be >= 1, got {global_batch}")
    total = int(sizes.sum())
    if total < global_batch:
        raise KaisokuError(
            f"the dataset has {total} samples, fewer than one global batch of {global_batch}; "
            "lower data.global_batch or use a larger dataset"
        )
    order = SHUFFLES[spec.name](sizes, seed, epoch, spec, global_batch)
    steps = order.size // global_batch
    if steps == 0:
        raise KaisokuError(
            f"the {spec.name} shuffle leaves no whole global batch of {global_batch} this epoch; "
            "lower data.global_batch"
        )
    return order[: steps * global_batch]
