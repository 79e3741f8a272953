"""Decode and augment a batch (or a thread's chunk of one) in one call: the same keyed crops and flips.

The per-sample chain (``decode_image`` then :func:`~kaisoku.data.loading.transforms.augment_into`) spends a
small image's time around its C calls: a crop drawn in Python, the crop wrapped in a tensor for a resize
kernel whose per-call cost outweighs 64 px of pixels, the flip, the copy. Here the boxes and flips of the
whole chunk are drawn at once, vectorised over SplitMix64 in numpy (:func:`keyed_crops`: the same boxes,
bit for bit, as :func:`~kaisoku.data.loading.transforms.random_crop_box`); each JPEG is decoded by
libjpeg-turbo into one reused scratch buffer; each crop is resized by the per-sample path's own resizer
(:func:`~kaisoku.data.loading.transforms._resize_box`: OpenCV's bilinear resize for a crop enlarged to the
output where ``opencv-python-headless`` is installed, 2-3x cheaper than torch's kernel on small crops, torch's
antialiased kernel otherwise), so both paths give the same pixels. Into a channels-last batch (the
loader's buffers) each sample is written where it lies: an image already the output's size decoded
straight into its slot, a crop resized into it, a flip done in place (at 64 px this takes 10-20 us off a
sample against decoding into scratch and a strided flip-and-transpose copy); into a plain NCHW array, flip
and HWC -> CHW end in one strided copy. Every C call releases the GIL, so a batch split between threads
decodes in parallel.

Measured against other batch designs on 64 px JPEGs (single thread, CPU time): one batched
``torchvision.ops.roi_align`` over a float canvas, ``grid_sample`` and a separable gather in float32 all
cost more than the per-sample torch kernel (float passes over the whole canvas cost more than the kernel's
fused uint8 pass), so the batch is batched where it pays (crop draws, buffers, the copy) and the pixels go
through the cheapest fused resizer available.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import simplejpeg

from kaisoku.data.loading.transforms import (
    _CROP_ATTEMPTS,
    _JPEG_MAGIC,
    _PNM_MAGICS,
    AugmentSpec,
    _epoch_key,
    _opencv,
    _resize_box,
    centre_crop_box,
    decode_image,
    raw_pixels,
)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)

BATCH_PIXEL_TOLERANCE = (1, 0.3)
"""Largest and mean absolute difference, in uint8 levels, a batch-path sample may have from the per-sample
path's. Both resize through the one :func:`~kaisoku.data.loading.transforms._resize_box`, and today give
the same pixels, bit for bit (the loader benchmark records the difference on every set)."""


def _mix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic), as ``transforms._mix64``."""
    values = (values ^ (values >> np.uint64(30))) * _MIX1
    values = (values ^ (values >> np.uint64(27))) * _MIX2
    return values ^ (values >> np.uint64(31))


