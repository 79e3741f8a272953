"""End to end: `kaisoku train` with 2 ranks through torchrun (--standalone), resume, and dying ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kaisoku.data.datagen import generate
from kaisoku.engine.checkpoint import CheckpointManager


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("data") / "shapes", count=160, size=20, val_count=20, workers=1)


def _args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "kaisoku", "train",
        "--nproc", "2",
        "--run-dir", str(run_dir),
        "--data.path", str(data),
        "--data.image-size", "16",
        "--data.global-batch", "16",
        "--data.workers", "0",
        "--model.stem", "imagenet",
        "--train.epochs", "2",
        "--train.log-every", "1",
        "--metrics.progress", "false",
        *extra,
    ]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.timeout(300)
def test_train_two_ranks_then_resume(tmp_path: Path, tiny_data: Path) -> None:
    run_dir = tmp_path / "run"
    first = subprocess.run(
        _args(tiny_data, run_dir, "--max-steps", "4", "--checkpoint.every-steps", "2"),
        capture_output=True, text=True, timeout=240, env=_env(),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert "val_accuracy" in first.stdout
    assert (run_dir / "config.toml").exists()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in steps if "loss" in r) == 4
    second = subprocess.run(
        _args(tiny_data, run_dir, "--max-steps", "6", "--resume", "auto"),
        capture_output=True, text=True, timeout=240, env=_env(),
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    newest = CheckpointManager(run_dir / "checkpoints", keep=3).latest_valid()
    assert newest is not None and newest[1]["step"] == 6


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out.append(child)
            out.extend(_descendants(child))
    return out


def _rank_pid(launcher: int, rank: int) -> int | None:
    for pid in _descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
            return pid
    return None


def _wait_for(condition, timeout: float) -> bool:  # noqa: ANN001
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.2)
    return False


def _kill_and_collect(proc: subprocess.Popen[str], rank: int) -> tuple[float, str]:
    pid = None

    def found() -> bool:
        nonlocal pid
        pid = _rank_pid(proc.pid, rank)
        return pid is not None

    assert _wait_for(found, 60), "rank process not found"
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    _, stderr = proc.communicate(timeout=90)
    return time.monotonic() - killed_at, stderr


@pytest.mark.timeout(300)
def test_sigkill_mid_step_stops_every_rank(tmp_path: Path, tiny_data: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _args(tiny_data, run_dir, "--train.epochs", "50"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    assert _wait_for(lambda: metrics.exists() and metrics.read_text().count('"loss"') >= 2, 180)
    seconds, stderr = _kill_and_collect(proc, rank=1)
    assert proc.returncode == 1
    assert seconds < 60
    assert "rank 1 stopped (signal SIGKILL)" in stderr
    assert _descendants(proc.pid) == []


@pytest.mark.timeout(300)
def test_sigkill_during_checkpoint_save_leaves_only_complete_checkpoints(
    tmp_path: Path, tiny_data: Path
) -> None:
    run_dir = tmp_path / "run"
    # Checkpoints at every 2 steps; the save at step 4 pauses before its rename, and rank 0 dies there.
    # The same launcher as `kaisoku train`, with ranks whose checkpoint writer takes a pausing callback.
    args = _args(tiny_data, run_dir, "--checkpoint.every-steps", "2", "--train.epochs", "50")
    entry = Path(__file__).parent / "engine" / "paused_save_entry.py"
    proc = subprocess.Popen(
        [sys.executable, str(entry), *args[4:]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    paused = run_dir / "checkpoints" / "PAUSED"
    assert _wait_for(paused.exists, 180)
    seconds, stderr = _kill_and_collect(proc, rank=0)
    assert proc.returncode == 1
    assert seconds < 60
    assert "rank 0 stopped (signal SIGKILL)" in stderr
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name != "PAUSED"]
    assert all(name.startswith("step-") and name.endswith(".pt") for name in leftovers), leftovers
    for name in leftovers:
        state = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        assert state["step"] > 0
