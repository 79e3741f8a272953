"""LARS and LAMB: layer-wise trust ratios computed for every layer at once, with no host synchronisation.

Both optimizers keep the per-layer work on the device. All norms of a parameter group come from one
``torch._foreach_norm`` call, the trust ratios are a handful of vector operations on the stacked norms
(``torch.where`` replaces the usual ``if norm > 0`` test), and the update is a few ``_foreach`` calls whose
per-tensor scale factors are 0-dim tensors. ``step()`` never calls ``.item()`` nor branches on a tensor
value, so it runs unchanged on ``meta`` tensors, under CUDA graphs and under ``torch.compile``.

Parameters with ``ndim <= 1`` (BatchNorm weights and biases) are excluded from adaptation and weight decay
by default, as in the large-batch literature. The choice can be made per parameter group
(``{"params": ..., "lars_exclude": True}``) or per parameter with a predicate ``exclude(name, param)``;
names are available when the optimizer is given ``model.named_parameters()``.

Sharded parameters (DTensors, e.g. under FSDP2) are updated through their local shards. A layer's norm is
then the norm of its whole parameter: :meth:`_LayerwiseOptimizer.reduce_norms_with` takes a function that
sums stacked squared local norms over the shard group (one collective per parameter group and step; see
:func:`kaisoku.distributed.sharding.shard_norm_reducer`), so no parameter is ever gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from kaisoku.errors import ConfigError

ParamsT: TypeAlias = Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]]
"""What an optimizer accepts: tensors, (name, tensor) pairs or parameter-group dicts."""

ExcludeFn: TypeAlias = Callable[[str, Tensor], bool]
"""``exclude(name, param) -> bool``: True leaves the parameter out of adaptation and weight decay."""

Coeff: TypeAlias = float | Tensor | list[Tensor]
"""A multiplier: one number (Python or 0-dim tensor) for every tensor of a list, or one 0-dim tensor each."""


def exclude_ndim_le_1(name: str, param: Tensor) -> bool:
    """The default exclusion rule: BatchNorm parameters and biases, i.e. every tensor with ``ndim <= 1``."""
    return param.ndim <= 1


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


NormReduce: TypeAlias = Callable[[Tensor], Tensor]
"""``reduce(squares) -> squares``: stacked squared local norms summed over the ranks that share a parameter."""


def _local(tensor: Tensor) -> Tensor:
    """A sharded tensor's local shard (a view: in-place updates reach the parameter), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def layer_norms(tensors: list[Tensor], reduce: NormReduce | None) -> Tensor:
    """The stacked 2-norms of ``tensors``; with ``reduce``, of the whole tensors whose local shards they are
    (``sqrt(sum over ranks of ||shard||^2)``, one ``reduce`` call for all of them)."""
    norms = torch.stack(torch._foreach_norm(tensors))
    if reduce is None:
        return norms
    return reduce(norms.square()).sqrt()


