"""Decoding on the device (data.decode gpu), run on the CPU: the host path's crops and flips, its pixels
within the stated tolerance, the same batches for any worker count, the one-line fallback, a training run."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kaisoku.data.loading.batch_augment import decode_batch_into, keyed_crops
from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.loading.gpu_decode import (
    DEVICE_PIXEL_TOLERANCE,
    EncodedBatch,
    decode_on_device,
    decode_place,
    encode_batch,
    jpeg_decoder_library,
)
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.data.loading.transforms import AugmentSpec, decode_image
from kaisoku.data.order.shuffle import ShuffleSpec
from tests.data.loading.test_batch_augment import _jpegs, _raw_blobs
from tests.train_harness import train_env


@pytest.mark.parametrize(("size", "source"), [(16, 16), (24, 72), (64, 64)])
def test_device_step_on_cpu_matches_the_host_path(size: int, source: int) -> None:
    blobs = _jpegs(40, source)
    spec = AugmentSpec(size=size)
    indices = np.arange(200, 240)
    host = np.empty((40, 3, size, size), dtype=np.uint8)
    decode_batch_into(blobs, spec, seed=3, epoch=2, indices=indices, out=host)
    batch = encode_batch(blobs, spec, seed=3, epoch=2, indices=indices)
    assert batch.decoded == {}  # every blob is a JPEG: none decoded on the host
    decoded = [decode_image(blob) for blob in blobs]
    heights, widths = np.array([d.shape[0] for d in decoded]), np.array([d.shape[1] for d in decoded])
    boxes, flips = keyed_crops(heights, widths, spec, seed=3, epoch=2, indices=indices)
    assert np.array_equal(batch.boxes, boxes) and np.array_equal(batch.flips, flips)  # the host path's draws
    assert flips.any() and not flips.all()
    got = batch.to("cpu", non_blocking=True)
    assert got.dtype == torch.uint8 and got.shape == (40, 3, size, size) and got.device.type == "cpu"
    diff = np.abs(got.numpy().astype(np.int16) - host.astype(np.int16))
    largest, mean = DEVICE_PIXEL_TOLERANCE
    assert diff.max() <= largest and diff.mean() <= mean
    # The tolerance is tight enough to catch a missed flip.
    flipped = np.flip(host, axis=3).astype(np.int16)
    assert np.abs(got.numpy().astype(np.int16) - flipped).mean() > 10 * mean


def test_raw_pixels_are_read_on_the_host_and_cropped_on_the_device() -> None:
    """Raw-pixel records (``kaisoku pack --raw-side``) have nothing for nvJPEG: read on the host, then
    cropped, resized and flipped on the device within the tolerance of the host path."""
    blobs = _raw_blobs(_jpegs(16, 24))
    spec = AugmentSpec(size=16)
    indices = np.arange(16)
    host = np.empty((16, 3, 16, 16), dtype=np.uint8)
    decode_batch_into(blobs, spec, seed=3, epoch=2, indices=indices, out=host)
    batch = encode_batch(blobs, spec, seed=3, epoch=2, indices=indices)
    assert sorted(batch.decoded) == list(range(16))
    got = batch.to("cpu", non_blocking=True).numpy().astype(np.int16)
    largest, mean = DEVICE_PIXEL_TOLERANCE
    assert np.abs(got - host).max() <= largest and np.abs(got - host).mean() <= mean


def test_host_decoded_images_are_cropped_on_the_device() -> None:
    image = np.random.default_rng(0).integers(0, 256, (30, 20, 3), dtype=np.uint8)
    batch = EncodedBatch(
        blobs=[torch.empty(0, dtype=torch.uint8)],
        boxes=np.array([[4, 6, 14, 16]]),
        flips=np.array([True]),
        size=10,
        decoded={0: torch.from_numpy(image)},
    )
    got = decode_on_device(batch, torch.device("cpu"))
    # A box of the output's size is copied, not resampled: the flipped crop exactly.
    assert torch.equal(got[0], torch.from_numpy(image[6:16, 4:14][:, ::-1].transpose(2, 0, 1).copy()))


def _loader(packed: Path, *, workers: int, decode: str, device: torch.device | None = None) -> ShardLoader:
    dataset = ShardedDataset(
        packed,
        transform=ImageLabelTransform(spec=AugmentSpec(size=12, scale=(0.3, 1.0)), seed=5),
        decode_images=False,
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
        decode=decode,
        device=device,
    )


def _epoch(loader: ShardLoader, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch)
    return [(images.to("cpu", non_blocking=True).clone(), labels.clone()) for images, labels in loader]


def test_device_batches_are_the_same_for_any_worker_count(packed: Path) -> None:
    runs = {workers: _epoch(_loader(packed, workers=workers, decode="gpu"), 1) for workers in (0, 1, 2)}
    host = _epoch(_loader(packed, workers=1, decode="cpu"), 1)
    assert len(host) > 1 and len(runs[0]) == len(host)
    for workers in (1, 2):
        for (a, la), (b, lb) in zip(runs[0], runs[workers], strict=True):
            assert torch.equal(a, b) and torch.equal(la, lb)
    largest, mean = DEVICE_PIXEL_TOLERANCE
    for (a, la), (b, lb) in zip(runs[0], host, strict=True):  # a PNG and a grey JPEG among them
        diff = (a.to(torch.int16) - b.to(torch.int16)).abs()
        assert torch.equal(la, lb) and int(diff.max()) <= largest and float(diff.float().mean()) <= mean


def test_no_cuda_device_falls_back_to_the_host_with_one_line(
    packed: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kaisoku"):
        loader = _loader(packed, workers=1, decode="gpu", device=torch.device("cpu"))
        silent = decode_place("gpu", torch.device("cpu"), announce=False)  # ranks other than 0
    lines = [r.getMessage() for r in caplog.records if "data.decode" in r.getMessage()]
    assert loader.decode == "cpu" and silent == "cpu" and len(lines) == 1
    assert "no CUDA device" in lines[0] and "\n" not in lines[0]
    loader.set_epoch(0)
    images, _ = next(iter(loader))
    assert isinstance(images, torch.Tensor) and images.shape[1:] == (3, 12, 12)
    assert decode_place("gpu", None, announce=True) == "gpu"  # no device given: as asked


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_train_with_gpu_decode_on_cpu_falls_back_and_trains(packed: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "kaisoku", "train",
        "--run-dir", str(run_dir),
        "--data.path", str(packed),
        "--data.image-size", "16",
        "--data.global-batch", "8",
        "--data.decode", "gpu",
        "--model.stem", "imagenet",
        "--train.max-steps", "2",
        "--train.log-every", "1",
        "--metrics.progress", "false",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, env=train_env())
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert output.count("data.decode gpu: no CUDA device") == 1
    assert "Traceback" not in output


def test_gpu_decode_is_refused_for_data_it_cannot_decode(tmp_path: Path) -> None:
    from kaisoku.cli import resolve_config
    from kaisoku.errors import ConfigError
    from kaisoku.run_facts import plan_run

    cfg, _ = resolve_config(["--data.decode", "gpu", "--data.cache-dir", str(tmp_path)])  # generated shapes
    with pytest.raises(ConfigError, match="data.decode gpu decodes packed JPEG images"):
        plan_run(cfg)


def test_the_device_decoder_library_is_named() -> None:
    """TorchCodec's decoder where it imports (the gpu extra), torchvision's otherwise."""
    try:
        import torchcodec.decoders  # noqa: F401

        expected = "torchcodec"
    except (ImportError, OSError, RuntimeError):
        expected = "torchvision"
    assert jpeg_decoder_library() == expected
