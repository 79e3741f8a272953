"""Late decoding and augmentation: bytes -> HWC uint8 -> CHW uint8 -> batched tensors.

Images travel through the loader as encoded bytes and are decoded in the worker that needs them
(simplejpeg for JPEG, Pillow for the rest). Augmentation randomness is keyed by
(seed, epoch, sample index) only, so a sample's crop does not depend on the worker, the rank or
the world size. Normalisation happens on the batch, on whatever device it lives on, so that the
loader ships uint8 (4x fewer bytes than float32).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import simplejpeg
import torch
from PIL import Image

from kaisoku.errors import KaisokuError

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
"""Per-channel mean of ImageNet RGB images, on a 0..1 scale."""

IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
"""Per-channel standard deviation of ImageNet RGB images, on a 0..1 scale."""

_JPEG_MAGIC = b"\xff\xd8"
_PNM_MAGICS = (b"P6", b"P5")
# The one header kaisoku pack writes for raw pixels (Pillow's PNM writer); other PNM headers go to Pillow.
_PNM_HEADER = re.compile(rb"P([56])\n([1-9][0-9]{0,5}) ([1-9][0-9]{0,5})\n255\n")
# Attempts at a random crop before falling back to a centre crop, as in torchvision.
_CROP_ATTEMPTS = 10


def _describe(name: str) -> str:
    return f"image {name!r}" if name else "image"


def _decode_with_pillow(data: bytes, name: str) -> np.ndarray:
    import io

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            rgb = image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as error:
        raise KaisokuError(
            f"cannot decode {_describe(name)} ({len(data)} bytes): {error}; "
            "re-encode it as JPEG or PNG or remove it"
        ) from None
    return np.asarray(rgb)


def raw_pixels(data: bytes | bytearray | memoryview) -> np.ndarray | None:
    """The pixels of a raw-pixel image (``kaisoku pack --raw-side``: binary PNM, ``P6`` RGB or ``P5`` grey,
    8 bits, the header :func:`kaisoku.data.shards.recode.raw_pixel_bytes` writes) as an HWC uint8 RGB array:
    RGB viewed in place (read-only where ``data`` is), grey repeated into 3 channels. None for other bytes,
    another PNM header, or a length that does not match the header (Pillow then reads or refuses them)."""
    header = _PNM_HEADER.match(data)
    if header is None:
        return None
    channels = 3 if header[1] == b"6" else 1
    width, height = int(header[2]), int(header[3])
    if len(data) != header.end() + width * height * channels:
        return None
    pixels = np.frombuffer(data, dtype=np.uint8, count=width * height * channels, offset=header.end())
    if channels == 1:
        return np.repeat(pixels.reshape(height, width, 1), 3, axis=2)
    return pixels.reshape(height, width, 3)


def decode_image(data: bytes | bytearray | memoryview, *, name: str = "", min_side: int = 0) -> np.ndarray:
    """Decode encoded image bytes to an HWC uint8 RGB array.

    JPEG goes through simplejpeg (libjpeg-turbo); PNG and every other format, and the rare JPEG
    that simplejpeg refuses (lossless, damaged), go through Pillow. Grayscale and palette images come
    back with 3 channels. ``name`` (a file or record) is named in the error raised for bytes that
    cannot be decoded. ``min_side`` > 0 lets simplejpeg decode a JPEG at a reduced DCT scale (1/2,
    1/4, 1/8) as long as both sides stay >= ``min_side``: much faster for large photos that are
    resized down anyway; 0 decodes at full size. Raw pixels (:func:`raw_pixels`) are copied out.
    """
    head = bytes(data[:2])
    if head in _PNM_MAGICS:
        pixels = raw_pixels(data)
        if pixels is not None:
            return pixels.copy()  # an array of its own, not a view of the record's buffer
    if head == _JPEG_MAGIC:
        try:
            image = simplejpeg.decode_jpeg(
                data,
                colorspace="RGB",
                min_height=min_side,
                min_width=min_side,
                strict=True,
            )
        except ValueError:
            # Unsupported colour space or a damaged stream: Pillow decides which one it is.
            pass
        else:
            return image
    return _decode_with_pillow(bytes(data), name)


@dataclass(kw_only=True, frozen=True)
class AugmentSpec:
    """How one image becomes a square CHW uint8 training or evaluation sample."""

    size: int
    """Side of the square output image, in pixels."""

    train: bool = True
    """True: random-resized-crop and random horizontal flip; False: resize the shorter side to
    ``size`` and take the centre crop, with no randomness."""

    scale: tuple[float, float] = (0.08, 1.0)
    """Range of the crop area as a fraction of the image area (training only)."""

    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    """Range of the crop aspect ratio, width / height, sampled log-uniformly (training only)."""

    flip: bool = True
    """Flip horizontally with probability 1/2 (training only)."""

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise KaisokuError(f"augment size must be a positive number of pixels, got {self.size}")
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise KaisokuError(f"augment scale must satisfy 0 < low <= high <= 1, got {self.scale}")
        rlo, rhi = self.ratio
        if not 0 < rlo <= rhi:
            raise KaisokuError(f"augment ratio must satisfy 0 < low <= high, got {self.ratio}")


_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a bijective 64-bit mix with full avalanche."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


@functools.lru_cache(maxsize=64)
def _epoch_key(seed: int, epoch: int) -> int:
    """The stream key of ``(seed, epoch)``, shared by every sample of the epoch (computed once)."""
    key = _mix64((seed + _GOLDEN64) & _MASK64)
    return _mix64(((key ^ (epoch & _MASK64)) + _GOLDEN64) & _MASK64)


class KeyedRandom:
    """A SplitMix64 stream whose start is a pure function of ``(seed, epoch, index)``.

    A few draws per sample from a counter-based stream cost about a microsecond in Python, where
    building a numpy ``Generator`` per sample costs over ten: a visible share of a small image's
    decode time. SplitMix64's statistical quality is ample for crop and flip decisions.
    """

    __slots__ = ("_state",)

    def __init__(self, seed: int, epoch: int, index: int) -> None:
        key = _epoch_key(seed, epoch)
        self._state = _mix64(((key ^ (index & _MASK64)) + _GOLDEN64) & _MASK64)

    def skip(self, draws: int) -> None:
        """Advance past ``draws`` draws without computing them (the stream is counter-based)."""
        self._state = (self._state + draws * _GOLDEN64) & _MASK64

    def random(self) -> float:
        """The next float, uniform in [0, 1)."""
        self._state = (self._state + _GOLDEN64) & _MASK64
        return (_mix64(self._state) >> 11) * (1.0 / (1 << 53))

    def uniform(self, low: float, high: float) -> float:
        """The next float, uniform in [low, high)."""
        return low + (high - low) * self.random()

    def integers(self, low: int, high: int) -> int:
        """The next integer, uniform in [low, high) (bias below 2**-40 for ranges under 2**13)."""
        return low + int(self.random() * (high - low))


def augment_rng(seed: int, epoch: int, index: int) -> KeyedRandom:
    """The random stream for one sample's augmentation, a pure function of its key."""
    return KeyedRandom(seed, epoch, index)


