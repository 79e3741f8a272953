"""Step engines: how one optimizer step runs, behind one small interface the trainer drives.

The trainer loop knows nothing of how the model is parallelised. It hands a step engine the step's
prepared micro-batches and asks it for its state; :class:`DataParallelStep` (DDP, accumulation, mixed
precision, an optional preconditioner such as K-FAC) and :class:`~kaisoku.engine.hybrid.HybridStep`
(pipeline stages and switch-parallel) implement it. ``engine/build.py`` picks one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from kaisoku.distributed.layout import ParallelLayout
from kaisoku.distributed.named_state import load_named_optimizer_state
from kaisoku.engine.divergence import NonFiniteGuard
from kaisoku.engine.structures import call_model
from kaisoku.errors import KaisokuError
from kaisoku.memory.compress import ActivationCompressor
from kaisoku.models.blocks import state_names
from kaisoku.precision import mode_conflict

if TYPE_CHECKING:
    from kaisoku.precision.stats import PrecisionMonitor

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
#: Cross-entropy (or another loss) of logits against targets.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Precision:
    """How numbers are carried for ``mode`` (``precision.mode``) on ``device``: autocast and the gradient
    scaler for fp32, bf16 and fp16; for the ``*-stats`` modes the layers quantize themselves
    (:func:`kaisoku.precision.apply_precision`) and :attr:`monitor` holds their per-layer statistics."""

    def __init__(self, mode: str, device: torch.device) -> None:
        conflict = mode_conflict(mode, device.type)
        if conflict:
            raise KaisokuError(conflict)
        self.mode = mode
        self.device = device
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)
        # fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range and needs none.
        self.scaler = torch.amp.GradScaler("cuda", enabled=mode == "fp16")
        self.monitor: PrecisionMonitor | None = None
        """The quantized layers' statistics under a ``*-stats`` mode (set where the model is built)."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context for a forward pass (a no-op in fp32 and the ``*-stats`` modes)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def layer_stats(self) -> dict[str, Any]:
        """Per-layer exponent, overflow rate and underflow fraction since the last call ({} without any)."""
        return self.monitor.window() if self.monitor is not None else {}


class Preconditioner(Protocol):
    """A gradient preconditioner run between backward and the optimizer step (e.g. K-FAC)."""

    def step(self) -> None:
        """Replace the gradients with preconditioned ones."""

    def state_dict(self) -> dict[str, Any]:
        """State for a checkpoint."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint."""


class StepEngine(Protocol):
    """What the trainer drives: steps, a layout switch point, the model to evaluate, checkpoint state.

    Every rank calls every method at the same point (some are collectives).
    """

    @property
    def model(self) -> nn.Module:
        """The whole model, unwrapped (the module the run's weights live in)."""

    @property
    def optimizer(self) -> Optimizer:
        """This rank's optimizer now (it may change at a layout switch)."""

    @property
    def scheduler(self) -> LambdaLR:
        """The per-step learning-rate scheduler of :attr:`optimizer`."""

    def train_step(self, micro_batches: MicroBatches) -> torch.Tensor:
        """One optimizer step over the step's micro-batches (on the device, normalised); the mean loss."""

    def switch_for(self, epoch: int, step: int) -> ParallelLayout | None:
        """Change layout if the run's schedule says so at (``epoch``, ``step``); the new layout, else None."""

    def eval_model(self) -> nn.Module:
        """The model to validate with, holding the current weights on every rank."""

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler, scaler (and preconditioner) state for a checkpoint."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint written by any engine (``state["step"]`` is the optimizer step)."""


def continue_schedule(scheduler: LambdaLR, steps: int) -> None:
    """Put a per-step scheduler (and its optimizer's learning rates) where it is after ``steps`` steps.

    The curve is a function of the step, so a scheduler built afresh on another layout's optimizer
    continues exactly. The peak learning rate of each group is its ``initial_lr`` (what a loaded
    optimizer state carries), else the scheduler's own.
    """
    groups = scheduler.optimizer.param_groups
    bases = [group.get("initial_lr", base) for group, base in zip(groups, scheduler.base_lrs)]
    lrs = [base * factor(steps) for base, factor in zip(bases, scheduler.lr_lambdas)]
    state = scheduler.state_dict()
    state.update(last_epoch=steps, _step_count=steps + 1, base_lrs=bases, _last_lr=lrs)
    scheduler.load_state_dict(state)
    for group, lr in zip(groups, lrs):
        group["lr"] = lr


