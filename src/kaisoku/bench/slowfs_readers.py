"""The readers of ``kaisoku bench slowfs``: random per-file reads, and kaisoku nodes reading packed shards
through a :class:`~kaisoku.data.cache.NodeCache` (one node, or two exchanging samples under the partial
shuffle). Each drops the page cache before an epoch and returns what it read and how long it took.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from kaisoku.bench import netfs
from kaisoku.bench.imagesets import BATCH, SEED, WORKERS, flip_transform, image_bytes, kaisoku_loader
from kaisoku.data.cache import NodeCache
from kaisoku.data.dataset import ShardedDataset
from kaisoku.data.format import Index, read_index
from kaisoku.data.loader import (
    _ExchangedSamples as ExchangedSamples,  # what ShardLoader reads an exchanged epoch through
)
from kaisoku.data.sampler import EpochSampler
from kaisoku.data.shuffle import ShuffleSpec
from kaisoku.data.transforms import collate
from kaisoku.distributed.spawn import run_ranks


def _file_bytes(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


class FileBytes(Dataset):
    """Random per-file reads: item ``i`` is file ``i``'s bytes (I/O only)."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> bytes:
        return _file_bytes(self.paths[index])


class FileSamples(Dataset):
    """Random per-file reads with decode and flip (kaisoku's transform); ``threads`` > 1 reads a batch's
    files concurrently in each worker."""

    def __init__(self, paths: Sequence[str], labels: np.ndarray, size: int, threads: int = 1) -> None:
        self.paths = list(paths)
        self.labels = labels
        self.transform = flip_transform(size)
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.paths)

    def _sample(self, key: tuple[int, int], data: bytes) -> tuple[np.ndarray, int]:
        epoch, index = key
        return self.transform({"image": data, "label": int(self.labels[index])}, index=index, epoch=epoch)

    def __getitem__(self, key: tuple[int, int]) -> tuple[np.ndarray, int]:
        return self._sample(key, _file_bytes(self.paths[key[1]]))

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[tuple[np.ndarray, int]]:
        if self.threads <= 1:
            return [self[key] for key in keys]
        if self._pid != os.getpid():
            self._pool, self._pid = ThreadPoolExecutor(self.threads), os.getpid()
        assert self._pool is not None
        blobs = list(self._pool.map(_file_bytes, [self.paths[i] for _, i in keys]))
        return [self._sample(key, data) for key, data in zip(keys, blobs)]


def _sum_lengths(batch: Sequence[bytes]) -> int:
    return sum(len(b) for b in batch)


def _batches(order: np.ndarray, epoch: int | None = None) -> list[list[Any]]:
    keys = order.tolist() if epoch is None else [(epoch, int(i)) for i in order]
    return [keys[k : k + BATCH] for k in range(0, len(keys) - BATCH + 1, BATCH)]


def perfile_epoch(
    paths: Sequence[str],
    labels: np.ndarray,
    order: np.ndarray,
    *,
    mode: str,
    readers: str,
    size: int,
    epoch: int,
) -> tuple[float, int]:
    """Seconds and bytes (I/O) or samples (end-to-end) of random per-file reads of ``order``'s files."""
    netfs.drop_caches()
    start = time.perf_counter()
    total = 0
    if mode == "io" and readers == "8 threads":
        with ThreadPoolExecutor(8) as pool:
            total = sum(len(b) for b in pool.map(_file_bytes, [paths[i] for i in order]))
    elif mode == "io":
        loader = DataLoader(
            FileBytes(paths), batch_sampler=_batches(order), num_workers=WORKERS, collate_fn=_sum_lengths
        )
        total = sum(loader)
    else:
        dataset = FileSamples(paths, labels, size, threads=4 if readers == "8 threads" else 1)
        loader = DataLoader(
            dataset, batch_sampler=_batches(order, epoch), num_workers=WORKERS, collate_fn=collate
        )
        total = sum(int(labels_.shape[0]) for _, labels_ in loader)
    return time.perf_counter() - start, total


@dataclass(frozen=True)
class CacheDirs:
    """Where a kaisoku row's node caches live (removed after the row)."""

    ram: Path
    local: Path
    capacity: int

    def node(self, name: str) -> tuple[Path, Path]:
        """RAM and local directories of one node."""
        return self.ram / name, self.local / name


def _node_cache(
    sampler: EpochSampler, index: Index, dirs: CacheDirs, node_name: str, token: str
) -> NodeCache:
    ram, local = dirs.node(node_name)
    return NodeCache.for_sampler(
        sampler,
        [index.shard_path(i) for i in range(len(index.shards))],
        ranks_per_node=1,
        ram_dir=ram,
        ram_capacity=dirs.capacity,
        local_dir=local,
        local_capacity=dirs.capacity,
        run_token=token,
        num_epochs=2,
        shard_bytes=index.shard_nbytes().tolist(),
    )


