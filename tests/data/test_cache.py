"""Tiered cache: the pure trace/Belady parts, and the stager and readers on real files."""

from __future__ import annotations

import logging
import pickle
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.cache import (
    CacheEvent,
    NodeCache,
    StagingSchedule,
    Trace,
    belady_evictions,
    first_use_order,
    node_trace,
    parse_bytes,
    plan_staging,
    progress_ticket,
    sampler_trace_fn,
)
from kaisoku.data.sampler import EpochSampler
from kaisoku.data.shuffle import ShuffleSpec, epoch_order, partial_plan, shard_of, shard_offsets
from kaisoku.errors import KaisokuError
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
    """A record through the cache, the way the dataset's seam reads one."""
    shard = int(shard_of(np.array([index]), sizes)[0])
    return cache.read_range(shard, (index - int(shard_offsets(sizes)[shard])) * RECORD, RECORD)


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


# ----------------------------------------------------------------------------------------------- pure


def test_first_use_order() -> None:
    assert first_use_order([3, 1, 3, 0, 1, 2, 0]).tolist() == [3, 1, 0, 2]


def test_belady_simulator_on_a_hand_checked_trace() -> None:
    trace = [0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2]
    events = belady_evictions(trace, 3, np.ones(5, dtype=np.int64))
    assert events == [
        CacheEvent(0, "load", 0),
        CacheEvent(1, "load", 1),
        CacheEvent(2, "load", 2),
        CacheEvent(4, "evict", 1),  # 1 is never used again
        CacheEvent(4, "load", 3),
        CacheEvent(6, "bypass", 4),  # 4 is never used again; the residents are (0 at 9, 2 at 7, 3 at 8)
    ]
    # A shard needed soon displaces the resident needed last (0, next used at 10).
    soon = belady_evictions([*trace[:6], 5, 5, 2, 3, 0], 3, np.ones(6, dtype=np.int64))
    assert soon[5:7] == [CacheEvent(6, "evict", 0), CacheEvent(6, "load", 5)]


def test_step_that_does_not_fit_bypasses() -> None:
    trace = Trace(np.array([0, 0, 0, 1]), np.array([0, 1, 2, 0]))
    events = belady_evictions(trace, 2, np.ones(3, dtype=np.int64))
    assert CacheEvent(2, "bypass", 2) in events
    assert not [e for e in events if e.kind == "evict"]  # shards of the running step are pinned


