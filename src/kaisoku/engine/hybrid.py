"""Hybrid data x pipeline parallelism and switch-parallel for the trainer.

``parallel.pp > 1`` or a ``parallel.switch`` schedule trains the model through
:class:`~kaisoku.distributed.pipeline.HybridParallel` instead of DDP. :class:`HybridEngine` is what the
trainer holds then: one step on a replica batch, the layout switch when the schedule says so (with the
learning-rate schedule carried over), the gathered model for validation and checkpoints in the
layout-independent form (the model's own ``state_dict`` names, an optimizer state keyed by the same
names), so a run saved under one layout resumes under any other, DDP included.

The data follows the dp axis: the sampler's rank is the replica index and its world the replica count,
so every rank of a pipeline reads its replica's batch; the global batch stays fixed whatever the layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from kaisoku.distributed.mesh import ParallelLayout, ParallelMesh, build_mesh, rank_coordinates
from kaisoku.distributed.pipeline import (
    HybridOptions,
    HybridParallel,
    LossFn,
    check_schedule,
    partition_blocks,
)
from kaisoku.distributed.switch import SwitchSchedule, SwitchSegment, parse_switch_schedule, switch_layout
from kaisoku.errors import ConfigError, KaisokuError
from kaisoku.models.blocks import check_blocks_cover, ordered_blocks

if TYPE_CHECKING:
    from kaisoku.config import Config, ParallelConfig

#: Builds a stage's optimizer from ``(name, parameter)`` pairs named as in the whole model.
OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], Optimizer]
#: Builds the per-step learning-rate scheduler of an optimizer.
SchedulerFactory = Callable[[Optimizer], LambdaLR]
#: Points the training sampler at shard ``rank`` of ``world_size`` (the replica index and count).
Reshard = Callable[[int, int], None]


# --------------------------------------------------------------------------------------------------
# Checks: world-independent (config validation) and against the world (at start).
# --------------------------------------------------------------------------------------------------


def hybrid_options(par: ParallelConfig) -> HybridOptions:
    """The :class:`HybridOptions` of ``parallel.*``."""
    return HybridOptions(
        microbatches=par.microbatches,
        schedule=par.schedule,
        virtual_stages=par.virtual_stages,
        balance=par.balance,
    )


def check_layout_batch(global_batch: int, layout: ParallelLayout, microbatches: int) -> None:
    """A one-line ConfigError unless the global batch splits into ``layout``'s replicas and micro-batches."""
    if global_batch % layout.dp:
        raise ConfigError(
            f"data.global_batch {global_batch} does not split into {layout.dp} replica batches "
            f"(layout {layout}); use a multiple of {layout.dp}"
        )
    replica = global_batch // layout.dp
    if layout.pp > 1 and replica % microbatches:
        raise ConfigError(
            f"the replica batch of {replica} samples (data.global_batch {global_batch} / dp {layout.dp}, "
            f"layout {layout}) does not split into parallel.microbatches {microbatches} equal micro-batches; "
            f"make data.global_batch a multiple of {layout.dp * microbatches}"
        )


def _check_layouts(cfg: Config, layouts: Sequence[ParallelLayout]) -> None:
    par = cfg.parallel
    for layout in layouts:
        check_schedule(par.schedule, layout.pp, par.microbatches, par.virtual_stages)
        check_layout_batch(cfg.data.global_batch, layout, par.microbatches)


def known_world_size(cfg: Config) -> int | None:
    """The world size a run of ``cfg`` will have, where it is known before launching; else None.

    Inside torchrun or a Slurm step it is the launcher's world; otherwise ``dist.nproc`` when set (one
    node launched by kaisoku itself).
    """
    from kaisoku.distributed.env import inside_slurm_step, inside_torchrun, world_from_env

    if inside_torchrun() or inside_slurm_step():
        return world_from_env().world_size
    return cfg.dist.nproc or None