def random_crop_box(
    height: int, width: int, spec: AugmentSpec, rng: KeyedRandom
) -> tuple[int, int, int, int]:
    """A random-resized-crop box ``(left, top, right, bottom)`` inside a ``height`` x ``width`` image.

    Area fraction from ``spec.scale``, aspect ratio log-uniform in ``spec.ratio``; after ten misses
    the centre crop with the ratio clamped into range, as torchvision does.
    """
    if spec.scale == (1.0, 1.0) and spec.ratio == (1.0, 1.0) and height == width:
        # The whole square image, as the loop below finds on its first attempt (its 4 draws skipped).
        rng.skip(4)
        return 0, 0, width, height
    area = height * width
    log_lo, log_hi = math.log(spec.ratio[0]), math.log(spec.ratio[1])
    for _ in range(_CROP_ATTEMPTS):
        target_area = area * rng.uniform(spec.scale[0], spec.scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        crop_w = int(round(math.sqrt(target_area * aspect)))
        crop_h = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = int(rng.integers(0, height - crop_h + 1))
            left = int(rng.integers(0, width - crop_w + 1))
            return left, top, left + crop_w, top + crop_h
    return centre_crop_box(height, width, spec)


def centre_crop_box(height: int, width: int, spec: AugmentSpec) -> tuple[int, int, int, int]:
    """The box :func:`random_crop_box` falls back to after ten misses: the centre crop, its aspect ratio
    clamped into ``spec.ratio``, as torchvision does."""
    in_ratio = width / height
    if in_ratio < spec.ratio[0]:
        crop_w, crop_h = width, int(round(width / spec.ratio[0]))
    elif in_ratio > spec.ratio[1]:
        crop_h, crop_w = height, int(round(height * spec.ratio[1]))
    else:
        crop_w, crop_h = width, height
    top = (height - crop_h) // 2
    left = (width - crop_w) // 2
    return left, top, left + crop_w, top + crop_h


def center_crop_box(height: int, width: int) -> tuple[float, float, float, float]:
    """The centred square box ``(left, top, right, bottom)`` of side ``min(height, width)``.

    Resizing this box to ``size`` x ``size`` equals resizing the shorter side to ``size`` and
    cropping the centre, in one resampling pass.
    """
    side = min(height, width)
    left = (width - side) / 2
    top = (height - side) / 2
    return left, top, left + side, top + side


def _as_image(image: np.ndarray) -> np.ndarray:
    """HWC RGB stays HWC; HW and HW1 grayscale become HW (Pillow mode L)."""
    if image.dtype != np.uint8:
        raise KaisokuError(f"augment expects a uint8 image, got dtype {image.dtype}")
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    if not (image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 3)):
        raise KaisokuError(f"augment expects an HW, HW1 or HW3 image, got shape {image.shape}")
    return image