def _check_positive(owner: str, name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{owner}: {name} must be > 0 (got {value})")


def _check_non_negative(owner: str, name: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{owner}: {name} must be >= 0 (got {value})")


def _axpy(dst: list[Tensor], src: list[Tensor], coeff: Coeff, value: float | Tensor = 1.0) -> None:
    """``dst[i] += value * coeff[i] * src[i]`` (or ``value * coeff * src[i]``) in one ``_foreach`` call."""
    if not dst:
        return
    if isinstance(coeff, list):
        if isinstance(value, Tensor):  # compiled path: the products fuse there
            coeff = list(torch._foreach_mul(coeff, value))
            value = 1.0
        torch._foreach_addcmul_(dst, src, coeff, value=value)
    elif isinstance(coeff, Tensor) or isinstance(value, Tensor):
        # A tensor learning rate (compiled path): the product is fused there, never materialised.
        torch._foreach_add_(dst, torch._foreach_mul(src, coeff * value))
    else:
        torch._foreach_add_(dst, src, alpha=value * coeff)


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


class _LayerwiseOptimizer(Optimizer):
    """Shared plumbing: the step loop, parameter collection, exclusion, sparse-gradient check, device grouping."""

    _exclude: ExcludeFn

    def _collect(self, group: dict[str, Any], state_keys: tuple[str, ...]) -> list[tuple[Any, ...]]:
        """The group's parameters that have gradients, split into adapted and excluded lists per device.

        Returns ``(adapted, excluded)`` pairs, one per (device, dtype); each is a tuple of lists
        ``(params, grads, *state tensors)``.
        """
        names = group.get("param_names")
        forced = group.get("lars_exclude")
        sharded = False
        self._originals: dict[int, Tensor] = {}
        buckets: dict[tuple[torch.device, torch.dtype], tuple[list[list[Tensor]], list[list[Tensor]]]] = {}
        width = 2 + len(state_keys)
        for index, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients; parameter "
                    f"{names[index] if names else index} of group {self.param_groups.index(group)} has one "
                    "(use a dense embedding or a sparse-aware optimizer for it)"
                )
            excluded = forced if forced is not None else self._exclude(names[index] if names else "", param)
            state = self.state[param]
            if not state:
                self._init_state(state, param)
            key = (param.device, param.dtype)
            if key not in buckets:
                buckets[key] = ([[] for _ in range(width)], [[] for _ in range(width)])
            lists = buckets[key][1 if excluded else 0]
            local = _local(param)
            if local is not param:
                sharded = True
                self._originals[id(local)] = param
            lists[0].append(local)
            lists[1].append(_local(grad))
            for slot, state_key in enumerate(state_keys, start=2):
                lists[slot].append(_local(state[state_key]))
        if sharded and self._norm_reduce is None:
            raise RuntimeError(
                f"{type(self).__name__} got sharded parameters but no way to sum their norms over the shards; "
                "call reduce_norms_with(kaisoku.distributed.sharding.shard_norm_reducer(mesh))"
            )
        return [(tuple(adapted), tuple(excluded)) for adapted, excluded in buckets.values()]

    def _state_of(self, tensor: Tensor) -> dict[str, Any]:
        """The state of the parameter ``tensor`` is (or, after :meth:`_collect`, the local shard of)."""
        return self.state[self._originals.get(id(tensor), tensor)]

    _norm_reduce: NormReduce | None = None

    def reduce_norms_with(self, reduce: NormReduce | None) -> None:
        """Sum each layer's squared local norms with ``reduce`` (sharded parameters); None: local norms."""
        self._norm_reduce = reduce

    _lr_tensors: dict[tuple[int, torch.device], Tensor]

    def _lr_tensor(self, group_index: int, device: torch.device, lr: float) -> Tensor:
        """A 0-dim device tensor holding ``lr``, reused across steps so the compiled update never recompiles."""
        key = (group_index, device)
        tensor = self._lr_tensors.get(key)
        if tensor is None:
            tensor = self._lr_tensors[key] = torch.tensor(lr, dtype=torch.float32, device=device)
        return tensor.fill_(lr)

    _compile: bool
    _update: Callable[..., None]
    _eager_update: Callable[..., None]

    def __getstate__(self) -> dict[str, Any]:
        """torch's optimizer state plus the exclusion rule and the update (copies and pickles keep them)."""
        state = super().__getstate__()
        state.update(_exclude=self._exclude, _eager_update=self._eager_update, _compile=self._compile)
        state.pop("_norm_reduce", None)  # holds a process group: a copy is given its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`__getstate__`; a compiled update is compiled afresh for the copy."""
        compiled = state.pop("_compile", False)
        super().__setstate__(state)
        self._lr_tensors = {}
        self._compile = False
        self._update = self._eager_update
        if compiled:
            self.compile_update()

    def compile_update(self) -> None:
        """Run the batched update through ``torch.compile`` from the next step on (that step compiles)."""
        if not self._compile:
            self._compile = True
            self._update = torch.compile(self._eager_update, dynamic=False)  # type: ignore[assignment]

    def _init_state(self, state: dict[str, Any], param: Tensor) -> None:
        raise NotImplementedError

    def _step_group(self, index: int, group: dict[str, Any]) -> None:
        """Update the parameters of ``self.param_groups[index]`` (``group``) from their gradients."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one optimization step; ``closure`` re-evaluates the loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group)
        return loss


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


class LAMB(_LayerwiseOptimizer):
    """LAMB: Adam moments with a layer-wise trust ratio, on the same batched, sync-free machinery as LARS.

    For each adapted parameter ``w``::

        m = b1 * m + (1 - b1) * g ;  v = b2 * v + (1 - b2) * g^2
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
        w -= lr * (||w|| / ||u||) * u           (ratio 1 where a norm is 0; clipped at ``max_trust``)

    Excluded parameters (``ndim <= 1`` by default) take the Adam step ``u`` without weight decay or ratio.
    The step count ``t`` is kept per parameter as a Python int, so bias corrections cost no device work.

    Args:
        params: as for :class:`LARS`.
        lr: learning rate, > 0.
        betas: moment coefficients, each in [0, 1).
        eps: added to the root of the second moment.
        weight_decay: decoupled weight decay of adapted parameters (inside the trust ratio).
        max_trust: upper bound of the trust ratio; 0 leaves it unbounded.
        exclude: as for :class:`LARS`.
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
