"""End to end: what a user sees when a run fails (one cause line, one hint line, logs, exit codes)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kaisoku.data.datagen import generate
from kaisoku.data.shards.writer import pack
from tests.dist_harness import run_ranks
from tests.train_harness import metric_lines, rank_pid, train_args, train_env, train_to_the_end, wait_for

# Slow tier: failure trials of whole kaisoku train runs.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    images = generate(root / "shapes", count=160, size=20, val_count=20, workers=1)
    pack(images, root / "packed", shard_bytes=20 * 1024, codec="raw", workers=1)
    return root / "packed"


@pytest.fixture(scope="module")
def damaged(packed: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A copy of the packed set with 64 bytes flipped in the middle of one training shard."""
    root = tmp_path_factory.mktemp("damaged") / "packed"
    shutil.copytree(packed, root)
    shard = sorted((root / "train").glob("*.kshard"))[3]
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    shard.write_bytes(bytes(data))
    return root, shard.name


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=240, env=train_env())


def _two_lines(stderr: str) -> list[str]:
    lines = stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("kaisoku: error: ") and lines[1].startswith("kaisoku: "), lines
    return lines


@pytest.mark.timeout(300)
def test_damaged_record_read_by_a_loader_worker_gives_one_cause_and_no_resume_hint(
    tmp_path: Path, damaged: tuple[Path, str]
) -> None:
    data, shard = damaged
    run_dir = tmp_path / "run"
    result = _run(train_args(data, run_dir, "--model.name", "small-cnn", "--data.workers", "1"))
    assert result.returncode == 3, result.stderr[-3000:]
    cause, hint = _two_lines(result.stderr)
    assert shard in cause and "record" in cause and "checksum" in cause
    assert "kaisoku inspect" in hint and "--data.skip-corrupt true" in hint
    assert "--resume" not in hint and str(run_dir / "logs") in hint
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank-*.log"))
    assert "Traceback" in logs and "CorruptRecordError" in logs
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "failed" and status["failure"] == "data"


@pytest.mark.timeout(300)
def test_skipped_damaged_records_are_counted_per_epoch_in_the_summary_and_the_last_line(
    tmp_path: Path, damaged: tuple[Path, str]
) -> None:
    data, _ = damaged
    run_dir = tmp_path / "run"
    args = ["--model.name", "small-cnn", "--data.skip-corrupt", "true", "--train.epochs", "1"]
    result = _run(train_args(data, run_dir, *args))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    epochs = [r for r in metric_lines(run_dir) if r.get("event") == "epoch"]
    assert [r["skipped_records"] for r in epochs] == [1.0]
    assert "skipped_records" in result.stdout  # the summary table
    last = result.stdout.strip().splitlines()[-1]
    assert "; 1 record skipped;" in last, last


@pytest.mark.timeout(300)
def test_divergence_stops_naming_the_step_and_layer_and_writes_no_bad_checkpoint(
    tmp_path: Path, packed: Path
) -> None:
    run_dir = tmp_path / "run"
    args = ["--model.name", "small-cnn", "--optim.lr", "1e6", "--checkpoint.every-steps", "2"]
    result = _run(train_args(packed, run_dir, *args))
    assert result.returncode == 4, result.stderr[-3000:]
    cause, hint = _two_lines(result.stderr)
    assert "training diverged:" in cause and "went non-finite at step" in cause
    assert "features.0.0.weight" in cause or "weights" in cause
    assert "--optim.lr" in hint
    lines = metric_lines(run_dir)  # strict JSON on every line
    assert all("time" in r and "elapsed_s" in r for r in lines)
    for path in (run_dir / "checkpoints").glob("step-*.pt"):
        state = torch.load(path, weights_only=True)
        assert all(t.isfinite().all() for t in state["model"].values() if t.is_floating_point()), path


