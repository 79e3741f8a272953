"""Losing a host in a cluster in a box: every rank of one host killed mid-epoch.

Without restarts the other host stops with one line naming the lost host, and ``--resume auto`` continues.
With ``--nnodes 1:2 --max-restarts`` the remaining host goes on (elastic), the world-size change is one
line, and over the interrupted epoch every sample is trained exactly once from the checkpoint on.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kaisoku.testing.cluster import ClusterBox, Link, unavailable_reason
from tests.cluster.box_runs import ENDPOINT, REPO, finish, host_args, hosts_record, make_packed, start_hosts
from tests.train_harness import metric_lines, wait_for

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
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


@pytest.mark.timeout(420)
def test_elastic_restart_goes_on_with_the_remaining_host_covering_every_sample_once(
    box: ClusterBox, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    args = host_args(
        box, run_dir, "--nnodes", "1:2", "--max-restarts", "2", "--rdzv-endpoint", ENDPOINT,
        "--checkpoint.every-steps", "4",
    )  # fmt: skip
    args = [sys.executable, str(REPO / "tests" / "cluster" / "logged_train.py"), *args[4:]]
    procs = start_hosts(box, args)
    assert wait_for(lambda: _steps_logged(run_dir, 6), 150)
    box.kill_host(1)
    [(code, stdout, stderr)] = finish(procs[:1], timeout=300)
    assert code == 0, stderr[-3000:]
    restart = [line for line in stderr.splitlines() if "restart 1 of 2" in line]
    assert len(restart) == 1 and restart[0].startswith("kaisoku: lost host kbox-node1 (rank 1): "), stderr
    attempts = hosts_record(run_dir)
    assert [(a["world_size"], a["hosts"]) for a in attempts] == [
        (2, {"kbox-node0": [0], "kbox-node1": [1]}),
        (1, {"kbox-node0": [0]}),
    ]
    resumed_at = attempts[1]["start_step"]
    change = [line for line in stdout.splitlines() if line.startswith("kaisoku: world size")]
    assert change == [f"kaisoku: world size 2 -> 1 (lost kbox-node1); 1 host continue from step {resumed_at}"]

    # Sample coverage over the interrupted epoch: the batches before the checkpoint (first attempt, both
    # ranks) and from it on (second attempt, one rank) hold every training sample exactly once.
    epoch, first_step = divmod(resumed_at, STEPS_PER_EPOCH)
    logged = [
        json.loads(line)
        for path in sorted((run_dir / "logs").glob("ids-rank*-attempt*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    before = [
        i
        for r in logged
        if (r["attempt"], r["epoch"]) == (0, epoch) and r["step"] < first_step
        for i in r["ids"]
    ]
    after = [i for r in logged if (r["attempt"], r["epoch"]) == (1, epoch) for i in r["ids"]]
    assert min(r["step"] for r in logged if (r["attempt"], r["epoch"]) == (1, epoch)) == first_step
    assert len(before) == first_step * GLOBAL_BATCH
    assert sorted(before + after) == list(range(TRAIN_SAMPLES))
    steps = [r["step"] for r in metric_lines(run_dir) if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 2 * STEPS_PER_EPOCH
