"""A pipeline run's checkpoint (one file of whole tensors, optimizer state keyed by parameter name) resumes
under ``parallel.shard full`` on real 2-rank gloo groups: the weights and optimizer state exactly, then the
same steps as a data-parallel run resumed from it; ``kaisoku ckpt convert`` turns it into a sharded folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kaisoku.data.datagen import generate
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from kaisoku.engine.checkpoint import CheckpointManager
from tests.dist_harness import run_ranks
from tests.distributed.test_sharded import (
    SHARD,
    STEPS,
    WEIGHT_ATOL,
    _close,
    _config,
    _parameters,
    _train,
    main_exit,
)

# Slow tier: pipeline checkpoints resumed sharded, several runs.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=64, size=20, val_count=16, workers=1)


def _pipeline_to_two(rank: int, world_size: int, tmp: Path, data: Path, run_dir: Path) -> None:
    cfg = _config(data, run_dir, **STEPS, parallel__pp=2, checkpoint__every_steps=2)
    cfg.train.max_steps = 2
    trainer = build_trainer(cfg, World(rank=rank, world_size=world_size, local_world_size=world_size))
    trainer.fit()
    trainer.metrics.close()


@pytest.mark.timeout(600)
def test_pipeline_checkpoint_resumes_sharded(tmp_path: Path, tiny_data: Path) -> None:
    run_ranks(_pipeline_to_two, 2, tmp_path / "p", tiny_data, tmp_path / "pp", timeout=240)
    checkpoint = tmp_path / "pp" / "checkpoints" / "step-00000002.pt"
    saved = CheckpointManager.load(checkpoint)
    assert "layout" in saved and all(
        isinstance(p, str) for p in saved["optimizer"]["param_groups"][0]["params"]
    )

    # Loaded on 2 shards: the step-2 weights and momentum exactly.
    loaded = run_ranks(
        _train, 2, tmp_path / "l", tiny_data, tmp_path / "run-l", 2, str(checkpoint), SHARD, timeout=240
    )[0]
    assert loaded["kind"] == "ShardedStep"
    for name, value in _parameters(saved["model"]).items():
        assert torch.equal(loaded["model"][name], value), name
    assert loaded["optimizer"].keys() == saved["optimizer"]["state"].keys()
    for name, slots in saved["optimizer"]["state"].items():
        assert torch.equal(loaded["optimizer"][name]["momentum_buffer"], slots["momentum_buffer"]), name

    # Trained on from there: as a data-parallel run resumed from the same file, within fp32 rounding.
    sharded = run_ranks(
        _train, 2, tmp_path / "s", tiny_data, tmp_path / "run-s", 0, str(checkpoint), SHARD, timeout=240
    )[0]
    ddp = run_ranks(
        _train, 2, tmp_path / "d", tiny_data, tmp_path / "run-d", 0, str(checkpoint), STEPS, timeout=240
    )[0]
    assert sharded["summary"]["steps"] == ddp["summary"]["steps"] == 4
    _close(ddp, sharded, WEIGHT_ATOL)

    # The file converts into a sharded folder that resumes as the file does, bitwise.
    folder = tmp_path / "folder" / "step-00000002"
    assert main_exit(["ckpt", "convert", str(checkpoint), str(folder)]) == 0
    from_folder = run_ranks(
        _train, 2, tmp_path / "f", tiny_data, tmp_path / "run-f", 0, str(folder), SHARD, timeout=240
    )[0]
    _close(sharded, from_folder, 0.0)