@pytest.mark.timeout(300)
def test_rollback_reloads_a_finite_checkpoint_with_a_lower_learning_rate(
    tmp_path: Path, packed: Path
) -> None:
    run_dir = tmp_path / "run"
    # lr 100 goes non-finite within the run on every CPU tried; lr 20 ended finite (loss 1e6) on an AVX-512 one.
    args = [
        "--model.name", "small-cnn", "--optim.lr", "100", "--checkpoint.every-steps", "2",
        "--train.log-every", "2", "--train.on-nonfinite", "rollback", "--train.max-rollbacks", "2",
    ]  # fmt: skip
    result = _run(train_args(packed, run_dir, *args))
    rollbacks = [r for r in metric_lines(run_dir) if r.get("event") == "rollback"]
    assert rollbacks, result.stdout[-2000:]
    assert [r["lr_scale"] for r in rollbacks] == [0.5, 0.25][: len(rollbacks)]
    assert all(r["step"] < r["from_step"] for r in rollbacks)
    assert "rolled back to step" in result.stdout
    if result.returncode != 0:  # still diverging after 2 rollbacks: said so, exit 4
        assert result.returncode == 4
        assert "still diverging after 2 rollbacks" in _two_lines(result.stderr)[0]


# Ctrl-C (exit 130, the step and the newest checkpoint named) is checked on the Ctrl-C run of
# tests/test_lifecycle.py.


