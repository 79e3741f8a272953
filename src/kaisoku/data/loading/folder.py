"""Image-folder datasets for training without packing, and the validation sampler.

The folder is scanned by :mod:`kaisoku.data.shards.sources` (the scanner ``kaisoku pack`` uses, so both see
the same images); training batches come from :class:`kaisoku.data.order.sampler.EpochSampler`. A dataset
item is addressed by ``(epoch, index)`` rather than ``index`` alone, so that the augmentation of a
sample is a pure function of (seed, epoch, index) in whichever worker decodes it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from kaisoku.data.loading.counters import LoaderCounters
from kaisoku.data.loading.transforms import AugmentSpec, augment, decode_image
from kaisoku.data.order.sampler import EpochSampler
from kaisoku.data.shards.sources import VAL_SPLIT_NAMES, ImageTree, scan_image_folder, scan_image_tree
from kaisoku.errors import KaisokuError

log = logging.getLogger(__name__)

NETWORK_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "sshfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "9p",
        "afs",
        "davfs",
        "wekafs",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.rclone",
        "fuse.juicefs",
        "fuse.ceph",
        "fuse.glusterfs",
        "fuse.lizardfs",
        "fuse.moosefs",
    }
)
"""Mount types read over a network (or through FUSE to one): where loose files cost a round trip each."""

PACK_HINT_WAIT = 0.3
"""Share of an epoch spent reading files above which an image folder on a slow mount gets the hint."""


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
    """The images of ``root/<class>/**`` with their labels (:func:`~kaisoku.data.shards.sources.scan_image_folder`)."""
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


def mount_type(path: str | os.PathLike[str], mounts_file: str = "/proc/self/mounts") -> str:
    """The file-system type of the mount holding ``path`` (longest matching mount point); "" if unknown."""
    target = os.path.realpath(path)
    best, best_type = "", ""
    try:
        with open(mounts_file, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, parts[2]
    return best_type


def is_slow_mount(fs_type: str) -> bool:
    """Whether ``fs_type`` is read over a network (each loose file a round trip)."""
    return fs_type in NETWORK_FS_TYPES or fs_type.startswith("fuse.") or fs_type == "fuse"


def pack_hint(root: str | os.PathLike[str], fs_type: str, wait_fraction: float) -> str | None:
    """The one-line suggestion to pack an image folder read from a slow mount, or None when not warranted.

    ``wait_fraction`` is the share of the epoch's time spent reading files; if the reads vanish, as
    sequential shard reads from a node cache make them, the epoch takes ``1 - wait_fraction`` of its time.
    """
    if not is_slow_mount(fs_type) or wait_fraction < PACK_HINT_WAIT:
        return None
    gain = 1.0 / max(1.0 - min(wait_fraction, 0.95), 0.05)
    return (
        f"data: {root} is an image folder on a {fs_type} mount and reading its files took "
        f"{100 * wait_fraction:.0f}% of the epoch; kaisoku pack {root} DST and training on DST "
        f"(with data.local_cache) reads whole shards sequentially: up to {gain:.1f}x faster epochs"
    )


class FolderSampler(EpochSampler):
    """The image-folder path's training sampler: an :class:`EpochSampler` that also reports the epoch's reads.

    ``counters`` are the ones the folder dataset counts into; ``root`` and ``workers`` let
    :meth:`epoch_stats` say once when packing the folder would help (see :func:`pack_hint`).
    """

    def __init__(self, *args: Any, counters: LoaderCounters, root: Path, workers: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counters = counters
        self.root = root
        self.workers = workers
        self._since = time.monotonic()
        self._hinted = False

    def epoch_stats(self) -> dict[str, float] | None:
        """Files read, their bytes, seconds spent reading them (over the workers) and damaged samples skipped
        since the previous call (None: nothing read)."""
        counted = self.counters.since_last()
        now, started = time.monotonic(), self._since
        self._since = now
        if counted["source_records"] == 0:
            return None
        wait = counted["read_ns"] / 1e9 / max(1, self.workers) / max(now - started, 1e-9)
        if not self._hinted and self.rank == 0:
            hint = pack_hint(self.root, mount_type(self.root), wait)
            if hint is not None:
                self._hinted = True
                log.warning("%s", hint)
        return {
            "skipped_records": counted["skipped_records"],
            "source_reads": counted["source_records"],
            "source_bytes": counted["served_source_bytes"],
            "served_ram_bytes": 0,
            "served_local_bytes": 0,
            "served_source_bytes": counted["served_source_bytes"],
            "exchanged_bytes": 0,
            "file_read_s": round(counted["read_ns"] / 1e9, 3),
        }


class ImageFolderDataset(Dataset):
    """Decoded, augmented samples of a :class:`FileList`, addressed by ``(epoch, index)``.

    With ``counters`` every file read is counted there (files, bytes, time spent reading).
    """

    def __init__(
        self, files: FileList, spec: AugmentSpec, *, seed: int, counters: LoaderCounters | None = None
    ) -> None:
        self.files = files
        self.spec = spec
        self.seed = seed
        self.counters = counters

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: tuple[int, int]) -> tuple[np.ndarray, int]:
        epoch, index = key
        path = self.files.files[index]
        started = time.perf_counter_ns()
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise KaisokuError(f"cannot read {path}: {error.strerror}") from None
        if self.counters is not None:
            self.counters.add("read_ns", time.perf_counter_ns() - started)
            self.counters.add("source_records")
            self.counters.add("served_source_bytes", len(data))
        image = decode_image(data, name=path)
        sample = augment(image, self.spec, seed=self.seed, epoch=epoch, index=index)
        return sample, int(self.files.labels[index])


class ShardedEvalSampler:
    """This rank's validation batches: every sample exactly once over all ranks, fixed order."""

    def __init__(self, num_samples: int, *, batch_size: int, rank: int, world_size: int) -> None:
        self.indices = np.arange(rank, num_samples, world_size)
        self.batch_size = batch_size

    @property
    def num_samples(self) -> int:
        """Samples this rank validates on: a validation pass that saw fewer skipped the difference as
        damaged records (``data.skip_corrupt``), which is how validation counts its skips."""
        return len(self.indices)

    def __len__(self) -> int:
        """Batches this rank validates on."""
        return (len(self.indices) + self.batch_size - 1) // self.batch_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for start in range(0, len(self.indices), self.batch_size):
            yield [(0, int(i)) for i in self.indices[start : start + self.batch_size]]

    def first_batch(self) -> list[tuple[int, int]]:
        """The set's first sample as a batch of one, whichever rank this is (a stand-in batch for a rank
        that must run a forward it has no sample of its own for)."""
        return [(0, 0)]
