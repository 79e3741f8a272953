"""``train.compile``: torch.compile of the model and of the optimizer step, or ``auto`` to pick by timing.

- ``model``: ``module.compile()`` in place on what the step engine runs (the DDP wrapper when there is
  one, as PyTorch documents compiled DDP: its graph is split at the gradient buckets). State-dict keys do
  not change, so checkpoints stay interchangeable with eager runs.
- ``optimizer``: kaisoku's LARS and LAMB compile their batched update (:meth:`compile_update`); any
  other optimizer's ``step`` runs through ``torch.compile`` with each group's learning rate handed in as
  a 0-dim tensor for the step only, so a learning rate that changes every step does not recompile and
  the groups, the scheduler and checkpoints keep plain numbers.
- ``all``: both. ``auto``: times 20 steps eager and 20 steps compiled (``all``) on a copy of the model
  and optimizer with a synthetic batch of the run's shape, keeps the faster (compiled only when at least
  2% faster), and says so in one line;
  the run's own model and optimizer are not touched by the trial.

Compile time (the first, compiling steps of the copy) is reported on its own in that line. Pipeline
stages and K-FAC's layer hooks do not go through ``torch.compile``: :func:`compile_conflict` names the
combination that is refused.
"""

from __future__ import annotations

import copy
import statistics
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from kaisoku.distributed import env

#: The values ``train.compile`` accepts.
COMPILE_MODES = ("off", "model", "optimizer", "all", "auto")
#: Steps timed for each way under ``auto``, after the compiling warm-up steps.
AUTO_STEPS = 20
WARMUP_STEPS = 3
#: ``auto`` keeps the compiled way only when its trial step is at least 2% faster: a tie goes to eager,
#: which has no compile time and no recompilation risk.
AUTO_MARGIN = 0.98


def compile_conflict(mode: str, *, hybrid: bool, kfac: bool) -> str | None:
    """Why ``train.compile=mode`` cannot run with this config (one line), or None when it can."""
    if mode == "off":
        return None
    if hybrid:
        return (
            f"train.compile={mode} does not work with pipeline stages (parallel.pp > 1): the stages "
            "send activations between compiled graphs; use train.compile=off"
        )
    if kfac and mode in ("model", "all", "auto"):
        return (
            f"train.compile={mode} does not work with optim.kfac.enabled: K-FAC reads layer inputs and "
            "gradients through module hooks that a compiled model skips; use train.compile=optimizer or off"
        )
    return None


@dataclass
class CompileReport:
    """What :func:`compile_for_training` did."""

    mode: str
    """The way the run goes: off, model, optimizer or all (auto resolved)."""
    compile_seconds: float = 0.0
    """Time of the compiling warm-up steps minus as many eager steps (0 when nothing was compiled)."""
    eager_step_seconds: float | None = None
    """Median eager step time of the trial, where one was run."""
    compiled_step_seconds: float | None = None
    """Median compiled step time of the trial, where one was run."""

    def line(self, requested: str) -> str:
        """The one line the run prints about compilation."""
        if requested == "off":
            return "compile: off"
        text = f"compile: {self.mode}"
        if requested == "auto":
            eager, compiled = self.eager_step_seconds, self.compiled_step_seconds
            text = (
                f"compile auto: kept {self.mode} "
                f"(step {compiled * 1e3:.1f} ms compiled vs {eager * 1e3:.1f} ms eager over {AUTO_STEPS} steps)"
                if eager is not None and compiled is not None
                else f"compile auto: kept {self.mode}"
            )
        return f"{text}; compile time {self.compile_seconds:.1f} s"


class CompiledStep:
    """``optimizer.step`` through ``torch.compile``, with tensor learning rates for the call only.

    Installed as the optimizer's ``step`` attribute. Each call fills one 0-dim tensor per group with the
    group's current ``lr``, swaps it in, runs the compiled step and puts the number back.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self._optimizer = optimizer
        self._eager = optimizer.step
        self._compiled: Callable[[], Any] = torch.compile(self._eager, fullgraph=False)
        self._lrs: list[Tensor] = []
        for group in optimizer.param_groups:
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            self._lrs.append(torch.tensor(float(group["lr"]), dtype=torch.float32, device=device))

    def __call__(self, closure: Callable[[], float] | None = None) -> Any:
        """One optimizer step; a closure runs the eager step (a compiled closure would re-trace the model)."""
        if closure is not None:
            return self._eager(closure)
        groups = self._optimizer.param_groups
        saved = [group["lr"] for group in groups]
        for group, tensor, lr in zip(groups, self._lrs, saved):
            group["lr"] = tensor.fill_(float(lr))
        try:
            return self._compiled()
        finally:
            for group, lr in zip(groups, saved):
                group["lr"] = lr


def compile_optimizer(optimizer: Optimizer) -> None:
    """Compile ``optimizer``'s update in place (see the module docstring)."""
    compile_update = getattr(optimizer, "compile_update", None)
    if compile_update is not None:
        compile_update()
        return
    if getattr(optimizer.step, "__func__", None) is not _compiled_step:
        compiled = CompiledStep(optimizer)
        optimizer._kaisoku_compiled_step = compiled  # type: ignore[attr-defined]
        # A bound method, as torch's LR schedulers expect of optimizer.step (they wrap step.__func__).
        optimizer.step = types.MethodType(_compiled_step, optimizer)  # type: ignore[method-assign]


