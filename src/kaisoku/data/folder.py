"""Class-folder image datasets and the rank's epoch sampler keyed by (seed, epoch).

A dataset item is addressed by ``(epoch, index)`` rather than ``index`` alone, so that the
augmentation of a sample is a pure function of (seed, epoch, index) in whichever worker decodes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from kaisoku.data.transforms import AugmentSpec, augment, decode_image
from kaisoku.errors import KaisokuError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


@dataclass(frozen=True)
class FileList:
    """Image files with integer labels, and the class names the labels index."""

    files: tuple[str, ...]
    labels: np.ndarray
    classes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.files)


def scan_class_folders(root: Path, classes: tuple[str, ...] | None = None) -> FileList:
    """List ``root/<class>/<image>`` files in sorted order; labels follow the sorted class names."""
    if not root.is_dir():
        raise KaisokuError(f"dataset folder {root} does not exist")
    found = tuple(sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")))
    classes = classes or found
    if not classes:
        raise KaisokuError(f"{root} has no class sub-folders; expected {root}/<class>/<image files>")
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        folder = root / name
        images = (
            sorted(str(p) for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if folder.is_dir()
            else []
        )
        if not images:
            raise KaisokuError(f"class folder {folder} has no images; add some or remove the folder")
        files.extend(images)
        labels.extend([label] * len(images))
    return FileList(tuple(files), np.asarray(labels, dtype=np.int64), classes)


def split_train_val(root: Path, val_fraction: float, seed: int) -> tuple[FileList, FileList]:
    """The train and validation lists: ``root/train`` and ``root/val`` when both exist, else a keyed split."""
    if (root / "train").is_dir() and (root / "val").is_dir():
        train = scan_class_folders(root / "train")
        return train, scan_class_folders(root / "val", train.classes)
    everything = scan_class_folders(root)
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


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's global sample order: a permutation keyed by (seed, epoch) alone."""
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(num_samples)


class EpochBatchSampler:
    """Yields this rank's micro-batches of ``(epoch, index)`` keys for one epoch at a time.

    Each global batch of ``global_batch`` samples is cut into equal rank slices, and each slice into
    ``micro_batches`` equal parts; the tail shorter than a global batch is dropped. The global order
    depends only on (seed, epoch), so the samples of a step do not depend on the world size.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        micro_batches: int = 1,
    ) -> None:
        per_rank, rest = divmod(global_batch, world_size)
        if rest:
            raise KaisokuError(
                f"data.global_batch {global_batch} is not divisible by the {world_size} ranks; "
                f"use a multiple of {world_size}"
            )
        if per_rank % micro_batches:
            raise KaisokuError(
                f"per-rank batch {per_rank} is not divisible by train.grad_accum {micro_batches}"
            )
        if num_samples < global_batch:
            raise KaisokuError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch}"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.micro_batches = micro_batches
        self.epoch = 0
        self.start_step = 0

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch."""
        return self.num_samples // self.global_batch

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Make the next iteration cover ``epoch`` from optimizer step ``start_step`` on."""
        self.epoch = epoch
        self.start_step = start_step

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.micro_batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        order = epoch_order(self.num_samples, self.seed, self.epoch)
        per_rank = self.global_batch // self.world_size
        micro = per_rank // self.micro_batches
        for step in range(self.start_step, self.steps_per_epoch):
            start = step * self.global_batch + self.rank * per_rank
            rank_slice = order[start : start + per_rank]
            for k in range(self.micro_batches):
                yield [(self.epoch, int(i)) for i in rank_slice[k * micro : (k + 1) * micro]]

    def state_dict(self) -> dict[str, Any]:
        """Position and the values the order depends on."""
        return {
            "epoch": self.epoch,
            "step": self.start_step,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved epoch and step; KaisokuError when the state is for another order."""
        for key in ("seed", "num_samples", "global_batch"):
            if state.get(key) != getattr(self, key):
                raise KaisokuError(
                    f"the saved data order has {key}={state.get(key)}, this run {getattr(self, key)}; "
                    "resume with the same data settings or start a new --run-dir"
                )
        self.set_epoch(int(state["epoch"]), int(state["step"]))


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
