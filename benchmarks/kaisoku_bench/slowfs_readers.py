"""The readers of ``kaisoku bench slowfs``: random per-file reads, and kaisoku nodes iterating the
:class:`~kaisoku.data.loading.loader.ShardLoader` that ``kaisoku train`` builds (one node, or two gloo ranks
exchanging samples under the partial shuffle). Each drops the page cache before an epoch and returns what
it read and how long it took. The packed peers' side is :mod:`kaisoku_bench.slowfs_peers`.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from kaisoku.config import Config
from kaisoku.config_sections import ByteSize
from kaisoku.data.loading.dataset import ShardedDataset
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.data.loading.transforms import collate
from kaisoku.data.node_cache.staging import CacheEvent
from kaisoku.data.order.shuffle import ShuffleSpec
from kaisoku.distributed.env import World
from kaisoku.distributed.spawn import run_ranks
from kaisoku.engine.data_build import shard_loader
from kaisoku.plan.probe import drop_caches
from kaisoku.run_facts import plan_run
from kaisoku.run_plan import WorldShape
from kaisoku_bench.imagesets import BATCH, SEED, WORKERS, flip_transform
from kaisoku_bench.loader_peers import read_bytes


class FileBytes(Dataset):
    """Random per-file reads: item ``i`` is file ``i``'s bytes (I/O only)."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> bytes:
        return read_bytes(self.paths[index])


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
        return self._sample(key, read_bytes(self.paths[key[1]]))

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[tuple[np.ndarray, int]]:
        if self.threads <= 1:
            return [self[key] for key in keys]
        if self._pid != os.getpid():
            self._pool, self._pid = ThreadPoolExecutor(self.threads), os.getpid()
        assert self._pool is not None
        blobs = list(self._pool.map(read_bytes, [self.paths[i] for _, i in keys]))
        return [self._sample(key, data) for key, data in zip(keys, blobs)]


def read_files(paths: Sequence[str], threads: int = 8) -> int:
    """Read every file of ``paths`` whole with ``threads`` threads; the bytes read."""
    with ThreadPoolExecutor(threads) as pool:
        return sum(len(b) for b in pool.map(read_bytes, paths))


def reader_threads(readers: str) -> int | None:
    """The thread count of a per-file reader named ``"<n> threads"``; None for ``"2 workers"`` (DataLoader
    workers, one file at a time each)."""
    count, _, kind = readers.partition(" ")
    return int(count) if kind == "threads" else None


