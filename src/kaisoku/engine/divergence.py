"""Catching a run that went non-finite (NaN or inf) without a host sync on every step.

The guard keeps device-side flags: each step ORs in whether the loss or any gradient was non-finite and
remembers the first such step and the first parameter (in model order) whose gradient it was. The
trainer reads them (one sync) at its log interval and before every checkpoint; only the ``skip``
policy reads them every step, because skipping needs to know before the optimizer steps (exactly as a
gradient scaler does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kaisoku.errors import KaisokuError


class NonFiniteError(KaisokuError):
    """Training went non-finite and the policy says stop: exit code 4."""

    exit_code = 4


@dataclass(frozen=True)
class NonFinite:
    """What a check found: the first non-finite step and where."""

    step: int
    """The optimizer step whose loss or gradient was first non-finite."""
    where: str
    """The first parameter whose gradient was non-finite, or ``loss``."""


class NonFiniteGuard:
    """Device-side record of non-finite losses and gradients since the last :meth:`reset`.

    Args:
        model: the module whose parameters' gradients are watched (names come from it).
        device: where the flags live.
        every_step: read the flags after every step (the ``skip`` policy).
    """

    def __init__(self, model: nn.Module, device: torch.device, *, every_step: bool = False) -> None:
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = device
        self.every_step = every_step
        self.step = 0
        """The step being taken (set by the trainer before each step)."""
        self.skipped = 0
        """Steps skipped in all (``skip`` policy)."""
        self.consecutive = 0
        """Steps skipped in a row up to now."""
        self.reset()

    def reset(self) -> None:
        """Forget what was seen (after a check that found nothing, or after a rollback)."""
        self._first_step = torch.full((), -1, dtype=torch.int64, device=self.device)
        self._first_where = torch.full((), -1, dtype=torch.int64, device=self.device)

    def _mark(self, bad: torch.Tensor, where: torch.Tensor) -> None:
        new = bad & (self._first_step < 0)
        self._first_step = torch.where(new, torch.full_like(self._first_step, self.step), self._first_step)
        self._first_where = torch.where(new, where, self._first_where)

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Record a non-finite step loss (no sync)."""
        bad = ~torch.isfinite(loss.detach().float()).all()
        self._mark(bad, torch.full_like(self._first_where, len(self.names)))

    def observe_grads(self) -> torch.Tensor:
        """Record non-finite gradients (no sync); returns a device bool: every gradient is finite."""
        indexed = [(i, p.grad) for i, p in enumerate(self.params) if p.grad is not None]
        if not indexed:
            return torch.ones((), dtype=torch.bool, device=self.device)
        norms = torch.stack(torch._foreach_norm([g for _, g in indexed])).float()
        bad = ~torch.isfinite(norms)
        index = torch.tensor([i for i, _ in indexed], device=norms.device)
        first = index[torch.argmax(bad.to(torch.uint8))]
        any_bad = bad.any()
        self._mark(any_bad, first)
        return ~any_bad

    def skips_step(self) -> bool:
        """Watch this step's gradients; under ``every_step`` (the ``skip`` policy), True when the step must be
        dropped as a gradient scaler drops one (counted; the engine then only advances the schedule)."""
        finite = self.observe_grads()
        if not self.every_step:
            return False
        if bool(finite):
            self.consecutive = 0
            return False
        self.skipped += 1
        self.consecutive += 1
        self.reset()  # a skipped step is handled, not a divergence to report
        return True

    def check(self) -> NonFinite | None:
        """One host sync: what was seen since the last reset, or None."""
        step, where = int(self._first_step.item()), int(self._first_where.item())
        if step < 0:
            return None
        name = self.names[where] if 0 <= where < len(self.names) else "loss"
        return NonFinite(step=step, where=name)


def weights_finite(model: nn.Module) -> torch.Tensor:
    """A device bool: every floating-point parameter and buffer of ``model`` is finite (no sync)."""
    tensors = [t.detach() for t in model.state_dict().values() if t.is_floating_point() and t.numel()]
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    norms = torch.stack(torch._foreach_norm(tensors)).float()
    return torch.isfinite(norms).all()


def scale_learning_rate(scheduler: torch.optim.lr_scheduler.LRScheduler, factor: float) -> None:
    """Multiply a scheduler's peak learning rates (and its optimizer's current ones) by ``factor``."""
    scheduler.base_lrs = [base * factor for base in scheduler.base_lrs]
    for group in scheduler.optimizer.param_groups:
        group["lr"] = group["lr"] * factor
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
