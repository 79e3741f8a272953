"""Image-folder datasets for training without packing, and the validation sampler.

The folder is scanned by :mod:`kaisoku.data.sources` (the scanner ``kaisoku pack`` uses, so both see
the same images); training batches come from :class:`kaisoku.data.sampler.EpochSampler`. A dataset
item is addressed by ``(epoch, index)`` rather than ``index`` alone, so that the augmentation of a
sample is a pure function of (seed, epoch, index) in whichever worker decodes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from kaisoku.data.sources import VAL_SPLIT_NAMES, ImageTree, scan_image_folder, scan_image_tree
from kaisoku.data.transforms import AugmentSpec, augment, decode_image
from kaisoku.errors import KaisokuError


@dataclass(frozen=True)
class FileList:
    """Image files with integer labels, and the class names the labels index."""

    files: tuple[str, ...]
    labels: np.ndarray
    classes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.files)


def _file_list(tree: ImageTree, split: str) -> FileList:
    labels = np.asarray([label for _, label, _ in tree.splits[split]], dtype=np.int64)
    return FileList(tuple(tree.files(split)), labels, tree.classes)


def scan_class_folders(root: Path, classes: tuple[str, ...] | None = None) -> FileList:
    """The images of ``root/<class>/**`` with their labels (:func:`~kaisoku.data.sources.scan_image_folder`)."""
    names, items = scan_image_folder(root, classes)
    tree = ImageTree(root, tuple(names), {"": items})
    return _file_list(tree, "")


def split_train_val(root: Path, val_fraction: float, seed: int) -> tuple[FileList, FileList]:
    """The train and validation lists of the image folder ``root``, scanned as ``kaisoku pack`` scans it.

    A tree of splits gives its ``train`` split and its first of val, valid, validation, test; without
    one of those (or without split folders) a fraction ``val_fraction`` of the images, chosen by a
    permutation keyed by ``seed``, is held out for validation.
    """
    if not root.is_dir():
        raise KaisokuError(f"dataset folder {root} does not exist")
    tree = scan_image_tree(root)
    if "" in tree.splits:
        everything = _file_list(tree, "")
    elif "train" not in tree.splits:
        raise KaisokuError(
            f"{root} holds the splits {', '.join(tree.splits)} but no train/; add {root}/train"
        )
    else:
        val_split = next((name for name in VAL_SPLIT_NAMES if name in tree.splits), None)
        if val_split is not None:
            return _file_list(tree, "train"), _file_list(tree, val_split)
        everything = _file_list(tree, "train")
    order = np.random.Generator(np.random.PCG64([seed, 0x5EED])).permutation(len(everything))
    n_val = int(round(len(everything) * val_fraction))
    if n_val == 0 or n_val == len(everything):
        raise KaisokuError(
            f"{root}: val_fraction {val_fraction} leaves no validation or no training images; "
            "add a val/ folder or change data.val_fraction"
        )
    val_idx, train_idx = np.sort(order[:n_val]), np.sort(order[n_val:])

    def pick(idx: np.ndarray) -> FileList:
        return FileList(tuple(everything.files[i] for i in idx), everything.labels[idx], everything.classes)

    return pick(train_idx), pick(val_idx)


class ImageFolderDataset(Dataset):
    """Decoded, augmented samples of a :class:`FileList`, addressed by ``(epoch, index)``."""

    def __init__(self, files: FileList, spec: AugmentSpec, *, seed: int) -> None:
        self.files = files
        self.spec = spec
        self.seed = seed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: tuple[int, int]) -> tuple[np.ndarray, int]:
        epoch, index = key
        path = self.files.files[index]
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise KaisokuError(f"cannot read {path}: {error.strerror}") from None
        image = decode_image(data, name=path)
        sample = augment(image, self.spec, seed=self.seed, epoch=epoch, index=index)
        return sample, int(self.files.labels[index])


class ShardedEvalSampler:
    """This rank's validation batches: every sample exactly once over all ranks, fixed order."""

    def __init__(self, num_samples: int, *, batch_size: int, rank: int, world_size: int) -> None:
        self.indices = np.arange(rank, num_samples, world_size)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return (len(self.indices) + self.batch_size - 1) // self.batch_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for start in range(0, len(self.indices), self.batch_size):
            yield [(0, int(i)) for i in self.indices[start : start + self.batch_size]]
