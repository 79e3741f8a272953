"""A trial step on two samples before launch: the user's model, loss, validation figures and metrics are run
once on the CPU, so that an output the loss cannot take, or one validation cannot score, or (under pipeline
stages) a block that hands the next anything but a tensor, is one line (exit 2) before any rank starts, not
a traceback after the training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kaisoku.engine.build import build_loss, example_batch, generators_put_back
from kaisoku.engine.structures import batch_size, call_model
from kaisoku.engine.tasks import make_task
from kaisoku.engine.user_metrics import UserMetrics
from kaisoku.errors import ConfigError
from kaisoku.models.blocks import ordered_blocks
from kaisoku.parts import UserParts
from kaisoku.run_facts import make_model
from kaisoku.run_plan import RunPlan

#: Samples the trial runs on: two, so that a batch dimension is a batch dimension.
TRIAL_SAMPLES = 2


def trial_step(plan: RunPlan, parts: UserParts) -> None:
    """Run the user's model on two samples of the run's data, then the training loss, the validation figures
    (where a validation set exists) and the user's metrics on its output; a one-line ConfigError naming the
    part that failed. Nothing of the run changes: no gradient, the model in eval mode for the trial (no
    running statistic moves), every random generator put back. Zoo models are known to fit their data: only
    a user's model is tried."""
    if parts.model is None:
        return
    with generators_put_back(), torch.no_grad():
        _trial(plan, parts)


def _trial(plan: RunPlan, parts: UserParts) -> None:
    model = make_model(plan.config, plan.model.spec, parts)
    device = _device_of(model)
    if device is None:
        return  # built on the meta device (deferred initialisation): nothing to compute with
    inputs, targets = _attempt(
        "reading two samples", lambda: example_batch(plan, device, parts, TRIAL_SAMPLES)
    )
    was_training = model.training
    model.eval()
    try:
        outputs = _attempt("the model's forward on two samples", lambda: call_model(model, inputs))
        if plan.schedule is not None and any(segment.layout.pp > 1 for segment in plan.schedule.segments):
            _check_stage_boundaries(model, inputs)
    finally:
        model.train(was_training)
    loss = _attempt("the loss", lambda: build_loss(plan, parts)(outputs, targets))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(
            f"loss: it returned a {_shape(loss)} for a batch of the model's outputs; a loss returns one number"
        )
    if plan.data.has_val:
        task = make_task(plan.task, mean=(), std=(), loss_fn=parts.loss, target_key=plan.data.target_key)
        _attempt("validation", lambda: task.validation_sums(outputs, targets))
    if parts.metrics:
        metrics = UserMetrics(parts.metrics, device, target_key=plan.data.target_key, task=plan.task)
        _attempt("train.metrics", lambda: metrics.update(outputs, targets, batch_size(inputs)))
        metrics.reset()


def _check_stage_boundaries(model: nn.Module, inputs: Any) -> None:
    """Pipeline stages pass one tensor from stage to stage: run the model's ordered blocks in turn and refuse,
    naming the block, one that hands the next anything else (a tuple, a dict, a model output object)."""
    blocks = _attempt("splitting the model into its ordered blocks", lambda: ordered_blocks(model))
    value = inputs
    for index, block in enumerate(blocks[:-1]):
        value = _attempt(f"block {index} of the model's ordered blocks", lambda b=block, v=value: b(v))
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"parallel.pp: block {index} ({type(block).__name__}) of the model's ordered blocks gives a "
                f"{type(value).__name__}, but pipeline stages pass one tensor between them; make each block "
                "return a tensor, or train with parallel.pp 1 (data parallel or sharded)"
            )


def _attempt(what: str, action: Callable[[], Any]) -> Any:
    """``action()``; a one-line ConfigError naming ``what`` when it raises."""
    try:
        return action()
    except ConfigError:
        raise
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ConfigError(
            f"a trial step before launch failed in {what}: {type(error).__name__}: {first}; the model's output, "
            "the loss and the task must fit each other (see kaisoku train --print-plan for the mapping)"
        ) from None


def _device_of(model: nn.Module) -> torch.device | None:
    """Where the model's weights are; None on the meta device."""
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    device = tensor.device if tensor is not None else torch.device("cpu")
    return None if device.type == "meta" else device


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {list(value.shape)}"
    return type(value).__name__
