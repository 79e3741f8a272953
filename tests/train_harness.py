"""Helpers for end-to-end `kaisoku train` tests: arguments of a tiny 2-rank run, finding and killing ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kaisoku.cli import resolve_config
from kaisoku.config import Config, apply_override
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer


def train_args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    """``kaisoku train`` on 2 ranks, 16 px images, batch 16, no workers, no progress bar."""
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


def kaisoku_in_process(capfd: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``kaisoku ARGS`` through :func:`kaisoku.cli.main` in this process, for commands refused before any
    rank starts: the command's own code and output without a process start that imports torch (a
    traceback would fail the test as an exception)."""
    from kaisoku.cli import main

    capfd.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    stdout, stderr = capfd.readouterr()
    return subprocess.CompletedProcess(list(args), exited.value.code or 0, stdout, stderr)


def train_to_the_end(rank: int, world_size: int, tmp: Path, argv: list[str]) -> None:
    """A :func:`tests.dist_harness.run_ranks` body: on this rank, the run of ``argv`` (``kaisoku train``'s
    arguments, e.g. ``train_args(...)[4:]``) to its end, in this process: the reference weights a test of
    a launched run compares with, without a launch of its own."""
    cfg, _ = resolve_config(argv)
    world = World(rank=rank, world_size=world_size, local_world_size=world_size)
    trainer = build_trainer(cfg, world, resume=cfg.checkpoint.resume)
    trainer.fit()
    trainer.metrics.close()


def train_env(**extra: str) -> dict[str, str]:
    """The environment of a test run: one thread per rank."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def descendants(pid: int) -> list[int]:
    """Every live descendant process of ``pid``."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            out.append(child)
            out.extend(descendants(child))
    return out


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of rank ``rank`` under ``launcher``, once it runs."""
    for pid in descendants(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
            return pid
    return None


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll ``condition`` every 0.2 s until it holds or ``timeout`` seconds pass."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.2)
    return False


def kill_and_collect(proc: subprocess.Popen[str], rank: int) -> tuple[float, str]:
    """SIGKILL rank ``rank`` of the run ``proc``; (seconds until the launcher exited, its stderr)."""
    pid = None

    def found() -> bool:
        nonlocal pid
        pid = rank_pid(proc.pid, rank)
        return pid is not None

    assert wait_for(found, 60), "rank process not found"
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    _, stderr = proc.communicate(timeout=90)
    return time.monotonic() - killed_at, stderr


def metric_lines(run_dir: Path) -> list[dict]:
    """metrics.jsonl parsed strictly (a bare NaN or Infinity token fails)."""
    import json

    def reject(token: str) -> None:
        raise ValueError(f"non-JSON token {token}")

    text = (run_dir / "metrics.jsonl").read_text()
    return [json.loads(line, parse_constant=reject) for line in text.splitlines()]


def tiny_config(data: Path | str, run_dir: Path | str, **overrides: object) -> Config:
    """The config of a tiny in-process run: 16 px, batch 16, no loader workers, small-cnn, 2 epochs.

    ``overrides`` are dotted keys written with ``__`` (``optim__lr=0.05``), applied in order.
    """
    cfg = Config(run_dir=str(run_dir))
    cfg.data.path = str(data)
    cfg.data.image_size = 16
    cfg.data.global_batch = 16
    cfg.data.workers = 0
    cfg.model.name = "small-cnn"
    cfg.train.epochs = 2
    cfg.metrics.progress = False
    for key, value in overrides.items():
        apply_override(cfg, key.replace("__", "."), value)
    return cfg


def cosmoflow_tiny_config(data: Path | str, run_dir: Path | str, **overrides: object) -> Config:
    """:func:`tiny_config` for CosmoFlow on 8^3 volumes: width 4, batch 8, AdamW 1e-3."""
    return tiny_config(
        data,
        run_dir,
        model__name="cosmoflow",
        model__width=4,
        data__image_size=8,
        data__global_batch=8,
        optim__name="adamw",
        optim__lr=1e-3,
        **overrides,
    )
