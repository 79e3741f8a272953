"""Build the data side of a run from its config: the training and validation loaders and what the model
needs to know about the data (classes, channels, normalisation)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from kaisoku.config import Config, data_settings
from kaisoku.data.counters import LoaderCounters
from kaisoku.data.datagen import ensure_demo_dataset
from kaisoku.data.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.folder import FolderSampler, ImageFolderDataset, ShardedEvalSampler, split_train_val
from kaisoku.data.format import Index, read_index
from kaisoku.data.loader import ShardLoader, label_count, packed_splits
from kaisoku.data.sampler import KeyedMicroBatches
from kaisoku.data.shuffle import ShuffleSpec
from kaisoku.data.transforms import IMAGENET_MEAN, IMAGENET_STD, AugmentSpec, collate
from kaisoku.distributed import env
from kaisoku.errors import ConfigError


def dataset_root(cfg: Config) -> Path:
    """The dataset folder: ``data.path``, or the demo set generated on first use (shapes; universes for
    ``cosmoflow``)."""
    if cfg.data.path:
        return Path(cfg.data.path).expanduser()
    if cfg.model.name == "cosmoflow":  # the generated universe set, at data.image_size cubed
        from kaisoku.data.cosmo import ensure_cosmo_dataset

        return ensure_cosmo_dataset(cfg.data.cache_dir, size=cfg.data.image_size)
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
    task: str = "classification"
    """``classification`` (int labels, images) or ``regression`` (float targets, volumes)."""
    sample_shape: tuple[int, ...] = ()
    """The shape of one input sample, without the batch: ``(C, D, D, D)`` for volumes, () for images."""


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
    if read_index(train_dir).task == "regression":
        return _volume_data(cfg, world, device, train_dir, val_dir, shard, val_sampler_args)
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


def _volume_data(
    cfg: Config,
    world: env.World,
    device: torch.device,
    train_dir: Path,
    val_dir: Path | None,
    shard: tuple[int, int] | None,
    val_sampler_args: dict[str, int],
) -> DataParts:
    """Loaders of a regression set of volumes: log1p volumes (flipped for training) and float targets."""
    from kaisoku.data.cosmo import VolumeTargetTransform

    train_set = ShardedDataset(
        train_dir,
        transform=VolumeTargetTransform(
            seed=cfg.train.seed, train=True, target_field=str(read_index(train_dir).target)
        ),
        skip_corrupt=cfg.data.skip_corrupt,
    )
    volume = volume_field(train_set.index)
    loader = shard_loader(cfg, world, device, train_set, shard=shard)
    val_loader = None
    if val_dir is not None:
        val_set = ShardedDataset(
            val_dir,
            transform=VolumeTargetTransform(
                seed=cfg.train.seed, train=False, target_field=str(train_set.index.target)
            ),
            skip_corrupt=cfg.data.skip_corrupt,
        )
        sampler = ShardedEvalSampler(len(val_set), **val_sampler_args)
        val_loader = _loader(val_set, sampler, cfg.data.workers, device)
    target = train_set.index.field(str(train_set.index.target))
    return DataParts(
        train_loader=loader,
        train_sampler=loader,
        val_loader=val_loader,
        num_classes=int(np.prod(target.shape or (1,))),
        in_channels=int(volume[0]),
        mean=(),
        std=(),
        task="regression",
        sample_shape=volume,
    )


def volume_field(index: Index) -> tuple[int, ...]:
    """The ``(C, D, D, D)`` shape of a volume set's input field ``x``; a clear error for anything else."""
    for field in index.fields:
        if field.name != index.target and field.kind == "array" and field.shape and len(field.shape) == 4:
            return tuple(int(d) for d in field.shape)
    shapes = ", ".join(f"{f.name} {list(f.shape or [])}" for f in index.fields)
    raise ConfigError(
        f"{index.root} is a regression set without a volume field [C, D, D, D] (fields: {shapes}); "
        "generate one with kaisoku datagen DIR --kind cosmo"
    )


def data_conflict(cfg: Config) -> str | None:
    """Why ``cfg``'s dataset does not fit its model or loss (one line naming both sides), else None.

    Reads only the packed index (no shards), so ``kaisoku train`` can say it before any rank starts.
    """
    volumetric = cfg.model.name == "cosmoflow"
    path = Path(cfg.data.path).expanduser() if cfg.data.path else None
    if path is not None and not path.exists():
        return None  # a missing path is reported as such where the data is opened
    packed = packed_splits(path) if path is not None else None
    if path is not None and packed is not None:
        index = read_index(packed[0])
        task = index.task or "classification"
        shape = next((list(f.shape or []) for f in index.fields if f.name in ("x", "image")), [])
        what = f"data.path {path} holds {'volumes' if task == 'regression' else 'images'} {shape} ({task})"
    elif path is None and volumetric:
        task, what = "regression", "the generated universe set"
    else:
        task = "classification"
        what = f"data.path {path or '(the generated shapes set)'} holds 2D images (classification)"
    if volumetric and task != "regression":
        return (
            f"model.name cosmoflow takes volumes [4, D, D, D] with regression targets, but {what}; "
            "generate a volume set with kaisoku datagen DIR --kind cosmo and pack it"
        )
    if not volumetric and task == "regression":
        return f"{what}, but model.name {cfg.model.name} is a 2D image classifier; use --model.name cosmoflow"
    loss = cfg.train.loss
    if loss != "auto" and (loss == "mse") != (task == "regression"):
        return f"train.loss {loss} does not fit {what}; use train.loss auto"
    if task == "regression" and cfg.train.label_smoothing > 0:
        smoothing = cfg.train.label_smoothing
        return f"train.label_smoothing {smoothing} is for classification, but {what}; set it to 0"
    return None


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
