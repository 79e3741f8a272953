"""The training loop. It receives built parts (model, optimizer, loaders, ...) and parses no config."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kaisoku.distributed import env
from kaisoku.distributed.sharded_checkpoint import read_full_state
from kaisoku.engine import stop
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.engine.checkpoint import remove as remove_checkpoint
from kaisoku.engine.divergence import (
    NonFinite,
    NonFiniteError,
    NonFiniteGuard,
    scale_learning_rate,
    weights_finite,
)
from kaisoku.engine.metrics import MetricsLogger, interval_peak_memory_mib, peak_memory_mib
from kaisoku.engine.step import MicroBatches, Precision, StepEngine
from kaisoku.engine.tasks import make_task
from kaisoku.engine.train_inputs import TrainData, TrainSettings
from kaisoku.engine.user_metrics import UserMetrics
from kaisoku.engine.validation import Validator, prepare_batch
from kaisoku.errors import KaisokuError


@dataclass
class TrainState:
    """Where the run is."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Trainer:
    """Runs the optimisation loop: data, steps through a step engine, validation, checkpoints, metrics.

    How a step runs (DDP with accumulation, or pipeline stages and layout switches) is the step
    engine's business; the loop is the same for every engine.
    """

    def __init__(
        self,
        *,
        engine: StepEngine,
        precision: Precision,
        train_data: TrainData,
        val_loader: torch.utils.data.DataLoader | None,
        settings: TrainSettings,
        world: env.World,
        device: torch.device,
        metrics: MetricsLogger,
        checkpoints: CheckpointManager | None,
        config_dict: dict[str, Any] | None = None,
        on_step: Callable[[int], None] | None = None,
        guard: NonFiniteGuard | None = None,
        user_metrics: UserMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.precision = precision
        self.train_data = train_data
        self.val_loader = val_loader
        self.settings = settings
        self.task = make_task(
            settings.task,
            mean=settings.mean,
            std=settings.std,
            channels_last=settings.channels_last,
            loss_fn=settings.loss_fn,
            target_key=settings.target_key,
        )
        self.validator = Validator(
            task=self.task,
            precision=precision,
            device=device,
            user_metrics=user_metrics,
            collective_forward=getattr(engine, "collective_forward", False),
            timeouts=(settings.short_timeout, settings.collective_timeout),
        )
        self.world = world
        self.device = device
        self.metrics = metrics
        self.checkpoints = checkpoints
        self._saved_step = -1  # the step of the last checkpoint this run wrote
        self.config_dict = config_dict or {}
        self.on_step = on_step
        self.state = TrainState()
        self.last_val: dict[str, float] = {}
        self.last_loss = float("nan")
        self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.guard = guard
        # The engine watches gradients where it can; else the trainer watches the loss.
        self._watch_loss = guard is not None and getattr(engine, "guard", None) is not guard
        self.lr_scale = 1.0
        self.rollbacks = 0
        self._rolled_back_to: int | None = None
        self._saved_since_rollback = False
        self.data_totals: dict[str, float] = {}
        self._paused = 0.0  # seconds of validation and checkpoints inside the current log window

    # ------------------------------------------------------------------------------------------------
    # State

    @property
    def unwrapped(self) -> nn.Module:
        """The whole model, without a DDP wrapper."""
        return self.engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """This rank's optimizer now."""
        return self.engine.optimizer

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly (a collective under hybrid parallelism)."""
        return {
            **self.engine.state_dict(),
            "step": self.state.step,
            "data": {
                "epoch": self.state.epoch,
                "step_in_epoch": self.state.step_in_epoch,
                "sampler": self.train_data.state_dict(),
            },
            "rng": {"torch": torch.get_rng_state()},
            "world_size": self.world.world_size,
            "config": self.config_dict,
            "nonfinite": {"lr_scale": self.lr_scale},
        }

    def load_state_dict(self, state: dict[str, Any], *, source: str = "checkpoint") -> None:
        """Restore a :meth:`state_dict` written by any step engine; a mismatch names ``source``."""
        try:
            if "sharded_dir" in state and not getattr(self.engine, "reads_sharded_checkpoints", False):
                # An unsharded engine takes whole tensors: read the shards into its own model first.
                state = {**state, **read_full_state(state["sharded_dir"], self.engine.model, self.optimizer)}
            self.engine.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError) as error:
            first = str(error).strip().splitlines()[0]
            raise KaisokuError(f"{source} does not match this model or optimizer: {first}") from None
        try:
            self.train_data.load_state_dict(state["data"]["sampler"])
        except KaisokuError as error:
            raise KaisokuError(f"{source}: {error}") from None
        torch.set_rng_state(state["rng"]["torch"])
        self.state = TrainState(
            step=int(state["step"]),
            epoch=int(state["data"]["epoch"]),
            step_in_epoch=int(state["data"]["step_in_epoch"]),
        )
        self.lr_scale = float(state.get("nonfinite", {}).get("lr_scale", 1.0))
        self._batches = None

    def save_checkpoint(self) -> None:
        """Rank 0 writes a checkpoint (every rank its shards, when sharded); every rank takes part in
        gathering it and waits for the write.

        Weights are checked first: a checkpoint with non-finite weights is never written (the
        ``on_nonfinite`` policy acts instead).
        """
        if self.checkpoints is None:
            return
        if not self.check_finite(at_checkpoint=True):
            return
        start = time.perf_counter()
        state = self.state_dict()
        path: Path | None = None
        if self.checkpoints.sharded:  # every rank writes its own shards (in the background with async_save)
            path = self.checkpoints.save(state, is_main=self.world.is_main)
            path = path if self.world.is_main else None
        elif self.world.is_main:
            path = self.checkpoints.save(state)
        env.barrier()
        self._saved_since_rollback = True
        self._saved_step = self.state.step
        seconds = time.perf_counter() - start
        self._paused += seconds
        if path is not None:
            self.metrics.log(
                {"step": self.state.step, "event": "checkpoint", "seconds": seconds, "path": str(path)}
            )
            self.metrics.message(f"checkpoint {path}")

    # ------------------------------------------------------------------------------------------------
    # Non-finite losses and gradients

    def check_finite(self, *, at_checkpoint: bool = False) -> bool:
        """Read the non-finite flags (one sync, agreed over ranks) and apply the policy.

        True when training may go on from here as it was; False after a rollback (the state changed).
        """
        if self.guard is None:
            return True
        found = self.guard.check()
        # A sharded engine checks its own shards (the flags are agreed over ranks below).
        finite = getattr(self.engine, "weights_finite", None)
        weights_bad = at_checkpoint and not bool(finite() if finite else weights_finite(self.engine.model))
        local = 1.0 if found is not None or weights_bad else 0.0
        if env.all_reduce_max([local], self.device)[0] == 0.0:
            return True
        if found is None:
            found = NonFinite(step=self.state.step, where="weights")
        if self.settings.on_nonfinite == "rollback":
            self.rollback(found)
            return False
        raise NonFiniteError(_diverged(found))

    def _rollback_target(self) -> str | None:
        """The newest checkpoint, or the one before it when the run diverged again from it before
        writing another; checkpoints after the target (the abandoned path) are deleted."""
        assert self.checkpoints is not None
        self.checkpoints.remove_partial()
        paths = self.checkpoints.list()
        if not paths:
            return None
        if self._rolled_back_to == _step_of(paths[-1]) and not self._saved_since_rollback and len(paths) > 1:
            paths = paths[:-1]
        target = paths[-1]
        for later in self.checkpoints.list():
            if _step_of(later) > _step_of(target):
                remove_checkpoint(later)
        return str(target)

    def rollback(self, found: NonFinite) -> None:
        """Reload the newest checkpoint and scale the learning rate; NonFiniteError past the limit."""
        self.rollbacks += 1
        if self.rollbacks > self.settings.max_rollbacks:
            raise NonFiniteError(
                f"{_diverged(found)}; still diverging after {self.settings.max_rollbacks} rollbacks"
            )
        path: str | None = None
        if self.world.is_main and self.checkpoints is not None:
            path = self._rollback_target()
        path = env.broadcast_object(path)  # type: ignore[assignment]
        if path is None:
            raise NonFiniteError(f"{_diverged(found)}; no checkpoint yet to roll back to")
        from_step = self.state.step
        target = self.lr_scale * self.settings.rollback_lr_scale
        self.load_state_dict(CheckpointManager.load(Path(path)), source=f"checkpoint {path}")
        scale_learning_rate(self.engine.scheduler, target / self.lr_scale)
        self.lr_scale = target
        self._rolled_back_to = self.state.step
        self._saved_since_rollback = False
        assert self.guard is not None
        self.guard.reset()
        self.metrics.log(
            {
                "step": self.state.step,
                "event": "rollback",
                "from_step": from_step,
                "nonfinite_step": found.step,
                "where": found.where,
                "lr_scale": target,
            }
        )
        self.metrics.message(
            f"step {found.step}: {found.where} went non-finite; rolled back to step {self.state.step} "
            f"with the learning rate x{target:g} ({self.rollbacks}/{self.settings.max_rollbacks})"
        )

    # ------------------------------------------------------------------------------------------------
    # Steps

    def _prepare(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        return prepare_batch(self.task, self.device, inputs, targets)

    def train_step(self, micro_batches: MicroBatches) -> torch.Tensor:
        """One optimizer step over ``micro_batches``; returns the mean loss as a device tensor (no sync)."""
        if self.guard is not None:
            self.guard.step = self.state.step + 1
        # Dropout and any other random draw of the step come from (seed, step): a resumed run draws the
        # same numbers as one that never stopped, whatever consumed the generator before (loader start-up).
        seed_step(step_seed(self.settings.seed, self.state.step), self.device)
        loss = self.engine.train_step([self._prepare(images, labels) for images, labels in micro_batches])
        if self._watch_loss and self.guard is not None:
            self.guard.observe_loss(loss)
        if self.guard is not None and self.guard.consecutive >= self.settings.max_skips:
            raise NonFiniteError(
                f"{self.guard.consecutive} consecutive steps up to step {self.guard.step} had non-finite "
                "gradients (all skipped)"
            )
        return loss

    def _switch_layout_if_due(self) -> None:
        """Change the parallel layout where the engine's schedule says so (every rank at the same step)."""
        layout = self.engine.switch_for(self.state.epoch, self.state.step)
        if layout is None:
            return
        self._batches = None  # the sampler now reads the new dp axis's shards, from this step on
        self.metrics.log(
            {"step": self.state.step, "epoch": self.state.epoch, "event": "switch", "layout": str(layout)}
        )
        self.metrics.message(f"step {self.state.step}: switched to parallel layout {layout}")

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """The task's validation figures (loss and top-1 accuracy, token accuracy and perplexity, or MSE and
        MAE per target) and the user's metrics over the whole validation set, the same on every rank."""
        if self.val_loader is None:
            return {}
        return self.validator.run(self.engine.eval_model(), self.val_loader, self.state.step)

    # ------------------------------------------------------------------------------------------------
    # Loop

    def _next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The next step's micro-batches of the current epoch; None at the epoch's end."""
        if self._batches is None:
            self.train_data.set_epoch(self.state.epoch, self.state.step_in_epoch)
            quality = self.train_data.last_quality
            if quality is not None:
                self.metrics.log(
                    {"step": self.state.step, "epoch": self.state.epoch, "shuffle_quality": quality}
                )
            self._batches = iter(self.train_data)
        micro: list[tuple[torch.Tensor, torch.Tensor]] = []
        for batch in self._batches:
            micro.append(batch)
            if len(micro) == self.settings.grad_accum:
                return micro
        self._batches = None
        return None

    def run(self, until_step: int) -> float:
        """Train up to optimizer step ``until_step`` (logging, validating and checkpointing on the way).

        Returns the mean loss of the last log window. Can be called repeatedly; the data position
        carries over between calls.
        """
        settings = self.settings
        steps_per_epoch = self.train_data.steps_per_epoch
        running_loss = torch.zeros((), device=self.device)
        window_steps = 0
        window_start = time.perf_counter()
        window_wait = 0.0
        self.metrics.advance(self.state.step)
        while self.state.step < until_step:
            self._stop_if_signalled()
            self._switch_layout_if_due()
            wait_start = time.perf_counter()
            micro = self._next_micro_batches()
            if micro is None:
                continue  # the sampler ran dry early (it never should); start the next pass
            window_wait += time.perf_counter() - wait_start
            running_loss += self.train_step(micro)
            window_steps += 1
            self.state.step += 1
            self.state.step_in_epoch += 1
            if self.on_step is not None:
                self.on_step(self.state.step)
            end_of_epoch = self.state.step_in_epoch >= steps_per_epoch
            last = self.state.step >= settings.total_steps
            if self.state.step % settings.log_every == 0 or self.state.step == until_step:
                # Validation and checkpoints in this window are logged as their own events.
                elapsed = time.perf_counter() - window_start - self._paused
                self.last_loss = (running_loss / window_steps).item()
                rate = window_steps * settings.global_batch / max(elapsed, 1e-9)
                self.metrics.log(
                    {
                        "step": self.state.step,
                        "epoch": self.state.epoch + self.state.step_in_epoch / steps_per_epoch,
                        "loss": self.last_loss,
                        "lr": self.engine.optimizer.param_groups[0]["lr"],
                        "samples_per_s": rate,
                        **(
                            {"tokens_per_s": rate * settings.tokens_per_sample}
                            if settings.tokens_per_sample
                            else {}
                        ),
                        "data_wait_fraction": window_wait / max(elapsed, 1e-9),
                        "peak_memory_mib": interval_peak_memory_mib(self.device),
                    }
                )
                self.metrics.advance(self.state.step, loss=self.last_loss, rate=rate)
                if self.precision.monitor is not None and self.metrics.enabled:
                    # Per-layer exponent, overflow rate and underflow fraction of the window (*-stats modes).
                    self.metrics.log(
                        {
                            "step": self.state.step,
                            "event": "precision",
                            "layers": self.precision.layer_stats(),
                        }
                    )
                running_loss.zero_()
                window_steps, window_wait = 0, 0.0
                window_start, self._paused = time.perf_counter(), 0.0
                if not self.check_finite():
                    continue  # rolled back: the loop goes on from the checkpoint's step
            if end_of_epoch:
                self._log_data_stats()
                self.state.epoch += 1
                self.state.step_in_epoch = 0
                self._batches = None
            every_val, every_ckpt = settings.val_every, settings.checkpoint_every
            if not last and (
                (every_val > 0 and self.state.step % every_val == 0) or (every_val == 0 and end_of_epoch)
            ):
                self._run_validation()
            if not last and (
                (every_ckpt > 0 and self.state.step % every_ckpt == 0) or (every_ckpt == 0 and end_of_epoch)
            ):
                self.save_checkpoint()
        return self.last_loss

    def _stop_if_signalled(self) -> None:
        """Between steps: when any rank was asked to stop by a signal (:mod:`kaisoku.engine.stop`), every rank
        writes a checkpoint of this step and raises StoppedBySignal. The ranks agree through a collective:
        at every step on the CPU, at log steps on an accelerator (a per-step agreement would make the host
        wait for the device every step)."""
        if self.device.type != "cpu" and self.state.step % self.settings.log_every != 0:
            return
        signum = int(env.all_reduce_max([float(stop.requested())], self.device)[0])
        if signum == 0:
            return
        path = None
        if self.checkpoints is not None:
            if self._saved_step != self.state.step:
                self.save_checkpoint()
            self.checkpoints.wait()
            path = str(self.checkpoints.path_for(self.state.step))
        raise stop.StoppedBySignal(signum, self.state.step, path)

    def fit(self) -> dict[str, Any]:
        """Train until ``total_steps``, validate, checkpoint; return the run summary."""
        start_step = self.state.step
        run_start = time.perf_counter()
        self.run(self.settings.total_steps)
        while not self.check_finite(at_checkpoint=True):
            self.run(self.settings.total_steps)  # rolled back at the very end: train the rest again
        wall = time.perf_counter() - run_start
        if self.state.step_in_epoch > 0:
            self._log_data_stats()
        val = self._run_validation()
        self.save_checkpoint()
        if self.checkpoints is not None:
            self.checkpoints.wait()  # a background save's folder appears before the run ends
        steps_run = self.state.step - start_step
        extra: dict[str, Any] = {key: self.data_totals[key] for key in sorted(self.data_totals)}
        if self.guard is not None and self.settings.on_nonfinite == "skip":
            extra["skipped_steps"] = self.guard.skipped
        if self.settings.on_nonfinite == "rollback":
            extra["rollbacks"] = self.rollbacks
        if self.precision.monitor is not None:
            self.metrics.log(
                {
                    "step": self.state.step,
                    "event": "precision_summary",
                    "layers": self.precision.monitor.totals(),
                }
            )
        # The last window's loss, averaged over the ranks: every rank returns the run's figure, not its own.
        final_loss = env.all_reduce_sum([self.last_loss], self.device)[0] / self.world.world_size
        samples_per_s = steps_run * self.settings.global_batch / max(wall, 1e-9)
        if self.settings.tokens_per_sample:
            extra["tokens_per_s"] = samples_per_s * self.settings.tokens_per_sample
        return {
            "steps": self.state.step,
            "epochs": self.state.step / self.train_data.steps_per_epoch,
            "final_loss": final_loss,
            "samples_per_s": samples_per_s,
            "train_seconds": wall,
            **val,
            "peak_memory_mib": peak_memory_mib(self.device),
            **extra,
        }

    def _log_data_stats(self) -> None:
        """The loader's counters for the epoch (skipped records, reads, bytes), summed over ranks."""
        stats = self.train_data.epoch_stats()
        if not stats:
            return
        keys = sorted(stats)
        values = env.all_reduce_sum([float(stats[key]) for key in keys], self.device)
        summed = dict(zip(keys, values))
        for key, value in summed.items():
            self.data_totals[key] = self.data_totals.get(key, 0.0) + value
        self.metrics.log({"step": self.state.step, "epoch": self.state.epoch, "event": "epoch", **summed})

    def _run_validation(self) -> dict[str, float]:
        start = time.perf_counter()
        val = self.validate()
        seconds = time.perf_counter() - start
        self._paused += seconds
        if val:
            self.last_val = val
            self.metrics.log(
                {
                    "step": self.state.step,
                    "epoch": self.state.epoch,
                    "event": "validation",
                    "seconds": seconds,
                    **val,
                }
            )
            score = self.validator.score(val)
            self.metrics.message(
                f"step {self.state.step}: val loss {val['val_loss']:.4f}, "
                f"{score} ({time.perf_counter() - start:.1f} s)"
            )
        return val


def _step_of(path: Path) -> int:
    return int(path.stem.split("-")[1])


def _diverged(found: NonFinite) -> str:
    if found.where == "weights":
        return f"training diverged: the weights were non-finite at step {found.step}"
    what = "the loss" if found.where == "loss" else f"the gradient of {found.where}"
    return f"training diverged: {what} went non-finite at step {found.step}"


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the generators a step on ``device`` draws from, as ``torch.manual_seed(seed)`` seeds them: the CPU
    generator, and every GPU's on a CUDA run.

    ``torch.manual_seed`` also queues a seed, with a formatted stack trace, for each backend this process has
    not started (CUDA and XPU on a CPU run): about 0.5 ms per call, paid on every step for generators a CPU
    run never draws from.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)  # started by now (the model is on the device): no queue, no trace
    elif device.type != "cpu":
        torch.manual_seed(seed)


def step_seed(seed: int, step: int) -> int:
    """The torch seed of optimizer step ``step`` of a run seeded ``seed`` (a hash, not seed + step, so that
    runs of neighbouring seeds do not share steps' numbers)."""
    return int(np.random.SeedSequence([seed, step, 0x57E9]).generate_state(1, np.uint64)[0] >> 1)
