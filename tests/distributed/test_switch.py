"""Switch-parallel: the schedule parser, switching layouts mid-run, layout-independent checkpoints."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kaisoku.distributed.layout import ParallelLayout, SwitchSchedule, SwitchSegment, parse_switch_schedule
from kaisoku.distributed.mesh import build_mesh
from kaisoku.distributed.pipeline import HybridOptions, HybridParallel
from kaisoku.distributed.switch import switch_layout
from kaisoku.errors import ConfigError
from tests.dist_harness import run_ranks
from tests.distributed.test_pipeline import (
    assert_states_close,
    batches,
    mlp_batchnorm,
    mlp_layernorm,
    reference_training,
    sgd,
    slice_replica,
)

# ------------------------------------------------------------------------------------------------
# The schedule parser.
# ------------------------------------------------------------------------------------------------


def test_parse_a_switch_schedule() -> None:
    schedule = parse_switch_schedule("dp2xpp2:0-10, dp4:10-")
    assert schedule == SwitchSchedule(
        (SwitchSegment(ParallelLayout(2, 2), 0, 10), SwitchSegment(ParallelLayout(4, 1), 10, None)), "epoch"
    )
    assert [str(schedule.layout_at(e)) for e in (0, 9, 10, 500)] == ["dp2xpp2", "dp2xpp2", "dp4", "dp4"]
    assert schedule.switch_points == [10]
    assert schedule.switch_at(10) == ParallelLayout(4, 1)
    assert schedule.switch_at(0) is None and schedule.switch_at(5) is None
    assert str(schedule) == "dp2xpp2:0-10,dp4:10-"
    assert parse_switch_schedule(str(schedule)) == schedule
    three = parse_switch_schedule("pp4:0-100,dp2xpp2:100-300,dp4:300-", unit="step")
    assert three.unit == "step" and three.switch_points == [100, 300]
    assert three.layout_at(299) == ParallelLayout(2, 2)
    assert parse_switch_schedule("dp4").layout_at(7) == ParallelLayout(4, 1)
    schedule.check_world(4)
    with pytest.raises(ConfigError, match="dp 2 x pp 2 = 4 but the world has 8 ranks"):
        schedule.check_world(8)


@pytest.mark.parametrize(
    "text, message",
    [
        ("dp2xpp2:1-10,dp4:10-", "should start at 0"),
        ("dp2xpp2:0-10,dp4:12-", "should start where the previous ended, at 10"),
        ("dp2xpp2:0-,dp4:10-", "is open-ended but is not the last"),
        ("dp2xpp2:0-10,dp4:10-20", r"last segment 'dp4:10-20' must be open-ended \('dp4:10-'\)"),
        ("dp2xpp2:0-0,dp4:0-", "ends at 0, not after its start 0"),
        ("dp2xpp2:0-10,,dp4:10-", "has an empty segment"),
        ("dp2xpp2 0-10", "should read LAYOUT:START-END"),
        ("dp2xqq2:0-10,dp4:10-", "cannot read parallel layout 'dp2xqq2'"),
        ("dp2xpp2,dp4:0-", "needs a range"),
    ],
)
def test_bad_switch_schedules_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_switch_schedule(text)


def test_unknown_unit() -> None:
    with pytest.raises(ConfigError, match="unknown parallel.switch_unit 'batch'"):
        parse_switch_schedule("dp4", unit="batch")


# ------------------------------------------------------------------------------------------------
# Multi-rank.
# ------------------------------------------------------------------------------------------------


def saved(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` written and read back as a checkpoint file would be."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _hybrid(
    model: nn.Module, layout: ParallelLayout, microbatches: int = 2, shard: str = "none"
) -> HybridParallel:
    return HybridParallel(
        model,
        build_mesh(layout),
        loss_fn=nn.functional.cross_entropy,
        optimizer_factory=sgd,
        options=HybridOptions(microbatches=microbatches, schedule="1f1b", shard=shard),
    )


def _step(hybrid: HybridParallel, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    return hybrid.train_step(*slice_replica(inputs, targets, hybrid.dp_index, hybrid.dp_size))


def _switch_two_ranks(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    data = batches([16, 16, 16, 16])
    hybrid = _hybrid(mlp_layernorm(), ParallelLayout(1, 2))
    losses = [_step(hybrid, *batch) for batch in data[:2]]
    before = hybrid.full_state_dict()
    record = saved(before)  # what a checkpoint written here keeps
    hybrid = switch_layout(hybrid, ParallelLayout(2, 1))
    after = hybrid.full_state_dict()
    losses += [_step(hybrid, *batch) for batch in data[2:]]
    # A fresh dp=2 run (other initial weights) resumes from the checkpoint taken under pp=2.
    resumed = _hybrid(mlp_layernorm(), ParallelLayout(2, 1))
    for p in resumed.model.parameters():
        nn.init.normal_(p)
    resumed.load_full_state_dict(record)
    loaded = resumed.full_state_dict()
    resumed_losses = [_step(resumed, *batch) for batch in data[2:]]
    return {
        "before": before,
        "after": after,
        "losses": losses,
        "loaded": loaded,
        "resumed_losses": resumed_losses,
        "stage_params": [n for n, _ in resumed.named_parameters],
    }


def assert_full_states_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Model tensors and optimizer state bit for bit; the layouts may differ."""
    assert list(actual["model"]) == list(expected["model"])
    for name, tensor in expected["model"].items():
        assert torch.equal(actual["model"][name], tensor), name
    assert list(actual["optimizer"]["state"]) == list(expected["optimizer"]["state"])
    for name, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            other = actual["optimizer"]["state"][name][key]
            assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
    groups = [{k: v for k, v in g.items()} for g in actual["optimizer"]["param_groups"]]
    assert groups == expected["optimizer"]["param_groups"]