def _read_epoch(
    dataset: ShardedDataset,
    sampler: EpochSampler,
    cache: NodeCache,
    epoch: int,
    *,
    mode: str,
    size: int,
    workers: int,
    received: dict[int, bytes] | None = None,
) -> int:
    """One epoch of a kaisoku node in DataLoader workers: bytes delivered (I/O: records read, images left
    encoded) or samples loaded (end-to-end: decoded, flipped, collated)."""
    sampler.set_epoch(epoch)
    cache.mark_progress(epoch, 0)
    source = ExchangedSamples(dataset, received, epoch) if received else dataset
    total = 0
    collate_fn = image_bytes if mode == "io" else collate
    for step, batch in enumerate(kaisoku_loader(source, sampler, epoch, workers, collate_fn)):
        total += batch if mode == "io" else int(batch[1].shape[0])
        cache.mark_progress(epoch, step + 1)
    return total


def _sampler(index: Index, spec: ShuffleSpec, rank: int, world_size: int) -> EpochSampler:
    return EpochSampler(
        index.shard_sizes(), global_batch=BATCH, rank=rank, world_size=world_size, seed=SEED, shuffle=spec
    )


def _make_dataset(index: Index, cache: NodeCache, mode: str, size: int) -> ShardedDataset:
    if mode == "io":
        return ShardedDataset(index, shard_opener=cache.shard_buffer, decode_images=False)
    return ShardedDataset(index, shard_opener=cache.shard_buffer, transform=flip_transform(size))


def kaisoku_single_node(
    pack_dir: Path, spec: ShuffleSpec, *, mode: str, size: int, dirs: CacheDirs
) -> list[dict[str, Any]]:
    """Two epochs of one node reading ``pack_dir`` (on the mount) through a fresh NodeCache."""
    epochs: list[dict[str, Any]] = []
    netfs.drop_caches()
    start = time.perf_counter()
    index = read_index(pack_dir)
    sampler = _sampler(index, spec, 0, 1)
    cache = _node_cache(sampler, index, dirs, "node0", f"bench-{os.getpid()}-{time.monotonic_ns()}")
    try:
        dataset = _make_dataset(index, cache, mode, size)
        for epoch in range(2):
            if epoch:
                netfs.drop_caches()
                start = time.perf_counter()
            before = cache.node_stats()
            total = _read_epoch(dataset, sampler, cache, epoch, mode=mode, size=size, workers=WORKERS)
            seconds = time.perf_counter() - start
            after = cache.node_stats()
            epochs.append(
                {
                    "seconds": seconds,
                    "total": total,
                    "source_reads": after["source_reads"] - before["source_reads"],
                    "source_bytes": after["source_bytes"] - before["source_bytes"],
                }
            )
    finally:
        cache.close()
    return epochs


def _partial_node(
    rank: int,
    world_size: int,
    tmp: Path,
    pack_dir: str,
    spec: ShuffleSpec,
    mode: str,
    size: int,
    dirs: CacheDirs,
) -> list[dict[str, Any]]:
    """Two epochs of one node (a gloo rank with its own cache) of the partial shuffle."""

    from kaisoku.data.exchange import exchange_for_epoch

    out: list[dict[str, Any]] = []
    cache: NodeCache | None = None
    try:
        for epoch in range(2):
            netfs.drop_caches_together(rank)
            start = time.perf_counter()
            if cache is None:
                index = read_index(pack_dir)
                sampler = _sampler(index, spec, rank, world_size)
                cache = _node_cache(
                    sampler, index, dirs, f"node{rank}", f"bench-{tmp.name}-{os.getppid()}-{rank}"
                )
                dataset = _make_dataset(index, cache, mode, size)
                fetch_set = ShardedDataset(index, shard_opener=cache.shard_buffer, decode_images=False)
            before = cache.node_stats()
            sampler.set_epoch(epoch)
            cache.mark_progress(epoch, 0)
            received = exchange_for_epoch(sampler, fetch_set.record_bytes, ranks_per_node=1)
            total = _read_epoch(
                dataset, sampler, cache, epoch, mode=mode, size=size, workers=1, received=received
            )
            seconds = time.perf_counter() - start
            after = cache.node_stats()
            out.append(
                {
                    "seconds": seconds,
                    "total": total,
                    "received": len(received),
                    "source_reads": after["source_reads"] - before["source_reads"],
                    "source_bytes": after["source_bytes"] - before["source_bytes"],
                }
            )
    finally:
        if cache is not None:
            cache.close()
    return out


def kaisoku_partial(
    pack_dir: Path, spec: ShuffleSpec, *, mode: str, size: int, dirs: CacheDirs
) -> list[dict[str, Any]]:
    """Two epochs of 2 nodes (gloo ranks, own caches, 1 DataLoader worker each) exchanging samples.

    An epoch's time is the slower node's; totals and source reads are summed over the nodes.
    """
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-rdzv-") as tmp:
        per_node = run_ranks(
            _partial_node,
            2,
            Path(tmp),
            str(pack_dir),
            spec,
            mode,
            size,
            dirs,
            timeout=1800.0,
            collective_timeout=600.0,
        )
    return [
        {
            "seconds": max(node[e]["seconds"] for node in per_node),
            "total": sum(node[e]["total"] for node in per_node),
            "source_reads": sum(node[e]["source_reads"] for node in per_node),
            "source_bytes": sum(node[e]["source_bytes"] for node in per_node),
            "exchanged": sum(node[e]["received"] for node in per_node),
        }
        for e in range(2)
    ]
