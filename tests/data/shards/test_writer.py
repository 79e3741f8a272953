"""Packing ImageFolder trees, .npz archives and iterables into shards."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from kaisoku.data.shards.format import INDEX_NAME, read_index
from kaisoku.data.shards.records import RecordCodec, record_view
from kaisoku.data.shards.tables import TABLES_NAME
from kaisoku.data.shards.writer import pack, pack_records, plan_shards
from kaisoku.errors import KaisokuError
from tests.fs_harness import REFUSALS, refusing_folder

CLASSES = ("cat", "dog", "emu")


def image_array(seed: int, height: int = 20, width: int = 24) -> np.ndarray:
    """A small smooth RGB image that differs per seed."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(1, 1, 3))
    ys, xs = np.mgrid[0:height, 0:width]
    image = (base + xs[:, :, None] * 5 + ys[:, :, None] * 3) % 256
    return image.astype(np.uint8)


def png_bytes(array: np.ndarray) -> bytes:
    """``array`` encoded as PNG."""
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def make_image_folder(root: Path, per_class: int = 6) -> dict[str, bytes]:
    """An ImageFolder tree of real JPEGs (plus one PNG, one grayscale JPEG, one nested file).

    Returns relative path -> file bytes.
    """
    files: dict[str, bytes] = {}
    seed = 0
    for name in CLASSES:
        for i in range(per_class):
            seed += 1
            relative = f"{name}/img_{i:02d}.jpg"
            data = simplejpeg.encode_jpeg(image_array(seed), quality=90)
            files[relative] = data
    files[f"{CLASSES[0]}/extra.png"] = png_bytes(image_array(100))
    gray = np.ascontiguousarray(image_array(101)[:, :, :1])
    files[f"{CLASSES[1]}/gray.jpg"] = simplejpeg.encode_jpeg(gray, colorspace="GRAY")
    files[f"{CLASSES[2]}/nested/deep.JPEG"] = simplejpeg.encode_jpeg(image_array(102))
    for relative, data in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / CLASSES[0] / "notes.txt").write_text("not an image")
    (root / CLASSES[0] / ".hidden.jpg").write_bytes(b"ignored")
    return files


def all_records(path: Path) -> list[dict]:
    """Every record of a packed dataset, decoded to fields, in global order."""
    index = read_index(path)
    codec = RecordCodec(index.fields, index.codec)
    out = []
    for shard_id, shard in enumerate(index.shards):
        data = index.shard_path(shard_id).read_bytes()
        for record in range(shard.samples):
            out.append(codec.decode(record_view(index, data, shard_id, record)))
    return out


def test_plan_shards_cuts_on_logical_size() -> None:
    assert plan_shards([4, 4, 4, 4], 8) == [(0, 2), (2, 4)]
    assert plan_shards([4, 4, 4], 9) == [(0, 2), (2, 3)]
    assert plan_shards([20, 1, 1], 8) == [(0, 1), (1, 3)]
    assert plan_shards([], 8) == []
    with pytest.raises(KaisokuError, match="positive"):
        plan_shards([1], 0)


def test_pack_image_folder_round_trip(tmp_path: Path) -> None:
    files = make_image_folder(tmp_path / "src")
    index = pack(tmp_path / "src", tmp_path / "dst", shard_bytes=4096, workers=0, progress=False)
    assert index.classes == CLASSES
    assert index.num_samples == len(files)
    assert len(index.shards) > 1
    records = all_records(tmp_path / "dst")
    # Every source file is stored byte for byte, under its class label.
    stored = sorted((r["image"], r["label"]) for r in records)
    expected = sorted((data, CLASSES.index(rel.split("/")[0])) for rel, data in files.items())
    assert stored == expected
    assert index.columns["label"].tolist() == [r["label"] for r in records]
    # Shuffled before sharding: the first shard is not one class.
    first = index.shards[0].samples
    assert len(set(index.columns["label"][: max(first, 6)].tolist())) > 1
    # Shards respect the target (a shard over it holds a single record).
    for shard in index.shards:
        assert shard.nbytes <= 4096 or shard.samples == 1


