"""LAMB: Adam moments scaled by a layer-wise trust ratio, every layer updated in a few batched calls."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kaisoku.optim.layerwise import (
    Coeff,
    ExcludeFn,
    NormReduce,
    ParamsT,
    _axpy,
    _check_non_negative,
    _check_positive,
    _LayerwiseOptimizer,
    exclude_ndim_le_1,
    layer_norms,
)


class LAMB(_LayerwiseOptimizer):
    """LAMB: Adam moments with a layer-wise trust ratio, on the same batched, sync-free machinery as LARS.

    For each adapted parameter ``w``::

        m = b1 * m + (1 - b1) * g ;  v = b2 * v + (1 - b2) * g^2
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
        w -= lr * (||w|| / ||u||) * u           (ratio 1 where a norm is 0; clipped at ``max_trust``)

    Excluded parameters (``ndim <= 1`` by default) take the Adam step ``u`` without weight decay or ratio.
    The step count ``t`` is kept per parameter as a Python int, so bias corrections cost no device work.

    Args:
        params: as for :class:`~kaisoku.optim.lars.LARS`.
        lr: learning rate, > 0.
        betas: moment coefficients, each in [0, 1).
        eps: added to the root of the second moment.
        weight_decay: decoupled weight decay of adapted parameters (inside the trust ratio).
        max_trust: upper bound of the trust ratio; 0 leaves it unbounded.
        exclude: as for :class:`~kaisoku.optim.lars.LARS`.
        compile: run the update through ``torch.compile`` (first step compiles; worth it on GPUs).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        *,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        max_trust: float = 10.0,
        exclude: ExcludeFn = exclude_ndim_le_1,
        compile: bool = False,
    ) -> None:
        _check_positive("LAMB", "lr", lr)
        _check_non_negative("LAMB", "weight_decay", weight_decay)
        _check_non_negative("LAMB", "max_trust", max_trust)
        _check_positive("LAMB", "eps", eps)
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"LAMB: betas[{index}] must be in [0, 1) (got {beta})")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        defaults.update(max_trust=max_trust, lars_exclude=None)
        self._exclude = exclude
        self._lr_tensors = {}
        self._compile = False
        self._eager_update = self._update = lamb_update
        if compile:
            self.compile_update()
        super().__init__(params, defaults)

    def _init_state(self, state: dict[str, Any], param: Tensor) -> None:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _step_group(self, index: int, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        for adapted, excluded in self._collect(group, ("exp_avg", "exp_avg_sq")):
            params, grads, exp_avgs, exp_avg_sqs = (a + e for a, e in zip(adapted, excluded))
            if not params:
                continue
            steps = []
            for param in params:
                state = self._state_of(param)
                state["step"] += 1
                steps.append(state["step"])
            device = params[0].device
            lr: float | Tensor = float(group["lr"])
            if self._compile:
                lr = self._lr_tensor(index, device, lr)
            # Bias corrections computed on the host in double precision (no device work). Eager: as scalar
            # lists, which a _foreach call applies in one kernel (a list of 0-dim tensors would launch one
            # kernel per tensor on CUDA). Compiled: sent as one tensor, so that new values are not new
            # constants and the update never recompiles.
            bias_corrections = ([1 / (1 - beta1**t) for t in steps], [(1 - beta2**t) ** -0.5 for t in steps])
            corrections: Tensor | tuple[list[float], list[float]] = bias_corrections
            if self._compile:
                corrections = torch.tensor(bias_corrections, dtype=torch.float32).to(
                    device, non_blocking=True
                )
            self._update(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                corrections,
                count=len(adapted[0]),
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                max_trust=group["max_trust"],
                norm_reduce=self._norm_reduce,
            )


def lamb_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    corrections: Tensor | tuple[list[float], list[float]],
    *,
    count: int,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_trust: float,
    norm_reduce: NormReduce | None = None,
) -> None:
    """The LAMB update in place: the first ``count`` tensors adapted, the rest excluded (see :class:`LAMB`).

    ``corrections`` is ``[1 / (1 - beta1^t), (1 - beta2^t)^-0.5]`` per tensor (``t`` its step count): two
    lists of floats, or a ``(2, n)`` tensor (the compiled path). ``lr`` may be a 0-dim tensor (the compiled
    path passes one so that a changing learning rate does not recompile). With ``norm_reduce`` the tensors
    are local shards and the norms are summed over the shards (:func:`layer_norms`).
    """
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    # u = m / bc1 / (sqrt(v) / sqrt(bc2) + eps), bias corrections per tensor.
    inv_bc1: list[float] | list[Tensor]
    inv_sqrt_bc2: list[float] | list[Tensor]
    if isinstance(corrections, Tensor):
        inv_bc1, inv_sqrt_bc2 = (list(row.unbind(0)) for row in corrections)
    else:
        inv_bc1, inv_sqrt_bc2 = corrections
    denom = list(torch._foreach_sqrt(exp_avg_sqs))
    torch._foreach_mul_(denom, inv_sqrt_bc2)
    torch._foreach_add_(denom, eps)
    updates = list(torch._foreach_div(exp_avgs, denom))
    torch._foreach_mul_(updates, inv_bc1)

    params_a, updates_a = params[:count], updates[:count]
    scale: Coeff = -lr
    if count:
        if weight_decay != 0:
            torch._foreach_add_(updates_a, params_a, alpha=weight_decay)
        norms = layer_norms(params_a + updates_a, norm_reduce)
        weight_norms, update_norms = norms[:count], norms[count:]
        ratio = weight_norms / update_norms
        if max_trust > 0:
            ratio = ratio.clamp(max=max_trust)
        usable = (weight_norms > 0) & (update_norms > 0)
        scale = list(torch.where(usable, ratio, 1.0).mul(-lr).unbind(0))
    _axpy(params_a, updates_a, scale)
    _axpy(params[count:], updates[count:], -lr)
