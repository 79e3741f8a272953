"""The hybrid step engine: data x pipeline parallelism and switch-parallel, as the trainer drives it.

``parallel.pp > 1`` or a ``parallel.switch`` schedule trains the model through
:class:`~kaisoku.distributed.pipeline.HybridParallel` instead of DDP. :class:`HybridStep` implements the
trainer's :class:`~kaisoku.engine.step.StepEngine`: one step on a replica batch, the layout switch when
the schedule says so (with the learning-rate schedule carried over), the gathered model for validation,
and checkpoints in the layout-independent form (the model's own ``state_dict`` names, an optimizer state
keyed by the same names), so a run saved under one layout resumes under any other, DDP included. With
``HybridOptions.shard`` each stage's blocks are sharded over the stage's replicas, and the checkpoint is a
sharded folder instead: every rank writes its own stage's shards under the whole model's names (the keys a
sharded data-parallel run writes) and reads its own stage's pieces of a folder written under any layout.

The data follows the dp axis: the sampler's shard is the replica index and its shard count the replica
count, so every rank of a pipeline reads its replica's batch; the global batch stays fixed whatever the
layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from kaisoku.distributed.layout import ParallelLayout, SwitchSchedule
from kaisoku.distributed.mesh import ParallelMesh, build_mesh
from kaisoku.distributed.named_state import is_named_optimizer_state, named_from_torch_optimizer_state
from kaisoku.distributed.pipeline import HybridOptions, HybridParallel, LossFn, OptimizerFactory
from kaisoku.distributed.sharding import local_weights_finite
from kaisoku.distributed.switch import switch_layout
from kaisoku.engine.step import MicroBatches, Precision, continue_schedule

#: Builds the per-step learning-rate scheduler of an optimizer.
SchedulerFactory = Callable[[Optimizer], LambdaLR]
#: Points the training sampler at shard ``shard`` of ``shards`` (the replica index and count).
Reshard = Callable[[int, int], None]


class HybridStep:
    """``model`` trained under the layouts of a switch schedule (a :class:`~kaisoku.engine.step.StepEngine`).

    Every rank calls every method at the same point (gathering and switching are collectives). The
    optimizer and scheduler change at a switch: read :attr:`optimizer` and :attr:`scheduler` afresh.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        schedule: SwitchSchedule,
        options: HybridOptions,
        loss_fn: LossFn,
        optimizer_factory: OptimizerFactory,
        scheduler_factory: SchedulerFactory,
        reshard: Reshard,
        device: torch.device,
        precision: Precision,
        ranks_per_node: int | None = None,
        micro_batches: Mapping[ParallelLayout, int] | None = None,
        input_shape: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.schedule = schedule
        self.options = options
        self.scheduler_factory = scheduler_factory
        self.reshard = reshard
        self.device = device
        self.precision = precision
        self.ranks_per_node = ranks_per_node
        self.micro_batches = dict(micro_batches or {})
        self.input_shape = input_shape
        self._meshes: dict[ParallelLayout, ParallelMesh] = {}
        layout = schedule.layout_at(0)
        self.parallel = HybridParallel(
            model,
            self._mesh(layout),
            loss_fn=loss_fn,
            optimizer_factory=optimizer_factory,
            options=options,
            example_input=self._example_input(layout),
            device=device,
        )
        self.scheduler = scheduler_factory(self.parallel.optimizer)
        self.reshard(self.parallel.dp_index, self.parallel.dp_size)

    @property
    def reads_sharded_checkpoints(self) -> bool:
        """Sharded stages read sharded checkpoint folders themselves (the trainer need not gather them)."""
        return self.parallel.sharded

    @property
    def layout(self) -> ParallelLayout:
        """The layout training runs under now."""
        return self.parallel.layout

    @property
    def optimizer(self) -> Optimizer:
        """This rank's optimizer (over its stage's parameters) in the current layout."""
        return self.parallel.optimizer

    def _mesh(self, layout: ParallelLayout) -> ParallelMesh:
        # One mesh (and its process groups) per layout, reused when the schedule comes back to it.
        if layout not in self._meshes:
            self._meshes[layout] = build_mesh(
                layout, ranks_per_node=self.ranks_per_node, device_type=self.device.type
            )
        return self._meshes[layout]

    def _example_input(self, layout: ParallelLayout) -> torch.Tensor | None:
        if self.options.balance != "time" or layout.pp == 1 or not self.input_shape:
            return None
        micro = self.micro_batches[layout]
        generator = torch.Generator().manual_seed(0)
        return torch.randn(micro, *self.input_shape, generator=generator).to(self.device)

    def layout_for(self, epoch: int, step: int) -> ParallelLayout:
        """The layout the schedule assigns to epoch ``epoch`` / optimizer step ``step``."""
        return self.schedule.layout_at(epoch if self.schedule.unit == "epoch" else step)

    def switch_for(self, epoch: int, step: int) -> ParallelLayout | None:
        """Switch to the layout of (``epoch``, ``step``) if it is not the current one; return it, else None.

        The model and optimizer state go over unchanged; the learning-rate schedule continues at ``step``
        (the optimizer steps done) and the data sampler moves to the new dp axis.
        """
        target = self.layout_for(epoch, step)
        if target == self.layout:
            return None
        self.parallel = switch_layout(
            self.parallel, self._mesh(target), example_input=self._example_input(target)
        )
        self.scheduler = self.scheduler_factory(self.parallel.optimizer)
        continue_schedule(self.scheduler, step)
        self.reshard(self.parallel.dp_index, self.parallel.dp_size)
        return target

    def train_step(self, micro_batches: MicroBatches) -> torch.Tensor:
        """One optimizer step on this replica's batch (its micro-batches joined); the mean loss of the step.

        The pipeline cuts the replica batch into ``parallel.microbatches`` itself.
        """
        self.model.train()
        images = torch.cat([images for images, _ in micro_batches])
        labels = torch.cat([labels for _, labels in micro_batches])
        with self.precision.autocast():
            loss = self.parallel.forward_backward(images, labels)
        self.parallel.optimizer.step()
        self.parallel.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return torch.tensor(loss, device=images.device)

    def eval_model(self) -> nn.Module:
        """Gather the stages into :attr:`model` (weights and averaged BatchNorm statistics) on every rank."""
        self.parallel.full_state_dict()
        return self.model

    def weights_finite(self) -> torch.Tensor:
        """Whether this rank's stage weights (its shards, when sharded) and buffers are finite: what it trains
        and checkpoints; the whole model is only refreshed at a gather (the trainer agrees over ranks)."""
        finite = [local_weights_finite(module) for module in self.parallel.stage_modules]
        return torch.stack(finite).all()

    def state_dict(self) -> dict[str, Any]:
        """The layout-independent form: ``model``, named ``optimizer``, ``layout``; plus the scheduler.

        Sharded stages: ``model`` and ``optimizer`` are this rank's stage shards as a sharded checkpoint holds
        them (every rank writes its own), with no ``layout``: the folder reads as any sharded run's."""
        if self.parallel.sharded:
            model_state, optimizer_state = self.parallel.sharded_state_dict()
            return {
                "model": model_state,
                "optimizer": optimizer_state,
                "scheduler": self._whole_model_schedule(optimizer_state["param_groups"]),
                "scaler": self.precision.scaler.state_dict(),
            }
        full = self.parallel.full_state_dict()
        return {
            "model": full["model"],
            "optimizer": full["optimizer"],
            "layout": full["layout"],
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.precision.scaler.state_dict(),
        }

    def _whole_model_schedule(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        """The scheduler's state as one optimizer with every stage's ``groups`` holds it: this rank's stage
        may hold fewer groups, and a reader under another layout loads it into all of its own."""
        return {
            **self.scheduler.state_dict(),
            "base_lrs": [group["initial_lr"] for group in groups],
            "_last_lr": [group["lr"] for group in groups],
            "lr_lambdas": [None] * len(groups),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a model and optimizer state saved under any layout (or by DDP); the schedule goes on at the
        step. A sharded checkpoint folder (``sharded_dir``, given to sharded stages only) is read by each rank
        for its own stage."""
        if "sharded_dir" in state:
            self.parallel.load_sharded(state["sharded_dir"])
            continue_schedule(self.scheduler, int(state["step"]))
            return
        optimizer_state = state["optimizer"]
        named = (
            optimizer_state
            if is_named_optimizer_state(optimizer_state)
            else named_from_torch_optimizer_state(optimizer_state)
        )
        self.parallel.load_full_state_dict({"model": state["model"], "optimizer": named})
        continue_schedule(self.scheduler, int(state["step"]))
