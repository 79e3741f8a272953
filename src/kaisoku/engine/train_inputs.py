"""What the training loop is given: the data it trains on (:class:`TrainData`, implemented by the packed
path's loader and by the sampled loader of an image folder or the user's dataset) and its resolved settings
(:class:`TrainSettings`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kaisoku.data.loading.transforms import IMAGENET_MEAN, IMAGENET_STD


class TrainData(Protocol):
    """What the trainer trains on: a rank's batches epoch by epoch, resumable exactly.

    Implemented by the packed path's :class:`~kaisoku.data.loading.loader.ShardLoader` and by
    :class:`~kaisoku.engine.data_build.SampledLoader` (an image folder or the user's dataset).
    """

    steps_per_epoch: int
    last_quality: float | None
    """The current epoch's shuffle-quality score, where the data path measures one."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The rest of the current epoch's (micro-)batches."""

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Point the next iteration at ``epoch`` from ``start_step``."""

    def state_dict(self) -> dict[str, Any]:
        """Where the data order is, for a checkpoint."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the data order; raise KaisokuError when the state is for other data."""

    def set_shard(self, shard: int, shards: int) -> None:
        """Read data-parallel shard ``shard`` of ``shards`` from the next epoch pass on (a layout switch)."""

    def epoch_stats(self) -> dict[str, float] | None:
        """Counters of the epoch so far (reads, bytes, skipped records), or None."""

    def close(self) -> None:
        """Release workers, threads and staged files."""


@dataclass(kw_only=True)
class TrainSettings:
    """Loop settings the trainer needs, already resolved from the config."""

    total_steps: int
    """Optimizer steps to run in all."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    val_every: int = 0
    """Validate every N steps; 0: at each epoch's end."""
    log_every: int = 10
    """Metrics line every N steps."""
    checkpoint_every: int = 0
    """Checkpoint every N steps; 0: at each epoch's end."""
    global_batch: int = 0
    """Samples per optimizer step over all ranks (for samples/s)."""
    channels_last: bool = False
    """Feed the model channels-last tensors (faster convolutions on CUDA)."""
    mean: tuple[float, ...] = IMAGENET_MEAN
    """Per-channel mean (0..1 scale) that input batches are normalised with."""
    std: tuple[float, ...] = IMAGENET_STD
    """Per-channel standard deviation (0..1 scale) for normalisation."""
    on_nonfinite: str = "stop"
    """stop, skip or rollback when the loss or a gradient goes non-finite."""
    max_skips: int = 10
    """skip: consecutive skipped steps that stop the run."""
    rollback_lr_scale: float = 0.5
    """rollback: learning-rate factor per rollback."""
    max_rollbacks: int = 3
    """rollback: rollbacks that stop the run."""
    task: str = "classification"
    """classification (normalised uint8 images, accuracy) or regression (float inputs as the loader gives
    them, mean absolute error per target)."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """The run's own loss, which validation reports (None: cross-entropy or mean squared error)."""
    target_key: str | None = None
    """Where a dict batch holds its labels (None: batches are (input, target) pairs)."""
    seed: int = 0
    """train.seed: each step's random numbers (dropout) are drawn from a generator keyed by (seed, step)."""
    collective_timeout: float = 300.0
    """dist.timeout: seconds a collective waits for a peer."""
    short_timeout: float = 0.0
    """dist.short_timeout: the same during validation (every rank runs the same short steps); 0: the above."""
    tokens_per_sample: int = 0
    """Token ids per sample where the input is a sequence of them (tokens/s is logged too), else 0."""