def test_pack_unshuffled_keeps_class_order(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "src")
    index = pack(tmp_path / "src", tmp_path / "dst", shuffle=False, workers=0, progress=False)
    labels = index.columns["label"]
    assert labels.tolist() == sorted(labels.tolist())


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.timeout(120)
def test_pack_is_deterministic_across_workers_and_codecs(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "a", shard_bytes=3000, workers=0, progress=False)
    pack(tmp_path / "src", tmp_path / "b", shard_bytes=3000, workers=2, progress=False)
    first = _tree_bytes(tmp_path / "a")
    assert len(first) > 3
    assert first == _tree_bytes(tmp_path / "b")
    # Shard boundaries do not depend on the codec (cut on logical size).
    zstd = pack(tmp_path / "src", tmp_path / "c", shard_bytes=3000, codec="zstd", workers=0, progress=False)
    assert zstd.shard_sizes().tolist() == read_index(tmp_path / "a").shard_sizes().tolist()


def test_pack_image_folder_split_tree_shares_labels(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "src" / "train", per_class=2)
    (tmp_path / "src" / "val" / "emu").mkdir(parents=True)
    (tmp_path / "src" / "val" / "emu" / "v.jpg").write_bytes(simplejpeg.encode_jpeg(image_array(7)))
    (tmp_path / "src" / "manifest.json").write_text("{}")
    indexes = pack(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)
    assert set(indexes) == {"train", "val"}
    assert indexes["val"].classes == indexes["train"].classes == CLASSES
    # val has only "emu": its label is emu's position among all classes, not 0.
    assert indexes["val"].columns["label"].tolist() == [CLASSES.index("emu")]
    assert read_index(tmp_path / "dst" / "train").num_samples == 9


def test_pack_npz_splits(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x_train = rng.integers(0, 256, size=(40, 8, 8), dtype=np.uint8)
    y_train = rng.integers(0, 10, size=40)
    x_val = rng.normal(size=(7, 5)).astype(np.float32)
    y_val = rng.normal(size=(7, 2)).astype(np.float64)
    np.savez(tmp_path / "data.npz", x_train=x_train, y_train=y_train, x_val=x_val, y_val=y_val)
    indexes = pack(tmp_path / "data.npz", tmp_path / "dst", codec="zstd", shard_bytes=300, progress=False)
    assert set(indexes) == {"train", "val"}
    assert (tmp_path / "dst" / "train" / INDEX_NAME).is_file()
    train = indexes["train"]
    assert [f.name for f in train.fields] == ["image", "label"]
    assert train.fields[0].shape == (8, 8)
    assert len(train.shards) > 1
    records = all_records(tmp_path / "dst" / "train")
    order = [next(i for i in range(40) if np.array_equal(x_train[i], r["image"])) for r in records]
    assert sorted(order) == list(range(40))
    assert [r["label"] for r in records] == y_train[order].tolist()
    assert train.columns["label"].tolist() == y_train[order].tolist()
    val = all_records(tmp_path / "dst" / "val")
    assert [f.name for f in indexes["val"].fields] == ["x", "y"]
    got = sorted(zip((r["x"].tobytes() for r in val), (r["y"].tobytes() for r in val)))
    assert got == sorted(zip((row.tobytes() for row in x_val), (row.tobytes() for row in y_val)))


def test_pack_mnist_subset(tmp_path: Path, mnist_path: Path) -> None:
    with np.load(mnist_path, allow_pickle=False) as archive:
        x, y = archive["x_test"][:500], archive["y_test"][:500]
    np.savez(tmp_path / "small.npz", x_test=x, y_test=y)
    index = pack(tmp_path / "small.npz", tmp_path / "dst", shuffle=False, workers=0, progress=False)["test"]
    records = all_records(tmp_path / "dst" / "test")
    np.testing.assert_array_equal(np.stack([r["image"] for r in records]), x)
    np.testing.assert_array_equal(index.columns["label"], y)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"a": np.zeros(3)}, "no x_<split>"),
        ({"x_train": np.zeros((3, 2)), "y_val": np.zeros(3)}, "train, val"),
        ({"x_train": np.zeros((3, 2)), "y_train": np.zeros(4, dtype=int)}, "must match"),
    ],
    ids=["no-arrays", "unpaired", "length-mismatch"],
)
def test_pack_npz_bad_archives(tmp_path: Path, arrays: dict, message: str) -> None:
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(KaisokuError, match=message):
        pack(tmp_path / "bad.npz", tmp_path / "dst", workers=0, progress=False)


