"""Learning-rate schedules per optimizer step: linear warmup, then constant, cosine, arccot, poly or step.

Every schedule is a multiplier of the peak learning rate, ``factor(step) -> float``, wrapped in
:class:`WarmupSchedule`, a ``torch.optim.lr_scheduler.LambdaLR``: call ``scheduler.step()`` once after every
``optimizer.step()``. Step ``s`` (0-based, the ``s``-th optimizer step) runs at ``peak * factor(s)``.

Warmup rises linearly over the first ``warmup_steps`` steps, from ``1 / warmup_steps`` of the decay
curve's value at ``warmup_steps`` up to that value, so the curve is continuous where warmup hands over.

Arc-cotangent (``arccot``): ``lr = peak * arccot(slope * (t - center)) / pi`` with
``arccot(x) = pi / 2 - arctan(x)`` and ``t = step / total_steps`` the fraction of the run done. It is close
to the peak well before ``center``, exactly half the peak at ``center``, and falls towards 0 after.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler


def arccot(x: float) -> float:
    """The arc-cotangent with values in (0, pi): ``pi / 2 - arctan(x)``, continuous at 0."""
    return math.pi / 2 - math.atan(x)


@dataclass
class Constant:
    """The peak learning rate throughout."""

    def __call__(self, step: int) -> float:
        """Multiplier of the peak learning rate at ``step``."""
        return 1.0


@dataclass
class Cosine:
    """Half a cosine from the peak at ``start`` down to ``min_ratio * peak`` at ``total``."""

    start: int
    total: int
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        """Multiplier of the peak learning rate at ``step``."""
        progress = _progress(step, self.start, self.total)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class Poly:
    """MLPerf-style polynomial decay ``min + (1 - min) * (1 - progress) ** power``, ``start`` to ``total``."""

    start: int
    total: int
    power: float = 2.0
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        """Multiplier of the peak learning rate at ``step``."""
        progress = _progress(step, self.start, self.total)
        return self.min_ratio + (1.0 - self.min_ratio) * (1.0 - progress) ** self.power


@dataclass
class Arccot:
    """``arccot(slope * (step / total - center)) / pi``: near 1 early, 0.5 at ``center``, then towards 0."""

    total: int
    center: float = 0.5
    slope: float = 10.0

    def __call__(self, step: int) -> float:
        """Multiplier of the peak learning rate at ``step``."""
        return arccot(self.slope * (step / self.total - self.center)) / math.pi


@dataclass
class Step:
    """Multiply by ``gamma`` at each milestone (in steps), or use ``factors[i]`` from milestone ``i`` on."""

    milestones: list[int] = field(default_factory=list)
    gamma: float = 0.1
    factors: list[float] = field(default_factory=list)

    def __call__(self, step: int) -> float:
        """Multiplier of the peak learning rate at ``step``."""
        passed = sum(step >= milestone for milestone in self.milestones)
        if self.factors:
            return self.factors[passed - 1] if passed else 1.0
        return self.gamma**passed


@dataclass
class Warmup:
    """Linear warmup over ``steps`` steps in front of ``after``, continuous where it hands over."""

    after: Callable[[int], float]
    steps: int = 0

    def __call__(self, step: int) -> float:
        """Multiplier of the peak learning rate at ``step``."""
        if step < self.steps:
            return self.after(self.steps) * (step + 1) / self.steps
        return self.after(step)


def _progress(step: int, start: int, total: int) -> float:
    """Fraction of the way from ``start`` to ``total``, clamped to [0, 1]."""
    if total <= start:
        return 1.0
    return min(max((step - start) / (total - start), 0.0), 1.0)


class WarmupSchedule(LambdaLR):
    """A ``LambdaLR`` driven by one schedule object for every parameter group.

    ``state_dict()`` holds plain values only (step count, learning rates); the curve comes from the
    config when the scheduler is rebuilt, and ``load_state_dict`` then resumes it at the saved step.

    Args:
        optimizer: the optimizer whose groups' learning rates are driven; each group's initial ``lr`` is
            its peak.
        factor: the multiplier of the peak learning rate per step, e.g. ``Warmup(Arccot(total=1000), 50)``.
        last_epoch: index of the last step taken, -1 for a new run (as in torch's schedulers).
    """

    def __init__(self, optimizer: Optimizer, factor: Callable[[int], float], last_epoch: int = -1) -> None:
        super().__init__(optimizer, factor, last_epoch=last_epoch)

    @property
    def factor(self) -> Callable[[int], float]:
        """The multiplier of the peak learning rate per step."""
        return self.lr_lambdas[0]

    def state_dict(self) -> dict[str, Any]:
        """Step count and learning rates as plain values; the curve itself is rebuilt from the config.

        Without schedule objects in it, a checkpoint loads with ``torch.load(weights_only=True)``.
        """
        state = {key: value for key, value in self.__dict__.items() if key not in ("optimizer", "lr_lambdas")}
        state["lr_lambdas"] = [None] * len(self.lr_lambdas)
        return state


def schedule_factor(
    name: str,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.0,
    arccot_center: float = 0.5,
    arccot_slope: float = 10.0,
    poly_power: float = 2.0,
    step_milestones: Sequence[float] = (0.5, 0.75),
    step_gamma: float = 0.1,
    step_factors: Sequence[float] = (),
) -> Warmup:
    """The multiplier of schedule ``name`` (constant, cosine, arccot, poly, step) behind a linear warmup.

    ``arccot_center`` and ``step_milestones`` are fractions of ``total_steps``; cosine and poly decay from
    the end of warmup to ``total_steps``.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1 (got {total_steps})")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup_steps must be in [0, total_steps) (got {warmup_steps} of {total_steps})")
    after: Callable[[int], float]
    if name == "constant":
        after = Constant()
    elif name == "cosine":
        after = Cosine(start=warmup_steps, total=total_steps, min_ratio=min_lr_ratio)
    elif name == "poly":
        after = Poly(start=warmup_steps, total=total_steps, power=poly_power, min_ratio=min_lr_ratio)
    elif name == "arccot":
        after = Arccot(total=total_steps, center=arccot_center, slope=arccot_slope)
    elif name == "step":
        if step_factors and len(step_factors) != len(step_milestones):
            raise ValueError(
                f"sched.step_factors has {len(step_factors)} values for {len(step_milestones)} milestones; "
                "give one per milestone"
            )
        after = Step(
            milestones=[round(m * total_steps) for m in step_milestones],
            gamma=step_gamma,
            factors=list(step_factors),
        )
    else:
        raise ValueError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    return Warmup(after=after, steps=warmup_steps)


