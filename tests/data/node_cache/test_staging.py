"""The pure staging planner: traces, Belady's MIN, the heap planner, node traces, cache settings."""

from __future__ import annotations

import numpy as np
import pytest

from kaisoku.data.node_cache.staging import (
    CacheEvent,
    CacheSettings,
    Trace,
    belady_evictions,
    first_use_order,
    node_trace,
    plan_staging,
)
from kaisoku.data.order.shuffle import ShuffleSpec, epoch_order, partial_plan, shard_of
from kaisoku.errors import ConfigError


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


def test_cache_settings_check_themselves() -> None:
    assert not CacheSettings().enabled
    assert CacheSettings(ram_capacity=1 << 20).enabled
    assert CacheSettings(local_dir="/scratch", local_capacity=2 << 30).enabled
    with pytest.raises(ConfigError, match="data.local_capacity needs data.local_cache"):
        CacheSettings(local_capacity=1)
    with pytest.raises(ConfigError, match=r"data.ram_capacity must be a byte count >= 0 \(got -1\)"):
        CacheSettings(ram_capacity=-1)
    with pytest.raises(ConfigError, match="data.ram_capacity"):
        CacheSettings(ram_capacity="2GiB")  # type: ignore[arg-type]
