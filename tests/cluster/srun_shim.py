"""``srun`` for a cluster in a box: starts the step's tasks on every host with Slurm's task environment.

Stands in for Slurm's srun (which reaches the other nodes through slurmd): the job's hosts are given in
``KBOX_HOSTS`` as one JSON list of command prefixes (``ClusterBox.command(host, [])``), the job's shape in
``SLURM_NNODES`` and ``SLURM_NTASKS_PER_NODE``, and ``KBOX_ROOT_PID`` is a process in the machine's own
namespaces (the test's). Each task gets ``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NODEID``, ``SLURM_NTASKS`` and ``SLURM_STEP_ID``; the exit code is the first failing task's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    prefixes = json.loads(os.environ["KBOX_HOSTS"])
    nodes = int(os.environ["SLURM_NNODES"])
    per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
    tasks = []
    for node in range(nodes):
        for local in range(per_node):
            env = dict(
                os.environ,
                SLURM_PROCID=str(node * per_node + local),
                SLURM_LOCALID=str(local),
                SLURM_NODEID=str(node),
                SLURM_NTASKS=str(nodes * per_node),
                SLURM_STEP_ID="0",
            )
            # From the batch host back to the machine's own namespaces, then into the task's host.
            root = os.environ["KBOX_ROOT_PID"]
            command = ["nsenter", "-t", root, "-m", "-n", "-u", "--", *prefixes[node], *argv]
            tasks.append(subprocess.Popen(command, env=env))
    codes = [task.wait(timeout=600) for task in tasks]
    return next((code for code in codes if code != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