def check_parallel_config(cfg: Config) -> None:
    """Everything about ``parallel.*`` that can be checked before launching; one-line ConfigErrors.

    Called by config validation when pp > 1, a switch schedule or dp is set. Checks the schedule text,
    the pipeline schedule, batch splits, the features a hybrid run does not support, the model's blocks
    against the stages, and dp x pp against the world where the world size is known already.
    """
    par = cfg.parallel
    if not par.hybrid:
        world = known_world_size(cfg)
        if world is not None:
            ParallelLayout.resolve(world, dp=par.dp, pp=par.pp)  # plain DDP: dp must be the world
        return
    hybrid_options(par)
    if par.switch.strip():
        schedule = parse_switch_schedule(par.switch, par.switch_unit)
        layouts = [segment.layout for segment in schedule.segments]
    else:
        check_schedule(par.schedule, par.pp, par.microbatches, par.virtual_stages)
        layouts = [ParallelLayout(dp=par.dp, pp=par.pp)] if par.dp != -1 else []
    world = known_world_size(cfg)
    if world is not None:
        layouts = [segment.layout for segment in resolve_schedule(cfg, world).segments]
    _check_layouts(cfg, layouts)
    what = "parallel.switch" if par.switch.strip() else f"parallel.pp {par.pp}"
    unsupported = [
        (cfg.train.grad_accum != 1, f"train.grad_accum {cfg.train.grad_accum}: use parallel.microbatches"),
        (cfg.optim.kfac.enabled, "optim.kfac.enabled (K-FAC runs on data parallelism only)"),
        (cfg.train.precision == "fp16", "train.precision fp16 (use bf16 or fp32)"),
        (cfg.data.shuffle == "partial", "data.shuffle partial (use global or block)"),
        (bool(cfg.data.local_cache), "data.local_cache (the node cache plans for data-parallel ranks)"),
        (
            cfg.data.ram_capacity not in ("", "0"),
            "data.ram_capacity (the node cache plans for data-parallel ranks)",
        ),
    ]
    for refused, setting in unsupported:
        if refused:
            raise ConfigError(f"{what} does not work with {setting}")
    pipelines = [layout for layout in layouts if layout.pp > 1]
    if not layouts and par.pp > 1:
        pipelines = [ParallelLayout(dp=1, pp=par.pp)]  # dp comes from the world; the stages do not
    if pipelines:
        count = model_block_count(cfg)
        for layout in pipelines:
            check_stage_count(count, layout, par.virtual_stages)


def model_block_count(cfg: Config) -> int:
    """How many blocks ``model.name`` splits into (built on the meta device: no memory, no init cost)."""
    from kaisoku.models.zoo import build_model

    with torch.device("meta"):
        model = build_model(
            cfg.model.name,
            num_classes=cfg.model.num_classes or 10,
            stem=cfg.model.stem,
            zero_init_residual=cfg.model.zero_init_residual,
            bn_momentum=cfg.model.bn_momentum,
        )
    return len(ordered_blocks(model))


def check_stage_count(blocks: int, layout: ParallelLayout, virtual_stages: int) -> None:
    """A one-line ConfigError when ``layout`` asks for more pipeline stages than the model has blocks."""
    stages = layout.pp * virtual_stages
    if layout.pp > 1 and stages > blocks:
        raise ConfigError(
            f"layout {layout} needs {stages} pipeline stages (pp {layout.pp} x parallel.virtual_stages "
            f"{virtual_stages}) but the model has only {blocks} blocks; use at most {blocks} stages"
        )


def resolve_schedule(cfg: Config, world_size: int) -> SwitchSchedule:
    """The layouts of a hybrid run on ``world_size`` ranks: the switch schedule, or dp x pp throughout.

    One-line ConfigErrors show the arithmetic: dp x pp against the world, batch splits per layout.
    """
    par = cfg.parallel
    if world_size < 2:
        what = f"parallel.switch '{par.switch}'" if par.switch.strip() else f"parallel.pp {par.pp}"
        raise ConfigError(
            f"{what} needs a world of at least 2 ranks, this one has {world_size}; "
            "launch more ranks (--nproc) or leave parallel.* at its defaults"
        )
    if par.switch.strip():
        schedule = parse_switch_schedule(par.switch, par.switch_unit)
        schedule.check_world(world_size)
    else:
        layout = ParallelLayout.resolve(world_size, dp=par.dp, pp=par.pp)
        schedule = SwitchSchedule((SwitchSegment(layout, 0, None),), par.switch_unit)
    _check_layouts(cfg, [segment.layout for segment in schedule.segments])
    return schedule


