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
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from kaisoku_bench.common import python_path

try:  # FFCV's rows run this module in FFCV's own venv, which need not have simplejpeg (only the in-process peer rows use it)
    import simplejpeg
except ImportError:
    simplejpeg = None  # type: ignore[assignment]

PEERS = ("imagefolder-pil", "imagefolder-simplejpeg", "webdataset", "mds", "litdata", "spdl")
"""Peer row names, in table order."""

_DONE = ".kaisoku-bench-complete"

_FORMAT_SUFFIX = {
    "litdata": "litdata",
    "mds": "mds",
    "webdataset": "wds",
    "ffcv": "ffcv",
    "ffcv-raw": "ffcv-raw",
}


def format_folder(peer_dir: Path, stem: str, peer: str) -> Path:
    """Where ``peer``'s format of the image set named ``stem`` is written (once, kept between runs): the one
    naming ``kaisoku bench loader`` and ``kaisoku bench slowfs`` share, so each reuses the other's."""
    return peer_dir / f"{stem}-{_FORMAT_SUFFIX[peer]}"


class PeerMissing(Exception):
    """A peer's library is not installed; the message says which package to install."""


@dataclass
class PeerLoader:
    """A peer's epoch: ``make()`` returns the iterable of the next epoch's ``(images, labels)`` batches (the
    peer's one DataLoader, built once with persistent workers: no worker start-up inside an epoch)."""

    name: str
    decoder: str
    make: Callable[[], Iterable[Any]]
    close: Callable[[], None] = lambda: None


def persistent(build: Callable[[], DataLoader]) -> Callable[[], DataLoader]:
    """``make`` for a peer: the DataLoader ``build`` returns, built on the first call and returned again on
    every later one, so that its workers (``persistent_workers=True``) live across epochs, as each peer's
    documentation recommends for multi-epoch training."""
    built: list[DataLoader] = []

    def make() -> DataLoader:
        if not built:
            built.append(build())
        return built[0]

    return make


def _workers(workers: int) -> dict[str, Any]:
    """DataLoader arguments for ``workers`` worker processes that persist across epochs."""
    return {"num_workers": workers, "persistent_workers": workers > 0}


def _require(module: str, package: str) -> None:
    try:  # a dotted name imports its parents, which may be missing themselves
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise PeerMissing(f"not installed: pip install {package}")


def decode_flip(data: bytes, flip: bool) -> torch.Tensor:
    """Decode JPEG bytes with simplejpeg, flip horizontally if asked, as a CHW uint8 tensor."""
    image = simplejpeg.decode_jpeg(data, colorspace="RGB")
    if flip:
        image = image[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))


class DecodeCropFlip:
    """bytes -> CHW uint8 tensor: simplejpeg decode, then torchvision's random-resized-crop to ``crop`` pixels
    (when ``crop`` > 0; bilinear, antialiased) and a random flip: what a peer pipeline does on the
    ImageNet-like row."""

    def __init__(self, crop: int = 0) -> None:
        self.crop = crop

    def __call__(self, data: bytes) -> torch.Tensor:
        """The decoded, cropped, randomly flipped CHW uint8 image."""
        flip = random.random() < 0.5
        if not self.crop:
            return decode_flip(data, flip)
        from torchvision.transforms import RandomResizedCrop
        from torchvision.transforms.v2 import functional

        image = torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB")).permute(2, 0, 1)
        top, left, height, width = RandomResizedCrop.get_params(image, (0.08, 1.0), (3 / 4, 4 / 3))
        out = functional.resized_crop(image, top, left, height, width, [self.crop, self.crop], antialias=True)
        return out.flip(-1).contiguous() if flip else out.contiguous()


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


