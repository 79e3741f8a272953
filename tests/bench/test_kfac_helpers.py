"""The accuracy benchmarks' shared parts: grid extension, interpolated time to target, the configs each
method trains with, and a run through the engine ``kaisoku train`` builds."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kaisoku.distributed.env import World
from kaisoku.models.zoo import SmallCNN
from kaisoku.optim.recipe import CPU_RECIPE
from kaisoku.parts import UserParts
from kaisoku.presets import get_preset
from kaisoku_bench.kfac import case_rows, seed_figures, time_goal
from kaisoku_bench.kfac_runs import (
    FAILED_SCORE,
    FULL_PLAN,
    METHODS,
    QUICK_PLAN,
    RESNET_PLAN,
    method_config,
    procedure,
    race_score,
    unreached_score,
    vouched_inside,
)
from kaisoku_bench.largebatch import RECIPE, ablations, methods
from kaisoku_bench.training import (
    EngineRun,
    bench_config,
    crossing,
    first_crossing,
    npz_splits,
    tune,
    tune_pair,
)


def test_tune_extends_the_grid_until_the_best_is_inside() -> None:
    tried: list[float] = []

    def score(value: float) -> float:  # best at 0.025, below the grid
        tried.append(value)
        return -abs(value - 0.025)

    best, points, inside = tune((0.1, 0.2, 0.4), score, extend_limit=4)
    assert best == pytest.approx(0.025) and inside
    # Down to the best, then one more point below its lower neighbour: the fall-off needs two points.
    assert tried == pytest.approx([0.1, 0.2, 0.4, 0.05, 0.025, 0.0125, 0.00625])
    assert [p["setting"] for p in points] == sorted(tried)
    # One extension fewer: the best has a tried lower neighbour but no second point below it.
    assert tune((0.1, 0.2, 0.4), score, extend_limit=3)[2] is False


def test_tune_reports_an_edge_it_could_not_leave() -> None:
    best, points, inside = tune((1.0, 2.0), lambda value: value, extend_limit=1)
    assert (best, inside, len(points)) == (4.0, False, 3)
    single = tune((1.0,), lambda value: value, extend_limit=4)
    assert single[2] is False and len(single[1]) == 1  # one point is never "inside"


def test_tune_does_not_take_a_single_non_monotone_point_for_an_interior_optimum() -> None:
    # The Nesterov-at-64x shape: 0.8 -> 60%, 1.6 -> 77%, 3.2 and up diverge; the true best is far lower.
    curve = {0.025: 0.90, 0.05: 0.93, 0.1: 0.96, 0.2: 0.95, 0.4: 0.90, 0.8: 0.60, 1.6: 0.77}
    tried: list[float] = []

    def score(value: float) -> float:
        tried.append(value)
        return curve.get(value, -1.0)

    best, _, inside = tune((0.8, 1.6, 3.2), score, extend_limit=8, failed_score=-1.0)
    assert best == pytest.approx(0.1) and inside
    assert 0.4 in tried and 0.025 in tried  # the lower side was explored past the single dip at 0.8
    assert all(value <= 3.2 for value in tried)  # a diverged higher neighbour settles its side
    # Without the room to look lower, the same grid is reported on an edge, not inside.
    best, _, inside = tune((0.8, 1.6, 3.2), score, extend_limit=0, failed_score=-1.0)
    assert (best, inside) == (1.6, False)


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


def test_kfac_methods_are_engine_configs(tmp_path: Path) -> None:
    common = {"seed": 1, "train_samples": 50000, "run_dir": tmp_path}
    kfac = method_config("kfac", 3e-3, 2.0, FULL_PLAN, **common)
    assert kfac.optim.kfac.enabled and kfac.optim.name == "sgd" and kfac.optim.lr == FULL_PLAN.kfac_lr
    assert kfac.optim.kfac.kl_clip == 3e-3 and kfac.optim.kfac.stat_fraction == 0.25
    lars = method_config("lars", 0.4, 2.83, FULL_PLAN, **common)
    assert (lars.optim.name, lars.optim.lr, lars.optim.eta, lars.optim.trust_clip) == (
        "lars",
        0.4,
        0.02,
        True,
    )
    assert not lars.optim.kfac.enabled
    # Every method: 4 warmup steps (of 24 a 2,048-sample epoch has), cosine over its tuned horizon, and
    # the same 4-epoch cap (96 steps) on every run, even where the horizon is longer.
    for cfg, horizon in ((kfac, 2.0), (lars, 2.83)):
        assert cfg.sched.name == "cosine" and cfg.sched.warmup_epochs * 24 == pytest.approx(4)
        assert cfg.train.epochs == horizon and cfg.train.max_steps == 96 and cfg.train.seed == 1


def test_every_method_gets_the_same_tuning_budget_and_a_stated_target() -> None:
    for plan in (FULL_PLAN, RESNET_PLAN):
        # The same number of step-size points for every method, one horizon grid for all, log-spaced.
        assert (
            all(len(plan.grid(method)) == 3 for method in ("sgd", "lars", "kfac")) and len(plan.horizons) == 3
        )
        assert plan.horizons[1] / plan.horizons[0] == pytest.approx(plan.horizons[2] / plan.horizons[1])
        assert plan.tuned and plan.extend_limit >= 2 and 0.0 < plan.target < 1.0
        # The middle horizon runs whole within the cap; the top one and its extensions end by the cap.
        assert plan.horizons[1] < plan.max_epochs <= plan.horizons[-1] * 2
    assert not QUICK_PLAN.tuned and QUICK_PLAN.repeats == 1


def test_tune_pair_tunes_the_step_size_then_the_horizon_scoring_each_pair_once() -> None:
    calls: list[tuple[float, float]] = []

    def score(lr: float, horizon: float) -> float:  # best at lr 0.2, horizon 2
        calls.append((lr, horizon))
        return -abs(math.log2(lr / 0.2)) - abs(math.log2(horizon / 2.0))

    (lr, horizon), points, inside = tune_pair((0.1, 0.2, 0.4), (1.0, 2.0, 4.0), score, extend_limit=2)
    assert (lr, horizon) == (pytest.approx(0.2), pytest.approx(2.0)) and inside == (True, True)
    assert len(calls) == len(set(calls)) == len(points)  # (0.2, 2.0) is shared by both passes
    # The step size at the middle horizon (5 points), then the horizon at lr 0.2 (4 more).
    assert {h for lr_, h in calls if lr_ != 0.2} == {2.0} and len(calls) == 9
    assert [p["score"] for p in points] == [score(p["first"], p["second"]) for p in points]
    # An optimum beyond the horizons' reach is reported on an edge, never inside.
    edge = tune_pair((0.1, 0.2, 0.4), (1.0, 2.0, 4.0), lambda a, b: b - abs(a - 0.2), extend_limit=1)
    assert edge[0][1] == 8.0 and edge[2][1] is False


def _result(reached_epochs: float | None, best: float, diverged: bool = False) -> dict[str, Any]:
    reached = {"epochs": reached_epochs} if reached_epochs is not None else None
    return {"reached": reached, "best_acc": best, "diverged": diverged}


def test_race_score_ranks_reached_runs_by_epochs_then_the_rest_by_their_gap() -> None:
    scores = [
        race_score(_result(1.5, 0.97), 0.96, 4.0),
        race_score(_result(2.5, 0.97), 0.96, 4.0),
        race_score(_result(None, 0.96), 0.96, 4.0),
        race_score(_result(None, 0.90), 0.96, 4.0),
        race_score(_result(None, 0.5, diverged=True), 0.96, 4.0),
    ]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == 5
    assert scores[0] == -1.5 and scores[-1] == FAILED_SCORE
    # Never reached within the cap: below any run that reached it, and failed for the fall-off.
    assert scores[1] > unreached_score(4.0) >= scores[2]


def test_a_tuned_best_that_never_reached_the_target_is_not_inside() -> None:
    details = {
        (0.2, 2.83): {"epochs_to_target": None},  # the step size's pass: nobody reached it at 2.83
        (0.2, 4.0): {"epochs_to_target": 3.1},
        (0.2, 2.0): {"epochs_to_target": None},
    }
    verdict = vouched_inside((True, True), details, 0.2, 4.0, 2.83)
    assert verdict == {"setting": False, "horizon": True}
    details[(0.2, 2.83)] = {"epochs_to_target": 2.5}
    assert vouched_inside((True, True), details, 0.2, 4.0, 2.83) == {"setting": True, "horizon": True}
    assert vouched_inside((True, False), details, 0.2, 4.0, 2.83)["horizon"] is False


def _race_run(
    method: str, repeat: int, step: float | None, wall: float, fb: float, own: float
) -> dict[str, Any]:
    split = {"forward_backward": fb, "optimizer": own}
    reached = {"step": step, "epochs": step / 24, "wall_s": wall, "acc": 0.96} if step else None
    return {
        "method": method,
        "repeat": repeat,
        "reached": reached,
        "step_split_ms": split,
        "diverged": False,
        "final_acc": 0.97,
    }


def _record(lars_reaches: bool = True) -> dict[str, Any]:
    runs = []
    for repeat in range(3):
        # K-FAC's forward/backward measured faster under a lighter load: the common pass removes that.
        runs.append(_race_run("sgd", repeat, 60.0, 21.0, 350.0, 1.0))
        runs.append(_race_run("lars", repeat, 70.0 if lars_reaches else None, 25.0, 360.0, 2.0))
        runs.append(_race_run("kfac", repeat, 30.0, 11.0, 300.0, 80.0))
    inside = {"setting": True, "horizon": True}
    best = {m: {"setting": 0.2, "horizon": 2.0, "inside": inside} for m in ("sgd", "lars", "kfac")}
    return {"runs": runs, "best": best}


def test_time_to_target_takes_the_common_forward_backward_plus_each_methods_own_cost() -> None:
    figures = seed_figures(_record()["runs"])
    # Common pass: the median of 350, 360 and 300 ms; each method adds its own ms per step.
    assert figures["kfac"]["0"]["time_s"] == pytest.approx(30 * (350 + 80) / 1000)
    assert figures["sgd"]["0"]["time_s"] == pytest.approx(60 * (350 + 1) / 1000)
    rows = case_rows(_record(), FULL_PLAN)
    entry = time_goal("kfac_time_to_target_vs_best_mnist", rows, FULL_PLAN, ["sgd", "lars"])
    assert entry["best_peer"] == "sgd" and entry["value"] == pytest.approx(30 * 430 / (60 * 351), abs=1e-4)
    assert entry["met"] is True and "reason" not in entry  # every seed's ratio clears 0.75
    # The measured wall times of the interleaved runs are recorded beside it.
    assert entry["measured_wall_ratio"]["value"] == pytest.approx(11 / 21, abs=1e-4)


def test_a_method_that_never_reaches_the_target_leaves_the_goal_unmet_with_its_name() -> None:
    rows = case_rows(_record(lars_reaches=False), FULL_PLAN)
    lars = next(row for row in rows if row["method"] == "lars")
    assert lars["reached_target"] is False and lars["unreached_seeds"] == [0, 1, 2]
    assert lars["time_s_to_target"] is None  # kept as a row, not dropped
    entry = time_goal("kfac_time_to_target_vs_best_mnist", rows, FULL_PLAN, ["sgd", "lars"])
    assert entry["met"] is False and "lars did not reach the target 95.0%" in entry["reason"]
    assert entry["value"] is not None  # K-FAC against SGD, the peer that reached it, still shown
    # Against SGD alone nothing is missing.
    assert "lars" not in time_goal("kfac_time_to_target_vs_sgd", rows, FULL_PLAN, ["sgd"]).get("reason", "")


def test_largebatch_compares_the_preset_recipe_with_one_change_per_ablation() -> None:
    assert RECIPE.recipe is CPU_RECIPE
    preset = get_preset("cpu-large-batch")
    assert preset.optim.lr == pytest.approx(CPU_RECIPE.lr(2048)) and preset.sched.name == CPU_RECIPE.schedule
    sgd = methods()[0].recipe
    assert (sgd.optimizer, sgd.lr_scaling, sgd.lr(128 * 64)) == ("sgd", "linear", pytest.approx(0.2 * 64))
    for variant in ablations():
        changed = {k for k, v in vars(variant.recipe).items() if vars(CPU_RECIPE)[k] != v}
        assert len(changed) == 1, (variant.name, changed)


def test_engine_run_trains_validates_and_splits_its_time(tmp_path: Path, mnist_path: Path) -> None:
    torch.set_num_threads(1)
    data = npz_splits(mnist_path, {"train": 512, "val": 256, "test": 256})
    assert data["train"].tensors[0].shape == (512, 1, 28, 28)
    assert abs(float(data["train"].tensors[0].mean())) < 0.2  # normalised
    cfg = bench_config(tmp_path / "run", seed=0)
    cfg.data.global_batch, cfg.train.epochs, cfg.optim.lr = 64, 2, 0.05
    cfg.model.name, cfg.model.width = "small-cnn", 4
    run = EngineRun(cfg, World(), UserParts(train_data=data["train"], val_data=data["val"]))
    assert run.steps_per_epoch == 8 and run.total_steps == 16
    assert run.train(5) and run.step == 5
    assert run.train(100) and run.step == 16  # never past the run's end
    val, test = run.accuracy(), run.accuracy(data["test"])
    assert 0.0 <= val <= 1.0 and 0.0 <= test <= 1.0
    split = run.phase_ms_per_step()
    assert set(split) == {"forward_backward", "optimizer"}
    assert sum(split.values()) == pytest.approx(1000 * run.seconds / 16, rel=1e-6)
    model = run.trainer.engine.model
    assert isinstance(model, SmallCNN) and model.features[0][0].out_channels == 4  # the zoo's, at width 4
    run.close()


@pytest.mark.timeout(600)
def test_the_tuned_procedure_runs_end_to_end_on_one_rank(tmp_path: Path, mnist_path: Path) -> None:
    # The full benchmark's path (grids over step size and horizon, then the interleaved races) at a tiny
    # size: --quick runs one setting per method and never tunes.
    torch.set_num_threads(1)
    plan = replace(
        QUICK_PLAN,
        lr_grid=(0.1, 0.2),
        lars_grid=(0.2, 0.4),
        kfac_grid=(1e-3, 3e-3),
        horizons=(1.0, 2.0),
        max_epochs=2,
        eval_every=2,
        repeats=1,
        target=0.3,
        global_batch=128,
        train_limit=512,
        eval_limit=256,
        warmup_steps=1,
        world_size=1,
    )
    assert plan.tuned
    record = procedure(0, 1, tmp_path, asdict(plan), str(mnist_path))
    assert record["complete"] and set(record["best"]) == set(METHODS)
    for method in METHODS:
        points = [p for p in record["grid"] if p["method"] == method]
        # Both step sizes at the middle horizon (2 epochs), then the other horizon at the best one.
        assert len(points) == 3 and {p["horizon"] for p in points} == {1.0, 2.0}
        assert {p["setting"] for p in points} == set(plan.grid(method))  # LARS on its own grid
        best = record["best"][method]
        assert (best["setting"], best["horizon"]) in {(p["setting"], p["horizon"]) for p in points}
        assert best["inside"] == {"setting": False, "horizon": False}  # two points: never inside
        for point in points:
            reached = point["epochs_to_target"] is not None
            assert point["score"] == (-point["epochs_to_target"] if reached else point["score"])
            assert reached or point["score"] <= unreached_score(plan.max_epochs)
    runs = record["runs"]
    assert [r["method"] for r in runs] == list(METHODS) and all(r["order"] == list(METHODS) for r in runs)
    for run in runs:
        assert run["curve"] and run["curve"][-1]["step"] <= 8  # never past the 2-epoch cap
        stop = run["reached"] is not None or run["curve"][-1]["step"] == 8 or run["diverged"]
        assert stop and run["step_split_ms"]["forward_backward"] > 0
    rows = case_rows(record, plan)
    assert [row["method"] for row in rows] == ["sgd", "lars", "kfac"]
    entry = time_goal("kfac_time_to_target_vs_sgd", rows, plan, ["sgd"])
    assert entry["met"] is False and "not tuned" in entry["reason"]  # the two-point grids end on edges
