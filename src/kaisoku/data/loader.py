"""The training loader over a packed dataset: shuffle, tiered cache, exchange, exact resume.

:class:`ShardLoader` is both what the trainer iterates (micro-batches of uint8 NCHW images and labels)
and its sampler (``steps_per_epoch``, ``set_epoch``, ``state_dict``). Per epoch it: points the
:class:`~kaisoku.data.sampler.EpochSampler` at the epoch and step, reports progress to the node cache,
runs the partial shuffle's inter-node exchange (a collective, on every rank), and starts a DataLoader
whose workers decode late. The state it saves is the number of steps training *consumed*, not how far
the DataLoader's prefetching ran.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from kaisoku.data.cache import NodeCache
from kaisoku.data.dataset import ShardedDataset
from kaisoku.data.exchange import RecordStore
from kaisoku.data.format import INDEX_NAME
from kaisoku.data.quality import shuffle_quality
from kaisoku.data.sampler import EpochSampler, KeyedMicroBatches
from kaisoku.data.shuffle import ShuffleSpec
from kaisoku.data.staging import CacheSettings
from kaisoku.data.transforms import collate

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


class ShardLoader:
    """A rank's training batches over a packed dataset, epoch after epoch, resumable exactly."""

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
    ) -> None:
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
        self._consumed_steps = 0
        self.last_quality: float | None = None

    @property
    def needs_exchange(self) -> bool:
        """True when epochs exchange samples between nodes (partial shuffle, Q > 0, several nodes)."""
        return self.sampler.spec.exchanges

    def connect(self, *, run_token: str, exchange_group: Any = None) -> None:
        """Finish set-up once the process group exists: the token naming shared files, the exchange."""
        self.run_token = run_token
        if self.needs_exchange:
            from kaisoku.data.exchange import exchange_for_epoch

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
        samples: Dataset = self.dataset
        if self._received is not None:
            samples = _ExchangedSamples(self.dataset, self._received, epoch)
        loader = DataLoader(
            samples,
            batch_sampler=KeyedMicroBatches(self.sampler),
            num_workers=self.workers,
            collate_fn=collate,
            pin_memory=self.pin_memory,
            prefetch_factor=4 if self.workers > 0 else None,
        )
        for k, batch in enumerate(loader):
            if (k + 1) % self.sampler.micro_batches == 0:
                self._consumed_steps += 1
                if self.cache is not None:
                    self.cache.mark_progress(epoch, self._consumed_steps)
            yield batch

    def quality(self, epoch: int) -> float:
        """The shuffle-quality score of ``epoch``'s global order at the global batch (1 random, 0 sequential)."""
        order = self.sampler.epoch_order(epoch)
        return shuffle_quality(order, self.sampler.shard_sizes, self.sampler.global_batch)

    # -- cache -------------------------------------------------------------------------------------

    def _start_cache(self) -> None:
        settings = self.cache_settings
        node_dir = f"{self.run_token}/node{self.node}"
        self.cache = NodeCache.for_sampler(
            self.sampler,
            self.dataset.shard_paths(),
            ranks_per_node=self.ranks_per_node,
            ram_dir=Path(settings.ram_dir) / node_dir,
            ram_capacity=settings.ram_capacity,
            local_dir=Path(settings.local_dir).expanduser() / node_dir if settings.local_dir else None,
            local_capacity=settings.local_capacity,
            run_token=self.run_token,
            num_epochs=self.num_epochs,
            shard_bytes=self.dataset.shard_nbytes(),
        )
        self.dataset.shard_opener = self.cache.shard_buffer

    def stats(self) -> dict[str, int]:
        """The node cache's counters (source reads, bytes, tier hits); empty without a cache."""
        return self.cache.node_stats() if self.cache is not None else {}

    def _drop_received(self) -> None:
        if self._received is not None:
            self._received.remove()
            self._received = None

    def close(self) -> None:
        """Stop staging and delete staged files (call on every rank of a node after a barrier)."""
        self._drop_received()
        if self.cache is not None:
            self.cache.close()
            self.cache = None


def label_count(dataset: ShardedDataset) -> int:
    """Number of classes: the index's class names, else the largest label + 1."""
    if dataset.classes:
        return len(dataset.classes)
    return int(np.max(dataset.labels)) + 1
