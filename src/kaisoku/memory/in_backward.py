"""The optimizer step inside the backward pass: each parameter is updated as soon as its gradient is final.

Single process: a ``register_post_accumulate_grad_hook`` per parameter runs the optimizer on that one
parameter and frees its gradient, so at most a few gradients exist at any time instead of all of them.
Under DDP the gradient is final only once its bucket is all-reduced: a communication hook chains the
update of the bucket's parameters onto the all-reduce future, so the last layers are updated while the
backward pass of the first ones still runs.

The update is the run's own optimizer (its state, its parameter groups, its learning rate of the step)
stepped on a subset of the parameters, so the weights are those of the ordinary step, bit for bit, for
optimizers whose update of one parameter reads only that parameter (SGD, LARS's per-layer trust ratio,
LAMB's). Excluded (refused by config validation): gradient clipping over all parameters, K-FAC (it needs
every gradient before the step), gradient accumulation (the gradient is final only after the last
micro-batch), hybrid parallelism, the fp16 gradient scaler (it decides after backward whether to step),
non-finite skipping (it too decides after backward), and a compiled optimizer step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from kaisoku.distributed.data_parallel import chain_after_allreduce

#: Optimizers whose update of one parameter depends on that parameter alone.
SUPPORTED = ("sgd", "lars", "lamb")


class SubsetStepper:
    """Run ``optimizer.step()`` on some of its parameters only, keeping its state and groups."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._lock = threading.Lock()  # bucket callbacks may run on the communication thread

    def step(self, params: Iterable[torch.Tensor]) -> None:
        """Update ``params`` (which have their final ``.grad``) with the optimizer's current settings."""
        wanted = {id(p) for p in params}
        with self._lock:
            groups = self.optimizer.param_groups
            views: list[dict[str, Any]] = []
            for group in groups:
                keep = [i for i, p in enumerate(group["params"]) if id(p) in wanted]
                view = dict(group)
                view["params"] = [group["params"][i] for i in keep]
                if "param_names" in group:
                    view["param_names"] = [group["param_names"][i] for i in keep]
                views.append(view)
            # The views share every setting (lr of this step included); state is keyed by parameter.
            self.optimizer.param_groups = views
            try:
                self.optimizer.step()
            finally:
                self.optimizer.param_groups = groups


def install_update_hooks(model: nn.Module, optimizer: Optimizer) -> Callable[[], None]:
    """Update each parameter of ``model`` right after its gradient is accumulated, then free the gradient.

    Returns a function that removes the hooks.
    """
    stepper = SubsetStepper(optimizer)

    def hook(param: torch.Tensor) -> None:
        stepper.step([param])
        param.grad = None  # the gradient's memory goes back while the backward pass goes on

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters() if p.requires_grad]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def in_backward_conflict(
    *,
    optimizer: str,
    grad_accum: int,
    kfac: bool,
    hybrid: bool,
    precision: str,
    on_nonfinite: str,
    compile_mode: str,
    compile_optimizer: bool,
) -> str:
    """Why ``memory.update_in_backward`` cannot run with these settings, in one line; "" when it can."""
    reasons = [
        (optimizer not in SUPPORTED, f"optim.name {optimizer} (supported: {', '.join(SUPPORTED)})"),
        (grad_accum > 1, "train.grad_accum > 1 (a gradient is final only after the last micro-batch)"),
        (kfac, "optim.kfac (it preconditions every gradient before the step)"),
        (hybrid, "hybrid parallelism (parallel.pp > 1 or parallel.switch)"),
        (
            precision == "fp16",
            "precision.mode fp16 (its gradient scaler decides after backward whether to step)",
        ),
        (on_nonfinite == "skip", "train.on_nonfinite skip (it decides after backward whether to step)"),
        (compile_mode in ("optimizer", "all", "auto") or compile_optimizer, "a compiled optimizer step"),
    ]
    for bad, what in reasons:
        if bad:
            return f"memory.update_in_backward cannot be combined with {what}; switch one of them off"
    return ""


def attach_update_in_backward(model: nn.Module, optimizer: Optimizer, *, compress_bf16: bool = False) -> None:
    """Run ``optimizer`` inside the backward pass of ``model`` (a DDP wrapper or a plain module).

    Under DDP the update is chained onto each bucket's all-reduce (bf16-compressed when
    ``compress_bf16``); the wrapper must have no communication hook yet.
    """
    if hasattr(model, "register_comm_hook"):
        chain_after_allreduce(model, SubsetStepper(optimizer).step, compress_bf16=compress_bf16)
    else:
        install_update_hooks(model, optimizer)
