"""Losing a host in a cluster in a box: every rank of one host killed mid-epoch.

Without restarts the other host stops with one line naming the lost host, and ``--resume auto`` continues.
With ``--nnodes 1:2 --max-restarts`` the remaining host goes on (elastic), the world-size change is one
line; when the lost host's launcher starts again, the run grows back to both hosts from the newest
checkpoint, and over each epoch every sample is trained exactly once across the world sizes.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kaisoku.testing.cluster import ClusterBox, Link, unavailable_reason
from tests.cluster.box_runs import ENDPOINT, REPO, finish, host_args, hosts_record, make_packed, start_hosts
from tests.train_harness import metric_lines, wait_for

REASON = unavailable_reason()
# Slow tier: a host lost and regained in a cluster in a box.
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.slow]
TRAIN_SAMPLES, GLOBAL_BATCH = 160, 8
STEPS_PER_EPOCH = TRAIN_SAMPLES // GLOBAL_BATCH


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_packed(tmp_path_factory.mktemp("data"))


@pytest.fixture
def box(packed: Path) -> Iterator[ClusterBox]:
    with ClusterBox(2, shared=packed, link=Link(rate_mbit=500)) as built:
        yield built
    assert built.leftovers() == []


def _steps_logged(run_dir: Path, count: int) -> bool:
    try:
        return sum('"loss"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines()) >= count
    except OSError:
        return False


def _attempts(run_dir: Path) -> list[dict]:
    try:
        return hosts_record(run_dir)
    except (OSError, ValueError):
        return []


def _checkpointed_alone(run_dir: Path) -> bool:
    """Whether the 1-host world has written its first checkpoint (4 steps after its start)."""
    attempts = _attempts(run_dir)
    if len(attempts) != 2:
        return False
    due = attempts[1]["start_step"] + 4
    return any(r.get("event") == "checkpoint" and r["step"] == due for r in _metric_lines_so_far(run_dir))


def _metric_lines_so_far(run_dir: Path) -> list[dict]:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def _id_lines(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "logs").glob("ids-rank*-attempt*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kaisoku: error:")]


@pytest.mark.timeout(420)
def test_without_restarts_the_other_host_stops_naming_the_lost_one_and_resume_continues(
    box: ClusterBox, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = host_args(
        box, run_dir, "--nnodes", "2", "--rdzv-endpoint", ENDPOINT, "--checkpoint.every-steps", "4"
    )
    procs = start_hosts(box, args)
    assert wait_for(lambda: _steps_logged(run_dir, 6), 150)
    assert box.kill_host(1) >= 2  # its launcher and its rank
    [(code, _, stderr)] = finish(procs[:1], timeout=120)  # within --dist.timeout 60 and the teardown
    assert code == 6, stderr[-3000:]
    [line] = _error_lines(stderr)
    assert line.startswith("kaisoku: error: lost host kbox-node1 (rank 1): "), line
    assert "rerun with --resume auto to continue from checkpoint step" in stderr
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"

    resumed = finish(start_hosts(box, [*args, "--resume", "auto"]), timeout=240)
    assert [code for code, _, _ in resumed] == [0, 0], resumed[0][2][-3000:] + resumed[1][2][-3000:]
    lines = metric_lines(run_dir)
    steps = [r["step"] for r in lines if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 2 * STEPS_PER_EPOCH
    assert [r["event"] for r in lines if r.get("event") in ("resume", "world")] == [
        "world",
        "resume",
        "world",
    ]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_elastic_restarts_go_on_with_the_remaining_host_and_grow_back_when_it_returns(
    box: ClusterBox, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # The same command on every host, the host that comes back included (--resume auto: a fresh folder
    # starts afresh). The rank of the 1-host world holds after 4 steps until the lost host is back.
    args = host_args(
        box, run_dir, "--nnodes", "1:2", "--max-restarts", "1", "--rdzv-endpoint", ENDPOINT,
        "--checkpoint.every-steps", "4", "--resume", "auto",
    )  # fmt: skip
    args = [
        sys.executable,
        str(REPO / "tests" / "cluster" / "logged_train.py"),
        "--hold-below",
        "2:4",
        *args[4:],
    ]
    first, lost = start_hosts(box, args)
    assert wait_for(lambda: _steps_logged(run_dir, 6), 150)
    box.kill_host(1)
    lost.communicate(timeout=30)
    assert wait_for(lambda: _checkpointed_alone(run_dir), 150), _attempts(run_dir)
    [back] = start_hosts(box, args, hosts=[1])
    results = finish([first, back], timeout=300)
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    # The loss is a restart (one line); the return is a membership change, not counted against 1 restart.
    restart = [line for line in results[0][2].splitlines() if "restart" in line]
    assert len(restart) == 1 and restart[0].startswith("kaisoku: lost host kbox-node1 (rank 1): "), restart
    assert "restart 1 of 1" in restart[0]

    attempts = _attempts(run_dir)
    both, one = {"kbox-node0": [0], "kbox-node1": [1]}, {"kbox-node0": [0]}
    assert [(a["attempt"], a["world_size"], a["hosts"]) for a in attempts] == [
        (0, 2, both),
        (1, 1, one),
        (2, 2, both),
    ]
    lost_at, back_at = attempts[1]["start_step"], attempts[2]["start_step"]
    assert lost_at % 4 == 0 and back_at == lost_at + 4  # the 1-host world's own checkpoint
    changes = [
        f"world size 2 -> 1 (lost kbox-node1); 1 host continue from step {lost_at}",
        f"world size 1 -> 2 (joined kbox-node1); 2 hosts continue from step {back_at}",
    ]
    assert [a.get("change") for a in attempts] == [None, *changes]
    stdout = results[0][1]
    assert [line for line in stdout.splitlines() if line.startswith("kaisoku: world size")] == [
        f"kaisoku: {change}" for change in changes
    ]
    # Both restarts loaded their checkpoint: the resumed states are those of the steps recorded.
    assert [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", stdout)] == [lost_at, back_at]
    lines = metric_lines(run_dir)
    assert [(r["world_size"], r.get("change")) for r in lines if r.get("event") == "world"] == [
        (2, None),
        (1, changes[0]),
        (2, changes[1]),
    ]
    steps = [r["step"] for r in lines if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 2 * STEPS_PER_EPOCH
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"

    # Every epoch trains each sample once: of each attempt, the batches before the next attempt's start.
    starts = [a["start_step"] for a in attempts] + [2 * STEPS_PER_EPOCH]
    trained: dict[int, list[int]] = {}
    for r in _id_lines(run_dir):
        step = r["epoch"] * STEPS_PER_EPOCH + r["step"]
        if starts[r["attempt"]] <= step < starts[r["attempt"] + 1]:
            trained.setdefault(r["epoch"], []).extend(r["ids"])
    assert {epoch: sorted(ids) for epoch, ids in trained.items()} == {
        epoch: list(range(TRAIN_SAMPLES)) for epoch in range(2)
    }
