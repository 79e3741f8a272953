"""What the data path reports: per-process counters, ``epoch_stats()``, cache settings that say what they do."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from kaisoku.data.loading.counters import LoaderCounters
from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.loading.folder import ImageFolderDataset, mount_type, pack_hint, scan_class_folders
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.data.loading.transforms import AugmentSpec
from kaisoku.data.node_cache.cache import NodeCache
from kaisoku.data.node_cache.staging import CacheSettings, plan_staging, sampler_trace_fn
from kaisoku.data.node_cache.tier_dirs import LOCAL_MARGIN_MIN, auto_local_capacity
from kaisoku.data.order.shuffle import ShuffleSpec
from kaisoku.data.shards.writer import pack
from tests.data.node_cache.test_cache import RECORD, SIZES, make_source, read_record, record_bytes
from tests.data.shards.test_writer import make_image_folder


class _Counting(Dataset):
    """Each item adds 1 and 10 to two counters: lost updates would show in the totals."""

    def __init__(self, counters: LoaderCounters, n: int) -> None:
        self.counters = counters
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.counters.add("source_records")
        self.counters.add("served_source_bytes", 10)
        return index


def test_counters_lose_nothing_under_workers_and_threads() -> None:
    counters = LoaderCounters(workers=2)
    loader = DataLoader(_Counting(counters, 300), batch_size=7, num_workers=2)
    assert sum(len(batch) for batch in loader) == 300

    def bump() -> None:
        for _ in range(2000):
            counters.add("skipped_records")

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    totals = counters.totals()
    assert totals["source_records"] == 300 and totals["served_source_bytes"] == 3000
    assert totals["skipped_records"] == 8000
    assert counters.since_last()["source_records"] == 300
    assert counters.since_last()["source_records"] == 0


def _loader(
    packed: Path,
    ram_dir: Path,
    *,
    workers: int,
    shuffle: ShuffleSpec | None = None,
    path: str = "threads",
    ram_capacity: int = 1 << 30,
    decode: str = "cpu",
    global_batch: int = 6,
) -> ShardLoader:
    dataset = ShardedDataset(
        packed,
        transform=ImageLabelTransform(spec=AugmentSpec(size=8, train=True), seed=0),
        decode_images=decode == "cpu",
    )
    loader = ShardLoader(
        dataset,
        global_batch=global_batch,
        rank=0,
        world_size=1,
        ranks_per_node=1,
        seed=1,
        shuffle=shuffle or ShuffleSpec(),
        workers=workers,
        cache=CacheSettings(ram_dir=str(ram_dir), ram_capacity=ram_capacity),
        num_epochs=2,
        batch_path=path,
        decode=decode,
    )
    loader.run_token = f"stats{workers}{path}{decode}"
    return loader


@pytest.mark.parametrize("path", ["batch", "threads", "processes"])
def test_epoch_stats_count_tiers_and_source_reads(packed: Path, ram_dir: Path, path: str) -> None:
    loader = _loader(packed, ram_dir, workers=2, path=path)
    index = loader.dataset.index
    record_sizes = np.concatenate([np.diff(s.offsets) for s in index.shards])
    try:
        served = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
            assert loader.cache is not None and loader.cache.wait_staged(epoch, timeout=30)
            stats = loader.epoch_stats()
            assert stats is not None
            served.append(stats)
            rows = loader.sampler.batches(epoch, 0).reshape(-1)
            expected = int(record_sizes[rows].sum())
            tiers = stats["served_ram_bytes"] + stats["served_local_bytes"] + stats["served_source_bytes"]
            assert tiers == expected
            assert stats["skipped_records"] == 0 and stats["exchanged_bytes"] == 0
        # Epoch 0: the stager read every shard once; epoch 1 read nothing from the source, all from RAM.
        assert served[0]["source_reads"] >= len(index.shards)
        assert served[0]["source_bytes"] >= index.nbytes
        assert served[1]["source_reads"] == 0 and served[1]["served_source_bytes"] == 0
        assert served[1]["served_ram_bytes"] > 0
        assert loader.epoch_stats() is None  # nothing happened since
        node = loader.stats()
        assert node["source_reads"] == served[0]["source_reads"]  # every process's row summed
    finally:
        loader.close()


#: Every way the packed loader reads: (``data.loader``, ``data.decode``).
READ_PATHS = [("batch", "cpu"), ("threads", "cpu"), ("processes", "cpu"), ("batch", "gpu")]


@pytest.fixture(scope="module")
def packed_twelve(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """84 real JPEGs packed into 12 shards of 5 or 6 records: with a block shuffle of 2 shards at a global
    batch of 4 and a cache of half the set, the plan evicts in each epoch and bypasses nothing."""
    root = tmp_path_factory.mktemp("packed-twelve")
    make_image_folder(root / "src", per_class=20)
    pack(root / "src", root / "dst", shard_bytes=6000, workers=0, progress=False)
    return root / "dst"


def _half_cache_loader(packed: Path, ram_dir: Path, path: str, decode: str) -> ShardLoader:
    """The loader of :func:`packed_twelve` on ``path`` and ``decode``, its RAM tier half the set."""
    return _loader(
        packed,
        ram_dir,
        workers=2,
        shuffle=ShuffleSpec(name="block", block_shards=2),
        path=path,
        ram_capacity=ShardedDataset(packed).index.nbytes // 2,
        decode=decode,
        global_batch=4,
    )


@pytest.mark.parametrize(("path", "decode"), READ_PATHS)
def test_prefetching_readers_never_read_a_shard_the_plan_loads(
    packed_twelve: Path, ram_dir: Path, path: str, decode: str
) -> None:
    # A cache of half the set: the stager evicts, and each eviction waits for training's progress, while
    # the loader's threads or workers read batches ahead of it. A read ahead of progress must wait for
    # the load planned for its batch's step, not read the shard from the source as well.
    loader = _half_cache_loader(packed_twelve, ram_dir, path, decode)
    try:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
        assert loader.cache is not None and loader.cache.wait_staged(1, timeout=30)
        kinds = [event.kind for _, _, event in loader.cache.stager_log]
        assert kinds.count("evict") > 0 and "bypass" not in kinds  # the plan serves every read from RAM
        assert loader.cache.stats()["source_reads"] == 0
        assert loader.cache.stager_stats()["source_reads"] == kinds.count("load")
    finally:
        loader.close()


# A read left waiting would hold the drop for the cache's 600 s wait limit: the timeout then fails inside the
# readers' generator as it closes, which Python reports as an unraisable exception, made an error here.
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(("path", "decode"), READ_PATHS)
def test_dropping_the_batches_mid_epoch_releases_reads_waiting_ahead(
    packed_twelve: Path, ram_dir: Path, path: str, decode: str
) -> None:
    # As a layout switch or a rollback does: a prefetching read may be waiting for a load gated on progress
    # that training will now never report; dropping the batches must release it, and the epoch goes on.
    loader = _half_cache_loader(packed_twelve, ram_dir, path, decode)
    capacity = loader.cache_settings.ram_capacity
    trace_of = sampler_trace_fn(loader.sampler, node=0, ranks_per_node=1)
    epoch_trace = trace_of(0, 0)
    plan = plan_staging(
        epoch_trace.then(trace_of(1, 0)), capacity, loader.dataset.shard_nbytes(), horizon=len(epoch_trace)
    )
    # An eviction for a step that every read path has in flight (2 batches ahead) while training has
    # received only the batches before the victim's last use: its gate stays closed, so the read of that
    # step waits for the load behind it.
    gate = next(a for a in plan.actions if a.kind == "evict" and a.step <= a.after_step + 2)
    received = gate.after_step
    try:
        loader.set_epoch(0)
        batches = iter(loader)
        for _ in range(received):
            next(batches)
        batches.close()
        loader.set_epoch(0, start_step=received)
        assert sum(1 for _ in loader) == loader.steps_per_epoch - received
    finally:
        loader.close()


def test_epoch_stats_without_a_cache_count_records(packed: Path, ram_dir: Path) -> None:
    loader = _loader(packed, ram_dir, workers=0)
    loader.cache_settings = CacheSettings()
    loader.set_epoch(0)
    batches = sum(1 for _ in loader)
    stats = loader.epoch_stats()
    assert stats is not None and stats["source_reads"] == batches * 6
    assert stats["source_bytes"] == stats["served_source_bytes"] > 0


def test_partial_on_one_node_says_it_is_global(
    packed: Path, ram_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kaisoku.data.loading.loader"):
        _loader(packed, ram_dir, workers=0, shuffle=ShuffleSpec(name="partial", num_nodes=1))
    lines = [r.getMessage() for r in caplog.records if "same order as global" in r.getMessage()]
    assert len(lines) == 1


def test_local_cache_without_capacity_uses_free_space(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert CacheSettings(local_dir=str(tmp_path)).enabled
    usage = shutil.disk_usage(tmp_path)
    with caplog.at_level(logging.INFO, logger="kaisoku.data.node_cache.tier_dirs"):
        capacity = auto_local_capacity(tmp_path / "not-yet" / "made")
    margin = max(int(usage.total * 0.05), LOCAL_MARGIN_MIN)
    assert abs(capacity - max(0, usage.free - margin)) < 64 << 20  # free space moves a little meanwhile
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "data.local_capacity" in messages[0]


def test_source_copies_are_bounded_by_bytes(tmp_path: Path, ram_dir: Path) -> None:
    paths = make_source(tmp_path / "source", SIZES)
    shard_bytes = int(SIZES[0]) * RECORD
    cache = NodeCache(paths, ram_dir=ram_dir, run_token="lru", max_source_bytes=2 * shard_bytes)
    try:
        for index in range(int(SIZES.sum())):
            assert read_record(cache, index, SIZES) == record_bytes(index)
            assert cache.held_bytes() <= 2 * shard_bytes
        assert cache.held_bytes() > 0
    finally:
        cache.close()


def test_pack_hint_only_for_slow_mounts_and_long_waits(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/sda1 / ext4 rw 0 0\nserver:/export /mnt/data nfs4 rw 0 0\n"
        "s3fs /mnt/data/bucket fuse.s3fs rw 0 0\n"
    )
    assert mount_type("/mnt/data/imagenet", str(mounts)) == "nfs4"
    assert mount_type("/mnt/data/bucket/x", str(mounts)) == "fuse.s3fs"
    assert mount_type("/home/user", str(mounts)) == "ext4"
    assert pack_hint("/home/user/set", "ext4", 0.9) is None
    assert pack_hint("/mnt/data/set", "nfs4", 0.1) is None
    line = pack_hint("/mnt/data/set", "nfs4", 0.8)
    assert line is not None and "kaisoku pack /mnt/data/set" in line and "nfs4" in line and "80%" in line
    assert "5.0x" in line


def test_folder_dataset_counts_its_reads(tmp_path: Path) -> None:
    files = make_image_folder(tmp_path / "src")
    listing = scan_class_folders(tmp_path / "src")
    counters = LoaderCounters()
    dataset = ImageFolderDataset(listing, AugmentSpec(size=8, train=False), seed=0, counters=counters)
    for i in range(len(dataset)):
        image, _ = dataset[(0, i)]
        assert isinstance(image, np.ndarray)
    totals = counters.totals()
    assert totals["source_records"] == len(listing) == len(files)
    assert totals["served_source_bytes"] == sum(len(b) for b in files.values())
    assert totals["read_ns"] > 0
    assert torch.is_tensor(counters.table)


def test_folder_sampler_reports_the_epochs_reads(tmp_path: Path) -> None:
    from kaisoku.data.loading.folder import FolderSampler

    make_image_folder(tmp_path / "src")
    listing = scan_class_folders(tmp_path / "src")
    counters = LoaderCounters()
    sampler = FolderSampler(
        [len(listing)], global_batch=4, rank=0, world_size=1, seed=0,
        shuffle=ShuffleSpec(unpacked=True), counters=counters, root=tmp_path / "src", workers=0,
    )  # fmt: skip
    dataset = ImageFolderDataset(listing, AugmentSpec(size=8), seed=0, counters=counters)
    assert sampler.epoch_stats() is None
    sampler.set_epoch(0)
    read = [i for batch in sampler for i in batch]
    for i in read:
        dataset[(0, i)]
    stats = sampler.epoch_stats()
    assert stats is not None and stats["source_reads"] == len(read) and stats["file_read_s"] >= 0
    assert stats["source_bytes"] == sum(Path(listing.files[i]).stat().st_size for i in read)
    assert sampler.epoch_stats() is None
