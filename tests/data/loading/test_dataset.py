"""ShardedDataset: random access, DataLoader workers, the cache seam and damaged shards."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.loading.folder import ShardedEvalSampler
from kaisoku.data.loading.transforms import AugmentSpec, augment, collate, decode_image
from kaisoku.data.shards.format import read_index
from kaisoku.data.shards.records import CorruptRecordError
from kaisoku.data.shards.writer import pack
from kaisoku.errors import KaisokuError
from tests.data.shards.test_writer import CLASSES, make_image_folder


@pytest.fixture
def folder(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A packed ImageFolder tree (several shards) and its source files."""
    files = make_image_folder(tmp_path / "src")
    pack(tmp_path / "src", tmp_path / "dst", shard_bytes=3000, workers=0, progress=False)
    return tmp_path / "dst", files


def _by_content(files: dict[str, bytes]) -> dict[bytes, tuple[np.ndarray, int]]:
    return {
        decode_image(data).tobytes(): (decode_image(data), CLASSES.index(rel.split("/")[0]))
        for rel, data in files.items()
    }


class MemoryOpener:
    """A picklable shard opener serving shard bytes from memory, counting its calls."""

    def __init__(self, path: Path) -> None:
        index = read_index(path)
        self.shards = [index.shard_path(i).read_bytes() for i in range(len(index.shards))]
        self.calls = 0

    def __call__(self, shard_id: int) -> bytes:
        self.calls += 1
        return self.shards[shard_id]


def test_samples_decode_to_the_source_images(folder: tuple[Path, dict[str, bytes]]) -> None:
    path, files = folder
    dataset = ShardedDataset(path)
    expected = _by_content(files)
    assert len(dataset) == len(files)
    seen = set()
    for i in range(len(dataset)):
        sample = dataset[i]
        image = sample["image"]
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
        _, label = expected[image.tobytes()]
        assert sample["label"] == label == dataset.labels[i]
        seen.add(image.tobytes())
    assert len(seen) == len(files)
    assert dataset[-1]["label"] == dataset.labels[-1]
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    assert dataset.classes == CLASSES


def test_shard_level_information(folder: tuple[Path, dict[str, bytes]]) -> None:
    path, _ = folder
    dataset = ShardedDataset(path)
    sizes = dataset.shard_sizes()
    assert sizes.sum() == len(dataset) and len(sizes) > 2
    assert [p.name for p in dataset.shard_paths()] == [f"shard-{i:05d}.kshard" for i in range(len(sizes))]
    assert all(p.stat().st_size == n for p, n in zip(dataset.shard_paths(), dataset.shard_nbytes()))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for index in range(len(dataset)):
        shard_id, record = dataset.shard_of(index)
        assert starts[shard_id] + record == index and 0 <= record < sizes[shard_id]
    shard_ids, records = dataset.locate(np.arange(len(dataset)))
    assert (starts[shard_ids] + records).tolist() == list(range(len(dataset)))
    with pytest.raises(IndexError):
        dataset.locate([len(dataset)])
    with pytest.raises(KaisokuError, match="no int column 'weight'"):
        dataset.column("weight")


def test_transform_keyed_by_epoch_and_index(folder: tuple[Path, dict[str, bytes]]) -> None:
    path, _ = folder
    spec = AugmentSpec(size=12)
    dataset = ShardedDataset(path, transform=ImageLabelTransform(spec=spec, seed=5))
    plain = ShardedDataset(path)
    image, label = dataset[3]
    assert image.shape == (3, 12, 12) and label == dataset.labels[3]
    expected = augment(plain[3]["image"], spec, seed=5, epoch=0, index=3)
    np.testing.assert_array_equal(image, expected)
    dataset.set_epoch(2)
    at_epoch_2 = dataset[3][0]
    np.testing.assert_array_equal(at_epoch_2, dataset[(2, 3)][0])
    np.testing.assert_array_equal(at_epoch_2, augment(plain[3]["image"], spec, seed=5, epoch=2, index=3))
    # Encoded images (decode_images=False) are decoded by the transform: same result.
    lazy = ShardedDataset(path, transform=ImageLabelTransform(spec=spec, seed=5), decode_images=False)
    assert isinstance(ShardedDataset(path, decode_images=False)[3]["image"], bytes)
    np.testing.assert_array_equal(lazy[(2, 3)][0], at_epoch_2)


