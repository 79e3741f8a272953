"""What a dataset's task means to the training loop: how a batch is prepared for the model, and what
validation sums and reports. One object per task keeps the loop free of task branches."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from kaisoku.data.loading.transforms import normalize
from kaisoku.engine.structures import IGNORE_INDEX, batch_size, labels_of, logits_of, model_loss

#: A loss of a model's outputs against a batch's targets (the labels, or the whole dict batch).
LossFn = Callable[[Any, Any], torch.Tensor]


class Task(Protocol):
    """A dataset's task as the loop sees it."""

    name: str
    """classification, token-classification, language-model, regression or loss-only."""

    def prepare(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """A batch already on the device, as the model takes it."""
        ...

    def validation_sums(self, outputs: Any, targets: Any) -> torch.Tensor:
        """This batch's contribution to the validation sums (float64, one dimension)."""
        ...

    def empty_sums(self) -> torch.Tensor:
        """The sums of a rank that saw no validation batch (the all-reduce needs every rank's)."""
        ...

    def validation_metrics(self, totals: list[float], samples: float) -> dict[str, float]:
        """The validation figures from the sums over every batch and rank."""
        ...

    def score(self, metrics: dict[str, float]) -> str:
        """The validation figure a progress line shows beside the loss."""
        ...


class Classification:
    """Integer labels, top-1 accuracy; uint8 images normalised by the dataset's mean and std (inputs taken as
    given where ``mean`` is empty); the validation loss is the model's own where its output carries one, else
    cross-entropy, or the run's own ``loss_fn``. ``target_key``: where a dict batch holds its labels."""

    name = "classification"

    def __init__(
        self,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        channels_last: bool,
        loss_fn: LossFn | None = None,
        target_key: str | None = None,
    ) -> None:
        self.mean, self.std, self.channels_last = mean, std, channels_last
        self.loss_fn = loss_fn
        self.target_key = target_key

    def prepare(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """Normalise with the dataset's mean and std; channels-last where the run asks for it, contiguous
        otherwise (the loader's image batches are channels-last in memory; a model may ``view`` its input)."""
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        if self.mean:
            inputs = normalize(inputs, self.mean, self.std, memory_format=layout)
        if isinstance(inputs, torch.Tensor) and inputs.ndim == 4:
            inputs = inputs.contiguous(memory_format=layout)
        return inputs, targets

    def _loss_sum(self, outputs: Any, targets: Any, count: int) -> torch.Tensor:
        """The batch's summed validation loss (a mean loss times ``count``)."""
        if self.loss_fn is not None:
            return (self.loss_fn(outputs, targets).detach().double() * count).reshape(())
        own = model_loss(outputs)
        if own is not None:
            return (own.detach().double() * count).reshape(())
        logits, labels = logits_of(outputs), labels_of(targets, self.target_key)
        return nn.functional.cross_entropy(logits.float(), labels, reduction="sum").double()

    def validation_sums(self, outputs: Any, targets: Any) -> torch.Tensor:
        """Summed loss and the number of correct top-1 predictions."""
        labels = labels_of(targets, self.target_key)
        loss = self._loss_sum(outputs, targets, int(labels.shape[0]))
        correct = (logits_of(outputs).argmax(dim=1) == labels).sum().double()
        return torch.stack([loss, correct])

    def empty_sums(self) -> torch.Tensor:
        """Zero loss and zero correct."""
        return torch.zeros(2, dtype=torch.float64)

    def validation_metrics(self, totals: list[float], samples: float) -> dict[str, float]:
        """``val_loss``, ``val_accuracy`` and ``val_samples``."""
        count = max(samples, 1.0)
        loss, correct = totals
        return {"val_loss": loss / count, "val_accuracy": correct / count, "val_samples": int(samples)}

    def score(self, metrics: dict[str, float]) -> str:
        """Top-1 accuracy."""
        return f"accuracy {100 * metrics['val_accuracy']:.2f}%"


class TokenClassification(Classification):
    """A label per token (``[B, T]`` targets, ``[B, T, C]`` logits; ``-100`` marks tokens left out): the
    validation loss per token, token accuracy and perplexity. ``shift``: a causal language model, whose
    logits at position t predict the label at t + 1 (Hugging Face's causal LMs take ``labels`` equal to
    ``input_ids`` and shift inside)."""

    def __init__(self, loss_fn: LossFn | None, target_key: str | None, *, shift: bool) -> None:
        super().__init__((), (), False, loss_fn, target_key)
        self.shift = shift
        self.name = "language-model" if shift else "token-classification"

    def validation_sums(self, outputs: Any, targets: Any) -> torch.Tensor:
        """Summed token loss, correct tokens and counted tokens."""
        logits, labels = aligned(logits_of(outputs), labels_of(targets, self.target_key), self.shift)
        counted = labels != IGNORE_INDEX
        tokens = counted.sum()
        if self.loss_fn is not None or model_loss(outputs) is not None:
            loss = self._loss_sum(outputs, targets, 1) * tokens.double()
        else:
            flat = logits.reshape(-1, logits.shape[-1]).float()
            loss = nn.functional.cross_entropy(flat, labels.reshape(-1), reduction="sum").double()
        correct = ((logits.argmax(dim=-1) == labels) & counted).sum().double()
        return torch.stack([loss.reshape(()), correct, tokens.double()])

    def empty_sums(self) -> torch.Tensor:
        """Zero loss, zero correct, zero tokens."""
        return torch.zeros(3, dtype=torch.float64)

    def validation_metrics(self, totals: list[float], samples: float) -> dict[str, float]:
        """``val_loss`` (per token), ``val_token_accuracy``, ``val_perplexity``, ``val_tokens``, ``val_samples``."""
        loss, correct, tokens = totals
        per_token = loss / max(tokens, 1.0)
        return {
            "val_loss": per_token,
            "val_token_accuracy": correct / max(tokens, 1.0),
            "val_perplexity": math.exp(min(per_token, 700.0)),
            "val_tokens": int(tokens),
            "val_samples": int(samples),
        }

    def score(self, metrics: dict[str, float]) -> str:
        """Token accuracy and perplexity."""
        return f"token accuracy {100 * metrics['val_token_accuracy']:.2f}%, perplexity {metrics['val_perplexity']:.3g}"


def aligned(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token logits and labels position by position (a causal model's logits at t against the label at t+1)."""
    if shift:
        return logits[..., :-1, :], labels[..., 1:]
    return logits, labels


class DefaultLoss:
    """The training loss a run uses unless it names its own: the model's own loss where its output carries
    one (a Hugging Face model given ``labels``), else cross-entropy on its logits (over every token for token
    targets, ``-100`` left out; shifted for a causal language model) or mean squared error."""

    def __init__(self, task: str, *, target_key: str | None, label_smoothing: float, mse: bool) -> None:
        self.task, self.target_key = task, target_key
        self.label_smoothing, self.mse = label_smoothing, mse

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The loss of one micro-batch."""
        own = model_loss(outputs)
        if own is not None:
            return own
        logits, labels = logits_of(outputs), labels_of(targets, self.target_key)
        if self.mse:
            return mse_to_outputs(logits, labels)
        logits, labels = aligned(logits, labels, self.task == "language-model")
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            label_smoothing=self.label_smoothing,
        )


def mse_to_outputs(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error with the targets taken in the outputs' shape and dtype: a dataset of scalar
    targets against a model's ``[B, 1]`` outputs must not broadcast to ``[B, B]``."""
    if targets.numel() == outputs.numel():
        targets = targets.reshape(outputs.shape)
    return nn.functional.mse_loss(outputs, targets.to(outputs.dtype))


class Regression:
    """Float inputs as the loader gives them (log1p volumes), MSE loss (or the run's own ``loss_fn``), mean
    absolute error per target."""

    name = "regression"

    def __init__(self, loss_fn: LossFn | None = None, target_key: str | None = None) -> None:
        self.loss_fn = loss_fn
        self.target_key = target_key

    def prepare(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """Unchanged: volumes arrive as float, already transformed in the loader."""
        return inputs, targets

    def validation_sums(self, outputs: Any, targets: Any) -> torch.Tensor:
        """Summed per-sample loss (mean squared error), then the summed absolute error of each target."""
        labels = labels_of(targets, self.target_key)
        predictions = logits_of(outputs)
        count = labels.shape[0]
        error = predictions.float().reshape(count, -1) - labels.float().reshape(count, -1)
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

    def score(self, metrics: dict[str, float]) -> str:
        """Mean absolute error."""
        return f"MAE {metrics['val_mae']:.4f}"


class LossOnly:
    """Dict samples with no target, trained on the user's own loss, which sees the whole batch (a
    self-supervised objective, an autoencoder, a model that computes its labels itself): validation reports
    that loss per sample."""

    name = "loss-only"

    def __init__(self, loss_fn: LossFn | None) -> None:
        if loss_fn is None:
            raise ValueError("the loss-only task needs the user's loss")
        self.loss_fn = loss_fn

    def prepare(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """Unchanged: the batch as the dataset gives it."""
        return inputs, targets

    def validation_sums(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The batch's loss times its samples."""
        count = batch_size(targets)
        return (self.loss_fn(outputs, targets).detach().double() * count).reshape(1)

    def empty_sums(self) -> torch.Tensor:
        """Zero loss."""
        return torch.zeros(1, dtype=torch.float64)

    def validation_metrics(self, totals: list[float], samples: float) -> dict[str, float]:
        """``val_loss`` (per sample) and ``val_samples``."""
        return {"val_loss": totals[0] / max(samples, 1.0), "val_samples": int(samples)}

    def score(self, metrics: dict[str, float]) -> str:
        """The samples validated (the loss is the figure)."""
        return f"{metrics['val_samples']} samples"


def make_task(
    name: str,
    *,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    channels_last: bool = False,
    loss_fn: LossFn | None = None,
    target_key: str | None = None,
) -> Task:
    """The task object for a run's ``task`` (classification, token-classification, language-model or
    regression); ``loss_fn`` is the run's own loss, which validation then reports (None: the model's own
    loss, else cross-entropy or mean squared error); ``target_key``: where a dict batch holds its labels."""
    if name == "regression":
        return Regression(loss_fn, target_key)
    if name == "loss-only":
        return LossOnly(loss_fn)
    if name in ("token-classification", "language-model"):
        return TokenClassification(loss_fn, target_key, shift=name == "language-model")
    return Classification(mean, std, channels_last, loss_fn, target_key)
