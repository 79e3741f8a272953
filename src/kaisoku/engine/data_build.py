"""Build the data side of a run from its plan: the training data (a :class:`TrainData`) and the validation
loader, for a packed dataset, an image folder, the generated sets or the user's own dataset."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from kaisoku.config import Config
from kaisoku.data.cosmo import VolumeTargetTransform, ensure_cosmo_dataset
from kaisoku.data.datagen import ensure_demo_dataset
from kaisoku.data.loading.counters import LoaderCounters
from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset, ShardSource
from kaisoku.data.loading.folder import FolderSampler, ImageFolderDataset, ShardedEvalSampler, split_train_val
from kaisoku.data.loading.loader import ShardLoader, packed_splits
from kaisoku.data.loading.transforms import AugmentSpec, collate
from kaisoku.data.order.sampler import EpochSampler, KeyedMicroBatches
from kaisoku.data.shards.format import read_index
from kaisoku.distributed import env
from kaisoku.distributed.launch import die_with_rank
from kaisoku.engine.train_inputs import TrainData
from kaisoku.parts import UserParts
from kaisoku.run_plan import RunPlan


def dataset_root(cfg: Config) -> Path:
    """The dataset folder: ``data.path``, or the demo set generated on first use (shapes; universes for
    ``cosmoflow``)."""
    if cfg.data.path:
        return Path(cfg.data.path).expanduser()
    if cfg.model.name == "cosmoflow":  # the generated universe set, at data.image_size cubed
        return ensure_cosmo_dataset(cfg.data.cache_dir, size=cfg.data.image_size)
    return ensure_demo_dataset(cfg.data.cache_dir)


class SampledLoader:
    """A DataLoader over an :class:`EpochSampler`'s keyed batches, as the trainer drives it (:class:`TrainData`).

    The image-folder path and the user's dataset train through it; a packed dataset through
    :class:`~kaisoku.data.loading.loader.ShardLoader`.
    """

    def __init__(self, loader: DataLoader, sampler: EpochSampler) -> None:
        self.loader = loader
        self.sampler = sampler
        self.last_quality: float | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in the current epoch."""
        return self.sampler.steps_per_epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The rest of the current epoch's micro-batches."""
        return iter(self.loader)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Point the next iteration at ``epoch`` from ``start_step``."""
        self.sampler.set_epoch(epoch, start_step)

    def set_shard(self, shard: int, shards: int) -> None:
        """Read data-parallel shard ``shard`` of ``shards`` from the next epoch pass on (a layout switch)."""
        self.sampler.set_shard(shard, shards)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's resume point."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the data order (any world size)."""
        self.sampler.load_state_dict(state)

    def epoch_stats(self) -> dict[str, float] | None:
        """The image folder's read counters (None for the user's dataset)."""
        stats = getattr(self.sampler, "epoch_stats", None)  # only FolderSampler counts file reads
        return stats() if callable(stats) else None

    def close(self) -> None:
        """Nothing to release: the DataLoader's workers end with it."""


class BatchPairs:
    """A user's samples as the step's ``(inputs, targets)``: collated by the user's ``collate`` (None: torch's
    default collate), floating tensors in torch's default dtype (a dataset of float64 numpy arrays trains a
    float32 model); the two parts of ``(input, target)`` batches, or a dict batch twice (the model takes it
    as keyword arguments, a loss sees all of it)."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any]) -> tuple[Any, Any]:
        """One micro-batch of ``samples``."""
        return _as_pair((self.collate or default_collate)(samples))


def _as_pair(batch: Any) -> tuple[Any, Any]:
    dtype = torch.get_default_dtype()

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        if isinstance(value, Mapping):
            return {key: cast(v) for key, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        return value

    batch = cast(batch)
    if isinstance(batch, Mapping):
        return batch, batch
    inputs, targets = batch
    return inputs, targets


class KeyedDataset(Dataset):
    """A user's map-style dataset addressed by the sampler's ``(epoch, index)`` keys (the epoch is unused:
    the user's dataset does its own augmentation)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.dataset[key[1]]


class OpenAfterStart:
    """A DataLoader ``batch_sampler`` that yields no batch until :meth:`open`, then the batches of ``batches``
    (whose length and attributes it has throughout): iterating the loader once while it is closed starts the
    persistent worker processes and reads nothing."""

    def __init__(self, batches: Any) -> None:
        self.batches = batches
        self.opened = False

    def open(self) -> None:
        """Yield ``batches``' batches from the next iteration on."""
        self.opened = True

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches) if self.opened else iter(())

    def __len__(self) -> int:
        return len(self.batches)

    def __getattr__(self, name: str) -> Any:  # what validation asks of its sampler (num_samples, first_batch)
        if name == "batches":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.batches, name)


def _loader(
    dataset: Dataset, batch_sampler: Any, workers: int, device: torch.device, collate_fn: Any
) -> DataLoader:
    """A DataLoader over ``batch_sampler`` whose persistent workers are started now, while the data is built.

    A rank forks them before it runs collectives and autograd: under Python 3.11 a fork made while another
    of the rank's threads (collectives and autograd run their own) creates a thread state leaves the child
    stuck for good in its start, and the rank waiting for that worker (seen as a validation that never began).
    """
    batches = OpenAfterStart(batch_sampler)
    loader = DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        worker_init_fn=die_with_rank if workers > 0 else None,
        prefetch_factor=4 if workers > 0 else None,
    )
    if workers > 0:
        with torch.random.fork_rng(devices=[]):  # the workers' base seed is no draw of the run's generator
            iter(loader)  # kept by the loader (persistent workers): later iterations reuse its workers
    batches.open()
    return loader


