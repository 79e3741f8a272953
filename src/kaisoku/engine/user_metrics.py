"""The user's own validation metrics: plain callables or torchmetrics metrics, reduced over every rank.

- A callable ``metric(outputs, targets)`` returns the batch's mean as a number or a 0-dim tensor, from the
  model's outputs as it gives them and the batch's targets as the loss sees them (the labels, or the whole
  batch for dict samples). kaisoku weights each batch by its samples and sums over every rank: the figure is
  the mean over the whole validation set, whatever the world size.
- A torchmetrics metric (anything with ``update``, ``compute`` and ``reset``) is updated with the
  predictions (``logits``) and the labels, and computed at the end of validation, where torchmetrics gathers
  its states from every rank itself. Token predictions arrive as torch's losses and torchmetrics take them,
  classes in dimension 1 (``[B, C, T]``), shifted by one token for a causal language model; give a token
  metric ``ignore_index=-100`` to leave padding out.

Each figure is written as ``val_<name>`` beside the task's own: in ``metrics.jsonl``, the progress line,
the report's plots and the summary ``fit`` returns.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kaisoku.engine.structures import labels_of, logits_of
from kaisoku.engine.tasks import aligned
from kaisoku.errors import ConfigError

#: A metric as a user gives it: ``fn(outputs, targets) -> number``, or a torchmetrics ``Metric``.
MetricSource = Callable[[Any, Any], Any]
#: What ``fit(metrics=...)`` takes: one metric, a sequence of them, or a mapping of name to metric.
MetricsArg = MetricSource | Sequence[MetricSource] | Mapping[str, MetricSource]

#: Names a user's metric may not take: the figures validation reports already.
_RESERVED = frozenset(
    {"loss", "accuracy", "token_accuracy", "perplexity", "mae", "samples", "tokens", "skipped_records"}
)


def is_stateful(metric: Any) -> bool:
    """Whether ``metric`` keeps state across batches and reduces itself (a torchmetrics ``Metric``)."""
    return all(callable(getattr(metric, name, None)) for name in ("update", "compute", "reset"))


def metric_name(metric: Any) -> str:
    """A metric's name when none is given: a function's own name, or a metric class's in snake case
    (``MulticlassAccuracy`` -> ``multiclass_accuracy``)."""
    name = getattr(metric, "__name__", None) if not is_stateful(metric) else type(metric).__name__
    if not name or name == "<lambda>":
        raise ConfigError(
            "metrics: a metric without a name (a lambda); pass metrics as a dict, e.g. {'f1': fn}"
        )
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def named_metrics(metrics: MetricsArg | None) -> dict[str, Any]:
    """``metrics`` as ``{name: metric}``; one-line ConfigError for a metric that is not callable, a name
    given twice, or a name validation already reports (``loss``, ``accuracy``, ...)."""
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        named = {str(name): metric for name, metric in metrics.items()}
    elif callable(metrics) or is_stateful(metrics):
        named = {metric_name(metrics): metrics}
    else:
        named = {}
        for metric in metrics:
            name = metric_name(metric)
            if name in named:
                raise ConfigError(f"metrics: two metrics are named {name!r}; pass them as a dict of names")
            named[name] = metric
    for name, metric in named.items():
        if not (callable(metric) or is_stateful(metric)):
            raise ConfigError(
                f"metrics: {name!r} is a {type(metric).__name__}, not a callable or a torchmetrics metric"
            )
        if name in _RESERVED or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(
                f"metrics: {name!r} cannot name a metric (validation reports val_{name} already, or it is no "
                "identifier); choose another name"
            )
    return named


class UserMetrics:
    """The run's own metrics over one validation pass: :meth:`reset`, :meth:`update` per batch, then
    :meth:`compute` on every rank (a collective). ``task``: the run's (token tasks give torchmetrics their
    predictions with the classes in dimension 1; a language model's predictions at t meet the label at t + 1);
    ``target_key``: where a dict batch holds its labels."""

    def __init__(
        self, metrics: Mapping[str, Any], device: torch.device, *, target_key: str | None, task: str
    ) -> None:
        self.metrics = dict(metrics)
        self.target_key = target_key
        self.per_token = task in ("token-classification", "language-model")
        self.shift = task == "language-model"
        self.device = device
        for metric in self.metrics.values():
            if is_stateful(metric) and hasattr(metric, "to"):
                metric.to(device)
        self._plain = [name for name, metric in self.metrics.items() if not is_stateful(metric)]
        self._sums = torch.zeros(len(self._plain), dtype=torch.float64, device=device)
        self._samples = 0

    def __bool__(self) -> bool:
        return bool(self.metrics)

    @property
    def names(self) -> list[str]:
        """The metrics' names, as the figures are keyed (``val_<name>``)."""
        return list(self.metrics)

    def reset(self) -> None:
        """Start a validation pass."""
        self._sums.zero_()
        self._samples = 0
        for metric in self.metrics.values():
            if is_stateful(metric):
                metric.reset()

    def update(self, outputs: Any, targets: Any, samples: int) -> None:
        """Take one validation batch of ``samples`` samples."""
        if not self.metrics:
            return
        values = []
        for name in self._plain:
            value = torch.as_tensor(self.metrics[name](outputs, targets), device=self.device)
            if value.numel() != 1:
                raise TypeError(
                    f"metric {name!r} returned {value.numel()} values; a metric returns one number per batch"
                )
            values.append(value.detach().reshape(()).double() * samples)
        if values:
            self._sums += torch.stack(values)
        self._samples += samples
        stateful = [metric for metric in self.metrics.values() if is_stateful(metric)]
        if stateful:
            predictions, labels = aligned(logits_of(outputs), labels_of(targets, self.target_key), self.shift)
            if self.per_token:
                predictions = predictions.movedim(-1, 1)
            for metric in stateful:
                metric.update(predictions.detach(), labels)

    def compute(self, all_reduce_sum: Callable[[list[float]], list[float]]) -> dict[str, float]:
        """Every metric's figure over all ranks' batches (every rank calls it): ``all_reduce_sum`` sums the
        plain metrics' weighted values; a torchmetrics metric gathers its own states."""
        out: dict[str, float] = {}
        if self._plain:
            totals = all_reduce_sum([*self._sums.tolist(), float(self._samples)])
            count = max(totals[-1], 1.0)
            out.update({name: total / count for name, total in zip(self._plain, totals[:-1])})
        for name, metric in self.metrics.items():
            if is_stateful(metric):
                out[name] = float(torch.as_tensor(metric.compute()).double().mean())
        return {f"val_{name}": out[name] for name in self.metrics}
