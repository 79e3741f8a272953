"""DDP bucket plan: small buckets near the output, growing towards the input, as DDP built them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from kaisoku.distributed.data_parallel import BucketPlan, bucket_sizes, layer_group_caps, wrap_ddp
from kaisoku.errors import ConfigError
from kaisoku.models.zoo import build_model
from tests.dist_harness import run_ranks

_MIB = 1024 * 1024


def test_layer_group_caps_grow_then_cover_the_model() -> None:
    caps = layer_group_caps(100 * _MIB, first_mb=1, cap_mb=25, growth=2)
    assert caps[:5] == [1, 2, 4, 8, 16]
    assert all(c == 25 for c in caps[5:])
    assert sum(caps) >= 100
    assert layer_group_caps(10, first_mb=1, cap_mb=25, growth=2) == [1]
    with pytest.raises(ConfigError, match="first_mb <= cap_mb"):
        layer_group_caps(10, first_mb=30, cap_mb=25, growth=2)


def _record_buckets(rank: int, world_size: int, tmp: Path, mode: str) -> dict:
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=10)
    ddp = wrap_ddp(model, torch.device("cpu"), plan=BucketPlan(mode=mode, first_mb=1, cap_mb=25, growth=2))
    constructed = list(bucket_sizes(ddp))
    seen: list[int] = []

    def hook(state, bucket):  # unannotated: DDP checks the annotation object itself
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook(None, hook)
    for _ in range(2):  # DDP rebuilds buckets in gradient-readiness order after the first step
        seen.clear()
        ddp(torch.randn(2, 3, 32, 32)).sum().backward()
    grads_equal = all(p.grad is not None for p in model.parameters())
    return {"constructed": constructed, "runtime": list(seen), "grads": grads_equal}


@pytest.mark.timeout(120)
def test_layer_groups_start_small_at_the_output(tmp_path: Path) -> None:
    layer, uniform = (run_ranks(_record_buckets, 2, tmp_path / m, m)[0] for m in ("layer-groups", "uniform"))
    # resnet18's largest tensors are 9 MiB, so a bucket holds at least one of them; the plan still
    # makes more, smaller messages than uniform 25 MiB buckets, and the first one is the smallest.
    sizes = layer["runtime"]
    assert sum(sizes) == sum(uniform["runtime"])
    assert len(sizes) > len(uniform["runtime"])
    assert sizes[0] <= 10 * _MIB
    assert max(sizes) <= 26 * _MIB
    assert layer["constructed"]  # DDP's own logging data records the construction-time buckets
    assert sum(layer["constructed"]) == sum(sizes)
    assert layer["grads"]
