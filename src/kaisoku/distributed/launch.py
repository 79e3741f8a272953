"""Starting the ranks of one node through torchrun's own launcher (``torch.distributed.run``).

``kaisoku train`` outside torchrun or a Slurm step with more than one rank calls :func:`launch_local`,
which runs torchrun's parser and ``run`` in this process: the same elastic agent, restarts and failure
reports as the ``torchrun`` command, without a launcher of kaisoku's own. On one host it runs with
``--standalone``; across hosts (a :class:`Rendezvous`) every host runs the same command, and torchrun's
c10d rendezvous at ``--rdzv-endpoint`` (or its static one, with ``--node-rank``) joins them.

With an elastic host count (``--nnodes MIN:MAX``) the hosts that survive a lost one restart their ranks at
the smaller size (a restart counted against ``--max-restarts``), and a host whose launcher starts again
while the run goes on waits in the rendezvous; torchrun's agents see it waiting and restart every rank at
the larger size (a membership change, not counted). Each host's agent counts its own restarts, so a host
that joins late starts at 0 where the others are at 1: the ranks take their attempt from the rendezvous
round instead (:data:`ROUND_ENV`, :func:`adopt_rendezvous_round`), one number for every host of a round.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kaisoku.errors import ConfigError

#: Set in the ranks to the launcher's pid: a rank whose launcher has gone stops (see die_with_launcher).
LAUNCHER_PID_ENV = "KAISOKU_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
#: Set in the ranks to the rendezvous round they were started in (0: the first); alike on every host.
ROUND_ENV = "KAISOKU_RDZV_ROUND"
#: torchrun's restart count in a rank, which kaisoku reads as the rank's attempt.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


DEFAULT_RDZV_PORT = 29400
#: Seconds the c10d rendezvous waits for more hosts once MIN have joined (torchrun's default is 30): the
#: part of a lost host's recovery spent waiting for hosts that may come.
LAST_CALL_S = 5
#: torchrun's switch that makes rank 0 of each c10d round publish a fresh store address. With its default (one
#: store shared by every round) a host joining in a later round waits for an address that rank 0 published
#: in an earlier round only, and the join times out; so kaisoku turns the sharing off across hosts.
UNSHARED_STORE_ENV = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


@dataclass(frozen=True)
class RendezvousTiming:
    """The c10d rendezvous's clocks: a host is dropped after ``heartbeat_misses`` heartbeats of
    ``heartbeat_s`` seconds missed (torchrun's defaults, 5 s and 3), and a round waits ``last_call_s`` for
    more hosts once MIN have joined. Shorter clocks suit a box of hosts on one machine, not a cluster."""

    heartbeat_s: int = 5
    heartbeat_misses: int = 3
    last_call_s: int = LAST_CALL_S

    def rdzv_conf(self) -> str:
        """The clocks as ``--rdzv-conf`` entries."""
        return (
            f"last_call_timeout={self.last_call_s},keep_alive_interval={self.heartbeat_s},"
            f"keep_alive_max_attempt={self.heartbeat_misses}"
        )


#: The clocks of ``kaisoku train``'s rendezvous.
DEFAULT_TIMING = RendezvousTiming()


def node_counts(nnodes: str) -> tuple[int, int]:
    """``dist.nnodes`` (``N`` or ``MIN:MAX``) as (MIN, MAX); ConfigError naming the field otherwise."""
    parts = str(nnodes).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low, high = 0, 0
    if not 1 <= low <= high:
        raise ConfigError(f"dist.nnodes must be N or MIN:MAX with 1 <= MIN <= MAX (got '{nnodes}')")
    return low, high


@dataclass(frozen=True)
class Rendezvous:
    """How the hosts of a multi-host run find each other (torchrun's rendezvous)."""

    nnodes: str
    """N or MIN:MAX hosts."""
    endpoint: str
    """HOST:PORT every host can reach."""
    run_id: str
    """The same on every host of one run (derived from the run folder)."""
    node_rank: int = -1
    """This host's index for the static rendezvous; -1: c10d assigns it."""
    join_timeout: float = 600.0
    """Seconds a host waits for the others to join."""
    timing: RendezvousTiming = RendezvousTiming()
    """Heartbeats and last call of the c10d rendezvous."""

    def agent_env(self) -> dict[str, str]:
        """What torchrun's agent needs in its environment for this rendezvous (see UNSHARED_STORE_ENV)."""
        return dict([UNSHARED_STORE_ENV]) if self.node_rank < 0 else {}

    def torchrun_args(self) -> list[str]:
        """The rendezvous flags of the torchrun command line."""
        if self.node_rank >= 0:
            host, port = self.endpoint.rsplit(":", 1)
            return [
                f"--nnodes={self.nnodes}",
                f"--node-rank={self.node_rank}",
                "--rdzv-backend=static",
                f"--master-addr={host}",
                f"--master-port={port}",
            ]
        return [
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf=join_timeout={int(self.join_timeout)},{self.timing.rdzv_conf()}",
        ]


def rendezvous_for(
    nnodes: str,
    node_rank: int,
    endpoint: str,
    *,
    run_id: str,
    join_timeout: float,
    timing: RendezvousTiming = DEFAULT_TIMING,
) -> Rendezvous | None:
    """The rendezvous of ``dist.nnodes`` / ``dist.node_rank`` / ``dist.rdzv_endpoint``; None for one host.

    Refuses (ConfigError, one line) what torchrun would fail on later: no endpoint across hosts, a node
    rank outside the host count, or a node rank with an elastic MIN:MAX (static rendezvous is fixed).
    """
    low, high = node_counts(nnodes)
    if high == 1:
        if node_rank > 0:
            raise ConfigError(f"dist.node_rank is {node_rank} but dist.nnodes is 1; set --nnodes")
        return None
    if not endpoint:
        raise ConfigError(
            f"dist.nnodes is {nnodes} but dist.rdzv_endpoint is empty; set --rdzv-endpoint HOST[:PORT] to "
            "an address of one host (the same on every host)"
        )
    if node_rank >= 0 and low != high:
        raise ConfigError(
            f"dist.node_rank needs a fixed dist.nnodes, not {nnodes}; leave --node-rank out for elastic runs"
        )
    if node_rank >= high:
        raise ConfigError(f"dist.node_rank is {node_rank} but there are {high} hosts (0 to {high - 1})")
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    if port and not port.isdigit():
        raise ConfigError(f"dist.rdzv_endpoint must be HOST[:PORT] (got '{endpoint}')")
    address = f"{host}:{port or DEFAULT_RDZV_PORT}"
    return Rendezvous(
        nnodes=f"{low}:{high}" if low != high else str(high),
        endpoint=address,
        run_id=run_id,
        node_rank=node_rank,
        join_timeout=join_timeout,
        timing=timing,
    )


@dataclass(frozen=True)
class RankFailure:
    """A rank that failed and how: ``signal SIGKILL`` or ``exit code 1``."""

    rank: int
    how: str
    signal: bool = False
    """True when a signal ended it (it could not say why itself)."""
    exit_code: int = 1
    """The rank's exit code, where it exited rather than being killed."""


@dataclass(frozen=True)
class LaunchResult:
    """How the ranks ended: every failure the launcher saw (first first), or an interrupt."""

    failures: tuple[RankFailure, ...] = ()
    interrupted: bool = False
    stop_signal: int = 0
    """The signal (SIGTERM, SIGUSR1) this launcher got and passed on to its ranks as SIGUSR1 (0: none)."""

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
        code = 1 if killed else int(failure.exitcode)
        out.append(RankFailure(rank=rank, how=how, signal=killed, exit_code=code))
    return tuple(out)


def _rendezvous_round(handler: Any) -> int | None:
    """The round of torchrun's c10d (dynamic) rendezvous just completed; None for a static rendezvous.

    torchrun keeps the round in the handler's state and passes it to no rank, so it is read there.
    """
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    value = getattr(state, "round", None)
    return value if isinstance(value, int) else None


@contextlib.contextmanager
def _watch_agent(on_restart: Callable[[tuple[RankFailure, ...], int], None] | None) -> Iterator[None]:
    """Hook torchrun's agent for the duration of the launch.

    After each rendezvous the round goes into :data:`ROUND_ENV`, which the ranks started next inherit.
    ``on_restart(failures, restart)`` is called each time the agent is about to restart failed ranks: it
    decides that right after a monitoring pass finds failed ranks while restarts remain, and only logs it.
    """
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original_monitor = LocalElasticAgent._monitor_workers
    original_rendezvous = SimpleElasticAgent._rendezvous

    def rendezvous(agent: Any, worker_group: Any) -> None:
        original_rendezvous(agent, worker_group)
        round_number = _rendezvous_round(worker_group.spec.rdzv_handler)
        if round_number is None:
            os.environ.pop(ROUND_ENV, None)
        else:
            os.environ[ROUND_ENV] = str(round_number)

    def monitored(agent: Any, worker_group: Any) -> Any:
        result = original_monitor(agent, worker_group)
        remaining = getattr(agent, "_remaining_restarts", 0)
        if on_restart is not None and result.is_failed() and remaining > 0:
            spec = worker_group.spec
            with contextlib.suppress(Exception):  # the report must not break the restart
                on_restart(_failures_of(result.failures), spec.max_restarts - remaining + 1)
        return result

    SimpleElasticAgent._rendezvous = rendezvous  # type: ignore[method-assign]
    LocalElasticAgent._monitor_workers = monitored  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimpleElasticAgent._rendezvous = original_rendezvous  # type: ignore[method-assign]
        LocalElasticAgent._monitor_workers = original_monitor  # type: ignore[method-assign]


def adopt_rendezvous_round() -> int:
    """In a rank started by :func:`launch_local`: take the rendezvous round as the rank's attempt; the attempt.

    The round replaces torchrun's own restart count in the rank's environment, where kaisoku reads the
    attempt (the key prefix of the ranks' store, the resume after a restart, the records), so that every
    host of a round agrees on it: a host that rejoins a running run has restarted nothing itself. Without
    a round (a static rendezvous, ranks not started by kaisoku) the restart count stays.
    """
    round_number = os.environ.get(ROUND_ENV, "")
    if round_number.isdigit():
        os.environ[RESTART_COUNT_ENV] = round_number
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)


def die_with_launcher() -> None:
    """In a rank started by :func:`launch_local`: get SIGTERM when the launcher dies (Linux parent-death
    signal), so that a killed launcher leaves no rank training on its own; exit now if it is already gone.

    SIGTERM, not SIGKILL: the rank leaves through Python and removes its temp files on the way.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher:
        return
    _on_parent_death(signal.SIGTERM)
    if os.getppid() != int(launcher):  # it died before the signal was set up
        os.kill(os.getpid(), signal.SIGTERM)


def die_with_rank(worker_id: int = 0) -> None:
    """A loader worker's ``worker_init_fn``: get SIGKILL when the rank that started it dies, however it dies
    (a rank killed outright would otherwise leave its workers running, holding their memory). Workers hold
    nothing to clean up; their shared memory goes with the rank's RAM tier."""
    parent = os.getppid()
    _on_parent_death(signal.SIGKILL)
    if os.getppid() != parent:  # the rank died before the signal was set up
        os.kill(os.getpid(), signal.SIGKILL)


def _on_parent_death(signum: signal.Signals) -> None:
    """Ask Linux to send ``signum`` to this process when its parent thread ends (``PR_SET_PDEATHSIG``)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def launch_local(
    entry: Sequence[str],
    *,
    nproc: int,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    on_restart: Callable[[tuple[RankFailure, ...], int], None] | None = None,
    rendezvous: Rendezvous | None = None,
) -> LaunchResult:
    """Run ``entry`` (``["-m", "module", *args]`` or ``["script.py", *args]``) on ``nproc`` local ranks.

    ``rendezvous`` joins this host's ranks to those of the other hosts (each running the same call);
    None: this host alone (``--standalone``).

    torchrun has stopped every rank when this returns. ``OMP_NUM_THREADS`` defaults to the usable
    cores shared out among the ranks; ``env`` is added to the ranks' environment, with this process's
    pid (:func:`die_with_launcher`). ``on_restart(failures, restart)`` is called when a rank failed and
    torchrun restarts them (``max_restarts``). Ctrl-C (SIGINT) stops the ranks and returns ``interrupted``.
    SIGTERM or SIGUSR1 to the launcher (a time limit, a preemption) is passed on to the ranks as SIGUSR1:
    they finish their step, write a checkpoint and end (:mod:`kaisoku.engine.stop`).
    """
    cores = len(os.sched_getaffinity(0))
    # torchrun hands its ranks this process's environment: set what they need for the launch only, so that
    # a caller that goes on (a benchmark, a test process) does not pass the launcher's marks to later runs.
    saved_environ = dict(os.environ)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    os.environ.update(env or {})
    os.environ.update(rendezvous.agent_env() if rendezvous is not None else {})
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be set
    signals = (signal.SIGTERM, signal.SIGUSR1) if main_thread else ()
    previous = {sig: signal.signal(sig, _pass_stop_on) for sig in signals}
    _STOP_SIGNAL[0] = 0
    try:
        result = _run_torchrun(entry, nproc, max_restarts, on_restart, rendezvous)
        return dataclasses.replace(result, stop_signal=_STOP_SIGNAL[0])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(saved_environ)


_STOP_SIGNAL = [0]  # the signal _pass_stop_on got during the launch in progress


def _pass_stop_on(signum: int, frame: object) -> None:
    """The launcher's SIGTERM and SIGUSR1 handler: ask every rank it started (its child processes) to stop
    with a checkpoint; torchrun's agent goes on watching them end."""
    _STOP_SIGNAL[0] = signum
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            with contextlib.suppress(OSError):
                os.kill(int(child), signal.SIGUSR1)


def _run_torchrun(
    entry: Sequence[str],
    nproc: int,
    max_restarts: int,
    on_restart: Callable[[tuple[RankFailure, ...], int], None] | None,
    rendezvous: Rendezvous | None,
) -> LaunchResult:
    """torchrun's parser and ``run`` in this process (see :func:`launch_local`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    # torchrun's agent would turn SIGTERM into an immediate stop of every rank; kaisoku's own handler passes
    # it on instead (:func:`_pass_stop_on`).
    options = {option for action in parser._actions for option in action.option_strings}
    own_signals = ["--signals-to-handle=SIGINT,SIGHUP,SIGQUIT"] if "--signals-to-handle" in options else []
    torchrun_args = parser.parse_args(
        [
            *(rendezvous.torchrun_args() if rendezvous is not None else ["--standalone"]),
            *own_signals,
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
        with _watch_agent(on_restart):
            run(torchrun_args)
    except ChildFailedError as error:
        return LaunchResult(failures=_failures_of(error.failures))
    except (SignalException, KeyboardInterrupt):
        return LaunchResult(interrupted=True)
    return LaunchResult()