def perfile_window(
    paths: Sequence[str], order: np.ndarray, threads: int, window_s: float
) -> dict[str, float]:
    """Random per-file reads of ``order``'s files (in order, each whole) by ``threads`` threads for about
    ``window_s`` seconds from a dropped page cache: each thread takes the next file until the window has
    passed (or the files run out) and finishes the read it started. ``files_per_s`` is the files read over
    the seconds until the last thread stopped."""
    drop_caches()
    positions = itertools.count()  # next() on a count is atomic under the GIL: no file is read twice
    counted = [0] * threads

    def read_until(slot: int, deadline: float) -> None:
        while time.perf_counter() < deadline:
            position = next(positions)
            if position >= order.size:
                return
            read_bytes(paths[int(order[position])])
            counted[slot] += 1

    start = time.perf_counter()
    workers = [threading.Thread(target=read_until, args=(k, start + window_s)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - start
    return {"threads": threads, "files": sum(counted), "seconds": round(seconds, 3),
            "files_per_s": round(sum(counted) / seconds, 1)}  # fmt: skip


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
    """Seconds and bytes (I/O) or samples (end-to-end) of random per-file reads of ``order``'s files.

    ``readers``: ``"2 workers"`` (DataLoader workers, a file at a time) or ``"<n> threads"``: I/O runs read
    with ``n`` threads, end-to-end runs with ``n / 2`` threads in each of the 2 DataLoader workers."""
    drop_caches()
    start = time.perf_counter()
    total = 0
    threads = reader_threads(readers)
    if mode == "io" and threads is not None:
        total = read_files([paths[i] for i in order], threads)
    elif mode == "io":
        loader = DataLoader(
            FileBytes(paths), batch_sampler=_batches(order), num_workers=WORKERS, collate_fn=_sum_lengths
        )
        total = sum(loader)
    else:
        per_worker = 1 if threads is None else max(1, threads // WORKERS)
        dataset = FileSamples(paths, labels, size, threads=per_worker)
        loader = DataLoader(
            dataset, batch_sampler=_batches(order, epoch), num_workers=WORKERS, collate_fn=collate
        )
        total = sum(int(labels_.shape[0]) for _, labels_ in loader)
    return time.perf_counter() - start, total


@dataclass(frozen=True)
class CacheDirs:
    """Where a kaisoku row's node caches live (removed after each run), and the bytes each tier may hold:
    ``capacity`` for the local folder, ``ram_capacity`` for the RAM tier (None: ``capacity`` too; 0: no RAM
    tier)."""

    ram: Path
    local: Path
    capacity: int
    ram_capacity: int | None = None

    def node(self, name: str) -> tuple[Path, Path]:
        """RAM and local directories of one node."""
        return self.ram / name, self.local / name


class EncodedSize:
    """The I/O-only transform: a sample becomes the byte count of its encoded image (no decode), written
    into the batch buffer as one int64, so that an epoch's batches sum to the image bytes delivered."""

    def __call__(self, sample: dict[str, Any], *, index: int, epoch: int) -> tuple[np.ndarray, int]:
        """``([bytes], label)``."""
        return np.array([len(sample["image"])], dtype=np.int64), int(sample["label"])

    def into(self, sample: dict[str, Any], *, index: int, epoch: int, out: np.ndarray) -> int:
        """Write the byte count into ``out``; return the label."""
        out[0] = len(sample["image"])
        return int(sample["label"])


def node_loader(
    pack_dir: str,
    spec: ShuffleSpec,
    dirs: CacheDirs,
    *,
    rank: int,
    world_size: int,
    mode: str,
    size: int,
    workers: int = WORKERS,
) -> ShardLoader:
    """The :class:`ShardLoader` ``kaisoku train`` builds for node ``rank`` of ``world_size`` (one rank per
    node), from a config through :func:`kaisoku.engine.data_build.shard_loader`: ``spec``'s shuffle, the
    node cache in ``dirs`` (local folder + RAM tier, sized by ``dirs``), ``workers`` decoding
    threads (``data.workers``), 2 epochs. ``mode`` ``io`` leaves images encoded (:class:`EncodedSize`),
    ``e2e`` decodes and flips them (:func:`flip_transform`)."""
    ram, local = dirs.node(f"node{rank}")
    cfg = Config()
    cfg.data.path = pack_dir
    cfg.data.global_batch = BATCH
    cfg.data.workers = workers
    cfg.data.shuffle = spec.name  # type: ignore[assignment]
    cfg.data.exchange = spec.exchange
    cfg.data.block_shards = spec.block_shards
    cfg.data.local_cache, cfg.data.local_capacity = str(local), ByteSize(dirs.capacity)
    ram_capacity = dirs.capacity if dirs.ram_capacity is None else dirs.ram_capacity
    cfg.data.ram_dir, cfg.data.ram_capacity = str(ram), ByteSize(ram_capacity)
    cfg.train.seed, cfg.train.epochs = SEED, 2
    world = World(rank=rank, world_size=world_size, local_world_size=1, node=rank, num_nodes=world_size)
    if mode == "io":
        dataset = ShardedDataset(pack_dir, transform=EncodedSize(), decode_images=False)
    else:
        dataset = ShardedDataset(pack_dir, transform=flip_transform(size))
    return shard_loader(plan_run(cfg, WorldShape(world_size, 1)), world, torch.device("cpu"), dataset)


@dataclass(frozen=True)
class KaisokuRun:
    """What a kaisoku row measures: ``repeats`` runs of each mode, 2 epochs each, on a fresh node cache."""

    pack_dir: str
    spec: ShuffleSpec
    size: int
    dirs: CacheDirs
    repeats: int
    modes: tuple[str, ...] = ("io", "e2e")
    workers: int = WORKERS
    """Decoding threads of the loader (``data.workers``)."""


def drop_caches_together(rank: int) -> None:
    """Every rank of the process group (if there is one) waits while rank 0 drops the page cache, so that
    all of them start the next timed epoch cold and at once."""
    grouped = dist.is_available() and dist.is_initialized()
    if grouped:
        dist.barrier()
    if rank == 0:
        drop_caches()
    if grouped:
        dist.barrier()


PLAN_COUNTS = ("planned_reads", "planned_bytes", "planned_bypasses", "evictions", "evicted_bytes")
"""What :func:`cache_plan_reads` counts per epoch, added to each :func:`node_epochs` record."""
CACHE_COUNTS = (*PLAN_COUNTS, "stager_reads", "reader_reads")
""":data:`PLAN_COUNTS` and the source reads the node's stager and its readers counted over the run (on
the run's last epoch record; 0 on the others, so that sums over a run's epochs are the run's)."""


def cache_plan_reads(
    events: Sequence[tuple[int, str, CacheEvent]], shard_bytes: Sequence[int]
) -> dict[int, dict[str, int]]:
    """Per epoch, the source reads the node cache's executed plan accounts for and what it evicted, from
    its stager log (``NodeCache.stager_log``: (epoch, tier, event) in execution order, local-tier actions
    first at each position).

    ``planned_reads`` / ``planned_bytes``: loads into the local tier, loads into RAM of a shard the local
    tier does not hold (a RAM load of a shard just written locally copies it, no source read), and
    accesses every tier bypassed whose shard no tier holds after that position's actions (the reader reads
    them from the source, unless it still holds a copy it read before: ``planned_bypasses`` counts them).
    ``evictions`` / ``evicted_bytes``: evictions that left a shard in no tier (a
    shard evicted from RAM but still held locally has not left the node)."""
    resident: dict[str, set[int]] = {"local": set(), "ram": set()}
    out: dict[int, dict[str, int]] = {}
    bytes_of = {"planned_reads": "planned_bytes", "evictions": "evicted_bytes"}

    def add(epoch: int, what: str, shard: int) -> None:
        counts = out.setdefault(epoch, dict.fromkeys(PLAN_COUNTS, 0))
        counts[what] += 1
        counts[bytes_of[what]] += int(shard_bytes[shard])

    for (epoch, _position), group in itertools.groupby(events, key=lambda e: (e[0], e[2].position)):
        bypassed: set[int] = set()
        for _, tier, event in group:
            if event.kind == "load":
                if tier == "local" or event.shard not in resident["local"]:
                    add(epoch, "planned_reads", event.shard)
                resident[tier].add(event.shard)
            elif event.kind == "evict":
                resident[tier].discard(event.shard)
                if all(event.shard not in held for held in resident.values()):
                    add(epoch, "evictions", event.shard)
            elif event.kind == "bypass":
                bypassed.add(event.shard)
        for shard in sorted(bypassed):
            if all(shard not in held for held in resident.values()):
                add(epoch, "planned_reads", shard)
                out[epoch]["planned_bypasses"] += 1
    return out


def _add_cache_plan(loader: ShardLoader, records: list[dict[str, Any]]) -> None:
    """Add to each epoch's record of one run what the node cache's plan read and evicted in it, and to the
    last one the source reads its stager and its readers counted over the run (:data:`CACHE_COUNTS`;
    zeros without a stager on this process)."""
    cache = loader.cache
    plan: dict[int, dict[str, int]] = {}
    run_reads = {"stager_reads": 0, "reader_reads": 0}
    if cache is not None and cache.owns_stager:  # node_epochs waited for the stager's last action
        plan = cache_plan_reads(cache.stager_log, [os.path.getsize(p) for p in cache.source_paths])
        run_reads = {
            "stager_reads": cache.stager_stats()["source_reads"],
            "reader_reads": cache.stats()["source_reads"],
        }
    for number, record in enumerate(records):
        counts = plan.get(record["epoch"], {})
        for name in PLAN_COUNTS:
            record[name] = counts.get(name, 0)
        for name, value in run_reads.items():
            record[name] = value if number == len(records) - 1 else 0


def node_epochs(rank: int, world_size: int, tmp: Path, run: KaisokuRun) -> list[dict[str, Any]]:
    """Every (repeat, mode, epoch) of one node: seconds from the page-cache drop to its last batch (the
    first epoch includes starting the node cache and all staging), what it delivered (image bytes or
    samples), what :meth:`ShardLoader.epoch_stats` counted (source reads and bytes, exchanged bytes) and
    what the node cache's plan read and evicted (:func:`cache_plan_reads`)."""
    out: list[dict[str, Any]] = []
    ram, local = run.dirs.node(f"node{rank}")
    for repeat in range(run.repeats):
        for mode in run.modes:
            loader = node_loader(
                run.pack_dir, run.spec, run.dirs, rank=rank, world_size=world_size, mode=mode, size=run.size,
                workers=run.workers,
            )  # fmt: skip
            loader.connect(run_token=f"slowfs-{tmp.name}-{repeat}-{mode}")
            records: list[dict[str, Any]] = []
            try:
                for epoch in range(2):
                    drop_caches_together(rank)
                    start = time.perf_counter()
                    loader.set_epoch(epoch, 0)  # starts the node cache in epoch 0; exchanges (collective)
                    total = 0
                    for images, labels in loader:
                        total += int(images.sum()) if mode == "io" else int(labels.shape[0])
                    seconds = time.perf_counter() - start
                    if epoch == 1 and loader.cache is not None and loader.cache.owns_stager:
                        loader.cache.wait_staged(epoch, timeout=600.0)  # its last reads counted too
                    stats = loader.epoch_stats() or {}
                    records.append(
                        {
                            "repeat": repeat,
                            "mode": mode,
                            "epoch": epoch,
                            "seconds": seconds,
                            "total": total,
                            "source_reads": int(stats.get("source_reads", 0)),
                            "source_bytes": int(stats.get("source_bytes", 0)),
                            "exchanged_bytes": int(stats.get("exchanged_bytes", 0)),
                        }
                    )
                _add_cache_plan(loader, records)
                out.extend(records)
            finally:
                loader.close()
                shutil.rmtree(local, ignore_errors=True)  # the next run starts cold: no staged shard kept
                shutil.rmtree(ram, ignore_errors=True)
    return out


def kaisoku_epochs(run: KaisokuRun) -> list[dict[str, Any]]:
    """:func:`node_epochs` on one node (this process) or, for the partial shuffle, on its
    ``spec.num_nodes`` nodes (gloo ranks with their own caches); an epoch's time is the slowest node's,
    totals and counts are summed over the nodes."""
    nodes = run.spec.num_nodes if run.spec.name == "partial" else 1
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-slowfs-") as tmp:
        if nodes == 1:
            return node_epochs(0, 1, Path(tmp), run)
        per_node = run_ranks(node_epochs, nodes, Path(tmp), run, timeout=3600.0, collective_timeout=600.0)
    return merge_nodes(per_node)


def merge_nodes(per_node: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The nodes' :func:`node_epochs` records as one cluster's: an epoch's time is the slowest node's,
    totals and counts are summed over the nodes."""
    merged = []
    for records in zip(*per_node, strict=True):
        first = records[0]
        merged.append(
            {
                **{k: first[k] for k in ("repeat", "mode", "epoch")},
                "seconds": max(r["seconds"] for r in records),
                **{
                    k: sum(r.get(k, 0) for r in records)
                    for k in ("total", "source_reads", "source_bytes", "exchanged_bytes", *CACHE_COUNTS)
                },
            }
        )
    return merged
