"""Starting the ranks of one node through torchrun's own launcher (``torch.distributed.run``).

``kaisoku train`` outside torchrun or a Slurm step with more than one rank calls :func:`launch_local`,
which runs torchrun's parser and ``run`` in this process with ``--standalone``: the same elastic agent,
restarts and failure reports as the ``torchrun`` command, without a launcher of kaisoku's own.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

#: Set in the ranks to the launcher's pid: a rank whose launcher has gone stops (see die_with_launcher).
LAUNCHER_PID_ENV = "KAISOKU_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


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


def _failures_of(failures: dict[int, Any]) -> tuple[RankFailure, ...]:
    """torchrun's ``{rank: ProcessFailure}`` as RankFailures, first first."""
    out = []
    for rank, failure in sorted(failures.items(), key=lambda item: item[1].timestamp):
        signal_name = failure.signal_name()
        killed = signal_name != "<N/A>"
        how = f"signal {signal_name}" if killed else f"exit code {failure.exitcode}"
        out.append(RankFailure(rank=rank, how=how, signal=killed))
    return tuple(out)


@contextlib.contextmanager
def _watch_restarts(on_restart: Callable[[tuple[RankFailure, ...], int], None] | None) -> Iterator[None]:
    """Call ``on_restart(failures, restart)`` each time torchrun's agent is about to restart the ranks.

    The agent decides a restart right after a monitoring pass finds failed ranks while restarts remain;
    it only logs it, so its monitoring method is wrapped for the duration of the launch.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._monitor_workers
    if on_restart is None:
        yield
        return

    def monitored(agent: Any, worker_group: Any) -> Any:
        result = original(agent, worker_group)
        remaining = getattr(agent, "_remaining_restarts", 0)
        if result.is_failed() and remaining > 0:
            spec = worker_group.spec
            with contextlib.suppress(Exception):  # the report must not break the restart
                on_restart(_failures_of(result.failures), spec.max_restarts - remaining + 1)
        return result

    LocalElasticAgent._monitor_workers = monitored  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]


def die_with_launcher() -> None:
    """In a rank started by :func:`launch_local`: get SIGTERM when the launcher dies (Linux parent-death
    signal), so that a killed launcher leaves no rank training on its own; exit now if it is already gone.

    SIGTERM, not SIGKILL: the rank leaves through Python and removes its temp files on the way.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != int(launcher):  # it died before the signal was set up
        os.kill(os.getpid(), signal.SIGTERM)


def launch_local(
    entry: Sequence[str],
    *,
    nproc: int,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    on_restart: Callable[[tuple[RankFailure, ...], int], None] | None = None,
) -> LaunchResult:
    """Run ``entry`` (``["-m", "module", *args]`` or ``["script.py", *args]``) on ``nproc`` local ranks.

    torchrun has stopped every rank when this returns. ``OMP_NUM_THREADS`` defaults to the usable
    cores shared out among the ranks; ``env`` is added to the ranks' environment, with this process's
    pid (:func:`die_with_launcher`). ``on_restart(failures, restart)`` is called when a rank failed and
    torchrun restarts them (``max_restarts``). Ctrl-C (SIGINT or SIGTERM to the launcher) stops the
    ranks and returns ``interrupted``.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    os.environ.update(env or {})
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
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
        with _watch_restarts(on_restart):
            run(torchrun_args)
    except ChildFailedError as error:
        return LaunchResult(failures=_failures_of(error.failures))
    except (SignalException, KeyboardInterrupt):
        return LaunchResult(interrupted=True)
    return LaunchResult()
