"""bench/engine.py's judging helpers: the confidence interval of the median round ratio."""

from __future__ import annotations

import math

import pytest

from kaisoku.bench.engine import median_interval


def _coverage(n: int, k: int) -> float:
    """P(k <= B <= n - k) for B ~ Bin(n, 1/2): how often [x(k), x(n+1-k)] holds the median."""
    return sum(math.comb(n, j) for j in range(k, n - k + 1)) / 2**n


@pytest.mark.parametrize("n", [6, 9, 15, 25])
def test_the_interval_is_the_narrowest_order_statistics_with_95_percent_coverage(n: int) -> None:
    values = [float(v) for v in reversed(range(1, n + 1))]  # unsorted on purpose
    interval = median_interval(values)
    assert interval is not None
    k = int(interval[0])
    assert interval == (k, n + 1 - k)
    assert _coverage(n, k) >= 0.95 > _coverage(n, k + 1)


def test_too_few_rounds_give_no_interval() -> None:
    assert median_interval([1.0, 1.01, 1.02, 0.99, 1.0]) is None  # 5 rounds cover at most 94%
    assert median_interval([1.0] * 6) == (1.0, 1.0)


def test_the_recorded_rounds_of_a_median_below_the_goal_can_still_reach_above_it() -> None:
    ratios = [1.0162, 1.0173, 1.0241, 1.0257, 1.0185, 1.0149, 1.0155, 1.0363, 1.0344]  # median 1.0185
    assert median_interval(ratios) == (1.0155, 1.0344)
