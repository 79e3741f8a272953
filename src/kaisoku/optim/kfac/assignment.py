"""Greedy assignment of K-FAC work to ranks by a cost model; pure functions, no process group needed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def decomposition_cost(dims: Iterable[int]) -> float:
    """Cost of decomposing square factors of the given sizes: the sum of their sizes cubed.

    Eigendecomposition, Cholesky and inversion of a ``d x d`` matrix all take ``O(d^3)`` work.
    """
    return float(sum(int(dim) ** 3 for dim in dims))


def greedy_assignment(costs: Mapping[str, float], world_size: int) -> dict[str, int]:
    """Assign each work item to a rank so that the per-rank cost is balanced.

    Items are taken from the most to the least expensive (ties broken by name, so every rank computes
    the same answer) and each goes to the rank with the smallest load so far (ties to the lowest rank).
    This is the longest-processing-time rule: the heaviest rank carries at most 4/3 of the optimum.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    for name, cost in costs.items():
        if not cost >= 0:
            raise ValueError(f"cost of '{name}' must be a non-negative number, got {cost}")
    loads = [0.0] * world_size
    owners: dict[str, int] = {}
    for name in sorted(costs, key=lambda item: (-costs[item], item)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[name] = rank
        loads[rank] += costs[name]
    return owners


def rank_loads(costs: Mapping[str, float], owners: Mapping[str, int], world_size: int) -> list[float]:
    """Total cost that ``owners`` puts on each rank."""
    loads = [0.0] * world_size
    for name, rank in owners.items():
        loads[rank] += costs[name]
    return loads


def bucket_plan(sizes: Sequence[int], cap: int) -> list[list[int]]:
    """Group consecutive items into buckets of at most ``cap`` elements (an item larger than ``cap``
    gets a bucket of its own); returns lists of item indices in order."""
    if cap < 1:
        raise ValueError(f"bucket cap must be at least 1 element, got {cap}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, size in enumerate(sizes):
        if current and filled + size > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += size
    if current:
        buckets.append(current)
    return buckets
