"""Build every part of a run from its resolved plan, in one place, and hand them to the trainer.

:func:`build_trainer` resolves the config on this rank's world (:func:`kaisoku.run_plan.plan_run`), then
each builder takes the plan: the data (:func:`~kaisoku.engine.data_build.build_data`), the model and its
precision (:func:`build_model_for`), the step engine (:func:`build_data_parallel_engine`,
:func:`build_sharded_engine` or :func:`build_hybrid_engine`), the trainer. The user's own model, dataset and loss enter here
(:class:`~kaisoku.parts.UserParts`) and get every feature the zoo's do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch import nn

from kaisoku.config import Config, to_dict
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.distributed import env
from kaisoku.distributed.data_parallel import BucketPlan, wrap_ddp
from kaisoku.distributed.gather_time import gather_scatter_seconds
from kaisoku.distributed.mesh import build_data_mesh
from kaisoku.distributed.pipeline import HybridOptions
from kaisoku.distributed.sharding import shard_model, shard_norm_reducer
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.engine.checkpoint_resume import resume_trainer
from kaisoku.engine.checksums import tensor_digest
from kaisoku.engine.compile import compile_run, synthetic_batch
from kaisoku.engine.data_build import BatchPairs, DataParts, build_data
from kaisoku.engine.divergence import NonFiniteGuard
from kaisoku.engine.hybrid import HybridStep
from kaisoku.engine.metrics import MetricsLogger
from kaisoku.engine.sharded import ShardedStep
from kaisoku.engine.step import DataParallelStep, LossFn, Precision, Preconditioner, StepEngine
from kaisoku.engine.structures import to_device
from kaisoku.engine.tasks import DefaultLoss
from kaisoku.engine.trainer import Trainer, TrainSettings
from kaisoku.engine.user_metrics import UserMetrics
from kaisoku.errors import ConfigError, KaisokuError
from kaisoku.memory.in_backward import attach_update_in_backward
from kaisoku.memory.profile import MemorySetup, setup_memory
from kaisoku.optim.factory import build_optimizer, build_optimizer_from_named, build_scheduler
from kaisoku.optim.kfac import KFAC
from kaisoku.optim.lars import LAMB, LARS
from kaisoku.parts import UserParts, check_user_parts, parts_from_config
from kaisoku.precision import apply_precision
from kaisoku.run_facts import make_model, plan_run
from kaisoku.run_plan import RunPlan, WorldShape, resolve


def user_parts(cfg: Config, parts: UserParts | None = None) -> UserParts:
    """The user's parts: those given from Python, completed by those ``cfg`` names by import path."""
    given = parts or UserParts()
    check_user_parts(given)
    # Only what was not given is loaded: a module is imported, a dataset factory called, once.
    return given.merged(
        parts_from_config(
            cfg.model.name if given.model is None else "",
            cfg.data.dataset if given.train_data is None else "",
            cfg.train.loss if given.loss is None else "auto",
            cfg.data.collate if given.collate is None else "",
            cfg.train.metrics if given.metrics is None else (),
        )
    )


def check_same_data(train: Any, val: Any | None) -> None:
    """Refuse, in one line, a user's dataset that differs between ranks (a collective): data built with
    unseeded randomness, or a random split, trains each rank on other samples without a word. Compared:
    the length and a digest of three samples (first, middle, last) of each dataset."""
    mine = (dataset_fingerprint(train), dataset_fingerprint(val) if val is not None else "")
    every = env.all_gather_object(mine)
    differ = [rank for rank, theirs in enumerate(every) if theirs != every[0]]
    if differ:
        which = "training" if any(every[r][0] != every[0][0] for r in differ) else "validation"
        raise ConfigError(
            f"data: rank {differ[0]} holds another {which} dataset than rank 0 (its length or samples differ); "
            "build the data the same way on every rank: seed its randomness (kaisoku.launch seeds every rank "
            "alike before main runs) or split it with a fixed seed"
        )


