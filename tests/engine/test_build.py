"""engine/build.py: what build_trainer wires from a config, on one rank (no process group needed)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from kaisoku.config import Config
from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from kaisoku.engine.step import DataParallelStep
from kaisoku.errors import ConfigError
from kaisoku.run_facts import check_config
from tests.train_harness import tiny_config


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=64, size=16, val_count=16, workers=1)


def _config(data: Path, run_dir: Path, **overrides: object) -> Config:
    cfg = tiny_config(data, run_dir, **overrides)
    check_config(cfg, 1)
    return cfg


def test_one_rank_builds_a_data_parallel_engine_without_ddp(tmp_path: Path, tiny_data: Path) -> None:
    trainer = build_trainer(_config(tiny_data, tmp_path / "run", train__max_steps=5), World())
    engine = trainer.engine
    assert isinstance(engine, DataParallelStep)
    assert not isinstance(engine.wrapped, torch.nn.parallel.DistributedDataParallel)
    assert engine.preconditioner is None
    # 64 samples / batch 16 = 4 steps an epoch; 2 epochs capped by max_steps 5.
    assert trainer.train_data.steps_per_epoch == 4
    assert trainer.settings.total_steps == 5
    assert trainer.optimizer is engine.optimizer
    trainer.metrics.close()


def test_loader_workers_start_while_the_data_is_built_and_read_what_a_loader_without_workers_reads(
    tmp_path: Path, tiny_data: Path
) -> None:
    """An image folder's training and validation loaders fork their worker processes inside build_trainer,
    before any collective or autograd thread exists, draw nothing from the run's generator doing so, and
    read the same batches as the in-process loaders."""
    before = set(multiprocessing.active_children())
    plain = build_trainer(_config(tiny_data, tmp_path / "plain"), World())
    plain_rng = torch.get_rng_state()
    workers = build_trainer(_config(tiny_data, tmp_path / "workers", data__workers=1), World())
    started = set(multiprocessing.active_children()) - before
    assert len(started) == 2, started  # one worker each for training and validation, none read yet
    assert torch.equal(torch.get_rng_state(), plain_rng)
    assert workers.val_loader is not None and plain.val_loader is not None
    assert len(workers.val_loader) == len(plain.val_loader) == 1
    for _ in range(2):  # the persistent workers serve every pass
        for (a, a_targets), (b, b_targets) in zip(workers.val_loader, plain.val_loader, strict=True):
            assert torch.equal(a, b) and torch.equal(a_targets, b_targets)
    for (a, a_targets), (b, b_targets) in zip(workers.train_data, plain.train_data, strict=True):
        assert torch.equal(a, b) and torch.equal(a_targets, b_targets)
    for trainer in (plain, workers):
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


def test_the_example_batch_has_the_runs_shape_and_targets() -> None:
    """The compile trial and the memory profile run on a batch of the run's shape: volumes with float
    targets for a regression set (a cosmoflow compile trial once built 2-D images and integer labels)."""
    from kaisoku.engine.build import example_batch
    from kaisoku.parts import UserParts
    from kaisoku.run_facts import describe_model
    from kaisoku.run_plan import DataFacts, WorldShape, resolve

    cfg = Config()
    cfg.model.name = "cosmoflow"
    cfg.data.global_batch = 8
    volumes = DataFacts(
        source="packed",
        task="regression",
        sample_shape=(4, 8, 8, 8),
        in_channels=4,
        num_classes=4,
        num_samples=32,
    )
    plan = resolve(cfg, WorldShape(2, 2), volumes, describe_model(cfg, volumes))
    inputs, targets = example_batch(plan, torch.device("cpu"), UserParts())
    assert inputs.shape == (4, 4, 8, 8, 8) and inputs.dtype == torch.float32
    assert targets.shape == (4, 4) and targets.is_floating_point()
    images = resolve(
        Config(),
        WorldShape(2, 2),
        DataFacts(source="packed", num_classes=10, num_samples=640),
        describe_model(Config(), DataFacts(source="packed", num_classes=10)),
    )
    inputs, targets = example_batch(images, torch.device("cpu"), UserParts())
    assert inputs.shape == (64, 3, 24, 24) and targets.dtype == torch.int64 and int(targets.max()) < 10
