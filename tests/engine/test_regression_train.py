"""Regression from `kaisoku train`: CosmoFlow on packed universes with 2 ranks, MSE and MAE per target, also
split into a 2-stage pipeline, and (the cosmoflow-cpu preset, with dropout) resumed mid-run equal to the run
that never stopped; a dataset that does not fit the model or the loss is refused in one line before training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kaisoku.config import Config, apply_override
from kaisoku.data.cosmo import universe_arrays
from kaisoku.data.datagen import generate
from kaisoku.data.shards.writer import pack
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from kaisoku.errors import ConfigError
from kaisoku.optim.schedules import schedule_factor
from kaisoku.presets import get_preset
from kaisoku.run_facts import check_config
from tests.dist_harness import run_ranks
from tests.train_harness import cosmoflow_tiny_config, train_env


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cosmo")
    x, y = universe_arrays(32, 8, seed=0)
    xv, yv = universe_arrays(8, 8, seed=0, split="val")
    np.savez(root / "cosmo.npz", x_train=x, y_train=y, x_val=xv, y_val=yv)
    pack(root / "cosmo.npz", root / "packed", codec="delta", workers=1, progress=False)
    return root / "packed"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cosmoflow_trains_on_two_ranks_with_mse_and_mae(tmp_path: Path, volumes: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "kaisoku", "train", "--preset", "cosmoflow-cpu",
         "--nproc", "2", "--run-dir", str(run_dir), "--data.path", str(volumes),
         "--data.image-size", "8", "--data.global-batch", "8", "--data.workers", "0",
         "--model.width", "4", "--train.epochs", "1", "--train.log-every", "1",
         "--metrics.progress", "false"],
        capture_output=True, text=True, timeout=240, env=train_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # 32 samples / batch 8
    assert all(np.isfinite(r["loss"]) for r in steps)
    validation = [r for r in lines if r.get("event") == "validation"][-1]
    assert validation["val_samples"] == 8
    assert "val_accuracy" not in validation
    maes = [validation[f"val_mae_{k}"] for k in range(4)]
    assert all(0 < m < 2.2 for m in maes) and validation["val_mae"] == pytest.approx(sum(maes) / 4)
    assert "MAE" in result.stdout


def _cfg(**fields: object) -> Config:
    cfg = Config()
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_data_that_does_not_fit_is_one_line_naming_both_sides(tmp_path: Path, volumes: Path) -> None:
    images = generate(tmp_path / "shapes", count=10, size=8, val_count=10, workers=1)
    with pytest.raises(ConfigError, match=r"model.name cosmoflow takes volumes .* holds 2D images") as error:
        check_config(_cfg(model__name="cosmoflow", data__path=str(images)))
    assert "\n" not in str(error.value)
    with pytest.raises(
        ConfigError, match=r"holds volumes \[4, 8, 8, 8\] \(regression\), but model.name resnet10"
    ):
        check_config(_cfg(data__path=str(volumes)))
    with pytest.raises(ConfigError, match="train.loss cross-entropy does not fit"):
        check_config(_cfg(model__name="cosmoflow", data__path=str(volumes), train__loss="cross-entropy"))
    with pytest.raises(ConfigError, match="train.loss mse does not fit"):
        check_config(_cfg(data__path=str(images), train__loss="mse"))
    with pytest.raises(ConfigError, match="label_smoothing"):
        check_config(_cfg(model__name="cosmoflow", data__path=str(volumes), train__label_smoothing=0.1))
    check_config(_cfg(model__name="cosmoflow", data__path=str(volumes), data__global_batch=8))  # fits


def test_reference_preset_schedule_decays_at_epochs_32_and_64() -> None:
    cfg = get_preset("cosmoflow")
    assert cfg.optim.lr == pytest.approx(0.001 * cfg.data.global_batch / 64)
    assert cfg.data.global_batch % 4 == 0 and cfg.optim.momentum == 0.9
    per_epoch = 10
    factor = schedule_factor(
        "step",
        total_steps=int(cfg.train.epochs) * per_epoch,
        warmup_steps=int(cfg.sched.warmup_epochs) * per_epoch,
        step_milestones=cfg.sched.step_milestones,
        step_factors=cfg.sched.step_factors,
    )
    assert factor(0) == pytest.approx(1 / 40)  # warming up over 4 epochs
    assert factor(31 * per_epoch) == 1.0
    assert factor(32 * per_epoch) == 0.25
    assert factor(64 * per_epoch) == 0.125
    assert factor(127 * per_epoch) == 0.125


def _train_pipeline(rank: int, world_size: int, tmp: Path, data: Path) -> dict[str, Any]:
    cfg = cosmoflow_tiny_config(
        data,
        tmp / "run",
        train__max_steps=2,
        train__log_every=1,
        parallel__pp=2,
        parallel__microbatches=2,
    )
    trainer = build_trainer(cfg, World(rank=rank, world_size=world_size, local_world_size=world_size))
    before = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    summary = trainer.fit()
    trainer.metrics.close()
    after = trainer.unwrapped.state_dict()
    return {
        "summary": summary,
        "changed": sorted(k for k, v in after.items() if not torch.equal(v, before[k])),
        "model": {k: v.clone() for k, v in after.items()},
    }


@pytest.mark.timeout(120)
def test_cosmoflow_trains_as_a_two_stage_pipeline(tmp_path: Path, volumes: Path) -> None:
    first, second = run_ranks(_train_pipeline, 2, tmp_path, volumes)
    assert first["summary"]["steps"] == 2
    assert np.isfinite(first["summary"]["final_loss"])
    assert 0 < first["summary"]["val_mae"] < 2.2  # regression: validated by MAE on the [-1, 1] targets
    # Gathered from both stages, each rank holds the same whole model, and both stages' weights moved.
    assert first["model"].keys() == second["model"].keys()
    assert all(torch.equal(first["model"][k], second["model"][k]) for k in first["model"])
    convs = [k for k in first["changed"] if k.endswith("weight") and first["model"][k].dim() == 5]
    linears = [k for k in first["changed"] if k.endswith("weight") and first["model"][k].dim() == 2]
    assert convs and linears
    (metrics,) = tmp_path.rglob("run/metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert next(r for r in records if r.get("event") == "start")["parallel"] == "pp2:0-"


def _preset_config(data: Path, run_dir: Path, **overrides: object) -> Config:
    """The cosmoflow-cpu preset (dropout 0.5 after both hidden dense layers, one loader worker) on the tiny
    volumes: 4 steps per epoch, 3 epochs, a checkpoint every 2 steps."""
    cfg = get_preset("cosmoflow-cpu")
    cfg.run_dir = str(run_dir)
    settings: dict[str, object] = {
        "data.path": str(data), "data.image_size": 8, "data.global_batch": 8, "model.width": 4,
        "train.epochs": 3, "checkpoint.every_steps": 2, "metrics.progress": False,
    }  # fmt: skip
    for key, value in {**settings, **overrides}.items():
        apply_override(cfg, key.replace("__", "."), value)
    return cfg


def _fit(cfg: Config, world: World, resume: str = "") -> int:
    """Train ``cfg`` to its end; the step it started from."""
    trainer = build_trainer(cfg, world, resume=resume)
    start = trainer.state.step
    trainer.fit()
    trainer.metrics.close()
    return start


def _whole_and_resumed(rank: int, world_size: int, tmp: Path, data: Path) -> tuple[int, Path]:
    world = World(rank=rank, world_size=world_size, local_world_size=world_size)
    _fit(_preset_config(data, tmp / "whole"), world)
    # Stopped mid-epoch after the step-6 checkpoint, then resumed by a new trainer: the epoch boundary
    # and validation after the resume are where the resumed run's random numbers used to part.
    _fit(_preset_config(data, tmp / "split", train__max_steps=6), world)
    return _fit(_preset_config(data, tmp / "split", checkpoint__resume="auto"), world, "auto"), tmp


@pytest.mark.timeout(300)
def test_cosmoflow_with_dropout_resumed_from_its_own_checkpoint_equals_the_uninterrupted_run(
    tmp_path: Path, volumes: Path
) -> None:
    results = run_ranks(_whole_and_resumed, 2, tmp_path, volumes, timeout=240)
    assert [start for start, _ in results] == [6, 6]
    root = results[0][1]
    whole, split = (
        torch.load(root / run / "checkpoints" / "step-00000012.pt", weights_only=True)
        for run in ("whole", "split")
    )
    for part in ("model", "optimizer", "rng"):
        expected, got = _tensors(whole[part]), _tensors(split[part])
        assert expected.keys() == got.keys() and expected
        assert [name for name in expected if not torch.equal(expected[name], got[name])] == [], part


def _tensors(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested dict/list, by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{prefix}/{key}").items()}