def test_planner_agrees_with_simulator_on_random_traces() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        num_shards = int(rng.integers(2, 10))
        length = int(rng.integers(1, 60))
        trace = Trace(
            np.sort(rng.integers(0, max(1, length // 2), length)).astype(np.int64),
            rng.integers(0, num_shards, length).astype(np.int64),
        )
        sizes = rng.integers(1, 8, num_shards)
        capacity = int(rng.integers(0, 30))
        initial = [int(s) for s in rng.permutation(num_shards)[: rng.integers(0, 3)]]
        while initial and sizes[initial].sum() > capacity:
            initial.pop()
        horizon = int(rng.integers(0, length + 1))
        expected = belady_evictions(trace, capacity, sizes, initial=initial, horizon=horizon)
        plan = plan_staging(trace, capacity, sizes, initial=initial, horizon=horizon)
        assert plan.events() == expected
        for action in plan.actions:  # an eviction is gated on the victim's last earlier use
            if action.kind == "evict" and action.after_step >= 0:
                earlier = trace.steps[: action.position][trace.shards[: action.position] == action.shard]
                assert action.after_step == earlier.max() < action.step


def test_node_trace_reads_the_node_columns_step_by_step() -> None:
    sizes = np.full(6, 10, dtype=np.int64)
    order = epoch_order(sizes, 0, 0, ShuffleSpec(), 12)
    trace = node_trace(order, global_batch=12, world_size=4, ranks_per_node=2, node=1, shard_sizes=sizes)
    grid = order.reshape(-1, 12)
    for step in range(grid.shape[0]):
        expected = list(dict.fromkeys(shard_of(grid[step, 6:12], sizes).tolist()))
        assert trace.shards[trace.steps == step].tolist() == expected


def test_node_trace_partial_reads_home_shards_and_what_it_sends() -> None:
    sizes = np.full(8, 10, dtype=np.int64)
    plan = partial_plan(sizes, 1, 0, num_nodes=2, exchange=0.5, global_batch=8)
    order = plan.global_order()
    home = plan.home_of_shard == 0
    trace = node_trace(
        order, global_batch=8, world_size=2, ranks_per_node=1, node=0, shard_sizes=sizes, home_shards=home
    )
    assert home[trace.shards].all()
    sent_shards = set(shard_of(order.reshape(-1, 8)[:, 4:].reshape(-1), sizes).tolist()) & set(
        np.flatnonzero(home).tolist()
    )
    assert sent_shards <= set(trace.shards[trace.steps == 0].tolist())


# -------------------------------------------------------------------------------------------- runtime


@pytest.fixture
def ram_dir() -> Iterator[Path]:
    path = Path("/dev/shm") / f"kaisoku-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


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


def _replay(events: list[CacheEvent], initial: list[int]) -> list[int]:
    resident = list(initial)
    for event in events:
        if event.kind == "load":
            resident.append(event.shard)
        elif event.kind == "evict":
            resident.remove(event.shard)
    return resident


def test_evictions_match_belady_simulator(tmp_path: Path, ram_dir: Path) -> None:
    paths = make_source(tmp_path / "source", SIZES)
    sampler = _sampler()
    capacities = {"local": 5 * SHARD_BYTES, "ram": 3 * SHARD_BYTES}
    trace_of = sampler_trace_fn(sampler, node=0, ranks_per_node=1)
    cache = NodeCache(
        paths,
        ram_dir=ram_dir,
        ram_capacity=capacities["ram"],
        local_dir=tmp_path / "local",
        local_capacity=capacities["local"],
        schedule=StagingSchedule(trace_of, num_epochs=3),
        run_token="t2",
    )
    try:
        for epoch in range(3):
            train_epoch(cache, sampler, epoch)
        assert cache.wait_staged(2, timeout=30)
        # The plans bypass nothing here (checked below), so the reader never went to the source: a shard
        # evicted and loaded again was waited for, however far the stager lagged behind.
        assert cache.stats()["source_reads"] == 0
    finally:
        cache.close()
    for tier, capacity in capacities.items():
        resident: list[int] = []
        for epoch in range(3):
            trace = trace_of(epoch, 0)
            lookahead = trace.then(trace_of(epoch + 1, 0)) if epoch < 2 else trace
            expected = belady_evictions(
                lookahead, capacity, np.full(8, SHARD_BYTES), initial=resident, horizon=len(trace)
            )
            executed = [ev for e, t, ev in cache.stager_log if t == tier and e == epoch]
            assert executed == expected
            assert any(ev.kind == "evict" for ev in executed)
            assert not any(ev.kind == "bypass" for ev in executed)
            resident = _replay(expected, resident)


def test_eviction_waits_for_readers(tmp_path: Path, ram_dir: Path) -> None:
    paths = make_source(tmp_path / "source", SIZES)
    sampler = _sampler()
    trace_of = sampler_trace_fn(sampler, node=0, ranks_per_node=1)
    cache = NodeCache(
        paths,
        ram_dir=ram_dir,
        ram_capacity=3 * SHARD_BYTES,
        schedule=StagingSchedule(trace_of, num_epochs=1),
        run_token="t3",
    )
    plan = plan_staging(trace_of(0, 0), 3 * SHARD_BYTES, np.full(8, SHARD_BYTES))
    first_evict = next(a for a in plan.actions if a.kind == "evict")
    try:
        # No reader has reported progress: the stager fills the capacity, then stops at the first
        # eviction until every rank has finished the step of the victim's last use.
        assert cache.wait_stalled(timeout=60) == progress_ticket(0, first_evict.after_step + 1)
        kinds = [ev.kind for _, _, ev in cache.stager_log]
        assert kinds.count("load") == 3 and "evict" not in kinds
        assert not cache.wait_staged(0, timeout=0)
        train_epoch(cache, sampler, 0)
        assert cache.wait_staged(0, timeout=60)
        assert cache.wait_stalled(timeout=60) is None  # finished
    finally:
        cache.close()


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


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512 MB") == 512_000_000
    assert parse_bytes("1.5kib") == 1536
    assert parse_bytes(0) == 0
    with pytest.raises(KaisokuError, match="2GiB"):
        parse_bytes("lots")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kaisoku.data.cache" and r.levelno == logging.WARNING
    ]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode}); needs root")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_full_local_disk_goes_on_from_source_with_one_warning(
    tmp_path: Path, ram_dir: Path, tiny_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sizes = np.full(8, 400, dtype=np.int64)  # 8 shards x 25.6 KB = 205 KB, more than the 64 KB tmpfs
    paths = make_source(tmp_path / "source", sizes)
    sampler = EpochSampler(sizes, global_batch=40, rank=0, world_size=1, seed=0, shuffle=ShuffleSpec())
    cache = NodeCache(
        paths,
        ram_dir=ram_dir,
        local_dir=tiny_tmpfs,
        local_capacity=1 << 30,
        schedule=StagingSchedule(sampler_trace_fn(sampler, node=0, ranks_per_node=1), num_epochs=2),
        run_token="t5",
    )
    caplog.set_level(logging.WARNING, logger="kaisoku.data.cache")
    try:
        train_epoch(cache, sampler, 0)
        before = cache.node_stats()["source_reads"]
        train_epoch(cache, sampler, 1)
        assert cache.node_stats()["source_reads"] > before  # what did not fit comes from the source
        assert cache.wait_staged(1, timeout=30)
        assert not cache.tiers_enabled()["local"]
        assert len(list((tiny_tmpfs / "kaisoku-shards").glob("shard-*"))) == 2  # what fitted stays in use
    finally:
        cache.close()
    messages = _warnings(caplog)
    assert len(messages) == 1 and "is full" in messages[0] and str(tiny_tmpfs) in messages[0]