def test_pack_records_infers_schema(tmp_path: Path) -> None:
    jpeg = simplejpeg.encode_jpeg(image_array(1))
    samples = [
        {"image": jpeg, "label": i, "name": f"s{i}", "blob": bytes([i]) * 50, "vec": np.arange(3.0) * i}
        for i in range(30)
    ]
    index = pack_records(iter(samples), tmp_path / "dst", codec="zstd", shard_bytes=2048, progress=False)
    kinds = {f.name: f.kind for f in index.fields}
    assert kinds == {"image": "image", "label": "int", "name": "str", "blob": "bytes", "vec": "array"}
    records = all_records(tmp_path / "dst")
    assert len(records) == 30 and len(index.shards) > 1
    for i, record in enumerate(records):
        assert record["image"] == jpeg
        assert record["label"] == i and record["name"] == f"s{i}" and record["blob"] == bytes([i]) * 50
        np.testing.assert_array_equal(record["vec"], np.arange(3.0) * i)
    with pytest.raises(KaisokuError, match="vec"):
        pack_records([{"vec": np.zeros(2)}, {"vec": np.zeros(3)}], tmp_path / "e", progress=False)
    with pytest.raises(KaisokuError, match="empty"):
        pack_records([], tmp_path / "f", progress=False)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_unreadable_image_names_the_file(tmp_path: Path, workers: int) -> None:
    files = make_image_folder(tmp_path / "src")
    bad = tmp_path / "src" / "dog" / "broken.jpg"
    bad.write_bytes(files["dog/img_00.jpg"][:300])
    with pytest.raises(KaisokuError, match="broken.jpg"):
        pack(tmp_path / "src", tmp_path / "dst", workers=workers, progress=False)
    # No half-written pack is left that looks like a dataset.
    assert not (tmp_path / "dst" / INDEX_NAME).exists()
    assert not list((tmp_path / "dst").glob("*.kshard"))


