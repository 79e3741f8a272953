"""One validation pass: the task's sums and the user's metrics over this rank's share of the validation set,
reduced over every rank, under the short collective timeout (every rank runs the same short steps)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from kaisoku.distributed import env
from kaisoku.engine.step import Precision
from kaisoku.engine.structures import batch_size, call_model, to_device
from kaisoku.engine.tasks import Task
from kaisoku.engine.user_metrics import UserMetrics


def prepare_batch(task: Task, device: torch.device, inputs: Any, targets: Any) -> tuple[Any, Any]:
    """A batch on ``device``, as the model takes it (a dict batch is its own targets: moved once)."""
    moved = to_device(inputs, device)
    return task.prepare(moved, moved if targets is inputs else to_device(targets, device))


class Validator:
    """Validates a model on a loader of this rank's share: the task's figures (loss and accuracy, token
    accuracy and perplexity, or MAE) and the user's metrics, the same on every rank.

    ``collective_forward``: the model's forward communicates (a sharded model gathers its weights), so every
    rank must run as many forwards; ``timeouts``: (short, normal) seconds a collective waits inside and after
    the pass (``dist.short_timeout``, ``dist.timeout``).
    """

    def __init__(
        self,
        *,
        task: Task,
        precision: Precision,
        device: torch.device,
        user_metrics: UserMetrics | None,
        collective_forward: bool,
        timeouts: tuple[float, float],
    ) -> None:
        self.task, self.precision, self.device = task, precision, device
        self.user_metrics = user_metrics
        self.collective_forward = collective_forward
        self.timeouts = timeouts

    @torch.no_grad()
    def run(self, model: nn.Module, loader: DataLoader, step: int) -> dict[str, float]:
        """The figures of one pass over ``loader`` (a collective). Draws no number of the run's: the checkpoint
        after it holds the generator state an uninterrupted run has there (the loader's iterator draws its
        base seed from the global generator)."""
        with (
            torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []),
            env.collective_timeout(*self.timeouts, f"validation at step {step}"),
        ):
            model.eval()
            try:
                return self._run(model, loader)
            finally:
                model.train()

    def _run(self, model: nn.Module, loader: DataLoader) -> dict[str, float]:
        sums: torch.Tensor | None = None
        seen = 0
        if self.user_metrics:
            self.user_metrics.reset()
        # A sharded model's forward gathers weights with every rank: a rank with fewer validation batches (the
        # set does not divide by the world) runs a forward on a spare batch for each it lacks, results unused.
        spare = 0
        if self.collective_forward:
            spare = int(env.all_reduce_max([float(len(loader))], self.device)[0]) - len(loader)
        last: Any = None
        for raw_inputs, raw_targets in loader:
            inputs, targets = prepare_batch(self.task, self.device, raw_inputs, raw_targets)
            last = inputs
            with self.precision.autocast():
                outputs = call_model(model, inputs)
            batch = self.task.validation_sums(outputs, targets)
            sums = batch if sums is None else sums + batch
            samples = batch_size(inputs)
            seen += samples
            if self.user_metrics:
                self.user_metrics.update(outputs, targets, samples)
        if spare:
            if last is None:
                last = prepare_batch(self.task, self.device, *_first_sample(loader))[0]
            for _ in range(spare):
                with self.precision.autocast():
                    call_model(model, last)
        values = [float(v) for v in (sums if sums is not None else self.task.empty_sums()).tolist()]
        # The eval sampler hands out this rank's share exactly once: fewer seen were skipped as damaged.
        expected = getattr(getattr(loader, "batch_sampler", None), "num_samples", seen)
        totals = env.all_reduce_sum([*values, float(seen), float(expected - seen)], self.device)
        own: dict[str, float] = {}
        if self.user_metrics:
            own = self.user_metrics.compute(lambda values: env.all_reduce_sum(values, self.device))
        return {
            **self.task.validation_metrics(totals[:-2], totals[-2]),
            **own,
            "val_skipped_records": int(totals[-1]),
        }

    def score(self, figures: dict[str, float]) -> str:
        """What a progress line shows beside the validation loss: the task's figure and the user's metrics."""
        text = self.task.score(figures)
        if self.user_metrics:
            text += "".join(f", {name} {figures[f'val_{name}']:.4g}" for name in self.user_metrics.names)
        return text


def _first_sample(loader: DataLoader) -> tuple[Any, Any]:
    """The validation set's first sample as a batch: what a rank that has no validation batch at all (a set
    smaller than the world) runs its spare forwards on."""
    indices = loader.batch_sampler.first_batch()  # type: ignore[union-attr]
    batch = loader.collate_fn([loader.dataset[i] for i in indices])
    return (batch, batch) if isinstance(batch, Mapping) else (batch[0], batch[1])