#: Schedule names accepted by :func:`schedule_factor`.
SCHEDULES: tuple[str, ...] = ("constant", "cosine", "arccot", "poly", "step")


def plot_schedule(
    schedule: Callable[[Optimizer], LRScheduler] | Callable[[int], float],
    steps: int,
    path: str | Path,
    *,
    lr: float = 1.0,
    title: str = "",
    steps_per_epoch: int = 0,
) -> Path:
    """Write a PNG of the learning rate over ``steps`` optimizer steps and return its path.

    ``schedule`` is either a scheduler factory, ``factory(optimizer) -> LRScheduler`` (stepped once per
    step on a throw-away optimizer with learning rate ``lr``), or a function of the step,
    ``fn(step) -> lr``: a callable that returns an ``LRScheduler`` when given an optimizer is a factory,
    anything else is called with step numbers. With ``steps_per_epoch`` the x axis is in epochs.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = schedule_values(schedule, steps, lr=lr)
    xs = [s / steps_per_epoch if steps_per_epoch else s for s in range(steps)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(xs, values)
    axis.set_xlabel("epoch" if steps_per_epoch else "step")
    axis.set_ylabel("learning rate")
    axis.set_title(title or "learning-rate schedule")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def schedule_values(
    schedule: Callable[[Optimizer], LRScheduler] | Callable[[int], float], steps: int, *, lr: float = 1.0
) -> list[float]:
    """The learning rate at each of ``steps`` steps (see :func:`plot_schedule` for ``schedule``)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    try:
        made: object = schedule(optimizer)  # type: ignore[arg-type]
    except Exception as error:  # not a factory: a function of the step number
        made = error
    if isinstance(made, LRScheduler):
        values = []
        for _ in range(steps):
            values.append(float(optimizer.param_groups[0]["lr"]))
            optimizer.step()
            made.step()
        return values
    try:
        return [float(schedule(step)) for step in range(steps)]  # type: ignore[arg-type]
    except Exception:
        if isinstance(made, Exception):
            # Neither reading worked; the factory's own error says more.
            raise made from None
        raise
