"""engine/divergence.py and the trainer's on_nonfinite policies (stop, skip, rollback), on one process."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kaisoku.distributed.env import World
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.engine.divergence import NonFiniteError, NonFiniteGuard, weights_finite
from kaisoku.engine.metrics import MetricsLogger
from kaisoku.engine.step import DataParallelStep, Precision
from kaisoku.engine.trainer import Trainer, TrainSettings
from tests.engine.test_trainer import ListSampler, _batches
from tests.train_harness import metric_lines


class Scale(nn.Module):
    """Multiplies by a plain float: NaN there poisons the step's loss and gradients, not the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Scale(), nn.ReLU(), nn.Linear(16, 3))


def _trainer(tmp_path: Path, model: nn.Sequential, poison: dict[int, float], **settings: Any) -> Trainer:
    """A trainer whose Scale factor is set to poison[step] after that step (NaN spoils the next one)."""
    device = torch.device("cpu")
    guard = NonFiniteGuard(model, device, every_step=settings.get("on_nonfinite") == "skip")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    engine = DataParallelStep(
        model,
        optimizer,
        scheduler,
        loss_fn=nn.CrossEntropyLoss(),
        precision=Precision("fp32", device),
        guard=guard,
    )
    sampler = ListSampler(_batches(4))

    def on_step(step: int) -> None:
        if step in poison:
            model[2].factor = poison.pop(step)  # one shot: a replay after a rollback runs clean

    return Trainer(
        engine=engine,
        precision=engine.precision,
        train_data=sampler,  # type: ignore[arg-type]
        val_loader=None,
        settings=TrainSettings(global_batch=8, mean=(0.5,), std=(0.25,), **settings),
        world=World(),
        device=device,
        metrics=MetricsLogger(tmp_path, enabled=True, total_steps=8, progress=False, tensorboard=False),
        checkpoints=CheckpointManager(tmp_path / "checkpoints", keep=3),
        on_step=on_step,
        guard=guard,
    )


def test_the_guard_names_the_first_step_and_parameter_and_syncs_only_when_checked() -> None:
    model = _model()
    guard = NonFiniteGuard(model, torch.device("cpu"))
    for step, bad in ((1, False), (2, True), (3, True)):
        guard.step = step
        for p in model.parameters():
            p.grad = torch.full_like(p, math.nan if bad and p.ndim == 1 else 1.0)
        guard.observe_grads()
    found = guard.check()
    assert found is not None and (found.step, found.where) == (2, "1.bias")
    guard.reset()
    assert guard.check() is None
    assert bool(weights_finite(model))
    with torch.no_grad():
        model[4].weight[0, 0] = math.inf
    assert not bool(weights_finite(model))


def test_stop_raises_with_the_step_and_layer_and_writes_no_checkpoint_after_it(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, _model(), {3: math.nan}, total_steps=8, log_every=2, checkpoint_every=2)
    with pytest.raises(NonFiniteError, match=r"the gradient of 1\.weight went non-finite at step 4"):
        trainer.fit()
    trainer.metrics.close()
    assert [p.name for p in trainer.checkpoints.list()] == ["step-00000002.pt"]  # type: ignore[union-attr]
    loss_line = [r for r in metric_lines(tmp_path) if r.get("step") == 4 and "lr" in r][0]
    assert loss_line["loss"] is None and loss_line["nonfinite"] == ["loss"]


def test_skip_drops_non_finite_steps_counts_them_and_stops_after_k_in_a_row(tmp_path: Path) -> None:
    model = _model()
    trainer = _trainer(
        tmp_path / "a", model, {3: math.nan, 5: 1.0}, total_steps=8, log_every=2, on_nonfinite="skip"
    )
    summary = trainer.fit()
    trainer.metrics.close()
    assert summary["skipped_steps"] == 2 and summary["steps"] == 8
    assert bool(weights_finite(model))

    stuck = _trainer(tmp_path / "b", _model(), {2: math.nan}, total_steps=8, on_nonfinite="skip", max_skips=3)
    with pytest.raises(NonFiniteError, match="3 consecutive steps up to step 5"):
        stuck.fit()
    stuck.metrics.close()


def test_rollback_reloads_the_newest_checkpoint_and_halves_the_learning_rate(tmp_path: Path) -> None:
    trainer = _trainer(
        tmp_path, _model(), {4: math.nan, 5: 1.0}, total_steps=8, log_every=2, checkpoint_every=2,
        on_nonfinite="rollback",
    )  # fmt: skip
    summary = trainer.fit()
    trainer.metrics.close()
    assert summary["rollbacks"] == 1 and summary["steps"] == 8
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    events = [r for r in metric_lines(tmp_path) if r.get("event") == "rollback"]
    assert [(e["step"], e["from_step"], e["nonfinite_step"], e["lr_scale"]) for e in events] == [
        (4, 6, 5, 0.5)
    ]
    newest = CheckpointManager.load(trainer.checkpoints.list()[-1])  # type: ignore[union-attr]
    assert newest["step"] == 8 and newest["nonfinite"]["lr_scale"] == 0.5
    assert all(t.isfinite().all() for t in newest["model"].values())
