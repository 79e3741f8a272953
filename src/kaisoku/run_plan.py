"""The run plan: a config resolved on a world, every derived value computed once, every cross-section check.

``kaisoku train`` reads a config (each section checks its own fields, :func:`kaisoku.config.validate`),
then :func:`kaisoku.run_facts.plan_run` gathers what it needs to know of the data (:class:`DataFacts`: the
packed index, the image folder's classes, or the user's dataset) and of the model (:class:`ModelFacts`: its
blocks and layer names, from a build on the meta device) and calls :func:`resolve`, which is pure: no
process group, no files, no model. The :class:`RunPlan` it returns holds the layouts over the run, the per-rank, replica and
micro-batch sizes, the sample shape, task and loss, the steps per epoch, the shuffle and cache settings,
the precision path and the memory planner's inputs. Builders take the plan and re-derive nothing.

Everything that can be known before launch is refused here, before any rank starts: one line, exit 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kaisoku.config import Config
from kaisoku.data.loading.transforms import IMAGENET_MEAN, IMAGENET_STD
from kaisoku.data.node_cache.staging import CacheSettings
from kaisoku.data.order.sampler import check_batch_split
from kaisoku.data.order.shuffle import ShuffleSpec
from kaisoku.distributed.layout import ParallelLayout, SwitchSchedule, check_parallel
from kaisoku.distributed.mesh import DATA_MESH_DIM_NAMES, data_mesh_shape, rank_coordinates
from kaisoku.engine.compile import compile_conflict
from kaisoku.errors import ConfigError
from kaisoku.facts import DataFacts, LossName, ModelFacts, ShardLevel, TaskKind, WorldShape
from kaisoku.memory.checkpointing import parse_block_list
from kaisoku.memory.in_backward import in_backward_conflict
from kaisoku.memory.planner import check_memory_config
from kaisoku.models.vit import check_vit_size
from kaisoku.models.zoo import is_zoo_model
from kaisoku.precision import mode_conflict
from kaisoku.precision.fp8 import fp8_support
from kaisoku.precision.quant import keep_names


@dataclass(frozen=True)
class RunPlan:
    """A config resolved on a world: the one source of every derived value (see the module docstring)."""

    config: Config
    world: WorldShape
    schedule: SwitchSchedule | None
    """The layouts over the run (None in a plan made before the world size was known)."""
    hybrid: bool
    """Pipeline stages or a layout switch (the hybrid engine) rather than plain data parallelism."""
    shard: ShardLevel
    """parallel.shard: none (DDP), grad (ZeRO-2-like) or full (ZeRO-3-like): the sharded engine when not none."""
    mesh_shape: tuple[int, ...]
    """The data-parallel mesh: ``(replicas, shards)`` under sharding (dims :data:`DATA_MESH_DIM_NAMES`),
    the first layout's replicas under pipeline stages, else ``(world size,)``; shards 1 where the world is
    not known."""
    data: DataFacts
    model: ModelFacts
    rank_batch: int
    """Samples a rank (data parallel) or a replica (hybrid, first layout) handles per optimizer step."""
    micro_batch: int
    """Samples per forward pass: rank batch / train.grad_accum, or replica batch / parallel.microbatches."""
    val_batch: int
    """Validation samples per rank and batch: the global batch over every rank (validation shards over all
    ranks, whatever the layout)."""
    layout_micro_batches: dict[ParallelLayout, int]
    """Hybrid: the micro-batch of each layout of the schedule (a switch changes the replica count)."""
    sample_shape: tuple[int, ...]
    """One input sample: ``(C, S, S)`` images, ``(C, D, D, D)`` volumes, or the user's sample shape."""
    task: TaskKind
    loss: LossName
    """cross-entropy, mse, or the user's loss."""
    label_smoothing: float
    steps_per_epoch: int | None
    """Optimizer steps per epoch (None where the number of samples is known only once the data is open)."""
    shuffle: ShuffleSpec
    cache: CacheSettings
    precision_path: Literal["fp32", "autocast", "stats"]
    """How numbers are carried: fp32, autocast (bf16/fp16), or quantized layers (*-stats)."""
    memory_input_shape: tuple[int, ...]
    """The batch shape the memory planner profiles: (micro_batch, *sample_shape)."""
    mean: tuple[float, ...]
    """Per-channel mean (0..1 scale) uint8 image batches are normalised with; () for inputs taken as given."""
    std: tuple[float, ...]
    """Per-channel standard deviation matching :attr:`mean`."""

    def total_steps(self, steps_per_epoch: int) -> tuple[int, int]:
        """``(horizon, total)``: the steps of all configured epochs (the schedule's span) and the steps this
        run trains (capped by train.max_steps)."""
        train = self.config.train
        horizon = max(1, math.ceil(train.epochs * steps_per_epoch))
        return horizon, (min(horizon, train.max_steps) if train.max_steps > 0 else horizon)

    def train_shard(self, rank: int) -> tuple[int, int]:
        """``(shard, shards)`` of the training order ``rank`` reads: ``(rank, world size)``, or under pipeline
        stages ``(replica index, replicas)`` of the first layout (every stage of a replica reads alike)."""
        if self.hybrid and self.schedule is not None:
            first = self.schedule.layout_at(0)
            return rank_coordinates(rank, first, self.world.ranks_per_node)[0], first.dp
        return rank, self.world.world_size

    @property
    def sharded_engine(self) -> bool:
        """The sharded engine (FSDP2 over the data mesh) runs the step; pipeline stages and switch schedules,
        sharded or not, run the hybrid engine."""
        return self.shard != "none" and not self.hybrid

    @property
    def sharded_checkpoints(self) -> bool:
        """Checkpoints are DCP folders of every rank's shards (sharded data parallelism, or pipeline stages
        sharded over their replicas); else one file of whole tensors that rank 0 writes."""
        return self.shard != "none"

    @property
    def engine_name(self) -> str:
        """How the step runs, in words."""
        if self.hybrid:
            return "hybrid (pipeline / switch)" + (
                f", stages sharded ({self.shard})" if self.shard != "none" else ""
            )
        if self.shard != "none":
            return f"sharded data parallel ({self.shard}: {_SHARD_WORDS[self.shard]})"
        return "data parallel"

    @property
    def mesh_description(self) -> str:
        """The data-parallel mesh as ``name=size`` pairs."""
        names = DATA_MESH_DIM_NAMES if self.sharded_engine else ("dp",)
        return " x ".join(f"{name}={size}" for name, size in zip(names, self.mesh_shape))

    @property
    def batch_mapping(self) -> str:
        """What the model gets and what the loss compares with."""
        key, form = self.data.target_key, self.data.batch_form
        if form == "dicts":
            labels = f"labels: batch[{key!r}]; " if key is not None else ""
            return f"model(**batch); {labels}loss(outputs, batch)"
        if form == "nested-pairs":
            return "model(inputs), a dict input as model(**inputs); loss(outputs, targets)"
        return "model(inputs); loss(outputs, targets)"

    @property
    def loss_description(self) -> str:
        """The training loss in words."""
        if self.loss == "user":
            return "user (your own loss)"
        if self.loss == "mse":
            return "the model's own where its output carries one, else mse"
        smoothing = f", label smoothing {self.label_smoothing:g}" if self.label_smoothing else ""
        per = {"token-classification": " per token", "language-model": " per token, shifted"}.get(
            self.task, ""
        )
        return f"the model's own where its output carries one, else cross-entropy{per}{smoothing}"

    @property
    def optimizer_description(self) -> str:
        """The optimizer and its peak learning rate."""
        optim = self.config.optim
        kfac = " + K-FAC" if optim.kfac.enabled else ""
        return f"{optim.name}{kfac}, lr {optim.lr:g}, weight decay {optim.weight_decay:g}"

    @property
    def schedule_description(self) -> str:
        """The learning-rate schedule over the run."""
        sched = self.config.sched
        return f"warmup {sched.warmup_epochs:g} epochs, then {sched.name} over {self.config.train.epochs:g} epochs"

    @property
    def validation_description(self) -> str:
        """The validation set and what it reports."""
        if not self.data.has_val:
            return "none"
        size = f"{self.data.val_samples} samples" if self.data.val_samples else "a split of the data"
        metrics = self.config.train.metrics
        own = f" + {', '.join(m.partition(':')[2] for m in metrics)}" if metrics else ""
        every = self.config.train.val_every
        when = f"every {every} steps" if every else "each epoch"
        return f"{size}, {when}, {self.task} figures{own}"

    def describe(self) -> str:
        """The plan as aligned ``key: value`` lines (``kaisoku train --print-plan``)."""
        rows: list[tuple[str, Any]] = [
            ("world", f"{self.world.world_size} ranks, {self.world.ranks_per_node} per node"),
            ("layouts", str(self.schedule) if self.schedule is not None else "(world size unknown)"),
            ("engine", self.engine_name),
            ("data mesh", self.mesh_description),
            ("data", self.data.description),
            ("model", f"{self.config.model.name} ({self.model.block_count or 'no'} ordered blocks)"),
            ("global batch", self.config.data.global_batch),
            ("rank batch", self.rank_batch),
            ("micro batch", self.micro_batch),
            ("sample shape", list(self.sample_shape)),
            ("task", self.task),
            ("batch", self.batch_mapping),
            ("loss", self.loss_description),
            ("optimizer", self.optimizer_description),
            ("lr schedule", self.schedule_description),
            (
                "total steps",
                self.total_steps(self.steps_per_epoch)[1] if self.steps_per_epoch else "when opened",
            ),
            ("validation", self.validation_description),
            ("steps per epoch", self.steps_per_epoch if self.steps_per_epoch is not None else "when opened"),
            ("shuffle", self.shuffle.name),
            ("node cache", "on" if self.cache.enabled else "off"),
            ("precision", f"{self.config.precision.mode} ({self.precision_path})"),
            ("memory profile batch", list(self.memory_input_shape)),
        ]
        width = max(len(key) for key, _ in rows)
        return "\n".join(f"{key:<{width}}  {value}" for key, value in rows)


