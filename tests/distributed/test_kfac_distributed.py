"""K-FAC on real gloo ranks equals K-FAC in one process on the same global batch, also on sub-groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisoku.optim.kfac import KFAC
from tests.dist_harness import run_ranks

GLOBAL_BATCH = 8
STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 6),
        nn.Tanh(),
        nn.Linear(6, 4),
    )


def _global_batch(step: int, seed: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + step)
    return torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=gen), torch.randint(
        0, 4, (GLOBAL_BATCH,), generator=gen
    )


def _train(
    model: nn.Module, kfac: KFAC, optimizer: torch.optim.Optimizer, rank: int, world: int, seed: int = 1000
) -> None:
    share = GLOBAL_BATCH // world
    for step in range(STEPS):
        x, y = _global_batch(step, seed)
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        kfac.step()
        optimizer.step()


def _kfac_options(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    return {"lr": optimizer, "inv_update_steps": 2, "factor_decay": 0.8, "damping": 1e-2}


def _run_rank(rank: int, world_size: int, tmp: Path, memory_mode: str, method: str) -> dict[str, object]:
    # A group passed in explicitly: the same two ranks as the default group.
    group = dist.new_group([0, 1])
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    # "owner" runs also split the factor all-reduce into many small buckets (about 400 bytes each).
    bucket_cap_mb = 4e-4 if memory_mode == "owner" else 25.0
    kfac = KFAC(
        model,
        process_group=group,
        memory_mode=memory_mode,
        method=method,
        bucket_cap_mb=bucket_cap_mb,
        **_kfac_options(optimizer),
    )
    _train(model, kfac, optimizer, rank, world_size)
    owned = sorted(name for name, owner in kfac.assignment.items() if owner == rank)
    return {
        "params": [p.detach().clone() for p in model.module.parameters()],
        "factors": {name: [f.clone() for f in layer.factors] for name, layer in kfac.layers.items()},
        "owned": owned,
        "timings": kfac.timings,
    }


def _single_process(
    method: str, seed: int = 1000
) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    kfac = KFAC(model, method=method, **_kfac_options(optimizer))
    _train(model, kfac, optimizer, rank=0, world=1, seed=seed)
    return [p.detach() for p in model.parameters()], {
        name: layer.factors for name, layer in kfac.layers.items()
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("memory_mode", "method"), [("full", "eigen"), ("owner", "inverse")])
def test_two_ranks_equal_single_process(tmp_path: Path, memory_mode: str, method: str) -> None:
    results = run_ranks(_run_rank, 2, tmp_path, memory_mode, method, timeout=150)
    params, factors = _single_process(method)
    for result in results:
        for got, expected in zip(result["params"], params):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
        for name, expected_factors in factors.items():
            for got, expected in zip(result["factors"][name], expected_factors):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    # Both ranks hold the same weights bit for bit, and the decompositions were shared out.
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
    assert results[0]["owned"] and results[1]["owned"]
    assert set(results[0]["owned"]).isdisjoint(results[1]["owned"])
    assert results[0]["timings"].get("communication", 0.0) > 0.0


def _group_seed(group_index: int) -> int:
    return 1000 + 100 * group_index


def _run_rank_in_subgroup(rank: int, world_size: int, tmp: Path) -> dict[str, object]:
    # Ranks {0, 1} and {2, 3} train independently, each pair on its own data; every rank creates both
    # groups (new_group is collective over the world) and uses its own.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    index = rank // 2
    group = groups[index]
    try:
        KFAC(_model(), process_group=groups[1 - index], kl_clip=None)
    except ValueError as error:
        outsider = str(error)
    model = DistributedDataParallel(_model(), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    # "owner" mode broadcasts preconditioned gradients from their owners at every step: in the second
    # group the owner's group rank (0 or 1) is not its global rank (2 or 3).
    kfac = KFAC(model, process_group=group, memory_mode="owner", method="eigen", **_kfac_options(optimizer))
    group_rank = rank - 2 * index
    _train(model, kfac, optimizer, group_rank, 2, seed=_group_seed(index))
    return {
        "comm": (kfac.comm.rank, kfac.comm.world_size),
        "outsider": outsider,
        "owners": sorted(set(kfac.assignment.values())),
        "params": [p.detach().clone() for p in model.module.parameters()],
        "factors": {name: [f.clone() for f in layer.factors] for name, layer in kfac.layers.items()},
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_subgroups_average_factors_within_their_group_only(tmp_path: Path) -> None:
    results = run_ranks(_run_rank_in_subgroup, 4, tmp_path, timeout=200)
    # Rank and size come from the group handed in, and the work is shared out over its two ranks.
    assert [r["comm"] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert all(r["owners"] == [0, 1] for r in results)
    assert all("not a member" in r["outsider"] for r in results)
    for index in range(2):
        params, factors = _single_process("eigen", seed=_group_seed(index))
        for result in results[2 * index : 2 * index + 2]:
            for got, expected in zip(result["params"], params):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
            for name, expected_factors in factors.items():
                for got, expected in zip(result["factors"][name], expected_factors):
                    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    # The two groups saw different data, so factors averaged over the whole world would match neither.
    first, second = results[0]["factors"], results[2]["factors"]
    assert any(not torch.allclose(a, b) for name in first for a, b in zip(first[name], second[name]))
