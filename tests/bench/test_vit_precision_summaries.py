"""The summary logic of ``kaisoku bench vit`` and ``kaisoku bench precision``: signed gaps judged by their
interval over seeds, the 60% precondition of the ViT comparison, and the sizing helpers they share."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kaisoku_bench.goals import goal, paired_gap_std, resolution, seeds_for_half_width
from kaisoku_bench.precision import Task, _summarise
from kaisoku_bench.vit import run_events, switch_goals, train_seconds_to


def _vit_runs(dp: list[float], switch: list[float], seconds: float | None = 300.0) -> list[dict[str, Any]]:
    runs = []
    for seed, (a, b) in enumerate(zip(dp, switch)):
        runs.append({"config": "dp-only", "seed": seed, "accuracy": a, "train_s_to_target": seconds})
        runs.append({"config": "switch", "seed": seed, "accuracy": b, "train_s_to_target": seconds})
    return runs


def test_vit_gap_is_signed_in_points_and_met_when_its_interval_clears_the_goal() -> None:
    dp = [0.650, 0.660, 0.655, 0.645]
    switch = [0.645, 0.657, 0.651, 0.643]  # 0.5, 0.3, 0.4, 0.2 points below dp-only
    summary = switch_goals(_vit_runs(dp, switch), epochs=6)
    gap = summary["switch_accuracy_gap_points"]
    assert gap["value"] == pytest.approx(-0.35, abs=1e-3)  # negative: switch is worse; never |mean|
    assert gap["switch_minus_dp_points_per_seed"] == pytest.approx([-0.5, -0.3, -0.4, -0.2], abs=1e-6)
    assert gap["met"] is True and gap["interval"][0] > -1.0
    assert gap["resolves_goal"] is True and gap["interval_half_width"] < 1.0
    assert summary["val_accuracy"]["met"] and summary["switch_val_accuracy"]["met"]
    assert summary["seconds_to_60pct"]["value"] == pytest.approx(300.0)


def test_vit_gap_whose_interval_straddles_the_goal_is_unmet_within_noise() -> None:
    dp = [0.65, 0.65, 0.65, 0.65]
    switch = [0.62, 0.66, 0.63, 0.655]  # -3, +1, -2, +0.5 points: mean -0.875, interval below -1 too
    gap = switch_goals(_vit_runs(dp, switch), epochs=6)["switch_accuracy_gap_points"]
    assert gap["value"] == pytest.approx(-0.875, abs=1e-3)
    assert gap["met"] is False and gap["reason"].startswith("within noise")
    assert gap["resolves_goal"] is False and gap["seeds_needed"] > 4


def test_vit_gap_is_not_judged_on_runs_below_60_percent() -> None:
    summary = switch_goals(_vit_runs([0.64, 0.58, 0.66], [0.64, 0.58, 0.66], seconds=None), epochs=6)
    gap = summary["switch_accuracy_gap_points"]
    assert gap["met"] is False and "dp-only seed 1 (0.580)" in gap["reason"]
    assert gap["value"] == 0.0  # identical accuracies are recorded, but they prove nothing here
    timing = summary["switch_seconds_to_60pct"]
    assert timing["met"] is False and "never reached 60%" in timing["reason"]


def test_vit_needs_the_same_seeds_on_both_sides() -> None:
    runs = _vit_runs([0.7, 0.7], [0.7, 0.7])
    runs.pop()  # switch lost its seed 1
    with pytest.raises(ValueError, match="same seeds"):
        switch_goals(runs, epochs=6)


def test_time_to_60_percent_counts_training_seconds_interpolated(tmp_path: Path) -> None:
    events = [
        {"event": "train", "step": 10, "elapsed_s": 50.0},
        {"event": "validation", "epoch": 1, "val_accuracy": 0.5, "elapsed_s": 110.0, "seconds": 10.0},
        {"event": "switch", "step": 20, "layout": "dp2"},
        {"event": "validation", "epoch": 2, "val_accuracy": 0.7, "elapsed_s": 220.0, "seconds": 10.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    curve, switches = run_events(tmp_path)
    assert [v["train_s"] for v in curve] == [100.0, 200.0]  # each validation's seconds taken out
    assert switches == [{"step": 20, "layout": "dp2"}]
    assert train_seconds_to(curve, 0.6) == pytest.approx(150.0)
    assert train_seconds_to(curve, 0.8) is None


def _precision_rows(task: str, gaps_by_mode: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = []
    seeds = len(next(iter(gaps_by_mode.values())))
    for seed in range(seeds):
        rows.append({"task": task, "mode": "fp32", "seed": seed, "accuracy": 0.9, "step_s": 0.1})
        for mode, gaps in gaps_by_mode.items():
            accuracy = 0.9 + gaps[seed] / 100.0
            rows.append({"task": task, "mode": mode, "seed": seed, "accuracy": accuracy, "step_s": 0.15})
    return rows


def test_precision_gap_keeps_its_sign_and_is_unmet_inside_its_interval() -> None:
    task = Task("mnist", "small-cnn", "small", 28, 64, 150, 0.1, 10_000, seeds=(0, 1, 2))
    rows = _precision_rows(
        "mnist",
        {"int16-stats": [0.16, -0.48, 0.32], "int8-stats": [-0.7, -0.8, -0.75], "int8-fixed": [-30.0] * 3},
    )
    summary, aggregates = _summarise(rows, {"tasks": [task]}, {}, quick=False)
    int16 = summary["int16_stats_gap_points_mnist_small_cnn"]
    assert int16["value"] == pytest.approx(0.0, abs=1e-6)  # the mean of +0.16, -0.48, +0.32: not |each|
    assert int16["per_seed"] == pytest.approx([0.16, -0.48, 0.32], abs=1e-6)
    assert int16["met"] is False and int16["reason"].startswith("within noise")
    assert int16["resolves_goal"] is False and int16["seeds_needed"] > 3
    int8 = summary["int8_stats_gap_points_mnist_small_cnn"]
    assert int8["value"] == pytest.approx(-0.75, abs=1e-6) and int8["met"] is False
    assert "reason" not in int8  # clearly worse than the goal: judged, not noise
    assert summary["int8_fixed_control_gap_points_mnist_small_cnn"]["met"] is True
    assert summary["fp8_stats_gap_points_mnist_small_cnn"]["reason"] == "not measured"
    assert {a["mode"] for a in aggregates} == {"int16-stats", "int8-stats", "int8-fixed"}


def test_a_failed_precision_run_leaves_its_goal_unmet_and_the_others_judged() -> None:
    task = Task("mnist", "small-cnn", "small", 28, 64, 150, 0.1, 10_000, seeds=(0, 1, 2))
    rows = _precision_rows("mnist", {"int16-stats": [0.01, -0.01, 0.0], "int8-stats": [-0.7, -0.8, -0.75]})
    failed = next(r for r in rows if r["mode"] == "int8-stats" and r["seed"] == 1)
    failed.update(accuracy=None, step_s=None, error="NonFiniteError: loss nan at step 40")
    summary, aggregates = _summarise(rows, {"tasks": [task]}, {}, quick=False)
    int8 = summary["int8_stats_gap_points_mnist_small_cnn"]
    assert int8["met"] is False
    assert int8["reason"] == "runs failed: int8-stats seed 1 (NonFiniteError: loss nan at step 40)"
    assert int8["per_seed"] == [pytest.approx(-0.7, abs=1e-6), None, pytest.approx(-0.75, abs=1e-6)]
    assert summary["int16_stats_gap_points_mnist_small_cnn"]["met"] is True  # its seeds all ran
    row = next(a for a in aggregates if a["mode"] == "int8-stats")
    assert row["gap_points_mean"] == pytest.approx(-0.725, abs=1e-3)


def test_sizing_helpers_follow_the_stated_arithmetic() -> None:
    assert paired_gap_std(0.25, 5000) == pytest.approx(math.sqrt(0.25 / 5000))
    assert seeds_for_half_width(0.9, 1.0) == 4  # 1.96 * 0.9 / sqrt(4) = 0.88 < 1; sqrt(3) gives 1.02
    assert seeds_for_half_width(0.1, 1.0) == 2
    with pytest.raises(ValueError):
        paired_gap_std(0.25, 0)
    entry = goal(None, ">= -1.0", samples=[0.0, 0.1, -0.1], statistic="mean", unit="seeds")
    found = resolution(entry, 1.0)
    assert found["resolves_goal"] is True and found["seed_std"] == pytest.approx(0.1)
    assert resolution(goal(0.5, ">= -1.0", reason="quick"), 1.0) == {}
