"""Splitting a model's ordered blocks into pipeline stages, balanced by parameter count or measured time.

Pure apart from :func:`measure_block_costs`, which times the blocks on an example input.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from kaisoku.errors import ConfigError, KaisokuError


def partition_blocks(costs: Sequence[float], num_stages: int) -> list[range]:
    """Split blocks with ``costs`` into ``num_stages`` contiguous, non-empty stages.

    Minimises the largest stage cost; among splits that reach it, prefers the smaller sum of squared
    stage costs (so blocks that cost nothing do not all pile onto one stage). Deterministic.
    """
    n = len(costs)
    if num_stages < 1:
        raise ConfigError(f"the number of pipeline stages must be at least 1, got {num_stages}")
    if num_stages > n:
        raise ConfigError(
            f"cannot split {n} blocks into {num_stages} pipeline stages; "
            f"use at most {n} stages (parallel.pp x virtual stages)"
        )
    prefix = [0.0]
    for cost in costs:
        if cost < 0 or not math.isfinite(cost):
            raise KaisokuError(f"block costs must be finite and non-negative, got {cost}")
        prefix.append(prefix[-1] + float(cost))
    inf = (math.inf, math.inf)
    # best[k][i]: (largest stage cost, sum of squares) of the first i blocks in k stages; cut[k][i]: start of
    # the last stage.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev[0] == math.inf:
                    continue
                stage = prefix[i] - prefix[j]
                candidate = (max(prev[0], stage), prev[1] + stage * stage)
                if candidate < best[k][i]:
                    best[k][i] = candidate
                    cut[k][i] = j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def parameter_costs(blocks: Sequence[nn.Module]) -> list[float]:
    """Each block's number of parameter elements (a parameter shared by blocks counts in the first)."""
    seen: set[int] = set()
    costs = []
    for block in blocks:
        total = 0
        for p in block.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        costs.append(float(total))
    return costs


def measure_block_costs(
    blocks: Sequence[nn.Module], example_input: torch.Tensor, repeats: int = 3
) -> list[float]:
    """Median seconds of forward + backward of each block on ``example_input`` flowing through the blocks.

    Buffers (BatchNorm running statistics) are restored and gradients cleared afterwards, so measuring
    leaves the model as it was.
    """
    buffers = [b for block in blocks for b in block.buffers()]
    saved = [b.detach().clone() for b in buffers]
    x = example_input
    costs: list[float] = []
    for block in blocks:
        times = []
        out = x
        for _ in range(max(1, repeats)):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = block(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            times.append(time.perf_counter() - start)
        costs.append(statistics.median(times))
        x = out.detach()
    with torch.no_grad():
        for buffer, value in zip(buffers, saved):
            buffer.copy_(value)
    for block in blocks:
        for p in block.parameters():
            p.grad = None
    return costs
