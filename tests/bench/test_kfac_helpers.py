"""The accuracy benchmarks' shared parts: grid extension, interpolated time to target, the configs each
method trains with, and a run through the engine ``kaisoku train`` builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kaisoku.bench.kfac import FULL_PLAN, method_config
from kaisoku.bench.largebatch import RECIPE, ablations, methods
from kaisoku.bench.training import (
    EngineRun,
    bench_config,
    crossing,
    first_crossing,
    npz_splits,
    tune,
)
from kaisoku.distributed.env import World
from kaisoku.models.zoo import SmallCNN
from kaisoku.optim.recipe import CPU_RECIPE
from kaisoku.parts import UserParts
from kaisoku.presets import get_preset


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
    kfac = method_config("kfac", 3e-3, FULL_PLAN, **common)
    assert kfac.optim.kfac.enabled and kfac.optim.name == "sgd" and kfac.optim.lr == FULL_PLAN.kfac_lr
    assert kfac.optim.kfac.kl_clip == 3e-3 and kfac.optim.kfac.stat_fraction == 0.25
    lars = method_config("lars", 0.4, FULL_PLAN, **common)
    assert (lars.optim.name, lars.optim.lr, lars.optim.eta, lars.optim.trust_clip) == (
        "lars",
        0.4,
        0.02,
        True,
    )
    assert not lars.optim.kfac.enabled
    # Every method: 4 warmup steps (of 24 a 2,048-sample epoch has) then cosine over the 4-epoch cap.
    for cfg in (kfac, lars):
        assert cfg.sched.name == "cosine" and cfg.sched.warmup_epochs * 24 == pytest.approx(4)
        assert cfg.train.epochs == 4 and cfg.train.seed == 1


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
