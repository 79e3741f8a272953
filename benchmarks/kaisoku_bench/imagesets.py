"""The generated JPEG sets the loader benchmarks read, and kaisoku's side of their rows.

:func:`image_set` generates class folders of JPEGs (:func:`kaisoku.data.datagen.generate`) and packs
them (:func:`kaisoku.data.shards.writer.pack`) on first use, under :func:`data_root`, where they are kept between
runs. Shared by ``kaisoku bench loader`` (warm local data) and ``kaisoku bench slowfs`` (a slow shared
file system).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import simplejpeg
import torch

from kaisoku.config import Config
from kaisoku.data.datagen import generate
from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.loading.folder import FileList, scan_class_folders
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.data.loading.transforms import AugmentSpec
from kaisoku.data.shards.format import Index, read_index
from kaisoku.data.shards.recode import ImageRecode
from kaisoku.data.shards.writer import pack
from kaisoku.distributed.env import World
from kaisoku.engine.data_build import shard_loader
from kaisoku.run_facts import plan_run
from kaisoku_bench.common import checked_data_path

BATCH = 256
"""Samples per batch in every row."""
WORKERS = 2
"""DataLoader workers per row."""
SEED = 0
"""Seed of the generated sets, the shuffles and the flips."""


def log(message: str) -> None:
    """Progress on stderr, with the time."""
    print(f"[bench loader {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- data sets


@dataclass(frozen=True)
class ImageSet:
    """A generated JPEG set: class folders, their file list and a kaisoku pack of them."""

    name: str
    size: int
    count: int
    folder: Path
    files: FileList
    pack_dir: Path
    index: Index

    @property
    def file_bytes(self) -> int:
        """Total bytes of the JPEG files."""
        return int(sum(os.path.getsize(f) for f in self.files.files))

    def shuffled_files(self) -> list[tuple[str, int]]:
        """(path, label) in a seed-keyed random order, for peer formats (so their shards mix classes)."""
        order = np.random.Generator(np.random.PCG64([SEED, 0xFEED])).permutation(len(self.files))
        return [(self.files.files[i], int(self.files.labels[i])) for i in order]


def data_root() -> Path:
    """Where generated sets and peer formats are kept between runs (regenerating costs minutes):
    ``$KAISOKU_BENCH_DATA``, else a folder in the temporary folder; never inside ``benchmarks/results``."""
    root = os.environ.get("KAISOKU_BENCH_DATA", "")
    if root:
        return checked_data_path(Path(root), "$KAISOKU_BENCH_DATA")
    return checked_data_path(Path(tempfile.gettempdir()) / "kaisoku-bench-loader", "the temporary folder")


def image_set(count: int, size: int, shard_bytes: str) -> ImageSet:
    """The set of ``count`` ``size``-pixel JPEGs, generated and packed on first use."""
    root = data_root()
    folder = root / f"shapes-{count}-{size}px"
    if not (folder / "manifest.json").exists():
        log(f"generating {count} JPEGs at {size}x{size} into {folder}")
        start = time.perf_counter()
        generate(folder, count=count, size=size, val_count=0, seed=SEED, workers=len(os.sched_getaffinity(0)))
        log(f"generated in {time.perf_counter() - start:.1f} s")
    pack_dir = root / f"shapes-{count}-{size}px-kaisoku-{shard_bytes}"
    if not (pack_dir / "index.json").exists():
        start = time.perf_counter()
        pack(folder / "train", pack_dir, shard_bytes=shard_bytes, overwrite=True, progress=False, seed=SEED)
        log(f"packed {folder.name} in {time.perf_counter() - start:.1f} s")
    return ImageSet(
        name=f"{size}px",
        size=size,
        count=count,
        folder=folder / "train",
        files=scan_class_folders(folder / "train"),
        pack_dir=pack_dir,
        index=read_index(pack_dir),
    )


OWN_FORMAT = ImageRecode(quality=90, subsampling="420")
"""kaisoku's own preferred format for the speed rows: the JPEGs re-encoded by ``kaisoku pack --jpeg-quality 90
--jpeg-subsampling 420``, as FFCV's writer re-encodes them (quality 90, 4:2:0 chroma)."""


def own_format_pack(image_set: ImageSet) -> Path:
    """``image_set`` packed again in :data:`OWN_FORMAT` (once, kept between runs), beside its plain pack."""
    return _recoded_pack(image_set, OWN_FORMAT, f"q{OWN_FORMAT.quality}-{OWN_FORMAT.subsampling}")


def raw_pixel_pack(image_set: ImageSet) -> Path:
    """``image_set`` packed again as raw pixels (``kaisoku pack --raw-side <its size>``: every image, decoded
    once; the format for tiny images), once, kept between runs, beside its plain pack."""
    return _recoded_pack(image_set, ImageRecode(quality=0, raw_side=image_set.size), "raw")


