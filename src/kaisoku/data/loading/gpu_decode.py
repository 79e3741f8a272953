"""Decoding on the training device (``data.decode gpu``): the loader ships encoded JPEGs, the device decodes.

With ``data.decode gpu`` the loader's threads decode nothing: a batch (:class:`EncodedBatch`) carries each
record's JPEG bytes with its keyed crop box and flip, drawn by
:func:`~kaisoku.data.loading.batch_augment.keyed_crops` from the JPEG header's size (the same function, so
the same boxes bit for bit, as the host path). Where the trainer moves the batch to its device
(``batch.to(device)``), :func:`decode_on_device` decodes the whole list in one call
(TorchCodec's ``decode_jpeg`` over a list: nvJPEG's batched decoder on CUDA), crops each image to its
box, resizes it (bilinear, antialiased, as the host path's kernel) and flips it, into one uint8 NCHW
batch on the device; normalisation then happens there as for any batch. The host's cores only parse
records and read JPEG headers.

The step takes any device, so it runs (and is tested) on the CPU too. Images that are not JPEG (PNG and
friends, rare in packed photo sets) are decoded on the host by the loader's threads and only cropped on
the device. Without a CUDA device, ``data.decode gpu`` trains through the host path after one line.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import simplejpeg
import torch

from kaisoku.data.loading.batch_augment import keyed_crops
from kaisoku.data.loading.batches import Key, ReadContext, no_read_context
from kaisoku.data.loading.transforms import _JPEG_MAGIC, AugmentSpec, decode_image
from kaisoku.errors import KaisokuError

log = logging.getLogger(__name__)

DECODE_PLACES = ("cpu", "gpu")
"""Where a packed dataset's training images are decoded: on the host (the loader's threads) or on the
training device (a CUDA GPU; the host path without one)."""

DEVICE_PIXEL_TOLERANCE = (2, 0.25)
"""Largest and mean absolute difference, in uint8 levels, allowed between a sample decoded by
:func:`decode_on_device` on the CPU and the host batch path's, with the same crop box and flip. Measured
(TorchCodec's libjpeg-turbo, as torchvision's, against simplejpeg's, a float resize against the uint8 kernel): max 1, mean
0.12-0.15 over batches of 16, 24, 64 and 160 px crops of JPEGs at 1x and 3x the output size. nvJPEG's
IDCT and chroma upsampling differ from libjpeg-turbo's by a few levels at edges; its difference is
recorded by ``kaisoku bench loader`` on a CUDA machine, not checked here."""


@functools.cache
def _decode_jpeg() -> Any:
    """A batch JPEG decoder taking a list of encoded uint8 tensors and ``device=``: TorchCodec's
    ``decode_jpeg`` (nvJPEG's batched decoder on CUDA, libjpeg-turbo on the CPU), else torchvision's, whose
    image decoding is deprecated since torchvision 0.29 in favour of TorchCodec (``pip install -e
    '.[gpu]'`` installs it). Imported on first use: the decoders cost start-up time to commands that never
    decode on a device."""
    try:
        from torchcodec.decoders import decode_jpeg
    except (ImportError, OSError, RuntimeError):  # not installed, or built for another torch
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as torchvision_decode_jpeg

        return functools.partial(torchvision_decode_jpeg, mode=ImageReadMode.RGB)
    return functools.partial(decode_jpeg, mode="RGB")


def jpeg_decoder_library() -> str:
    """Which library's batch JPEG decoder :func:`decode_on_device` uses: ``torchcodec`` or ``torchvision``."""
    return str(_decode_jpeg().func.__module__).split(".")[0]


@dataclass(kw_only=True)
class EncodedBatch:
    """A batch of encoded images with their keyed crops and flips, decoded where it is moved to.

    ``to(device)`` returns the uint8 NCHW batch on ``device`` (:func:`decode_on_device`), so a trainer that
    moves tensors with ``images.to(device, non_blocking=True)`` moves this batch the same way.
    """

    blobs: list[torch.Tensor]
    """Each sample's JPEG bytes as a 1-D uint8 CPU tensor (empty where ``decoded`` holds the sample)."""
    boxes: np.ndarray
    """Crop boxes ``(left, top, right, bottom)``, int64, N x 4."""
    flips: np.ndarray
    """Horizontal flips, bool, N."""
    size: int
    """Side of the square output."""
    decoded: dict[int, torch.Tensor] = field(default_factory=dict)
    """Samples decoded on the host (not JPEG): HWC uint8 CPU tensors by position in the batch."""

    def __len__(self) -> int:
        """Samples in the batch."""
        return len(self.blobs)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The shape of the decoded batch (N, 3, size, size)."""
        return (len(self.blobs), 3, self.size, self.size)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
        """The decoded uint8 NCHW batch on ``device`` (``non_blocking`` is implied: the decode is queued on
        the device's stream)."""
        return decode_on_device(self, torch.device(device))


def _resized(crop: torch.Tensor, size: int) -> torch.Tensor:
    """A CHW uint8 crop resized to ``size`` x ``size`` (bilinear, antialiased, half-pixel centres: the
    filter of the host path's kernel, in float)."""
    if crop.shape[1] == size and crop.shape[2] == size:
        return crop  # already the output size: no resampling (as the host path)
    resized = torch.nn.functional.interpolate(
        crop[None].float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False
    )[0]
    return resized.round_().clamp_(0, 255).to(torch.uint8)


def decode_on_device(batch: EncodedBatch, device: torch.device) -> torch.Tensor:
    """Decode ``batch``'s JPEGs on ``device`` in one call, crop each to its box, resize, flip: the uint8
    N x 3 x S x S batch on ``device``, the counterpart of
    :func:`~kaisoku.data.loading.batch_augment.decode_batch_into` for the same boxes and flips."""
    count, size = len(batch), batch.size
    out = torch.empty((count, 3, size, size), dtype=torch.uint8, device=device)
    rows = [n for n in range(count) if n not in batch.decoded]
    images: dict[int, torch.Tensor] = {}
    if rows:
        decoded = _decode_jpeg()([batch.blobs[n] for n in rows], device=device)
        images = dict(zip(rows, decoded, strict=True))
    for n, hwc in batch.decoded.items():
        images[n] = hwc.to(device, non_blocking=True).permute(2, 0, 1)
    for n, (left, top, right, bottom) in enumerate(batch.boxes.tolist()):
        out[n] = _resized(images[n][:, top:bottom, left:right], size)
    if batch.flips.any():
        flipped = torch.from_numpy(np.flatnonzero(batch.flips)).to(device)
        out[flipped] = out[flipped].flip(-1)
    return out


def encode_batch(
    blobs: Sequence[Any],
    spec: AugmentSpec,
    *,
    seed: int,
    epoch: int,
    indices: Sequence[int] | np.ndarray,
    names: Sequence[str] | None = None,
) -> EncodedBatch:
    """The :class:`EncodedBatch` of encoded images ``blobs`` (sample ``indices`` of ``epoch``): sizes from
    the JPEG headers, boxes and flips from :func:`~kaisoku.data.loading.batch_augment.keyed_crops`, the
    bytes copied into tensors. Images that are not JPEG (or whose header simplejpeg cannot read) are decoded
    here by :func:`~kaisoku.data.loading.transforms.decode_image`, which raises naming ``names[n]`` for
    bytes that cannot be decoded."""
    count = len(blobs)
    sizes = np.zeros((count, 2), dtype=np.int64)
    tensors: list[torch.Tensor] = []
    decoded: dict[int, torch.Tensor] = {}
    for n, data in enumerate(blobs):
        if len(data) >= 2 and bytes(data[:2]) == _JPEG_MAGIC:
            try:
                sizes[n] = simplejpeg.decode_jpeg_header(data)[:2]
            except ValueError:
                pass
            else:
                # A copy: the record may be a view of a shard's mmap that the cache evicts.
                tensors.append(torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()))
                continue
        image = decode_image(data, name=names[n] if names else "")
        # A copy too: a stored array's image is a read-only view of the shard's mmap.
        decoded[n] = torch.from_numpy(np.array(image, copy=True))
        sizes[n] = image.shape[:2]
        tensors.append(torch.empty(0, dtype=torch.uint8))
    boxes, flips = keyed_crops(
        sizes[:, 0], sizes[:, 1], spec, seed=seed, epoch=epoch, indices=np.asarray(indices)
    )
    return EncodedBatch(blobs=tensors, boxes=boxes, flips=flips, size=spec.size, decoded=decoded)


class EncodableDataset(Protocol):
    """A dataset that reads samples ``(epoch, index)`` as an :class:`EncodedBatch` and their labels."""

    def read_encoded(self, keys: Sequence[Key]) -> tuple[EncodedBatch, torch.Tensor]:
        """The batch of ``keys`` (samples skipped as damaged left out) and its int64 labels."""
        ...


class EncodedBatches:
    """Iterate ``(EncodedBatch, labels)`` for ``batches`` of keys, read by ``threads`` threads.

    Each batch is read by one thread (records parsed, headers read, crops drawn); ``threads`` batches are
    read ahead of the one being consumed, in order. A batch does not depend on the thread count. Its
    reads run inside ``read_context(keys)``.
    """

    def __init__(
        self,
        dataset: EncodableDataset,
        batches: Iterable[Sequence[Key]],
        *,
        threads: int,
        read_context: ReadContext = no_read_context,
    ) -> None:
        self.dataset = dataset
        self.batches = iter(batches)
        self.threads = max(1, int(threads))
        self.read_context = read_context

    def _read(self, keys: Sequence[Key]) -> tuple[EncodedBatch, torch.Tensor]:
        with self.read_context(keys):
            return self.dataset.read_encoded(list(keys))

    def __iter__(self) -> Iterator[tuple[EncodedBatch, torch.Tensor]]:
        pending: deque[Future[tuple[EncodedBatch, torch.Tensor]]] = deque()
        with ThreadPoolExecutor(self.threads, thread_name_prefix="kaisoku-encoded") as pool:
            try:
                for keys in self.batches:
                    pending.append(pool.submit(self._read, keys))
                    if len(pending) > self.threads:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()


def decode_place(decode: str, device: torch.device | None, *, announce: bool) -> str:
    """Where ``data.decode`` ``decode`` decodes on ``device``: ``gpu`` only on a CUDA device; otherwise
    ``cpu``, after one warning line when ``announce`` (rank 0). ``device`` None: as asked (tests and
    benchmarks that move the batches themselves)."""
    if decode not in DECODE_PLACES:
        raise KaisokuError(f"data.decode must be one of {', '.join(DECODE_PLACES)} (got {decode!r})")
    if decode == "gpu" and device is not None and device.type != "cuda":
        if announce:
            log.warning(
                "data.decode gpu: no CUDA device here (training on %s); decoding on the host instead", device
            )
        return "cpu"
    return decode