def test_unwritable_local_dir_warns_once(
    tmp_path: Path, ram_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = make_source(tmp_path / "source", SIZES)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    caplog.set_level(logging.WARNING, logger="kaisoku.data.cache")
    sampler = _sampler()
    cache = NodeCache(
        paths,
        ram_dir=ram_dir,
        ram_capacity=2 * SHARD_BYTES,
        local_dir=blocker / "cache",
        local_capacity=1 << 30,
        schedule=StagingSchedule(sampler_trace_fn(sampler, node=0, ranks_per_node=1), num_epochs=1),
        run_token="t6",
    )
    try:
        train_epoch(cache, sampler, 0)
        assert cache.tiers_enabled() == {"ram": True, "local": False}
    finally:
        cache.close()
    messages = _warnings(caplog)
    assert len(messages) == 1 and "not writable" in messages[0]


def test_too_small_cache_for_a_global_order_warns(
    tmp_path: Path, ram_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = make_source(tmp_path / "source", SIZES)
    sampler = _sampler(ShuffleSpec(name="global"))
    caplog.set_level(logging.WARNING, logger="kaisoku.data.cache")
    cache = NodeCache.for_sampler(
        sampler,
        paths,
        ranks_per_node=1,
        ram_dir=ram_dir,
        ram_capacity=2 * SHARD_BYTES,
        run_token="t8",
        num_epochs=2,
    )
    try:
        train_epoch(cache, sampler, 0)  # still correct, only slow
        assert cache.wait_staged(0, timeout=30)
    finally:
        cache.close()
    messages = _warnings(caplog)
    assert len(messages) == 1 and "too small for this order" in messages[0]


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