@pytest.fixture(scope="module")
def uninterrupted(packed: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The restart tests' reference: their run never interrupted, on 2 in-process ranks (what the tests
    check is the restarted `kaisoku train` run; this one only gives the weights it must end with)."""
    root = tmp_path_factory.mktemp("reference")
    argv = train_args(packed, root / "run", *_RESTART_ARGS)[4:]  # after `python -m kaisoku train`
    run_ranks(train_to_the_end, 2, root, argv, timeout=240)
    return torch.load(root / "run" / "checkpoints" / "step-00000030.pt", weights_only=True)["model"]


_RESTART_ARGS = ("--model.name", "small-cnn", "--train.epochs", "3", "--checkpoint.every-steps", "2")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("rank", "after_lines"), [(0, 7), (1, 4)])
def test_a_killed_rank_restarts_once_and_finishes_bit_identical(
    tmp_path: Path, packed: Path, uninterrupted: dict[str, torch.Tensor], rank: int, after_lines: int
) -> None:
    """Also the restart's one line, its failure record, each step's metrics once and the RAM tier
    reclaimed (rank 0 owns the node's RAM tier)."""
    run_dir, ram = tmp_path / "run", tmp_path / "ram"
    args = train_args(
        packed, run_dir, *_RESTART_ARGS, "--max-restarts", "1", "--data.ram-dir", str(ram),
        "--data.ram-capacity", "1MiB",
    )  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env())
    metrics = run_dir / "metrics.jsonl"
    assert wait_for(lambda: metrics.exists() and metrics.read_text().count('"loss"') >= after_lines, 180)
    pid = rank_pid(proc.pid, rank)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "restart 1" in (run_dir / "logs" / f"rank-{rank}.log").read_text()  # it did restart
    final = torch.load(run_dir / "checkpoints" / "step-00000030.pt", weights_only=True)["model"]
    assert final.keys() == uninterrupted.keys()
    assert all(torch.equal(final[key], uninterrupted[key]) for key in final)
    if rank != 0:
        return
    restart_lines = [line for line in stderr.splitlines() if "restart 1 of 1" in line]
    assert restart_lines == [
        f"kaisoku: rank 0 on {socket.gethostname()} died (signal SIGKILL); restart 1 of 1 continues from "
        + restart_lines[0].split("continues from ")[1]
    ]
    assert restart_lines[0].split("continues from ")[1].startswith("checkpoint step ")
    record = json.loads((run_dir / "logs" / "failure-rank-0.json").read_text())
    assert record["kind"] == "peer" and "signal SIGKILL" in record["cause"] and record["attempt"] == 0
    lines = metric_lines(run_dir)
    steps = [r["step"] for r in lines if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 30
    assert [r["restart"] for r in lines if r.get("event") == "resume"] == [1]
    assert list(ram.iterdir()) == []  # the killed rank's tier was reclaimed


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["sigterm", "sigusr1"])
def test_a_signal_to_the_launcher_checkpoints_its_step_and_the_rerun_ends_bit_identical(
    tmp_path: Path, packed: Path, uninterrupted: dict[str, torch.Tensor], sig: signal.Signals
) -> None:
    """What Slurm sends at a time limit (SIGTERM) or ahead of it (``--signal=USR1@120``): the ranks finish
    the same step, write its checkpoint and end with exit 75; ``--resume auto`` then ends as if never
    stopped."""
    run_dir = tmp_path / "run"
    args = train_args(packed, run_dir, *_RESTART_ARGS)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env())
    metrics = run_dir / "metrics.jsonl"
    assert wait_for(lambda: metrics.exists() and metrics.read_text().count('"loss"') >= 5, 180)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stderr
    cause, hint = stderr.strip().splitlines()
    prefix = f"kaisoku: stopped by {sig.name} at step "
    assert cause.startswith(prefix) and cause.endswith(" written"), cause
    step = int(cause[len(prefix) :].split(";")[0])
    assert 5 <= step < 30
    assert cause == f"{prefix}{step}; checkpoint step {step} written"
    newest = max(int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*.pt"))
    assert newest == step  # the step it stopped at, not the last every-2-steps checkpoint
    assert hint.startswith(f"kaisoku: rerun with --resume auto to continue from checkpoint step {step}; ")
    state = json.loads((run_dir / "run.json").read_text())
    assert state["status"] == "stopped" and state["exit_code"] == 75 and state["ended"] is not None

    resumed = subprocess.run(
        [*args, "--resume", "auto"], capture_output=True, text=True, timeout=240, env=train_env()
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = torch.load(run_dir / "checkpoints" / "step-00000030.pt", weights_only=True)["model"]
    assert final.keys() == uninterrupted.keys()
    assert all(torch.equal(final[key], uninterrupted[key]) for key in final)


_EXIT_MARKING_MODEL = """
import atexit, os
from pathlib import Path
from torch import nn


def net(spec):
    if "RANK" in os.environ:  # a rank (the launcher builds the model too, to try a step before launching)
        marker = Path(os.environ["EXIT_MARKS"]) / f"rank-{os.environ['RANK']}"
        atexit.register(marker.write_text, "ran")  # what a user's module (or the loader) leaves to the exit
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, getattr(spec, "num_classes", 0) or 10))
"""


@pytest.mark.timeout(300)
def test_a_finished_rank_runs_what_was_registered_for_its_exit(tmp_path: Path, packed: Path) -> None:
    (tmp_path / "exit_marking.py").write_text(_EXIT_MARKING_MODEL)
    marks = tmp_path / "marks"
    marks.mkdir()
    args = train_args(packed, tmp_path / "run", "--model.name", "exit_marking:net", "--max-steps", "2")
    result = subprocess.run(
        args, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=train_env(EXIT_MARKS=str(marks))
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == ["rank-0", "rank-1"]


_LAUNCHED_SCRIPT = """\
import atexit, os, sys
from pathlib import Path
import kaisoku

def main() -> None:
    rank = os.environ["RANK"]
    atexit.register(lambda: (Path(sys.argv[1]) / f"exit-{rank}").write_text("ran"))

if __name__ == "__main__":
    kaisoku.launch(main, nproc=2)
    with (Path(sys.argv[1]) / "after-launch").open("a") as after:
        after.write("once\\n")
"""


@pytest.mark.timeout(200)
def test_launched_ranks_run_their_exit_functions_and_not_the_code_after_launch(tmp_path: Path) -> None:
    script = tmp_path / "launched.py"
    script.write_text(_LAUNCHED_SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    result = subprocess.run(
        [sys.executable, str(script), str(marks)], cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == ["after-launch", "exit-0", "exit-1"]
    assert (marks / "after-launch").read_text() == "once\n"  # the calling process alone went on
