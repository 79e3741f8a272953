"""The K-FAC benchmark's fairness helpers: grid extension, interpolated time to target, the schedule."""

from __future__ import annotations

import math

import pytest

from kaisoku.bench.kfac import crossing, first_crossing, lr_factor, tune


def test_tune_extends_the_grid_until_the_best_is_inside() -> None:
    tried: list[float] = []

    def score(value: float) -> float:  # best at 0.025, below the grid
        tried.append(value)
        return -abs(value - 0.025)

    best, points, inside = tune((0.1, 0.2, 0.4), score, extend_limit=3)
    assert best == pytest.approx(0.025) and inside
    assert tried == pytest.approx([0.1, 0.2, 0.4, 0.05, 0.025, 0.0125])
    assert [p["setting"] for p in points] == sorted(tried)


def test_tune_reports_an_edge_it_could_not_leave() -> None:
    best, points, inside = tune((1.0, 2.0), lambda value: value, extend_limit=1)
    assert (best, inside, len(points)) == (4.0, False, 3)


def test_crossing_is_interpolated_between_evaluations() -> None:
    curve = [
        {"step": 6.0, "wall_s": 3.0, "epochs": 0.5, "acc": 0.90},
        {"step": 12.0, "wall_s": 6.0, "epochs": 1.0, "acc": 0.98},
    ]
    point = first_crossing(curve, 0.96)
    assert point is not None
    assert point["wall_s"] == pytest.approx(5.25) and point["step"] == pytest.approx(10.5)
    assert crossing(None, curve[0], 0.5) == curve[0]
    assert first_crossing(curve, 0.99) is None


def test_every_method_gets_warmup_then_decay() -> None:
    assert lr_factor(0, 4, 100) == pytest.approx(0.25)
    assert lr_factor(3, 4, 100) == pytest.approx(0.5 * (1 + math.cos(0.03 * math.pi)))
    assert lr_factor(50, 4, 100) == pytest.approx(0.5)
    assert lr_factor(100, 4, 100) == pytest.approx(0.0)
