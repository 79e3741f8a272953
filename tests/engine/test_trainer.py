"""engine/trainer.py: the loop over a step engine, on one process with real models and data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kaisoku.distributed.env import World
from kaisoku.distributed.layout import ParallelLayout
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.engine.metrics import MetricsLogger
from kaisoku.engine.step import DataParallelStep, MicroBatches, Precision
from kaisoku.engine.trainer import Trainer, TrainSettings, seed_step, step_seed


class ListSampler:
    """A deterministic epoch sampler over an in-memory list of batches (what the trainer needs of one)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches
        self.steps_per_epoch = len(batches)
        self.epoch = 0
        self.start = 0
        self.last_quality = None

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start = epoch, start_step

    def __iter__(self):  # noqa: ANN204
        return iter(self.batches[self.start :])

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.start = state["epoch"], state["start"]

    def set_shard(self, shard: int, shards: int) -> None:
        raise AssertionError("a data-parallel run never changes its shard")

    def epoch_stats(self) -> None:
        return None

    def close(self) -> None:
        pass


def _batches(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """uint8 NCHW images and labels, as the loaders yield them."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (8, 1, 8, 8), generator=generator, dtype=torch.uint8),
            torch.randint(0, 3, (8,), generator=generator),
        )
        for _ in range(count)
    ]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))


def _trainer(tmp_path: Path, engine: Any, sampler: ListSampler, total_steps: int, **settings: Any) -> Trainer:
    precision = Precision("fp32", torch.device("cpu"))
    return Trainer(
        engine=engine,
        precision=precision,
        train_data=sampler,  # type: ignore[arg-type]
        val_loader=_batches(2, seed=1),  # type: ignore[arg-type]
        settings=TrainSettings(total_steps=total_steps, global_batch=8, mean=(0.5,), std=(0.25,), **settings),
        world=World(),
        device=torch.device("cpu"),
        metrics=MetricsLogger(
            tmp_path, enabled=True, total_steps=total_steps, progress=False, tensorboard=False
        ),
        checkpoints=CheckpointManager(tmp_path / "checkpoints", keep=2),
    )


def _data_parallel_engine(model: nn.Module) -> DataParallelStep:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return DataParallelStep(
        model,
        optimizer,
        scheduler,
        loss_fn=nn.CrossEntropyLoss(),
        precision=Precision("fp32", torch.device("cpu")),
    )


def test_fit_runs_every_step_validates_and_checkpoints_each_epoch(tmp_path: Path) -> None:
    sampler = ListSampler(_batches(4))
    trainer = _trainer(tmp_path, _data_parallel_engine(_model()), sampler, total_steps=8, log_every=2)
    summary = trainer.fit()
    trainer.metrics.close()
    assert summary["steps"] == 8 and summary["epochs"] == 2.0
    assert 0.0 <= summary["val_accuracy"] <= 1.0 and summary["val_samples"] == 16
    assert trainer.state.epoch == 2 and trainer.state.step_in_epoch == 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [2, 4, 6, 8]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*.pt")) == [
        "step-00000004.pt",
        "step-00000008.pt",
    ]


def test_accumulated_micro_batches_equal_one_big_batch() -> None:
    batches = [(images.float() / 255, labels) for images, labels in _batches(2)]
    whole = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    a, b = _model(), _model()
    engine_a, engine_b = _data_parallel_engine(a), _data_parallel_engine(b)
    loss_a = engine_a.train_step(batches)
    loss_b = engine_b.train_step([whole])
    torch.testing.assert_close(loss_a, loss_b)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)


def test_checkpoint_round_trip_resumes_exactly(tmp_path: Path) -> None:
    batches = _batches(4)
    straight = _trainer(tmp_path / "a", _data_parallel_engine(_model()), ListSampler(batches), total_steps=6)
    straight.fit()
    straight.metrics.close()

    first = _trainer(tmp_path / "b", _data_parallel_engine(_model()), ListSampler(batches), total_steps=6)
    first.run(3)
    state = first.state_dict()
    first.metrics.close()
    second = _trainer(tmp_path / "c", _data_parallel_engine(_model()), ListSampler(batches), total_steps=6)
    second.load_state_dict(state)
    assert second.state.step == 3 and second.state.step_in_epoch == 3
    second.fit()
    second.metrics.close()
    for pa, pb in zip(straight.unwrapped.parameters(), second.unwrapped.parameters()):
        assert torch.equal(pa, pb)


def test_seed_step_leaves_the_generator_as_torch_manual_seed_does() -> None:
    for step in (0, 1, 1000):
        seed = step_seed(7, step)
        torch.manual_seed(seed)
        expected_state, expected_draw = torch.get_rng_state(), torch.rand(5)
        torch.manual_seed(12345)  # something else first: seed_step must replace it all
        torch.rand(3)
        seed_step(seed, torch.device("cpu"))
        assert torch.equal(torch.get_rng_state(), expected_state)
        assert torch.equal(torch.rand(5), expected_draw)


def test_a_model_with_dropout_resumes_exactly(tmp_path: Path) -> None:
    """Each step draws its dropout masks from (seed, step): the resumed half draws what the whole run drew."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3))

    batches = _batches(4)
    straight = _trainer(tmp_path / "a", _data_parallel_engine(model()), ListSampler(batches), total_steps=6)
    straight.fit()
    straight.metrics.close()
    first = _trainer(tmp_path / "b", _data_parallel_engine(model()), ListSampler(batches), total_steps=6)
    first.run(3)
    state = first.state_dict()
    first.metrics.close()
    second = _trainer(tmp_path / "c", _data_parallel_engine(model()), ListSampler(batches), total_steps=6)
    second.load_state_dict(state)
    torch.rand(100)  # what a loader's start-up draws after the resume
    second.fit()
    second.metrics.close()
    for pa, pb in zip(straight.unwrapped.parameters(), second.unwrapped.parameters()):
        assert torch.equal(pa, pb)


class SwitchingEngine(DataParallelStep):
    """A data-parallel engine that reports a layout change at step 2 (as a switch schedule would)."""

    def __init__(self, model: nn.Module) -> None:
        base = _data_parallel_engine(model)
        super().__init__(
            model, base.optimizer, base.scheduler, loss_fn=base.loss_fn, precision=base.precision
        )
        self.asked: list[tuple[int, int]] = []

    def train_step(self, micro_batches: MicroBatches) -> torch.Tensor:
        self.seen = micro_batches[0][1].clone()
        return super().train_step(micro_batches)

    def switch_for(self, epoch: int, step: int) -> ParallelLayout | None:
        self.asked.append((epoch, step))
        return ParallelLayout(dp=1, pp=1) if step == 2 else None


def test_a_layout_switch_restarts_the_data_pass_at_the_same_position(tmp_path: Path) -> None:
    batches = _batches(4)
    engine = SwitchingEngine(_model())
    sampler = ListSampler(batches)
    trainer = _trainer(tmp_path, engine, sampler, total_steps=3)
    trainer.run(3)
    trainer.metrics.close()
    assert engine.asked == [(0, 0), (0, 1), (0, 2)]
    # After the switch the sampler was pointed at step 2 of epoch 0 again, and batch 2 was trained on.
    assert (sampler.epoch, sampler.start) == (0, 2)
    assert torch.equal(engine.seen, batches[2][1])
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "switch" and e["step"] == 2 for e in events)
