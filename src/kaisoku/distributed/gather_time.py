"""What full sharding's collectives cost on this world: the memory planner's price for ``parallel.shard full``."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist


def gather_scatter_seconds(numel: int, device: torch.device, repeats: int = 3) -> float:
    """Best of ``repeats`` timings of one all-gather and one reduce-scatter of ``numel`` fp32 values over
    the default group (each rank holding a 1/world shard); 0.0 with no group or a single rank.

    A collective: every rank calls it with the same ``numel``. Each rank returns its own timing (the
    caller agrees on rank 0's).
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return 0.0
    world = dist.get_world_size()
    local = torch.ones(max(1, math.ceil(numel / world)), device=device)
    whole = torch.empty(local.numel() * world, device=device)
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_gather_single(whole, local)
        dist.reduce_scatter_single(local, whole)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
