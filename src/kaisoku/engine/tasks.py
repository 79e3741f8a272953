"""What a dataset's task means to the training loop: how a batch is prepared for the model, and what
validation sums and reports. One object per task keeps the loop free of task branches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from kaisoku.data.loading.transforms import normalize

#: A loss of outputs against targets.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Task(Protocol):
    """A dataset's task as the loop sees it."""

    name: str
    """classification or regression."""

    def prepare(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch already on the device, as the model takes it."""
        ...

    def validation_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This batch's contribution to the validation sums (float64, one dimension)."""
        ...

    def empty_sums(self) -> torch.Tensor:
        """The sums of a rank that saw no validation batch (the all-reduce needs every rank's)."""
        ...

    def validation_metrics(self, totals: list[float], samples: float) -> dict[str, float]:
        """The validation figures from the sums over every batch and rank."""
        ...


class Classification:
    """Integer labels, top-1 accuracy; uint8 images normalised by the dataset's mean and std (inputs taken as
    given where ``mean`` is empty); the validation loss is cross-entropy, or the run's own ``loss_fn``."""

    name = "classification"

    def __init__(
        self,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        channels_last: bool,
        loss_fn: LossFn | None = None,
    ) -> None:
        self.mean, self.std, self.channels_last = mean, std, channels_last
        self.loss_fn = loss_fn

    def prepare(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise with the dataset's mean and std; channels-last where the run asks for it."""
        if self.mean:
            inputs = normalize(inputs, self.mean, self.std)
        if self.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets

    def validation_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed loss and the number of correct top-1 predictions."""
        if self.loss_fn is not None:
            loss = (self.loss_fn(outputs, targets).detach().double() * targets.shape[0]).reshape(())
        else:
            loss = nn.functional.cross_entropy(outputs.float(), targets, reduction="sum").double()
        correct = (outputs.argmax(dim=1) == targets).sum().double()
        return torch.stack([loss, correct])

    def empty_sums(self) -> torch.Tensor:
        """Zero loss and zero correct."""
        return torch.zeros(2, dtype=torch.float64)

    def validation_metrics(self, totals: list[float], samples: float) -> dict[str, float]:
        """``val_loss``, ``val_accuracy`` and ``val_samples``."""
        count = max(samples, 1.0)
        loss, correct = totals
        return {"val_loss": loss / count, "val_accuracy": correct / count, "val_samples": int(samples)}


class Regression:
    """Float inputs as the loader gives them (log1p volumes), MSE loss (or the run's own ``loss_fn``), mean
    absolute error per target."""

    name = "regression"

    def __init__(self, loss_fn: LossFn | None = None) -> None:
        self.loss_fn = loss_fn

    def prepare(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unchanged: volumes arrive as float, already transformed in the loader."""
        return inputs, targets

    def validation_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed per-sample loss (mean squared error), then the summed absolute error of each target."""
        count = targets.shape[0]
        error = outputs.float().reshape(count, -1) - targets.float().reshape(count, -1)
        if self.loss_fn is not None:
            loss = (self.loss_fn(outputs, targets).detach().float() * count).view(1)
        else:
            loss = (error**2).mean(dim=1).sum().view(1)
        return torch.cat([loss, error.abs().sum(dim=0)]).double()

    def empty_sums(self) -> torch.Tensor:
        """Nothing: the number of targets is known only from a batch."""
        return torch.zeros(0, dtype=torch.float64)

    def validation_metrics(self, totals: list[float], samples: float) -> dict[str, float]:
        """``val_loss`` (MSE), ``val_mae`` and ``val_mae_<k>`` per target, ``val_samples``."""
        count = max(samples, 1.0)
        per_target = [v / count for v in totals[1:]]
        return {
            "val_loss": totals[0] / count if totals else float("nan"),
            "val_mae": sum(per_target) / max(len(per_target), 1),
            **{f"val_mae_{k}": v for k, v in enumerate(per_target)},
            "val_samples": int(samples),
        }


def make_task(
    name: str,
    *,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    channels_last: bool = False,
    loss_fn: LossFn | None = None,
) -> Task:
    """The task object for a dataset's ``task`` (``classification`` or ``regression``); ``loss_fn`` is the
    run's own loss, which validation then reports (None: cross-entropy or mean squared error)."""
    if name == "regression":
        return Regression(loss_fn)
    return Classification(mean, std, channels_last, loss_fn)
