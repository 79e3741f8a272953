"""The sharded data-parallel step engine: FSDP2 blocks (``parallel.shard grad|full``) behind the StepEngine
interface the trainer drives.

The model arrives sharded (:func:`kaisoku.distributed.sharding.shard_model`); under bf16 its blocks are
gathered in bf16 and the step runs under autocast, so the layers kept in float32 stay so, as under DDP.
Micro-batches before the step's last keep their gradients local and the weights gathered
(:func:`~kaisoku.distributed.sharding.set_micro_batch`); the last reduce-scatters.
Checkpoints hold DTensor shards, written by every rank (:mod:`kaisoku.distributed.sharded_checkpoint`).

The memory techniques of ``memory.*`` (recompute, per-block policies) are applied to the bare model before it
is sharded, as activation checkpointing goes before ``fully_shard``: a recomputed block's forward runs again
inside backward, where FSDP2 already gathered its weights. Compression and offload of saved activations
wrap each forward pass here; the gathered weights are parameters, which they leave as they are.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from kaisoku.distributed.layout import ParallelLayout
from kaisoku.distributed.sharded_checkpoint import load_full_into_sharded, load_sharded, sharded_state
from kaisoku.distributed.sharding import broadcast_buffers, local_weights_finite, set_micro_batch
from kaisoku.engine.divergence import NonFiniteGuard
from kaisoku.engine.step import LossFn, MicroBatches, Precision
from kaisoku.engine.structures import call_model


class ActivationHooks(Protocol):
    """What packs a forward pass's saved activations (:class:`~kaisoku.memory.compress.ActivationCompressor`,
    a :mod:`kaisoku.memory.offload` store)."""

    def step(self) -> contextlib.AbstractContextManager[None]:
        """The saved-tensors hooks of one forward pass."""
        ...


class ShardedStep:
    """Sharded data parallelism over a sharded ``model`` with accumulation over micro-batches.

    The guard (when given) sees the reduced gradient shards before the step; with ``every_step`` a
    non-finite step is skipped on every rank alike (the gradient norms it reads are summed over ranks).
    """

    reads_sharded_checkpoints = True
    collective_forward = True
    """Its forward gathers weights from every rank: every rank must run as many forwards (validation)."""
    """Loads :mod:`~kaisoku.distributed.sharded_checkpoint` folders itself (the trainer need not gather)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LambdaLR,
        *,
        loss_fn: LossFn,
        precision: Precision,
        guard: NonFiniteGuard | None = None,
        activations: ActivationHooks | None = None,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._scheduler = scheduler
        self.loss_fn = loss_fn
        self.precision = precision
        self.guard = guard
        self.activations = activations
        """Packs what each forward pass saves for backward (``memory.compress`` / ``offload``), when given."""

    @property
    def model(self) -> nn.Module:
        """The sharded model (its parameters are DTensors; calling it gathers them block by block)."""
        return self._model

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer over the parameter shards."""
        return self._optimizer

    @property
    def scheduler(self) -> LambdaLR:
        """The per-step learning-rate scheduler."""
        return self._scheduler

    def train_step(self, micro_batches: MicroBatches) -> torch.Tensor:
        """Forward and backward of each micro-batch, then one optimizer step; the mean loss (no sync)."""
        self._model.train()
        total = torch.zeros((), device=self.precision.device)
        count = len(micro_batches)
        for k, (inputs, targets) in enumerate(micro_batches):
            if count > 1:
                set_micro_batch(self._model, last=k == count - 1)
            saving = self.activations.step() if self.activations else contextlib.nullcontext()
            with self.precision.autocast(), saving:
                loss = self.loss_fn(call_model(self._model, inputs), targets) / count
            loss.backward()
            total += loss.detach().float()
        if self.guard is not None and self.guard.skips_step():
            self._optimizer.zero_grad(set_to_none=True)
            self._scheduler.step()
            return total
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._scheduler.step()
        return total

    def switch_for(self, epoch: int, step: int) -> ParallelLayout | None:
        """Sharded data parallelism never changes layout."""
        return None

    def eval_model(self) -> nn.Module:
        """The sharded model with rank 0's buffers on every rank (it gathers its weights as it runs)."""
        broadcast_buffers(self._model)
        return self._model

    def weights_finite(self) -> torch.Tensor:
        """Whether this rank's weight shards and buffers are finite (the trainer agrees over ranks)."""
        return local_weights_finite(self._model)

    def state_dict(self) -> dict[str, Any]:
        """Sharded model and optimizer state (DTensors, keyed by parameter name), scheduler and scaler."""
        broadcast_buffers(self._model)  # a checkpoint holds rank 0's running statistics, as under DDP
        model_state, optimizer_state = sharded_state(self._model, self._optimizer)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self._scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a sharded checkpoint (any layout or world size, pipeline stages included) or a single-file
        one: data-parallel, or a pipeline run's (whole tensors, optimizer state keyed by parameter name)."""
        if "sharded_dir" in state:
            load_sharded(state["sharded_dir"], self._model, self._optimizer)
        else:
            load_full_into_sharded(state["model"], state["optimizer"], self._model, self._optimizer)
        self._scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.precision.scaler.load_state_dict(state["scaler"])
