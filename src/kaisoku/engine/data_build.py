"""Build the data side of a run from its config: the training and validation loaders and what the model
needs to know about the data (classes, channels, normalisation)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from kaisoku.config import Config, data_settings
from kaisoku.data.counters import LoaderCounters
from kaisoku.data.datagen import ensure_demo_dataset
from kaisoku.data.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.folder import FolderSampler, ImageFolderDataset, ShardedEvalSampler, split_train_val
from kaisoku.data.loader import ShardLoader, label_count, packed_splits
from kaisoku.data.sampler import KeyedMicroBatches
from kaisoku.data.shuffle import ShuffleSpec
from kaisoku.data.transforms import IMAGENET_MEAN, IMAGENET_STD, AugmentSpec, collate
from kaisoku.distributed import env
from kaisoku.errors import ConfigError


def dataset_root(cfg: Config) -> Path:
    """The dataset folder: ``data.path``, or the demo set generated on first use."""
    if cfg.data.path:
        return Path(cfg.data.path).expanduser()
    return ensure_demo_dataset(cfg.data.cache_dir)


def _loader(
    dataset: ImageFolderDataset, batch_sampler: Any, workers: int, device: torch.device
) -> DataLoader:
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
    )


@dataclass
class DataParts:
    """The loaders a run trains and validates on, and what the model needs to know about the data."""

    train_loader: Any
    train_sampler: Any
    val_loader: DataLoader | None
    num_classes: int
    in_channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def build_data(
    cfg: Config, world: env.World, device: torch.device, *, shard: tuple[int, int] | None = None
) -> DataParts:
    """Loaders for a packed dataset (shuffles, cache, exchange) or an image-folder tree (plain sampler).

    ``shard`` is ``(shard, shards)`` for the training sampler when it is not ``(rank, world size)``: the
    replica index and count under hybrid parallelism. Validation always shards over every rank.
    """
    root = dataset_root(cfg)
    train_rank, train_world = shard if shard is not None else (world.rank, world.world_size)
    train_spec = AugmentSpec(size=cfg.data.image_size, train=True, scale=(cfg.data.crop_scale_min, 1.0))
    val_spec = AugmentSpec(size=cfg.data.image_size, train=False)
    workers = cfg.data.workers
    val_batch = max(1, cfg.data.global_batch // world.world_size)
    val_sampler_args = {"rank": world.rank, "world_size": world.world_size, "batch_size": val_batch}
    shuffle, cache = data_settings(cfg.data, world.num_nodes)
    packed = packed_splits(root)
    if packed is None:
        if shuffle.needs_shards or cache.enabled:
            raise ConfigError(
                f"data.shuffle {cfg.data.shuffle}, data.local_cache and data.ram_capacity need a packed "
                f"dataset; run kaisoku pack {root} DST and train on DST"
            )
        train_files, val_files = split_train_val(root, cfg.data.val_fraction, cfg.train.seed)
        counters = LoaderCounters(workers)
        sampler = FolderSampler(
            [len(train_files)],
            counters=counters,
            root=root,
            workers=workers,
            global_batch=cfg.data.global_batch,
            rank=train_rank,
            world_size=train_world,
            seed=cfg.train.seed,
            shuffle=ShuffleSpec(unpacked=True),
            micro_batches=cfg.train.grad_accum,
        )
        train = ImageFolderDataset(train_files, train_spec, seed=cfg.train.seed, counters=counters)
        val = ImageFolderDataset(val_files, val_spec, seed=cfg.train.seed)
        return DataParts(
            train_loader=_loader(train, KeyedMicroBatches(sampler), workers, device),
            train_sampler=sampler,
            val_loader=_loader(val, ShardedEvalSampler(len(val_files), **val_sampler_args), workers, device),
            num_classes=len(train_files.classes),
            in_channels=3,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
        )
    train_dir, val_dir = packed
    train_set = ShardedDataset(
        train_dir,
        transform=ImageLabelTransform(spec=train_spec, seed=cfg.train.seed, crop_decode=cfg.data.crop_decode),
        skip_corrupt=cfg.data.skip_corrupt,
        decode_images=not cfg.data.crop_decode,  # crop decoding needs the encoded bytes
    )
    in_channels = image_channels(train_set)
    loader = shard_loader(cfg, world, device, train_set, shard=shard)
    val_loader = None
    if val_dir is not None:
        val_set = ShardedDataset(
            val_dir,
            transform=ImageLabelTransform(spec=val_spec, seed=cfg.train.seed),
            skip_corrupt=cfg.data.skip_corrupt,
        )
        val_loader = _loader(val_set, ShardedEvalSampler(len(val_set), **val_sampler_args), workers, device)
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if in_channels == 3 else ((0.5,), (0.25,))
    return DataParts(
        train_loader=loader,
        train_sampler=loader,
        val_loader=val_loader,
        num_classes=label_count(train_set),
        in_channels=in_channels,
        mean=mean,
        std=std,
    )


def shard_loader(
    cfg: Config,
    world: env.World,
    device: torch.device,
    train_set: ShardedDataset,
    *,
    shard: tuple[int, int] | None = None,
) -> ShardLoader:
    """The training :class:`ShardLoader` of ``cfg`` over ``train_set`` (shuffle, cache, batch path, workers).

    :func:`build_data` calls it with the dataset it opens; ``kaisoku bench loader`` with its own, so that its
    rows iterate exactly what training iterates.
    """
    train_rank, train_world = shard if shard is not None else (world.rank, world.world_size)
    shuffle, cache = data_settings(cfg.data, world.num_nodes)
    return ShardLoader(
        train_set,
        global_batch=cfg.data.global_batch,
        rank=train_rank,
        world_size=train_world,
        ranks_per_node=world.local_world_size,
        seed=cfg.train.seed,
        shuffle=shuffle,
        micro_batches=cfg.train.grad_accum,
        workers=cfg.data.workers,
        cache=cache,
        num_epochs=math.ceil(cfg.train.epochs),
        pin_memory=device.type == "cuda",
        batch_path=cfg.data.loader,
    )


def image_channels(dataset: ShardedDataset) -> int:
    """Channels of the dataset's images: encoded images decode to RGB; stored arrays keep theirs."""
    for field in dataset.index.fields:
        if field.name == "image" and field.kind == "array" and field.shape is not None:
            return 1 if len(field.shape) == 2 else int(field.shape[-1])
    return 3