def check_model_stages(model: nn.Module, schedule: SwitchSchedule, virtual_stages: int) -> None:
    """The built model splits into every pipeline layout of ``schedule`` (blocks cover it, enough of them)."""
    layouts = [segment.layout for segment in schedule.segments if segment.layout.pp > 1]
    if not layouts:
        return
    blocks = ordered_blocks(model)
    check_blocks_cover(model, blocks)
    for layout in layouts:
        check_stage_count(len(blocks), layout, virtual_stages)
        partition_blocks([1.0] * len(blocks), layout.pp * virtual_stages)


def data_shard(rank: int, layout: ParallelLayout, ranks_per_node: int | None) -> tuple[int, int]:
    """``(shard, shards)`` the training sampler of global ``rank`` reads under ``layout``: (dp index, dp)."""
    dp_index, _ = rank_coordinates(rank, layout, ranks_per_node)
    return dp_index, layout.dp


def reshard_sampler(sampler: Any, rank: int, world_size: int) -> None:
    """Point a training sampler (an EpochBatchSampler, or a ShardLoader's EpochSampler) at another shard.

    Both read ``rank`` and ``world_size`` afresh at the start of every pass, which the trainer begins
    right after a switch.
    """
    target = getattr(sampler, "sampler", sampler)
    if not hasattr(target, "rank") or not hasattr(target, "world_size"):
        raise KaisokuError(f"the training sampler {type(sampler).__name__} cannot follow a layout switch")
    target.rank = rank
    target.world_size = world_size


# --------------------------------------------------------------------------------------------------
# Learning rate and optimizer state across layouts.
# --------------------------------------------------------------------------------------------------


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


def is_named_optimizer_state(state: dict[str, Any]) -> bool:
    """True for the layout-independent form (parameters named, not numbered)."""
    return all(isinstance(p, str) for group in state["param_groups"] for p in group["params"])


def named_from_torch_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """A torch ``optimizer.state_dict()`` (parameters numbered) in the named form, from its ``param_names``.

    Optimizers built by :mod:`kaisoku.optim.factory` list their parameters' names in every group.
    """
    index_to_name: dict[int, str] = {}
    groups = []
    for group in state["param_groups"]:
        names = group.get("param_names")
        if names is None or len(names) != len(group["params"]):
            raise KaisokuError(
                "the checkpoint's optimizer state does not name its parameters; it cannot load into "
                "another parallel layout"
            )
        index_to_name.update(zip(group["params"], names))
        hyper = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        groups.append({**hyper, "params": list(names)})
    return {"state": {index_to_name[i]: s for i, s in state["state"].items()}, "param_groups": groups}


# --------------------------------------------------------------------------------------------------
# The trainer's handle.
# --------------------------------------------------------------------------------------------------


class HybridEngine:
    """``model`` trained under the layouts of a switch schedule, as the trainer drives it.

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
        ranks_per_node: int | None = None,
        global_batch: int = 0,
        input_shape: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.schedule = schedule
        self.options = options
        self.scheduler_factory = scheduler_factory
        self.reshard = reshard
        self.device = device
        self.ranks_per_node = ranks_per_node
        self.global_batch = global_batch
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
        micro = max(1, self.global_batch // layout.dp // self.options.microbatches)
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

    def train_step(
        self, images: torch.Tensor, labels: torch.Tensor, autocast: contextlib.AbstractContextManager[Any]
    ) -> float:
        """One optimizer step on this replica's batch; the step's mean loss, the same on every rank."""
        with autocast:
            loss = self.parallel.forward_backward(images, labels)
        self.parallel.optimizer.step()
        self.parallel.optimizer.zero_grad(set_to_none=True)
        return loss

    def gather(self) -> None:
        """Make :attr:`model` hold the current weights (and averaged BatchNorm statistics) on every rank."""
        self.parallel.full_state_dict()

    def full_state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer", "layout"}`` in the layout-independent form, on every rank."""
        return self.parallel.full_state_dict()

    def load_state(self, model_state: dict[str, Any], optimizer_state: dict[str, Any], step: int) -> None:
        """Load a model and optimizer state saved under any layout (or by DDP); the schedule goes on at ``step``."""
        named = (
            optimizer_state
            if is_named_optimizer_state(optimizer_state)
            else named_from_torch_optimizer_state(optimizer_state)
        )
        self.parallel.load_full_state_dict({"model": model_state, "optimizer": named})
        continue_schedule(self.scheduler, step)
