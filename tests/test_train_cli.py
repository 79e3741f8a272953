"""End to end: `kaisoku train` with 2 ranks through torchrun (--standalone), resume, and dying ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kaisoku.data.datagen import generate
from kaisoku.engine.checkpoint import CheckpointManager
from tests.train_harness import descendants, kill_and_collect, metric_lines, train_args, train_env, wait_for


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=160, size=20, val_count=20, workers=1)


@pytest.mark.timeout(300)
def test_train_two_ranks_then_resume(tmp_path: Path, tiny_data: Path) -> None:
    run_dir = tmp_path / "run"
    first = subprocess.run(
        train_args(tiny_data, run_dir, "--max-steps", "4", "--checkpoint.every-steps", "2"),
        capture_output=True, text=True, timeout=240, env=train_env(),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert "val_accuracy" in first.stdout
    assert (run_dir / "config.toml").exists()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in steps if "loss" in r) == 4
    # Resumed on one rank: said in one line; the run ends with a line naming its report.
    second = subprocess.run(
        train_args(tiny_data, run_dir, "--max-steps", "6", "--resume", "auto", "--nproc", "1"),
        capture_output=True, text=True, timeout=240, env=train_env(),
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    assert (
        "world size changed since the checkpoint: 2 -> 1 ranks; the sample order is unchanged"
        in second.stdout
    )
    last = second.stdout.strip().splitlines()[-1]
    assert last.startswith("kaisoku: done at step 6;") and "records skipped" in last, last
    assert last.endswith(f"report {run_dir / 'report.html'}")
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    events = [r["event"] for r in metric_lines(run_dir) if "event" in r]
    assert {"start", "checkpoint", "validation", "world_size"} <= set(events), events
    newest = CheckpointManager(run_dir / "checkpoints", keep=3).latest_valid()
    assert newest is not None and newest[1]["step"] == 6


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_mid_step_stops_every_rank(tmp_path: Path, tiny_data: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        train_args(tiny_data, run_dir, "--train.epochs", "50", "--checkpoint.every-steps", "1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(),
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    assert wait_for(lambda: metrics.exists() and metrics.read_text().count('"loss"') >= 2, 180)
    seconds, stderr = kill_and_collect(proc, rank=1)
    assert proc.returncode == 6  # lost peer
    assert seconds < 60
    lines = stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in stderr, stderr
    assert "rank 1 on " in lines[0] and "died (signal SIGKILL)" in lines[0], lines
    assert "rerun with --resume auto to continue from checkpoint step" in lines[1]
    assert str(run_dir / "logs") in lines[1]
    assert "Traceback" in (run_dir / "logs" / "rank-0.log").read_text()  # the detail stays in the log
    assert descendants(proc.pid) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_during_checkpoint_save_leaves_only_complete_checkpoints(
    tmp_path: Path, tiny_data: Path
) -> None:
    run_dir = tmp_path / "run"
    # Checkpoints at every 2 steps; the save at step 4 pauses before its rename, and rank 0 dies there.
    # The same launcher as `kaisoku train`, with ranks whose checkpoint writer takes a pausing callback.
    args = train_args(tiny_data, run_dir, "--checkpoint.every-steps", "2", "--train.epochs", "50")
    entry = Path(__file__).parent / "engine" / "paused_save_entry.py"
    proc = subprocess.Popen(
        [sys.executable, str(entry), *args[4:]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(),
    )  # fmt: skip
    paused = run_dir / "checkpoints" / "PAUSED"
    assert wait_for(paused.exists, 180)
    seconds, stderr = kill_and_collect(proc, rank=0)
    assert proc.returncode == 6
    assert seconds < 60
    assert "rank 0 on " in stderr and "died (signal SIGKILL)" in stderr
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name != "PAUSED"]
    assert all(name.startswith("step-") and name.endswith(".pt") for name in leftovers), leftovers
    for name in leftovers:
        state = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        assert state["step"] > 0