def imagefolder(root: Path, *, decoder: str, batch: int, workers: int, crop: int = 0) -> PeerLoader:
    """torchvision ImageFolder over the JPEG files: PIL (``RandomHorizontalFlip``, ``PILToTensor``, with
    ``RandomResizedCrop(crop)`` first when ``crop`` > 0) or simplejpeg (:class:`DecodeCropFlip`)."""
    from torchvision import datasets, transforms

    if decoder == "pil":
        steps: list[Any] = [transforms.RandomResizedCrop(crop)] if crop else []
        steps += [transforms.RandomHorizontalFlip(), transforms.PILToTensor()]
        dataset = datasets.ImageFolder(str(root), transform=transforms.Compose(steps))
    else:
        dataset = datasets.ImageFolder(str(root), loader=read_bytes, transform=DecodeCropFlip(crop))

    def build() -> DataLoader:
        return DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True, **_workers(workers))

    return PeerLoader(
        f"imagefolder-{decoder}", "PIL" if decoder == "pil" else "simplejpeg", persistent(build)
    )


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
    return webdataset_reader(directory, batch=batch, workers=workers)


def webdataset_reader(directory: Path, *, batch: int, workers: int) -> PeerLoader:
    """The WebDataset pipeline of :func:`webdataset` over the tar shards already in ``directory`` (which may
    be a read-only mount of the folder they were written to); WebDataset keeps no cache of local files."""
    _require("webdataset", "webdataset")
    import webdataset as wds

    urls = [str(p) for p in sorted(directory.glob("shard-*.tar"))]

    def build() -> DataLoader:
        dataset = (
            wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
            .shuffle(1000)
            .map(_wds_sample)
            .batched(batch, partial=False)
        )
        return DataLoader(dataset, batch_size=None, **_workers(workers))

    return PeerLoader("webdataset", "simplejpeg", persistent(build))


# ------------------------------------------------------------------------------------- MosaicML Streaming


def mds(files: Sequence[tuple[str, int]], directory: Path, *, batch: int, workers: int) -> PeerLoader:
    """MosaicML Streaming MDS shards read from a local directory, its default shuffle (py1e)."""
    _require("streaming", "mosaicml-streaming")
    from streaming import MDSWriter

    if not _complete(directory):
        _fresh(directory)
        with MDSWriter(
            out=str(directory / "data"), columns={"jpg": "bytes", "cls": "int"}, size_limit=1 << 26
        ) as out:
            for path, label in files:
                out.write({"jpg": read_bytes(path), "cls": int(label)})
        _mark_complete(directory, {"samples": len(files)})
    return mds_reader(directory / "data", None, batch=batch, workers=workers)


def mds_reader(data: Path, cache: Path | None, *, batch: int, workers: int) -> PeerLoader:
    """The MDS dataset of :func:`mds` over the shards in ``data``: read in place (``cache`` None), or with
    ``data`` as Streaming's ``remote`` copied shard by shard into its local cache ``cache`` as it reads."""
    _require("streaming", "mosaicml-streaming")
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()

    class _Flip(StreamingDataset):
        def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
            sample = super().__getitem__(index)
            return decode_flip(sample["jpg"], random.random() < 0.5), int(sample["cls"])

    where = {"local": str(data)} if cache is None else {"remote": str(data), "local": str(cache)}
    dataset = _Flip(**where, shuffle=True, batch_size=batch, shuffle_seed=1)

    def build() -> DataLoader:
        return DataLoader(dataset, batch_size=batch, drop_last=True, **_workers(workers))

    return PeerLoader("mds", "simplejpeg", persistent(build), close=clean_stale_shared_memory)


# ---------------------------------------------------------------------------------------------------- LitData


class _LitFlip:
    """LitData transform: ``{"jpg", "cls"}`` -> (CHW uint8 tensor, label) through :class:`DecodeCropFlip`."""

    def __init__(self, crop: int = 0) -> None:
        self.decode = DecodeCropFlip(crop)

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        return self.decode(sample["jpg"]), int(sample["cls"])


