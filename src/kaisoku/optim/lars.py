"""LARS: layer-wise trust ratios computed for every layer at once, with no host synchronisation.

LARS and LAMB (:mod:`kaisoku.optim.lamb`, importable from here too) share the machinery of
:mod:`kaisoku.optim.layerwise`. Both optimizers keep the per-layer work on the device. All norms of a
parameter group come from one ``torch._foreach_norm`` call, the trust ratios are a handful of vector
operations on the stacked norms (``torch.where`` replaces the usual ``if norm > 0`` test), and the update
is a few ``_foreach`` calls whose per-tensor scale factors are 0-dim tensors. ``step()`` never calls
``.item()`` nor branches on a tensor value, so it runs unchanged on ``meta`` tensors, under CUDA graphs
and under ``torch.compile``.

Parameters with ``ndim <= 1`` (BatchNorm weights and biases) are excluded from adaptation and weight decay
by default, as in the large-batch literature. The choice can be made per parameter group
(``{"params": ..., "lars_exclude": True}``) or per parameter with a predicate ``exclude(name, param)``;
names are available when the optimizer is given ``model.named_parameters()``.

Sharded parameters (DTensors, e.g. under FSDP2) are updated through their local shards. A layer's norm is
then the norm of its whole parameter:
:meth:`~kaisoku.optim.layerwise._LayerwiseOptimizer.reduce_norms_with` takes a function that sums stacked
squared local norms over the shard group (one collective per parameter group and step; see
:func:`kaisoku.distributed.sharding.shard_norm_reducer`), so no parameter is ever gathered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kaisoku.errors import ConfigError
from kaisoku.optim.lamb import LAMB, lamb_update  # noqa: F401  (LAMB's public home was this module)
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

#: The parameter count at which the ImageNet LARS trust coefficient 0.001 was tuned (ResNet-50).
ETA_REFERENCE_PARAMS = 25.6e6
#: Bounds of :func:`lars_eta`.
ETA_MIN, ETA_MAX = 0.001, 0.08


def count_parameters(model_or_groups: nn.Module | list[dict]) -> int:
    """Trainable values of a model, or of parameter-group dicts (``params`` as tensors or (name, tensor))."""
    if isinstance(model_or_groups, nn.Module):
        return sum(p.numel() for p in model_or_groups.parameters() if p.requires_grad)
    total = 0
    for group in model_or_groups:
        for item in group["params"]:
            total += (item[1] if isinstance(item, tuple) else item).numel()
    return total


def lars_eta(num_params: int) -> float:
    """The LARS trust coefficient for a model of ``num_params`` values: ``0.001 * (25.6e6 / n) ** 0.6``.

    0.001 is the ImageNet value at ResNet-50's size. Smaller models have fewer, smaller layers whose
    gradient norm is large relative to the weight norm, so the trust ratio needs a larger coefficient;
    the power 0.6 puts kaisoku's small-cnn (94 k values) at 0.029 and resnet10 (4.9 M) at 0.0027, inside
    the range kaisoku's own benchmarks tune to. The result is clipped to [0.001, 0.08].
    """
    if num_params < 1:
        raise ConfigError("lars_eta: the model has no trainable parameters")
    return min(ETA_MAX, max(ETA_MIN, 0.001 * (ETA_REFERENCE_PARAMS / num_params) ** 0.6))


def trust_ratios(
    weight_norms: Tensor,
    update_norms: Tensor,
    *,
    eta: float,
    weight_decay: float,
    eps: float,
    lr: float | Tensor,
    trust_clip: bool,
) -> Tensor:
    """LARS trust ratios ``eta * ||w|| / (||g|| + wd * ||w|| + eps)`` for stacked norms, 1 where a norm is 0.

    With ``trust_clip`` (LARC's clip mode, as in apex and timm) the ratio becomes ``min(ratio / lr, 1)``: the
    layer's learning rate is ``min(eta * ||w|| / (...), lr)`` and never exceeds the global one.
    """
    denominator = update_norms.add(weight_norms, alpha=weight_decay).add_(eps)
    ratio = weight_norms.mul(eta).div_(denominator)
    if trust_clip:
        ratio = ratio.div_(lr).clamp_(max=1.0)
    # Both norms positive; norms are never negative, so the smaller one decides.
    usable = torch.minimum(weight_norms, update_norms) > 0
    return torch.where(usable, ratio, 1.0)


class LARS(_LayerwiseOptimizer):
    """Momentum SGD with layer-wise adaptive rate scaling (LARS), all layers updated in a few batched calls.

    For each adapted parameter ``w`` with gradient ``g`` the step is::

        trust = eta * ||w|| / (||g|| + wd * ||w|| + eps)     (1 where ||w|| or ||g|| is 0)
        d     = trust * (g + wd * w)
        buf   = momentum * buf + d
        w    -= lr * buf                  (Nesterov: w -= lr * (d + momentum * buf))

    Excluded parameters (``ndim <= 1`` by default) get ``d = g``: plain momentum SGD without weight decay.
    With ``adaptation=False`` the trust ratio is 1 and the optimizer is exactly ``torch.optim.SGD`` (same
    momentum, Nesterov and weight decay) for the adapted parameters.

    ``momentum_correction=True`` (the default) keeps the buffer free of the learning rate, as above: when the
    learning rate changes, the accumulated momentum is rescaled with it (the "momentum correction" of Goyal
    et al.). With ``False`` the learning rate enters the buffer (``buf = momentum * buf + lr * d``,
    ``w -= buf``), so past steps keep the learning rate they were taken with.

    ``p.grad`` is never modified. Parameters without a gradient are skipped; sparse gradients raise.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or parameter-group dicts.
            Group keys override the defaults below; ``lars_exclude=True/False`` forces exclusion for the
            whole group, ``None`` (default) asks ``exclude``.
        lr: learning rate, > 0.
        momentum: momentum factor in [0, 1).
        weight_decay: L2 weight decay of adapted parameters.
        eta: trust coefficient, > 0.
        eps: denominator epsilon of the trust ratio.
        trust_clip: LARC clipping: the trust ratio becomes ``min(ratio / lr, 1)``, so a layer's learning
            rate is ``min(eta * ||w|| / (...), lr)``.
        nesterov: Nesterov momentum.
        momentum_correction: keep the buffer free of the learning rate (see above).
        adaptation: apply the trust ratio; False gives momentum SGD.
        exclude: ``exclude(name, param) -> bool`` for groups without ``lars_exclude``; ``name`` is "" when
            the optimizer was given bare tensors.
        compile: run the update through ``torch.compile`` (first step compiles; worth it on GPUs).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 0.1,
        momentum: float = 0.9,
        *,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        eps: float = 1e-9,
        trust_clip: bool = False,
        nesterov: bool = False,
        momentum_correction: bool = True,
        adaptation: bool = True,
        exclude: ExcludeFn = exclude_ndim_le_1,
        compile: bool = False,
    ) -> None:
        _check_positive("LARS", "lr", lr)
        _check_positive("LARS", "eta", eta)
        _check_non_negative("LARS", "weight_decay", weight_decay)
        _check_non_negative("LARS", "eps", eps)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS: momentum must be in [0, 1) (got {momentum})")
        if nesterov and momentum == 0:
            raise ValueError("LARS: nesterov needs momentum > 0")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            eta=eta,
            eps=eps,
            trust_clip=trust_clip,
            nesterov=nesterov,
            momentum_correction=momentum_correction,
            adaptation=adaptation,
            lars_exclude=None,
        )
        self._exclude = exclude
        self._lr_tensors: dict[tuple[int, torch.device], Tensor] = {}
        self._compile = False
        self._eager_update = self._update = lars_update
        if compile:
            self.compile_update()
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, checking the hyper-parameters it overrides."""
        for key in ("lr", "eta"):
            if key in param_group:
                _check_positive("LARS", f"{key} (parameter group)", param_group[key])
        if "weight_decay" in param_group:
            _check_non_negative("LARS", "weight_decay (parameter group)", param_group["weight_decay"])
        super().add_param_group(param_group)

    def _init_state(self, state: dict[str, Any], param: Tensor) -> None:
        # A zero buffer makes the first step momentum * 0 + d = d, as torch.optim.SGD's clone(d).
        state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _step_group(self, index: int, group: dict[str, Any]) -> None:
        for adapted, excluded in self._collect(group, ("momentum_buffer",)):
            lr: float | Tensor = float(group["lr"])
            if self._compile:
                lr = self._lr_tensor(index, (adapted[0] or excluded[0])[0].device, lr)
            self._update(
                *adapted,
                *excluded,
                lr=lr,
                momentum=group["momentum"],
                weight_decay=group["weight_decay"],
                eta=group["eta"],
                eps=group["eps"],
                trust_clip=group["trust_clip"],
                nesterov=group["nesterov"],
                momentum_correction=group["momentum_correction"],
                adaptation=group["adaptation"],
                norm_reduce=self._norm_reduce,
            )


def lars_update(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor],
    params_excluded: list[Tensor],
    grads_excluded: list[Tensor],
    bufs_excluded: list[Tensor],
    *,
    lr: float | Tensor,
    momentum: float,
    weight_decay: float,
    eta: float,
    eps: float,
    trust_clip: bool,
    nesterov: bool,
    momentum_correction: bool,
    adaptation: bool,
    norm_reduce: NormReduce | None = None,
) -> None:
    """The LARS update of adapted (``params``...) and excluded tensors, in place, by ``_foreach`` calls.

    All tensors share one device and dtype. ``lr`` may be a 0-dim tensor (the compiled path passes one so
    that a changing learning rate does not recompile). See :class:`LARS` for the formulas. With
    ``norm_reduce`` the tensors are local shards and the norms are summed over the shards (:func:`layer_norms`).
    """
    # The buffer accumulates inner * d and the weights move by -outer * buf: (1, lr) keeps the learning
    # rate out of the buffer (momentum correction), (lr, 1) folds it in.
    inner, outer = (1.0, lr) if momentum_correction else (lr, 1.0)
    # buf = momentum * buf + coeff_grad * g + coeff_weight * w, per tensor.
    coeff_grad: Coeff = inner
    coeff_weight: Coeff = inner * weight_decay
    trust: Tensor | None = None
    if adaptation and params:
        norms = layer_norms(params + grads, norm_reduce)
        trust = trust_ratios(
            norms[: len(params)],
            norms[len(params) :],
            eta=eta,
            weight_decay=weight_decay,
            eps=eps,
            lr=lr,
            trust_clip=trust_clip,
        )
        if isinstance(inner, Tensor) or inner != 1.0:
            trust = trust.mul_(inner)
        coeff_grad = list(trust.unbind(0))
        if weight_decay != 0:
            coeff_weight = list(trust.mul(weight_decay).unbind(0))

    all_bufs = bufs + bufs_excluded
    if momentum != 0:
        # On CPU a Python scalar is converted to a tensor once per tensor of the list; one 0-dim tensor is
        # not. On accelerators the scalar goes straight into the fused kernel.
        if all_bufs[0].device.type == "cpu":
            dtype = torch.promote_types(all_bufs[0].dtype, torch.float32)
            torch._foreach_mul_(all_bufs, torch.scalar_tensor(momentum, dtype=dtype))
        else:
            torch._foreach_mul_(all_bufs, momentum)
    else:
        torch._foreach_zero_(all_bufs)
    if trust is None:
        _axpy(all_bufs, grads + grads_excluded, inner)  # one call when both lists share the scale
    else:
        _axpy(bufs, grads, coeff_grad)
        _axpy(bufs_excluded, grads_excluded, inner)
    if weight_decay != 0:
        _axpy(bufs, params, coeff_weight)

    all_params = params + params_excluded
    if not nesterov:
        _axpy(all_params, all_bufs, -outer)
        return
    # Nesterov: w -= outer * (coeff_grad * g + coeff_weight * w + momentum * buf); the weight term reads
    # w, so it goes first.
    if weight_decay != 0:
        _axpy(params, params, coeff_weight, -outer)
    if trust is None:
        _axpy(all_params, grads + grads_excluded, inner, -outer)
    else:
        _axpy(params, grads, coeff_grad, -outer)
        _axpy(params_excluded, grads_excluded, inner, -outer)
    _axpy(all_params, all_bufs, momentum, -outer)
