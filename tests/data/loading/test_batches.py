"""Threaded batches: the same bytes as the DataLoader path, whatever the thread count; reused buffers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kaisoku.data.loading.batches import BatchRing, ThreadedBatches
from kaisoku.data.loading.dataset import ImageLabelTransform, ShardedDataset
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.data.loading.transforms import (
    AugmentSpec,
    augment,
    augment_into,
    collate,
)
from kaisoku.data.loading.worker_batches import PREFETCH, ring_size
from kaisoku.data.order.shuffle import ShuffleSpec
from kaisoku.data.shards.format import read_index
from kaisoku.errors import KaisokuError


def _loader(
    packed: Path, *, path: str, workers: int, skip: bool = False, batch: int = 6, micro: int = 1
) -> ShardLoader:
    dataset = ShardedDataset(
        packed,
        transform=ImageLabelTransform(spec=AugmentSpec(size=12, train=True, scale=(0.3, 1.0)), seed=5),
        skip_corrupt=skip,
    )
    return ShardLoader(
        dataset,
        global_batch=batch,
        rank=0,
        world_size=1,
        ranks_per_node=1,
        seed=2,
        shuffle=ShuffleSpec(),
        workers=workers,
        batch_path=path,
        micro_batches=micro,
    )


def _epoch(loader: ShardLoader, epoch: int, start_step: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader.set_epoch(epoch, start_step)
    return [(images.clone(), labels.clone()) for images, labels in loader]


@pytest.mark.parametrize("threads", [1, 3])
def test_threads_give_the_dataloaders_batches(packed: Path, threads: int) -> None:
    reference = _epoch(_loader(packed, path="processes", workers=0), 1)
    got = _epoch(_loader(packed, path="threads", workers=threads), 1)
    assert len(got) == len(reference) > 1
    for (a, la), (b, lb) in zip(reference, got, strict=True):
        assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape
        assert torch.equal(a, b) and torch.equal(la, lb)
        # RGB batches in channels-last memory: each sample one HWC block the decoder writes where it lies.
        assert b.is_contiguous(memory_format=torch.channels_last) and not b.is_contiguous()


def test_augment_into_equals_augment() -> None:
    rng = np.random.default_rng(0)
    spec = AugmentSpec(size=9, train=True)
    for shape in [(20, 30, 3), (9, 9, 3), (17, 11)]:
        image = rng.integers(0, 256, shape, dtype=np.uint8)
        for index in range(6):
            expected = augment(image, spec, seed=1, epoch=2, index=index)
            out = np.full_like(expected, 7)
            augment_into(image, spec, seed=1, epoch=2, index=index, out=out)
            assert np.array_equal(out, expected)
    with pytest.raises(KaisokuError, match="buffer given"):
        augment_into(rng.integers(0, 256, (9, 9, 3), dtype=np.uint8), spec, seed=0, epoch=0, index=0,
                     out=np.empty((3, 8, 8), np.uint8))  # fmt: skip


def test_buffers_are_reused_and_damage_compacts_the_batch(packed: Path) -> None:
    index = read_index(packed)
    first = index.shards[0]
    with open(index.shard_path(0), "r+b") as handle:  # damage record 1 of shard 0
        handle.seek(int(first.offsets[1]) + 3)
        byte = handle.read(1)
        handle.seek(int(first.offsets[1]) + 3)
        handle.write(bytes([byte[0] ^ 0xFF]))
    dataset = ShardedDataset(
        packed, transform=ImageLabelTransform(spec=AugmentSpec(size=8), seed=0), skip_corrupt=True
    )
    keys = [[(0, i) for i in range(k, k + 3)] for k in range(0, 18, 3)]
    batches = ThreadedBatches(dataset, keys, threads=2, prefetch=1, ring=BatchRing(3))
    seen = []
    pointers = set()
    for images, labels in batches:
        if seen:  # the first batch is compacted into a new tensor (see below)
            pointers.add(images.data_ptr())
        seen.append((images.clone(), labels.clone()))
    assert len(seen) == 6 and len(pointers) <= 3  # a ring of buffers, not one per batch
    assert seen[0][0].shape[0] == 2 and seen[1][0].shape[0] == 3  # sample 1 skipped: the batch shrinks
    expected = collate([dataset[key] for key in keys[0]])
    assert torch.equal(seen[0][0], expected[0]) and torch.equal(seen[0][1], expected[1])
    assert dataset.skipped == 2  # once by the threads, once by the reference above


@pytest.mark.parametrize("path", ["batch", "threads"])
def test_a_loader_keeps_its_ring_across_epochs_and_the_batches_held_from_the_last(
    packed: Path, path: str
) -> None:
    """Epoch 2 decodes into the buffers epoch 1 used (the batch path's worker processes, kept, into the same
    shared ones), going on round the ring from where epoch 1 stopped: the last batch of epoch 1, still held,
    keeps its pixels for as long as a batch is the caller's. Its batches are the ones a fresh loader makes."""
    loader = _loader(packed, path=path, workers=2, batch=3)
    micro = loader.sampler.micro_batches
    if path == "batch":  # worker processes: the batches sent ahead, a step's micro-batches and the last's, 1
        size = ring_size(2, micro)
        window = size - PREFETCH * 2 - 1
    else:  # the threads' ring: a step's micro-batches + 4, two batches decoded ahead
        size = 2 * micro + 4
        window = size - 2 - 1
    loader.set_epoch(1)
    first = []
    for images, labels in loader:
        first.append(images.data_ptr())
        held, held_copy, held_labels, held_labels_copy = images, images.clone(), labels, labels.clone()
    loader.set_epoch(2)
    second = []
    for k, (images, labels) in enumerate(loader):
        second.append((images.data_ptr(), images.clone(), labels.clone()))
        if k < window:  # a batch is the caller's until ring size - batches sent ahead - 1 batches later
            assert torch.equal(held, held_copy) and torch.equal(held_labels, held_labels_copy)
    slots = [(len(first) + k) % size for k in range(len(second))]
    reused = [
        (slot, pointer) for slot, (pointer, _, _) in zip(slots, second, strict=True) if slot < len(first)
    ]
    assert reused, "the two epochs do not go round the ring: nothing to compare"
    assert all(pointer == first[slot] for slot, pointer in reused)
    fresh = _epoch(_loader(packed, path=path, workers=2, batch=3), 2)
    assert len(second) == len(fresh) > 1
    for (_, a, la), (b, lb) in zip(second, fresh, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_an_iteration_finding_the_ring_in_use_decodes_into_its_own(packed: Path) -> None:
    """Two iterations at once over one ring (an epoch's generator left open): the second gets buffers of
    its own, so neither writes into the other's batches."""
    dataset = ShardedDataset(packed, transform=ImageLabelTransform(spec=AugmentSpec(size=8), seed=0))
    keys = [[(0, i) for i in range(k, k + 3)] for k in range(0, 18, 3)]
    ring = BatchRing(3)
    first = iter(ThreadedBatches(dataset, keys, threads=2, prefetch=1, ring=ring))
    a, _ = next(first)
    second = [
        images.data_ptr() for images, _ in ThreadedBatches(dataset, keys, threads=2, prefetch=1, ring=ring)
    ]
    assert a.data_ptr() not in second
    first.close()
    third = [
        images.data_ptr() for images, _ in ThreadedBatches(dataset, keys, threads=2, prefetch=1, ring=ring)
    ]
    assert a.data_ptr() in third  # closed: the ring is free again


def test_decoding_errors_reach_the_caller(packed: Path) -> None:
    index = read_index(packed)
    with open(index.shard_path(0), "r+b") as handle:
        handle.seek(int(index.shards[0].offsets[0]) + 5)
        handle.write(b"\x00\x00\x00")
    dataset = ShardedDataset(packed, transform=ImageLabelTransform(spec=AugmentSpec(size=8), seed=0))
    with pytest.raises(KaisokuError, match="record 0"):
        list(ThreadedBatches(dataset, [[(0, 0), (0, 1)]], threads=2))


def _received_half(sampler: object, record_bytes: object, *, ranks_per_node: int) -> dict[int, bytes]:
    """What an exchange hands this rank: the records of every other sample (here read locally)."""
    return {i: record_bytes(i) for i in range(0, 21, 2)}  # type: ignore[operator]


@pytest.mark.parametrize("path", ["batch", "threads", "processes"])
def test_received_records_go_through_every_path(packed: Path, ram_dir: Path, path: str) -> None:
    reference = _epoch(_loader(packed, path="processes", workers=0), 0)
    loader = _loader(packed, path=path, workers=2)
    loader.cache_settings = type(loader.cache_settings)(ram_dir=str(ram_dir))
    loader.exchange = _received_half
    got = _epoch(loader, 0)
    stats = loader.epoch_stats()
    loader.close()
    for (a, la), (b, lb) in zip(reference, got, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    sizes = np.concatenate([np.diff(s.offsets) for s in read_index(packed).shards])
    assert stats is not None and stats["exchanged_bytes"] == int(sizes[0:21:2].sum())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_pinned_ring_on_cuda(packed: Path) -> None:
    dataset = ShardedDataset(packed, transform=ImageLabelTransform(spec=AugmentSpec(size=8), seed=0))
    keys = [[(0, i) for i in range(k, k + 3)] for k in range(0, 9, 3)]
    for images, _labels in ThreadedBatches(dataset, keys, threads=2, ring=BatchRing(4, pin_memory=True)):
        assert images.is_pinned()
        assert torch.equal(images.to("cuda", non_blocking=True).cpu(), images)