@pytest.mark.timeout(120)
def test_works_in_a_dataloader_with_workers(folder: tuple[Path, dict[str, bytes]]) -> None:
    path, files = folder
    dataset = ShardedDataset(path, transform=ImageLabelTransform(spec=AugmentSpec(size=8), seed=0))
    dataset[0]  # mmaps open in the parent must not travel to the workers
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=collate, drop_last=False
    )
    labels = []
    for images, batch_labels in loader:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, 8, 8)
        assert batch_labels.dtype == torch.int64
        labels.extend(batch_labels.tolist())
    assert sorted(labels) == sorted(dataset.labels.tolist())
    assert len(labels) == len(files)


def test_pickles_with_open_mmaps(folder: tuple[Path, dict[str, bytes]]) -> None:
    path, _ = folder
    dataset = ShardedDataset(path)
    first = dataset[0]["image"]
    clone = pickle.loads(pickle.dumps(dataset))
    np.testing.assert_array_equal(clone[0]["image"], first)
    dataset.close()
    np.testing.assert_array_equal(dataset[0]["image"], first)  # reopens after close


def test_shard_opener_and_record_bytes(folder: tuple[Path, dict[str, bytes]]) -> None:
    path, _ = folder
    opener = MemoryOpener(path)
    cached = ShardedDataset(path, shard_opener=opener)
    direct = ShardedDataset(path)
    for index in range(len(direct)):
        assert cached.record_bytes(index) == direct.record_bytes(index)
        np.testing.assert_array_equal(cached[index]["image"], direct[index]["image"])
    assert opener.calls >= len(direct)  # the opener is asked on every read: it owns caching
    clone = pickle.loads(pickle.dumps(cached))
    assert clone[1]["label"] == direct[1]["label"]
    # Record bytes received from elsewhere (an exchange) decode like a local read...
    data = direct.record_bytes(7)
    np.testing.assert_array_equal(direct.sample_from_record(data, 7)["image"], direct[7]["image"])
    # ...and are checked against the index: wrong bytes for that sample are refused.
    with pytest.raises(CorruptRecordError, match="sample 8"):
        direct.sample_from_record(data, 8)
    # An opener serving a short buffer is caught.
    opener.shards[0] = opener.shards[0][:-1]
    with pytest.raises(CorruptRecordError, match="truncated"):
        ShardedDataset(path, shard_opener=opener)[0]


# -- damaged shards ----------------------------------------------------------------------------


def _flip_byte(path: Path, shard_id: int, record: int) -> None:
    index = read_index(path)
    shard_path = index.shard_path(shard_id)
    data = bytearray(shard_path.read_bytes())
    data[int(index.shards[shard_id].offsets[record]) + 20] ^= 0x10
    shard_path.write_bytes(bytes(data))


def test_flipped_byte_raises_naming_file_and_record(folder: tuple[Path, dict[str, bytes]]) -> None:
    path, _ = folder
    _flip_byte(path, 1, 1)
    dataset = ShardedDataset(path)
    sample = int(dataset.shard_sizes()[0]) + 1
    with pytest.raises(CorruptRecordError, match=f"shard-00001.kshard record 1 \\(sample {sample}\\)"):
        dataset[sample]
    assert dataset[sample - 1]["image"].shape[2] == 3  # neighbours are fine


