"""Pipeline stages: block lists, the balanced split, and training that matches one process."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer, resnet18

from kaisoku.distributed.layout import ParallelLayout, check_schedule
from kaisoku.distributed.mesh import build_mesh
from kaisoku.distributed.named_state import (
    load_named_optimizer_state,
    merge_named_optimizer_states,
    named_optimizer_state,
)
from kaisoku.distributed.partition import measure_block_costs, parameter_costs, partition_blocks
from kaisoku.distributed.pipeline import (
    HybridOptions,
    HybridParallel,
    check_microbatches,
    microbatch_momentum,
    replica_batch_slice,
    schedules_take_microbatches,
)
from kaisoku.errors import ConfigError, KaisokuError
from kaisoku.models.blocks import check_blocks_cover, ordered_blocks, run_blocks, state_names
from tests.dist_harness import run_ranks

LR = 0.1


# ------------------------------------------------------------------------------------------------
# Models, data and the single-process reference (shared with test_switch).
# ------------------------------------------------------------------------------------------------


def mlp_layernorm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def mlp_batchnorm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def tiny_vit() -> nn.Module:
    torch.manual_seed(0)
    return VisionTransformer(
        image_size=8, patch_size=4, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=16, num_classes=4
    )


def sgd(named: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], lr=LR, momentum=0.9)


def batches(
    sizes: list[int], shape: tuple[int, ...] = (8,), seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, *shape, generator=generator), torch.randint(0, 4, (size,), generator=generator))
        for size in sizes
    ]


def reference_training(
    model: nn.Module,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    dp: int,
    microbatches: int,
    bn_momentum: float | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process doing what the layout does: replica slices, micro-batches, accumulated gradients.

    BatchNorm: each micro-batch normalised alone; replicas start a step from the same running statistics
    and their results are averaged (the update is linear, so this equals averaging at the end).
    """
    optimizer = sgd(model.named_parameters())
    if bn_momentum is not None:
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.momentum = bn_momentum
    losses = []
    for inputs, targets in data:
        start = {name: b.clone() for name, b in model.named_buffers()}
        ends = []
        total = 0.0
        for replica_x, replica_y in zip(inputs.chunk(dp), targets.chunk(dp)):
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(start[name])
            for x, y in zip(replica_x.chunk(microbatches), replica_y.chunk(microbatches)):
                loss = nn.functional.cross_entropy(model(x), y) / (dp * microbatches)
                loss.backward()
                total += loss.item()
            ends.append({name: b.clone() for name, b in model.named_buffers()})
        with torch.no_grad():
            for name, b in model.named_buffers():
                values = [end[name] for end in ends]
                b.copy_(torch.stack(values).mean(0) if b.is_floating_point() else values[0])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def train_layout(
    make_model: Callable[[], nn.Module],
    layout: ParallelLayout,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    options: HybridOptions,
) -> tuple[list[float], dict[str, Any], HybridParallel]:
    """Run on every rank: train ``data`` (global batches) under ``layout``; losses and the gathered state."""
    hybrid = HybridParallel(
        make_model(),
        build_mesh(layout),
        loss_fn=nn.functional.cross_entropy,
        optimizer_factory=sgd,
        options=options,
        example_input=data[0][0][: data[0][0].shape[0] // layout.dp // options.microbatches],
    )
    losses = []
    for inputs, targets in data:
        replica = slice_replica(inputs, targets, hybrid.dp_index, hybrid.dp_size)
        losses.append(hybrid.train_step(*replica))
    return losses, hybrid.full_state_dict(), hybrid


def slice_replica(
    inputs: torch.Tensor, targets: torch.Tensor, dp_index: int, dp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    part = replica_batch_slice(int(targets.shape[0]), dp_index, dp_size)
    return inputs[part], targets[part]


def assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------------
# Pure pieces.
# ------------------------------------------------------------------------------------------------


def test_partition_minimises_the_largest_stage() -> None:
    assert partition_blocks([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert partition_blocks([4, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 5)]
    assert partition_blocks([5, 5, 5], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    # Blocks without cost do not pile up on one stage.
    assert partition_blocks([0, 5, 0, 0, 5, 0], 2) in ([range(0, 2), range(2, 6)], [range(0, 3), range(3, 6)])
    rng = random.Random(0)
    for _ in range(40):
        costs = [float(rng.randint(0, 9)) for _ in range(rng.randint(1, 8))]
        stages = rng.randint(1, len(costs))
        split = partition_blocks(costs, stages)
        assert [i for r in split for i in r] == list(range(len(costs)))
        assert all(len(r) > 0 for r in split)
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
            for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
        )
        assert max(sum(costs[i] for i in r) for r in split) == best


def test_more_stages_than_blocks_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot split 3 blocks into 4 pipeline stages; use at most 3"):
        partition_blocks([1.0, 2.0, 3.0], 4)


def test_batch_not_divisible_by_microbatches_names_the_numbers() -> None:
    assert check_microbatches(12, 4) == 3
    with pytest.raises(KaisokuError, match=r"batch of 10 samples does not split into 4 equal micro-batches"):
        check_microbatches(10, 4)


def test_replica_slices_cover_the_global_batch() -> None:
    assert [replica_batch_slice(12, d, 3) for d in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    with pytest.raises(KaisokuError, match="global batch of 10 samples does not split into dp 4"):
        replica_batch_slice(10, 0, 4)


def test_schedule_checks() -> None:
    check_schedule("1f1b", 2, 2, 1)
    with pytest.raises(ConfigError, match="unknown parallel.schedule 'zb'"):
        check_schedule("zb", 2, 4, 1)
    with pytest.raises(
        ConfigError, match="1f1b needs at least pp 4 micro-batches, got parallel.microbatches 2"
    ):
        check_schedule("1f1b", 4, 2, 1)
    with pytest.raises(ConfigError, match="virtual_stages 2 needs parallel.schedule 'interleaved-1f1b'"):
        check_schedule("gpipe", 2, 4, 2)
    with pytest.raises(ConfigError, match="interleaved-1f1b runs 7 micro-batches in 3 rounds of pp 2"):
        check_schedule("interleaved-1f1b", 2, 7, 2)
    check_schedule("interleaved-1f1b", 4, 3, 2)


def test_microbatch_momentum_keeps_the_per_step_decay() -> None:
    for m in (1, 2, 4, 8):
        assert (1 - microbatch_momentum(0.1, m)) ** m == pytest.approx(0.9)


def test_resnet_blocks_compute_the_model() -> None:
    model = resnet18(num_classes=10).eval()
    blocks = ordered_blocks(model)
    assert len(blocks) == 1 + 8 + 1
    check_blocks_cover(model, blocks)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(run_blocks(blocks, x), model(x))
    names = state_names(model)
    assert names[id(blocks[0].conv1.weight)] == "conv1.weight"
    assert names[id(blocks[-1].fc.bias)] == "fc.bias"
    assert names[id(blocks[1].bn1.running_mean)] == "layer1.0.bn1.running_mean"


def test_vit_and_sequential_blocks_compute_the_model() -> None:
    vit = tiny_vit().eval()
    blocks = ordered_blocks(vit)
    assert len(blocks) == 4
    check_blocks_cover(vit, blocks)
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(run_blocks(blocks, x), vit(x))
    assert state_names(vit)[id(blocks[0].pos_embedding)] == "encoder.pos_embedding"
    seq = mlp_layernorm()
    assert ordered_blocks(seq) == list(seq.children())


def test_unsplittable_models_are_refused() -> None:
    with pytest.raises(KaisokuError, match="cannot split a Linear into pipeline stages"):
        ordered_blocks(nn.Linear(2, 2))
    model = mlp_layernorm()
    with pytest.raises(KaisokuError, match="leave out 2 parameters .first: 5.weight"):
        check_blocks_cover(model, list(model.children())[:-1])


def test_block_costs_leave_the_model_untouched() -> None:
    model = mlp_batchnorm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    blocks = ordered_blocks(model)
    costs = measure_block_costs(blocks, torch.randn(4, 8), repeats=2)
    assert len(costs) == 6 and all(c > 0 for c in costs)
    assert_states_close(model.state_dict(), before)
    assert all(p.grad is None for p in model.parameters())
    assert parameter_costs(blocks) == [144.0, 32.0, 0.0, 272.0, 0.0, 68.0]


def test_named_optimizer_state_survives_a_regrouping() -> None:
    model = mlp_layernorm()
    names = state_names(model)
    params = list(model.parameters())
    # Two "stages" with their own optimizers; the second has a group with another learning rate.
    stage_a = torch.optim.SGD(params[:4], lr=LR, momentum=0.9)
    stage_b = torch.optim.SGD(
        [{"params": params[4:6]}, {"params": params[6:], "lr": 0.5}], lr=LR, momentum=0.9
    )
    model(torch.randn(4, 8)).sum().backward()
    stage_a.step()
    stage_b.step()
    order = [n for n, _ in model.named_parameters()]
    merged = merge_named_optimizer_states(
        [named_optimizer_state(stage_a, names), named_optimizer_state(stage_b, names)], order
    )
    assert [g["params"] for g in merged["param_groups"]] == [order[:6], order[6:]]
    assert list(merged["state"]) == order
    # Built from named parameters, as the optimizer factory does: the groups keep their own names.
    named_params = list(model.named_parameters())
    whole = torch.optim.SGD(
        [{"params": named_params[6:], "lr": 9.0}, {"params": named_params[:6]}], lr=9.0, momentum=0.9
    )
    load_named_optimizer_state(whole, merged, names)
    assert whole.param_groups[0]["lr"] == 0.5 and whole.param_groups[1]["lr"] == LR
    assert whole.param_groups[0]["param_names"] == order[6:]
    assert "param_names" not in named_optimizer_state(whole, names)["param_groups"][0]
    for p in params:
        source = stage_a if any(p is q for q in params[:4]) else stage_b
        torch.testing.assert_close(whole.state[p]["momentum_buffer"], source.state[p]["momentum_buffer"])


# ------------------------------------------------------------------------------------------------
# Multi-rank: losses and weights equal the single-process reference.
# ------------------------------------------------------------------------------------------------


_PP2_CASES = [
    ("gpipe", 1, "parameters"),
    ("1f1b", 1, "time"),
    ("interleaved-1f1b", 2, "parameters"),
]


def _pp2_schedules(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    # The third batch is smaller: a new batch shape gets its own schedule.
    data = batches([16, 16, 8])
    for schedule, virtual, balance in _PP2_CASES:
        options = HybridOptions(microbatches=4, schedule=schedule, virtual_stages=virtual, balance=balance)
        losses, state, hybrid = train_layout(mlp_layernorm, ParallelLayout(1, 2), data, options)
        results[schedule] = (losses, state["model"], hybrid.stage_ranges)
    vit_data = batches([8, 8], shape=(3, 8, 8))
    losses, state, _ = train_layout(tiny_vit, ParallelLayout(1, 2), vit_data, HybridOptions(microbatches=2))
    results["vit"] = (losses, state["model"], None)
    return results


@pytest.mark.timeout(120)
def test_pp2_schedules_match_one_process(tmp_path: Path) -> None:
    ranks = run_ranks(_pp2_schedules, 2, tmp_path)
    data = batches([16, 16, 8])
    expected_losses, expected_state = reference_training(mlp_layernorm(), data, dp=1, microbatches=4)
    for schedule, _, _ in _PP2_CASES:
        for rank_result in ranks:
            losses, state, _ = rank_result[schedule]
            assert losses == pytest.approx(expected_losses, rel=1e-5), schedule
            assert_states_close(state, expected_state)
        # Both ranks split the model alike, also when the split comes from timing on rank 0.
        assert ranks[0][schedule][2] == ranks[1][schedule][2]
        assert len(ranks[0][schedule][2]) == (4 if schedule == "interleaved-1f1b" else 2)
    vit_losses, vit_state = reference_training(
        tiny_vit(), batches([8, 8], shape=(3, 8, 8)), dp=1, microbatches=2
    )
    assert ranks[1]["vit"][0] == pytest.approx(vit_losses, rel=1e-5)
    assert_states_close(ranks[0]["vit"][1], vit_state)


def _batchnorm_policy(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    model = mlp_batchnorm()
    hybrid = HybridParallel(
        model,
        build_mesh(ParallelLayout(1, 2)),
        loss_fn=nn.functional.cross_entropy,
        optimizer_factory=sgd,
        options=HybridOptions(microbatches=4, schedule="gpipe"),
    )
    momenta = [m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    losses = [hybrid.train_step(x, y) for x, y in batches([16, 16])]
    state = hybrid.full_state_dict()["model"]
    hybrid.close()
    restored = [m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    return {"losses": losses, "state": state, "momenta": momenta, "restored": restored}


@pytest.mark.timeout(90)
def test_batchnorm_uses_microbatch_statistics_and_rescaled_momentum(tmp_path: Path) -> None:
    if not schedules_take_microbatches():
        pytest.skip("this torch's schedules run a shape-inference forward: BatchNorm statistics differ")
    """Policy: statistics per micro-batch; running stats move per step as with the model's momentum."""
    ranks = run_ranks(_batchnorm_policy, 2, tmp_path)
    data = batches([16, 16])
    policy_momentum = 1 - 0.9 ** (1 / 4)
    expected_losses, expected_state = reference_training(
        mlp_batchnorm(), data, 1, 4, bn_momentum=policy_momentum
    )
    # Stage 0 holds the BatchNorm; the model keeps its own momentum once the layout is closed.
    assert ranks[0]["momenta"] == [pytest.approx(policy_momentum)]
    assert ranks[0]["restored"] == [0.1]
    for result in ranks:
        assert result["losses"] == pytest.approx(expected_losses, rel=1e-5)
        assert_states_close(result["state"], expected_state)
    # The policy is visible: whole-batch statistics give another loss, the plain momentum other running stats.
    whole_losses, _ = reference_training(mlp_batchnorm(), data, 1, 1)
    assert abs(whole_losses[0] - expected_losses[0]) > 1e-3
    _, naive_state = reference_training(mlp_batchnorm(), data, 1, 4, bn_momentum=0.1)
    assert (naive_state["1.running_mean"] - expected_state["1.running_mean"]).abs().max() > 1e-3


def _hybrid_four_ranks(rank: int, world_size: int, tmp: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    options = HybridOptions(microbatches=2, schedule="1f1b")
    losses, state, _ = train_layout(mlp_batchnorm, ParallelLayout(2, 2), batches([16, 16, 16]), options)
    return losses, state["model"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dp2_pp2_matches_one_process(tmp_path: Path) -> None:
    if not schedules_take_microbatches():
        pytest.skip("this torch's schedules run a shape-inference forward: BatchNorm statistics differ")
    ranks = run_ranks(_hybrid_four_ranks, 4, tmp_path)
    expected_losses, expected_state = reference_training(
        mlp_batchnorm(), batches([16, 16, 16]), dp=2, microbatches=2, bn_momentum=1 - 0.9 ** (1 / 2)
    )
    for losses, state in ranks:
        assert losses == pytest.approx(expected_losses, rel=1e-5)
        assert_states_close(state, expected_state)
