"""parallel.shard and parallel.dp_replicate in the run plan: the mesh shape, the engine, every refusal."""

from __future__ import annotations

import pytest

from kaisoku.config import Config, apply_override
from kaisoku.distributed.mesh import data_mesh_shape
from kaisoku.errors import ConfigError
from kaisoku.facts import DataFacts, WorldShape
from kaisoku.run_facts import describe_model
from kaisoku.run_plan import resolve

IMAGES = DataFacts(
    source="packed", num_classes=10, num_samples=1000, has_val=True, root="/d", description="d"
)


def _plan(world: int | None, **overrides: object):  # noqa: ANN202
    cfg = Config()
    cfg.data.global_batch = 64
    for key, value in overrides.items():
        apply_override(cfg, key.replace("__", "."), value)
    shape = WorldShape(world, world) if world is not None else None
    return resolve(cfg, shape, IMAGES, describe_model(cfg, IMAGES))


def test_shard_levels_and_mesh_shapes() -> None:
    plan = _plan(4, parallel__shard="full")
    assert (plan.shard, plan.mesh_shape, plan.hybrid) == ("full", (1, 4), False)
    assert "sharded data parallel (full" in plan.describe()
    assert "dp_replicate=1 x dp_shard=4" in plan.describe()
    hsdp = _plan(4, parallel__shard="grad", parallel__dp_replicate=2)
    assert (hsdp.shard, hsdp.mesh_shape) == ("grad", (2, 2))
    assert (hsdp.rank_batch, hsdp.micro_batch) == (16, 16)
    plain = _plan(4)
    assert (plain.shard, plain.mesh_shape) == ("none", (4,))
    assert plain.engine_name == "data parallel"


def test_pipeline_stages_shard_over_their_replicas() -> None:
    plan = _plan(4, parallel__shard="full", parallel__pp=2)
    assert (plan.shard, plan.hybrid, plan.mesh_shape) == ("full", True, (2,))
    assert (plan.rank_batch, plan.engine_name) == (32, "hybrid (pipeline / switch), stages sharded (full)")
    # The hybrid engine runs and writes one whole-tensor file; its replicas are the dp dimension.
    assert (plan.sharded_engine, plan.mesh_description) == (False, "dp=2")
    assert _plan(4, parallel__shard="full").sharded_engine


def test_switch_schedules_shard_on_the_hybrid_engine() -> None:
    plan = _plan(4, parallel__shard="full", parallel__switch="dp2xpp2:0-1,dp4:1-")
    assert (plan.shard, plan.hybrid, plan.sharded_engine, plan.mesh_shape) == ("full", True, False, (2,))
    assert plan.engine_name == "hybrid (pipeline / switch), stages sharded (full)"
    assert plan.sharded_checkpoints


def test_one_rank_runs_as_plain_data_parallel() -> None:
    plan = _plan(1, parallel__shard="full")
    assert (plan.shard, plan.engine_name, plan.mesh_shape) == ("none", "data parallel", (1,))


def test_world_unknown_keeps_the_level() -> None:
    plan = _plan(None, parallel__shard="full", parallel__dp_replicate=2)
    assert (plan.shard, plan.mesh_shape) == ("full", (2, 1))


def test_mesh_shape_arithmetic() -> None:
    assert data_mesh_shape(8, 2) == (2, 4)
    with pytest.raises(ConfigError, match=r"does not divide the world size 4: 4 / 3 = 1\.33333"):
        data_mesh_shape(4, 3)
    with pytest.raises(ConfigError, match="positive integer"):
        data_mesh_shape(4, 0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"parallel__dp_replicate": 2}, "needs parallel.shard grad or full"),
        ({"parallel__shard": "full", "parallel__dp_replicate": 3}, "4 / 3 = 1.33333 ranks per replica"),
        (
            {"parallel__shard": "full", "parallel__pp": 2, "parallel__dp_replicate": 2},
            "parallel.dp_replicate under pipeline stages",
        ),
        ({"parallel__shard": "full", "memory__update_in_backward": True}, "memory.update_in_backward"),
        ({"parallel__shard": "grad", "optim__kfac__enabled": True}, "K-FAC needs whole gradients"),
        ({"parallel__shard": "full", "train__compile": "model"}, "train.compile"),
        ({"parallel__shard": "full", "optim__compile": True}, "optim.compile"),
        ({"parallel__shard": "full", "precision__mode": "int8-stats"}, "precision.mode int8-stats"),
        ({"parallel__shard": "full", "dist__compress": "bf16"}, "dist.compress"),
        (
            {"parallel__shard": "full", "parallel__pp": 2, "memory__recompute": "blocks"},
            "parallel.pp 2 does not work with memory.recompute",
        ),
        ({"parallel__shard": "full", "memory__budget": "0.5"}, "memory.budget (it chooses full sharding"),
        ({"checkpoint__async_save": True}, "checkpoint.async_save writes sharded checkpoints"),
    ],
)
def test_refusals_are_one_line(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")) as caught:
        _plan(4, **overrides)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "memory",
    [
        {"memory__recompute": "blocks"},
        {"memory__recompute": "selective", "memory__blocks": "1-2"},
        {"memory__compress": "int8"},
        {"memory__policy": "0-1:recompute,2:compress"},
    ],
)
def test_memory_techniques_compose_with_sharding(memory: dict) -> None:
    for level in ("grad", "full"):
        plan = _plan(4, parallel__shard=level, **memory)
        assert plan.sharded_engine and plan.shard == level