def dataset_fingerprint(dataset: Any) -> str:
    """A digest of ``dataset``'s length and of its first, middle and last samples (any nesting of tensors,
    arrays, numbers and strings). The samples are read with the generators seeded alike and put back as they
    were after: a dataset that augments at random neither differs between ranks for it nor moves the run's
    random streams (which a single rank, that checks nothing, would then not match)."""
    count = len(dataset)
    digest = xxhash.xxh3_64(str(count).encode())
    with generators_put_back():
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        for index in sorted({0, count // 2, count - 1} if count else set()):
            for leaf in _leaves(dataset[index]):
                digest.update(leaf)
    return digest.hexdigest()


@contextlib.contextmanager
def generators_put_back() -> Iterator[None]:
    """torch's CPU generator, NumPy's and Python's as they were before, whatever the block draws: work beside
    the run (a check, a trial) must not move its random streams."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def _leaves(value: Any) -> Iterator[bytes]:
    if isinstance(value, torch.Tensor):
        yield tensor_digest(value).encode()
    elif isinstance(value, np.ndarray):
        yield tensor_digest(torch.from_numpy(np.ascontiguousarray(value))).encode()
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield str(key).encode()
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)
    else:
        yield repr(value).encode()


def build_loss(plan: RunPlan, parts: UserParts) -> LossFn:
    """The run's loss: the user's, else the model's own where its output carries one, else cross-entropy
    (with label smoothing; per token for token targets) or mean squared error."""
    if parts.loss is not None:
        return parts.loss
    return DefaultLoss(
        plan.task,
        target_key=plan.data.target_key,
        label_smoothing=plan.label_smoothing,
        mse=plan.loss == "mse",
    )


def example_batch(
    plan: RunPlan, device: torch.device, parts: UserParts, count: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``count`` samples (0: one micro-batch of the run) for the compile trial, the memory profile
    and the trial step: the first samples of the user's dataset, else standard-normal inputs with labels (or
    targets) keyed by train.seed."""
    seed = plan.config.train.seed
    count = count or plan.micro_batch
    if parts.train_data is not None:
        data = parts.train_data
        samples = [data[i % len(data)] for i in range(count)]
        inputs, targets = BatchPairs(parts.collate)(samples)
        moved = to_device(inputs, device)
        return moved, moved if targets is inputs else to_device(targets, device)
    shape = (count, *plan.sample_shape)
    if plan.task == "regression":
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(shape, generator=generator)
        targets = torch.randn((shape[0], plan.model.spec.num_classes), generator=generator)
        return inputs.to(device), targets.to(device)
    return synthetic_batch(shape, plan.model.spec.num_classes, device, seed=seed)


@dataclass
class BuiltModel:
    """The run's model on its device, with its precision and memory set-up."""

    model: nn.Module
    precision: Precision
    channels_last: bool
    memory: MemorySetup | None


def build_model_for(
    plan: RunPlan,
    world: env.World,
    device: torch.device,
    parts: UserParts,
    *,
    loss_fn: LossFn,
    example: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    agree: Any = None,
    shard_ranks: int = 0,
    gather_time: Callable[[int], float] | None = None,
    not_priced: str = "",
) -> BuiltModel:
    """The model of ``plan`` (the user's or the zoo's) on ``device``, in its precision, with the memory
    techniques of ``memory.*`` applied (data parallelism; ``agree`` makes every rank take rank 0's plan;
    ``shard_ranks``, ``gather_time``, ``not_priced``: memory.budget's pricing of full sharding, see
    :func:`~kaisoku.memory.profile.setup_memory`)."""
    cfg = plan.config
    model = make_model(cfg, plan.model.spec, parts).to(device)
    # Pipeline stages send plain contiguous activations: channels-last only on the DDP path, and only for
    # images (a 3-D CNN's 5-D weights have no channels_last format).
    channels_last = (
        device.type == "cuda" and not plan.hybrid and len(plan.sample_shape) == 3 and bool(plan.mean)
    )
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    precision = Precision(cfg.precision.mode, device)
    if plan.precision_path != "fp32":
        precision.monitor = apply_precision(
            model, cfg.precision, device, announce=print if world.is_main else None, seed=cfg.train.seed
        )
    memory = None
    if not plan.hybrid:
        # Global recompute / compress / offload, or the per-block plan of memory.budget / policy.
        memory = setup_memory(
            model,
            cfg.memory,
            device=device,
            example=example,
            loss_fn=loss_fn,
            autocast=precision.autocast,
            agree=agree,
            ranks=world.world_size,
            shard_ranks=shard_ranks,
            gather_time=gather_time,
            not_priced=not_priced,
        )
    return BuiltModel(model=model, precision=precision, channels_last=channels_last, memory=memory)


def build_kfac(
    cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, group: object
) -> Preconditioner | None:
    """K-FAC in front of ``optimizer`` when ``optim.kfac.enabled``, averaging its factors over ``group``."""
    if not cfg.optim.kfac.enabled:
        return None
    k = cfg.optim.kfac
    # The hooks go on the inner modules; DDP has already averaged the gradients they precondition.
    return KFAC(
        model,
        factor_update_steps=k.factor_update_steps,
        inv_update_steps=k.inv_update_steps,
        damping=k.damping,
        factor_decay=k.factor_decay,
        kl_clip=k.kl_clip or None,
        lr=optimizer,
        method=k.method,
        memory_mode=k.memory_mode,
        bn=k.bn,
        skip_layers=tuple(k.skip_layers),
        grad_accum=cfg.train.grad_accum,
        bucket_cap_mb=k.bucket_cap_mb,
        stat_fraction=k.stat_fraction,
        overhead_target=k.overhead_target,
        factor_dtype=k.factor_dtype,
        grad_scaler=precision.scaler,  # K-FAC builds G from unscaled gradients under fp16
        process_group=group,
    )


def build_data_parallel_engine(
    plan: RunPlan,
    built: BuiltModel,
    *,
    loss_fn: LossFn,
    make_scheduler: Any,
    guard: NonFiniteGuard,
    device: torch.device,
    example: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    announce: bool,
) -> DataParallelStep:
    """DDP (with the bucket plan and compression), compile, update-in-backward, K-FAC: the data-parallel step."""
    cfg = plan.config
    model = built.model
    optimizer = build_optimizer(model, cfg.optim)
    group = env.data_parallel_group()
    if group is not None:
        plan_buckets = BucketPlan(
            mode=cfg.dist.buckets,
            first_mb=cfg.dist.first_bucket_mb,
            cap_mb=cfg.dist.bucket_cap_mb,
            growth=cfg.dist.bucket_growth,
        )
        # Under update-in-backward the memory hook does the (optionally bf16) all-reduce itself.
        compress = cfg.dist.compress == "bf16" and not cfg.memory.update_in_backward
        model = wrap_ddp(model, device, plan=plan_buckets, compress_bf16=compress)
    # Before the scheduler wraps optimizer.step; the DDP wrapper is what gets compiled.
    compile_run(
        cfg.train.compile,
        model,
        optimizer,
        loss_fn=loss_fn,
        autocast=built.precision.autocast,
        example=example,
        announce=announce,
    )
    if cfg.memory.update_in_backward:
        attach_update_in_backward(model, optimizer, compress_bf16=cfg.dist.compress == "bf16")
    return DataParallelStep(
        model,
        optimizer,
        make_scheduler(optimizer),
        loss_fn=loss_fn,
        precision=built.precision,
        preconditioner=build_kfac(cfg, model, optimizer, built.precision, group),
        guard=guard,
        update_in_backward=cfg.memory.update_in_backward,
        activations=built.memory.activations if built.memory is not None else None,
    )


def build_sharded_engine(
    plan: RunPlan,
    built: BuiltModel,
    *,
    loss_fn: LossFn,
    make_scheduler: Any,
    device: torch.device,
) -> ShardedStep:
    """FSDP2 per ordered block over the plan's ("dp_replicate", "dp_shard") mesh: the sharded step.

    The optimizer is built on the shards (SGD and AdamW work on DTensors as they are; LARS and LAMB sum
    each layer's squared shard norms over the shard group), and so is the non-finite guard.
    """
    cfg = plan.config
    replicate, shards = plan.mesh_shape
    mesh = build_data_mesh(replicate, shards, device_type=device.type)
    assert plan.shard != "none"
    model = shard_model(built.model, mesh, level=plan.shard, precision_mode=cfg.precision.mode)
    optimizer = build_optimizer(model, cfg.optim)
    if isinstance(optimizer, (LARS, LAMB)):
        optimizer.reduce_norms_with(shard_norm_reducer(mesh))
    return ShardedStep(
        model,
        optimizer,
        make_scheduler(optimizer),
        loss_fn=loss_fn,
        precision=built.precision,
        guard=NonFiniteGuard(model, device, every_step=cfg.train.on_nonfinite == "skip"),
        activations=built.memory.activations if built.memory is not None else None,
    )


def build_hybrid_engine(
    plan: RunPlan,
    built: BuiltModel,
    data: DataParts,
    world: env.World,
    *,
    loss_fn: LossFn,
    make_scheduler: Any,
    device: torch.device,
) -> HybridStep:
    """Pipeline stages (and layout switches) over the plan's schedule: the hybrid step; under
    ``parallel.shard`` each stage's blocks sharded over its data-parallel ranks."""
    cfg = plan.config
    par = cfg.parallel
    assert plan.schedule is not None
    return HybridStep(
        built.model,
        schedule=plan.schedule,
        options=HybridOptions(
            microbatches=par.microbatches,
            schedule=par.schedule,
            virtual_stages=par.virtual_stages,
            balance=par.balance,
            shard=plan.shard,
            precision=cfg.precision.mode,
        ),
        loss_fn=loss_fn,
        optimizer_factory=functools.partial(build_optimizer_from_named, cfg=cfg.optim),
        scheduler_factory=make_scheduler,
        reshard=data.train.set_shard,
        device=device,
        precision=built.precision,
        ranks_per_node=world.local_world_size,
        micro_batches=plan.layout_micro_batches,
        input_shape=plan.sample_shape,
    )


def sharding_alternative(plan: RunPlan) -> tuple[RunPlan | None, str]:
    """The plan of this run under ``parallel.shard full`` (no activation techniques) that memory.budget
    may choose, or None and why it may not (the refusals are the run plan's own). Pure."""
    cfg = plan.config
    if not cfg.memory.budget.strip() or plan.hybrid or plan.shard != "none":
        return None, ""
    if not cfg.memory.allow_shard:
        return None, "memory.allow_shard is off"
    if plan.world.world_size < 2:
        return None, "one rank has nothing to shard over"
    if cfg.memory.policy.strip():
        return None, "memory.policy forces techniques per block"
    sharded_cfg = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, shard="full"),
        memory=dataclasses.replace(cfg.memory, budget="", compress="none", offload="none"),
    )
    try:
        return resolve(sharded_cfg, plan.world, plan.data, plan.model, own_loss=plan.loss == "user"), ""
    except ConfigError as error:
        return None, str(error)


