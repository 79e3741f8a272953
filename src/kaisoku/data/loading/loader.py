"""The training loader over a packed dataset: shuffle, tiered cache, exchange, exact resume.

:class:`ShardLoader` is both what the trainer iterates (micro-batches of uint8 NCHW images and labels)
and its sampler (``steps_per_epoch``, ``set_epoch``, ``state_dict``). Per epoch it: points the
:class:`~kaisoku.data.order.sampler.EpochSampler` at the epoch and step, reports progress to the node cache,
runs the partial shuffle's inter-node exchange (a collective, on every rank), and starts a DataLoader
whose workers decode late. The state it saves is the number of steps training *consumed*, not how far
the DataLoader's prefetching ran.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import multiprocessing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from kaisoku.data.loading.batches import BatchRing, Key, ThreadedBatches, no_read_context
from kaisoku.data.loading.counters import LoaderCounters
from kaisoku.data.loading.dataset import ShardedDataset
from kaisoku.data.loading.gpu_decode import EncodedBatch, EncodedBatches, decode_place
from kaisoku.data.loading.transforms import collate
from kaisoku.data.loading.worker_batches import WorkerBatches, ring_size
from kaisoku.data.node_cache.cache import NodeCache
from kaisoku.data.node_cache.staging import CacheSettings
from kaisoku.data.node_cache.tier_dirs import auto_local_capacity
from kaisoku.data.order.exchange import RecordStore, exchange_for_epoch
from kaisoku.data.order.quality import shuffle_quality
from kaisoku.data.order.sampler import EpochSampler, KeyedMicroBatches, StepKeys
from kaisoku.data.order.shuffle import ShuffleSpec
from kaisoku.data.shards.format import INDEX_NAME
from kaisoku.distributed.launch import die_with_rank
from kaisoku.errors import KaisokuError

log = logging.getLogger(__name__)


def packed_splits(path: Path) -> tuple[Path, Path | None] | None:
    """``(train, val)`` index folders when ``path`` is a packed dataset, else None (an image folder).

    ``path/index.json`` is a single split (no validation set); ``path/train/index.json`` with an optional
    ``path/val/index.json`` (or ``test``) is what ``kaisoku pack`` writes for split trees and .npz files.
    """
    if (path / INDEX_NAME).is_file():
        return path, None
    if (path / "train" / INDEX_NAME).is_file():
        for name in ("val", "valid", "validation", "test"):
            if (path / name / INDEX_NAME).is_file():
                return path / "train", path / name
        return path / "train", None
    return None


class _ExchangedSamples(Dataset):
    """Samples of one epoch: records received from other nodes come from RAM, the rest from the shards."""

    def __init__(self, dataset: ShardedDataset, received: Mapping[int, memoryview], epoch: int) -> None:
        self.dataset = dataset
        self.received = received
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if index in self.received:
            return self.dataset.sample_from_record(self.received[index], index, epoch=epoch)
        return self.dataset[key]

    def read_into(self, key: tuple[int, int], out: np.ndarray) -> int | None:
        """Sample ``key`` written into ``out`` (see :meth:`ShardedDataset.read_into`)."""
        index = key[1]
        data = self.received[index] if index in self.received else None
        return self.dataset.read_into(key, out, data)

    def read_batch_into(self, keys: Sequence[tuple[int, int]], out: np.ndarray) -> list[int | None]:
        """Samples ``keys`` written into ``out`` (see :meth:`ShardedDataset.read_batch_into`)."""
        return self.dataset.read_batch_into(keys, out, [self.received.get(key[1]) for key in keys])

    def read_encoded(self, keys: Sequence[tuple[int, int]]) -> tuple[EncodedBatch, torch.Tensor]:
        """Samples ``keys`` encoded, for the device (see :meth:`ShardedDataset.read_encoded`)."""
        return self.dataset.read_encoded(keys, [self.received.get(key[1]) for key in keys])


BATCH_PATHS = ("batch", "threads", "processes")
"""How batches are made: worker processes kept across epochs, each decoding whole batches in one call into
shared buffers (one thread of the training process without workers); threads decoding sample by sample
into reused buffers; or DataLoader worker processes collating samples."""


class _ForTheirStep:
    """The packed loader's read context: each micro-batch's reads inside the node cache's
    :meth:`~kaisoku.data.node_cache.cache.NodeCache.reading_for` its step, since its threads and workers
    read ahead of what training has received; :meth:`withdraw` takes a pass's steps back once its batches
    are dropped. Its count of withdrawn passes is process-shared: worker processes read too, and those of
    the batch path outlive a pass."""

    def __init__(self, cache: NodeCache) -> None:
        self.cache = cache
        self.withdrawn = multiprocessing.Value("q", 0, lock=False)
        """Passes ``0 .. withdrawn - 1`` are dropped (written by the training process only)."""

    def withdraw(self, loader_pass: int) -> None:
        """Pass ``loader_pass``'s batches are dropped: a read for it waiting for progress that training will
        now never report gives up."""
        self.withdrawn.value = max(self.withdrawn.value, loader_pass + 1)

    def __call__(self, keys: Sequence[Key]) -> contextlib.AbstractContextManager[object]:
        """The context for reading ``keys`` (a :class:`StepKeys`; anything else needs none)."""
        if not isinstance(keys, StepKeys):
            return contextlib.nullcontext()
        return self.cache.reading_for(keys.epoch, keys.step, _Withdrawn(self.withdrawn, keys.loader_pass))


class _Withdrawn:
    """The node cache's stop flag for one pass's reads: set once that pass is withdrawn."""

    def __init__(self, withdrawn: Any, loader_pass: int) -> None:
        self.withdrawn = withdrawn
        self.loader_pass = loader_pass

    def is_set(self) -> bool:
        """True once the pass's batches are dropped."""
        return bool(self.withdrawn.value > self.loader_pass)


