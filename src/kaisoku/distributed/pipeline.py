"""Pipeline stages on torch.distributed.pipelining, with data parallelism across pipeline replicas.

A model's ordered blocks (:func:`kaisoku.models.blocks.ordered_blocks`) are split into contiguous stages
balanced by parameter count or by measured time (:func:`partition_blocks`). Each rank of a pipeline
runs its stage (or, for interleaved 1F1B, its ``virtual_stages`` stages) under a torch schedule; after
the schedule the stage's gradients are averaged over the dp sub-group, explicitly, in one flat
all-reduce. A layout with ``pp == 1`` is plain data parallelism: the replica batch runs in one piece.

With ``HybridOptions.shard`` grad or full, each stage's blocks are instead sharded with FSDP2 over the
stage's dp sub-group (:func:`kaisoku.distributed.sharding.shard_stage`): the stage trains a copy of its
blocks whose parameters, gradients and optimizer state are shards, the gradients are reduce-scattered by
FSDP after the last micro-batch, and the whole model (still held by every rank, for evaluation and layout
switches) is refreshed from the gathered shards whenever the full state is gathered. Such a layout checkpoints
as the sharded data-parallel engine does: every rank writes its own stage's shards, keyed by the names of the
whole model (:meth:`HybridParallel.sharded_state_dict`), and reads its own stage's pieces of a checkpoint
written under any layout (:meth:`HybridParallel.load_sharded`). A sharded ``pp == 1`` layout (reached only
through a switch schedule) is one stage of every block, sharded over all the replicas: sharded data
parallelism that a switch can gather and rebuild like any other layout.

The loss of a step is the mean, over every replica and micro-batch, of ``loss_fn`` on that micro-batch;
with a mean-reducing ``loss_fn`` and equal micro-batches that is the gradient of the whole global batch.

BatchNorm policy (pipelines run micro-batches one at a time, so no normalisation can see the whole
replica batch without stalling the pipeline):

* each micro-batch is normalised with its own statistics, as a data-parallel replica whose batch is the
  micro-batch would be ("ghost" batch norm); the forward and backward of a micro-batch do not depend on
  the other micro-batches;
* the running statistics are updated once per micro-batch with the momentum rescaled to
  ``1 - (1 - momentum) ** (1 / m)``, so that one optimizer step moves them as far as one update with the
  model's own momentum does, whatever the number ``m`` of micro-batches (a layout switch keeps the
  running averages' horizon in steps);
* replicas' running statistics are averaged over the dp group whenever the full state is gathered
  (:meth:`HybridParallel.full_state_dict`); the update is linear, so averaging late equals averaging
  every step.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from kaisoku.distributed.layout import check_schedule
from kaisoku.distributed.mesh import ParallelMesh
from kaisoku.distributed.named_state import (
    load_named_optimizer_state,
    merge_named_optimizer_states,
    named_optimizer_state,
    with_param_names,
)
from kaisoku.distributed.partition import measure_block_costs, parameter_costs, partition_blocks
from kaisoku.distributed.sharded_checkpoint import read_named_shards
from kaisoku.distributed.sharding import (
    group_norm_reducer,
    local_part,
    placed_like,
    shard_stage,
    whole_tensor,
)
from kaisoku.errors import ConfigError, KaisokuError
from kaisoku.models.blocks import check_blocks_cover, ordered_blocks, state_names

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: Builds the optimizer of one rank from ``(name, parameter)`` pairs named as in the full model.
OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]

#: Ways to weigh blocks when splitting a model into stages.
BALANCE_NAMES: tuple[str, ...] = ("parameters", "time")
#: How a stage's blocks are held over its dp sub-group: whole (none) or sharded (grad, full).
SHARD_LEVELS: tuple[str, ...] = ("none", "grad", "full")

_BASE_MOMENTUM = "_kaisoku_base_momentum"


def schedules_take_microbatches() -> bool:
    """True where torch's pipeline schedules take pre-split micro-batches. Where they do not (older
    releases), the first step of each schedule also runs every stage's forward once for shape inference,
    which gives BatchNorm running statistics one extra update."""
    from torch.distributed.pipelining import Schedule1F1B

    return _step_arguments(Schedule1F1B)[0]


@functools.cache
def _step_arguments(schedule_class: type) -> tuple[bool, bool]:
    """Whether this torch's ``schedule.step`` takes pre-split micro-batches (``arg_mbs``) and
    ``return_outputs``: older releases take neither and pass unknown keywords on to the model."""
    parameters = inspect.signature(schedule_class.step).parameters
    return "arg_mbs" in parameters, "return_outputs" in parameters


# --------------------------------------------------------------------------------------------------
# Pure pieces: partition, micro-batch checks, BatchNorm momentum.
# --------------------------------------------------------------------------------------------------


def check_microbatches(batch_size: int, microbatches: int) -> int:
    """The micro-batch size; a one-line :class:`KaisokuError` unless ``microbatches`` divides the batch."""
    if microbatches < 1:
        raise ConfigError(f"parallel.microbatches must be at least 1, got {microbatches}")
    if batch_size % microbatches != 0:
        raise KaisokuError(
            f"a replica batch of {batch_size} samples does not split into {microbatches} equal micro-batches; "
            f"make the per-replica batch a multiple of {microbatches} (or change parallel.microbatches)"
        )
    return batch_size // microbatches


def replica_batch_slice(global_batch: int, dp_index: int, dp_size: int) -> slice:
    """The samples of a global batch that replica ``dp_index`` of ``dp_size`` trains on (contiguous)."""
    if global_batch % dp_size != 0:
        raise KaisokuError(
            f"a global batch of {global_batch} samples does not split into dp {dp_size} equal replica batches; "
            f"make the batch a multiple of {dp_size}"
        )
    size = global_batch // dp_size
    return slice(dp_index * size, (dp_index + 1) * size)


def microbatch_momentum(momentum: float, microbatches: int) -> float:
    """The per-micro-batch BatchNorm momentum that moves running statistics as far per step as ``momentum``."""
    return 1.0 - (1.0 - momentum) ** (1.0 / microbatches)


def apply_batchnorm_policy(module: nn.Module, microbatches: int) -> int:
    """Set every BatchNorm's momentum for ``microbatches`` updates per step; return how many were set.

    The model's own momentum is kept on the module, so applying the policy again (another layout, another
    micro-batch count) starts from it; :func:`restore_batchnorm_momentum` puts it back.
    """
    count = 0
    for bn in module.modules():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            base = getattr(bn, _BASE_MOMENTUM, bn.momentum)
            setattr(bn, _BASE_MOMENTUM, base)
            # momentum None is a cumulative average over all updates: already independent of m.
            bn.momentum = None if base is None else microbatch_momentum(base, microbatches)
            count += 1
    return count


def restore_batchnorm_momentum(module: nn.Module) -> None:
    """Undo :func:`apply_batchnorm_policy`."""
    for bn in module.modules():
        if isinstance(bn, nn.modules.batchnorm._BatchNorm) and hasattr(bn, _BASE_MOMENTUM):
            bn.momentum = getattr(bn, _BASE_MOMENTUM)
            delattr(bn, _BASE_MOMENTUM)


# --------------------------------------------------------------------------------------------------
# The trainer-facing object.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HybridOptions:
    """How a layout runs; the same options serve every layout of a switch schedule."""

    microbatches: int = 4
    """Micro-batches per replica batch in layouts with pp > 1 (pp = 1 runs the replica batch whole)."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b or interleaved-1f1b."""
    virtual_stages: int = 1
    """Stages per rank for interleaved-1f1b (>= 2 to interleave); 1 for the other schedules."""
    balance: str = "parameters"
    """Weigh blocks by parameter count ("parameters") or by measured forward+backward time ("time")."""
    shard: str = "none"
    """none: whole stages, gradients averaged over dp; grad / full: each stage's blocks sharded over its dp
    sub-group (FSDP2; full also reshards the weights after each block's forward)."""
    precision: str = "fp32"
    """precision.mode: under bf16 the sharded blocks are gathered in bf16 (see :func:`shard_stage`)."""

    def __post_init__(self) -> None:
        if self.balance not in BALANCE_NAMES:
            raise ConfigError(
                f"unknown parallel.balance '{self.balance}'; choose one of: {', '.join(BALANCE_NAMES)}"
            )
        if self.shard not in SHARD_LEVELS:
            raise ConfigError(
                f"unknown parallel.shard '{self.shard}'; choose one of: {', '.join(SHARD_LEVELS)}"
            )
        check_schedule(self.schedule, 1, self.microbatches, self.virtual_stages)


