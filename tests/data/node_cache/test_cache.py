"""The node cache on real files: readers through ``shard_buffer`` (the dataset's seam), staging, resume."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.node_cache.cache import NodeCache
from kaisoku.data.node_cache.staging import StagingSchedule, first_use_order, node_trace, sampler_trace_fn
from kaisoku.data.order.sampler import EpochSampler
from kaisoku.data.order.shuffle import ShuffleSpec, epoch_order, shard_of, shard_offsets
from tests.dist_harness import run_ranks

RECORD = 64


def record_bytes(index: int) -> bytes:
    """The test format: fixed-size records whose bytes name their global index."""
    return int(index).to_bytes(8, "little") * (RECORD // 8)


def make_source(root: Path, sizes: np.ndarray) -> list[Path]:
    """Shard files of fixed-size records under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    offsets = shard_offsets(sizes)
    paths = []
    for shard, size in enumerate(sizes.tolist()):
        path = root / f"shard-{shard:03d}.bin"
        path.write_bytes(b"".join(record_bytes(i) for i in range(offsets[shard], offsets[shard] + size)))
        paths.append(path)
    return paths


def read_record(cache: NodeCache, index: int, sizes: np.ndarray) -> bytes:
    """A record through the cache as the dataset reads one: its shard's buffer, then the record's bytes."""
    shard = int(shard_of(np.array([index]), sizes)[0])
    start = (index - int(shard_offsets(sizes)[shard])) * RECORD
    return bytes(cache.shard_buffer(shard)[start : start + RECORD])


def train_epoch(cache: NodeCache, sampler: EpochSampler, epoch: int) -> int:
    """Read every record of the rank's epoch through the cache, checking bytes; report progress."""
    sampler.set_epoch(epoch)
    cache.mark_progress(epoch, sampler.step)
    count = 0
    for batch in sampler:
        for index in batch:
            assert read_record(cache, index, sampler.shard_sizes) == record_bytes(index)
            count += 1
        cache.mark_progress(epoch, sampler.step)
    return count


SIZES = np.array([50, 50, 50, 50, 50, 50, 50, 50], dtype=np.int64)
SHARD_BYTES = 50 * RECORD


def _sampler(spec: ShuffleSpec | None = None) -> EpochSampler:
    spec = spec or ShuffleSpec(name="block", block_shards=2)
    return EpochSampler(SIZES, global_batch=20, rank=0, world_size=1, seed=3, shuffle=spec)


def test_staging_follows_first_use_and_epoch_two_reads_no_source(tmp_path: Path, ram_dir: Path) -> None:
    paths = make_source(tmp_path / "source", SIZES)
    sampler = _sampler(ShuffleSpec(name="global"))
    cache = NodeCache(
        paths,
        ram_dir=ram_dir,
        ram_capacity=10 * SHARD_BYTES,
        local_dir=tmp_path / "local",
        local_capacity=10 * SHARD_BYTES,
        schedule=StagingSchedule(sampler_trace_fn(sampler, node=0, ranks_per_node=1), num_epochs=2),
        run_token="t1",
    )
    try:
        assert train_epoch(cache, sampler, 0) == sampler.num_batches(0) * 20
        assert cache.wait_staged(1, timeout=30)
        # Computed independently from (seed, epoch): the node's first-use order.
        order = epoch_order(SIZES, 3, 0, ShuffleSpec(name="global"), 20)
        expected = first_use_order(
            node_trace(order, global_batch=20, world_size=1, ranks_per_node=1, node=0, shard_sizes=SIZES)
        )
        for tier in ("local", "ram"):
            loads = [ev.shard for _, t, ev in cache.stager_log if t == tier and ev.kind == "load"]
            assert loads == expected.tolist()
        assert cache.node_stats()["source_reads"] == len(SIZES)  # each shard once, by the stager
        before = cache.node_stats()
        train_epoch(cache, sampler, 1)
        after = cache.node_stats()
        assert after["source_reads"] == before["source_reads"]
        # The reader never went to the source: each shard was mapped once from a node-local tier.
        assert cache.stats()["source_reads"] == 0
        assert after["ram_opens"] + after["local_opens"] == len(SIZES)
    finally:
        cache.close()
    assert not (ram_dir / "shards").exists()