def build_trainer(
    cfg: Config,
    world: env.World,
    *,
    parts: UserParts | None = None,
    plan: RunPlan | None = None,
    resume: str = "",
) -> Trainer:
    """Every part of the run, built from its plan and wired; the process group is joined on the way.

    ``parts`` are the user's own model, dataset and loss given from Python (import paths in ``cfg`` fill in
    the rest); ``plan``, where the caller resolved it on this world already. Joining the group starts first, in the background (``dist.eager_init``), and overlaps
    reading the data and building the model.
    """
    parts = user_parts(cfg, parts)
    if plan is None or plan.world != WorldShape(world.world_size, world.local_world_size):
        plan = plan_run(cfg, WorldShape(world.world_size, world.local_world_size), parts)
    device = env.pick_device(cfg.train.device, world)
    pg_init = env.ProcessGroupInit(world, device, cfg.dist.timeout, background=cfg.dist.eager_init)
    build_start = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    data = build_data(plan, world, device, parts)
    loss_fn = build_loss(plan, parts)
    # Made only when the compile trial or the memory profile runs (a user's dataset may be slow to read).
    example = functools.cache(functools.partial(example_batch, plan, device, parts))
    sharded_plan, not_priced = sharding_alternative(plan)

    def gather_time(numel: int) -> float:
        pg_init.wait()
        return gather_scatter_seconds(numel, device)

    built = build_model_for(
        plan,
        world,
        device,
        parts,
        loss_fn=loss_fn,
        example=example,
        # Every rank applies rank 0's memory plan (waits for the process group only when it plans).
        agree=functools.partial(env.rank_zero_value, ready=pg_init) if world.distributed else None,
        shard_ranks=sharded_plan.mesh_shape[-1] if sharded_plan is not None else 0,
        gather_time=gather_time if sharded_plan is not None else None,
        not_priced=not_priced,
    )
    if built.memory is not None and built.memory.plan is not None and built.memory.plan.shard != "none":
        assert sharded_plan is not None
        plan = sharded_plan  # memory.budget chose full sharding: the sharded engine and checkpoints
    build_seconds = time.perf_counter() - build_start
    wait_start = time.perf_counter()
    pg_init.wait()
    pg_wait_seconds = time.perf_counter() - wait_start
    with env.collective_timeout(cfg.dist.short_timeout, cfg.dist.timeout, "the start-up checks"):
        if parts.train_data is not None and world.distributed:
            check_same_data(parts.train_data, parts.val_data)
        if isinstance(data.train, ShardLoader):
            # Collective set-up of the shard loader: a run token all ranks share, the exchange's group.
            data.train.connect(
                run_token=env.shared_token(),
                exchange_group=env.cpu_collective_group() if data.train.needs_exchange else None,
            )
    steps_per_epoch = data.train.steps_per_epoch
    if plan.steps_per_epoch is not None and plan.steps_per_epoch != steps_per_epoch:
        raise KaisokuError(
            f"the data gives {steps_per_epoch} steps per epoch where the plan expects {plan.steps_per_epoch}"
        )
    horizon, total_steps = plan.total_steps(steps_per_epoch)
    # The schedule spans the configured epochs; max_steps only stops early, so that a run stopped at
    # max_steps and resumed follows the same learning-rate curve as one that never stopped.
    make_scheduler = functools.partial(
        build_scheduler, cfg=cfg.sched, steps_per_epoch=steps_per_epoch, total_steps=horizon
    )
    engine: StepEngine
    guard: NonFiniteGuard
    if plan.hybrid:
        guard = NonFiniteGuard(built.model, device, every_step=cfg.train.on_nonfinite == "skip")
        engine = build_hybrid_engine(
            plan, built, data, world, loss_fn=loss_fn, make_scheduler=make_scheduler, device=device
        )
    elif plan.sharded_engine:
        sharded = build_sharded_engine(
            plan, built, loss_fn=loss_fn, make_scheduler=make_scheduler, device=device
        )
        engine, guard = sharded, sharded.guard  # the guard watches the shards that replaced the weights
    else:
        guard = NonFiniteGuard(built.model, device, every_step=cfg.train.on_nonfinite == "skip")
        engine = build_data_parallel_engine(
            plan,
            built,
            loss_fn=loss_fn,
            make_scheduler=make_scheduler,
            guard=guard,
            device=device,
            example=example,
            announce=world.is_main,
        )
    run_dir = Path(cfg.run_dir).expanduser()
    metrics = MetricsLogger(
        run_dir,
        enabled=world.is_main,
        total_steps=total_steps,
        progress=cfg.metrics.progress,
        tensorboard=cfg.metrics.tensorboard,
    )
    preconditioner = getattr(engine, "preconditioner", None)
    if isinstance(preconditioner, KFAC):  # K-FAC's cost-adapted intervals are logged and said

        def announce_intervals(record: dict[str, Any], text: str) -> None:
            metrics.log(record)
            metrics.message(text)

        preconditioner.on_intervals = announce_intervals
    trainer = Trainer(
        engine=engine,
        precision=built.precision,
        train_data=data.train,
        val_loader=data.val_loader,
        settings=TrainSettings(
            total_steps=total_steps,
            grad_accum=cfg.train.grad_accum,
            val_every=cfg.train.val_every,
            log_every=cfg.train.log_every,
            checkpoint_every=cfg.checkpoint.every_steps,
            global_batch=cfg.data.global_batch,
            channels_last=built.channels_last,
            mean=plan.mean,
            std=plan.std,
            on_nonfinite=cfg.train.on_nonfinite,
            max_skips=cfg.train.max_skips,
            rollback_lr_scale=cfg.train.rollback_lr_scale,
            max_rollbacks=cfg.train.max_rollbacks,
            task=plan.task,
            loss_fn=parts.loss,
            target_key=plan.data.target_key,
            seed=cfg.train.seed,
            tokens_per_sample=plan.data.tokens_per_sample,
            collective_timeout=cfg.dist.timeout,
            short_timeout=cfg.dist.short_timeout,
        ),
        world=world,
        device=device,
        metrics=metrics,
        checkpoints=CheckpointManager(
            run_dir / "checkpoints",
            keep=cfg.checkpoint.keep,
            sharded=plan.sharded_checkpoints,
            background=cfg.checkpoint.async_save,
        ),
        config_dict=to_dict(cfg),
        guard=guard,
        user_metrics=UserMetrics(
            parts.metrics or {}, device, target_key=plan.data.target_key, task=plan.task
        ),
    )
    metrics.log(
        {
            "event": "start",
            "world_size": world.world_size,
            "device": str(device),
            "build_seconds": build_seconds,
            "process_group_seconds": pg_init.seconds,
            "process_group_wait_seconds": pg_wait_seconds,
            "eager_init": cfg.dist.eager_init,
            **({"parallel": str(plan.schedule)} if plan.hybrid else {}),
            **({"shard": plan.shard, "data_mesh": plan.mesh_description} if plan.shard != "none" else {}),
        }
    )
    if built.memory is not None and built.memory.plan is not None:
        metrics.log(built.memory.record())
        metrics.message(built.memory.message())
    if resume:
        resume_trainer(trainer, resume)
    return trainer
