"""The batched, sync-free machinery LARS and LAMB share: norms, scaled adds and the optimizer base."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import torch
from torch import Tensor
from torch.optim import Optimizer

ParamsT: TypeAlias = Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]]
"""What an optimizer accepts: tensors, (name, tensor) pairs or parameter-group dicts."""

ExcludeFn: TypeAlias = Callable[[str, Tensor], bool]
"""``exclude(name, param) -> bool``: True leaves the parameter out of adaptation and weight decay."""

Coeff: TypeAlias = float | Tensor | list[Tensor]
"""A multiplier: one number (Python or 0-dim tensor) for every tensor of a list, or one 0-dim tensor each."""


def exclude_ndim_le_1(name: str, param: Tensor) -> bool:
    """The default exclusion rule: BatchNorm parameters and biases, i.e. every tensor with ``ndim <= 1``."""
    return param.ndim <= 1


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