def _streams(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """The start state of each sample's stream (``KeyedRandom(seed, epoch, index)._state``)."""
    key = np.uint64(_epoch_key(seed, epoch))
    return _mix64((key ^ indices.astype(np.uint64)) + _GOLDEN)


def _draw(states: np.ndarray, draw: np.ndarray | int) -> np.ndarray:
    """The ``draw``-th float (1-based) of each stream, uniform in [0, 1), as ``KeyedRandom.random``."""
    with np.errstate(over="ignore"):
        counted = states + np.asarray(draw, dtype=np.uint64) * _GOLDEN
    return (_mix64(counted) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def keyed_crops(
    heights: np.ndarray, widths: np.ndarray, spec: AugmentSpec, *, seed: int, epoch: int, indices: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Crop boxes ``(left, top, right, bottom)`` (int64, N x 4) and flips (bool, N) of a batch of samples.

    Sample ``k`` is image ``indices[k]`` of size ``heights[k]`` x ``widths[k]``; its box and flip equal
    :func:`~kaisoku.data.loading.transforms.random_crop_box` and the flip draw of ``augment_into`` for the
    key ``(seed, epoch, indices[k])`` (the same draws, the same float operations, ``math.exp`` included).
    Evaluation specs give the centre box rounded to whole pixels and no flips.
    """
    heights = np.asarray(heights, dtype=np.int64)
    widths = np.asarray(widths, dtype=np.int64)
    count = len(heights)
    boxes = np.zeros((count, 4), dtype=np.int64)
    if not spec.train:
        side = np.minimum(heights, widths)
        boxes[:, 0], boxes[:, 1] = (widths - side) // 2, (heights - side) // 2
        boxes[:, 2], boxes[:, 3] = boxes[:, 0] + side, boxes[:, 1] + side
        return boxes, np.zeros(count, dtype=bool)
    states = _streams(seed, epoch, np.asarray(indices, dtype=np.int64))
    flip_draw = np.full(count, 2 * _CROP_ATTEMPTS + 1, dtype=np.int64)  # after ten misses: draw 21
    boxes[:, 2], boxes[:, 3] = widths, heights
    pending = np.ones(count, dtype=bool)
    if spec.scale == (1.0, 1.0) and spec.ratio == (1.0, 1.0):
        whole = heights == widths  # the whole square image, first attempt (transforms' shortcut)
        flip_draw[whole], pending[whole] = 5, False
    area = (heights * widths).astype(np.float64)
    log_lo, log_hi = math.log(spec.ratio[0]), math.log(spec.ratio[1])
    for attempt in range(_CROP_ATTEMPTS):
        rows = np.flatnonzero(pending)
        if rows.size == 0:
            break
        draw = 2 * attempt + 1
        target_area = area[rows] * (
            spec.scale[0] + (spec.scale[1] - spec.scale[0]) * _draw(states[rows], draw)
        )
        log_ratio = log_lo + (log_hi - log_lo) * _draw(states[rows], draw + 1)
        aspect = np.fromiter(map(math.exp, log_ratio.tolist()), dtype=np.float64, count=rows.size)
        crop_w = np.round(np.sqrt(target_area * aspect)).astype(np.int64)
        crop_h = np.round(np.sqrt(target_area / aspect)).astype(np.int64)
        fits = (crop_w > 0) & (crop_w <= widths[rows]) & (crop_h > 0) & (crop_h <= heights[rows])
        rows, crop_w, crop_h = rows[fits], crop_w[fits], crop_h[fits]
        top_span = (heights[rows] - crop_h + 1).astype(np.float64)
        left_span = (widths[rows] - crop_w + 1).astype(np.float64)
        top = (_draw(states[rows], draw + 2) * top_span).astype(np.int64)
        left = (_draw(states[rows], draw + 3) * left_span).astype(np.int64)
        boxes[rows] = np.stack([left, top, left + crop_w, top + crop_h], axis=1)
        flip_draw[rows], pending[rows] = draw + 4, False
    for row in np.flatnonzero(pending):  # ten misses (rare): the centre crop, ratio clamped, as transforms
        boxes[row] = centre_crop_box(int(heights[row]), int(widths[row]), spec)
    flips = _draw(states, flip_draw) >= 0.5 if spec.flip else np.zeros(count, dtype=bool)
    return boxes, flips


def hwc_slots(out: np.ndarray) -> np.ndarray | None:
    """``out`` (N x 3 x S x S) as N x S x S x 3 where each sample's pixels are one C-contiguous HWC block
    (a batch buffer in channels-last memory), else None."""
    slots = out.transpose(0, 2, 3, 1)
    if len(slots) and slots[0].flags.c_contiguous and slots.strides[0] >= slots[0].nbytes:
        return slots
    return None


def flip_in_place(image: np.ndarray, cv2: Any = None) -> None:
    """Mirror an HWC uint8 image left to right where it lies: with ``cv2`` (OpenCV's module, looked up once
    per batch by the caller) its flip, which swaps each row's ends; else through a copy."""
    if cv2 is not None:
        cv2.flip(image, 1, dst=image)
    else:
        image[:] = image[:, ::-1].copy()


def decode_batch_into(
    blobs: Sequence[Any],
    spec: AugmentSpec,
    *,
    seed: int,
    epoch: int,
    indices: Sequence[int] | np.ndarray,
    out: np.ndarray,
    names: Sequence[str] | None = None,
) -> None:
    """Decode encoded images ``blobs`` and write their keyed crops, resized and flipped, into ``out``
    (uint8, N x 3 x S x S): the batch counterpart of ``augment_into(decode_image(blob), spec, ...)`` for
    the keys ``(seed, epoch, indices[n])``.

    Where ``out`` is in channels-last memory (:func:`hwc_slots`: the batch buffers of
    :class:`~kaisoku.data.loading.batches.ThreadedBatches`), each sample is written where it lies: a JPEG
    that is already the output (the whole image at the output size) is decoded straight into its slot,
    a crop is resized into it, and a flip mirrors the slot in place; no HWC -> CHW copy. Raw pixels
    (:func:`~kaisoku.data.loading.transforms.raw_pixels`) are read where they lie, with no decoding: copied
    (or mirrored) into the slot, or resized into it. Other images that are not baseline RGB/grey JPEGs go
    through :func:`~kaisoku.data.loading.transforms.decode_image`, which
    raises naming ``names[n]`` for bytes that cannot be decoded.
    """
    count = len(blobs)
    if out.shape != (count, 3, spec.size, spec.size):
        raise ValueError(
            f"decode_batch_into: out is {tuple(out.shape)}, expected {(count, 3, spec.size, spec.size)}"
        )
    sizes = np.zeros((count, 2), dtype=np.int64)
    decoded: dict[int, np.ndarray] = {}
    for n, data in enumerate(blobs):
        head = bytes(data[:2])
        if head == _JPEG_MAGIC:
            try:
                sizes[n] = simplejpeg.decode_jpeg_header(data)[:2]
                continue
            except ValueError:
                pass
        pixels = raw_pixels(data) if head in _PNM_MAGICS else None
        # Raw pixels are read where they lie; PNG and friends are decoded here.
        decoded[n] = pixels if pixels is not None else decode_image(data, name=names[n] if names else "")
        sizes[n] = decoded[n].shape[:2]
    boxes, flips = keyed_crops(
        sizes[:, 0], sizes[:, 1], spec, seed=seed, epoch=epoch, indices=np.asarray(indices)
    )
    slots = hwc_slots(out)
    cv2 = _opencv()
    # A sample already the output's size and uncropped needs no scratch buffer, where it has a slot.
    whole = (boxes[:, 0] == 0) & (boxes[:, 1] == 0) & (sizes[:, 0] == spec.size) & (sizes[:, 1] == spec.size)
    whole &= (boxes[:, 2] == spec.size) & (boxes[:, 3] == spec.size)
    scratch = np.empty(int(sizes.prod(axis=1).max()) * 3, dtype=np.uint8)  # one decode buffer, reused
    for n, (box, flip, in_place) in enumerate(
        zip(boxes.tolist(), flips.tolist(), whole.tolist(), strict=True)
    ):
        image = decoded.get(n)
        target = scratch if slots is None or not in_place else slots[n]
        in_slot = False
        if image is None:
            try:
                image = simplejpeg.decode_jpeg(blobs[n], colorspace="RGB", buffer=target, strict=True)
                in_slot = target is not scratch
            except ValueError:  # unsupported colour space or damage: decode_image tells which, or decodes
                image = decode_image(blobs[n], name=names[n] if names else "")
        if slots is None:
            resized = _resize_box(image, tuple(box), spec.size)
            if flip:
                resized = resized[:, ::-1]
            np.copyto(out[n], resized.transpose(2, 0, 1))
            continue
        slot = slots[n]
        if in_place and not in_slot and flip and cv2 is not None:
            # Decoded already (raw pixels, a PNG) at the output's size: mirrored as it is copied.
            cv2.flip(image, 1, dst=slot)
            continue
        if not in_slot:
            _resize_box(image, tuple(box), spec.size, out=slot)
        if flip:
            flip_in_place(slot, cv2)
