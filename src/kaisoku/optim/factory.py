"""Optimizers and schedules built from config: parameter groups, the optimizer registry, the scheduler.

The training loop uses it as::

    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.sched, steps_per_epoch=steps, total_steps=total)
    for batch in ...:
        ...backward...
        optimizer.step()
        scheduler.step()          # once per optimizer step, after it
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from kaisoku.config import OptimConfig, SchedConfig
from kaisoku.errors import ConfigError
from kaisoku.optim.lars import LAMB, LARS, count_parameters, lars_eta
from kaisoku.optim.schedules import WarmupSchedule, schedule_factor

ExcludeT: TypeAlias = Sequence[str] | Callable[[str, Tensor], bool]
"""Extra parameters to keep out of weight decay and adaptation: name patterns or ``fn(name, param)``."""

OptimizerBuilder: TypeAlias = Callable[[list[dict[str, Any]], OptimConfig], Optimizer]
"""``builder(param_groups, cfg) -> Optimizer``."""

#: Last name components of learned embeddings kept out of weight decay with ``no_decay_bn_bias``: a vision
#: transformer's class token and position embedding (torchvision's names, and timm's).
EMBEDDING_NAMES: frozenset[str] = frozenset({"class_token", "pos_embedding", "cls_token", "pos_embed"})


def is_embedding(name: str) -> bool:
    """Whether parameter ``name`` (any prefix: ``module.``, a stage's) is a learned embedding of :data:`EMBEDDING_NAMES`."""
    return name.rsplit(".", 1)[-1] in EMBEDDING_NAMES


def _excluder(exclude: ExcludeT) -> Callable[[str, Tensor], bool]:
    if callable(exclude):
        return exclude
    patterns = [exclude] if isinstance(exclude, str) else list(exclude)
    return lambda name, param: any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def param_groups(
    model: nn.Module, *, weight_decay: float, no_decay_bn_bias: bool = True, exclude: ExcludeT = ()
) -> list[dict[str, Any]]:
    """Split the model's trainable parameters into a decayed group and a no-decay group.

    With ``no_decay_bn_bias`` every parameter with ``ndim <= 1`` (BatchNorm and LayerNorm weights, biases)
    and every learned embedding (:func:`is_embedding`: a ViT's class token and position embedding) goes to
    the no-decay group, as does every parameter matched by ``exclude`` (``fnmatch`` patterns over names such
    as ``"fc.*"``, or a predicate ``fn(name, param)``). The no-decay group has ``weight_decay=0`` and
    ``lars_exclude=True`` (no LARS/LAMB trust ratio); the other has ``lars_exclude=False``. Parameters are
    given as ``(name, tensor)`` pairs, so each group carries ``param_names``. Empty groups are left out and
    frozen parameters (``requires_grad=False``) are skipped.
    """
    return named_param_groups(
        model.named_parameters(),
        weight_decay=weight_decay,
        no_decay_bn_bias=no_decay_bn_bias,
        exclude=exclude,
    )


def named_param_groups(
    named_params: Iterable[tuple[str, Tensor]],
    *,
    weight_decay: float,
    no_decay_bn_bias: bool = True,
    exclude: ExcludeT = (),
) -> list[dict[str, Any]]:
    """:func:`param_groups` over ``(name, parameter)`` pairs, e.g. one pipeline stage's share of a model."""
    excluded_by_user = _excluder(exclude)
    decay: list[tuple[str, Tensor]] = []
    no_decay: list[tuple[str, Tensor]] = []
    for name, param in named_params:
        if not param.requires_grad:
            continue
        skip = (no_decay_bn_bias and (param.ndim <= 1 or is_embedding(name))) or excluded_by_user(name, param)
        (no_decay if skip else decay).append((name, param))
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, "lars_exclude": False})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "lars_exclude": True})
    return groups


def _sgd(groups: list[dict[str, Any]], cfg: OptimConfig) -> Optimizer:
    return torch.optim.SGD(
        groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
    )


def _lars(groups: list[dict[str, Any]], cfg: OptimConfig) -> Optimizer:
    return LARS(
        groups,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
        eta=cfg.eta or _size_rule_eta(groups),
        eps=cfg.eps,
        trust_clip=cfg.trust_clip,
        # A config without the field (today's) keeps the eager update.
        compile=bool(getattr(cfg, "compile", False)),
    )


def _size_rule_eta(groups: list[dict[str, Any]]) -> float:
    """``optim.eta = 0``: the trust coefficient of :func:`kaisoku.optim.lars.lars_eta` for these parameters."""
    return lars_eta(count_parameters(groups))


def _adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> Optimizer:
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay)


def _lamb(groups: list[dict[str, Any]], cfg: OptimConfig) -> Optimizer:
    return LAMB(
        groups,
        lr=cfg.lr,
        betas=(cfg.momentum, 0.999),
        weight_decay=cfg.weight_decay,
        compile=bool(getattr(cfg, "compile", False)),
    )


#: Optimizer name (``optim.name``) -> builder. sgd: torch.optim.SGD; lars: :class:`~kaisoku.optim.LARS`;
#: adamw: torch.optim.AdamW with betas (momentum, 0.999); lamb: :class:`~kaisoku.optim.LAMB`.
OPTIMIZERS: dict[str, OptimizerBuilder] = {"sgd": _sgd, "lars": _lars, "adamw": _adamw, "lamb": _lamb}


