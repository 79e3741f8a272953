"""Starting the ranks of one node through torchrun's own launcher (``torch.distributed.run``).

``kaisoku train`` outside torchrun or a Slurm step with more than one rank calls :func:`launch_local`,
which runs torchrun's parser and ``run`` in this process with ``--standalone``: the same elastic agent,
restarts and failure reports as the ``torchrun`` command, without a launcher of kaisoku's own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankFailure:
    """The first rank that failed and how: ``signal SIGKILL`` or ``exit code 1``."""

    rank: int
    how: str


def launch_local(entry: Sequence[str], *, nproc: int, max_restarts: int = 0) -> RankFailure | None:
    """Run ``entry`` (``["-m", "module", *args]`` or ``["script.py", *args]``) on ``nproc`` local ranks.

    Returns None when every rank succeeded, else the first failure; torchrun has stopped every rank by
    then. ``OMP_NUM_THREADS`` defaults to the usable cores shared out among the ranks.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    torchrun_args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5",
            *entry,
        ]
    )
    # The agent's own log lines repeat what kaisoku reports in one line.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    try:
        run(torchrun_args)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        signal_name = failure.signal_name()
        how = f"signal {signal_name}" if signal_name != "<N/A>" else f"exit code {failure.exitcode}"
        return RankFailure(rank=rank, how=how)
    return None
