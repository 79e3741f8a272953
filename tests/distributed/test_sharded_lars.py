"""LARS and LAMB on FSDP2 shards equal unsharded LARS and LAMB: each layer's norm comes from one all-reduce of
the local squared norms over the shard group, never from a gathered parameter (2 real gloo ranks)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from kaisoku.distributed.mesh import build_data_mesh
from kaisoku.distributed.sharding import shard_model, shard_norm_reducer
from kaisoku.optim.factory import param_groups
from kaisoku.optim.lars import LAMB, LARS
from tests.dist_harness import run_ranks

#: Sharded vs unsharded weights after 3 steps: the norms are sums of per-shard squares (another fp32
#: reduction order), and the gradients are averaged by a reduce-scatter.
ATOL = 1e-6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # Odd sizes: 7 rows over 2 ranks shards unevenly (FSDP2 pads the last shard).
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 3))


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay=1e-2)
    if name == "lars":
        return LARS(groups, lr=0.5, momentum=0.9, eta=0.01)
    return LAMB(groups, lr=1e-2)


def _body(rank: int, world_size: int, tmp: Path, name: str) -> dict:
    reference = _model()
    sharded = shard_model(
        copy.deepcopy(reference), build_data_mesh(1, world_size), level="full", precision_mode="fp32"
    )
    ref_opt, opt = _optimizer(name, reference), _optimizer(name, sharded)
    calls = []
    reduce = shard_norm_reducer(build_data_mesh(1, world_size))

    def counting(squares: torch.Tensor) -> torch.Tensor:
        calls.append(squares.numel())
        return reduce(squares)

    opt.reduce_norms_with(counting)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        inputs, targets = torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator)
        # The reference sees the whole batch; each shard rank half of it (gradients averaged).
        nn.functional.mse_loss(reference(inputs), targets).backward()
        half = slice(rank * 4, rank * 4 + 4)
        nn.functional.mse_loss(sharded(inputs[half]), targets[half]).backward()
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    return {"reference": reference.state_dict(), "sharded": full, "calls": calls}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_layerwise_optimizers_on_shards_equal_unsharded(tmp_path: Path, name: str) -> None:
    results = run_ranks(_body, 2, tmp_path, name)
    for result in results:
        for key, value in result["reference"].items():
            torch.testing.assert_close(result["sharded"][key], value, rtol=0, atol=ATOL, msg=key)
        # One all-reduce per step, for the norms of both adapted weight matrices and their updates.
        assert result["calls"] == [4, 4, 4]


def _unreduced(rank: int, world_size: int, tmp: Path) -> str:
    model = shard_model(_model(), build_data_mesh(1, world_size), level="full", precision_mode="fp32")
    optimizer = _optimizer("lars", model)
    nn.functional.mse_loss(model(torch.ones(2, 5)), torch.zeros(2, 3)).backward()
    with pytest.raises(RuntimeError, match="sharded parameters but no way to sum their norms") as caught:
        optimizer.step()
    return str(caught.value)


@pytest.mark.timeout(120)
def test_lars_refuses_shards_without_a_reducer(tmp_path: Path) -> None:
    assert all("reduce_norms_with" in message for message in run_ranks(_unreduced, 2, tmp_path))
