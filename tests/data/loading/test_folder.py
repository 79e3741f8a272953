"""Image-folder datasets, the keyed train/validation split and the validation sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.datagen import generate
from kaisoku.data.loading.folder import (
    ImageFolderDataset,
    ShardedEvalSampler,
    scan_class_folders,
    split_train_val,
)
from kaisoku.data.loading.transforms import AugmentSpec
from kaisoku.errors import KaisokuError


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
    with pytest.raises(KaisokuError, match="star holds no images"):
        scan_class_folders(root / "train")
