"""The profile part of ``kaisoku bench loader``: where a sample's microseconds go, on one thread.

For each row set, over bytes in memory (the set's own JPEGs, and the same images as kaisoku's own format
stores them: re-encoded at quality 90 with 4:2:0 chroma, as FFCV's writer does): the decoder alone
(:func:`~kaisoku.data.loading.transforms.decode_image`, libjpeg-turbo through simplejpeg) and the batch
path's whole pixel call (:func:`~kaisoku.data.loading.batch_augment.decode_batch_into`: decode, keyed crop,
resize and flip into a channels-last batch, as a worker makes a batch), each the median of
:data:`REPEATS` passes of this thread's CPU time. Set beside a loader row's CPU time per sample (every
process of the row, its workers included), what is left over is the loader's own share: reading and
checking records, the worker loop, the hand-over of batches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.loading.batch_augment import decode_batch_into
from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.loading.transforms import decode_image

REPEATS = 3
"""Timed passes per figure (the median is kept)."""
CHUNK = 256
"""Samples per :func:`decode_batch_into` call (the loader's batch)."""


def _us_per_sample(run: Callable[[], None], samples: int) -> float:
    """Median over :data:`REPEATS` calls of ``run`` of this thread's CPU time, per sample, in µs."""
    spent = []
    for _ in range(REPEATS):
        start = time.thread_time()
        run()
        spent.append(time.thread_time() - start)
    return statistics.median(spent) / samples * 1e6


def pack_images(pack_dir: Path, count: int) -> list[bytes]:
    """The stored image bytes of a pack's first ``count`` samples (index order), undecoded."""
    dataset = ShardedDataset(pack_dir, decode_images=False)
    try:
        field = next(f.name for f in dataset.index.fields if f.kind == "image")
        return [bytes(dataset[index][field]) for index in range(min(count, len(dataset)))]
    finally:
        dataset.close()


def stage_us(blobs: Sequence[bytes], transform: ImageLabelTransform, epoch: int) -> dict[str, float]:
    """``decoder_us`` and ``batch_call_us`` per sample of ``blobs`` on this thread (see the module)."""
    spec = transform.spec
    buffer = np.empty((CHUNK, spec.size, spec.size, 3), dtype=np.uint8)

    def decode_all() -> None:
        for data in blobs:
            decode_image(data)

    def batch_calls() -> None:
        for start in range(0, len(blobs), CHUNK):
            chunk = blobs[start : start + CHUNK]
            out = buffer[: len(chunk)].transpose(0, 3, 1, 2)  # channels-last, as the loader's batch ring
            indices = np.arange(start, start + len(chunk))
            decode_batch_into(chunk, spec, seed=transform.seed, epoch=epoch, indices=indices, out=out)

    return {
        "decoder_us": _us_per_sample(decode_all, len(blobs)),
        "batch_call_us": _us_per_sample(batch_calls, len(blobs)),
    }


def profile_row(
    set_name: str,
    own: dict[str, float],
    own_format: dict[str, float],
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
