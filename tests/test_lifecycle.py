"""End to end: a run's life in its folder (one run per folder, the right cause once, nothing left behind)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kaisoku.data.datagen import generate
from kaisoku.data.shards.writer import pack
from tests.train_harness import metric_lines, rank_pid, train_args, train_env, wait_for

# Slow tier: kill, interrupt and refusal trials of whole kaisoku train runs.
pytestmark = pytest.mark.slow


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


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _ram_args(ram: Path) -> list[str]:
    return ["--data.ram-dir", str(ram), "--data.ram-capacity", "1MiB"]


def _steps_logged(run_dir: Path, count: int) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and path.read_text().count('"loss"') >= count


@pytest.mark.timeout(300)
def test_one_run_per_folder_and_ctrl_c_leaves_no_ram_tier(tmp_path: Path, packed: Path) -> None:
    run_dir, ram = tmp_path / "run", tmp_path / "ram"
    args = [
        *train_args(packed, run_dir, "--model.name", "small-cnn", "--train.epochs", "200"),
        *_ram_args(ram),
        "--checkpoint.every-steps", "3",
    ]  # fmt: skip
    first = _start(args, start_new_session=True)
    assert wait_for(lambda: len(list((run_dir / "checkpoints").glob("step-*.pt"))) >= 1, 180)
    assert any(ram.iterdir())  # the RAM tier is in use
    # A second run on the same folder, even asking to resume, is refused while the first holds it.
    second = _run([*args, "--resume", "auto"])
    assert second.returncode == 2, second.stderr
    assert second.stderr.strip().splitlines() == [
        f"kaisoku: error: run folder {run_dir} is in use by pid {first.pid} on {socket.gethostname()} "
        "(another kaisoku train); wait for it or choose another --run-dir"
    ]
    os.killpg(first.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    _, stderr = first.communicate(timeout=90)
    assert first.returncode == 130, stderr
    cause, hint = _two_lines(stderr)
    newest = max(int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*.pt"))
    assert cause.startswith("kaisoku: error: interrupted at step ")
    assert cause.endswith(f"; checkpoint step {newest} is the newest"), cause
    assert "--resume auto" in hint
    assert list(ram.iterdir()) == []
    steps = [r["step"] for r in metric_lines(run_dir) if "loss" in r]
    assert steps == sorted(set(steps))  # one run's lines only
    # Rerunning into the used folder without --resume would mix two runs: refused.
    again = _run(args)
    assert again.returncode == 2
    (line,) = again.stderr.strip().splitlines()
    assert line.startswith(f"kaisoku: error: run folder {run_dir} holds another run (checkpoints up to step ")
    assert line.endswith("); pass --resume auto to continue it, or choose a new --run-dir")


@pytest.mark.timeout(300)
def test_a_killed_launcher_takes_its_ranks_down_and_the_next_run_marks_it_failed(
    tmp_path: Path, packed: Path
) -> None:
    run_dir, ram = tmp_path / "run", tmp_path / "ram"
    args = [
        *train_args(packed, run_dir, "--model.name", "small-cnn", "--train.epochs", "200"),
        *_ram_args(ram),
    ]
    launcher = _start(args)
    assert wait_for(lambda: _steps_logged(run_dir, 2), 180)
    ranks = [rank_pid(launcher.pid, rank) for rank in (0, 1)]
    assert None not in ranks
    launcher.kill()
    launcher.communicate(timeout=30)
    assert wait_for(lambda: not any(_alive(pid) for pid in ranks if pid is not None), 60), "ranks still run"
    assert json.loads((run_dir / "run.json").read_text())["status"] == "running"
    left = sorted(str(p.relative_to(ram)) for p in ram.rglob("*"))
    assert left == []  # the ranks left through Python, removing their RAM tier
    for rank in (0, 1):  # each rank's record says why it stopped: no other rank had failed
        record = json.loads((run_dir / "logs" / f"failure-rank-{rank}.json").read_text())
        assert record["cause"] == "stopped because its launcher died (killed)", record
    later = _run(args)
    assert later.returncode == 2  # it holds the killed run's steps
    state = json.loads((run_dir / "run.json").read_text())
    assert state["status"] == "failed" and f"pid {launcher.pid}" in state["cause"]
    assert state["ended"] is not None and state["ended"] <= time.time()
    assert f"kaisoku: the earlier run in {run_dir} stopped without a word" in later.stderr


# A rank killed and restarted (its one line, failure record, metrics once, RAM tier reclaimed) is checked on
# the bit-identical restart run of tests/test_failures.py.


@pytest.mark.timeout(300)
def test_cache_trouble_is_one_line_on_the_terminal_and_never_damaged_data(
    tmp_path: Path, packed: Path
) -> None:
    run_dir = tmp_path / "run"
    blocker = tmp_path / "file"
    blocker.write_text("")
    # An unwritable RAM directory: the directory is named, not the dataset.
    unwritable = _run(
        [*train_args(packed, run_dir, "--model.name", "small-cnn"), *_ram_args(blocker / "ram")]
    )
    assert unwritable.returncode == 1
    cause, hint = _two_lines(unwritable.stderr)
    assert cause.startswith(f"kaisoku: error: cannot write to data.ram_dir {blocker}/ram/")
    assert "--data.ram-dir" in cause and "inspect" not in hint and "re-pack" not in cause + hint
    # A node-local cache too small for the order: one warning, on the terminal.
    small = _run(
        [
            *train_args(packed, tmp_path / "run2", "--model.name", "small-cnn", "--train.epochs", "1"),
            "--data.local-cache", str(tmp_path / "local"), "--data.local-capacity", "24KiB",
        ]
    )  # fmt: skip
    assert small.returncode == 0, small.stderr[-3000:]
    warnings = [line for line in small.stderr.splitlines() if line.startswith("kaisoku: warning: ")]
    assert len(warnings) == 1 and "local" in warnings[0], small.stderr


@pytest.mark.timeout(300)
def test_messages_are_one_line_when_piped_and_the_summary_shows_what_matters(
    tmp_path: Path, packed: Path
) -> None:
    run_dir = tmp_path / ("a-run-folder-with-a-long-name-" * 3)
    args = train_args(packed, run_dir, "--model.name", "small-cnn", "--max-steps", "4")
    result = _run([*args, "--metrics.progress", "true", "--checkpoint.every-steps", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoint {run_dir}/checkpoints/step-00000002.pt" in result.stdout.splitlines()
    assert "source_bytes" not in result.stdout and "served_ram_bytes" not in result.stdout


@pytest.mark.timeout(120)
def test_a_read_only_run_folder_is_one_line(tmp_path: Path, packed: Path) -> None:
    readonly = tmp_path / "ro"
    readonly.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)]).returncode != 0:
        pytest.skip("needs mount (root): a read-only file system")
    try:
        result = _run(train_args(packed, readonly / "run"), timeout=60)
    finally:
        subprocess.run(["umount", str(readonly)], check=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kaisoku: error: cannot write to run folder {readonly / 'run'} (Read-only file system); "
        "choose a writable --run-dir"
    ]


@pytest.mark.timeout(300)
def test_a_broken_index_exits_3_with_a_run_folder_and_run_json(tmp_path: Path, packed: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(packed, broken)
    index = broken / "train" / "index.json"
    index.write_text(index.read_text()[:40])
    run_dir = tmp_path / "run"
    result = _run(train_args(broken, run_dir, "--model.name", "small-cnn"))
    assert result.returncode == 3, result.stderr
    cause, hint = _two_lines(result.stderr)
    assert "index.json" in cause and "kaisoku inspect" in hint
    assert json.loads((run_dir / "run.json").read_text())["failure"] == "data"
