"""Parameter groups, the optimizer registry and the scheduler, built from config."""

from __future__ import annotations

import math
import typing

import pytest
import torch
from torch import nn

from kaisoku.config import OptimConfig, SchedConfig
from kaisoku.errors import ConfigError
from kaisoku.optim import LAMB, LARS, OPTIMIZERS, build_optimizer, build_scheduler, param_groups


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.fc(self.bn(self.conv(x)).mean((2, 3))))


def names(group: dict) -> list[str]:
    return group["param_names"] if "param_names" in group else [n for n, _ in group["params"]]


def test_param_groups_split_bn_and_bias_from_weights() -> None:
    groups = param_groups(Net(), weight_decay=1e-4, no_decay_bn_bias=True)
    assert [names(g) for g in groups] == [["conv.weight", "fc.weight"], ["bn.weight", "bn.bias", "fc.bias"]]
    assert [g["weight_decay"] for g in groups] == [1e-4, 0.0]
    assert [g["lars_exclude"] for g in groups] == [False, True]


def test_param_groups_without_split_and_with_exclusions() -> None:
    (single,) = param_groups(Net(), weight_decay=1e-4, no_decay_bn_bias=False)
    assert names(single) == ["conv.weight", "bn.weight", "bn.bias", "fc.weight", "fc.bias"]
    by_pattern = param_groups(Net(), weight_decay=1e-4, no_decay_bn_bias=False, exclude=["fc.*"])
    assert [names(g) for g in by_pattern] == [
        ["conv.weight", "bn.weight", "bn.bias"],
        ["fc.weight", "fc.bias"],
    ]
    by_predicate = param_groups(
        Net(), weight_decay=1e-4, no_decay_bn_bias=True, exclude=lambda name, p: name.startswith("conv")
    )
    assert [names(g) for g in by_predicate] == [
        ["fc.weight"],
        ["conv.weight", "bn.weight", "bn.bias", "fc.bias"],
    ]


def test_registry_covers_every_configurable_name() -> None:
    configurable = typing.get_args(typing.get_type_hints(OptimConfig)["name"])
    assert set(configurable) <= set(OPTIMIZERS)


@pytest.mark.parametrize(
    ("name", "cls"),
    [("sgd", torch.optim.SGD), ("lars", LARS), ("adamw", torch.optim.AdamW), ("lamb", LAMB)],
)
def test_build_optimizer(name: str, cls: type) -> None:
    cfg = OptimConfig(name=name, lr=0.3, momentum=0.8, weight_decay=1e-3, eta=0.02, trust_clip=True)
    optimizer = build_optimizer(Net(), cfg)
    assert type(optimizer) is cls
    decay, no_decay = optimizer.param_groups
    assert decay["lr"] == no_decay["lr"] == 0.3
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (1e-3, 0.0)
    assert len(decay["params"]) == 2 and len(no_decay["params"]) == 3
    if name in ("sgd", "lars"):
        assert decay["momentum"] == 0.8
    if name == "lars":
        assert (decay["eta"], decay["trust_clip"], decay["eps"]) == (0.02, True, cfg.eps)
        assert (decay["lars_exclude"], no_decay["lars_exclude"]) == (False, True)
    if name in ("adamw", "lamb"):
        assert decay["betas"] == (0.8, 0.999)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(eta=-0.1), "optim.eta"),
        (dict(lr=-0.1), "optim.lr"),
        (dict(momentum=1.0), "optim.momentum"),
        (dict(weight_decay=-1.0), "optim.weight_decay"),
        (dict(nesterov=True, momentum=0.0), "optim.nesterov"),
    ],
)
def test_bad_optim_config_names_the_field(changes: dict, field: str) -> None:
    cfg = OptimConfig(name="lars", **changes)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_optimizer(Net(), cfg)


def test_build_scheduler_arccot_by_fractions_of_the_run() -> None:
    optimizer = build_optimizer(Net(), OptimConfig(name="lars", lr=2.0))
    cfg = SchedConfig(name="arccot", warmup_epochs=1.0, arccot_center=0.5, arccot_slope=10.0)
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch=10, total_steps=100)
    lrs = []
    for _ in range(100):
        lrs.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert all(a == b for a, b in lrs)  # every group follows the same curve
    first = [a for a, _ in lrs]
    at_warmup_end = 2.0 * (math.pi / 2 - math.atan(10 * (0.1 - 0.5))) / math.pi
    assert first[0] == pytest.approx(at_warmup_end / 10)
    assert first[9] == pytest.approx(at_warmup_end)
    assert first[50] == pytest.approx(1.0)
    assert first[99] < 0.15


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(warmup_epochs=10.0), "sched.warmup_epochs"),
        (dict(min_lr_ratio=1.5), "sched.min_lr_ratio"),
        (dict(name="arccot", arccot_slope=0.0), "sched.arccot_slope"),
        (dict(name="step", step_milestones=[0.5, 2.0]), "sched.step_milestones"),
    ],
)
def test_bad_sched_config_names_the_field(changes: dict, field: str) -> None:
    optimizer = build_optimizer(Net(), OptimConfig())
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_scheduler(optimizer, SchedConfig(**changes), steps_per_epoch=10, total_steps=100)


def test_recipe_trains() -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = build_optimizer(model, OptimConfig(name="lars", lr=1.0, eta=0.02, weight_decay=5e-4))
    scheduler = build_scheduler(
        optimizer, SchedConfig(name="arccot", warmup_epochs=1.0), steps_per_epoch=5, total_steps=40
    )
    x = torch.randn(16, 3, 6, 6)
    y = torch.randint(0, 2, (16,))
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y, label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def test_build_optimizer_from_named_parameters_of_a_part() -> None:
    from kaisoku.optim.factory import build_optimizer_from_named

    model = Net()
    stage = [(name, p) for name, p in model.named_parameters() if name.startswith(("bn.", "fc."))]
    optimizer = build_optimizer_from_named(stage, OptimConfig(name="lars", weight_decay=1e-3))
    assert [names(g) for g in optimizer.param_groups] == [["fc.weight"], ["bn.weight", "bn.bias", "fc.bias"]]
    with pytest.raises(ConfigError, match="trainable"):
        build_optimizer_from_named(list(model.frozen.named_parameters()), OptimConfig())


def test_build_optimizer_names_a_frozen_model_and_checks_config_first() -> None:
    frozen = Net().requires_grad_(False)
    with pytest.raises(ConfigError, match="the model has no trainable parameters for the optimizer"):
        build_optimizer(frozen, OptimConfig())
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        build_optimizer(frozen, OptimConfig(lr=-1.0))


def test_build_optimizer_equals_building_from_the_models_named_parameters() -> None:
    from kaisoku.optim.factory import build_optimizer_from_named

    model = Net()
    cfg = OptimConfig(name="lars", weight_decay=1e-3)
    whole = build_optimizer(model, cfg, exclude=["fc.*"])
    named = build_optimizer_from_named(model.named_parameters(), cfg, exclude=["fc.*"])
    assert type(whole) is type(named)
    assert [names(g) for g in whole.param_groups] == [names(g) for g in named.param_groups]
    assert [names(g) for g in whole.param_groups] == [
        ["conv.weight"],
        ["bn.weight", "bn.bias", "fc.weight", "fc.bias"],
    ]
    strip = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in whole.param_groups]
    assert strip == [
        {k: v for k, v in g.items() if k not in ("params", "param_names")} for g in named.param_groups
    ]