def test_unreadable_image_skipped_when_asked(tmp_path: Path) -> None:
    files = make_image_folder(tmp_path / "src")
    (tmp_path / "src" / "emu" / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    index = pack(tmp_path / "src", tmp_path / "dst", workers=0, progress=False, skip_corrupt=True)
    assert index.skipped == ("emu/garbage.png",)
    assert index.num_samples == len(files)
    assert read_index(tmp_path / "dst").skipped == ("emu/garbage.png",)


def test_non_empty_destination_refused_unless_overwrite(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "src")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    with pytest.raises(KaisokuError, match="not empty.*overwrite"):
        pack(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)
    assert not (tmp_path / "dst" / INDEX_NAME).exists()
    small = pack(
        tmp_path / "src", tmp_path / "dst", shard_bytes=2000, workers=0, progress=False, overwrite=True
    )
    assert len(small.shards) > 2
    big = pack(tmp_path / "src", tmp_path / "dst", workers=0, progress=False, overwrite=True)
    assert len(big.shards) == 1
    # Stale shards of the previous pack are gone; other files are left alone.
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == sorted(
        ["keep.txt", INDEX_NAME, TABLES_NAME, big.shards[0].file]
    )


def test_destination_inside_source_refused(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "src")
    with pytest.raises(KaisokuError, match="inside the source"):
        pack(tmp_path / "src", tmp_path / "src" / "packed", workers=0, progress=False)


def test_bad_source_and_codec(tmp_path: Path) -> None:
    with pytest.raises(KaisokuError, match="does not exist"):
        pack(tmp_path / "nope", tmp_path / "dst", progress=False)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(KaisokuError, match="neither"):
        pack(tmp_path / "file.txt", tmp_path / "dst", progress=False)
    make_image_folder(tmp_path / "src", per_class=1)
    with pytest.raises(KaisokuError, match="unknown codec 'brotli'"):
        pack(tmp_path / "src", tmp_path / "dst", codec="brotli", progress=False)


def test_progress_bar_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_image_folder(tmp_path / "src", per_class=2)
    index = pack(tmp_path / "src", tmp_path / "dst", workers=0, progress=True)
    assert index.num_samples == 9


def test_empty_class_folder_is_an_error(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "src")
    (tmp_path / "src" / "zebra").mkdir()
    (tmp_path / "src" / "zebra" / "readme.txt").write_text("no images here")
    with pytest.raises(KaisokuError, match="zebra holds no images"):
        pack(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)
    assert not (tmp_path / "dst").exists()


def test_tree_without_class_folders_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jpg").write_bytes(simplejpeg.encode_jpeg(image_array(0)))
    with pytest.raises(KaisokuError, match="no class folders"):
        pack(tmp_path / "src", tmp_path / "dst", workers=0, progress=False)


@pytest.mark.parametrize("kind", REFUSALS)
def test_pack_into_a_full_read_only_or_immutable_destination_is_one_line(tmp_path: Path, kind: str) -> None:
    make_image_folder(tmp_path / "src", per_class=12)
    with refusing_folder(tmp_path / "mnt", kind) as dest:
        result = subprocess.run(
            [sys.executable, "-m", "kaisoku", "pack", str(tmp_path / "src"), str(dest), "--shard-size", "8KiB"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert lines[0].startswith(f"kaisoku: error: cannot write the pack to {dest}: "), lines
        reason = {"full": "no space left", "read-only": "read-only file system", "immutable": "not permitted"}
        assert reason[kind] in lines[0], lines
        left = [p.name for p in dest.rglob("*")] if dest.exists() else []
        assert left == []  # no shard, temp file, index or empty split folder left behind
        assert dest.exists() == (kind != "full")  # a folder the pack made itself is gone too


def test_pack_recodes_images_as_jpegs_of_the_quality_subsampling_and_size_asked(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``--jpeg-quality``, ``--jpeg-subsampling`` and ``--max-side`` re-encode every image (PNG and grayscale
    sources included), recorded in the index; without them the source's bytes are stored as they are."""
    from kaisoku.data.loading.dataset import ShardedDataset
    from kaisoku.data.shards.format import read_index
    from kaisoku.data.shards.records import RecordCodec
    from tests.train_harness import kaisoku_in_process

    files = make_image_folder(tmp_path / "src", per_class=3)
    args = ["pack", str(tmp_path / "src"), str(tmp_path / "dst"), "--workers", "1", "--no-shuffle"]
    result = kaisoku_in_process(
        capfd, *args, "--jpeg-quality", "75", "--jpeg-subsampling", "420", "--max-side", "12"
    )
    assert result.returncode == 0, result.stderr
    index = read_index(tmp_path / "dst")
    assert index.pack["recode"] == {"quality": 75, "subsampling": "420", "max_side": 12, "raw_side": 0}
    dataset = ShardedDataset(tmp_path / "dst")
    codec = RecordCodec(index.fields, index.codec)
    sources = {len(data) for data in files.values()}
    for i in range(len(dataset)):
        data = codec.decode(dataset.record_bytes(i))["image"]
        height, width, colorspace, subsampling = simplejpeg.decode_jpeg_header(bytes(data))
        assert max(height, width) <= 12 and len(data) not in sources
        assert (colorspace, subsampling) in (("YCbCr", "420"), ("Gray", "Gray"))

    plain = kaisoku_in_process(
        capfd, "pack", str(tmp_path / "src"), str(tmp_path / "plain"), "--workers", "1"
    )
    assert plain.returncode == 0 and "recode" not in read_index(tmp_path / "plain").pack
    refused = kaisoku_in_process(capfd, *args[:2], str(tmp_path / "other"), "--jpeg-quality", "101")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "kaisoku: error: kaisoku pack: JPEG quality 101 is outside 0..100 (0: keep the source's bytes)"
    )


def test_pack_stores_images_up_to_the_raw_side_as_raw_pixels(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``--raw-side`` stores an image whose longer side is at most that as raw pixels (P6 RGB, P5 grey, the
    source's decoded pixels exactly), recorded in the index; a larger image keeps the source's bytes, or
    is re-encoded with ``--jpeg-quality``; ``--max-side`` caps before the raw side is judged."""
    from kaisoku.data.loading.dataset import ShardedDataset
    from kaisoku.data.loading.transforms import decode_image
    from kaisoku.data.shards.format import read_index
    from kaisoku.data.shards.records import RecordCodec
    from tests.train_harness import kaisoku_in_process

    files = make_image_folder(tmp_path / "src", per_class=2)  # 20 x 24 images: RGB and grey JPEGs, a PNG
    large = simplejpeg.encode_jpeg(image_array(7, height=40, width=48), quality=95)
    (tmp_path / "src" / CLASSES[2] / "large.jpg").write_bytes(large)
    files[f"{CLASSES[2]}/large.jpg"] = large
    rgba = Image.fromarray(np.dstack([image_array(8), np.full((20, 24, 1), 128, np.uint8)]))
    palette = Image.fromarray(image_array(9)).quantize(16)
    for name, image in (("rgba.png", rgba), ("palette.png", palette)):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        (tmp_path / "src" / CLASSES[0] / name).write_bytes(buffer.getvalue())
        files[f"{CLASSES[0]}/{name}"] = buffer.getvalue()

    def stored(dst: str, *options: str) -> tuple[Any, list[bytes]]:
        args = ["pack", str(tmp_path / "src"), str(tmp_path / dst), "--workers", "1", "--no-shuffle"]
        result = kaisoku_in_process(capfd, *args, *options)
        assert result.returncode == 0, result.stderr
        index = read_index(tmp_path / dst)
        codec = RecordCodec(index.fields, index.codec)
        dataset = ShardedDataset(tmp_path / dst)
        return index, [bytes(codec.decode(dataset.record_bytes(i))["image"]) for i in range(len(dataset))]

    index, images = stored("raw", "--raw-side", "24")
    assert index.pack["recode"] == {"quality": 0, "subsampling": "420", "max_side": 0, "raw_side": 24}
    raw = [data for data in images if data[:2] in (b"P6", b"P5")]
    assert len(raw) == len(files) - 1 and sum(data.startswith(b"P5\n24 20\n255\n") for data in raw) == 1
    assert large in images  # longer than the raw side, no quality asked: the source's bytes
    # Each record is its own source's decoded pixels: in source order (no shuffle), the large one kept.
    sources = [decode_image(files[name]) for name in sorted(files) if name != f"{CLASSES[2]}/large.jpg"]
    assert sorted(decode_image(data).tobytes() for data in raw) == sorted(p.tobytes() for p in sources)

    _, recoded = stored("recoded", "--raw-side", "24", "--jpeg-quality", "80")
    (jpeg,) = [data for data in recoded if data[:2] == b"\xff\xd8"]
    assert jpeg != large and simplejpeg.decode_jpeg_header(jpeg)[:2] == (40, 48)
    _, capped = stored("capped", "--raw-side", "24", "--max-side", "24")
    assert all(data.startswith(b"P6\n24 20\n255\n") or data.startswith(b"P5") for data in capped)

    refused = kaisoku_in_process(
        capfd, "pack", str(tmp_path / "src"), str(tmp_path / "x"), "--raw-side", "-1"
    )
    assert refused.returncode == 2
    assert refused.stderr.strip() == "kaisoku: error: kaisoku pack: raw side -1 is negative"


def test_raw_recode_settings_that_do_nothing_or_cannot_resize_are_refused() -> None:
    from kaisoku.data.shards.recode import ImageRecode

    with pytest.raises(ValueError, match="a max side needs a JPEG quality"):
        ImageRecode(quality=0, max_side=32, raw_side=16)
    with pytest.raises(ValueError, match="give a raw side, or nothing is recoded"):
        ImageRecode(quality=0)
    with pytest.raises(ValueError, match="raw side -2 is negative"):
        ImageRecode(raw_side=-2)


def test_other_pnm_headers_are_read_by_pillow() -> None:
    """Only the header ``kaisoku pack`` writes is viewed in place; a PNM with a comment (or 16 bits) is
    Pillow's to read, with the same pixels."""
    from kaisoku.data.loading.transforms import decode_image, raw_pixels

    pixels = image_array(3)
    commented = b"P6\n# made elsewhere\n24 20\n255\n" + pixels.tobytes()
    assert raw_pixels(commented) is None
    assert np.array_equal(decode_image(commented), pixels)
    truncated = b"P6\n24 20\n255\n" + pixels.tobytes()[:-5]
    assert raw_pixels(truncated) is None
    with pytest.raises(KaisokuError, match="cannot decode image"):
        decode_image(truncated)


def test_an_image_that_cannot_be_recoded_is_named_in_one_line_or_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image that passes the JPEG check but that Pillow refuses to open for re-encoding (here: over a
    lowered decompression-bomb limit) stops the pack naming the file, or is skipped with skip_corrupt."""
    from kaisoku.data.shards.recode import ImageRecode

    for name in CLASSES[:2]:
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "a.jpg").write_bytes(simplejpeg.encode_jpeg(image_array(1)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 20 x 24 = 480 pixels: over twice the limit
    recode = ImageRecode(quality=0, raw_side=64)
    with pytest.raises(KaisokuError, match=r"^cannot re-encode image .*a\.jpg: .*--skip-corrupt") as error:
        pack(tmp_path / "src", tmp_path / "dst", workers=0, progress=False, recode=recode)
    assert "\n" not in str(error.value)
    small = tmp_path / "src" / CLASSES[2] / "small.jpg"  # 8 x 8 = 64 pixels: under the limit
    small.parent.mkdir()
    small.write_bytes(simplejpeg.encode_jpeg(image_array(2, height=8, width=8)))
    index = pack(
        tmp_path / "src", tmp_path / "dst2", workers=0, progress=False, recode=recode, skip_corrupt=True
    )
    assert sorted(index.skipped) == [f"{CLASSES[0]}/a.jpg", f"{CLASSES[1]}/a.jpg"] and index.num_samples == 1
