"""Shuffle-quality metric: global about 1, file order about 0, block in between."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kaisoku.data.order.quality import batch_entropies, expected_random_entropy, shuffle_quality
from kaisoku.data.order.shuffle import block_order, global_order, partial_plan, sequential_order

SIZES = np.full(40, 500, dtype=np.int64)
BATCH = 128


def test_global_scores_about_one() -> None:
    assert shuffle_quality(global_order(SIZES, 0, 0), SIZES, BATCH) == pytest.approx(1.0, abs=0.02)


def test_sequential_scores_about_zero() -> None:
    assert shuffle_quality(sequential_order(SIZES), SIZES, BATCH) < 0.05


def test_block_lies_between_and_rises_with_block_size() -> None:
    scores = [shuffle_quality(block_order(SIZES, 0, 0, block_shards=k), SIZES, BATCH) for k in (1, 4, 16)]
    assert 0.0 <= scores[0] < scores[1] < scores[2] < 0.98
    assert scores[1] > 0.2


def test_partial_node_batches_score_below_global_at_q0() -> None:
    sizes = np.full(8, 500, dtype=np.int64)
    local = partial_plan(sizes, 0, 0, num_nodes=4, exchange=0.0, global_batch=4 * 32)
    mixed = partial_plan(sizes, 0, 0, num_nodes=4, exchange=1.0, global_batch=4 * 32)
    assert shuffle_quality(local.node_orders[0], sizes, 32) < 0.5
    assert shuffle_quality(mixed.node_orders[0], sizes, 32) == pytest.approx(1.0, abs=0.05)


def test_entropy_formula_on_a_hand_batch() -> None:
    sizes = np.array([4, 4], dtype=np.int64)
    # One batch of 4: three samples from shard 0, one from shard 1.
    entropies = batch_entropies(np.array([0, 1, 2, 4]), sizes, 4)
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert entropies[0] == pytest.approx(expected)


def test_expected_entropy_matches_sampling() -> None:
    sizes = np.array([30, 10, 20, 5], dtype=np.int64)
    rng = np.random.default_rng(1)
    draws = np.concatenate([rng.permutation(65)[:16] for _ in range(4000)])
    sampled = batch_entropies(draws, sizes, 16).mean()
    assert expected_random_entropy(sizes, 16) == pytest.approx(sampled, rel=0.01)


def test_single_shard_scores_one() -> None:
    assert shuffle_quality(np.arange(50), np.array([50]), 10) == 1.0
