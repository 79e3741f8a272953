"""A rank's view of each epoch: its batches of sample indices, and exact mid-epoch resume.

One sampler serves both data paths: a packed dataset (its shards and any shuffle) and an image folder
(one "shard" of files, the global shuffle keyed as :attr:`ShuffleSpec.unpacked` says). It is what the
trainer drives (``steps_per_epoch``, ``set_epoch``, ``state_dict``, ``set_shard``);
:class:`KeyedMicroBatches` turns it into a DataLoader ``batch_sampler`` of ``(epoch, index)`` keys.

Every global batch of ``B`` samples is cut into ``world_size`` contiguous slices of ``B / world_size``;
rank ``r`` takes slice ``r`` (:func:`rank_batches`). With contiguous rank numbers per node, node ``n``'s
ranks together take the node's columns of each global batch, which is what the ``partial`` shuffle fills.

Resume: the state is ``(epoch, position, seed, world size, shuffle spec, dataset fingerprint)``, with
``position`` the samples consumed in the epoch over all ranks, a whole number of global batches. The rest
of the epoch is ``order[position:]`` of the saved epoch's order; a sampler with another world size slices
that rest with its own world size, so together its ranks consume exactly the samples the old world had
left: none lost, none repeated. Since the global batch stays fixed, even the content of each remaining
step is unchanged. For ``partial`` the saved epoch keeps the saved node count (its order depends on it);
the new node count takes over at the next epoch.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

from kaisoku.data.order.shuffle import PartialPlan, ShuffleSpec, as_shard_sizes, epoch_order, partial_plan
from kaisoku.errors import ConfigError, KaisokuError

STATE_VERSION = 1


def check_batch_split(global_batch: int, world_size: int, spec: ShuffleSpec, micro_batches: int = 1) -> None:
    """One-line ConfigError unless the global batch splits evenly over the ranks (and over the nodes for the
    partial shuffle) and each rank's part into ``micro_batches`` (``train.grad_accum``). The one home of
    these checks: the run plan calls it before launch, the sampler keeps it as its invariant."""
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if global_batch < 1 or global_batch % world_size:
        raise ConfigError(
            f"data.global_batch {global_batch} is not a multiple of the world size {world_size}: "
            f"{global_batch} / {world_size} = {global_batch / world_size:g} samples per rank; "
            "choose a global batch divisible by the number of ranks"
        )
    if spec.depends_on_nodes and world_size % spec.num_nodes:
        raise ConfigError(
            f"world size {world_size} is not a multiple of the node count {spec.num_nodes}; "
            "every node needs the same number of ranks for the partial shuffle"
        )
    per_rank = global_batch // world_size
    if micro_batches < 1 or per_rank % micro_batches:
        raise ConfigError(
            f"train.grad_accum {micro_batches} does not divide the {per_rank} samples per rank "
            f"(data.global_batch {global_batch} / {world_size} ranks)"
        )


def rank_batches(
    order: np.ndarray, global_batch: int, rank: int, world_size: int, start_step: int = 0
) -> np.ndarray:
    """Rank ``rank``'s batches of ``order`` from step ``start_step``: shape ``(steps, B / world_size)``."""
    if global_batch % world_size or not 0 <= rank < world_size:
        raise KaisokuError(
            f"rank {rank} of world size {world_size} cannot split a global batch of {global_batch}"
        )
    local = global_batch // world_size
    steps = len(order) // global_batch
    grid = np.asarray(order[: steps * global_batch]).reshape(steps, global_batch)
    return grid[start_step:, rank * local : (rank + 1) * local]


def shards_digest(shard_sizes: Any) -> str:
    """A short fingerprint of the dataset's shard layout (samples per shard)."""
    sizes = as_shard_sizes(shard_sizes)
    return hashlib.sha256(sizes.astype("<i8").tobytes()).hexdigest()[:16]


