"""The greedy cost-model assignment and the bucket plan: pure functions, no processes."""

from __future__ import annotations

import itertools

import pytest

from kaisoku.optim.kfac import bucket_plan, decomposition_cost, greedy_assignment, rank_loads


def test_cost_is_sum_of_sizes_cubed() -> None:
    assert decomposition_cost([2, 3]) == 8 + 27
    assert decomposition_cost([]) == 0


def test_heaviest_items_spread_and_loads_balanced() -> None:
    costs = {"a": 8.0, "b": 7.0, "c": 6.0, "d": 5.0, "e": 4.0}
    owners = greedy_assignment(costs, 2)
    # LPT: a->0, b->1, c->1 (7<8), d->0 (8<13), e->0 (13=13, lowest rank)... loads 17 and 13.
    assert owners == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}
    assert rank_loads(costs, owners, 2) == [17.0, 13.0]


def test_within_four_thirds_of_optimum_on_small_cases() -> None:
    cases = [[5, 5, 4, 4, 3, 3, 3], [9, 7, 6, 5, 5, 4, 2, 1], [1, 1, 1, 1], [100, 1, 1, 1]]
    for sizes, world in itertools.product(cases, [2, 3]):
        costs = {f"layer{i}": float(s) for i, s in enumerate(sizes)}
        loads = rank_loads(costs, greedy_assignment(costs, world), world)
        best = min(
            max(sum(s for s, r in zip(sizes, split) if r == rank) for rank in range(world))
            for split in itertools.product(range(world), repeat=len(sizes))
        )
        assert max(loads) <= best * 4 / 3 + 1e-9
        assert sum(loads) == pytest.approx(sum(sizes))


def test_deterministic_regardless_of_insertion_order() -> None:
    costs = {"x": 3.0, "y": 3.0, "z": 3.0, "w": 1.0}
    reordered = dict(reversed(list(costs.items())))
    assert greedy_assignment(costs, 2) == greedy_assignment(reordered, 2)


def test_more_ranks_than_items_and_single_rank() -> None:
    assert greedy_assignment({"a": 1.0, "b": 2.0}, 4) == {"b": 0, "a": 1}
    assert set(greedy_assignment({"a": 1.0, "b": 2.0}, 1).values()) == {0}
    assert greedy_assignment({}, 3) == {}


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="world_size"):
        greedy_assignment({"a": 1.0}, 0)
    with pytest.raises(ValueError, match="'a'"):
        greedy_assignment({"a": float("nan")}, 2)


def test_bucket_plan_groups_consecutive_items_under_cap() -> None:
    assert bucket_plan([3, 3, 3, 10, 1], cap=6) == [[0, 1], [2], [3], [4]]
    assert bucket_plan([], cap=4) == []
    assert bucket_plan([1, 1, 1], cap=100) == [[0, 1, 2]]
