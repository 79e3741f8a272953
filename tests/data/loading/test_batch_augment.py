"""The batch decode path: the per-sample path's crops and flips, its pixels within the stated tolerance,
the same batches for any thread count."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from kaisoku.data.loading.batch_augment import (
    BATCH_PIXEL_TOLERANCE,
    decode_batch_into,
    flip_in_place,
    hwc_slots,
    keyed_crops,
)
from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.data.loading.transforms import (
    AugmentSpec,
    _opencv,
    augment_into,
    augment_rng,
    decode_image,
    random_crop_box,
    resizer,
)
from kaisoku.data.order.shuffle import ShuffleSpec
from kaisoku.data.shards.format import Field, read_index
from kaisoku.data.shards.recode import ImageRecode, raw_pixel_bytes
from kaisoku.data.shards.records import RecordCodec
from kaisoku.data.shards.writer import pack
from kaisoku.errors import KaisokuError
from tests.data.loading.test_batches import _received_half

SPECS = [
    AugmentSpec(size=24),
    AugmentSpec(size=16, scale=(0.9, 1.0), ratio=(0.2, 5.0)),  # many misses: the centre-crop fallback
    AugmentSpec(size=16, scale=(0.6, 1.0), ratio=(3.0, 4.0)),  # wide crops on tall images: ratio clamped
    AugmentSpec(size=8, scale=(1.0, 1.0), ratio=(1.0, 1.0)),  # the whole-square shortcut
    AugmentSpec(size=8, flip=False),
]


@pytest.mark.parametrize("spec", SPECS)
def test_keyed_crops_are_the_per_sample_draws(spec: AugmentSpec) -> None:
    rng = np.random.default_rng(1)
    heights, widths = rng.integers(1, 300, 3000), rng.integers(1, 300, 3000)
    heights[:500] = widths[:500] = 64  # squares, as a small-image set
    indices = rng.integers(0, 2**40, 3000)
    boxes, flips = keyed_crops(heights, widths, spec, seed=7, epoch=3, indices=indices)
    for k in range(len(indices)):
        stream = augment_rng(7, 3, int(indices[k]))
        box = random_crop_box(int(heights[k]), int(widths[k]), spec, stream)
        flip = spec.flip and bool(stream.integers(0, 2))
        assert tuple(boxes[k].tolist()) == box and bool(flips[k]) == flip, k


def _jpegs(count: int, size: int) -> list[bytes]:
    """Smooth, textured JPEGs of mixed sizes around ``size`` (as a small-image set)."""
    rng = np.random.default_rng(5)
    blobs = []
    for k in range(count):
        height, width = (
            size + int(rng.integers(-8, 9)) * (k % 2),
            size + int(rng.integers(-8, 9)) * (k % 3 > 0),
        )
        y, x = np.mgrid[0:height, 0:width].astype(np.float32)
        image = np.stack(
            [128 + 90 * np.sin(x / (5 + c + k % 7) + c) * np.cos(y / (7 + c)) for c in range(3)], -1
        )
        image += rng.normal(0, 8, image.shape)
        blobs.append(simplejpeg.encode_jpeg(np.clip(image, 0, 255).astype(np.uint8), quality=90))
    return blobs


def _mixed_blobs(size: int) -> list[bytes]:
    """JPEGs around ``size`` (some exactly ``size`` square), a PNG and a grayscale JPEG of ``size``."""
    blobs = _jpegs(40, size)
    gray = np.random.default_rng(2).integers(0, 256, (size, size, 1), dtype=np.uint8)
    blobs[7] = simplejpeg.encode_jpeg(gray, colorspace="GRAY", quality=90)
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
        buffer, format="PNG"
    )
    blobs[12] = buffer.getvalue()
    return blobs


def _raw_blobs(blobs: list[bytes]) -> list[bytes]:
    """``blobs`` decoded and stored as raw pixels (``kaisoku pack --raw-side``), the grey one as grey (P5)."""
    raw = []
    for data in blobs:
        image = Image.open(io.BytesIO(data))
        raw.append(raw_pixel_bytes(image.convert("L" if image.mode == "L" else "RGB")))
    return raw


def _batch_buffer(count: int, size: int, layout: str) -> np.ndarray:
    """An N x 3 x S x S uint8 buffer, filled with 7s: plain, or channels-last as ThreadedBatches lays out."""
    if layout == "channels-last":
        return np.full((count, size, size, 3), 7, dtype=np.uint8).transpose(0, 3, 1, 2)
    return np.full((count, 3, size, size), 7, dtype=np.uint8)


@pytest.mark.parametrize("stored", ["encoded", "raw-pixels"])
@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
@pytest.mark.parametrize("whole", [False, True], ids=["crops", "whole-images"])
@pytest.mark.parametrize("size,source", [(24, 24), (64, 64), (24, 80)], ids=["24", "64", "24-from-80"])
def test_batch_path_gives_the_per_sample_paths_pixels(
    size: int, source: int, whole: bool, layout: str, stored: str
) -> None:
    # Images of the output's size (enlarged crops: OpenCV) and 3x it (reduced: torch's antialiased kernel);
    # JPEGs and a PNG, or the same pixels stored raw (read in place; mirrored as copied into a slot).
    blobs = _mixed_blobs(source)
    if stored == "raw-pixels":
        decoded = [decode_image(data) for data in blobs]
        blobs = _raw_blobs(blobs)
        assert blobs[7].startswith(b"P5") and blobs[0].startswith(b"P6")
        for data, pixels in zip(blobs, decoded, strict=True):  # lossless: the source's decoded pixels
            assert np.array_equal(decode_image(data), pixels)
    # Whole images: the squares at the output size decode straight into a channels-last slot.
    spec = AugmentSpec(size=size, scale=(1.0, 1.0), ratio=(1.0, 1.0)) if whole else AugmentSpec(size=size)
    indices = np.arange(100, 140)
    got = _batch_buffer(40, size, layout)
    assert (hwc_slots(got) is not None) == (layout == "channels-last")
    decode_batch_into(blobs, spec, seed=3, epoch=2, indices=indices, out=got)
    expected = np.empty((40, 3, size, size), dtype=np.uint8)
    for k, data in enumerate(blobs):  # the reference: decode, then the per-sample crop, resize and flip
        augment_into(decode_image(data), spec, seed=3, epoch=2, index=int(indices[k]), out=expected[k])
    # One resizer serves both paths: the same pixels, bit for bit (a sample's pixels depend on its key
    # alone, not on which path, batch position, memory layout or resume made it).
    assert np.array_equal(got, expected), resizer()
    flipped = np.flip(expected, axis=3)  # and the comparison sees a missed flip
    assert np.abs(got.astype(np.int16) - flipped.astype(np.int16)).mean() > 3


@pytest.mark.parametrize("width", [1, 2, 7, 64])
def test_flip_in_place_mirrors_every_row(width: int) -> None:
    image = np.random.default_rng(width).integers(0, 256, (5, width, 3), dtype=np.uint8)
    expected = image[:, ::-1].copy()
    for cv2 in (None, _opencv()):  # OpenCV's flip where it lies, and the copy without OpenCV
        mirrored = image.copy()
        flip_in_place(mirrored, cv2)
        assert np.array_equal(mirrored, expected)


def _loader(packed: Path, *, path: str, workers: int) -> ShardLoader:
    dataset = ShardedDataset(
        packed, transform=ImageLabelTransform(spec=AugmentSpec(size=12, scale=(0.3, 1.0)), seed=5)
    )
    return ShardLoader(
        dataset,
        global_batch=8,
        rank=0,
        world_size=1,
        ranks_per_node=1,
        seed=2,
        shuffle=ShuffleSpec(),
        workers=workers,
        batch_path=path,
    )


def _epoch(loader: ShardLoader, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch)
    return [(images.clone(), labels.clone()) for images, labels in loader]


def test_batch_path_gives_the_same_batches_for_any_worker_count(packed: Path) -> None:
    runs = {workers: _epoch(_loader(packed, path="batch", workers=workers), 1) for workers in (0, 1, 2)}
    reference = _epoch(_loader(packed, path="threads", workers=1), 1)  # the per-sample path
    assert len(reference) > 1
    largest, mean = BATCH_PIXEL_TOLERANCE
    for workers in (1, 2):
        for (a, la), (b, lb) in zip(runs[0], runs[workers], strict=True):
            assert torch.equal(a, b) and torch.equal(la, lb)
    for (a, la), (b, lb) in zip(runs[0], reference, strict=True):  # a PNG and a grey JPEG among them
        diff = (a.to(torch.int16) - b.to(torch.int16)).abs()
        assert torch.equal(la, lb) and int(diff.max()) <= largest and float(diff.float().mean()) <= mean


def test_a_raw_pixel_pack_gives_the_batches_of_the_encoded_pack(packed: Path, tmp_path: Path) -> None:
    """Raw pixels (``kaisoku pack --raw-side``) are the source's decoded pixels: the loader gives the encoded
    pack's batches, bit for bit, on the batch path for any worker count and on the per-sample path."""
    source = packed.parent / "src"
    pack(
        source,
        tmp_path / "raw",
        shard_bytes=3000,
        workers=0,
        progress=False,
        recode=ImageRecode(quality=0, raw_side=64),
    )
    index = read_index(tmp_path / "raw")
    shards = b"".join(index.shard_path(k).read_bytes() for k in range(len(index.shards)))
    assert shards.count(b"P6\n24 20\n255\n") + shards.count(b"P5\n24 20\n255\n") == index.num_samples
    reference = _epoch(_loader(packed, path="threads", workers=1), 1)
    assert len(reference) > 1
    for path, workers in (("batch", 0), ("batch", 2), ("threads", 1)):
        got = _epoch(_loader(tmp_path / "raw", path=path, workers=workers), 1)
        for (a, la), (b, lb) in zip(got, reference, strict=True):
            assert torch.equal(a, b) and torch.equal(la, lb), (path, workers)


