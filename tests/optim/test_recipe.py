"""The large-batch recipe call builds exactly the groups, schedule, loss and initialisation it documents."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kaisoku.config import OptimConfig
from kaisoku.errors import ConfigError
from kaisoku.models.zoo import build_model
from kaisoku.optim import LAMB, LARS, build_optimizer
from kaisoku.optim.recipe import (
    count_parameters,
    default_warmup_epochs,
    large_batch,
    large_batch_kfac,
    lars_eta,
    zero_init_last_bn,
)


def resnet() -> nn.Module:
    torch.manual_seed(0)
    return build_model("resnet10", num_classes=10, stem="small", zero_init_residual=False)


def test_groups_lr_eta_and_loss() -> None:
    model = resnet()
    optimizer, scheduler, loss_fn = large_batch(
        model, base_lr=0.1, batch=4096, epochs=8, steps_per_epoch=10, weight_decay=1e-4
    )
    assert isinstance(optimizer, LARS)
    decay, no_decay = optimizer.param_groups
    assert all(p.ndim > 1 for p in decay["params"]) and decay["weight_decay"] == 1e-4
    assert not decay["lars_exclude"]
    assert all(p.ndim <= 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert no_decay["lars_exclude"]
    names = set(decay["param_names"]) | set(no_decay["param_names"])
    assert names == {name for name, _ in model.named_parameters()}
    # sqrt scaling: 0.1 * sqrt(4096 / 256) = 0.4 at the peak; eta by the size rule.
    assert decay["initial_lr"] == pytest.approx(0.4)
    assert decay["eta"] == pytest.approx(lars_eta(count_parameters(model)))
    assert isinstance(loss_fn, nn.CrossEntropyLoss) and loss_fn.label_smoothing == 0.1
    assert scheduler.optimizer is optimizer


def test_schedule_is_warmup_then_poly_decay() -> None:
    model = resnet()
    optimizer, scheduler, _ = large_batch(model, base_lr=0.1, batch=1024, epochs=10, steps_per_epoch=20)
    warmup_steps = round(default_warmup_epochs(1024, 256, 10) * 20)
    assert warmup_steps == 20  # 0.5 * log2(4) = 1 epoch
    peak = 0.1 * 2
    lrs = []
    for _ in range(200):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(peak / warmup_steps)
    assert lrs[warmup_steps - 1] == pytest.approx(peak)
    assert all(a < b for a, b in zip(lrs[: warmup_steps - 1], lrs[1:warmup_steps]))
    # Poly power 2 after warmup: peak * (1 - progress) ** 2.
    step = 110
    progress = (step - warmup_steps) / (200 - warmup_steps)
    assert lrs[step] == pytest.approx(peak * (1 - progress) ** 2)
    assert lrs[-1] < 1e-3 * peak


def test_linear_scaling_lamb_and_explicit_eta() -> None:
    optimizer, _, _ = large_batch(
        resnet(), base_lr=0.1, batch=512, epochs=2, steps_per_epoch=5, lr_scaling="linear", optimizer="lamb"
    )
    assert isinstance(optimizer, LAMB) and optimizer.param_groups[0]["initial_lr"] == pytest.approx(0.2)
    optimizer, _, _ = large_batch(resnet(), base_lr=0.1, batch=256, epochs=2, steps_per_epoch=5, eta=0.05)
    assert optimizer.param_groups[0]["eta"] == 0.05


def test_zero_init_last_bn_of_residual_blocks_only() -> None:
    model = resnet()
    large_batch(model, base_lr=0.1, batch=256, epochs=1, steps_per_epoch=4)
    for name, module in model.named_modules():
        if name.endswith(".bn2"):
            assert torch.count_nonzero(module.weight) == 0, name
        if name.endswith(".bn1") or name == "bn1":
            assert torch.count_nonzero(module.weight) > 0, name
    assert zero_init_last_bn(build_model("small-cnn", num_classes=10, in_channels=1)) == 0
    assert zero_init_last_bn(resnet()) == 4  # resnet10: one block per stage


def test_eta_rule_values_and_config_zero_uses_it() -> None:
    assert lars_eta(25_600_000) == pytest.approx(0.001)
    assert lars_eta(94_186) == pytest.approx(0.001 * (25.6e6 / 94_186) ** 0.6)
    assert 0.02 <= lars_eta(94_186) <= 0.08
    assert lars_eta(10) == 0.08 and lars_eta(10**9) == 0.001
    model = resnet()
    optimizer = build_optimizer(model, OptimConfig(name="lars", eta=0.0))
    assert optimizer.param_groups[0]["eta"] == pytest.approx(lars_eta(count_parameters(model)))


@pytest.mark.parametrize(
    ("changes", "word"),
    [(dict(base_lr=0.0), "base_lr"), (dict(batch=0), "batch"), (dict(lr_scaling="cube"), "lr_scaling")],
)
def test_bad_arguments_name_themselves(changes: dict, word: str) -> None:
    args = dict(base_lr=0.1, batch=256, epochs=1, steps_per_epoch=4) | changes
    with pytest.raises(ConfigError, match=word):
        large_batch(resnet(), **args)


@pytest.mark.parametrize("factor_dtype", ["float32", "bfloat16"])
def test_kfac_recipe_trains_a_few_steps(factor_dtype: str) -> None:
    torch.manual_seed(0)
    model = build_model("small-cnn", num_classes=10, in_channels=1)
    optimizer, scheduler, loss_fn, kfac = large_batch_kfac(
        model,
        base_lr=0.05,
        batch=64,
        epochs=1,
        steps_per_epoch=6,
        inv_update_steps=2,
        factor_dtype=factor_dtype,
    )
    assert kfac.factor_dtype == factor_dtype
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    losses = []
    for _ in range(6):
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        kfac.step()
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_recipe_config_values_are_what_the_python_call_uses() -> None:
    from kaisoku.config import Config
    from kaisoku.optim.recipe import CPU_RECIPE

    cfg = CPU_RECIPE.apply(Config(), batch=2048, epochs=12)
    # sqrt scaling from 0.2 at batch 128; warmup 0.5 * log2(16) epochs; the recipe's decay and smoothing.
    assert cfg.optim.lr == pytest.approx(0.2 * 4) and cfg.data.global_batch == 2048
    assert (
        cfg.sched.warmup_epochs == pytest.approx(default_warmup_epochs(2048, 128, 12)) == pytest.approx(2.0)
    )
    assert (cfg.optim.name, cfg.optim.eta, cfg.optim.weight_decay) == ("lars", 0.0, 5e-4)
    assert (cfg.sched.name, cfg.sched.arccot_slope, cfg.train.label_smoothing) == ("arccot", 5.0, 0.1)
    # The Python call takes the same peak and warmup from the same numbers.
    model = resnet()
    optimizer, scheduler, loss_fn = large_batch(
        model, base_lr=0.2, base_batch=128, batch=2048, epochs=12, steps_per_epoch=10, schedule="arccot"
    )
    assert optimizer.param_groups[0]["initial_lr"] == pytest.approx(cfg.optim.lr)
    assert loss_fn.label_smoothing == cfg.train.label_smoothing


def test_presets_apply_the_recipe() -> None:
    from kaisoku.optim.recipe import CPU_RECIPE, IMAGENET_RECIPE
    from kaisoku.presets import get_preset

    imagenet = get_preset("resnet50-imagenet-lars")
    assert (imagenet.optim.name, imagenet.optim.lr, imagenet.optim.eta) == ("lars", 29.0, 0.001)
    assert (imagenet.sched.name, imagenet.sched.warmup_epochs, imagenet.sched.poly_power) == (
        "poly",
        5.0,
        2.0,
    )
    assert (imagenet.data.global_batch, imagenet.train.epochs, imagenet.train.label_smoothing) == (
        32768,
        40,
        0.1,
    )
    assert imagenet.optim.lr == IMAGENET_RECIPE.lr(32768)
    cpu = get_preset("cpu-large-batch")
    assert cpu.optim.lr == pytest.approx(CPU_RECIPE.lr(2048)) and cpu.sched.name == CPU_RECIPE.schedule
    assert (cpu.optim.weight_decay, cpu.train.label_smoothing) == (CPU_RECIPE.weight_decay, 0.1)
    assert (cpu.optim.eta, cpu.sched.warmup_epochs) == (0.08, 0.5)  # the preset's own two settings