class _ReadsForTheirStep(Dataset):
    """``samples`` as DataLoader workers read them: each micro-batch inside ``reads(keys)``. A worker gets
    it with the dataset, whose shard opener is the same cache, so the step reaches the cache that reads."""

    def __init__(self, samples: Any, reads: _ForTheirStep) -> None:
        self.samples = samples
        self.reads = reads

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: Key) -> Any:
        return self.samples[key]

    def __getitems__(self, keys: Sequence[Key]) -> list[Any]:
        """A micro-batch's samples (the DataLoader's batched fetch), read for its step."""
        with self.reads(keys):
            return [self.samples[key] for key in keys]


class ShardLoader:
    """A rank's training batches over a packed dataset, epoch after epoch, resumable exactly.

    ``batch_path`` ``batch`` (the default, the fastest): ``workers`` worker processes, kept across epochs,
    each decode whole batches in one call (:mod:`~kaisoku.data.loading.batch_augment`: crops drawn for the
    batch at once, the fastest installed resizer) into batch buffers in shared memory
    (:mod:`~kaisoku.data.loading.worker_batches`); without workers one thread of this process does;
    ``threads``: ``max(1, workers)`` threads of this process, sample by sample, into reused batch buffers
    (:class:`~kaisoku.data.loading.batches.ThreadedBatches`); ``processes``: a DataLoader with ``workers``
    worker processes collating samples. All three give the same batches (``batch`` within
    :data:`~kaisoku.data.loading.batch_augment.BATCH_PIXEL_TOLERANCE`; bit for bit today).

    ``decode`` ``gpu`` (on a CUDA ``device``; the host path after one line elsewhere, see
    :func:`~kaisoku.data.loading.gpu_decode.decode_place`): the threads only read records and draw the
    crops; batches are :class:`~kaisoku.data.loading.gpu_decode.EncodedBatch` es, decoded where the trainer
    moves them. The dataset must keep its images encoded (``decode_images=False``).
    """

    def __init__(
        self,
        dataset: ShardedDataset,
        *,
        global_batch: int,
        rank: int,
        world_size: int,
        ranks_per_node: int,
        seed: int,
        shuffle: ShuffleSpec,
        micro_batches: int = 1,
        workers: int = 0,
        cache: CacheSettings | None = None,
        num_epochs: int | None = None,
        pin_memory: bool = False,
        batch_path: str = "batch",
        decode: str = "cpu",
        device: torch.device | None = None,
    ) -> None:
        if batch_path not in BATCH_PATHS:
            raise KaisokuError(f"data.loader must be one of {', '.join(BATCH_PATHS)} (got {batch_path!r})")
        self.batch_path = batch_path
        self.decode = decode_place(decode, device, announce=rank == 0)
        """Where training images are decoded: cpu (the host, by ``batch_path``) or gpu (the device)."""
        self.dataset = dataset
        self.sampler = EpochSampler(
            dataset.shard_sizes(),
            global_batch=global_batch,
            rank=rank,
            world_size=world_size,
            seed=seed,
            shuffle=shuffle,
            micro_batches=micro_batches,
        )
        self.workers = workers
        self.ranks_per_node = ranks_per_node
        self.node = rank // ranks_per_node
        self.cache_settings = cache or CacheSettings()
        self.run_token = "run"
        self.num_epochs = num_epochs
        self.exchange: Callable[..., dict[int, bytes]] | None = None
        self.pin_memory = pin_memory
        self.cache: NodeCache | None = None
        self._received: RecordStore | None = None
        self._ring: BatchRing | None = None  # the thread paths' batch buffers
        self._workers: WorkerBatches | None = None  # the batch path's worker processes and shared buffers
        self._reads: _ForTheirStep | None = None  # the read context of every pass over the node cache
        self._passes = 0  # passes over the data begun (the keys of each carry its number)
        self._consumed_steps = 0
        self.last_quality: float | None = None
        if dataset.source.counters is None:  # a dataset built without its loader's counters counts here
            dataset.source.counters = LoaderCounters(workers)
        self.counters = dataset.source.counters
        self._cache_baseline = {"source_reads": 0, "source_bytes": 0}
        self._batches = 0
        self._batches_at_stats = 0
        if shuffle.depends_on_nodes and shuffle.num_nodes == 1 and rank == 0:
            log.warning(
                "data.shuffle partial on one node gives the same order as global (there is no other "
                "node to exchange with); it differs from global once the run spans several nodes"
            )

    @property
    def needs_exchange(self) -> bool:
        """True when epochs exchange samples between nodes (partial shuffle, Q > 0, several nodes)."""
        return self.sampler.spec.exchanges

    def connect(self, *, run_token: str, exchange_group: Any = None) -> None:
        """Finish set-up once the process group exists: the token naming shared files, the exchange."""
        self.run_token = run_token
        if self.needs_exchange:
            self.exchange = functools.partial(exchange_for_epoch, group=exchange_group)

    # -- the trainer's sampler protocol ------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in the current epoch."""
        return self.sampler.num_batches()

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Prepare ``epoch`` from optimizer step ``start_step``: cache progress, exchange (collective)."""
        self.sampler.set_epoch(epoch, start_step)
        self._consumed_steps = start_step
        if self.cache is None and self.cache_settings.enabled:
            self._start_cache()
        if self.cache is not None:
            self.cache.mark_progress(epoch, start_step)
        self._drop_received()
        if self.exchange is not None:
            records = self.exchange(
                self.sampler, self.dataset.record_bytes, ranks_per_node=self.ranks_per_node
            )
            self.counters.add("exchanged_bytes", sum(len(r) for r in records.values()))
            if records:
                path = (
                    Path(self.cache_settings.ram_dir)
                    / self.run_token
                    / f"exchange-rank{self.sampler.rank}.bin"
                )
                self._received = RecordStore.write(records, path)
        self.last_quality = self.quality(epoch)

    def set_shard(self, shard: int, shards: int) -> None:
        """Read data-parallel shard ``shard`` of ``shards`` from the next epoch pass on (a layout switch)."""
        self.sampler.set_shard(shard, shards)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state at the steps training consumed (not where prefetching got to)."""
        return self.sampler.state_dict(steps_done=self._consumed_steps)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the data order; the world size may differ from the one that saved it."""
        self.sampler.load_state_dict(state)
        self._consumed_steps = self.sampler.step

    # -- iteration ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = self.sampler.epoch
        samples: Any = self.dataset
        if self._received is not None:
            samples = _ExchangedSamples(self.dataset, self._received, epoch)
        loader_pass, self._passes = self._passes, self._passes + 1
        keyed = KeyedMicroBatches(self.sampler, loader_pass=loader_pass)
        if self.cache is not None and (self._reads is None or self._reads.cache is not self.cache):
            self._reads = _ForTheirStep(self.cache)
        for_their_step = self._reads if self.cache is not None else None
        reads = no_read_context if for_their_step is None else for_their_step
        loader: Any
        if self.decode == "gpu":
            loader = EncodedBatches(samples, keyed, threads=max(1, self.workers), read_context=reads)
        elif self.batch_path == "batch" and self.workers > 0:
            if self._workers is None:
                ring = BatchRing(
                    ring_size(self.workers, self.sampler.micro_batches),
                    pin_memory=self.pin_memory,
                    shared=True,
                )
                self._workers = WorkerBatches(self.workers, ring)
            loader = self._workers.pass_over(samples, keyed, reads)
        elif self.batch_path in ("batch", "threads"):
            if self._ring is None:  # one for every epoch: allocated, pinned and paged in once
                # The trainer holds a step's micro-batches; plus the prefetched ones.
                self._ring = BatchRing(2 * self.sampler.micro_batches + 4, pin_memory=self.pin_memory)
            loader = ThreadedBatches(
                samples,
                keyed,
                threads=max(1, self.workers),
                prefetch=2,
                ring=self._ring,
                chunked=self.batch_path == "batch",
                read_context=reads,
            )
        else:
            loader = DataLoader(
                samples if for_their_step is None else _ReadsForTheirStep(samples, for_their_step),
                batch_sampler=keyed,
                num_workers=self.workers,
                collate_fn=collate,
                pin_memory=self.pin_memory,
                worker_init_fn=die_with_rank if self.workers > 0 else None,
                prefetch_factor=4 if self.workers > 0 else None,
            )
        # Held here, not only by the loop: a loop's iterator goes as an exception leaves the loop, before the
        # ``finally`` below; this one shuts the readers' pool or workers down only when this frame goes.
        batches = iter(loader)
        try:
            for k, batch in enumerate(batches):
                self._batches += 1
                if (k + 1) % self.sampler.micro_batches == 0:
                    self._consumed_steps += 1
                    if self.cache is not None:
                        self.cache.mark_progress(epoch, self._consumed_steps)
                yield batch
        finally:
            if for_their_step is not None:  # before the readers shut down (the trainer dropped the batches)
                for_their_step.withdraw(loader_pass)

    def quality(self, epoch: int) -> float:
        """The shuffle-quality score of ``epoch``'s global order at the global batch (1 random, 0 sequential)."""
        order = self.sampler.epoch_order(epoch)
        return shuffle_quality(order, self.sampler.shard_sizes, self.sampler.global_batch)

    # -- cache -------------------------------------------------------------------------------------

    def _start_cache(self) -> None:
        settings = self.cache_settings
        node_dir = f"{self.run_token}/node{self.node}"
        local_capacity = settings.local_capacity
        if settings.local_dir and local_capacity == 0:
            local_capacity = auto_local_capacity(
                settings.local_dir, announce=self.sampler.rank % self.ranks_per_node == 0
            )
        self.cache = NodeCache.for_sampler(
            self.sampler,
            self.dataset.shard_paths(),
            ranks_per_node=self.ranks_per_node,
            ram_dir=Path(settings.ram_dir) / node_dir,
            ram_capacity=settings.ram_capacity,
            local_dir=self._local_dir(),
            local_capacity=local_capacity,
            run_token=self.run_token,
            num_epochs=self.num_epochs,
            shard_bytes=self.dataset.shard_nbytes(),
            reader_slots=self.workers + 1,
            shard_crcs=[shard.crc32 for shard in self.dataset.index.shards],
        )
        self.dataset.source.attach_cache(self.cache.shard_buffer, self.cache.tier_of)

    def _local_dir(self) -> Path | None:
        """The node's local-tier directory: named by the dataset (its shards' CRCs), not by the run, so that
        a restart finds what the previous run staged (the cache checks each file's size and CRC)."""
        if not self.cache_settings.local_dir:
            return None
        shards = self.dataset.index.shards
        key = hashlib.sha256(np.asarray([(s.crc32, s.nbytes) for s in shards], dtype=np.int64).tobytes())
        root = Path(self.cache_settings.local_dir).expanduser()
        return root / f"kaisoku-{key.hexdigest()[:16]}" / f"node{self.node}"

    def stats(self) -> dict[str, int]:
        """The node cache's counters (source reads, bytes, tier hits); empty without a cache."""
        return self.cache.node_stats() if self.cache is not None else {}

    def epoch_stats(self) -> dict[str, float] | None:
        """What this rank's data path did since the previous call (the trainer calls it per epoch).

        ``source_reads`` / ``source_bytes``: reads of the source file system (whole shards with a node
        cache, counted by this rank's processes and, on local rank 0, the node's stager; records without
        one); ``served_{ram,local,source}_bytes``: record bytes handed to decoding per tier;
        ``exchanged_bytes``: record bytes received from other nodes; ``skipped_records``: damaged
        records skipped. None when nothing was read or trained since the previous call.
        """
        counted = self.counters.since_last()
        if self.cache is not None:
            totals = self.cache.stats()
            if self.cache.owns_stager:
                stager = self.cache.stager_stats()
                totals = {k: totals[k] + stager[k] for k in totals}
            reads = {k: totals[k] - self._cache_baseline[k] for k in self._cache_baseline}
            self._cache_baseline = {k: totals[k] for k in self._cache_baseline}
        else:
            reads = {
                "source_reads": counted["source_records"],
                "source_bytes": counted["served_source_bytes"],
            }
        stats: dict[str, float] = {
            "skipped_records": counted["skipped_records"],
            **reads,
            "served_ram_bytes": counted["served_ram_bytes"],
            "served_local_bytes": counted["served_local_bytes"],
            "served_source_bytes": counted["served_source_bytes"],
            "exchanged_bytes": counted["exchanged_bytes"],
        }
        batches, self._batches_at_stats = self._batches - self._batches_at_stats, self._batches
        if batches == 0 and not any(stats.values()):
            return None
        return stats

    def _drop_received(self) -> None:
        if self._received is not None:
            self._received.remove()
            self._received = None

    def close(self) -> None:
        """Stop the batch path's workers, stop staging and delete staged files (call on every rank of a node
        after a barrier)."""
        if self._workers is not None:
            self._workers.close()
        self._drop_received()
        if self.cache is not None:
            self.cache.close()
            self.cache = None


def label_count(dataset: ShardedDataset) -> int:
    """Number of classes: the index's class names, else the largest label + 1."""
    if dataset.classes:
        return len(dataset.classes)
    return int(np.max(dataset.labels)) + 1