def check_optim_config(cfg: OptimConfig) -> None:
    """Raise ConfigError naming the ``optim.*`` field whose value no optimizer accepts."""
    if cfg.name not in OPTIMIZERS:
        choices = ", ".join(OPTIMIZERS)
        raise ConfigError(f"optim.name: {cfg.name!r} is not an optimizer; choose one of: {choices}")
    checks = [
        (cfg.lr > 0, f"optim.lr must be > 0 (got {cfg.lr})"),
        (0 <= cfg.momentum < 1, f"optim.momentum must be in [0, 1) (got {cfg.momentum})"),
        (cfg.weight_decay >= 0, f"optim.weight_decay must be >= 0 (got {cfg.weight_decay})"),
        (cfg.eta >= 0, f"optim.eta must be >= 0 (0: the model-size rule) (got {cfg.eta})"),
        (cfg.eps >= 0, f"optim.eps must be >= 0 (got {cfg.eps})"),
        (
            not (cfg.nesterov and cfg.momentum == 0 and cfg.name in ("sgd", "lars")),
            "optim.nesterov needs optim.momentum > 0",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, exclude: ExcludeT = ()) -> Optimizer:
    """The optimizer ``cfg.name`` over :func:`param_groups` of ``model``, with ``cfg``'s hyper-parameters."""
    check_optim_config(cfg)
    if not any(param.requires_grad for param in model.parameters()):
        raise ConfigError("the model has no trainable parameters for the optimizer")
    return build_optimizer_from_named(model.named_parameters(), cfg, exclude=exclude)


def build_optimizer_from_named(
    named_params: Iterable[tuple[str, Tensor]], cfg: OptimConfig, *, exclude: ExcludeT = ()
) -> Optimizer:
    """:func:`build_optimizer` over ``(name, parameter)`` pairs named as in the whole model.

    A pipeline stage builds its optimizer this way from its own parameters; the groups and
    hyper-parameters are those the whole model would get.
    """
    check_optim_config(cfg)
    groups = named_param_groups(
        named_params, weight_decay=cfg.weight_decay, no_decay_bn_bias=cfg.no_decay_bn_bias, exclude=exclude
    )
    if not groups:
        raise ConfigError("the parameters handed to the optimizer include none that is trainable")
    return OPTIMIZERS[cfg.name](groups, cfg)


def warmup_steps(cfg: SchedConfig, steps_per_epoch: int) -> int:
    """Warmup length in optimizer steps: ``round(warmup_epochs * steps_per_epoch)``."""
    return round(cfg.warmup_epochs * steps_per_epoch)


def check_sched_config(cfg: SchedConfig, *, steps_per_epoch: int, total_steps: int) -> None:
    """Raise ConfigError naming the ``sched.*`` field whose value cannot make a schedule of this run."""
    if steps_per_epoch < 1 or total_steps < 1:
        raise ConfigError(
            f"the run has {total_steps} optimizer steps ({steps_per_epoch} per epoch); "
            "it needs at least 1 (lower data.global_batch or raise train.epochs)"
        )
    warmup = warmup_steps(cfg, steps_per_epoch)
    checks = [
        (cfg.warmup_epochs >= 0, f"sched.warmup_epochs must be >= 0 (got {cfg.warmup_epochs})"),
        (
            warmup < total_steps,
            f"sched.warmup_epochs={cfg.warmup_epochs} is {warmup} steps but the run has only {total_steps}; "
            "shorten the warmup or train longer",
        ),
        (0 <= cfg.min_lr_ratio <= 1, f"sched.min_lr_ratio must be in [0, 1] (got {cfg.min_lr_ratio})"),
        (cfg.arccot_slope > 0, f"sched.arccot_slope must be > 0 (got {cfg.arccot_slope})"),
        (cfg.poly_power > 0, f"sched.poly_power must be > 0 (got {cfg.poly_power})"),
        (cfg.step_gamma > 0, f"sched.step_gamma must be > 0 (got {cfg.step_gamma})"),
        (
            not cfg.step_factors or len(cfg.step_factors) == len(cfg.step_milestones),
            f"sched.step_factors has {len(cfg.step_factors)} values for {len(cfg.step_milestones)} "
            "sched.step_milestones; give one per milestone",
        ),
        (
            all(0 < m <= 1 for m in cfg.step_milestones),
            f"sched.step_milestones must be fractions of the run in (0, 1] (got {list(cfg.step_milestones)})",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def build_scheduler(
    optimizer: Optimizer, cfg: SchedConfig, *, steps_per_epoch: int, total_steps: int
) -> LRScheduler:
    """A per-step scheduler: linear warmup of ``cfg.warmup_epochs``, then ``cfg.name``.

    Step it once after every ``optimizer.step()``. ``total_steps`` is the length of the whole run in
    optimizer steps (``epochs * steps_per_epoch``; ``train.max_steps`` only stops a run early, so a run
    stopped there and resumed follows the same curve); fractions in ``cfg`` (arccot centre, step
    milestones) are fractions of it.
    """
    check_sched_config(cfg, steps_per_epoch=steps_per_epoch, total_steps=total_steps)
    factor = schedule_factor(
        cfg.name,
        total_steps=total_steps,
        warmup_steps=warmup_steps(cfg, steps_per_epoch),
        min_lr_ratio=cfg.min_lr_ratio,
        arccot_center=cfg.arccot_center,
        arccot_slope=cfg.arccot_slope,
        poly_power=cfg.poly_power,
        step_milestones=cfg.step_milestones,
        step_gamma=cfg.step_gamma,
        step_factors=cfg.step_factors,
    )
    return WarmupSchedule(optimizer, factor)