@pytest.mark.timeout(120)
def test_switch_pp2_to_dp2_keeps_the_model_and_resumes_anywhere(tmp_path: Path) -> None:
    ranks = run_ranks(_switch_two_ranks, 2, tmp_path)
    for result in ranks:
        assert result["before"]["layout"] == "pp2" and result["after"]["layout"] == "dp2"
        assert_full_states_equal(result["after"], result["before"])
        assert_full_states_equal(result["loaded"], result["before"])
        # Under dp=2 every rank holds every parameter again.
        assert len(result["stage_params"]) == 8
    # LayerNorm model: every layout computes the gradient of the whole batch, so the run across the switch
    # (with its momentum buffers) is the one-process run.
    expected_losses, _ = reference_training(mlp_layernorm(), batches([16, 16, 16, 16]), dp=1, microbatches=1)
    assert ranks[0]["losses"] == pytest.approx(expected_losses, rel=1e-5)
    assert ranks[1]["resumed_losses"] == pytest.approx(expected_losses[2:], rel=1e-5)
    assert ranks[0]["losses"] == ranks[1]["losses"]


def _switch_sharded_two_ranks(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    data = batches([16] * 5)
    hybrid = _hybrid(mlp_layernorm(), ParallelLayout(1, 2), shard="grad")
    losses = [_step(hybrid, *batch) for batch in data[:2]]
    before = hybrid.full_state_dict()
    hybrid = switch_layout(hybrid, ParallelLayout(2, 1))
    after = hybrid.full_state_dict()
    # Under dp2 one stage of every block, each parameter a shard over both ranks.
    shards = {name: type(p).__name__ for name, p in hybrid.named_parameters}
    losses += [_step(hybrid, *batch) for batch in data[2:4]]
    dp_trained = hybrid.full_state_dict()
    hybrid = switch_layout(hybrid, ParallelLayout(1, 2))
    back = hybrid.full_state_dict()
    losses.append(_step(hybrid, *data[4]))
    return {"before": before, "after": after, "dp_trained": dp_trained, "back": back, "losses": losses,
            "shards": shards}  # fmt: skip


@pytest.mark.timeout(120)
def test_sharded_switch_pp2_to_dp2_and_back_trains_as_one_process(tmp_path: Path) -> None:
    """parallel.shard grad across pp2 -> dp2 -> pp2: the switches keep the state bit for bit, and the
    reduce-scattered dp2 steps (not also all-reduced) train as one process does."""
    ranks = run_ranks(_switch_sharded_two_ranks, 2, tmp_path)
    for result in ranks:
        assert result["after"]["layout"] == "dp2" and result["back"]["layout"] == "pp2"
        assert_full_states_equal(result["after"], result["before"])
        assert_full_states_equal(result["back"], result["dp_trained"])
        assert len(result["shards"]) == 8 and set(result["shards"].values()) == {"DTensor"}
    expected_losses, _ = reference_training(mlp_layernorm(), batches([16] * 5), dp=1, microbatches=1)
    assert ranks[0]["losses"] == pytest.approx(expected_losses, rel=1e-5)
    assert ranks[0]["losses"] == ranks[1]["losses"]


def _switch_four_ranks(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    data = batches([16, 16, 16])
    hybrid = _hybrid(mlp_batchnorm(), ParallelLayout(2, 2))
    _step(hybrid, *data[0])
    hybrid_state = saved(hybrid.full_state_dict())
    dp_mesh = build_mesh(ParallelLayout(4, 1))
    hybrid = switch_layout(hybrid, dp_mesh)
    dp_state = hybrid.full_state_dict()
    momenta = [m.momentum for m in hybrid.model.modules() if isinstance(m, nn.BatchNorm1d)]
    _step(hybrid, *data[1])
    dp_trained = saved(hybrid.full_state_dict())
    hybrid = switch_layout(hybrid, ParallelLayout(2, 2))
    back_state = hybrid.full_state_dict()
    _step(hybrid, *data[2])
    # Cross loads: the dp2xpp2 state under dp4 and the dp4 state under dp2xpp2.
    under_dp4 = _hybrid(mlp_batchnorm(), ParallelLayout(4, 1))
    under_dp4.load_full_state_dict(hybrid_state)
    under_hybrid = _hybrid(mlp_batchnorm(), ParallelLayout(2, 2))
    under_hybrid.load_full_state_dict(dp_trained)
    return {
        "hybrid_state": hybrid_state,
        "dp_state": dp_state,
        "dp_trained": dp_trained,
        "back_state": back_state,
        "momenta": momenta,
        "under_dp4": under_dp4.full_state_dict(),
        "under_hybrid": under_hybrid.full_state_dict(),
        "final": hybrid.full_state_dict()["model"],
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_switch_dp2pp2_dp4_and_back_with_batchnorm(tmp_path: Path) -> None:
    ranks = run_ranks(_switch_four_ranks, 4, tmp_path)
    for result in ranks:
        assert_full_states_equal(result["dp_state"], result["hybrid_state"])
        assert_full_states_equal(result["back_state"], result["dp_trained"])
        assert_full_states_equal(result["under_dp4"], result["hybrid_state"])
        assert_full_states_equal(result["under_hybrid"], result["dp_trained"])
        assert result["momenta"] == [0.1]
        assert_states_close(result["final"], ranks[0]["final"])
    # The step under dp4 really trained: the model moved.
    first = ranks[0]
    assert not torch.equal(first["dp_trained"]["model"]["0.weight"], first["dp_state"]["model"]["0.weight"])