def test_damaged_record_is_skipped_or_named_on_the_batch_path(packed: Path) -> None:
    index = read_index(packed)
    with open(index.shard_path(0), "r+b") as handle:  # damage record 1 of shard 0 (sample 1)
        handle.seek(int(index.shards[0].offsets[1]) + 3)
        byte = handle.read(1)
        handle.seek(int(index.shards[0].offsets[1]) + 3)
        handle.write(bytes([byte[0] ^ 0xFF]))
    transform = ImageLabelTransform(spec=AugmentSpec(size=8), seed=0)
    out = np.zeros((4, 3, 8, 8), dtype=np.uint8)
    skipping = ShardedDataset(packed, transform=transform, skip_corrupt=True)
    labels = skipping.read_batch_into([(0, i) for i in range(4)], out)
    assert labels[1] is None and None not in (labels[0], labels[2], labels[3]) and skipping.skipped == 1
    strict = ShardedDataset(packed, transform=transform, check_files=False)
    with pytest.raises(Exception, match="record 1"):
        strict.read_batch_into([(0, i) for i in range(4)], out)


def test_received_records_go_through_the_batch_path(packed: Path, ram_dir: Path) -> None:
    reference = _epoch(_loader(packed, path="batch", workers=1), 0)
    loader = _loader(packed, path="batch", workers=2)
    loader.cache_settings = type(loader.cache_settings)(ram_dir=str(ram_dir))
    loader.exchange = _received_half
    got = _epoch(loader, 0)
    stats = loader.epoch_stats()
    loader.close()
    for (a, la), (b, lb) in zip(reference, got, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert stats is not None and stats["exchanged_bytes"] > 0


def test_single_channel_data_reads_sample_by_sample_on_the_batch_path(
    tmp_path: Path, mnist_path: Path
) -> None:
    # MNIST packed from its arrays: 1-channel images, which the batch path (3 channels) hands to the
    # per-sample path: the same batches as data.loader threads, bit for bit.
    with np.load(mnist_path) as archive:
        np.savez(tmp_path / "digits.npz", x_train=archive["x_train"][:40], y_train=archive["y_train"][:40])
    pack(tmp_path / "digits.npz", tmp_path / "packed", progress=False, workers=1)
    packed = tmp_path / "packed" / "train"
    batch, threads = (_epoch(_loader(packed, path=path, workers=1), 1) for path in ("batch", "threads"))
    assert batch and batch[0][0].shape[1] == 1
    for (a, la), (b, lb) in zip(batch, threads, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_a_record_that_passes_its_checksum_but_does_not_parse_is_named_on_the_batch_path(
    packed: Path,
) -> None:
    """The batch path reads records the short way; a record it cannot parse goes the checked way, which
    names it (a record damaged before its checksum was taken, here its header's image length)."""
    index = read_index(packed)
    start = int(index.shards[0].offsets[1])
    with open(index.shard_path(0), "r+b") as handle:
        handle.seek(start)
        handle.write((10**6).to_bytes(4, "little"))  # the image's stored length: past the record's end
    transform = ImageLabelTransform(spec=AugmentSpec(size=8), seed=0)
    out = np.zeros((4, 3, 8, 8), dtype=np.uint8)
    for skip in (False, True):
        dataset = ShardedDataset(packed, transform=transform, skip_corrupt=skip, check_files=False)
        shard = dataset.index.shards[0]
        end = int(shard.offsets[2])
        crcs = np.array(shard.record_crc32)
        crcs[1] = zlib.crc32(index.shard_path(0).read_bytes()[start:end])
        object.__setattr__(shard, "record_crc32", crcs)  # the checksum of the damaged bytes
        if skip:
            labels = dataset.read_batch_into([(0, i) for i in range(4)], out)
            assert labels[1] is None and None not in (labels[0], labels[2], labels[3])
            assert dataset.skipped == 1
        else:
            with pytest.raises(KaisokuError, match=r"record 1 \(sample 1\) cannot be parsed"):
                dataset.read_batch_into([(0, i) for i in range(4)], out)


def test_the_record_codec_says_none_for_bytes_it_cannot_parse() -> None:
    codec = RecordCodec([Field(name="image", kind="image"), Field(name="label", kind="int")], "raw")
    record, _ = codec.encode({"image": b"\xff\xd8abc", "label": 7})
    assert codec.decode_or_none(record) == {"image": b"\xff\xd8abc", "label": 7} == codec.decode(record)
    for broken in (record[:-1], record + b"\x00", b"\x01"):
        assert codec.decode_or_none(broken) is None
        with pytest.raises((ValueError, struct.error)):
            codec.decode(broken)