class EpochSampler:
    """Rank ``rank``'s batches of sample indices, epoch by epoch, resumable mid-epoch on any world size.

    Iterating yields the rank's remaining batches of the current epoch as lists of global sample indices;
    ``set_epoch`` moves to another epoch. Every rank gets the same number of batches. ``state_dict`` is
    the same on every rank, so rank 0 saves it. ``micro_batches`` is the number of equal parts each rank
    batch is cut into (gradient accumulation; see :class:`KeyedMicroBatches`).
    """

    def __init__(
        self,
        shard_sizes: Any,
        *,
        global_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: ShuffleSpec | None = None,
        micro_batches: int = 1,
    ) -> None:
        self.shard_sizes = as_shard_sizes(shard_sizes)
        self.global_batch = int(global_batch)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.spec = shuffle if shuffle is not None else ShuffleSpec()
        self.micro_batches = int(micro_batches)
        self._check_shard(self.rank, self.world_size)
        if self.num_samples < self.global_batch:
            raise KaisokuError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch}; lower data.global_batch or use a larger dataset"
            )
        if self.seed < 0:
            raise KaisokuError(f"seed {self.seed} is negative; use a seed >= 0")
        self.epoch = 0
        self.position = 0
        self.last_quality: float | None = None
        """The current epoch's shuffle-quality score, where the loader computes one (None: not measured)."""
        # The saved spec of a resumed epoch, when it differs from the current one (other node count).
        self._epoch_specs: dict[int, ShuffleSpec] = {}
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self._plans: OrderedDict[int, PartialPlan] = OrderedDict()
        # A node's stager thread computes orders too; the memo below is shared with it.
        self._lock = threading.RLock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def _check_shard(self, shard: int, shards: int) -> None:
        check_batch_split(self.global_batch, shards, self.spec, self.micro_batches)
        if not 0 <= shard < shards:
            raise KaisokuError(f"rank {shard} is outside world size {shards}")

    def set_shard(self, shard: int, shards: int) -> None:
        """Read data-parallel shard ``shard`` of ``shards`` from the next pass on (a parallel layout switch).

        The global order does not change, only the slice of each global batch this rank takes.
        """
        self._check_shard(int(shard), int(shards))
        self.rank, self.world_size = int(shard), int(shards)

    @property
    def num_samples(self) -> int:
        """Samples in the dataset."""
        return int(self.shard_sizes.sum())

    def spec_for(self, epoch: int) -> ShuffleSpec:
        """The shuffle spec that decides ``epoch``'s order (a resumed epoch keeps its saved spec)."""
        return self._epoch_specs.get(epoch, self.spec)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global order of ``epoch``, trimmed to whole global batches (pure in (seed, epoch, spec))."""
        with self._lock:
            return self._epoch_order_locked(epoch)

    def _epoch_order_locked(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            spec = self.spec_for(epoch)
            if spec.depends_on_nodes:
                order = self.partial_plan(epoch).global_order()
            else:
                order = epoch_order(self.shard_sizes, self.seed, epoch, spec, self.global_batch)
            self._orders[epoch] = order
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def partial_plan(self, epoch: int) -> PartialPlan:
        """The ``partial`` plan of ``epoch`` (its node orders and the shards' home nodes)."""
        spec = self.spec_for(epoch)
        if not spec.depends_on_nodes:
            raise KaisokuError(f"epoch {epoch} uses the {spec.name} shuffle, not partial")
        with self._lock:
            return self._partial_plan_locked(epoch, spec)

    def _partial_plan_locked(self, epoch: int, spec: ShuffleSpec) -> PartialPlan:
        if epoch not in self._plans:
            plan = partial_plan(
                self.shard_sizes,
                self.seed,
                epoch,
                num_nodes=spec.num_nodes,
                exchange=spec.exchange,
                global_batch=self.global_batch,
            )
            if plan.steps == 0:
                raise KaisokuError(
                    f"the partial shuffle leaves no whole global batch of {self.global_batch} "
                    f"in epoch {epoch}; lower data.global_batch"
                )
            self._plans[epoch] = plan
            while len(self._plans) > 2:
                self._plans.popitem(last=False)
        return self._plans[epoch]

    def layout_matches(self, epoch: int) -> bool:
        """Whether ``epoch``'s order was built for this world's nodes (always true but for partial).

        False only for a ``partial`` epoch resumed on another node count: its samples are then not on
        the nodes that hold them, so the loader skips the exchange and reads them through the cache.
        """
        spec = self.spec_for(epoch)
        return not spec.depends_on_nodes or spec.num_nodes == self.spec.num_nodes

    def num_batches(self, epoch: int | None = None) -> int:
        """Steps in ``epoch`` (default: the current one); the same on every rank."""
        return len(self.epoch_order(self.epoch if epoch is None else epoch)) // self.global_batch

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in the current epoch."""
        return self.num_batches()

    def set_epoch(self, epoch: int, start_step: int | None = None) -> None:
        """Move to ``epoch`` from optimizer step ``start_step``.

        Without ``start_step``, another epoch starts at its beginning and the current one (e.g. a resumed
        one) keeps its position.
        """
        if epoch < 0:
            raise KaisokuError(f"epoch {epoch} is negative")
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.position = 0
        if start_step is not None:
            if not 0 <= start_step <= self.num_batches():
                raise KaisokuError(
                    f"start step {start_step} is outside epoch {epoch}'s {self.num_batches()} steps"
                )
            self.position = int(start_step) * self.global_batch

    @property
    def step(self) -> int:
        """Steps of the current epoch already consumed (over all ranks)."""
        return self.position // self.global_batch

    def batches(self, epoch: int | None = None, start_step: int | None = None) -> np.ndarray:
        """This rank's batches of ``epoch`` from ``start_step`` (default: the current epoch and position)."""
        epoch = self.epoch if epoch is None else epoch
        if start_step is None:
            start_step = self.step if epoch == self.epoch else 0
        return rank_batches(
            self.epoch_order(epoch), self.global_batch, self.rank, self.world_size, start_step
        )

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        return self.num_batches() - self.step

    def __iter__(self) -> Iterator[list[int]]:
        """The rank's remaining batches of the current epoch; the position moves as each one is handed out."""
        epoch = self.epoch
        for batch in self.batches(epoch, self.step):
            if self.epoch != epoch:
                return
            self.position += self.global_batch
            yield batch.tolist()

    def state_dict(self, steps_done: int | None = None) -> dict[str, Any]:
        """Resume point: epoch, samples consumed in it, seed, world and shuffle, dataset fingerprint.

        A DataLoader runs ahead of training; pass ``steps_done``, the steps of this epoch training has
        consumed, to save that point rather than how far the sampler has handed out batches.
        """
        step = self.step if steps_done is None else int(steps_done)
        if not 0 <= step <= self.num_batches():
            raise KaisokuError(
                f"steps_done {step} is outside epoch {self.epoch}'s 0..{self.num_batches()} steps"
            )
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": step * self.global_batch,
            "seed": self.seed,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "num_samples": self.num_samples,
            "num_shards": int(self.shard_sizes.size),
            "shards_digest": shards_digest(self.shard_sizes),
            "shuffle": self.spec_for(self.epoch).as_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved epoch and position; the world size may differ from the saved one.

        Raises KaisokuError when the state belongs to another dataset, seed or global batch.
        """
        if "version" not in state and "step" in state:
            state = folder_state(state, self.world_size)
        if state.get("version") != STATE_VERSION:
            raise KaisokuError(
                f"sampler state version {state.get('version')} is not {STATE_VERSION}; "
                "this checkpoint was written by another kaisoku version: start the data order afresh"
            )
        if state["num_samples"] != self.num_samples or state["shards_digest"] != shards_digest(
            self.shard_sizes
        ):
            raise KaisokuError(
                f"the checkpoint's data order is for a dataset of {state['num_samples']} samples in "
                f"{state['num_shards']} shards, but this dataset has {self.num_samples} samples in "
                f"{self.shard_sizes.size} shards; resume with the same packed dataset (data.path), "
                "or start a new run"
            )
        if state["seed"] != self.seed:
            raise KaisokuError(
                f"the checkpoint's data order uses seed {state['seed']}, this run seed {self.seed}; "
                f"set train.seed={state['seed']} to resume, or start a new run"
            )
        position = int(state["position"])
        saved_spec = ShuffleSpec.from_dict(state["shuffle"])
        if state["global_batch"] != self.global_batch and position:
            raise KaisokuError(
                f"the checkpoint stopped mid-epoch with a global batch of {state['global_batch']}, "
                f"this run uses {self.global_batch}; set data.global_batch={state['global_batch']} to resume "
                "(the global batch stays fixed across world sizes)"
            )
        if position % self.global_batch or position < 0:
            raise KaisokuError(f"sampler position {position} is not a whole number of global batches")
        with self._lock:
            self.epoch = int(state["epoch"])
            self.position = position
            self._orders.clear()
            self._plans.clear()
            self._epoch_specs.clear()
        if saved_spec != self.spec:
            # The epoch in progress finishes in its saved order; the flat order splits over any world.
            with self._lock:
                self._epoch_specs[self.epoch] = saved_spec
        if self.position > self.num_batches() * self.global_batch:
            raise KaisokuError(
                f"sampler position {position} lies beyond epoch {self.epoch}'s "
                f"{self.num_batches() * self.global_batch} samples"
            )


def folder_state(state: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The state saved by the image-folder sampler of earlier versions, in this sampler's format."""
    return {
        "version": STATE_VERSION,
        "epoch": int(state["epoch"]),
        "position": int(state["step"]) * int(state["global_batch"]),
        "seed": state["seed"],
        "world_size": world_size,
        "global_batch": state["global_batch"],
        "num_samples": state["num_samples"],
        "num_shards": 1,
        "shards_digest": shards_digest([state["num_samples"]]),
        "shuffle": ShuffleSpec(unpacked=True).as_dict(),
    }


class StepKeys(list[tuple[int, int]]):
    """A micro-batch's ``(epoch, index)`` keys, with the epoch and the rank's optimizer step they are read
    for (a plain list to every reader; the node cache's planned loads are keyed by that step), and the
    loader pass that asked for them (a loader whose workers outlive a pass withdraws its reads by pass)."""

    def __init__(self, keys: list[tuple[int, int]], *, epoch: int, step: int, loader_pass: int = 0) -> None:
        super().__init__(keys)
        self.epoch = epoch
        self.step = step
        self.loader_pass = loader_pass


class KeyedMicroBatches:
    """A DataLoader ``batch_sampler`` over an :class:`EpochSampler`: each rank batch of the current epoch
    cut into ``sampler.micro_batches`` equal parts of ``(epoch, index)`` keys (augmentation is keyed by
    both), each a :class:`StepKeys` naming its step and ``loader_pass``."""

    def __init__(self, sampler: EpochSampler, *, loader_pass: int = 0) -> None:
        self.sampler = sampler
        self.loader_pass = loader_pass

    def __len__(self) -> int:
        return len(self.sampler) * self.sampler.micro_batches

    def __iter__(self) -> Iterator[StepKeys]:
        epoch = self.sampler.epoch
        micro = self.sampler.micro_batches
        start = self.sampler.step
        for n, batch in enumerate(self.sampler):
            size = len(batch) // micro
            for k in range(micro):
                keys = [(epoch, i) for i in batch[k * size : (k + 1) * size]]
                yield StepKeys(keys, epoch=epoch, step=start + n, loader_pass=self.loader_pass)