class StageModule(nn.Module):
    """Consecutive blocks of a model run as one pipeline stage (the blocks are the model's own)."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the blocks in order; the result is made contiguous, as point-to-point sends require."""
        for block in self.blocks:
            x = block(x)
        return x.contiguous()


class HybridParallel:
    """``model`` trained under one layout: this rank's stage(s), their optimizer, the dp gradient average.

    Every rank holds the whole ``model`` (built identically, or made identical here from rank 0 when
    ``sync_initial_state``): that is what lets any layout be rebuilt from it. Gradients and optimizer state
    exist only for this rank's stage. Every rank of a replica is handed the replica's batch; the first
    stage reads the inputs, the last the targets.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: ParallelMesh,
        *,
        loss_fn: LossFn,
        optimizer_factory: OptimizerFactory,
        options: HybridOptions | None = None,
        example_input: torch.Tensor | None = None,
        device: torch.device | None = None,
        sync_initial_state: bool = True,
    ) -> None:
        self.model = model
        self.mesh = mesh
        self.layout = mesh.layout
        self.loss_fn = loss_fn
        self.optimizer_factory = optimizer_factory
        self.options = options or HybridOptions()
        self.device = device or torch.device("cpu")
        opts = self.options
        pp = self.layout.pp
        check_schedule(opts.schedule, pp, opts.microbatches, opts.virtual_stages)
        if sync_initial_state:
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
        self._names = state_names(model)
        self._order = list(model.state_dict().keys())
        self._schedules: dict[tuple[Any, ...], tuple[Any, list[Any]]] = {}
        self.sharded = opts.shard != "none"

        self.stage_indices: list[int] = [0]
        self.stage_modules: list[nn.Module] = [model]
        self.stage_ranges: list[range] = []
        if pp == 1:
            restore_batchnorm_momentum(model)  # whole replica batches: the model's own momentum
        if pp > 1 or self.sharded:
            blocks = ordered_blocks(model)
            check_blocks_cover(model, blocks)
            if pp == 1:
                # Sharded data parallelism inside a switch schedule: one stage of every block, sharded over
                # all the replicas (a run without stages and switches uses the sharded data-parallel engine).
                self.stage_ranges = [range(len(blocks))]
            else:
                num_stages = pp * opts.virtual_stages
                self.stage_ranges = partition_blocks(self._block_costs(blocks, example_input), num_stages)
                # Interleaved ("loop") placement: stage s lives on pipeline rank s % pp.
                self.stage_indices = list(range(mesh.pp_index, num_stages, pp))
            self.stage_modules = [
                StageModule([blocks[i] for i in self.stage_ranges[s]]) for s in self.stage_indices
            ]
            if self.sharded:
                # The stage trains copies: the model keeps whole tensors, for evaluation and switching.
                self.stage_modules = [copy.deepcopy(module) for module in self.stage_modules]
            if pp > 1:
                for module in self.stage_modules:
                    apply_batchnorm_policy(module, opts.microbatches)
        # Each stage tensor's name in the model, by its name in the stage (which sharding keeps).
        self._stage_names: list[dict[str, str]] = [
            self._fqn_names(module, original)
            for module, original in zip(self.stage_modules, self._original_stages())
        ]
        if self.sharded:
            level = "full" if opts.shard == "full" else "grad"
            dp_mesh = mesh.mesh["dp"]
            for module in self.stage_modules:
                assert isinstance(module, StageModule)
                shard_stage(module, list(module.blocks), dp_mesh, level=level, precision_mode=opts.precision)
        self.num_stages = pp * (opts.virtual_stages if pp > 1 else 1)
        self.holds_first = 0 in self.stage_indices
        self.holds_last = self.num_stages - 1 in self.stage_indices
        self.named_parameters: list[tuple[str, nn.Parameter]] = self._stage_parameters()
        # The optimizer's parameters by name (sharding replaces the parameter objects of the stage).
        self._param_names: dict[int, str] = {id(p): name for name, p in self.named_parameters}
        self.optimizer = optimizer_factory(list(self.named_parameters))
        if self.sharded and hasattr(self.optimizer, "reduce_norms_with"):
            # LARS / LAMB: a layer's norm is the norm of its whole parameter, summed over the shards.
            self.optimizer.reduce_norms_with(group_norm_reducer(mesh.dp_group))

    # ---------------------------------------------------------------- properties and helpers

    @property
    def dp_index(self) -> int:
        """This rank's replica: the data shard it trains on (shard count: ``dp_size``)."""
        return self.mesh.dp_index

    @property
    def dp_size(self) -> int:
        """The number of replicas: how many data shards a global batch is cut into."""
        return self.layout.dp

    def _original_stages(self) -> list[nn.Module]:
        """The stages made of the model's own blocks (what sharded stages were copied from)."""
        if not self.stage_ranges:  # unsharded pp == 1: the model itself
            return [self.model]
        blocks = ordered_blocks(self.model)
        return [StageModule([blocks[i] for i in self.stage_ranges[s]]) for s in self.stage_indices]

    def _fqn_names(self, module: nn.Module, original: nn.Module) -> dict[str, str]:
        # A copy lists its tensors in the order of the original, under the same names.
        names = {}
        for (fqn, _), tensor in zip(
            module.state_dict(keep_vars=True).items(), original.state_dict(keep_vars=True).values()
        ):
            if id(tensor) in self._names:
                names[fqn] = self._names[id(tensor)]
        return names

    def _stage_parameters(self) -> list[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        named = []
        for module, names in zip(self.stage_modules, self._stage_names):
            for fqn, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    named.append((names[fqn], p))
        order = {name: i for i, name in enumerate(self._order)}
        return sorted(named, key=lambda item: order[item[0]])

    def _stage_tensors(self, *, keep_vars: bool = True) -> dict[str, torch.Tensor]:
        """This rank's stage tensors by their names in the model (sharded parameters as DTensors);
        ``keep_vars`` False: detached views of them, which a load may write into."""
        tensors: dict[str, torch.Tensor] = {}
        for module, names in zip(self.stage_modules, self._stage_names):
            for fqn, tensor in module.state_dict(keep_vars=keep_vars).items():
                if fqn in names:
                    tensors[names[fqn]] = tensor
        return tensors

    def _block_costs(self, blocks: list[nn.Module], example_input: torch.Tensor | None) -> list[float]:
        if self.options.balance == "parameters":
            return parameter_costs(blocks)
        if example_input is None:
            raise ConfigError("parallel.balance 'time' needs an example micro-batch to time the blocks")
        # One rank measures (the others wait in the broadcast) so that every rank splits alike.
        costs = torch.zeros(len(blocks), dtype=torch.float64)
        if dist.get_rank() == 0:
            costs = torch.tensor(measure_block_costs(blocks, example_input), dtype=torch.float64)
        dist.broadcast(costs, src=0)
        return costs.tolist()

    def _build_schedule(self, inputs: torch.Tensor) -> tuple[Any, list[Any]]:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        opts = self.options
        stages = [
            PipelineStage(module, index, self.num_stages, self.device, group=self.mesh.pp_group)
            for module, index in zip(self.stage_modules, self.stage_indices)
        ]
        if opts.schedule == "interleaved-1f1b":
            schedule: Any = ScheduleInterleaved1F1B(stages, opts.microbatches, loss_fn=self.loss_fn)
        else:
            single = ScheduleGPipe if opts.schedule == "gpipe" else Schedule1F1B
            schedule = single(stages[0], opts.microbatches, loss_fn=self.loss_fn)
        return schedule, stages

    # ---------------------------------------------------------------- training

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of this replica's batch; gradients averaged over the replicas.

        Returns the step's loss, the same on every rank: the mean over replicas and micro-batches.
        """
        batch = int(targets.shape[0])
        if int(inputs.shape[0]) != batch:
            raise KaisokuError(f"inputs hold {inputs.shape[0]} samples but targets {batch}")
        if self.layout.pp == 1:
            # The model itself, or its sharded copy (whose backward reduce-scatters the gradients).
            loss = self.loss_fn(self.stage_modules[0](inputs.to(self.device)), targets.to(self.device))
            loss.backward()
            local = loss.detach().reshape(1).to(torch.float64).cpu()
        else:
            local = self.pipeline_step(inputs, targets)
        if not self.sharded:  # sharded stages: FSDP reduce-scattered the gradients after the last micro-batch
            self._average_gradients()
        # Only last-stage ranks hold a loss; one small world all-reduce hands it to everyone.
        dist.all_reduce(local)
        return float(local.item()) / self.layout.dp

    def pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run the pipeline schedule alone on a replica batch (layouts with pp > 1).

        No gradient averaging and no loss reduction: returns this rank's mean micro-batch loss as a
        one-element float64 tensor (zero on ranks without the last stage). :meth:`forward_backward` is the
        whole step; this piece is what a bubble measurement times.
        """
        m = self.options.microbatches
        size = check_microbatches(int(targets.shape[0]), m)
        key = (tuple(inputs.shape), inputs.dtype)
        if key not in self._schedules:
            # Stage metadata (shapes) is fixed at the first step of a schedule: one per batch shape.
            self._schedules[key] = self._build_schedule(inputs)
        schedule, _ = self._schedules[key]
        kwargs: dict[str, Any] = {}
        args: tuple[torch.Tensor, ...] = ()
        losses: list[torch.Tensor] = []
        pre_split, return_outputs = _step_arguments(type(schedule))
        if pre_split:
            if self.holds_first:
                kwargs["arg_mbs"] = [(inputs[i * size : (i + 1) * size].to(self.device),) for i in range(m)]
            if self.holds_last:
                kwargs["target_mbs"] = [targets[i * size : (i + 1) * size].to(self.device) for i in range(m)]
        else:  # older torch splits the whole batch itself, into the same equal chunks
            if self.holds_first:
                args = (inputs.to(self.device),)
            if self.holds_last:
                kwargs["target"] = targets.to(self.device)
        if self.holds_last:
            kwargs["losses"] = losses
        if return_outputs:
            kwargs["return_outputs"] = False
        schedule.step(*args, **kwargs)
        if self.holds_last:
            return torch.stack([loss.detach() for loss in losses]).mean().reshape(1).to(torch.float64).cpu()
        return torch.zeros(1, dtype=torch.float64)

    def _average_gradients(self) -> None:
        if self.layout.dp == 1:
            return
        params = [p for _, p in self.named_parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                # Keep the flat buffer the same on every replica even if a parameter went unused.
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.mesh.dp_group)
        flat.div_(self.layout.dp)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the whole model's gradient norm (over every stage) to ``max_norm``; return the norm."""
        grads = [p.grad for _, p in self.named_parameters if p.grad is not None]
        squares = torch.zeros(1, dtype=torch.float64)
        for grad in grads:
            squares += local_part(grad).detach().double().pow(2).sum().cpu()
        if self.sharded and self.layout.dp > 1:  # each rank holds a shard of its stage's gradients
            dist.all_reduce(squares, group=self.mesh.dp_group)
        if self.layout.pp > 1:
            dist.all_reduce(squares, group=self.mesh.pp_group)
        norm = float(squares.sqrt().item())
        if norm > max_norm:
            for grad in grads:
                grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def train_step(
        self, inputs: torch.Tensor, targets: torch.Tensor, max_grad_norm: float | None = None
    ) -> float:
        """One optimizer step on this replica's batch; returns the step's loss (same on every rank)."""
        loss = self.forward_backward(inputs, targets)
        if max_grad_norm is not None:
            self.clip_grad_norm_(max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    # ---------------------------------------------------------------- state

    def sync_buffers(self) -> None:
        """Average floating-point buffers (BatchNorm running statistics) of this stage over the replicas."""
        if self.layout.dp == 1:
            return
        buffers = [
            t
            for name, t in self._stage_tensors().items()
            if t.is_floating_point() and not isinstance(t, nn.Parameter)
        ]
        if not buffers:
            return
        flat = _flatten_dense_tensors([b.detach() for b in buffers])
        dist.all_reduce(flat, group=self.mesh.dp_group)
        flat.div_(self.layout.dp)
        with torch.no_grad():
            for buffer, reduced in zip(buffers, _unflatten_dense_tensors(flat, buffers)):
                buffer.copy_(reduced)

    def full_state_dict(self) -> dict[str, Any]:
        """Gather the whole model and optimizer state, named as in the model, onto every rank.

        Afterwards ``self.model`` holds the current weights on every rank (use it to evaluate). The result
        does not depend on the layout: ``{"model": state_dict, "optimizer": named form, "layout": str}``.
        """
        self.sync_buffers()
        mine: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        if self.sharded:
            # Gathering shards is a collective of the stage's dp sub-group: every replica takes part.
            tensors = {name: whole_tensor(t, self.device) for name, t in self._stage_tensors().items()}
            named = named_optimizer_state(self.optimizer, self._param_names)
            for per_param in named["state"].values():
                for key, value in per_param.items():
                    per_param[key] = whole_tensor(value, self.device)
            if self.dp_index == 0:
                mine = (tensors, named)
        elif self.dp_index == 0:
            tensors = {name: t.detach().cpu().clone() for name, t in self._stage_tensors().items()}
            mine = (tensors, named_optimizer_state(self.optimizer, self._param_names))
        model_state = {name: t.detach().cpu().clone() for name, t in self.model.state_dict().items()}
        parts: list[dict[str, Any]] = []
        for pp_index in range(self.layout.pp):
            box: list[Any] = [mine if self.mesh.pp_index == pp_index else None]
            dist.broadcast_object_list(box, src=self.mesh.stage_owner(pp_index))
            tensors, named = box[0]
            model_state.update(tensors)
            parts.append(named)
        ordered = {name: model_state[name] for name in self._order}
        self.model.load_state_dict(ordered)
        return {
            "model": ordered,
            "optimizer": merge_named_optimizer_states(parts, self._order),
            "layout": str(self.layout),
        }

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`full_state_dict` (from any layout) on every rank."""
        self.model.load_state_dict(state["model"])
        named = state["optimizer"]
        if self.sharded:
            # Each rank keeps its own pieces of the whole tensors (no communication).
            for module, names in zip(self.stage_modules, self._stage_names):
                current = module.state_dict()
                module.load_state_dict(
                    {fqn: placed_like(state["model"][name], current[fqn]) for fqn, name in names.items()}
                )
            shapes = {name: p for name, p in self.named_parameters}
            named = {
                "param_groups": named["param_groups"],
                "state": {
                    name: {
                        key: placed_like(value, shapes[name])
                        if isinstance(value, torch.Tensor) and value.shape == shapes[name].shape
                        else value
                        for key, value in per_param.items()
                    }
                    for name, per_param in named["state"].items()
                    if name in shapes
                },
            }
        load_named_optimizer_state(self.optimizer, named, self._param_names)

    def sharded_state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(model, optimizer)`` state of this rank's stage as a sharded checkpoint holds it
        (:func:`kaisoku.distributed.sharded_checkpoint.sharded_state`'s keys): tensors named as in the whole
        model, sharded parameters and their optimizer slots as this rank's DTensor shards (not copied), and
        the parameter groups of every stage merged (the same on every rank, as one model's optimizer lists
        them). A collective (the stages' groups are exchanged; buffers averaged over the replicas first)."""
        self.sync_buffers()
        tensors = self._stage_tensors(keep_vars=False)
        named = named_optimizer_state(self.optimizer, self._param_names, snapshot=False)
        stage_groups: list[Any] = [None] * self.layout.pp
        dist.all_gather_object(stage_groups, named["param_groups"], group=self.mesh.pp_group)
        parts = [{"state": {}, "param_groups": groups} for groups in stage_groups]
        merged = merge_named_optimizer_states(parts, self._order)["param_groups"]
        return tensors, with_param_names({"state": named["state"], "param_groups": merged})

    def load_sharded(self, folder: str | Path) -> None:
        """Read this rank's stage from the sharded checkpoint ``folder`` (written under any layout): its
        tensors' pieces and its parameters' optimizer state, by name. A collective of every rank.

        The whole ``model`` that every rank holds is refreshed at the next gather
        (:meth:`full_state_dict`), as during training."""
        parameters = {name: p for name, p in self.named_parameters}
        named = read_named_shards(folder, self._stage_tensors(keep_vars=False), parameters)
        load_named_optimizer_state(self.optimizer, named, self._param_names)

    def close(self) -> None:
        """Give the model back as it was built (BatchNorm momentum restored); drop stages and optimizer."""
        for module in self.stage_modules:
            restore_batchnorm_momentum(module)
        self._schedules.clear()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.model.parameters():
            p.grad = None
