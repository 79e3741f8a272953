"""Decoding, augmentation, collation and normalisation."""

from __future__ import annotations

import io

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image

from kaisoku.data.loading.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    AugmentSpec,
    KeyedRandom,
    augment,
    collate,
    decode_image,
    normalize,
    random_crop_box,
)
from kaisoku.errors import KaisokuError


def _gradient_image(height: int = 48, width: int = 64) -> np.ndarray:
    """A smooth image whose every crop and flip is distinguishable (and survives JPEG)."""
    ys, xs = np.mgrid[0:height, 0:width]
    red = (xs * 255 // max(width - 1, 1)).astype(np.uint8)
    green = (ys * 255 // max(height - 1, 1)).astype(np.uint8)
    blue = ((xs + ys) * 255 // (width + height - 2)).astype(np.uint8)
    return np.stack([red, green, blue], axis=2)


def _png_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_decode_jpeg_rgb_shape_and_content() -> None:
    image = _gradient_image()
    data = simplejpeg.encode_jpeg(image, quality=95)
    decoded = decode_image(data, name="a.jpg")
    assert decoded.shape == (48, 64, 3)
    assert decoded.dtype == np.uint8
    assert np.abs(decoded.astype(int) - image.astype(int)).mean() < 3


def test_decode_png_exact() -> None:
    image = _gradient_image(17, 23)
    decoded = decode_image(_png_bytes(image))
    np.testing.assert_array_equal(decoded, image)


def test_decode_grayscale_jpeg_and_png_give_three_channels() -> None:
    gray = _gradient_image(20, 30)[:, :, :1]
    jpeg = decode_image(simplejpeg.encode_jpeg(np.ascontiguousarray(gray), colorspace="GRAY"))
    png = decode_image(_png_bytes(gray[:, :, 0]))
    for decoded in (jpeg, png):
        assert decoded.shape == (20, 30, 3)
        np.testing.assert_array_equal(decoded[:, :, 0], decoded[:, :, 2])
    np.testing.assert_array_equal(png[:, :, 1], gray[:, :, 0])


def test_decode_cmyk_jpeg_gives_three_channels() -> None:
    buffer = io.BytesIO()
    Image.fromarray(_gradient_image(16, 16)).convert("CMYK").save(buffer, format="JPEG")
    assert decode_image(buffer.getvalue()).shape == (16, 16, 3)


def test_decode_min_side_scales_large_jpeg() -> None:
    data = simplejpeg.encode_jpeg(_gradient_image(256, 320))
    assert decode_image(data, min_side=64).shape == (64, 80, 3)
    assert decode_image(data).shape == (256, 320, 3)


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image at all", b"\xff\xd8\xff\xe0garbage", b"\x89PNG\r\n\x1a\n" + b"\0" * 20],
    ids=["empty", "text", "jpeg-magic", "png-magic"],
)
def test_decode_garbage_names_the_image(data: bytes) -> None:
    with pytest.raises(KaisokuError, match="shard-3 record 7"):
        decode_image(data, name="shard-3 record 7")


def test_decode_truncated_jpeg_raises() -> None:
    data = simplejpeg.encode_jpeg(_gradient_image())
    with pytest.raises(KaisokuError, match="cut.jpg"):
        decode_image(data[: len(data) // 2], name="cut.jpg")


def test_augment_train_is_keyed_by_seed_epoch_index() -> None:
    image = _gradient_image()
    spec = AugmentSpec(size=24)
    first = augment(image, spec, seed=1, epoch=2, index=3)
    again = augment(image, spec, seed=1, epoch=2, index=3)
    assert first.shape == (3, 24, 24)
    assert first.dtype == np.uint8
    assert first.flags.c_contiguous
    np.testing.assert_array_equal(first, again)
    for key in ({"seed": 2, "epoch": 2, "index": 3}, {"seed": 1, "epoch": 3, "index": 3}):
        assert not np.array_equal(first, augment(image, spec, **key))
    # Across many indices the crops differ: not one fixed crop.
    crops = {augment(image, spec, seed=1, epoch=2, index=i).tobytes() for i in range(8)}
    assert len(crops) == 8


def test_keyed_random_is_a_pure_function_of_its_key() -> None:
    first = [KeyedRandom(3, 1, 7).random() for _ in range(2)]
    assert first[0] == first[1]
    stream = KeyedRandom(3, 1, 7)
    draws = [stream.random() for _ in range(4)]
    assert len(set(draws)) == 4 and draws[0] == first[0]
    assert KeyedRandom(3, 1, 8).random() != draws[0]
    assert KeyedRandom(3, 2, 7).random() != draws[0]
    assert KeyedRandom(-1, 0, 0).random() != KeyedRandom(0, 0, 0).random()
    values = np.array([KeyedRandom(0, 0, i).random() for i in range(4000)])
    assert 0.0 <= values.min() and values.max() < 1.0
    assert abs(values.mean() - 0.5) < 0.02
    counts = np.histogram(values, bins=4, range=(0, 1))[0]
    assert counts.min() > 900
    flips = [KeyedRandom(5, 0, i).integers(0, 2) for i in range(4000)]
    assert 0.45 < np.mean(flips) < 0.55


def test_random_crop_box_respects_scale_and_ratio() -> None:
    spec = AugmentSpec(size=8, scale=(0.2, 0.6), ratio=(0.5, 2.0))
    for i in range(300):
        left, top, right, bottom = random_crop_box(60, 80, spec, KeyedRandom(0, 0, i))
        assert 0 <= left < right <= 80 and 0 <= top < bottom <= 60
        area = (right - left) * (bottom - top) / (60 * 80)
        assert 0.18 <= area <= 0.62
        assert 0.45 <= (right - left) / (bottom - top) <= 2.2


def test_augment_flip_only_mirrors_full_image() -> None:
    image = _gradient_image(32, 32)
    spec = AugmentSpec(size=32, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    outputs = [augment(image, spec, seed=0, epoch=0, index=i) for i in range(16)]
    chw = image.transpose(2, 0, 1)
    flipped = chw[:, :, ::-1]
    kinds = set()
    for out in outputs:
        if np.array_equal(out, chw):
            kinds.add("same")
        elif np.array_equal(out, flipped):
            kinds.add("flipped")
        else:
            pytest.fail("a full-image crop at the same size must be the image or its mirror")
    assert kinds == {"same", "flipped"}
    no_flip = AugmentSpec(size=32, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False)
    for i in range(16):
        np.testing.assert_array_equal(augment(image, no_flip, seed=0, epoch=0, index=i), chw)


def test_augment_eval_is_deterministic_center_crop() -> None:
    image = _gradient_image(40, 80)
    spec = AugmentSpec(size=20, train=False)
    out = augment(image, spec, seed=1, epoch=0, index=0)
    assert out.shape == (3, 20, 20)
    np.testing.assert_array_equal(out, augment(image, spec, seed=9, epoch=5, index=123))
    # Reference: resize the shorter side to 20 (40x80 -> 20x40), then crop the centre 20 columns.
    reference = np.asarray(Image.fromarray(image).resize((40, 20), Image.Resampling.BILINEAR))[:, 10:30]
    assert np.abs(out.transpose(1, 2, 0).astype(int) - reference.astype(int)).max() <= 2
    # The centre: the red channel (x ramp) sits around its middle value.
    assert abs(int(out[0].mean()) - 127) < 10


def test_augment_grayscale_array_keeps_one_channel() -> None:
    gray = _gradient_image(30, 30)[:, :, 0]
    spec = AugmentSpec(size=16, train=False)
    out = augment(gray, spec, seed=0, epoch=0, index=0)
    assert out.shape == (1, 16, 16)
    np.testing.assert_array_equal(augment(gray[:, :, None], spec, seed=0, epoch=0, index=0), out)
    # Same pixels as the green channel of the RGB image it came from would give.
    rgb = np.repeat(gray[:, :, None], 3, axis=2)
    np.testing.assert_array_equal(augment(rgb, spec, seed=0, epoch=0, index=0)[1], out[0])
    train = augment(gray, AugmentSpec(size=12), seed=3, epoch=1, index=4)
    assert train.shape == (1, 12, 12)
    with pytest.raises(KaisokuError, match="HW"):
        augment(np.zeros((4, 4, 2), dtype=np.uint8), spec, seed=0, epoch=0, index=0)
    with pytest.raises(KaisokuError, match="uint8"):
        augment(np.zeros((4, 4), dtype=np.float32), spec, seed=0, epoch=0, index=0)


def test_augment_tiny_and_extreme_aspect_images() -> None:
    spec = AugmentSpec(size=8)
    for shape in ((1, 1, 3), (2, 200, 3), (200, 2, 3)):
        image = np.full(shape, 7, dtype=np.uint8)
        out = augment(image, spec, seed=0, epoch=0, index=0)
        assert out.shape == (3, 8, 8)
        assert (out == 7).all()


def test_augment_spec_rejects_bad_values() -> None:
    with pytest.raises(KaisokuError, match="size"):
        AugmentSpec(size=0)
    with pytest.raises(KaisokuError, match="scale"):
        AugmentSpec(size=8, scale=(0.5, 0.1))
    with pytest.raises(KaisokuError, match="ratio"):
        AugmentSpec(size=8, ratio=(0.0, 1.0))


def test_collate_shapes_and_dtypes() -> None:
    samples = [(np.full((3, 4, 5), i, dtype=np.uint8), i) for i in range(3)]
    images, labels = collate(samples)
    assert images.shape == (3, 3, 4, 5)
    assert images.dtype == torch.uint8
    assert labels.dtype == torch.int64
    assert labels.tolist() == [0, 1, 2]
    assert images[2].eq(2).all()


def test_collate_leaves_out_skipped_samples() -> None:
    samples = [None, (np.zeros((1, 2, 2), dtype=np.uint8), 4), None, (np.ones((1, 2, 2), dtype=np.uint8), 5)]
    images, labels = collate(samples)
    assert images.shape == (2, 1, 2, 2)
    assert labels.tolist() == [4, 5]
    with pytest.raises(KaisokuError, match="none left"):
        collate([None, None])


def test_normalize_matches_formula() -> None:
    batch = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    out = normalize(batch)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    expected = (batch.float() / 255 - mean) / std
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    assert normalize(batch, dtype=torch.bfloat16).dtype == torch.bfloat16
    one_channel = normalize(batch[:, :1], mean=(0.5,), std=(0.5,))
    torch.testing.assert_close(one_channel, batch[:, :1].float() / 127.5 - 1)
    with pytest.raises(KaisokuError, match="channels"):
        normalize(batch, mean=(0.5,), std=(0.5,))


def test_a_channels_last_batch_normalises_into_the_layout_asked_for() -> None:
    from kaisoku.engine.tasks import Classification

    batch = torch.randint(0, 256, (2, 3, 5, 4), dtype=torch.uint8).contiguous(
        memory_format=torch.channels_last
    )
    expected = normalize(batch.contiguous())
    plain = normalize(batch)
    assert plain.is_contiguous() and torch.equal(plain, expected)
    last = normalize(batch, memory_format=torch.channels_last)
    assert last.is_contiguous(memory_format=torch.channels_last) and not last.is_contiguous()
    assert torch.equal(last, expected)
    # The trainer's step: contiguous for a model that may ``view`` its input, channels-last where the run is.
    for channels_last in (False, True):
        task = Classification(IMAGENET_MEAN, IMAGENET_STD, channels_last)
        inputs, _ = task.prepare(batch, None)
        assert inputs.is_contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format
        )
        assert torch.equal(inputs, expected)
        unnormalised, _ = Classification((), (), channels_last).prepare(batch, None)
        assert unnormalised.is_contiguous() == (not channels_last) and torch.equal(unnormalised, batch)


def test_whole_pixel_crops_resample_like_pil_inside_the_crop_and_take_read_only_images() -> None:
    import warnings

    from kaisoku.data.loading.transforms import _resize_box

    image = _gradient_image(60, 80)
    box = (10, 5, 70, 55)  # 60 x 50 -> 32 x 32: a downscale, antialiased
    ours = _resize_box(image, box, 32)
    assert ours.shape == (32, 32, 3) and ours.dtype == np.uint8
    reference = np.asarray(Image.fromarray(image).resize((32, 32), Image.Resampling.BILINEAR, box=box))
    # Inside the crop both resamplers see the same pixels (PIL's filter also reads outside the box at its edges).
    inner = np.abs(ours[2:-2, 2:-2].astype(int) - reference[2:-2, 2:-2].astype(int))
    assert inner.max() <= 1
    frozen = image.copy()
    frozen.flags.writeable = False  # a record viewed in place
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(_resize_box(frozen, box, 32), ours)
    gray = _resize_box(np.ascontiguousarray(image[:, :, 1]), box, 32)
    np.testing.assert_array_equal(gray, ours[:, :, 1])