def litdata(
    files: Sequence[tuple[str, int]], directory: Path, *, batch: int, workers: int, crop: int = 0
) -> PeerLoader:
    """LitData chunks (its BinaryWriter, the engine behind ``optimize``) and its StreamingDataLoader."""
    _require("litdata", "litdata")
    from litdata.streaming.writer import BinaryWriter

    if not _complete(directory):
        _fresh(directory)
        writer = BinaryWriter(str(directory / "data"), chunk_bytes="64MB")
        for i, (path, label) in enumerate(files):
            writer[i] = {"jpg": read_bytes(path), "cls": int(label)}
        writer.done()
        writer.merge()
        _mark_complete(directory, {"samples": len(files)})
    return litdata_reader(
        str(directory / "data"), directory / "cache", batch=batch, workers=workers, crop=crop
    )


def litdata_reader(source: str, cache: Path, *, batch: int, workers: int, crop: int = 0) -> PeerLoader:
    """The LitData dataset and loader of :func:`litdata` over the chunks at ``source``: a folder (read in
    place) or ``local:FOLDER`` (LitData's remote-folder scheme: chunks copied into its cache ``cache``
    as they are read, as from object storage)."""
    _require("litdata", "litdata")
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(
        source, cache_dir=str(cache), shuffle=True, drop_last=True, transform=_LitFlip(crop)
    )

    def build() -> DataLoader:
        return StreamingDataLoader(dataset, batch_size=batch, drop_last=True, **_workers(workers))

    return PeerLoader("litdata", "simplejpeg", persistent(build))


# ------------------------------------------------------------------------------------------------------ SPDL