@dataclass
class DataParts:
    """What a run trains and validates on."""

    train: TrainData
    val_loader: DataLoader | None


def build_data(
    plan: RunPlan,
    world: env.World,
    device: torch.device,
    parts: UserParts | None = None,
) -> DataParts:
    """The training data and validation loader of ``plan``: the user's dataset, a packed dataset (shuffles,
    cache, exchange) or an image-folder tree.

    The training order is the plan's shard of this rank (:meth:`RunPlan.train_shard`); validation always
    shards over every rank.
    """
    cfg = plan.config
    train_rank, train_world = plan.train_shard(world.rank)
    val_args = {"rank": world.rank, "world_size": world.world_size, "batch_size": plan.val_batch}
    workers = cfg.data.workers
    if plan.data.source == "user":
        assert parts is not None and parts.train_data is not None
        sampler = EpochSampler(
            [len(parts.train_data)],
            global_batch=cfg.data.global_batch,
            rank=train_rank,
            world_size=train_world,
            seed=cfg.train.seed,
            shuffle=plan.shuffle,
            micro_batches=cfg.train.grad_accum,
        )
        train = KeyedDataset(parts.train_data)
        val_loader = None
        if parts.val_data is not None:
            val_sampler = ShardedEvalSampler(len(parts.val_data), **val_args)
            val_loader = _loader(
                KeyedDataset(parts.val_data), val_sampler, workers, device, BatchPairs(parts.collate)
            )
        loader = _loader(train, KeyedMicroBatches(sampler), workers, device, BatchPairs(parts.collate))
        return DataParts(train=SampledLoader(loader, sampler), val_loader=val_loader)
    root = dataset_root(cfg)
    train_spec = AugmentSpec(size=cfg.data.image_size, train=True, scale=(cfg.data.crop_scale_min, 1.0))
    val_spec = AugmentSpec(size=cfg.data.image_size, train=False)
    packed = packed_splits(root)
    if packed is None:
        train_files, val_files = split_train_val(root, cfg.data.val_fraction, cfg.train.seed)
        counters = LoaderCounters(workers)
        folder_sampler = FolderSampler(
            [len(train_files)],
            counters=counters,
            root=root,
            workers=workers,
            global_batch=cfg.data.global_batch,
            rank=train_rank,
            world_size=train_world,
            seed=cfg.train.seed,
            shuffle=plan.shuffle,
            micro_batches=cfg.train.grad_accum,
        )
        train_set = ImageFolderDataset(train_files, train_spec, seed=cfg.train.seed, counters=counters)
        val_set = ImageFolderDataset(val_files, val_spec, seed=cfg.train.seed)
        loader = _loader(train_set, KeyedMicroBatches(folder_sampler), workers, device, collate)
        val_sampler = ShardedEvalSampler(len(val_files), **val_args)
        return DataParts(
            train=SampledLoader(loader, folder_sampler),
            val_loader=_loader(val_set, val_sampler, workers, device, collate),
        )
    train_dir, val_dir = packed
    # The training set reads through the source its loader counts in and attaches the node cache to.
    source = ShardSource(LoaderCounters(workers))
    if plan.task == "regression":
        target = str(read_index(train_dir).target)

        def transform(train: bool) -> Any:
            return VolumeTargetTransform(seed=cfg.train.seed, train=train, target_field=target)

        train_set = ShardedDataset(
            train_dir, transform=transform(True), skip_corrupt=cfg.data.skip_corrupt, source=source
        )
        val_set = (
            ShardedDataset(val_dir, transform=transform(False), skip_corrupt=cfg.data.skip_corrupt)
            if val_dir is not None
            else None
        )
    else:
        train_set = ShardedDataset(
            train_dir,
            transform=ImageLabelTransform(spec=train_spec, seed=cfg.train.seed),
            skip_corrupt=cfg.data.skip_corrupt,
            decode_images=cfg.data.decode == "cpu",  # decoding on the device needs the encoded bytes
            source=source,
        )
        val_set = (
            ShardedDataset(
                val_dir,
                transform=ImageLabelTransform(spec=val_spec, seed=cfg.train.seed),
                skip_corrupt=cfg.data.skip_corrupt,
            )
            if val_dir is not None
            else None
        )
    val_loader = None
    if val_set is not None:
        val_loader = _loader(val_set, ShardedEvalSampler(len(val_set), **val_args), workers, device, collate)
    return DataParts(train=shard_loader(plan, world, device, train_set), val_loader=val_loader)


def shard_loader(
    plan: RunPlan,
    world: env.World,
    device: torch.device,
    train_set: ShardedDataset,
) -> ShardLoader:
    """The training :class:`ShardLoader` of ``plan`` over ``train_set`` (shuffle, cache, batch path, workers).

    :func:`build_data` calls it with the dataset it opens; ``kaisoku bench loader`` with its own, so that its
    rows iterate exactly what training iterates.
    """
    cfg = plan.config
    train_rank, train_world = plan.train_shard(world.rank)
    return ShardLoader(
        train_set,
        global_batch=cfg.data.global_batch,
        rank=train_rank,
        world_size=train_world,
        ranks_per_node=world.local_world_size,
        seed=cfg.train.seed,
        shuffle=plan.shuffle,
        micro_batches=cfg.train.grad_accum,
        workers=cfg.data.workers,
        cache=plan.cache,
        num_epochs=math.ceil(cfg.train.epochs),
        pin_memory=device.type == "cuda",
        batch_path=cfg.data.loader,
        decode=cfg.data.decode,
        device=device,
    )