def _recoded_pack(image_set: ImageSet, recode: ImageRecode, suffix: str) -> Path:
    pack_dir = image_set.pack_dir.with_name(f"{image_set.pack_dir.name}-{suffix}")
    if not (pack_dir / "index.json").exists():
        start = time.perf_counter()
        pack(
            image_set.folder,
            pack_dir,
            shard_bytes=image_set.index.nbytes // max(1, len(image_set.index.shards)),  # the same shard size
            overwrite=True,
            progress=False,
            seed=SEED,
            recode=recode,
        )
        log(f"packed {image_set.folder.parent.name} re-encoded in {time.perf_counter() - start:.1f} s")
    return pack_dir


# --------------------------------------------------------------------------------------------- kaisoku parts


def flip_transform(size: int) -> ImageLabelTransform:
    """kaisoku's transform for "decode + random flip": a full-image crop (scale and ratio 1), flip keyed by
    (seed, epoch, index)."""
    return ImageLabelTransform(spec=AugmentSpec(size=size, scale=(1.0, 1.0), ratio=(1.0, 1.0)), seed=SEED)


def work_transform(size: int, crop: bool) -> ImageLabelTransform:
    """kaisoku's transform for a row set's work: random-resized-crop to ``size`` + flip (the one ``kaisoku
    train`` builds) when ``crop``, else :func:`flip_transform`."""
    if crop:
        return ImageLabelTransform(spec=AugmentSpec(size=size, train=True), seed=SEED)
    return flip_transform(size)


def production_loader(
    pack_dir: Path,
    transform: ImageLabelTransform,
    *,
    workers: int = WORKERS,
    batch_path: str = "batch",
) -> ShardLoader:
    """The :class:`ShardLoader` ``kaisoku train`` builds for a run on ``pack_dir`` (one rank, global shuffle,
    batch :data:`BATCH`, ``workers`` decoding workers (processes on the batch path, threads on ``threads``), ``batch_path`` as ``data.loader``), from a config
    through the training builder (:func:`kaisoku.engine.data_build.shard_loader`), over a dataset with
    ``transform``."""
    cfg = Config()
    cfg.data.path = str(pack_dir)
    cfg.data.global_batch = BATCH
    cfg.data.workers = workers
    cfg.data.loader = batch_path  # type: ignore[assignment]  # checked by the config against its choices
    cfg.train.seed = SEED
    cfg.train.epochs = 10**6
    dataset = ShardedDataset(pack_dir, transform=transform)
    return shard_loader(plan_run(cfg, 1), World(), torch.device("cpu"), dataset)


def epoch_of(loader: ShardLoader, epoch: int) -> ShardLoader:
    """``loader`` set to ``epoch`` from its start, ready to iterate (as the trainer does each epoch)."""
    loader.set_epoch(epoch, 0)
    return loader


def _photo(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A photo-like image: smooth colour fields, a few shapes, sensor-like noise (JPEGs of ~35 KB at q90)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phases = rng.uniform(0, 6.3, (3, 4))
    scales = rng.uniform(12, 60, (3, 2))
    image = np.stack(
        [
            128
            + 70 * np.sin(x / scales[c, 0] + phases[c, 0]) * np.cos(y / scales[c, 1] + phases[c, 1])
            + 30 * np.sin((x + y) / (scales[c, 0] / 3) + phases[c, 2])
            for c in range(3)
        ],
        axis=-1,
    )
    for _ in range(4):
        cy, cx, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(15, 80)
        image[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    image += rng.normal(0, 2.5, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def photo_set(count: int, classes: int = 10) -> ImageSet:
    """The ImageNet-like set: ``count`` JPEGs of about 400 x 350 px at quality 90 in class folders, packed."""
    root = data_root()
    folder = root / f"photos-v2-{count}"
    if not (folder / "done").exists():
        log(f"generating {count} photo-like JPEGs (~400 x 350, q90) into {folder}")
        start = time.perf_counter()
        rng = np.random.Generator(np.random.PCG64([SEED, count]))
        for k in range(count):
            height, width = int(rng.integers(320, 381)), int(rng.integers(370, 431))
            target = folder / "train" / f"class{k % classes:02d}" / f"img{k:06d}.jpg"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(simplejpeg.encode_jpeg(_photo(rng, height, width), quality=90))
        (folder / "done").write_text("ok\n")
        log(f"generated in {time.perf_counter() - start:.1f} s")
    pack_dir = root / f"photos-v2-{count}-kaisoku"
    if not (pack_dir / "index.json").exists():
        pack(folder / "train", pack_dir, shard_bytes="16MiB", overwrite=True, progress=False, seed=SEED)
    return ImageSet(
        name="imagenet-like",
        size=160,
        count=count,
        folder=folder / "train",
        files=scan_class_folders(folder / "train"),
        pack_dir=pack_dir,
        index=read_index(pack_dir),
    )
