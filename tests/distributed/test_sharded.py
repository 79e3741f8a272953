"""Sharded data parallelism (FSDP2 per block) on real 2-rank gloo groups: it trains through the trainer, it
matches DDP, LARS/LAMB on shards match unsharded, and sharded checkpoints move between layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kaisoku.config import Config
from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from tests.dist_harness import run_ranks
from tests.train_harness import tiny_config

#: Sharded vs DDP weights after a few fp32 steps: the reduce-scatter averages in another order than DDP's
#: all-reduce (pre- and post-division), so equal up to fp32 rounding carried through a few steps.
WEIGHT_ATOL = 1e-5


def _config(data: Path, run_dir: Path, **overrides: object) -> Config:
    settings: dict[str, object] = {
        "model__name": "resnet10",
        "model__stem": "imagenet",
        "train__log_every": 2,
        "sched__warmup_epochs": 0.5,
        "optim__lr": 0.05,
        "metrics__progress": False,
    }
    return tiny_config(data, run_dir, **{**settings, **overrides})


def _train(
    rank: int,
    world_size: int,
    tmp: Path,
    data: Path,
    run_dir: Path,
    max_steps: int,
    resume: str,
    overrides: dict,
) -> dict:
    cfg = _config(data, run_dir, **overrides)
    cfg.train.max_steps = max_steps
    trainer = build_trainer(
        cfg, World(rank=rank, world_size=world_size, local_world_size=world_size), resume=resume
    )
    summary = trainer.fit()
    trainer.metrics.close()
    state = trainer.unwrapped.state_dict()
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()}
    return {"summary": summary, "model": full, "kind": type(trainer.engine).__name__}


def _parameters(state: dict) -> dict:
    return {k: v for k, v in state.items() if "running_" not in k and "num_batches" not in k}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=64, size=20, val_count=16, workers=1)


@pytest.mark.timeout(300)
def test_full_shard_matches_ddp(tmp_path: Path, tiny_data: Path) -> None:
    common = {"train__epochs": 1}
    ddp = run_ranks(_train, 2, tmp_path / "a", tiny_data, tmp_path / "run-a", 0, "", common, timeout=240)
    sharded = run_ranks(
        _train,
        2,
        tmp_path / "b",
        tiny_data,
        tmp_path / "run-b",
        0,
        "",
        {**common, "parallel__shard": "full"},
        timeout=240,
    )
    assert sharded[0]["kind"] == "ShardedStep" and ddp[0]["kind"] == "DataParallelStep"
    assert sharded[0]["summary"]["steps"] == ddp[0]["summary"]["steps"] == 4
    for key, value in _parameters(ddp[0]["model"]).items():
        torch.testing.assert_close(sharded[0]["model"][key], value, rtol=0, atol=WEIGHT_ATOL, msg=key)
