"""Data parallelism on torch DDP: the gradient bucket plan and communication hooks.

Gradients become ready in reverse layer order (output layer first). A small first bucket lets the
first all-reduce start as soon as the head's gradients exist; later buckets grow towards the input so
that fewer, larger messages carry the bulk while backward is still running ("layer groups").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from kaisoku.errors import ConfigError

_MIB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """How DDP groups gradients into all-reduce messages."""

    mode: str = "layer-groups"
    """uniform: every bucket ``cap_mb``; layer-groups: ``first_mb`` growing by ``growth`` up to ``cap_mb``."""
    first_mb: float = 1.0
    """Size of the first bucket (the output end), in MiB."""
    cap_mb: float = 25.0
    """Largest bucket, in MiB."""
    growth: float = 2.0
    """Ratio between consecutive bucket sizes in layer-groups mode."""


def layer_group_caps(total_bytes: int, *, first_mb: float, cap_mb: float, growth: float) -> list[float]:
    """Per-bucket caps in MiB, in gradient-readiness order: ``first_mb * growth**k`` up to ``cap_mb``.

    The list is long enough to cover ``total_bytes``; DDP reuses the last cap for any further bucket.
    """
    if first_mb <= 0 or cap_mb < first_mb or growth < 1:
        raise ConfigError(
            f"bucket plan needs 0 < first_mb <= cap_mb and growth >= 1 (got {first_mb}, {cap_mb}, {growth})"
        )
    caps: list[float] = []
    covered = 0.0
    size = first_mb
    while covered * _MIB < total_bytes or not caps:
        caps.append(size)
        covered += size
        if size >= cap_mb:
            remaining = max(0.0, total_bytes / _MIB - covered)
            caps.extend([cap_mb] * math.ceil(remaining / cap_mb))
            break
        size = min(cap_mb, size * growth)
    return caps


def bucket_caps_for(model: nn.Module, plan: BucketPlan) -> list[float] | None:
    """The ``bucket_cap_mb_list`` for ``model`` under ``plan``; None for uniform buckets."""
    if plan.mode == "uniform":
        return None
    if plan.mode != "layer-groups":
        raise ConfigError(f"dist.buckets: unknown mode '{plan.mode}'; choose uniform or layer-groups")
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return layer_group_caps(total, first_mb=plan.first_mb, cap_mb=plan.cap_mb, growth=plan.growth)


def wrap_ddp(
    model: nn.Module,
    device: torch.device,
    *,
    plan: BucketPlan,
    compress_bf16: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP with the bucket plan and, optionally, bf16 gradient compression."""
    caps = bucket_caps_for(model, plan)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=process_group,
        bucket_cap_mb=None if caps else int(plan.cap_mb),
        bucket_cap_mb_list=caps,  # type: ignore[arg-type]  # DDP multiplies floats by 1 MiB as well
        gradient_as_bucket_view=True,
    )
    if compress_bf16:
        ddp.register_comm_hook(process_group, default_hooks.bf16_compress_hook)
    return ddp


def bucket_sizes(ddp: DistributedDataParallel) -> Sequence[int]:
    """The bucket sizes in bytes that DDP actually built, in readiness order (from its logging data)."""
    data = ddp._get_ddp_logging_data()
    raw = data.get("bucket_sizes", "")
    if isinstance(raw, str):
        return [int(x) for x in raw.split(",") if x.strip()]
    return list(raw)


def chain_after_allreduce(
    ddp: DistributedDataParallel,
    after: Callable[[list[torch.nn.Parameter]], None],
    *,
    compress_bf16: bool = False,
) -> None:
    """Register a communication hook that all-reduces each bucket (bf16-compressed when asked), points
    the bucket's parameters' ``.grad`` at the averaged values, then calls ``after(parameters)``.

    The update of a bucket thus runs as soon as its all-reduce completes, overlapping the rest of the
    backward pass. ``ddp`` must have no communication hook yet.
    """
    base = default_hooks.bf16_compress_hook if compress_bf16 else default_hooks.allreduce_hook

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        params = bucket.parameters()
        grads = bucket.gradients()

        def update(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            reduced = fut.value()
            reduced = reduced[0] if isinstance(reduced, list) else reduced
            buffer = bucket.buffer()
            if reduced.data_ptr() != buffer.data_ptr():
                buffer.copy_(reduced)  # a hook that returned a new tensor (e.g. decompressed bf16)
            for param, grad in zip(params, grads):
                param.grad = grad  # views of the averaged bucket
            after(params)
            return reduced

        return base(state, bucket).then(update)

    # DDP checks a hook's annotations as objects (dist.GradBucket); this module's are strings under
    # postponed evaluation, and unannotated hooks pass the check.
    hook.__annotations__ = {}
    ddp.register_comm_hook(ddp.process_group, hook)