def _compiled_step(optimizer: Optimizer, closure: Callable[[], float] | None = None) -> Any:
    """``optimizer.step`` once :func:`compile_optimizer` installed it: the optimizer's :class:`CompiledStep`."""
    return optimizer._kaisoku_compiled_step(closure)  # type: ignore[attr-defined]


def apply_mode(mode: str, model: nn.Module, optimizer: Optimizer) -> None:
    """Compile ``model`` and/or ``optimizer`` in place for ``mode`` (model, optimizer, all; off does nothing)."""
    if mode in ("model", "all"):
        model.compile()
    if mode in ("optimizer", "all"):
        compile_optimizer(optimizer)


@dataclass(frozen=True)
class Trial:
    """What a timing trial trains on: the loss, a fixed batch of the run's shape, the autocast context."""

    loss_fn: Callable[[Tensor, Tensor], Tensor]
    batch: tuple[Tensor, Tensor]
    autocast: Callable[[], Any]

    def step(self, model: nn.Module, optimizer: Optimizer) -> float:
        """One forward, backward and optimizer step; its wall time (device work included)."""
        images, labels = self.batch
        start = time.perf_counter()
        with self.autocast():
            loss = self.loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if images.device.type == "cuda":
            torch.cuda.synchronize(images.device)
        return time.perf_counter() - start


def prepare_way(
    mode: str, model: nn.Module, optimizer: Optimizer, trial: Trial
) -> tuple[float, Callable[[], float]]:
    """Copies of ``model`` and ``optimizer`` compiled for ``mode`` and warmed up.

    Returns the warm-up's seconds (``WARMUP_STEPS`` steps, compilation included) and a function that
    runs one more training step on the copies and returns its seconds.
    """
    memo: dict[int, Any] = {}
    model_copy = copy.deepcopy(model, memo)
    optimizer_copy = copy.deepcopy(optimizer, memo)  # the shared memo maps its parameters to the copy's
    apply_mode(mode, model_copy, optimizer_copy)
    model_copy.train()

    def step() -> float:
        return trial.step(model_copy, optimizer_copy)

    warmup = sum(step() for _ in range(WARMUP_STEPS))
    return warmup, step


def time_way(
    mode: str, model: nn.Module, optimizer: Optimizer, trial: Trial, *, steps: int = AUTO_STEPS
) -> tuple[float, float]:
    """``(warm-up seconds, median step seconds)`` of ``mode`` on copies of ``model`` and ``optimizer``."""
    warmup, step = prepare_way(mode, model, optimizer, trial)
    return warmup, statistics.median(step() for _ in range(steps))


def compile_for_training(
    mode: str,
    model: nn.Module,
    optimizer: Optimizer,
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    batch: tuple[Tensor, Tensor],
    autocast: Callable[[], Any],
    trial_model: nn.Module | None = None,
    decide: Callable[[str], str] = lambda choice: choice,
) -> CompileReport:
    """Apply ``train.compile=mode`` to the run's ``model`` (as the engine runs it) and ``optimizer``.

    ``batch`` is a synthetic batch of the run's shape for the timing trial, ``trial_model`` the module to
    copy for it (the model without its DDP wrapper; default ``model``), ``decide`` makes every rank take
    the same choice (rank 0's). Returns what was done, with the compile time measured on the trial copy.
    """
    if mode == "off":
        return CompileReport(mode="off")
    source = trial_model if trial_model is not None else model
    way = "all" if mode == "auto" else mode
    # A named mode needs the compile time only: one timed step after the warm-up of each way.
    steps = AUTO_STEPS if mode == "auto" else 1
    trial = Trial(loss_fn, batch, autocast)
    eager_warmup, eager_step = time_way("off", source, optimizer, trial, steps=steps)
    warmup, compiled_step = time_way(way, source, optimizer, trial, steps=steps)
    chosen = way
    if mode == "auto":
        chosen = decide(way if compiled_step < AUTO_MARGIN * eager_step else "off")
    apply_mode(chosen, model, optimizer)
    return CompileReport(
        mode=chosen,
        compile_seconds=max(0.0, warmup - eager_warmup),
        eager_step_seconds=eager_step,
        compiled_step_seconds=compiled_step,
    )


def synthetic_batch(
    shape: tuple[int, ...], num_classes: int, device: torch.device, *, seed: int
) -> tuple[Tensor, Tensor]:
    """A batch of standard-normal images and uniform labels, keyed by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(shape, generator=generator)
    labels = torch.randint(0, num_classes, (shape[0],), generator=generator)
    return images.to(device), labels.to(device)


def compile_run(
    mode: str,
    model: nn.Module,
    optimizer: Optimizer,
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    autocast: Callable[[], Any],
    example: Callable[[], tuple[Tensor, Tensor]],
    announce: bool,
) -> CompileReport:
    """:func:`compile_for_training` for ``kaisoku train``.

    ``example`` gives the trial batch (one rank's micro-batch of the run's shape), called only when a mode
    is set; every rank takes rank 0's choice; the main rank (``announce``) prints the one line.
    """
    if mode == "off":
        return CompileReport(mode="off")
    report = compile_for_training(
        mode,
        model,
        optimizer,
        loss_fn=loss_fn,
        batch=example(),
        autocast=autocast,
        trial_model=getattr(model, "module", model),
        decide=lambda choice: str(env.broadcast_object(choice)),
    )
    if announce:
        print(f"kaisoku: {report.line(mode)}", flush=True)
    return report
