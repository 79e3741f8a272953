"""K-FAC factor decompositions (eigen or damped inverse): their owners, computing, sharing, applying."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from kaisoku.optim.kfac.assignment import decomposition_cost, greedy_assignment
from kaisoku.optim.kfac.checkpoint import Decompositions
from kaisoku.optim.kfac.distributed import Communicator, broadcast_from_owners
from kaisoku.optim.kfac.layers import (
    KFACLayer,
    KroneckerLayer,
    SingularFactorError,
    damped_inverse,
    precondition_eigen,
    precondition_inverse,
    symmetric_eigen,
)

#: How often a failing decomposition is retried with ten times the damping before the layer falls back
#: to its plain gradient for this step.
MAX_DAMPING_RAISES = 8
#: Damping a singular factor is raised to at least, when the configured damping is zero.
MIN_RAISED_DAMPING = 1e-6


class KFACWarning(RuntimeWarning):
    """A factor was singular or not finite; K-FAC raised damping or skipped the statistics."""


def raise_damping_floor(layer: KFACLayer, damping: float, why: str, step: int) -> float:
    """Raise ``layer``'s damping floor to ten times its effective damping (at least ``MIN_RAISED_DAMPING``)
    after a failure at ``step``, with a :class:`KFACWarning` saying ``why``; returns the new floor."""
    effective = max(damping, layer.damping_floor)
    layer.damping_floor = max(10.0 * effective, MIN_RAISED_DAMPING)
    warnings.warn(
        f"K-FAC: {why} in layer '{layer.name}' at step {step}; its damping is raised to "
        f"{layer.damping_floor:.3g}",
        KFACWarning,
        stacklevel=4,
    )
    return layer.damping_floor


def decomposition_work(layers: Sequence[KroneckerLayer], memory_mode: str) -> dict[str, float]:
    """The decomposition work items and their costs: one per factor (``"layer#A"``, finer balance), or one
    per layer (``"layer"``) in ``"owner"`` memory mode, where the owner needs both factors to precondition."""
    costs: dict[str, float] = {}
    for layer in layers:
        dims = [shape[0] for shape in layer.factor_shapes()]
        if memory_mode == "owner":
            costs[layer.name] = decomposition_cost(dims)
        else:
            for factor_name, dim in zip(layer.factor_names, dims):
                costs[f"{layer.name}#{factor_name}"] = decomposition_cost([dim])
    return costs


class FactorDecompositions:
    """The decompositions of the Kronecker layers' factors: their owners, computing, sharing and applying them.

    Args:
        layers: the Kronecker layers whose factors are decomposed.
        method: ``"eigen"`` (eigenvectors and eigenvalues) or ``"inverse"`` (the damped inverse).
        memory_mode: ``"full"`` (one work item per factor) or ``"owner"`` (one per layer).
        comm: the data-parallel group the work is spread over.
    """

    def __init__(
        self, layers: Sequence[KroneckerLayer], *, method: str, memory_mode: str, comm: Communicator
    ) -> None:
        self.layers = list(layers)
        self.method = method
        self.memory_mode = memory_mode
        self.comm = comm
        #: Work item -> decomposition cost (sum of factor sizes cubed).
        self.work_costs = decomposition_work(self.layers, memory_mode)
        #: Work item -> the rank that decomposes it.
        self.assignment = greedy_assignment(self.work_costs, comm.world_size)
        #: Layer name -> per factor: [eigenvectors, eigenvalues] or [inverse], or None when not held here.
        self.held: Decompositions = {layer.name: [None, None] for layer in self.layers}

    def owner(self, layer_name: str, factor_index: int) -> int:
        """The rank that decomposes factor ``factor_index`` (0 = A, 1 = G) of a Kronecker layer."""
        if self.memory_mode == "owner":
            return self.assignment[layer_name]
        return self.assignment[f"{layer_name}#{KroneckerLayer.factor_names[factor_index]}"]

    def needed_here(self, layer_name: str, factor_index: int) -> bool:
        """Whether this rank uses the decomposition of that factor (all of them in "full" mode)."""
        return self.memory_mode == "full" or self.owner(layer_name, factor_index) == self.comm.rank

    def decompose(
        self, layer: KFACLayer, factor: torch.Tensor, damping: float, step: int
    ) -> list[torch.Tensor]:
        """The decomposition of ``factor`` (float32) of ``layer`` at ``step``; a failure raises the layer's
        damping floor, and an identity (scaled by the damping for inverses) stands in if nothing helps."""
        dim = factor.shape[0]
        if not bool(torch.isfinite(factor).all()):
            # No damping fixes a NaN; the next factor update replaces the factor on every rank.
            effective = raise_damping_floor(layer, damping, "a factor was not finite", step)
            eye = torch.eye(dim, device=factor.device)
            if self.method == "eigen":
                return [eye, torch.ones(dim, device=factor.device)]
            return [eye / (1.0 + math.sqrt(effective))]
        if self.method == "eigen":
            try:
                vectors, values = symmetric_eigen(factor)
            except SingularFactorError as error:
                raise_damping_floor(layer, damping, f"eigendecomposition failed ({error})", step)
                return [torch.eye(dim, device=factor.device), torch.ones(dim, device=factor.device)]
            return [vectors, values]
        effective = max(damping, layer.damping_floor)
        for _ in range(MAX_DAMPING_RAISES):
            try:
                return [damped_inverse(factor, math.sqrt(effective))]
            except SingularFactorError as error:
                effective = raise_damping_floor(layer, damping, f"singular factor ({error})", step)
        return [torch.eye(dim, device=factor.device) / (1.0 + math.sqrt(effective))]

    def share(self) -> None:
        """Owners broadcast what they computed, with their damping floors; afterwards every rank holds every
        decomposition and each layer the highest floor."""
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.comm.world_size)]
        floors: list[tuple[KroneckerLayer, torch.Tensor]] = []
        for layer in self.layers:
            held = self.held[layer.name]
            for index, factor in enumerate(layer.factors):
                if factor is None:
                    continue
                owner = self.owner(layer.name, index)
                if owner == self.comm.rank:
                    tensors = list(held[index] or [])
                else:
                    dim = factor.shape[0]
                    shapes = [(dim, dim), (dim,)] if self.method == "eigen" else [(dim, dim)]
                    tensors = [torch.empty(shape, device=factor.device) for shape in shapes]
                    held[index] = tensors
                floor = torch.tensor([layer.damping_floor], device=factor.device)
                floors.append((layer, floor))
                per_rank[owner].extend([*tensors, floor])
        broadcast_from_owners(per_rank, self.comm)
        for layer, floor in floors:
            layer.damping_floor = max(layer.damping_floor, float(floor))

    def precondition(self, layer: KroneckerLayer, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """``grad`` (the layer's gradient matrix) preconditioned with the held decompositions (``damping``:
        the effective damping, used by the eigen method); unchanged while either factor has none."""
        held = self.held[layer.name]
        if held[0] is None or held[1] is None:
            return grad
        if self.method == "inverse":
            return precondition_inverse(grad, held[0][0], held[1][0])
        return precondition_eigen(grad, held[0][0], held[0][1], held[1][0], held[1][1], damping)