@functools.cache
def _opencv() -> Any:
    """OpenCV's module where ``opencv-python-headless`` is installed, else None (imported on first use: its
    import costs start-up time to commands that never resize an image)."""
    try:
        import cv2
    except ImportError:
        return None
    return cv2


def resizer() -> str:
    """What enlarges crops here: ``opencv`` (installed) or ``torch`` (its uint8 kernel)."""
    return "opencv" if _opencv() is not None else "torch"


def _resize_box(
    image: np.ndarray, box: tuple[float, float, float, float], size: int, out: np.ndarray | None = None
) -> np.ndarray:
    """``box`` of an HWC (or HW) uint8 image resampled to ``size`` x ``size`` (bilinear, antialiased), HWC;
    written into ``out`` (a C-contiguous HWC array, e.g. a channels-last batch slot) and returned when given.

    The one resizer of the per-sample and the batch paths, so that a sample's pixels depend on its key
    alone, whichever path (or position in a batch, or resume) made it. A box on whole pixels (every
    training crop) is a slice: enlarged to the output, OpenCV's bilinear resize (half-pixel centres, the
    filter torch's kernel applies there, no antialiasing involved; several times faster) where installed;
    otherwise torch's uint8 antialiased kernel, which reads the HWC slice in place as a channels-last
    tensor (1.5x faster than PIL's box resize on ImageNet-like crops to 160; pixels within 1 of PIL's but
    at the crop's border, where PIL's filter also reads outside the box). A box with fractional edges keeps
    PIL's sub-pixel box.
    """
    height, width = image.shape[:2]
    if box == (0, 0, width, height) and height == size and width == size:
        return _written(image, out)  # already the output: skip a resampling pass
    if all(float(edge).is_integer() for edge in box):
        left, top, right, bottom = (int(edge) for edge in box)
        if right - left == size and bottom - top == size:
            return _written(image[top:bottom, left:right], out)  # already the output size: no resampling
        cv2 = _opencv()
        if cv2 is not None and right - left <= size and bottom - top <= size:
            region = image[top:bottom, left:right]
            if out is not None:  # resampled straight into ``out``
                return cv2.resize(region, (size, size), dst=out, interpolation=cv2.INTER_LINEAR)
            return cv2.resize(region, (size, size), interpolation=cv2.INTER_LINEAR)
        region = image[top:bottom, left:right]
        if not region.flags.writeable:  # a record's bytes viewed in place: torch wants writable memory
            region = region.copy()
        crop = torch.from_numpy(region)
        planes = crop.permute(2, 0, 1)[None] if crop.ndim == 3 else crop[None, None]
        resized = torch.nn.functional.interpolate(
            planes, size=(size, size), mode="bilinear", antialias=True, align_corners=False
        )[0]
        return _written((resized.permute(1, 2, 0) if crop.ndim == 3 else resized[0]).numpy(), out)
    resized = Image.fromarray(image).resize((size, size), Image.Resampling.BILINEAR, box=box)
    return _written(np.asarray(resized), out)


