"""Shuffles: pure functions of (shard sizes, seed, epoch, world), no files, no processes."""

from __future__ import annotations

import numpy as np
import pytest

from kaisoku.data.order.sampler import rank_batches
from kaisoku.data.order.shuffle import (
    SHUFFLES,
    ShuffleSpec,
    _water_fill,
    block_order,
    epoch_order,
    global_order,
    node_partition,
    partial_plan,
    shard_of,
    shard_offsets,
    window_shuffle,
)
from kaisoku.errors import ConfigError, KaisokuError

SIZES = np.array([40, 37, 50, 41, 40, 44, 39, 45, 42, 38, 40, 36], dtype=np.int64)
TOTAL = int(SIZES.sum())


def test_registry_names() -> None:
    assert set(SHUFFLES) == {"global", "block", "partial"}


def test_offsets_and_shard_of() -> None:
    offsets = shard_offsets(SIZES)
    assert offsets[0] == 0 and offsets[-1] == TOTAL
    idx = np.arange(TOTAL)
    shards = shard_of(idx, SIZES)
    assert np.array_equal(np.bincount(shards, minlength=SIZES.size), SIZES)
    with pytest.raises(KaisokuError, match="out of range"):
        shard_of(np.array([TOTAL]), SIZES)


@pytest.mark.parametrize(
    "make",
    [
        lambda seed, epoch: global_order(SIZES, seed, epoch),
        lambda seed, epoch: block_order(SIZES, seed, epoch, block_shards=3, buffer_size=0),
        lambda seed, epoch: block_order(SIZES, seed, epoch, block_shards=2, buffer_size=30),
    ],
    ids=["global", "block", "block-buffer"],
)
def test_orders_are_keyed_permutations(make) -> None:
    order = make(7, 3)
    assert order.dtype == np.int64
    assert np.array_equal(np.sort(order), np.arange(TOTAL))
    assert np.array_equal(order, make(7, 3))
    assert not np.array_equal(order, make(7, 4))
    assert not np.array_equal(order, make(8, 3))


def test_block_keeps_blocks_together_without_buffer() -> None:
    order = block_order(SIZES, 1, 0, block_shards=3, buffer_size=0)
    shards = shard_of(order, SIZES)
    # Walking the order, the shards appear in runs of whole blocks: each block of 3 shards occupies one
    # contiguous stretch, so the number of distinct shards seen so far steps by 3 at block ends only.
    seen: list[set[int]] = []
    start = 0
    while start < order.size:
        block = set()
        end = start
        while end < order.size and (len(block) < 3 or shards[end] in block):
            block.add(int(shards[end]))
            end += 1
        seen.append(block)
        start = end
    assert len(seen) == SIZES.size // 3
    assert set().union(*seen) == set(range(SIZES.size))
    # Samples within a block are mixed: not in file order.
    assert not np.all(np.diff(order[: SIZES[:3].sum()]) > 0)


def test_window_shuffle_moves_less_than_window() -> None:
    base = np.arange(1000, dtype=np.int64)
    mixed = window_shuffle(base, 25, np.random.default_rng(0))
    assert np.array_equal(np.sort(mixed), base)
    displacement = np.abs(np.arange(1000) - mixed)
    assert displacement.max() < 25
    assert displacement.mean() > 3  # it does move things


def test_node_partition_fixed_and_balanced() -> None:
    home = node_partition(SIZES, seed=5, num_nodes=3)
    assert np.array_equal(home, node_partition(SIZES, seed=5, num_nodes=3))
    loads = np.bincount(home, weights=SIZES, minlength=3)
    assert loads.max() - loads.min() <= SIZES.max()
    with pytest.raises(KaisokuError, match="at least one shard per node"):
        node_partition(SIZES[:2], seed=0, num_nodes=3)


def test_water_fill_levels_sizes() -> None:
    kept = np.array([10, 3, 7])
    got = _water_fill(kept, 9)
    assert got.sum() == 9
    totals = kept + got
    assert totals.max() - totals.min() <= 1
    assert np.array_equal(_water_fill(np.array([10, 0]), 4), [0, 4])


def _foreign_fraction(plan, sizes) -> float:
    foreign = 0
    total = 0
    for node, order in enumerate(plan.node_orders):
        homes = plan.home_of_shard[shard_of(order, sizes)]
        foreign += int((homes != node).sum())
        total += order.size
    return foreign / total


def test_partial_q0_is_local_and_q1_mixes() -> None:
    sizes = np.full(40, 50, dtype=np.int64)
    local = partial_plan(sizes, 3, 1, num_nodes=4, exchange=0.0, global_batch=40)
    assert _foreign_fraction(local, sizes) == 0.0
    mixed = partial_plan(sizes, 3, 1, num_nodes=4, exchange=1.0, global_batch=40)
    assert 0.7 < _foreign_fraction(mixed, sizes) < 0.8  # uniform over 4 nodes: 3/4 away from home
    quarter = partial_plan(sizes, 3, 1, num_nodes=4, exchange=0.25, global_batch=40)
    assert 0.15 < _foreign_fraction(quarter, sizes) < 0.22  # Q * (N - 1) / N = 0.1875
    # The partition is the same every epoch; the exchange differs.
    other_epoch = partial_plan(sizes, 3, 2, num_nodes=4, exchange=0.25, global_batch=40)
    assert np.array_equal(quarter.home_of_shard, other_epoch.home_of_shard)
    assert not np.array_equal(quarter.node_orders[0], other_epoch.node_orders[0])


