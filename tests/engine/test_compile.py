"""``train.compile``: compiled model and optimizer step agree with eager ones; refusals are one line."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from kaisoku.config import Config
from kaisoku.engine.compile import compile_conflict, compile_for_training, synthetic_batch
from kaisoku.errors import ConfigError
from kaisoku.optim import LARS
from kaisoku.optim.schedules import WarmupSchedule
from kaisoku.run_facts import check_config


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def run_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    scheduler = WarmupSchedule(optimizer, lambda step: 1.0 / (1 + step))  # lr changes every step
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        images, labels = synthetic_batch((8, 3, 2, 2), 3, torch.device("cpu"), seed=step)
        loss_fn(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4),
        lambda params: LARS(params, lr=0.1, eta=0.02, weight_decay=1e-4),
    ],
    ids=["sgd", "lars"],
)
def test_compiled_model_and_step_match_eager(make) -> None:
    eager_model, compiled_model = tiny_model(), tiny_model()
    eager, compiled = make(eager_model.parameters()), make(compiled_model.parameters())
    report = compile_for_training(
        "all",
        compiled_model,
        compiled,
        loss_fn=nn.CrossEntropyLoss(),
        batch=synthetic_batch((8, 3, 2, 2), 3, torch.device("cpu"), seed=9),
        autocast=contextlib.nullcontext,
    )
    assert report.mode == "all" and report.compile_seconds >= 0
    assert report.line("all").startswith("compile: all; compile time ")
    # The trial ran on copies: the run's model is where it started.
    for p, q in zip(tiny_model().parameters(), compiled_model.parameters()):
        assert torch.equal(p, q)
    run_steps(eager_model, eager, 4)
    run_steps(compiled_model, compiled, 4)
    for p, q in zip(eager_model.state_dict().values(), compiled_model.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # Keys stay those of the eager model (checkpoints interchangeable); learning rates stay numbers.
    assert list(compiled_model.state_dict()) == list(eager_model.state_dict())
    assert all(isinstance(group["lr"], float) for group in compiled.param_groups)


def test_auto_keeps_one_way_and_says_which() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    asked: list[str] = []
    report = compile_for_training(
        "auto",
        model,
        optimizer,
        loss_fn=nn.CrossEntropyLoss(),
        batch=synthetic_batch((8, 3, 2, 2), 3, torch.device("cpu"), seed=1),
        autocast=contextlib.nullcontext,
        decide=lambda choice: asked.append(choice) or choice,
    )
    assert report.mode in ("off", "all") and asked == [report.mode]
    assert report.eager_step_seconds is not None and report.compiled_step_seconds is not None
    assert report.line("auto").startswith(f"compile auto: kept {report.mode} (step ")


def test_conflicts_are_refused_in_one_line() -> None:
    assert compile_conflict("off", hybrid=True, kfac=True) is None
    assert compile_conflict("optimizer", hybrid=False, kfac=True) is None
    assert "pipeline" in (compile_conflict("auto", hybrid=True, kfac=False) or "")
    cfg = Config()
    cfg.optim.kfac.enabled = True
    cfg.train.compile = "model"
    with pytest.raises(
        ConfigError, match="train.compile=model does not work with optim.kfac.enabled"
    ) as info:
        check_config(cfg)
    assert "\n" not in str(info.value)
    cfg = copy.deepcopy(cfg)
    cfg.train.compile = "sometimes"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="train.compile must be"):
        check_config(cfg)
