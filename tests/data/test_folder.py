"""Class-folder datasets and the (seed, epoch)-keyed epoch sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.datagen import generate
from kaisoku.data.folder import (
    EpochBatchSampler,
    ImageFolderDataset,
    ShardedEvalSampler,
    epoch_order,
    scan_class_folders,
    split_train_val,
)
from kaisoku.data.transforms import AugmentSpec
from kaisoku.errors import KaisokuError


def _steps(num: int, batch: int, world: int, epoch: int, accum: int = 1) -> list[list[int]]:
    """For each optimizer step, the union of all ranks' sample indices, in rank order."""
    per_rank = []
    for rank in range(world):
        sampler = EpochBatchSampler(
            num, global_batch=batch, rank=rank, world_size=world, seed=7, micro_batches=accum
        )
        sampler.set_epoch(epoch)
        micro = list(sampler)
        per_rank.append(
            [sum((m for m in micro[s * accum : (s + 1) * accum]), []) for s in range(sampler.steps_per_epoch)]
        )
    return [[i for rank in range(world) for _, i in per_rank[rank][step]] for step in range(len(per_rank[0]))]


def test_step_contents_do_not_depend_on_world_size_or_accumulation() -> None:
    one = _steps(100, 16, 1, epoch=3)
    assert one == _steps(100, 16, 2, epoch=3)
    assert one == _steps(100, 16, 4, epoch=3, accum=2)
    assert len(one) == 100 // 16  # the short tail is dropped
    flat = [i for step in one for i in step]
    assert len(set(flat)) == len(flat)


def test_order_is_keyed_by_seed_and_epoch() -> None:
    assert np.array_equal(epoch_order(50, 1, 2), epoch_order(50, 1, 2))
    assert not np.array_equal(epoch_order(50, 1, 2), epoch_order(50, 1, 3))
    assert not np.array_equal(epoch_order(50, 1, 2), epoch_order(50, 2, 2))


def test_start_step_skips_exactly_the_consumed_steps() -> None:
    sampler = EpochBatchSampler(64, global_batch=8, rank=1, world_size=2, seed=0)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start_step=3)
    assert list(sampler) == full[3:]
    assert sampler.state_dict()["step"] == 3


def test_sampler_rejects_batches_that_do_not_divide() -> None:
    with pytest.raises(KaisokuError, match="not divisible by the 3 ranks"):
        EpochBatchSampler(100, global_batch=16, rank=0, world_size=3, seed=0)
    with pytest.raises(KaisokuError, match="not divisible by train.grad_accum 3"):
        EpochBatchSampler(100, global_batch=16, rank=0, world_size=2, seed=0, micro_batches=3)
    with pytest.raises(KaisokuError, match="fewer than one global batch"):
        EpochBatchSampler(10, global_batch=16, rank=0, world_size=2, seed=0)


def test_eval_sampler_covers_every_sample_once() -> None:
    seen = [
        i
        for r in range(3)
        for batch in ShardedEvalSampler(10, batch_size=2, rank=r, world_size=3)
        for _, i in batch
    ]
    assert sorted(seen) == list(range(10))


def test_folder_dataset_and_keyed_split(tmp_path: Path) -> None:
    root = generate(tmp_path / "d", count=30, size=16, val_count=10, workers=1)
    train, val = split_train_val(root, 0.1, seed=0)
    assert (len(train), len(val)) == (30, 10)
    flat = scan_class_folders(root / "train")
    a, b = split_train_val(root / "train", 0.2, seed=0)
    assert len(a) + len(b) == len(flat) and len(b) == 6
    assert set(a.files).isdisjoint(b.files)
    dataset = ImageFolderDataset(train, AugmentSpec(size=12, scale=(0.5, 1.0)), seed=0)
    image, label = dataset[(0, 5)]
    assert image.shape == (3, 12, 12) and image.dtype == np.uint8
    assert label == int(train.labels[5])
    assert np.array_equal(dataset[(0, 5)][0], image)
    assert not np.array_equal(dataset[(1, 5)][0], image)


def test_empty_class_folder_is_named(tmp_path: Path) -> None:
    root = generate(tmp_path / "d", count=20, size=16, workers=1)
    for path in (root / "train" / "star").iterdir():
        path.unlink()
    with pytest.raises(KaisokuError, match="star has no images"):
        scan_class_folders(root / "train")
