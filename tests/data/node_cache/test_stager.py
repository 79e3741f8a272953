"""The stager thread: Belady plans executed on real files, gated evictions, full or unwritable tiers."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kaisoku.data.node_cache.cache import NodeCache
from kaisoku.data.node_cache.stager import progress_ticket
from kaisoku.data.node_cache.staging import (
    CacheEvent,
    StagingAction,
    StagingSchedule,
    belady_evictions,
    plan_staging,
    sampler_trace_fn,
)
from kaisoku.data.order.sampler import EpochSampler
from kaisoku.data.order.shuffle import ShuffleSpec
from tests.data.node_cache.test_cache import (
    RECORD,
    SHARD_BYTES,
    SIZES,
    _sampler,
    make_source,
    record_bytes,
    train_epoch,
)


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


def _replay(events: list[CacheEvent], initial: list[int]) -> list[int]:
    resident = list(initial)
    for event in events:
        if event.kind == "load":
            resident.append(event.shard)
        elif event.kind == "evict":
            resident.remove(event.shard)
    return resident


def _three_shard_ram_cache(
    tmp_path: Path, ram_dir: Path, token: str
) -> tuple[NodeCache, list[StagingAction]]:
    """A RAM tier of 3 of the 8 shards staging one epoch of :func:`_sampler`'s order, and its plan."""
    trace_of = sampler_trace_fn(_sampler(), node=0, ranks_per_node=1)
    cache = NodeCache(
        make_source(tmp_path / "source", SIZES),
        ram_dir=ram_dir,
        ram_capacity=3 * SHARD_BYTES,
        schedule=StagingSchedule(trace_of, num_epochs=1),
        run_token=token,
    )
    return cache, plan_staging(trace_of(0, 0), 3 * SHARD_BYTES, np.full(8, SHARD_BYTES)).actions


def test_eviction_waits_for_readers(tmp_path: Path, ram_dir: Path) -> None:
    cache, actions = _three_shard_ram_cache(tmp_path, ram_dir, "t3")
    sampler = _sampler()
    first_evict = next(a for a in actions if a.kind == "evict")
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


def test_a_read_ahead_of_progress_waits_for_the_load_planned_for_its_step(
    tmp_path: Path, ram_dir: Path
) -> None:
    cache, actions = _three_shard_ram_cache(tmp_path, ram_dir, "ahead")
    first_evict = next(n for n, a in enumerate(actions) if a.kind == "evict")
    gated = [a for a in actions[first_evict:] if a.kind == "load"]
    shards = list(dict.fromkeys(a.shard for a in gated))  # each shard's first load behind the gate
    assert len(shards) >= 2
    ahead, plain = (next(a for a in gated if a.shard == s) for s in shards[:2])
    try:
        # Training has received nothing; the stager stalls at its first eviction, before these loads.
        cache.mark_progress(0, 0)
        assert cache.wait_stalled(timeout=60) == progress_ticket(0, actions[first_evict].after_step + 1)
        # A read with no step looks ahead of the plan: it goes to the source (the plan loads it later too).
        assert bytes(cache.shard_buffer(plain.shard)[:RECORD]) == record_bytes(plain.shard * 50)
        assert cache.tier_of(plain.shard) == "source" and cache.stats()["source_reads"] == 1
        # A read for its step waits for the load planned for that step, which needs training's progress.
        read: dict[str, object] = {}

        def reader() -> None:
            with cache.reading_for(0, ahead.step):
                read["bytes"] = bytes(cache.shard_buffer(ahead.shard)[:RECORD])
                read["tier"] = cache.tier_of(ahead.shard)

        thread = threading.Thread(target=reader)
        thread.start()
        deadline = time.monotonic() + 60
        while cache.stats()["waits"] == 0 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.stats()["waits"] == 1 and thread.is_alive()
        cache.mark_progress(0, ahead.step)  # batches 0 .. step - 1 received: every gate before the load opens
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert read == {"bytes": record_bytes(ahead.shard * 50), "tier": "ram"}
        assert cache.stats()["source_reads"] == 1  # only the read with no step
    finally:
        cache.close()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kaisoku.data.node_cache.cache" and r.levelno == logging.WARNING
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
    caplog.set_level(logging.WARNING, logger="kaisoku.data.node_cache.cache")
    try:
        train_epoch(cache, sampler, 0)
        train_epoch(cache, sampler, 1)
        # Two shards fit; the reader read every other one from the source (and kept it mapped).
        assert cache.stats()["source_reads"] >= len(sizes) - 2
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
    caplog.set_level(logging.WARNING, logger="kaisoku.data.node_cache.cache")
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
    caplog.set_level(logging.WARNING, logger="kaisoku.data.node_cache.cache")
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
