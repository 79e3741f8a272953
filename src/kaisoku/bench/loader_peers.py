"""The peer loaders of ``kaisoku bench loader`` part (a): same samples, same output, other libraries.

Every peer yields uint8 NCHW batches of decoded, randomly flipped images with int64 labels through a
``torch.utils.data.DataLoader`` with the caller's worker count and batch size. Peers store the JPEG bytes
as they are and decode them with simplejpeg (the decoder kaisoku uses) in the dataset, so that the rows
compare loaders, not decoders; the ImageFolder row decodes with PIL, as torchvision's ImageFolder does,
and a second ImageFolder row uses simplejpeg. Each builder writes its format once (kept between runs)
and returns a :class:`PeerLoader`, or raises :class:`PeerMissing` when its library is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg
import torch
from torch.utils.data import DataLoader

PEERS = ("imagefolder-pil", "imagefolder-simplejpeg", "webdataset", "mds", "litdata")
"""Peer row names, in table order."""

_DONE = ".kaisoku-bench-complete"


class PeerMissing(Exception):
    """A peer's library is not installed; the message says which package to install."""


@dataclass
class PeerLoader:
    """A peer's epoch: ``make()`` returns a fresh iterable of ``(images, labels)`` batches."""

    name: str
    decoder: str
    make: Callable[[], Iterable[Any]]
    close: Callable[[], None] = lambda: None


def _require(module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise PeerMissing(f"not installed: pip install {package}")


def decode_flip(data: bytes, flip: bool) -> torch.Tensor:
    """Decode JPEG bytes with simplejpeg, flip horizontally if asked, as a CHW uint8 tensor."""
    image = simplejpeg.decode_jpeg(data, colorspace="RGB")
    if flip:
        image = image[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))


def _complete(directory: Path) -> bool:
    return (directory / _DONE).exists()


def _fresh(directory: Path) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def _mark_complete(directory: Path, what: dict[str, Any]) -> None:
    (directory / _DONE).write_text(json.dumps(what) + "\n")


# ---------------------------------------------------------------------------------------- ImageFolder rows


def read_bytes(path: str) -> bytes:
    """The whole file at ``path``."""
    with open(path, "rb") as handle:
        return handle.read()


class _SimplejpegFlip:
    """ImageFolder transform for the simplejpeg row: bytes -> flipped CHW uint8 tensor."""

    def __call__(self, data: bytes) -> torch.Tensor:
        return decode_flip(data, random.random() < 0.5)


def imagefolder(root: Path, *, decoder: str, batch: int, workers: int) -> PeerLoader:
    """torchvision ImageFolder over the JPEG files: PIL (``RandomHorizontalFlip``, ``PILToTensor``) or simplejpeg."""
    from torchvision import datasets, transforms

    if decoder == "pil":
        dataset = datasets.ImageFolder(
            str(root),
            transform=transforms.Compose([transforms.RandomHorizontalFlip(), transforms.PILToTensor()]),
        )
    else:
        dataset = datasets.ImageFolder(str(root), loader=read_bytes, transform=_SimplejpegFlip())

    def make() -> Iterable[Any]:
        return DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)

    return PeerLoader(f"imagefolder-{decoder}", "PIL" if decoder == "pil" else "simplejpeg", make)


# ------------------------------------------------------------------------------------------------ WebDataset


def _wds_sample(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    return decode_flip(sample["jpg"], random.random() < 0.5), int(sample["cls"])


def webdataset(
    files: Sequence[tuple[str, int]], directory: Path, *, batch: int, workers: int, shard_samples: int = 1000
) -> PeerLoader:
    """WebDataset tar shards; shard shuffle, a 1,000-sample shuffle buffer, batching in the workers."""
    _require("webdataset", "webdataset")
    import webdataset as wds

    if not _complete(directory):
        _fresh(directory)
        with wds.ShardWriter(str(directory / "shard-%05d.tar"), maxcount=shard_samples, verbose=0) as sink:
            for i, (path, label) in enumerate(files):
                sink.write({"__key__": f"{i:07d}", "jpg": read_bytes(path), "cls": str(label).encode()})
        _mark_complete(directory, {"samples": len(files)})
    urls = [str(p) for p in sorted(directory.glob("shard-*.tar"))]

    def make() -> Iterable[Any]:
        dataset = (
            wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
            .shuffle(1000)
            .map(_wds_sample)
            .batched(batch, partial=False)
        )
        return DataLoader(dataset, batch_size=None, num_workers=workers)

    return PeerLoader("webdataset", "simplejpeg", make)


# ------------------------------------------------------------------------------------- MosaicML Streaming


def mds(files: Sequence[tuple[str, int]], directory: Path, *, batch: int, workers: int) -> PeerLoader:
    """MosaicML Streaming MDS shards read from a local directory, its default shuffle (py1e)."""
    _require("streaming", "mosaicml-streaming")
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    if not _complete(directory):
        _fresh(directory)
        with MDSWriter(
            out=str(directory / "data"), columns={"jpg": "bytes", "cls": "int"}, size_limit=1 << 26
        ) as out:
            for path, label in files:
                out.write({"jpg": read_bytes(path), "cls": int(label)})
        _mark_complete(directory, {"samples": len(files)})
    clean_stale_shared_memory()

    class _Flip(StreamingDataset):
        def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
            sample = super().__getitem__(index)
            return decode_flip(sample["jpg"], random.random() < 0.5), int(sample["cls"])

    dataset = _Flip(local=str(directory / "data"), shuffle=True, batch_size=batch, shuffle_seed=1)

    def make() -> Iterable[Any]:
        return DataLoader(dataset, batch_size=batch, num_workers=workers, drop_last=True)

    return PeerLoader("mds", "simplejpeg", make, close=clean_stale_shared_memory)


# ---------------------------------------------------------------------------------------------------- LitData


class _LitFlip:
    """LitData transform: ``{"jpg", "cls"}`` -> (flipped CHW uint8 tensor, label)."""

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        return decode_flip(sample["jpg"], random.random() < 0.5), int(sample["cls"])


def litdata(files: Sequence[tuple[str, int]], directory: Path, *, batch: int, workers: int) -> PeerLoader:
    """LitData chunks (its BinaryWriter, the engine behind ``optimize``) and its StreamingDataLoader."""
    _require("litdata", "litdata")
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.writer import BinaryWriter

    if not _complete(directory):
        _fresh(directory)
        writer = BinaryWriter(str(directory / "data"), chunk_bytes="64MB")
        for i, (path, label) in enumerate(files):
            writer[i] = {"jpg": read_bytes(path), "cls": int(label)}
        writer.done()
        writer.merge()
        _mark_complete(directory, {"samples": len(files)})
    cache = directory / "cache"
    dataset = StreamingDataset(
        str(directory / "data"), cache_dir=str(cache), shuffle=True, drop_last=True, transform=_LitFlip()
    )

    def make() -> Iterable[Any]:
        return StreamingDataLoader(dataset, batch_size=batch, num_workers=workers, drop_last=True)

    return PeerLoader("litdata", "simplejpeg", make)
