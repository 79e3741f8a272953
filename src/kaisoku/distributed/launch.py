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
    """A rank that failed and how: ``signal SIGKILL`` or ``exit code 1``."""

    rank: int
    how: str
    signal: bool = False
    """True when a signal ended it (it could not say why itself)."""


@dataclass(frozen=True)
class LaunchResult:
    """How the ranks ended: every failure the launcher saw (first first), or an interrupt."""

    failures: tuple[RankFailure, ...] = ()
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        """True when every rank succeeded."""
        return not self.failures and not self.interrupted


def launch_local(
    entry: Sequence[str], *, nproc: int, max_restarts: int = 0, env: dict[str, str] | None = None
) -> LaunchResult:
    """Run ``entry`` (``["-m", "module", *args]`` or ``["script.py", *args]``) on ``nproc`` local ranks.

    torchrun has stopped every rank when this returns. ``OMP_NUM_THREADS`` defaults to the usable
    cores shared out among the ranks; ``env`` is added to the ranks' environment. Ctrl-C (SIGINT or
    SIGTERM to the launcher) stops the ranks and returns ``interrupted``.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    os.environ.update(env or {})
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
    # torch's elastic modules set levels on their own loggers, so each is quietened by name.
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(torchrun_args)
    except ChildFailedError as error:
        failures = []
        for rank, failure in sorted(error.failures.items(), key=lambda item: item[1].timestamp):
            signal_name = failure.signal_name()
            killed = signal_name != "<N/A>"
            how = f"signal {signal_name}" if killed else f"exit code {failure.exitcode}"
            failures.append(RankFailure(rank=rank, how=how, signal=killed))
        return LaunchResult(failures=tuple(failures))
    except (SignalException, KeyboardInterrupt):
        return LaunchResult(interrupted=True)
    return LaunchResult()