def test_reader_unpickled_in_a_worker_attaches(tmp_path: Path, ram_dir: Path) -> None:
    paths = make_source(tmp_path / "source", SIZES)
    sampler = _sampler()
    cache = NodeCache(
        paths,
        ram_dir=ram_dir,
        ram_capacity=10 * SHARD_BYTES,
        schedule=StagingSchedule(sampler_trace_fn(sampler, node=0, ranks_per_node=1), num_epochs=1),
        run_token="t4",
    )
    try:
        cache.mark_progress(0, 0)
        assert cache.wait_staged(0, timeout=30)
        worker = pickle.loads(pickle.dumps(cache))
        assert read_record(worker, 123, SIZES) == record_bytes(123)
        assert worker.stats()["ram_opens"] >= 1 and worker.stats()["source_reads"] == 0
        worker.close()  # a worker's close must leave the node's files alone
        assert read_record(cache, 7, SIZES) == record_bytes(7)
        assert len(list((ram_dir / "shards").iterdir())) == len(SIZES)
    finally:
        cache.close()


def test_resumed_sampler_stages_from_its_step(tmp_path: Path, ram_dir: Path) -> None:
    paths = make_source(tmp_path / "source", SIZES)
    before = _sampler()
    for _ in zip(range(6), before):
        pass
    sampler = _sampler()
    sampler.load_state_dict(before.state_dict())
    cache = NodeCache.for_sampler(
        sampler,
        paths,
        ranks_per_node=1,
        ram_dir=ram_dir,
        ram_capacity=10 * SHARD_BYTES,
        run_token="t7",
        num_epochs=1,
        shard_bytes=[SHARD_BYTES] * len(SIZES),
    )
    try:
        remaining = train_epoch(cache, sampler, 0)
        assert remaining == (sampler.num_batches() - 6) * 20
        assert cache.wait_staged(0, timeout=30)
        trace = node_trace(
            sampler.epoch_order(0),
            global_batch=20,
            world_size=1,
            ranks_per_node=1,
            node=0,
            shard_sizes=SIZES,
            start_step=6,
        )
        loads = [ev.shard for _, _, ev in cache.stager_log if ev.kind == "load"]
        assert loads == first_use_order(trace).tolist()
        assert cache.node_stats()["source_reads"] == len(loads)
    finally:
        cache.close()


def _node_of_two_ranks(rank: int, world_size: int, tmp: Path, ram_dir: str) -> dict[str, int]:
    import torch.distributed as dist

    sizes = SIZES
    paths = sorted((tmp.parent / "source").glob("shard-*.bin"))
    sampler = EpochSampler(sizes, global_batch=20, rank=rank, world_size=2, seed=5, shuffle=ShuffleSpec())
    cache = NodeCache(
        paths,
        ram_dir=ram_dir,
        ram_capacity=4 * SHARD_BYTES,
        local_dir=tmp / "local",
        local_capacity=8 * SHARD_BYTES,
        local_rank=rank,
        ranks_per_node=2,
        schedule=StagingSchedule(sampler_trace_fn(sampler, node=0, ranks_per_node=2), num_epochs=2),
        run_token=str(tmp),
    )
    train_epoch(cache, sampler, 0)
    dist.barrier()
    first = cache.node_stats()
    train_epoch(cache, sampler, 1)
    dist.barrier()
    second = cache.node_stats()
    reader = cache.stats()
    dist.barrier()
    cache.close()
    return {
        "epoch0_source": first["source_reads"],
        "epoch1_source": second["source_reads"] - first["source_reads"],
        "reader_source": reader["source_reads"],
    }


@pytest.mark.timeout(120)
def test_ranks_of_a_node_share_one_stager(tmp_path: Path, ram_dir: Path) -> None:
    make_source(tmp_path / "source", SIZES)
    results = run_ranks(_node_of_two_ranks, 2, tmp_path, str(ram_dir), timeout=100)
    # Both ranks read everything through one node cache: each shard came from the source once, in epoch 0,
    # read by the stager; neither reader went to the source, however the threads were scheduled.
    assert results[0] == results[1] == {"epoch0_source": len(SIZES), "epoch1_source": 0, "reader_source": 0}