def spdl(
    files: Sequence[tuple[str, int]], *, batch: int, workers: int, size: int, seed: int = 0
) -> PeerLoader:
    """SPDL's thread pipeline (``spdl.pipeline``) over the same JPEG files: each epoch's shuffled file list
    in batches, each batch decoded and resized to ``size`` by ``spdl.io.load_image_batch`` (FFmpeg's
    decoder, in native code with the GIL released) in ``workers`` concurrent tasks, as uint8 NCHW views
    of its NHWC buffer. It does no per-sample random flip or crop (its batch filter is one for all
    images), so its row does less work than the others."""
    _require("spdl.pipeline", "spdl")
    _require("spdl.io", "spdl-io")
    import spdl.io
    from spdl.pipeline import PipelineBuilder

    try:  # FFmpeg's shared libraries are not in SPDL's wheel
        spdl.io.load_image_batch([files[0][0]], width=size, height=size, pix_fmt="rgb24")
    except RuntimeError as error:
        raise PeerMissing(
            f"SPDL could not decode (it needs FFmpeg's libraries: apt-get install ffmpeg): {error}"
        ) from None
    epochs = iter(range(1, 10**9))

    def load(chunk: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        buffer = spdl.io.load_image_batch([p for p, _ in chunk], width=size, height=size, pix_fmt="rgb24")
        images = spdl.io.to_torch(buffer).permute(0, 3, 1, 2)
        return images, torch.tensor([label for _, label in chunk], dtype=torch.int64)

    def make() -> Iterable[Any]:
        order = list(files)
        random.Random(seed * 1_000_003 + next(epochs)).shuffle(order)
        pipeline = (
            PipelineBuilder()
            .add_source(order)
            .aggregate(batch, drop_last=True)
            .pipe(load, concurrency=workers, output_order="completion")
            .add_sink(workers + 1)
            .build(num_threads=workers)
        )

        def batches() -> Iterable[Any]:
            with pipeline.auto_stop():
                yield from pipeline

        return batches()

    return PeerLoader("spdl", "FFmpeg (SPDL load_image_batch, no flips)", make)


# ------------------------------------------------------------------------------------------------------ FFCV


FFCV_PYTHON_ENV = "KAISOKU_FFCV_PYTHON"
"""Environment variable naming a Python interpreter that has ``ffcv`` (FFCV pins its own numba/numpy, so it
often lives in a venv of its own); without it, this interpreter if it has ``ffcv``."""


def ffcv_python() -> str | None:
    """The interpreter the FFCV row runs in, or None when FFCV is not available."""
    named = os.environ.get(FFCV_PYTHON_ENV)
    if named:
        return named
    return sys.executable if importlib.util.find_spec("ffcv") is not None else None


class FFCVRow:
    """FFCV's loader in a child process (its own interpreter), driven epoch by epoch over a pipe.

    The child writes FFCV's ``.beton`` of the files once (its writer re-encodes the JPEGs at quality 90; with
    ``raw``, ``write_mode="raw"``: the decoded pixels, its format for tiny images), then for each ``epoch()``
    call iterates one epoch of ``Loader(os_cache=True, order=RANDOM)`` with ``SimpleRGBImageDecoder`` (or
    ``RandomResizedCropRGBImageDecoder`` when ``crop``), ``RandomHorizontalFlip``, ``ToTensor``,
    ``ToTorchImage`` and reports samples, seconds and its CPU seconds.
    """

    def __init__(
        self,
        files: Sequence[tuple[str, int]],
        directory: Path,
        *,
        batch: int,
        workers: int,
        crop: int,
        raw: bool = False,
    ) -> None:
        python = ffcv_python()
        if python is None:
            raise PeerMissing(
                f"FFCV not installed: apt-get install libturbojpeg0-dev libopencv-dev; pip install ffcv "
                f"(in this venv, or a venv named by ${FFCV_PYTHON_ENV})"
            )
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "files.json").write_text(json.dumps(list(files)))
        env = {**os.environ, "PYTHONPATH": python_path()}
        args = [
            python,
            "-m",
            "kaisoku_bench.loader_peers",
            str(directory),
            str(batch),
            str(workers),
            str(crop),
            "raw" if raw else "jpg",
        ]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env
        )
        ready = self.proc.stdout.readline() if self.proc.stdout else ""
        if not ready.startswith("ready"):
            self.close()
            raise PeerMissing(f"FFCV could not start ({python}): {ready.strip() or 'no answer'}")

    def epoch(self) -> tuple[int, float, float]:
        """One epoch in the child: ``(samples, seconds, CPU seconds)``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("epoch\n")
        self.proc.stdin.flush()
        samples, seconds, cpu = self.proc.stdout.readline().split()
        return int(samples), float(seconds), float(cpu)

    def close(self) -> None:
        """Stop the child."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def _ffcv_child(directory: Path, batch: int, workers: int, crop: int, write_mode: str) -> None:
    import time

    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage
    from ffcv.writer import DatasetWriter
    from PIL import Image

    files = json.loads((directory / "files.json").read_text())
    beton = directory / "data.beton"
    if not _complete(directory):

        class Items:
            def __len__(self) -> int:
                return len(files)

            def __getitem__(self, i: int) -> tuple[Any, int]:
                return Image.open(files[i][0]).convert("RGB"), int(files[i][1])

        field = RGBImageField(write_mode=write_mode, jpeg_quality=90)
        DatasetWriter(str(beton), {"image": field, "label": IntField()}, num_workers=1).from_indexed_dataset(
            Items()
        )
        _mark_complete(directory, {"samples": len(files)})
    decoder = RandomResizedCropRGBImageDecoder((crop, crop)) if crop else SimpleRGBImageDecoder()
    loader = Loader(
        str(beton),
        batch_size=batch,
        num_workers=workers,
        order=OrderOption.RANDOM,
        os_cache=True,
        drop_last=True,
        pipelines={
            "image": [decoder, RandomHorizontalFlip(), ToTensor(), ToTorchImage()],
            "label": [IntDecoder(), ToTensor(), Squeeze()],
        },
    )
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "epoch":
            break
        cpu, start, count = time.process_time(), time.perf_counter(), 0
        for _images, labels in loader:
            count += int(labels.shape[0])
        print(count, time.perf_counter() - start, time.process_time() - cpu, flush=True)


if __name__ == "__main__":
    _ffcv_child(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