class DataParallelStep:
    """Data parallelism: ``model`` (DDP-wrapped when distributed) with accumulation over micro-batches.

    Gradients are synchronised on the last micro-batch only (``no_sync`` before it); a preconditioner,
    when given, sees unscaled, averaged gradients just before the optimizer step. With
    ``update_in_backward`` the optimizer runs inside the backward pass (hooks installed by
    :mod:`kaisoku.memory.in_backward`) and this engine only advances the schedule.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LambdaLR,
        *,
        loss_fn: LossFn,
        precision: Precision,
        preconditioner: Preconditioner | None = None,
        guard: NonFiniteGuard | None = None,
        update_in_backward: bool = False,
        activations: ActivationCompressor | None = None,
    ) -> None:
        self.wrapped = model
        self._optimizer = optimizer
        self._scheduler = scheduler
        self.loss_fn = loss_fn
        self.precision = precision
        self.preconditioner = preconditioner
        self.guard = guard
        """Watches for non-finite gradients; with ``every_step`` a non-finite step is skipped."""
        self.update_in_backward = update_in_backward
        """The optimizer already ran inside backward (``kaisoku.memory.in_backward`` hooks): no step here."""
        self.activations = activations
        """Compresses what each forward pass saves for backward (``memory.compress``), when given."""

    @property
    def model(self) -> nn.Module:
        """The model without its DDP wrapper."""
        return getattr(self.wrapped, "module", self.wrapped)

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer over every parameter."""
        return self._optimizer

    @property
    def scheduler(self) -> LambdaLR:
        """The per-step learning-rate scheduler."""
        return self._scheduler

    def train_step(self, micro_batches: MicroBatches) -> torch.Tensor:
        """Forward and backward of each micro-batch, then one optimizer step; the mean loss (no sync)."""
        self.wrapped.train()
        scaler = self.precision.scaler
        total = torch.zeros((), device=self.precision.device)
        count = len(micro_batches)
        for k, (images, labels) in enumerate(micro_batches):
            last = k == count - 1
            no_sync = getattr(self.wrapped, "no_sync", None)
            sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
            with sync:
                saving = self.activations.step() if self.activations else contextlib.nullcontext()
                with self.precision.autocast(), saving:
                    loss = self.loss_fn(call_model(self.wrapped, images), labels) / count
                scaler.scale(loss).backward()
            total += loss.detach().float()
        if self.update_in_backward:
            # Every parameter was updated as its gradient became final; what is left is bookkeeping.
            self._optimizer.zero_grad(set_to_none=True)
            self._scheduler.step()
            return total
        # Under fp16 the scaler skips overflowing steps itself; non-finite gradients are routine there.
        if self.guard is not None and not scaler.is_enabled() and self.guard.skips_step():
            # Skip the step as a gradient scaler does: no update, the schedule moves on.
            self._optimizer.zero_grad(set_to_none=True)
            self._scheduler.step()
            return total
        if self.preconditioner is not None:
            scaler.unscale_(self._optimizer)
            self.preconditioner.step()
        scaler.step(self._optimizer)
        scaler.update()
        self._optimizer.zero_grad(set_to_none=True)
        self._scheduler.step()
        return total

    def switch_for(self, epoch: int, step: int) -> ParallelLayout | None:
        """Plain data parallelism never changes layout."""
        return None

    def eval_model(self) -> nn.Module:
        """Every rank already holds the whole, current model."""
        return self.model

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler, scaler and preconditioner state."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self._optimizer.state_dict(),
            "scheduler": self._scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict(),
        }
        if self.preconditioner is not None:
            state["preconditioner"] = self.preconditioner.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a DDP checkpoint, or a layout-independent one written under hybrid parallelism."""
        self.model.load_state_dict(state["model"])
        if "layout" in state:
            load_named_optimizer_state(self._optimizer, state["optimizer"], state_names(self.model))
            # The saved scheduler belongs to one stage's optimizer; the curve only needs the step.
            continue_schedule(self._scheduler, int(state["step"]))
        else:
            self._optimizer.load_state_dict(state["optimizer"])
            self._scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.precision.scaler.load_state_dict(state["scaler"])
        if self.preconditioner is not None and "preconditioner" in state:
            self.preconditioner.load_state_dict(state["preconditioner"])
