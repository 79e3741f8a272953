"""HSDP on 4 real gloo ranks (``--parallel.shard full --parallel.dp-replicate 2``: 2 replicas x 2 shards): it
matches DDP, and its checkpoints move to 2 ranks fully sharded, on to 2 pipeline stages sharded over 2 ranks
each (which write their own stage's shards, in the background) and back; ``kaisoku ckpt convert`` turns the
pipeline's folder into one file.

A small model of LayerNorm blocks (no BatchNorm, no dropout) keeps every rank count on the same trajectory:
each step's gradient is the mean over the same global batch whatever its split, so runs on 4 and 2 ranks
compare directly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from kaisoku.data.datagen import generate
from kaisoku.distributed.named_state import named_from_torch_optimizer_state
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.parts import ModelSpec
from tests.dist_harness import run_ranks
from tests.distributed.test_sharded import WEIGHT_ATOL, _build, _close, _train, _whole_state, main_exit

# Slow tier: HSDP against DDP and across layouts, several runs.
pytestmark = pytest.mark.slow


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
PIPELINE = {**SHARD, "parallel__pp": 2, "checkpoint__async_save": True}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=64, size=20, val_count=16, workers=1)


def _resume_and_train(
    rank: int,
    world_size: int,
    tmp: Path,
    data: Path,
    run_dir: Path,
    max_steps: int,
    resume: str,
    overrides: dict,
) -> dict:
    """:func:`_train`, with the whole state just as it was resumed (``loaded``) too."""
    trainer = _build(rank, world_size, data, run_dir, max_steps, resume, overrides)
    loaded = _whole_state(trainer)
    summary = trainer.fit()
    trainer.metrics.close()
    return {
        "summary": summary,
        "loaded": loaded,
        **_whole_state(trainer),
        "kind": type(trainer.engine).__name__,
    }


def _model_keys_by_file(folder: Path) -> dict[str, set[str]]:
    """The model tensors (by name) each shard file of the sharded checkpoint ``folder`` holds pieces of."""
    metadata = FileSystemReader(folder).read_metadata()
    held: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("model."):
            held.setdefault(info.relative_path, set()).add(index.fqn.removeprefix("model."))
    return held


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hsdp_matches_ddp_and_moves_to_two_ranks_pipeline_stages_and_back(
    tmp_path: Path, tiny_data: Path
) -> None:
    # Uninterrupted 4-step runs on 4 ranks: HSDP (a checkpoint at step 2) and DDP.
    hsdp = run_ranks(
        _train, 4, tmp_path / "h", tiny_data, tmp_path / "run-h", 0, "", {**HSDP, "checkpoint__every_steps": 2},
        timeout=400,
    )[0]  # fmt: skip
    assert hsdp["kind"] == "ShardedStep" and hsdp["summary"]["steps"] == 4
    at_two = tmp_path / "run-h" / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in at_two.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "checksums.json",
        "trainer.pt",
    ]  # fmt: skip
    ddp = run_ranks(_train, 4, tmp_path / "d", tiny_data, tmp_path / "run-d", 0, "", SMALL, timeout=400)[0]
    assert ddp["kind"] == "DataParallelStep"
    _close(ddp, hsdp, WEIGHT_ATOL)
    # HSDP step 2 -> 2 ranks fully sharded to step 3.
    two = run_ranks(
        _train, 2, tmp_path / "s", tiny_data, tmp_path / "run-s", 3, str(at_two), SHARD, timeout=400
    )[0]
    assert two["kind"] == "ShardedStep" and two["summary"]["steps"] == 3
    at_three = tmp_path / "run-s" / "checkpoints" / "step-00000003"
    # -> 2 pipeline stages x 2 shards on 4 ranks: each rank reads its stage's pieces, the step-3 state
    # exactly; to step 4 as the uninterrupted run, saved in the background as a folder of each rank's stage
    # shards.
    piped = run_ranks(
        _resume_and_train, 4, tmp_path / "p", tiny_data, tmp_path / "run-p", 4, str(at_three), PIPELINE,
        timeout=400,
    )[0]  # fmt: skip
    assert piped["kind"] == "HybridStep" and piped["summary"]["steps"] == 4
    _close(two, piped["loaded"], 0.0)
    _close(hsdp, piped, WEIGHT_ATOL)
    checkpoints = tmp_path / "run-p" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step-00000004"]
    at_four = checkpoints / "step-00000004"
    assert sorted(p.name for p in at_four.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "checksums.json",
        "trainer.pt",
    ]  # fmt: skip
    # Every file holds one stage's tensors (its shard of each), the two stages together the whole model.
    stages = {frozenset(names) for names in _model_keys_by_file(at_four).values()}
    assert len(stages) == 2 and set.union(*map(set, stages)) == set(piped["model"])
    assert not frozenset.intersection(*stages)
    # -> HSDP on 4 ranks reads the pipeline's folder: the step-4 state exactly.
    back = run_ranks(
        _train, 4, tmp_path / "b", tiny_data, tmp_path / "run-b", 4, str(at_four), HSDP, timeout=400
    )[0]
    assert back["kind"] == "ShardedStep"
    _close(piped, back, 0.0)
    # The pipeline's folder converts into one file of the same state.
    single = tmp_path / "one" / "step-00000004.pt"
    assert main_exit(["ckpt", "convert", str(at_four), str(single)]) == 0
    converted = CheckpointManager.load(single)
    named = named_from_torch_optimizer_state(converted["optimizer"])
    _close(piped, {"model": converted["model"], "optimizer": named["state"]}, 0.0)
