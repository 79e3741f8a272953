"""Build every part of a run from its config, in one place, and hand them to the trainer."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch

from kaisoku.config import Config, to_dict
from kaisoku.data.loader import ShardLoader
from kaisoku.distributed import env
from kaisoku.distributed.data_parallel import BucketPlan, wrap_ddp
from kaisoku.distributed.layout import resolve_schedule
from kaisoku.distributed.mesh import rank_coordinates
from kaisoku.distributed.pipeline import HybridOptions
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.engine.compile import compile_run
from kaisoku.engine.data_build import build_data
from kaisoku.engine.divergence import NonFiniteGuard
from kaisoku.engine.hybrid import HybridStep
from kaisoku.engine.metrics import MetricsLogger
from kaisoku.engine.step import DataParallelStep, Precision, Preconditioner, StepEngine
from kaisoku.engine.trainer import Trainer, TrainSettings, steps_for
from kaisoku.models.zoo import build_model
from kaisoku.optim.factory import build_optimizer, build_optimizer_from_named, build_scheduler


def build_trainer(cfg: Config, world: env.World, *, resume: str = "") -> Trainer:
    """Every part of the run, built and wired; the process group is joined on the way.

    Joining the group starts first, in the background (``dist.eager_init``), and overlaps reading the
    dataset's index and building the model and optimizer. The config was validated (layouts included)
    when it was read; here the layouts are only resolved on this world.
    """
    device = env.pick_device(cfg.train.device, world)
    par = cfg.parallel
    schedule = resolve_schedule(
        world.world_size, dp=par.dp, pp=par.pp, switch=par.switch, unit=par.switch_unit
    )
    hybrid = par.hybrid
    pg_init = env.ProcessGroupInit(world, device, cfg.dist.timeout, background=cfg.dist.eager_init)
    build_start = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    shard = None
    if hybrid:
        # Under hybrid parallelism the sampler reads the replica's shard: (dp index, dp).
        dp_index, _ = rank_coordinates(world.rank, schedule.layout_at(0), world.local_world_size)
        shard = (dp_index, schedule.layout_at(0).dp)
    data = build_data(cfg, world, device, shard=shard)
    # One sample's input shape: (C, H, W) images, or (C, D, D, D) volumes for a regression set.
    sample_shape = data.sample_shape or (data.in_channels, cfg.data.image_size, cfg.data.image_size)
    model = build_model(
        cfg.model.name,
        num_classes=cfg.model.num_classes or data.num_classes,
        stem=cfg.model.stem,
        zero_init_residual=cfg.model.zero_init_residual,
        bn_momentum=cfg.model.bn_momentum,
        in_channels=data.in_channels,
        size=sample_shape[-1],
        width=cfg.model.width,
    ).to(device)
    # Pipeline stages send plain contiguous activations: channels-last only on the DDP path, and only for
    # images (a 3-D CNN's 5-D weights have no channels_last format).
    channels_last = device.type == "cuda" and not hybrid and len(sample_shape) == 3
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    precision = Precision(cfg.precision.mode, device)
    if cfg.precision.mode != "fp32":
        from kaisoku.precision import apply_precision

        precision.monitor = apply_precision(
            model, cfg.precision, device, announce=print if world.is_main else None, seed=cfg.train.seed
        )
    memory_setup = None
    if not hybrid:
        from kaisoku.memory.profile import setup_memory

        # Global recompute / compress / offload, or the per-block plan of memory.budget / policy.
        memory_setup = setup_memory(
            model,
            cfg.memory,
            device=device,
            input_shape=(
                max(1, cfg.data.global_batch // world.world_size // cfg.train.grad_accum),
                *sample_shape,
            ),
            num_classes=cfg.model.num_classes or data.num_classes,
            autocast=precision.autocast,
            # Every rank applies rank 0's plan (waits for the process group only when it plans).
            agree=functools.partial(env.rank_zero_value, ready=pg_init) if world.distributed else None,
            ranks=world.world_size,
        )
    # Under hybrid parallelism each rank's optimizer covers its stage only; the engine builds it.
    optimizer = None if hybrid else build_optimizer(model, cfg.optim)
    build_seconds = time.perf_counter() - build_start
    wait_start = time.perf_counter()
    pg_init.wait()
    pg_wait_seconds = time.perf_counter() - wait_start
    if isinstance(data.train_loader, ShardLoader):
        # Collective set-up of the shard loader: a run token all ranks share, the exchange's group.
        data.train_loader.connect(
            run_token=env.shared_token(),
            exchange_group=env.cpu_collective_group() if data.train_loader.needs_exchange else None,
        )
    steps_per_epoch = data.train_sampler.steps_per_epoch
    horizon = steps_for(cfg.train.epochs, steps_per_epoch, 0)
    total_steps = steps_for(cfg.train.epochs, steps_per_epoch, cfg.train.max_steps)
    # The schedule spans the configured epochs; max_steps only stops early, so that a run stopped at
    # max_steps and resumed follows the same learning-rate curve as one that never stopped.
    make_scheduler = functools.partial(
        build_scheduler, cfg=cfg.sched, steps_per_epoch=steps_per_epoch, total_steps=horizon
    )
    guard = NonFiniteGuard(model, device, every_step=cfg.train.on_nonfinite == "skip")
    # The dataset's task decides the loss: mean squared error for regression targets.
    loss_fn: torch.nn.Module = (
        torch.nn.MSELoss()
        if data.task == "regression"
        else torch.nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
    )
    engine: StepEngine
    if hybrid:
        engine = HybridStep(
            model,
            schedule=schedule,
            options=HybridOptions(
                microbatches=par.microbatches,
                schedule=par.schedule,
                virtual_stages=par.virtual_stages,
                balance=par.balance,
            ),
            loss_fn=loss_fn,
            optimizer_factory=functools.partial(build_optimizer_from_named, cfg=cfg.optim),
            scheduler_factory=make_scheduler,
            reshard=data.train_sampler.set_shard,
            device=device,
            precision=precision,
            ranks_per_node=world.local_world_size,
            global_batch=cfg.data.global_batch,
            input_shape=sample_shape,
        )
    else:
        assert optimizer is not None
        group = env.data_parallel_group()
        if group is not None:
            plan = BucketPlan(
                mode=cfg.dist.buckets,
                first_mb=cfg.dist.first_bucket_mb,
                cap_mb=cfg.dist.bucket_cap_mb,
                growth=cfg.dist.bucket_growth,
            )
            # Under update-in-backward the memory hook does the (optionally bf16) all-reduce itself.
            compress = cfg.dist.compress == "bf16" and not cfg.memory.update_in_backward
            model = wrap_ddp(model, device, plan=plan, compress_bf16=compress)
        # Before the scheduler wraps optimizer.step; the DDP wrapper is what gets compiled.
        compile_run(
            cfg.train.compile,
            model,
            optimizer,
            loss_fn=loss_fn,
            autocast=precision.autocast,
            input_shape=(
                max(1, cfg.data.global_batch // world.world_size // cfg.train.grad_accum),
                data.in_channels,
                cfg.data.image_size,
                cfg.data.image_size,
            ),
            num_classes=cfg.model.num_classes or data.num_classes,
            device=device,
            seed=cfg.train.seed,
            announce=world.is_main,
        )
        if cfg.memory.update_in_backward:
            from kaisoku.memory.in_backward import attach_update_in_backward

            attach_update_in_backward(model, optimizer, compress_bf16=cfg.dist.compress == "bf16")
        engine = DataParallelStep(
            model,
            optimizer,
            make_scheduler(optimizer),
            loss_fn=loss_fn,
            precision=precision,
            preconditioner=_build_kfac(cfg, model, optimizer, precision, group),
            guard=guard,
            update_in_backward=cfg.memory.update_in_backward,
            activations=memory_setup.activations if memory_setup is not None else None,
        )
    run_dir = Path(cfg.run_dir).expanduser()
    metrics = MetricsLogger(
        run_dir,
        enabled=world.is_main,
        total_steps=total_steps,
        progress=cfg.metrics.progress,
        tensorboard=cfg.metrics.tensorboard,
    )
    if hasattr(getattr(engine, "preconditioner", None), "on_intervals"):  # K-FAC's cost-adapted intervals

        def announce_intervals(record: dict[str, Any], text: str) -> None:
            metrics.log(record)
            metrics.message(text)

        engine.preconditioner.on_intervals = announce_intervals
    trainer = Trainer(
        engine=engine,
        precision=precision,
        train_loader=data.train_loader,
        train_sampler=data.train_sampler,
        val_loader=data.val_loader,
        settings=TrainSettings(
            total_steps=total_steps,
            grad_accum=cfg.train.grad_accum,
            val_every=cfg.train.val_every,
            log_every=cfg.train.log_every,
            checkpoint_every=cfg.checkpoint.every_steps,
            global_batch=cfg.data.global_batch,
            channels_last=channels_last,
            mean=data.mean,
            std=data.std,
            on_nonfinite=cfg.train.on_nonfinite,
            max_skips=cfg.train.max_skips,
            rollback_lr_scale=cfg.train.rollback_lr_scale,
            max_rollbacks=cfg.train.max_rollbacks,
            task=data.task,
        ),
        world=world,
        device=device,
        metrics=metrics,
        checkpoints=CheckpointManager(run_dir / "checkpoints", keep=cfg.checkpoint.keep),
        config_dict=to_dict(cfg),
        guard=guard,
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
            **({"parallel": str(schedule)} if hybrid else {}),
        }
    )
    if memory_setup is not None and memory_setup.plan is not None:
        metrics.log(memory_setup.record())
        metrics.message(memory_setup.message())
    if resume:
        _resume(trainer, resume)
    return trainer


def _build_kfac(
    cfg: Config,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    group: object,
) -> Preconditioner | None:
    """K-FAC in front of ``optimizer`` when ``optim.kfac.enabled``, averaging its factors over ``group``."""
    if not cfg.optim.kfac.enabled:
        return None
    from kaisoku.optim.kfac import KFAC

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


def _resume(trainer: Trainer, resume: str) -> None:
    """Load the checkpoint that ``resume`` names ("auto": the newest valid one; none yet is fine)."""
    assert trainer.checkpoints is not None
    path: str | None = None
    if trainer.world.is_main:
        if resume == "auto":
            trainer.checkpoints.remove_partial()
            found = trainer.checkpoints.latest_valid()
            path = str(found[0]) if found else None
        else:
            path = resume
    # Rank 0 picks the file so that every rank loads the same one even while files change.
    path = env.broadcast_object(path)  # type: ignore[assignment]
    if path is None:
        trainer.metrics.message("no checkpoint to resume from; starting fresh")
        return
    state = CheckpointManager.load(Path(path))
    trainer.load_state_dict(state, source=f"checkpoint {path}")
    trainer.metrics.message(f"resumed from {path} at step {trainer.state.step}")
    old, new = int(state.get("world_size", 0)), trainer.world.world_size
    if old and old != new:
        # Sample order is keyed by (seed, epoch) and sliced by rank: the world size does not change it.
        trainer.metrics.log({"step": trainer.state.step, "event": "world_size", "from": old, "to": new})
        trainer.metrics.message(
            f"world size changed since the checkpoint: {old} -> {new} ranks; the sample order is unchanged"
        )
