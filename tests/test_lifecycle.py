"""End to end: a run's life in its folder (one run per folder, the right cause once, nothing left behind)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from kaisoku.data.datagen import generate
from kaisoku.data.writer import pack
from tests.train_harness import metric_lines, rank_pid, train_args, train_env, wait_for


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    images = generate(root / "shapes", count=160, size=20, val_count=20, workers=1)
    pack(images, root / "packed", shard_bytes=20 * 1024, codec="raw", workers=1)
    return root / "packed"


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=train_env())


def _start(args: list[str], **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(), **kwargs
    )


def _two_lines(stderr: str) -> list[str]:
    lines = stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("kaisoku: error: ") and lines[1].startswith("kaisoku: "), lines
    return lines


def _has_event(run_dir: Path, event: str) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and f'"event": "{event}"' in path.read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_killed_after_validation_is_reported_as_the_rank_that_died(
    tmp_path: Path, packed: Path, rank: int
) -> None:
    # Validation starts the loader's worker processes; the teardown's SIGTERM then kills the survivor's
    # worker, and that death must not pass for the cause.
    run_dir = tmp_path / "run"
    args = train_args(
        packed, run_dir, "--model.name", "small-cnn", "--data.workers", "1", "--train.val-every", "2",
        "--train.epochs", "200", "--checkpoint.every-steps", "2", "--data.loader", "processes",
    )  # fmt: skip
    proc = _start(args)
    assert wait_for(lambda: _has_event(run_dir, "validation"), 180)
    pid = rank_pid(proc.pid, rank)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 6, stderr
    cause, hint = _two_lines(stderr)
    assert cause.startswith(f"kaisoku: error: rank {rank} on {socket.gethostname()} died (signal SIGKILL)")
    assert "--resume auto" in hint
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "failed" and status["failure"] == "peer"
