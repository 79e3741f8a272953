"""The large-batch recipe, defined once: as config values for ``kaisoku train`` and as one Python call.

:class:`Recipe` holds the recipe's settings; :meth:`Recipe.apply` writes them into a
:class:`~kaisoku.config.Config` for a batch size (the presets ``cpu-large-batch`` and
``resnet50-imagenet-lars`` and ``kaisoku bench largebatch`` use it), and
``large_batch(model, base_lr=..., batch=..., epochs=..., steps_per_epoch=...)`` builds the same recipe's
optimizer, schedule and loss for a Python training loop::

    optimizer, scheduler, loss_fn = large_batch(model, base_lr=0.1, batch=4096, epochs=10, steps_per_epoch=12)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()

:func:`large_batch_kfac` returns the same three plus a K-FAC preconditioner whose ``step()`` goes between
``loss.backward()`` and ``optimizer.step()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import nn
from torch.optim import Optimizer

from kaisoku.config import Config
from kaisoku.errors import ConfigError
from kaisoku.optim.factory import param_groups
from kaisoku.optim.kfac import KFAC
from kaisoku.optim.lars import LAMB, LARS, count_parameters, lars_eta
from kaisoku.optim.schedules import WarmupSchedule, schedule_factor


def default_warmup_epochs(batch: int, base_batch: int, epochs: float) -> float:
    """Warmup that grows with the batch: ``0.5 * max(1, log2(batch / base_batch))`` epochs, at most a quarter of the run."""
    ratio = max(1.0, batch / base_batch)
    return min(0.25 * epochs, 0.5 * max(1.0, math.log2(ratio)))


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """The large-batch recipe's settings: the learning rate at ``base_batch`` and how it scales, the
    optimizer, the warmup and decay, label smoothing. One source for the presets, the benchmark and
    :func:`large_batch`."""

    base_lr: float
    """Peak learning rate at ``base_batch``."""
    base_batch: int = 256
    """The batch ``base_lr`` is for."""
    lr_scaling: Literal["linear", "sqrt"] = "sqrt"
    """The peak learning rate at batch B: ``base_lr * k`` or ``base_lr * sqrt(k)``, ``k = B / base_batch``."""
    optimizer: Literal["lars", "lamb", "adamw", "sgd"] = "lars"
    """lars (the recipe), lamb, adamw, or sgd (what the recipe is compared against)."""
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-5
    """Weight decay of the weights; BatchNorm parameters and biases get none and no trust ratio."""
    eta: float = 0.0
    """LARS trust coefficient; 0: the model-size rule (:func:`~kaisoku.optim.lars.lars_eta`)."""
    trust_clip: bool = False
    warmup_epochs: float | None = None
    """Linear warmup; None: :func:`default_warmup_epochs` of the batch."""
    schedule: Literal["poly", "cosine", "arccot", "constant"] = "poly"
    poly_power: float = 2.0
    arccot_center: float = 0.5
    arccot_slope: float = 10.0
    label_smoothing: float = 0.1
    zero_init_residual: bool = True
    """Zero the last BatchNorm of every residual block, so that each starts as the identity."""

    def lr(self, batch: int) -> float:
        """The peak learning rate at ``batch``."""
        ratio = batch / self.base_batch
        return self.base_lr * (ratio if self.lr_scaling == "linear" else math.sqrt(ratio))

    def warmup(self, batch: int, epochs: float) -> float:
        """Warmup epochs at ``batch`` in a run of ``epochs``."""
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        return default_warmup_epochs(batch, self.base_batch, epochs)

    def apply(self, cfg: Config, *, batch: int, epochs: float) -> Config:
        """Write the recipe at global batch ``batch`` for ``epochs`` epochs into ``cfg`` (returned)."""
        cfg.data.global_batch = batch
        cfg.train.epochs = epochs
        cfg.train.label_smoothing = self.label_smoothing
        cfg.model.zero_init_residual = self.zero_init_residual
        optim = cfg.optim
        optim.name = self.optimizer
        optim.lr = self.lr(batch)
        optim.momentum = self.momentum
        optim.nesterov = self.nesterov
        optim.weight_decay = self.weight_decay
        optim.eta = self.eta
        optim.trust_clip = self.trust_clip
        optim.no_decay_bn_bias = True
        sched = cfg.sched
        sched.name = self.schedule
        sched.warmup_epochs = self.warmup(batch, epochs)
        sched.poly_power = self.poly_power
        sched.arccot_center = self.arccot_center
        sched.arccot_slope = self.arccot_slope
        return cfg


#: The recipe on CPU ranks for small models (``cpu-large-batch``, ``kaisoku bench largebatch``): LARS with
#: the model-size trust coefficient, base lr 0.2 at batch 128 scaled by sqrt(k), weight decay 5e-4,
#: warmup by batch, then arc-cotangent decay (centre 0.5, slope 5), label smoothing 0.1.
CPU_RECIPE = Recipe(
    base_lr=0.2, base_batch=128, weight_decay=5e-4, schedule="arccot", arccot_center=0.5, arccot_slope=5.0
)

#: ResNet-50 on ImageNet at batch 32,768 (``resnet50-imagenet-lars``), MLPerf-style: LARS (eta 0.001), lr
#: 29.0 at that batch, 5 warmup epochs then polynomial (power 2) decay, weight decay 5e-5, label smoothing 0.1.
IMAGENET_RECIPE = Recipe(
    base_lr=29.0, base_batch=32768, eta=0.001, weight_decay=5e-5, warmup_epochs=5.0, schedule="poly"
)


def zero_init_last_bn(model: nn.Module) -> int:
    """Zero the weight of the last BatchNorm of every residual block; returns how many were zeroed.

    A residual block is a module with a ``downsample`` attribute (torchvision's ``BasicBlock`` and
    ``Bottleneck`` and blocks shaped like them); its last BatchNorm child outside ``downsample`` is the one
    whose output is added to the shortcut, so each block starts as the identity. Models without residual
    blocks are left as they are (0).
    """
    zeroed = 0
    for module in model.modules():
        if not hasattr(module, "downsample"):
            continue
        norms = [
            child
            for name, child in module.named_children()
            if name != "downsample" and isinstance(child, nn.modules.batchnorm._BatchNorm)
        ]
        if norms and norms[-1].weight is not None:
            nn.init.zeros_(norms[-1].weight)
            zeroed += 1
    return zeroed


class LargeBatch(NamedTuple):
    """What :func:`large_batch` returns: unpack it as ``optimizer, scheduler, loss_fn``."""

    optimizer: Optimizer
    """LARS (or LAMB) over a decayed/adapted group and a no-decay, non-adapted group (BN and biases)."""
    scheduler: WarmupSchedule
    """Linear warmup then the decay; step it once after every ``optimizer.step()``."""
    loss_fn: nn.CrossEntropyLoss
    """Cross-entropy with label smoothing."""


def large_batch(
    model: nn.Module,
    *,
    base_lr: float,
    batch: int,
    epochs: float,
    steps_per_epoch: int,
    base_batch: int = 256,
    lr_scaling: Literal["linear", "sqrt"] = "sqrt",
    optimizer: Literal["lars", "lamb", "adamw"] = "lars",
    momentum: float = 0.9,
    weight_decay: float = 5e-5,
    eta: float | None = None,
    trust_clip: bool = False,
    warmup_epochs: float | None = None,
    schedule: Literal["poly", "cosine", "arccot", "constant"] = "poly",
    poly_power: float = 2.0,
    label_smoothing: float = 0.1,
    zero_init_residual: bool = True,
    compile: bool = False,
) -> LargeBatch:
    """The large-batch recipe for ``model``: ``(optimizer, scheduler, loss_fn)``.

    - learning rate ``base_lr * k`` (``lr_scaling="linear"``) or ``base_lr * sqrt(k)`` (``"sqrt"``) with
      ``k = batch / base_batch``;
    - two parameter groups: weights (``ndim > 1``) with ``weight_decay`` and the trust ratio, BatchNorm
      parameters and biases with neither;
    - LARS with ``eta`` (default :func:`lars_eta` of the model's size), LAMB, or AdamW (the ViT recipe:
      ``optimizer="adamw", schedule="cosine", zero_init_residual=False``; a ViT's class token and
      position embedding join the no-decay group);
    - ``warmup_epochs`` (default :func:`default_warmup_epochs`) of linear warmup, then ``schedule``
      (polynomial decay of power ``poly_power`` by default) over ``epochs * steps_per_epoch`` steps;
    - cross-entropy with ``label_smoothing``;
    - the last BatchNorm of each residual block zeroed (:func:`zero_init_last_bn`) when
      ``zero_init_residual``.

    Bad values raise ConfigError naming the argument.
    """
    checks = [
        (base_lr > 0, f"large_batch: base_lr must be > 0 (got {base_lr})"),
        (
            batch >= 1 and base_batch >= 1,
            f"large_batch: batch and base_batch must be >= 1 (got {batch}, {base_batch})",
        ),
        (epochs > 0, f"large_batch: epochs must be > 0 (got {epochs})"),
        (steps_per_epoch >= 1, f"large_batch: steps_per_epoch must be >= 1 (got {steps_per_epoch})"),
        (lr_scaling in ("linear", "sqrt"), f"large_batch: lr_scaling is linear or sqrt (got {lr_scaling!r})"),
        (
            optimizer in ("lars", "lamb", "adamw"),
            f"large_batch: optimizer is lars, lamb or adamw (got {optimizer!r})",
        ),
        (0 <= label_smoothing < 1, f"large_batch: label_smoothing must be in [0, 1) (got {label_smoothing})"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if zero_init_residual:
        zero_init_last_bn(model)
    recipe = Recipe(
        base_lr=base_lr,
        base_batch=base_batch,
        lr_scaling=lr_scaling,
        warmup_epochs=warmup_epochs,
        schedule=schedule,
        poly_power=poly_power,
    )
    lr = recipe.lr(batch)
    groups = param_groups(model, weight_decay=weight_decay, no_decay_bn_bias=True)
    if not groups:
        raise ConfigError("large_batch: the model has no trainable parameters")
    opt: Optimizer
    if optimizer == "lars":
        opt = LARS(
            groups,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            eta=eta if eta is not None else lars_eta(count_parameters(model)),
            trust_clip=trust_clip,
            compile=compile,
        )
    elif optimizer == "lamb":
        opt = LAMB(groups, lr=lr, betas=(momentum, 0.999), weight_decay=weight_decay, compile=compile)
    else:
        opt = torch.optim.AdamW(groups, lr=lr, betas=(momentum, 0.999), weight_decay=weight_decay)
    total = max(1, round(epochs * steps_per_epoch))
    warmup_steps = min(round(recipe.warmup(batch, epochs) * steps_per_epoch), total - 1)
    factor = schedule_factor(schedule, total_steps=total, warmup_steps=warmup_steps, poly_power=poly_power)
    return LargeBatch(opt, WarmupSchedule(opt, factor), nn.CrossEntropyLoss(label_smoothing=label_smoothing))


class LargeBatchKFAC(NamedTuple):
    """What :func:`large_batch_kfac` returns: ``optimizer, scheduler, loss_fn, kfac``."""

    optimizer: Optimizer
    """As in :class:`LargeBatch`."""
    scheduler: WarmupSchedule
    """As in :class:`LargeBatch`."""
    loss_fn: nn.CrossEntropyLoss
    """As in :class:`LargeBatch`."""
    kfac: KFAC
    """The :class:`~kaisoku.optim.kfac.KFAC` preconditioner: ``kfac.step()`` after backward, before ``optimizer.step()``."""


def large_batch_kfac(
    model: nn.Module,
    *,
    damping: float = 1e-3,
    kl_clip: float = 1e-3,
    factor_update_steps: int = 1,
    inv_update_steps: int = 10,
    factor_dtype: str = "float32",
    **recipe: object,
) -> LargeBatchKFAC:
    """:func:`large_batch` (``recipe`` are its arguments) with K-FAC preconditioning in front of the optimizer.

    K-FAC hooks the model's Linear, Conv2d and BatchNorm layers; the step size it clips to
    (``kl_clip``) follows the optimizer's learning rate, so the schedule drives both. Build it before
    wrapping the model in DDP or ``torch.compile``. ``factor_dtype="bfloat16"`` keeps the factor statistics
    in bf16 (where the hardware multiplies bf16 natively).
    """
    optimizer, scheduler, loss_fn = large_batch(model, **recipe)  # type: ignore[arg-type]
    kfac = KFAC(
        model,
        factor_update_steps=factor_update_steps,
        inv_update_steps=inv_update_steps,
        damping=damping,
        kl_clip=kl_clip or None,
        lr=optimizer,
        factor_dtype=factor_dtype,
    )
    return LargeBatchKFAC(optimizer, scheduler, loss_fn, kfac)
