"""HSDP on 4 real gloo ranks (``--parallel.shard full --parallel.dp-replicate 2``: 2 replicas x 2 shards): it
matches DDP, and its checkpoints move to 2 ranks fully sharded and back.

A small model of LayerNorm blocks (no BatchNorm, no dropout) keeps every rank count on the same trajectory:
each step's gradient is the mean over the same global batch whatever its split, so runs on 4 and 2 ranks
compare directly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from torch import nn

from kaisoku.data.datagen import generate
from kaisoku.parts import ModelSpec
from tests.dist_harness import run_ranks
from tests.distributed.test_sharded import WEIGHT_ATOL, _close, _train


def layer_norm_blocks(spec: ModelSpec) -> nn.Sequential:
    """Four blocks (four FSDP units) of LayerNorm and Linear layers: a model that trains in moments."""
    width = 64
    return nn.Sequential(
        nn.Sequential(nn.Flatten(), nn.Linear(math.prod(spec.sample_shape), width)),
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()),
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()),
        nn.Sequential(nn.LayerNorm(width), nn.Linear(width, spec.num_classes)),
    )


SMALL = {
    "train__epochs": 1,
    "model__name": "tests.distributed.test_sharded_hsdp:layer_norm_blocks",
    "optim__name": "adamw",
    "optim__lr": 1e-3,
}
HSDP = {**SMALL, "parallel__shard": "full", "parallel__dp_replicate": 2}
SHARD = {**SMALL, "parallel__shard": "full"}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=64, size=20, val_count=16, workers=1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hsdp_matches_ddp_and_moves_to_two_ranks_and_back(tmp_path: Path, tiny_data: Path) -> None:
    # Uninterrupted 4-step runs on 4 ranks: HSDP (a checkpoint at step 2) and DDP.
    hsdp = run_ranks(
        _train, 4, tmp_path / "h", tiny_data, tmp_path / "run-h", 0, "", {**HSDP, "checkpoint__every_steps": 2},
        timeout=400,
    )[0]  # fmt: skip
    assert hsdp["kind"] == "ShardedStep" and hsdp["summary"]["steps"] == 4
    at_two = tmp_path / "run-h" / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in at_two.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "trainer.pt"
    ]  # fmt: skip
    ddp = run_ranks(_train, 4, tmp_path / "d", tiny_data, tmp_path / "run-d", 0, "", SMALL, timeout=400)[0]
    assert ddp["kind"] == "DataParallelStep"
    _close(ddp, hsdp, WEIGHT_ATOL)
    # HSDP step 2 -> 2 ranks fully sharded to step 3 -> HSDP on 4 ranks to step 4: the uninterrupted run.
    two = run_ranks(
        _train, 2, tmp_path / "s", tiny_data, tmp_path / "run-s", 3, str(at_two), SHARD, timeout=400
    )[0]
    assert two["kind"] == "ShardedStep" and two["summary"]["steps"] == 3
    at_three = tmp_path / "run-s" / "checkpoints" / "step-00000003"
    back = run_ranks(
        _train, 4, tmp_path / "b", tiny_data, tmp_path / "run-b", 4, str(at_three), HSDP, timeout=400
    )[0]
    assert back["summary"]["steps"] == 4
    _close(hsdp, back, WEIGHT_ATOL)