# ----------------------------------------------------------------------------------------------------
# Resolve: pure.


def resolve(
    cfg: Config, world: WorldShape | None, data: DataFacts, model: ModelFacts, *, own_loss: bool = False
) -> RunPlan:
    """The :class:`RunPlan` of ``cfg`` on ``world`` (None: not known yet) for this data and model;
    ``own_loss``: the user gave a loss from Python (``train.loss`` names it otherwise).

    Pure: every value comes from the arguments. One-line ConfigError for settings that cannot work together.
    """
    task = _task(cfg, data)
    _check_data_against_model(cfg, data, model, task)
    hybrid = cfg.parallel.hybrid
    shuffle, cache = _data_settings(cfg, world, data)
    schedule = _check_parallel(cfg, world, model, shuffle)
    _check_memory(cfg, model, hybrid)
    precision_path = _check_precision(cfg, model)
    conflict = compile_conflict(cfg.train.compile, hybrid=hybrid, kfac=cfg.optim.kfac.enabled)
    if conflict:
        raise ConfigError(conflict)
    size = world.world_size if world is not None else 1
    mesh_shape = _check_shard(cfg, world, hybrid)
    # One rank has nothing to shard over: it runs (and checkpoints) as plain data parallelism.
    shard: ShardLevel = cfg.parallel.shard if world is None or size > 1 else "none"
    if shard == "none":
        mesh_shape = (size,)
    first = schedule.layout_at(0) if schedule is not None else None
    layout_micro_batches: dict[ParallelLayout, int] = {}
    if hybrid:
        replicas = first.dp if first is not None else max(1, cfg.parallel.dp)
        mesh_shape = (replicas,)  # the data-parallel replicas of the first layout, not every rank
        rank_batch = cfg.data.global_batch // replicas
        micro_batch = max(1, rank_batch // cfg.parallel.microbatches)
        for segment in schedule.segments if schedule is not None else ():
            layout = segment.layout
            layout_micro_batches[layout] = max(
                1, cfg.data.global_batch // layout.dp // cfg.parallel.microbatches
            )
    else:
        rank_batch = cfg.data.global_batch // size
        micro_batch = max(1, rank_batch // cfg.train.grad_accum)
    loss: LossName = (
        "user"
        if own_loss or ":" in cfg.train.loss
        else ("mse" if (cfg.train.loss == "mse" or (cfg.train.loss == "auto" and task == "regression"))
              else "cross-entropy")
    )  # fmt: skip
    steps = data.num_samples // cfg.data.global_batch if data.num_samples else None
    if steps == 0:
        raise ConfigError(
            f"the dataset has {data.num_samples} samples, fewer than one global batch of "
            f"{cfg.data.global_batch}; lower data.global_batch or use a larger dataset"
        )
    sample_shape = model.spec.sample_shape
    return RunPlan(
        config=cfg,
        world=world or WorldShape(),
        schedule=schedule,
        hybrid=hybrid,
        shard=shard,
        mesh_shape=mesh_shape,
        data=data,
        model=model,
        rank_batch=rank_batch,
        micro_batch=micro_batch,
        val_batch=max(1, cfg.data.global_batch // size),
        layout_micro_batches=layout_micro_batches,
        sample_shape=sample_shape,
        task=task,
        loss=loss,
        label_smoothing=cfg.train.label_smoothing,
        steps_per_epoch=steps,
        shuffle=shuffle,
        cache=cache,
        precision_path=precision_path,
        memory_input_shape=(micro_batch, *sample_shape),
        **_normalization(data),
    )


def _normalization(data: DataFacts) -> dict[str, tuple[float, ...]]:
    """How input batches are normalised: uint8 images by ImageNet's statistics (one-channel arrays by 0.5
    and 0.25); volumes and the user's inputs as given."""
    if data.source == "user" or data.task != "classification":
        return {"mean": (), "std": ()}
    if data.in_channels == 3:
        return {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    return {"mean": (0.5,), "std": (0.25,)}


def _data_settings(
    cfg: Config, world: WorldShape | None, data: DataFacts
) -> tuple[ShuffleSpec, CacheSettings]:
    """The shuffle and node-cache settings of ``data.*`` (each checks its own values) and what they need."""
    d = cfg.data
    shuffle = ShuffleSpec(
        name=d.shuffle,
        block_shards=d.block_shards,
        buffer_size=d.buffer_size,
        exchange=d.exchange,
        num_nodes=world.num_nodes if world is not None else 1,
    )
    cache = CacheSettings(
        local_dir=d.local_cache,
        local_capacity=int(d.local_capacity),
        ram_dir=d.ram_dir,
        ram_capacity=int(d.ram_capacity),
    )
    if (shuffle.needs_shards or cache.enabled) and data.source in ("folder", "generated-shapes", "user"):
        where = f"kaisoku pack {data.root} DST and train on DST" if data.root else "pack the dataset first"
        raise ConfigError(
            f"data.shuffle {d.shuffle}, data.local_cache and data.ram_capacity need a packed dataset; {where}"
        )
    if d.decode == "gpu" and (data.source != "packed" or data.task != "classification"):
        what = data.description or "this dataset"
        raise ConfigError(
            f"data.decode gpu decodes packed JPEG images, but {what}; pack the images with kaisoku pack, "
            "or use data.decode cpu"
        )
    if data.source in ("folder", "generated-shapes", "user"):
        shuffle = ShuffleSpec(
            unpacked=True
        )  # samples read one by one: the global order keyed by (seed, epoch)
    return shuffle, cache


def _task(cfg: Config, data: DataFacts) -> TaskKind:
    """``train.task``, resolved: auto takes the data's (read from its targets); a task named explicitly must
    fit the targets (one label per sample, a label per token, or floats)."""
    named = cfg.train.task
    if named == "auto" or named == data.task:
        return data.task
    per_token = ("token-classification", "language-model")
    fits = (
        named == "regression"
        or (named in per_token and data.task in per_token)
        or (named == "classification" and data.task == "classification")
    )
    if not fits:
        what = data.description or "this dataset"
        raise ConfigError(f"train.task {named} does not fit {what}; use train.task auto or {data.task}")
    return named


def _check_data_against_model(cfg: Config, data: DataFacts, model: ModelFacts, task: str) -> None:
    """The dataset against the model and the loss: one line naming both sides."""
    what = data.description
    if data.source != "user" and is_zoo_model(cfg.model.name):
        volumetric = cfg.model.name == "cosmoflow"
        if volumetric and data.task != "regression":
            raise ConfigError(
                f"model.name cosmoflow takes volumes [4, D, D, D] with regression targets, but {what}; "
                "generate a volume set with kaisoku datagen DIR --kind cosmo and pack it"
            )
        if not volumetric and data.task == "regression":
            raise ConfigError(
                f"{what}, but model.name {cfg.model.name} is a 2D image classifier; use --model.name cosmoflow"
            )
        check_vit_size(cfg.model.name, cfg.data.image_size)
    loss = cfg.train.loss
    if loss in ("mse", "cross-entropy") and (loss == "mse") != (task == "regression"):
        raise ConfigError(f"train.loss {loss} does not fit {what}; use train.loss auto")
    if task == "regression" and cfg.train.label_smoothing > 0:
        smoothing = cfg.train.label_smoothing
        raise ConfigError(f"train.label_smoothing {smoothing} is for classification, but {what}; set it to 0")
    if data.batch_form != "pairs" and cfg.parallel.pp > 1:
        given = "dict batches as keyword arguments" if data.batch_form == "dicts" else "nested inputs"
        raise ConfigError(
            f"parallel.pp {cfg.parallel.pp}: pipeline stages pass tensors between them, but {what} gives the "
            f"model {given}; train it with parallel.pp 1 (data parallel or sharded)"
        )
    if data.source == "user" and not data.has_val and cfg.train.val_every > 0:
        raise ConfigError("train.val_every needs a validation set; give the dataset factory's (train, val)")


def _block_count(model: ModelFacts, what: str) -> int:
    """The model's ordered blocks, or a one-line ConfigError saying what ``what`` needs."""
    if model.block_count is None:
        raise ConfigError(f"{what} needs the model's ordered blocks: {model.block_error}")
    return model.block_count


def _check_parallel(
    cfg: Config, world: WorldShape | None, model: ModelFacts, shuffle: ShuffleSpec
) -> SwitchSchedule | None:
    """``parallel.*`` on the world (degrees, batch splits, stages against blocks) and what it excludes."""
    par = cfg.parallel
    what = "parallel.switch" if par.switch.strip() else f"parallel.pp {par.pp}"
    schedule = check_parallel(
        world_size=world.world_size if world is not None else None,
        global_batch=cfg.data.global_batch,
        dp=par.dp,
        pp=par.pp,
        microbatches=par.microbatches,
        schedule=par.schedule,
        virtual_stages=par.virtual_stages,
        switch=par.switch,
        unit=par.switch_unit,
        block_count=lambda: _block_count(model, what),
    )
    if not par.hybrid:
        if world is not None:
            check_batch_split(cfg.data.global_batch, world.world_size, shuffle, cfg.train.grad_accum)
        return schedule
    unsupported = [
        (cfg.train.grad_accum != 1, f"train.grad_accum {cfg.train.grad_accum}: use parallel.microbatches"),
        (cfg.optim.kfac.enabled, "optim.kfac.enabled (K-FAC runs on data parallelism only)"),
        (cfg.precision.mode == "fp16", "precision.mode fp16 (use bf16 or fp32)"),
        (cfg.precision.mode.endswith("-stats"), f"precision.mode {cfg.precision.mode} (use bf16 or fp32)"),
        (cfg.data.shuffle == "partial", f"data.shuffle {cfg.data.shuffle} (use global or block)"),
        (
            bool(cfg.data.local_cache) or int(cfg.data.ram_capacity) > 0,
            "data.local_cache / data.ram_capacity (the node cache plans for data-parallel ranks)",
        ),
        (
            cfg.memory.recompute != "none" or cfg.memory.compress != "none",
            "memory.recompute / memory.compress (they are for data parallelism; set them to none)",
        ),
    ]
    for refused, setting in unsupported:
        if refused:
            raise ConfigError(f"{what} does not work with {setting}")
    _block_count(model, what)
    return schedule


_SHARD_WORDS = {
    "grad": "weights gathered once per step, gradients and optimizer state sharded",
    "full": "weights, gradients and optimizer state sharded, gathered per block",
}


def _check_shard(cfg: Config, world: WorldShape | None, hybrid: bool) -> tuple[int, ...]:
    """``parallel.shard`` and ``parallel.dp_replicate`` on the world and against what sharding excludes;
    the data-parallel mesh shape."""
    par = cfg.parallel
    size = world.world_size if world is not None else None
    if par.shard == "none":
        if cfg.checkpoint.async_save:
            raise ConfigError(
                "checkpoint.async_save writes sharded checkpoints in the background and needs parallel.shard "
                "grad or full (a single-file checkpoint is written by rank 0 as it is)"
            )
        if par.dp_replicate != 1:
            raise ConfigError(
                f"parallel.dp_replicate {par.dp_replicate} needs parallel.shard grad or full (without "
                "sharding every rank is already a replica); set parallel.shard or drop parallel.dp_replicate"
            )
        return (size or 1,)
    shape = data_mesh_shape(size if size is not None else par.dp_replicate, par.dp_replicate)
    what = f"parallel.shard {par.shard}"
    unsupported = [
        (
            hybrid and par.dp_replicate != 1,
            "parallel.dp_replicate under pipeline stages or a switch schedule (each stage shards over all its "
            "replicas; drop it)",
        ),
        (cfg.memory.update_in_backward, "memory.update_in_backward (the sharded step owns the update)"),
        (cfg.optim.kfac.enabled, "optim.kfac.enabled (K-FAC needs whole gradients of each layer)"),
        (cfg.train.compile != "off" or cfg.optim.compile, "train.compile / optim.compile (set them off)"),
        (cfg.precision.mode == "fp16", "precision.mode fp16 (use bf16: sharded mixed precision)"),
        (cfg.precision.mode.endswith("-stats"), f"precision.mode {cfg.precision.mode} (use bf16 or fp32)"),
        (cfg.dist.compress != "none", "dist.compress (a DDP setting; the reduce-scatter runs in fp32)"),
        (
            bool(cfg.memory.budget.strip()),
            "memory.budget (it chooses full sharding itself when memory.allow_shard is on; leave "
            "parallel.shard none)",
        ),
    ]
    for refused, setting in unsupported:
        if refused:
            raise ConfigError(f"{what} does not work with {setting}")
    return shape


def _check_memory(cfg: Config, model: ModelFacts, hybrid: bool) -> None:
    """``memory.*`` against the engine, the optimizer and the model's blocks."""
    mem = cfg.memory
    if mem.update_in_backward:
        conflict = in_backward_conflict(
            optimizer=cfg.optim.name,
            grad_accum=cfg.train.grad_accum,
            kfac=cfg.optim.kfac.enabled,
            hybrid=hybrid,
            precision=cfg.precision.mode,
            on_nonfinite=cfg.train.on_nonfinite,
            compile_mode=cfg.train.compile,
            compile_optimizer=cfg.optim.compile,
        )
        if conflict:
            raise ConfigError(conflict)
    if mem.recompute != "none" and mem.blocks.strip():
        parse_block_list(mem.blocks, _block_count(model, "memory.blocks"))
    check_memory_config(mem, hybrid=hybrid, block_count=lambda: _block_count(model, "memory.policy"))
    if (mem.budget.strip() or mem.policy.strip()) and not hybrid:
        _block_count(model, "memory.budget / memory.policy")


def _check_precision(cfg: Config, model: ModelFacts) -> Literal["fp32", "autocast", "stats"]:
    """``precision.*`` against the device the run will have and the model's layer names."""
    prec = cfg.precision
    device = cfg.train.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    fp8_reason = ""
    if prec.mode == "fp8-stats" and prec.fp8 == "real":
        fp8_reason = (
            fp8_support(torch.device(device)) if device == "cpu" or torch.cuda.is_available() else "no CUDA"
        )
    conflict = mode_conflict(prec.mode, device, prec.fp8, fp8_reason)
    if conflict:
        raise ConfigError(conflict)
    if prec.mode == "fp32":
        return "fp32"
    if not prec.mode.endswith("-stats"):
        return "autocast"
    stats_conflicts = [
        (
            cfg.memory.recompute != "none",
            "memory.recompute (a recomputed forward would round with a moved exponent)",
        ),
        (cfg.train.compile != "off", "train.compile (the scalers keep Python state per call)"),
    ]
    for refused, setting in stats_conflicts:
        if refused:
            raise ConfigError(f"precision.mode {prec.mode} does not work with {setting}; turn it off")
    keep_names(model.layer_names, prec.keep)  # a ConfigError listing the layers for an unknown name
    return "stats"
