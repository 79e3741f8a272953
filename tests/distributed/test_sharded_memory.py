"""Sharded data parallelism with the memory techniques on real 2-rank gloo groups: recomputation (whole blocks
or selective) is applied to the blocks before they are sharded and trains as the plain sharded run does;
compressed and offloaded activations train too; ``kaisoku train`` runs the combination end to end."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from kaisoku.data.datagen import generate
from tests.dist_harness import run_ranks
from tests.distributed.test_sharded import SHARD, WEIGHT_ATOL, _close, _train
from tests.train_harness import train_args, train_env

# Slow tier: memory techniques on sharded blocks, several 2-rank runs.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=64, size=20, val_count=16, workers=1)


def _run(tmp: Path, data: Path, settings: dict) -> dict:
    return run_ranks(_train, 2, tmp / "ranks", data, tmp / "run", 0, "", settings, timeout=240)[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("level", ["full", "grad"])
def test_recompute_on_sharded_blocks_trains_as_without(tmp_path: Path, tiny_data: Path, level: str) -> None:
    settings = {**SHARD, "parallel__shard": level}
    plain = _run(tmp_path / "plain", tiny_data, settings)
    for mode in ("blocks", "selective"):
        recomputed = _run(tmp_path / mode, tiny_data, {**settings, "memory__recompute": mode})
        assert recomputed["kind"] == "ShardedStep" and recomputed["summary"]["steps"] == 4
        _close(plain, recomputed, WEIGHT_ATOL)


@pytest.mark.timeout(600)
def test_compressed_offloaded_and_per_block_activations_on_sharded_blocks(
    tmp_path: Path, tiny_data: Path
) -> None:
    plain = _run(tmp_path / "plain", tiny_data, SHARD)
    compressed = _run(tmp_path / "bf16", tiny_data, {**SHARD, "memory__compress": "bf16"})
    assert compressed["kind"] == "ShardedStep" and compressed["summary"]["steps"] == 4
    # bf16 activations change the gradients slightly: close to the plain run, not equal to it.
    floats = [k for k, v in plain["model"].items() if v.is_floating_point()]
    for key in floats:
        torch.testing.assert_close(compressed["model"][key], plain["model"][key], rtol=0, atol=5e-2, msg=key)
    assert any(not torch.equal(compressed["model"][k], plain["model"][k]) for k in floats)
    # Offloaded activations come back as they were; a per-block policy mixes recompute and offload.
    offload = {"memory__offload_dir": str(tmp_path / "offload")}
    for name, memory in (
        ("offload", {"memory__offload": "disk", **offload}),
        ("policy", {"memory__policy": "0-1:recompute,2:offload", **offload}),
    ):
        other = _run(tmp_path / name, tiny_data, {**SHARD, **memory})
        assert other["kind"] == "ShardedStep" and other["summary"]["steps"] == 4
        _close(plain, other, WEIGHT_ATOL)


@pytest.mark.timeout(300)
def test_kaisoku_train_shards_recomputed_blocks(tmp_path: Path, tiny_data: Path) -> None:
    run_dir = tmp_path / "run"
    args = ("--parallel.shard", "full", "--model.name", "resnet10", "--memory.recompute", "blocks")
    done = subprocess.run(
        train_args(tiny_data, run_dir, *args, "--max-steps", "2"),
        capture_output=True, text=True, timeout=240, env=train_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kaisoku: done at step 2" in done.stdout