def _written(image: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``image`` copied into ``out`` when given (and ``out`` returned), else ``image`` itself. An RGB image
    held as three planes (torch's resize gives CHW) is interleaved by OpenCV's ``merge`` where installed:
    numpy's strided copy from planes is about 30x slower (109 against 4 us at 160 px)."""
    if out is None:
        return image
    cv2 = _opencv()
    planes = image.transpose(2, 0, 1) if image.ndim == 3 and image.shape[2] == 3 else None
    if cv2 is not None and planes is not None and planes.flags.c_contiguous and out.flags.c_contiguous:
        cv2.merge([planes[0], planes[1], planes[2]], dst=out)
    else:
        np.copyto(out, image)
    return out


def augment(image: np.ndarray, spec: AugmentSpec, *, seed: int, epoch: int, index: int) -> np.ndarray:
    """Turn one HWC uint8 image into a C-contiguous CHW uint8 array of ``spec.size`` x ``spec.size``.

    Training (``spec.train``): random-resized-crop then a random horizontal flip, drawn from a
    stream keyed by ``(seed, epoch, index)`` alone (:class:`KeyedRandom`). Evaluation: shorter side resized to
    ``spec.size`` (bilinear, antialiased) and the centre crop, identical for every key.
    Channels are kept: HWC RGB gives 3 x size x size, grayscale (HW or HW1, e.g. MNIST arrays)
    gives 1 x size x size. (:func:`decode_image` always yields RGB.)
    """
    image = _as_image(image)
    channels = 1 if image.ndim == 2 else 3
    out = np.empty((channels, spec.size, spec.size), dtype=np.uint8)
    augment_into(image, spec, seed=seed, epoch=epoch, index=index, out=out)
    return out


def augment_into(
    image: np.ndarray, spec: AugmentSpec, *, seed: int, epoch: int, index: int, out: np.ndarray
) -> None:
    """:func:`augment` written into ``out`` (a CHW uint8 array, e.g. a slot of a batch buffer).

    The crop, resample, flip and transpose end in one strided copy into ``out`` (which releases the GIL),
    so a batch filled by several threads costs no extra copy per sample.
    """
    image = _as_image(image)
    height, width = image.shape[:2]
    flip = False
    if spec.train:
        rng = augment_rng(seed, epoch, index)
        box: tuple[float, float, float, float] = random_crop_box(height, width, spec, rng)
        flip = spec.flip and bool(rng.integers(0, 2))
    else:
        box = center_crop_box(height, width)
    resized = _resize_box(image, box, spec.size)
    if flip:
        resized = resized[:, ::-1]
    expected = (1 if resized.ndim == 2 else 3, spec.size, spec.size)
    if out.shape != expected:
        raise KaisokuError(f"augment output is {expected}, the buffer given is {tuple(out.shape)}")
    if resized.ndim == 2:
        np.copyto(out[0], resized)
    else:
        np.copyto(out, resized.transpose(2, 0, 1))


def collate(samples: Sequence[tuple[np.ndarray, int] | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(CHW uint8 image, label)`` pairs into a uint8 NCHW tensor and int64 labels (or arrays and
    their array targets, e.g. float32 volumes and regression targets, into tensors of their dtypes).

    ``None`` entries (records a dataset skipped as damaged, already logged and counted there) are
    left out, so such a batch is smaller.
    """
    kept = [sample for sample in samples if sample is not None]
    if not kept:
        raise KaisokuError(
            f"cannot collate a batch of {len(samples)} samples: none left after skipping damaged records"
        )
    images = np.stack([image for image, _ in kept])
    if isinstance(kept[0][1], np.ndarray):  # array targets (regression): stacked as they are
        return torch.from_numpy(images), torch.from_numpy(np.stack([target for _, target in kept]))
    labels = np.fromiter((int(label) for _, label in kept), dtype=np.int64, count=len(kept))
    return torch.from_numpy(images), torch.from_numpy(labels)


def normalize(
    batch: torch.Tensor,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: torch.dtype = torch.float32,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """Convert a uint8 NCHW batch (on any device, in any memory layout) to ``dtype`` and normalise per channel.

    ``mean`` and ``std`` are on the 0..1 scale; the result is ``(batch / 255 - mean) / std``, laid out in
    ``memory_format`` (the cast that converts the values also lays out the memory: a channels-last batch
    from the loader costs no pass of its own to become contiguous).
    """
    if batch.ndim != 4:
        raise KaisokuError(f"normalize expects an NCHW batch, got shape {tuple(batch.shape)}")
    channels = batch.shape[1]
    if len(mean) != channels or len(std) != channels:
        raise KaisokuError(
            f"normalize got {len(mean)} means and {len(std)} stds for {channels} channels; "
            "give one of each per channel"
        )
    # Fold the 1/255 into the constants: one subtract and one multiply over the batch.
    scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=dtype, device=batch.device)
    shift = torch.tensor([255.0 * m for m in mean], dtype=dtype, device=batch.device)
    out = batch.to(dtype, memory_format=memory_format)
    out.sub_(shift.view(1, -1, 1, 1)).mul_(scale.view(1, -1, 1, 1))
    return out
