"""The Slurm example in docs/clusters.md (examples/slurm/train.sbatch) run in a cluster in a box: sbatch's environment
on the first host, srun's tasks on both, each task a rank that reads its place from SLURM_*."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from kaisoku.testing.cluster import ClusterBox, Link, unavailable_reason
from tests.cluster.box_runs import REPO, box_env, finish, host_args, hosts_record, make_packed, start_hosts

REASON = unavailable_reason()
# Slow tier: the sbatch script on two hosts in a cluster in a box.
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.slow]
SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"


def _srun_on_path(folder: Path) -> Path:
    """A folder holding an ``srun`` that runs tests/cluster/srun_shim.py."""
    folder.mkdir()
    srun = folder / "srun"
    srun.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO / "tests" / "cluster" / "srun_shim.py"} "$@"\n')
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    return folder


def test_the_readme_shows_the_sbatch_script() -> None:
    assert SCRIPT.read_text().strip() in (REPO / "docs" / "clusters.md").read_text()


@pytest.mark.timeout(300)
def test_the_sbatch_script_trains_on_two_hosts(tmp_path: Path) -> None:
    packed = make_packed(tmp_path / "data")
    run_dir = tmp_path / "run"
    with ClusterBox(2, shared=packed, link=Link(rate_mbit=500)) as box:
        # `sbatch --nodes=2 --ntasks-per-node=1 train.sbatch ARGS`: options on the command line win over
        # the script's #SBATCH lines, as in Slurm.
        job = {
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "kbox-node[0-1]",
            "SLURM_NNODES": "2",
            "SLURM_NTASKS_PER_NODE": "1",
            "KBOX_HOSTS": json.dumps([box.command(host, [], cwd=REPO) for host in range(2)]),
            "KBOX_ROOT_PID": str(os.getpid()),
            "RUN_DIR": str(run_dir),
        }
        path = f"{_srun_on_path(tmp_path / 'bin')}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
        env = box_env(**job, PATH=path + os.environ["PATH"])
        # The script's own arguments: what host_args adds after `kaisoku train --nproc 1 --run-dir RUN`.
        extra = host_args(box, run_dir, "--max-steps", "4")[8:]
        [(code, stdout, stderr)] = finish(
            start_hosts(box, ["bash", str(SCRIPT), *extra], hosts=[0], env=env), 240
        )
        assert code == 0, stderr[-3000:]
        assert f"run folder {run_dir}" in stdout
        attempts = hosts_record(run_dir)
    assert box.leftovers() == []
    assert attempts[0]["hosts"] == {"kbox-node0": [0], "kbox-node1": [1]}
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