def test_partial_global_order_interleaves_nodes() -> None:
    plan = partial_plan(SIZES, 2, 0, num_nodes=2, exchange=0.5, global_batch=20)
    order = plan.global_order()
    assert order.size == plan.steps * 20
    assert np.unique(order).size == order.size
    grid = order.reshape(plan.steps, 20)
    for node in range(2):
        assert np.array_equal(grid[:, node * 10 : (node + 1) * 10].reshape(-1), plan.node_orders[node])


def test_partial_does_not_depend_on_ranks_per_node() -> None:
    spec = ShuffleSpec(name="partial", exchange=0.3, num_nodes=2)
    order = epoch_order(SIZES, 4, 1, spec, 24)
    one_rank_each = [rank_batches(order, 24, r, 2) for r in range(2)]
    two_ranks_each = [rank_batches(order, 24, r, 4) for r in range(4)]
    for node in range(2):
        joined = np.concatenate([two_ranks_each[2 * node], two_ranks_each[2 * node + 1]], axis=1)
        assert np.array_equal(joined, one_rank_each[node])


def test_epoch_order_drops_short_tail() -> None:
    for name in SHUFFLES:
        spec = ShuffleSpec(name=name, num_nodes=2, exchange=0.5 if name == "partial" else 0.0, block_shards=2)
        order = epoch_order(SIZES, 0, 0, spec, 64)
        assert order.size % 64 == 0
        assert TOTAL - order.size < 64 * (2 if name == "partial" else 1)
        assert np.unique(order).size == order.size


def test_global_batches_identical_for_any_world_size() -> None:
    order = epoch_order(SIZES, 9, 2, ShuffleSpec(name="block", block_shards=2, buffer_size=16), 16)
    reference = order.reshape(-1, 16)
    for world in (1, 2, 4, 8, 16):
        pieces = np.concatenate([rank_batches(order, 16, r, world) for r in range(world)], axis=1)
        assert np.array_equal(pieces, reference)


def test_bad_parameters_are_named() -> None:
    with pytest.raises(
        KaisokuError, match=r"data.shuffle must be one of block, global, partial \(got 'random'\)"
    ):
        ShuffleSpec(name="random")
    with pytest.raises(KaisokuError, match="multiple of the node count"):
        partial_plan(SIZES, 0, 0, num_nodes=3, exchange=0.1, global_batch=20)
    with pytest.raises(KaisokuError, match="fewer than one global batch"):
        epoch_order(SIZES, 0, 0, ShuffleSpec(), TOTAL + 1)
    with pytest.raises(KaisokuError, match="seed"):
        global_order(SIZES, -1, 0)


def test_global_orders_are_pinned() -> None:
    """Both data paths' global orders: these values must never change (runs replay exactly)."""
    packed = global_order([10, 20, 30], 0, 0)[:12].tolist()
    assert packed == [12, 57, 4, 22, 53, 30, 29, 43, 3, 28, 38, 0]
    assert global_order([10, 20, 30], 7, 3)[:12].tolist() == [24, 34, 2, 45, 39, 36, 19, 38, 30, 52, 51, 9]
    # The image-folder demo path: keyed by (seed, epoch) alone.
    folder = epoch_order([1000], 0, 0, ShuffleSpec(unpacked=True), 1)[:12].tolist()
    assert folder == [459, 206, 222, 162, 711, 814, 350, 890, 518, 264, 683, 674]
    assert global_order([1000], 7, 3, unpacked=True)[:12].tolist() == [
        919, 225, 21, 78, 70, 40, 82, 156, 66, 517, 275, 127,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"block_shards": 0}, r"data.block_shards must be >= 1 \(got 0\)"),
        ({"buffer_size": -1}, r"data.buffer_size must be >= 0 \(got -1\)"),
        ({"name": "partial", "exchange": 2.0}, r"data.exchange must be in \[0, 1\] \(got 2.0\)"),
        ({"name": "block", "exchange": 0.5}, "data.exchange needs --data.shuffle partial"),
        ({"name": "block", "unpacked": True}, "needs a packed dataset"),
    ],
)
def test_spec_checks_itself_in_one_line(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        ShuffleSpec(**values)
    assert "\n" not in str(caught.value)


def test_spec_answers_what_the_order_needs() -> None:
    assert not ShuffleSpec().needs_shards and ShuffleSpec(name="block").needs_shards
    local = ShuffleSpec(name="partial", num_nodes=1, exchange=0.5)
    assert local.depends_on_nodes and not local.partitioned and not local.exchanges
    assert ShuffleSpec(name="partial", num_nodes=2).partitioned
    assert not ShuffleSpec(name="partial", num_nodes=2).exchanges
    assert ShuffleSpec(name="partial", num_nodes=2, exchange=0.1).exchanges
    old = {k: v for k, v in ShuffleSpec(name="block").as_dict().items() if k != "unpacked"}
    assert ShuffleSpec.from_dict(old) == ShuffleSpec(name="block")  # states saved before `unpacked`
