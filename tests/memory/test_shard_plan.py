"""memory.budget on 2 real gloo ranks choosing full sharding: the sharded engine trains, the memory_plan
event says so, its sharded checkpoint resumes into the data-parallel engine of a run that may not shard.

The model is weight-heavy (eight 768x768 blocks, 18 MiB of weights, little activation memory): its
gradients alone exceed the budget's room as whole tensors, so no per-block technique fits, while as
2 shards they fit. A test seam sets the profile's calibration (``fixed``, the host allocator's share of
the measured peak, which varies from run to run) to 0, so the budget lies between the two predictions
by a known margin.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from kaisoku.data.datagen import generate
from kaisoku.engine.build import sharding_alternative
from kaisoku.memory.profile import Profile
from kaisoku.run_facts import plan_run
from tests.dist_harness import run_ranks
from tests.train_harness import metric_lines, tiny_config

BUDGET = "18MiB"  # room 16.2 MiB: whole gradients need >= 18 MiB, 2 shards about 12.5 MiB


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(768, 768), nn.ReLU()) for _ in range(8)]
    return nn.Sequential(nn.Flatten(), *blocks, nn.Linear(768, 10))


def _no_calibration(profile: Profile) -> Profile:
    return dataclasses.replace(profile, fixed=0)


def _train(rank: int, world_size: int, tmp: Path, data: Path, run_dir: Path) -> dict:
    from kaisoku.distributed.env import World
    from kaisoku.engine.build import build_trainer
    from kaisoku.engine.sharded import ShardedStep
    from kaisoku.engine.step import DataParallelStep
    from kaisoku.memory import profile as profile_module
    from kaisoku.parts import UserParts

    profile_module._adjust_profile = _no_calibration
    world = World(rank=rank, world_size=world_size, local_world_size=world_size)
    common = {"train__epochs": 1, "checkpoint__every_steps": 2, "checkpoint__keep": 2}
    cfg = tiny_config(data, run_dir, memory__budget=BUDGET, train__max_steps=2, **common)
    trainer = build_trainer(cfg, world, parts=UserParts(model=_model()))
    sharded_engine = isinstance(trainer.engine, ShardedStep)
    trainer.fit()
    trainer.metrics.close()
    # The same run continued by one that may not shard (and has room): the data-parallel engine reads
    # the sharded checkpoint folder.
    cfg = tiny_config(
        data, run_dir, memory__budget="1GiB", memory__allow_shard=False, train__max_steps=4, **common
    )
    resumed = build_trainer(cfg, world, parts=UserParts(model=_model()), resume="auto")
    start = resumed.state.step
    resumed.fit()
    resumed.metrics.close()
    return {
        "sharded_engine": sharded_engine,
        "resumed_engine_ddp": isinstance(resumed.engine, DataParallelStep),
        "resumed_at": start,
        "end": resumed.state.step,
        "weights": {k: v.detach().clone() for k, v in resumed.unwrapped.state_dict().items()},
    }


@pytest.mark.timeout(180)
def test_budget_chooses_full_sharding_and_resumes_unsharded(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    data = generate(tmp_path / "shapes", count=64, size=16, val_count=16, workers=1)
    zero, one = run_ranks(_train, 2, tmp_path, data, tmp_path / "run", timeout=170)
    assert zero["sharded_engine"] and one["sharded_engine"]
    assert zero["resumed_engine_ddp"] and one["resumed_engine_ddp"]
    assert zero["resumed_at"] == 2 and zero["end"] == 4
    for key, value in zero["weights"].items():
        assert torch.equal(value, one["weights"][key]), key
    records = metric_lines(tmp_path / "run")
    plans = [r for r in records if r.get("event") == "memory_plan"]
    assert len(plans) == 2, plans
    chosen, refused = plans
    assert chosen["shard"] == "full" and chosen["plan"] == "shard full", chosen
    assert set(chosen["techniques"]) == {"keep"}
    assert chosen["shard_priced"]["shards"] == 2 and chosen["shard_priced"]["added_s"] > 0
    assert (
        chosen["predicted_peak_bytes"] <= 0.9 * 18 * (1 << 20) < chosen["plain_peak_bytes"] + 18 * (1 << 20)
    )
    assert "no per-block plan fits" in chosen["shard_note"]
    assert refused["shard"] == "none" and "shard_priced" not in refused
    assert refused["shard_note"] == "sharding not priced: memory.allow_shard is off"
    starts = [r for r in records if r.get("event") == "start"]
    assert starts[0].get("shard") == "full" and "shard" not in starts[1]
    assert list((tmp_path / "run" / "checkpoints").iterdir()), "no checkpoint written"


def test_sharding_alternative_follows_the_settings(tmp_path: Path) -> None:
    data = generate(tmp_path / "shapes", count=32, size=16, val_count=16, workers=1)
    cfg = tiny_config(data, tmp_path / "run", memory__budget=BUDGET)
    sharded, why = sharding_alternative(plan_run(cfg, 2))
    assert sharded is not None and why == ""
    assert sharded.shard == "full" and sharded.mesh_shape == (1, 2)
    assert sharding_alternative(plan_run(cfg, 1)) == (None, "one rank has nothing to shard over")
    off = tiny_config(data, tmp_path / "run", memory__budget=BUDGET, memory__allow_shard=False)
    assert sharding_alternative(plan_run(off, 2)) == (None, "memory.allow_shard is off")
    kfac = tiny_config(data, tmp_path / "run", memory__budget=BUDGET, optim__kfac__enabled=True)
    sharded, why = sharding_alternative(plan_run(kfac, 2))
    assert sharded is None and "optim.kfac.enabled" in why, why
    unset = tiny_config(data, tmp_path / "run")
    assert sharding_alternative(plan_run(unset, 2)) == (None, "")
