"""The profile part of ``kaisoku bench loader``: where a sample's microseconds go, on one thread.

For each row set, over bytes in memory (the set's own JPEGs, and the same images as kaisoku's own format
stores them: re-encoded at quality 90 with 4:2:0 chroma, as FFCV's writer does): the decoder alone
(libjpeg-turbo through simplejpeg, into one reused buffer as the batch path decodes) and the batch
path's whole pixel call (:func:`~kaisoku.data.loading.batch_augment.decode_batch_into`: decode, keyed crop,
resize and flip into a channels-last batch, as a worker makes a batch), each the median of
:data:`REPEATS` passes of this thread's CPU time, the two interleaved (the range of the passes is kept:
this machine's speed drifts by a fifth over seconds, which the loaders' own rows, interleaved epochs, see
as noise too). Set beside a loader row's CPU time per sample (every
process of the row, its workers included), what is left over is the loader's own share: reading and
checking records, the worker loop, the hand-over of batches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg

from kaisoku.data.loading.batch_augment import decode_batch_into
from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.loading.transforms import decode_image

REPEATS = 5
"""Timed passes per figure (the median is kept)."""
CHUNK = 256
"""Samples per :func:`decode_batch_into` call (the loader's batch)."""


def pack_images(pack_dir: Path, count: int) -> list[bytes]:
    """The stored image bytes of a pack's first ``count`` samples (index order), undecoded."""
    dataset = ShardedDataset(pack_dir, decode_images=False)
    try:
        field = next(f.name for f in dataset.index.fields if f.kind == "image")
        return [bytes(dataset[index][field]) for index in range(min(count, len(dataset)))]
    finally:
        dataset.close()


def _jpeg_sides(data: bytes) -> tuple[int, int] | None:
    """A JPEG's height and width, or None for other bytes (raw pixels, PNG)."""
    try:
        height, width = simplejpeg.decode_jpeg_header(data)[:2]
    except ValueError:
        return None
    return int(height), int(width)


def stage_us(blobs: Sequence[bytes], transform: ImageLabelTransform, epoch: int) -> dict[str, Any]:
    """``decoder_us`` and ``batch_call_us`` per sample of ``blobs`` on this thread (see the module), each the
    median of :data:`REPEATS` passes, the two interleaved pass by pass (a drift of the machine's speed falls
    on both), with the range of the passes (``*_range_us``)."""
    spec = transform.spec
    buffer = np.empty((CHUNK, spec.size, spec.size, 3), dtype=np.uint8)
    sides = [_jpeg_sides(data) for data in blobs]
    jpeg = [side is not None for side in sides]
    scratch = np.empty(max((h * w for h, w in filter(None, sides)), default=1) * 3, dtype=np.uint8)

    def decoder() -> None:
        # Into one reused buffer, as the batch path decodes: the decoder's own time, no allocation's.
        for data, is_jpeg in zip(blobs, jpeg, strict=True):
            if is_jpeg:
                simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=scratch, strict=True)
            else:
                decode_image(data)

    def batch_call() -> None:
        for start in range(0, len(blobs), CHUNK):
            chunk = blobs[start : start + CHUNK]
            out = buffer[: len(chunk)].transpose(0, 3, 1, 2)  # channels-last, as the loader's batch ring
            indices = np.arange(start, start + len(chunk))
            decode_batch_into(chunk, spec, seed=transform.seed, epoch=epoch, indices=indices, out=out)

    runs = {"decoder": decoder, "batch_call": batch_call}
    spent: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(REPEATS):
        for name, run in runs.items():
            start = time.thread_time()
            run()
            spent[name].append((time.thread_time() - start) / len(blobs) * 1e6)
    figures: dict[str, Any] = {}
    for name, values in spent.items():
        figures[f"{name}_us"] = statistics.median(values)
        figures[f"{name}_range_us"] = [round(min(values), 1), round(max(values), 1)]
    return figures


def profile_row(
    set_name: str,
    own: dict[str, Any],
    own_format: dict[str, Any],
    cpu_us: dict[str, float],
) -> dict[str, Any]:
    """The set's profile row: the one-thread stage figures (``own``: the set's JPEGs, ``own_format``:
    kaisoku's own format) beside the rows' CPU µs per sample (``cpu_us`` by row name), and what each row
    spends outside the stages its bytes need."""
    row: dict[str, Any] = {
        "part": "profile",
        "size": set_name,
        "row": "one-thread stages (µs/sample)",
        "decoder_us": round(own["decoder_us"], 1),
        "batch_call_us": round(own["batch_call_us"], 1),
        "own_format_decoder_us": round(own_format["decoder_us"], 1),
        "own_format_batch_call_us": round(own_format["batch_call_us"], 1),
        "decoder_range_us": own["decoder_range_us"],
        "batch_call_range_us": own["batch_call_range_us"],
        "own_format_decoder_range_us": own_format["decoder_range_us"],
        "own_format_batch_call_range_us": own_format["batch_call_range_us"],
    }
    stages = {
        "kaisoku": own["batch_call_us"],
        "kaisoku-own-format": own_format["batch_call_us"],
        # FFCV's file is re-encoded as the own format is (q90 4:2:0, by OpenCV): its decoder costs about
        # the same; its crop, resize and flip are its own (numba), so only the decoder is taken off.
        "ffcv": own_format["decoder_us"],
    }
    for name, stage in stages.items():
        if name in cpu_us:
            row[f"{name}_cpu_us"] = round(cpu_us[name], 1)
            row[f"{name}_outside_stages_us"] = round(cpu_us[name] - stage, 1)
    return row
