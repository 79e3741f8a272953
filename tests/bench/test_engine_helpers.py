"""bench/engine.py's judging helpers (the confidence interval of the median round ratio, the alternating
rounds) and the CPU-side logic of bench/throughput.py, which judges with them."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kaisoku.errors import ConfigError
from kaisoku_bench import throughput
from kaisoku_bench.engine import alternating_rounds, median_interval
from kaisoku_bench.throughput import summarize


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


def test_rounds_alternate_the_sides_and_stop_on_the_budget_not_on_the_ratios() -> None:
    calls: list[str] = []

    def side(name: str, seconds: float) -> Callable[[], float]:
        def block() -> float:
            calls.append(name)
            return seconds

        return block

    blocks = {"a": side("a", 0.5), "b": side("b", 0.25), "c": side("c", 1.0)}
    plan = {"min_rounds": 2, "max_rounds": 9, "chunks_per_round": 2, "row_seconds": 20}
    rounds, spent = alternating_rounds(blocks, 4, plan)
    # Two warm-up passes, then per round one pass in order and one reversed.
    assert calls[:6] == ["a", "b", "c"] * 2
    assert calls[6:12] == ["a", "b", "c", "c", "b", "a"]
    # A round measures 2 passes x 4 steps x 1.75 s = 14 s: the 20 s budget ends it after the second.
    assert len(rounds) == 2 and spent == pytest.approx(28.0)
    assert rounds[0] == {"a": 0.5, "b": 0.25, "c": 1.0}


def test_the_throughput_goals_point_the_right_way() -> None:
    # kaisoku 10% slower per step than the loop on the same loader, and fed at 80% of the synthetic ceiling.
    rounds = [{"kaisoku": 0.11 + 1e-4 * i, "loop": 0.1, "synthetic": 0.088} for i in range(12)]
    plan = {"global_batch": 256}
    rows, summary = summarize({"rounds": rounds}, plan)
    step = summary["kaisoku_step_time_vs_loop_with_loader"]
    feed = summary["kaisoku_images_per_s_vs_synthetic_loop"]
    assert step["value"] == pytest.approx(1.1055, abs=1e-3) and step["met"] is False
    assert feed["value"] == pytest.approx(0.796, abs=1e-3) and feed["met"] is False
    assert rows[0]["side"] == "kaisoku" and rows[0]["images_per_s_median"] == pytest.approx(
        256 / 0.11055, rel=1e-3
    )
    # The same rounds with kaisoku as fast as the loop and the ceiling: both goals met, clear of the noise.
    even = [{"kaisoku": 0.1 - 1e-5 * i, "loop": 0.1, "synthetic": 0.1 - 2e-5 * i} for i in range(12)]
    _, met = summarize({"rounds": even}, plan)
    assert met["kaisoku_step_time_vs_loop_with_loader"]["met"] is True
    assert met["kaisoku_images_per_s_vs_synthetic_loop"]["met"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_full_throughput_run_without_cuda_is_refused_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs|has none"):
        throughput.run(quick=False, out_dir=tmp_path)
    assert not list(tmp_path.iterdir())
