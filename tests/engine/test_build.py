"""engine/build.py: what build_trainer wires from a config, on one rank (no process group needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kaisoku.config import Config, validate
from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from kaisoku.engine.step import DataParallelStep
from kaisoku.errors import ConfigError
from tests.train_harness import tiny_config


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=64, size=16, val_count=16, workers=1)


def _config(data: Path, run_dir: Path, **overrides: object) -> Config:
    cfg = tiny_config(data, run_dir, **overrides)
    validate(cfg, world_size=1)
    return cfg


def test_one_rank_builds_a_data_parallel_engine_without_ddp(tmp_path: Path, tiny_data: Path) -> None:
    trainer = build_trainer(_config(tiny_data, tmp_path / "run", train__max_steps=5), World())
    engine = trainer.engine
    assert isinstance(engine, DataParallelStep)
    assert not isinstance(engine.wrapped, torch.nn.parallel.DistributedDataParallel)
    assert engine.preconditioner is None
    # 64 samples / batch 16 = 4 steps an epoch; 2 epochs capped by max_steps 5.
    assert trainer.train_sampler.steps_per_epoch == 4
    assert trainer.settings.total_steps == 5
    assert trainer.optimizer is engine.optimizer
    trainer.metrics.close()


def test_the_schedule_spans_the_epochs_even_when_max_steps_stops_early(
    tmp_path: Path, tiny_data: Path
) -> None:
    short = build_trainer(_config(tiny_data, tmp_path / "a", train__max_steps=2), World())
    full = build_trainer(_config(tiny_data, tmp_path / "b"), World())
    for trainer in (short, full):
        for _ in range(2):
            trainer.optimizer.step()  # no gradients yet: moves nothing, keeps torch's call order
            trainer.engine.scheduler.step()
    assert short.optimizer.param_groups[0]["lr"] == full.optimizer.param_groups[0]["lr"]
    short.metrics.close()
    full.metrics.close()


def test_kfac_is_built_in_front_of_the_optimizer_with_the_run_scaler(tmp_path: Path, tiny_data: Path) -> None:
    trainer = build_trainer(_config(tiny_data, tmp_path / "run", optim__kfac__enabled=True), World())
    engine = trainer.engine
    assert isinstance(engine, DataParallelStep)
    assert engine.preconditioner is not None
    assert engine.preconditioner.grad_scaler is engine.precision.scaler
    trainer.metrics.close()


def test_a_pipeline_layout_on_one_rank_is_refused_in_one_line(tmp_path: Path, tiny_data: Path) -> None:
    with pytest.raises(ConfigError, match="needs a world of at least 2 ranks"):
        _config(tiny_data, tmp_path / "run", parallel__pp=2)