def test_flipped_byte_skipped_and_counted(
    folder: tuple[Path, dict[str, bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    path, files = folder
    _flip_byte(path, 1, 1)
    dataset = ShardedDataset(
        path, skip_corrupt=True, transform=ImageLabelTransform(spec=AugmentSpec(size=8), seed=0)
    )
    with caplog.at_level(logging.WARNING, logger="kaisoku.data"):
        samples = [dataset[i] for i in range(len(dataset))]
    assert sum(s is None for s in samples) == 1 and dataset.skipped == 1
    assert "shard-00001.kshard record 1" in caplog.text
    images, labels = collate(samples)
    assert len(labels) == len(files) - 1


def test_a_validation_pass_in_worker_processes_can_count_its_skipped_records(
    folder: tuple[Path, dict[str, bytes]],
) -> None:
    """Validation's loader, as training builds it (eval sampler, a worker process per rank): the damaged
    record is skipped in the worker, and the rank counts it as its share of samples minus those seen."""
    path, files = folder
    _flip_byte(path, 1, 1)
    dataset = ShardedDataset(
        path, skip_corrupt=True, transform=ImageLabelTransform(spec=AugmentSpec(size=8), seed=0)
    )
    skipped = 0
    for rank in range(2):
        sampler = ShardedEvalSampler(len(dataset), batch_size=4, rank=rank, world_size=2)
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=1, collate_fn=collate
        )
        seen = sum(len(labels) for _, labels in loader)
        skipped += sampler.num_samples - seen
    assert skipped == 1
    assert dataset.skipped == 0  # counted in the worker process only: the main process never sees it


def test_truncated_shard(folder: tuple[Path, dict[str, bytes]], caplog: pytest.LogCaptureFixture) -> None:
    path, _ = folder
    index = read_index(path)
    shard_path = index.shard_path(2)
    shard_path.write_bytes(shard_path.read_bytes()[:-10])
    with pytest.raises(CorruptRecordError, match="shard-00002.kshard is truncated") as caught:
        ShardedDataset(path)
    assert caught.value.record == index.shards[2].samples - 1
    skipping = ShardedDataset(path, skip_corrupt=True)
    first = int(index.shard_starts()[2])
    last = first + index.shards[2].samples - 1
    with caplog.at_level(logging.WARNING, logger="kaisoku"):
        assert skipping[first] is not None and skipping[last] is None
    assert skipping.skipped == 1
    # The warning names what is damaged, and suggests nothing that is on already (skip_corrupt).
    warned = [r.getMessage() for r in caplog.records if "skipped damaged record" in r.getMessage()]
    assert len(warned) == 1 and "truncated" in warned[0] and "skip_corrupt" not in warned[0], warned


def test_missing_shard(folder: tuple[Path, dict[str, bytes]]) -> None:
    path, _ = folder
    index = read_index(path)
    index.shard_path(1).unlink()
    with pytest.raises(CorruptRecordError, match="shard file .*shard-00001.kshard is missing"):
        ShardedDataset(path)
    # Even without the start-up check, a read names the missing file.
    unchecked = ShardedDataset(path, check_files=False)
    with pytest.raises(CorruptRecordError, match="shard-00001.kshard is missing"):
        unchecked[int(index.shard_starts()[1])]
    skipping = ShardedDataset(path, skip_corrupt=True)
    results = [skipping[i] for i in range(len(skipping))]
    assert sum(r is None for r in results) == index.shards[1].samples == skipping.skipped


def test_index_version_mismatch(folder: tuple[Path, dict[str, bytes]]) -> None:
    path, _ = folder
    text = (path / "index.json").read_text()
    (path / "index.json").write_text(text.replace('"version":2', '"version":99'))
    with pytest.raises(KaisokuError, match="format version 99.*upgrade kaisoku"):
        ShardedDataset(path)


def test_undecodable_image_in_a_sound_record(tmp_path: Path) -> None:
    from kaisoku.data.shards.writer import pack_records

    pack_records(
        [
            {"image": b"\xff\xd8\xff" + b"\0" * 50, "label": 0},
            {"image": b"\xff\xd8\xff" + b"\1" * 50, "label": 1},
        ],
        tmp_path / "d",
        progress=False,
    )
    with pytest.raises(CorruptRecordError, match="record 1 \\(sample 1\\): field 'image'"):
        ShardedDataset(tmp_path / "d")[1]
    assert ShardedDataset(tmp_path / "d", skip_corrupt=True)[1] is None


def test_npz_pack_gives_array_images(tmp_path: Path, mnist_path: Path) -> None:
    with np.load(mnist_path, allow_pickle=False) as archive:
        x, y = archive["x_val"][:300], archive["y_val"][:300]
    np.savez(tmp_path / "m.npz", x_val=x, y_val=y)
    pack(tmp_path / "m.npz", tmp_path / "dst", codec="zstd", shuffle=False, workers=0, progress=False)
    dataset = ShardedDataset(
        tmp_path / "dst" / "val", transform=ImageLabelTransform(spec=AugmentSpec(size=28))
    )
    plain = ShardedDataset(tmp_path / "dst" / "val")
    np.testing.assert_array_equal(plain[17]["image"], x[17])
    image, label = dataset[17]
    assert image.shape == (1, 28, 28) and label == y[17]
    np.testing.assert_array_equal(dataset.labels, y)
