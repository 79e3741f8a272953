"""End to end: `kaisoku train --parallel.shard full --nproc 2` through torchrun, sharded checkpoint folders, and
SIGKILL during a sharded save leaving the previous checkpoint valid for --resume auto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kaisoku.data.datagen import generate
from kaisoku.engine.checkpoint import CheckpointManager
from tests.train_harness import kill_and_collect, metric_lines, train_args, train_env, wait_for

SHARD = ("--parallel.shard", "full", "--model.name", "resnet10", "--checkpoint.every-steps", "2")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=96, size=20, val_count=16, workers=1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sharded_train_and_kill_during_sharded_save(tmp_path: Path, tiny_data: Path) -> None:
    run_dir = tmp_path / "run"
    first = subprocess.run(
        train_args(tiny_data, run_dir, *SHARD, "--max-steps", "2"),
        capture_output=True, text=True, timeout=240, env=train_env(),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    start = next(r for r in metric_lines(run_dir) if r.get("event") == "start")
    assert (start["shard"], start["data_mesh"]) == ("full", "dp_replicate=1 x dp_shard=2")
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "step-00000002" / ".metadata").is_file()

    # Resume; the save at step 4 pauses before its rename with every shard and the metadata written, and
    # rank 0 dies there.
    entry = Path(__file__).parent / "engine" / "paused_save_entry.py"
    args = train_args(tiny_data, run_dir, *SHARD, "--max-steps", "4", "--resume", "auto")
    proc = subprocess.Popen(
        [sys.executable, str(entry), *args[4:]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(),
    )  # fmt: skip
    paused = checkpoints / "PAUSED"
    assert wait_for(paused.exists, 180)
    _, stderr = kill_and_collect(proc, rank=0)
    assert proc.returncode == 6 and "died (signal SIGKILL)" in stderr
    assert paused.read_text().endswith(".step-00000004.tmp")  # complete, never renamed
    # The launcher cleared the dead writer's folder; the previous checkpoint is untouched.
    assert sorted(p.name for p in checkpoints.iterdir() if p.name != "PAUSED") == ["step-00000002"]
    manager = CheckpointManager(checkpoints, keep=3)
    assert [p.name for p in manager.list()] == ["step-00000002"]
    newest = manager.latest_valid()
    assert newest is not None and newest[1]["step"] == 2

    resumed = subprocess.run(
        train_args(tiny_data, run_dir, *SHARD, "--max-steps", "4", "--resume", "auto"),
        capture_output=True, text=True, timeout=240, env=train_env(),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step-00000002'} at step 2" in resumed.stdout
    assert not (checkpoints / ".step-00000004.tmp").exists()
    assert [p.name for p in manager.list()] == ["step-00000002", "step-00000004"]


@pytest.mark.timeout(120)
def test_async_save_without_sharding_is_refused_before_launch(tmp_path: Path, tiny_data: Path) -> None:
    run_dir = tmp_path / "run"
    refused = subprocess.run(
        train_args(tiny_data, run_dir, "--checkpoint.async-save", "true"),
        capture_output=True, text=True, timeout=100, env=train_env(),
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert lines == [
        "kaisoku: error: checkpoint.async_save writes sharded checkpoints in the background and needs "
        "parallel.shard grad or full (a single-file checkpoint is written by rank 0 as it is)"
    ]
    assert not run_dir.exists()
