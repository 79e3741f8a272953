"""One voice for failures: each rank records why it stopped; the launcher prints one cause and one hint.

A rank started by kaisoku's launcher sends its stderr (and, off rank 0, its stdout) to
``RUN_DIR/logs/rank-N.log``; when it fails it writes the traceback there and a small JSON record
(``failure-rank-N.json``: class, cause, hint, step, time). The launcher picks the failure that
decided the run (the first rank to fail for a reason of its own; a rank that only lost its peer
yields to the peer that died), prints two lines and exits with the class's code. Without kaisoku's
launcher (one process, or an outside torchrun or srun) the rank prints the two lines itself.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn, TextIO

from kaisoku.data.node_cache.tier_dirs import NodeCacheError
from kaisoku.distributed.launch import LAUNCHER_PID_ENV
from kaisoku.distributed.sharded_checkpoint import UnreadableCheckpointError
from kaisoku.engine import hosts, stop
from kaisoku.engine.checkpoint import newest_step
from kaisoku.engine.divergence import NonFiniteError
from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_write_text

#: Set by the launcher in its ranks: they stay quiet on the terminal and leave the report to it.
LAUNCHER_ENV = "KAISOKU_LAUNCHED"

EXIT_CODES = {
    "error": 1,
    "unknown": 1,
    "data": 3,
    "nonfinite": 4,
    "oom": 5,
    "peer": 6,
    "stopped": 143,
    "interrupt": 130,
    "signal": stop.EXIT_CODE,
}
"""Exit code of ``kaisoku train`` for each failure class."""

_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Connection refused",
    "connectFullMesh",
    "Broken pipe",
    "DistBackendError",
    "NCCL error",
    "Timed out",
    "timed out",
)
_WRAPPED = re.compile(r"^(kaisoku\.[\w.]+)\.(\w+Error): (.+)$", re.MULTILINE)
# A loader worker stopped by the launcher's SIGTERM (to the rank's whole process group) in the teardown.
_WORKER_STOPPED = re.compile(r"DataLoader worker \(pid\(?s?\)? [\d, ]+\) is killed by signal: Terminated")
_STOP_SIGNALLED = [False]  # set by on_stop_signal: from then on, any error is the teardown's doing
_LAUNCHER_GONE = [False]  # set by on_stop_signal where the stop came from the launcher's death
_STOP_HELD: list[int | None] = [None]  # inside stop_held(): 0, or the stop signal that came meanwhile


@dataclass
class Failure:
    """Why one rank stopped, as the user is told."""

    kind: str
    """Class: data, nonfinite, oom, peer, interrupt, stopped, signal (stopped with a checkpoint by SIGTERM or
    SIGUSR1), error or unknown."""
    cause: str
    """One line: what happened."""
    hint: str = ""
    """One line: what to do (may be empty)."""
    resumable: bool = False
    """Whether ``--resume auto`` can help."""
    rank: int = 0
    host: str = ""
    step: int | None = None
    time: float = 0.0
    attempt: int = 0
    """The launcher's restart attempt (0: the first start) the rank failed in."""

    @property
    def exit_code(self) -> int:
        """The exit code of this class."""
        return EXIT_CODES.get(self.kind, 1)


def _data_hint(skip_corrupt: bool, data: str, cause: str) -> str:
    check = f"check the dataset with `kaisoku inspect {data or 'DATA'} --verify` and re-pack it"
    if skip_corrupt or "record" not in cause:  # skipping helps with damaged records only
        return check  # damaged records are skipped already; this one is beyond skipping
    return f"{check}, or set --data.skip-corrupt true to skip damaged records"


def _data_cause(message: str) -> str:
    # The data layer's messages end in "; what to do": the hint line says that, once.
    return message.strip().splitlines()[0].split("; ")[0]


def _from_data_code(error: BaseException) -> bool:
    if type(error).__module__.startswith("kaisoku.data"):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"kaisoku{os.sep}data{os.sep}" in frames[-1].filename


def on_stop_signal(signum: int, frame: object) -> None:
    """SIGTERM handler of a rank: the launcher stops it after another rank failed; leave through Python.

    Remembered, so that what the stop breaks on the way out (a loader worker killed by the same
    signal, a peer's closed connection) is not taken for this rank's own failure.
    """
    _STOP_SIGNALLED[0] = True
    _LAUNCHER_GONE[0] = launcher_gone()
    if _STOP_HELD[0] is not None:
        _STOP_HELD[0] = signum
        return
    raise SystemExit(128 + signum)


@contextmanager
def stop_held() -> Iterator[None]:
    """Hold a stop signal that arrives inside the block until the block has run to its end, then leave.

    For cleanup on the way out (removing the RAM tier): a signal delivered late (the main thread was in a
    collective that the stopping peers broke) must not cut it off half way. An exception already leaving
    the block goes on as it is; the signal is remembered for its classification either way.
    """
    _STOP_HELD[0] = 0
    leaving = True
    try:
        yield
        leaving = False
    finally:
        signum, _STOP_HELD[0] = _STOP_HELD[0], None
        if signum and not leaving:
            raise SystemExit(128 + signum)


def launcher_gone() -> bool:
    """Whether this rank's kaisoku launcher has died: this rank was handed to another parent, or the
    launcher's process is gone or a zombie."""
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    if not launcher.isdigit():
        return False
    if os.getppid() != int(launcher):
        return True
    try:
        state = Path(f"/proc/{launcher}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def classify(
    error: BaseException,
    *,
    device: str = "",
    skip_corrupt: bool = False,
    data: str = "",
    on_nonfinite: str = "stop",
) -> Failure:
    """The failure class, cause line and hint of an exception raised on a rank.

    ``skip_corrupt`` and ``on_nonfinite`` are the run's settings, so that no hint suggests what is set.
    """
    message = str(error).strip()
    first = message.splitlines()[0] if message else ""
    if isinstance(error, KeyboardInterrupt):
        return Failure("interrupt", "interrupted")
    if isinstance(error, stop.StoppedBySignal):
        return Failure("signal", message, resumable=True, step=error.step)
    stopped = _STOP_SIGNALLED[0] or _WORKER_STOPPED.search(message) is not None
    if stopped or any(isinstance(link, SystemExit) for link in _chain(error)):
        if _LAUNCHER_GONE[0] or launcher_gone():
            return Failure("stopped", "stopped because its launcher died (killed)")
        return Failure("stopped", "stopped by the launcher after another rank failed")
    if isinstance(error, NonFiniteError):
        remedy = "lower --optim.lr (or lengthen --sched.warmup-epochs)"
        if on_nonfinite != "rollback":
            remedy += ", or set --train.on-nonfinite rollback"
        return Failure("nonfinite", message, remedy, resumable=True)
    if isinstance(error, NodeCacheError):  # a directory of the node cache, not the dataset
        return Failure("error", first)
    if isinstance(error, UnreadableCheckpointError):  # damaged data: the checkpoint's own remedy follows
        return Failure("data", first)
    # A DataLoader worker's exception comes back wrapped, with the original type in its text.
    wrapped = _WRAPPED.findall(message) if "DataLoader worker" in message else []
    if wrapped and wrapped[-1][0].startswith("kaisoku"):
        cause = _data_cause(wrapped[-1][2])
        return Failure("data", cause, _data_hint(skip_corrupt, data, cause))
    if isinstance(error, KaisokuError):
        if _from_data_code(error):
            cause = _data_cause(first)
            return Failure("data", cause, _data_hint(skip_corrupt, data, cause))
        return Failure("error", first)
    oom = isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"
    if oom or "can't allocate memory" in message or "out of memory" in first.lower():
        return Failure(
            "oom",
            f"out of memory on {device or 'this device'}",
            "raise --train.grad-accum (same global batch, smaller micro-batches), or lower "
            "--data.global-batch in a new --run-dir",
            resumable=True,
        )
    if type(error).__name__ == "DistBackendError" or any(sign in message for sign in _PEER_SIGNS):
        return Failure(
            "peer",
            f"lost contact with another rank ({first[:160]})",
            "",
            resumable=True,
        )
    return Failure("unknown", f"{type(error).__name__}: {first[:300]}")


def log_dir(run_dir: Path) -> Path:
    """Where the ranks' logs and failure records go."""
    return run_dir / "logs"


def record_path(run_dir: Path, rank: int) -> Path:
    """The failure record of ``rank``."""
    return log_dir(run_dir) / f"failure-rank-{rank}.json"


class _TerminalWarnings(logging.Handler):
    """kaisoku's warnings on the terminal as ``kaisoku: warning: ...`` (one line each), besides the log."""

    def __init__(self, terminal: TextIO) -> None:
        super().__init__(logging.WARNING)
        self.terminal = terminal

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = " ".join(record.getMessage().split())  # one line, however the message was written
            self.terminal.write(f"kaisoku: warning: {text}\n")
            self.terminal.flush()
        except Exception:  # noqa: BLE001 - a closed terminal must not stop training
            self.handleError(record)


def warnings_to_terminal(terminal: TextIO) -> None:
    """Show the warnings of kaisoku's loggers (node cache, staging, loader) on ``terminal`` too.

    Under the launcher the rank's stderr is its log; the warning then goes to both.
    """
    logger = logging.getLogger("kaisoku")
    logger.handlers = [h for h in logger.handlers if not isinstance(h, _TerminalWarnings)]
    logger.addHandler(_TerminalWarnings(terminal))
    if terminal is not sys.stderr:
        log_handler = logging.StreamHandler(sys.stderr)
        log_handler.setLevel(logging.WARNING)
        logger.addHandler(log_handler)
    logger.propagate = False  # the root's last-resort handler would print each warning a second time


def redirect_to_log(run_dir: Path, rank: int, *, keep_stdout: bool) -> Path:
    """Send this process's stderr (and stdout unless ``keep_stdout``) to ``RUN_DIR/logs/rank-N.log``.

    File descriptors are redirected, so C++ messages (gloo, ``terminate called ...``) land there too.
    With ``keep_stdout`` (rank 0) kaisoku's warnings still reach the terminal's stderr.
    """
    path = log_dir(run_dir) / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if keep_stdout:
        warnings_to_terminal(os.fdopen(os.dup(2), "w", encoding="utf-8", errors="replace"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    if not keep_stdout:
        os.dup2(fd, 1)
    os.close(fd)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(
        f"=== kaisoku rank {rank} on {socket.gethostname()}, {stamp}, restart {restart} ===", file=sys.stderr
    )
    return path


def restart_attempt() -> int:
    """The launcher's restart attempt this rank belongs to (0: the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


@contextmanager
def rank_failures(
    run_dir: Path,
    rank: int,
    *,
    step: Callable[[], int | None],
    device: Callable[[], str] = lambda: "",
    skip_corrupt: bool = False,
    data: str = "",
    on_nonfinite: str = "stop",
    resume: str = "",
) -> Iterator[None]:
    """Record why this rank stops (traceback to its log, a failure record), then exit with the class's code.

    Under kaisoku's launcher the rank prints nothing on the terminal; else it prints the two lines.
    ``skip_corrupt``, ``on_nonfinite`` and ``resume`` are the run's settings (no hint suggests them again).
    """
    launched = os.environ.get(LAUNCHER_ENV) == "1"
    if not launched:  # the launcher clears the records at launch and keeps those of restarted attempts
        record_path(run_dir, rank).unlink(missing_ok=True)
    try:
        yield
    except BaseException as error:
        failure = classify(
            error, device=device(), skip_corrupt=skip_corrupt, data=data, on_nonfinite=on_nonfinite
        )
        failure.rank, failure.host, failure.time = rank, socket.gethostname(), time.time()
        failure.attempt = restart_attempt()
        try:
            failure.step = step() if failure.step is None else failure.step
        except Exception:  # noqa: BLE001 - the step is a detail; the failure must still be recorded
            failure.step = None
        if launched:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's stop must not cut this short
            traceback.print_exc()  # stderr is the rank's log under the launcher
        try:
            if not launched:
                log = log_dir(run_dir) / f"rank-{rank}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                with log.open("a", encoding="utf-8") as handle:
                    handle.write(traceback.format_exc())
            atomic_write_text(record_path(run_dir, rank), json.dumps(asdict(failure)))
        except OSError:
            pass  # an unwritable run folder: the exit code still tells the class
        if not launched:
            print_failure(failure, run_dir, resume=resume)
            if rank == 0:
                mark_ended(run_dir, failure)
            raise SystemExit(failure.exit_code) from None
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave at once: gloo's and the loader's threads must not print or hang on the way out. A stop on a
        # signal leaves as a success, so that torchrun restarts nothing; the launcher reads the record.
        os._exit(0 if failure.kind == "signal" else failure.exit_code)


def leave_finished_rank() -> NoReturn:
    """End a rank process whose training finished: every function registered to run at exit runs (the
    loader's workers are stopped, logs flushed), then the process leaves without tearing the interpreter
    down. Torch's threads can abort that teardown ("terminate called without an active exception", seen
    under load after a sharded run), which would turn a finished rank into one that died."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_record(run_dir: Path, failure: Failure) -> None:
    """Write ``failure`` as its rank's record (the launcher's, for a rank that died without a word)."""
    try:
        atomic_write_text(record_path(run_dir, failure.rank), json.dumps(asdict(failure)))
    except OSError:
        pass  # an unwritable run folder: the terminal line still says it


def read_failures(run_dir: Path, *, latest_attempt: bool = False) -> list[Failure]:
    """Every rank's failure record, oldest first; only the last restart attempt's with ``latest_attempt``."""
    out: list[Failure] = []
    for path in sorted(log_dir(run_dir).glob("failure-rank-*.json")):
        try:
            out.append(Failure(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    if latest_attempt and out:
        last = max(f.attempt for f in out)
        out = [f for f in out if f.attempt == last]
    return sorted(out, key=lambda f: f.time)


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint in the run folder (a file or a sharded folder), if any."""
    return newest_step(run_dir / "checkpoints")


def decide(records: list[Failure], died: list[tuple[int, str]], *, interrupted: bool) -> Failure:
    """The failure that decided the run.

    ``died`` lists (rank, how) of ranks killed by a signal, as the launcher saw them. A rank's own
    reason (data, divergence, memory, a bug) wins over a lost peer; a peer that died by a signal wins
    over the ranks that merely lost it.
    """
    if interrupted:
        steps = [r.step for r in records if r.step is not None]
        return Failure("interrupt", "interrupted", step=max(steps) if steps else None)
    own = [r for r in records if r.kind not in ("peer", "stopped", "interrupt", "signal")]
    if own:
        return own[0]
    steps = [r.step for r in records if r.step is not None]
    step = max(steps) if steps else None
    if died:
        rank, how = died[0]
        return Failure(
            "peer",
            f"rank {rank} on {socket.gethostname()} died ({how})",
            "",
            resumable=True,
            rank=rank,
            step=step,
        )
    if records:
        return records[0]
    return Failure("unknown", "a rank stopped without saying why", step=step)


def print_failure(failure: Failure, run_dir: Path, *, resume: str = "") -> None:
    """The two lines a user sees: the cause, then what to do (with the logs' folder).

    ``resume`` is the run's ``--resume``: a rerun with ``--resume auto`` already set is the same command.
    """
    newest = newest_checkpoint_step(run_dir)
    at = f" (at step {failure.step})" if failure.step else ""
    if failure.kind == "interrupt":
        kept = f"checkpoint step {newest} is the newest" if newest is not None else "no checkpoint yet"
        cause = f"interrupted at step {failure.step}; {kept}" if failure.step else f"interrupted; {kept}"
    else:
        cause = failure.cause if failure.kind in ("nonfinite", "signal") else f"{failure.cause}{at}"
    hints = [failure.hint] if failure.hint else []
    if failure.resumable or failure.kind == "interrupt":
        rerun = "rerun the same command" if resume == "auto" else "rerun with --resume auto"
        if newest is not None:
            hints.append(f"{rerun} to continue from checkpoint step {newest}")
        elif failure.kind in ("peer", "interrupt"):
            hints.append(f"{rerun} (there is no checkpoint yet: it starts over)")
    hint = "; then ".join(hints)
    logs = f"full logs in {log_dir(run_dir)}"
    print(f"kaisoku: {'' if failure.kind == 'signal' else 'error: '}{cause}", file=sys.stderr)
    print(f"kaisoku: {hint}; {logs}" if hint else f"kaisoku: {logs}", file=sys.stderr)


def start_run(run_dir: Path, **fields: Any) -> None:
    """Begin ``RUN_DIR/run.json`` afresh for a starting run: ``running`` with ``fields`` (owner, times);
    what an earlier run of the folder recorded (its status, cause) is replaced."""
    try:
        atomic_write_text(
            run_dir / "run.json", json.dumps({"status": "running", "ended": None, **fields}, indent=1)
        )
    except OSError:
        pass  # the status file is a convenience; the exit code and the two lines carry the news


def mark_run(run_dir: Path, **fields: Any) -> None:
    """Merge ``fields`` into ``RUN_DIR/run.json`` (status, cause, times), written atomically."""
    path = run_dir / "run.json"
    try:
        state = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        state = {}
    if fields.get("status") in ("running", "completed"):
        # A run that goes on (an elastic restart after a rank died) or ends well no longer carries the
        # cause of an earlier attempt's failure; that history stays in the failure records.
        for stale in ("failure", "cause", "exit_code"):
            state.pop(stale, None)
    state.update(fields)
    try:
        atomic_write_text(path, json.dumps(state, indent=1))
    except OSError:
        pass  # the status file is a convenience; the exit code and the two lines carry the news


def mark_ended(run_dir: Path, failure: Failure, **fields: Any) -> None:
    """Record in ``run.json`` how the run ended: ``failed`` (``stopped`` on a signal, its checkpoint written),
    the failure's class, cause and step, the time, and ``fields``."""
    mark_run(
        run_dir,
        status="stopped" if failure.kind == "signal" else "failed",
        failure=failure.kind,
        cause=failure.cause,
        step=failure.step,
        ended=time.time(),
        **fields,
    )


def report_launch(
    run_dir: Path,
    failures: list[tuple[int, str, bool]],
    *,
    interrupted: bool,
    resume: str = "",
    stop_signal: int = 0,
) -> int:
    """After the ranks of a launch ended badly, or stopped on a signal: print the two lines, mark
    ``run.json``; the exit code.

    ``failures`` are (rank, how, killed by a signal) as the launcher saw them, first first; the records
    of the last restart attempt decide (earlier attempts' records stay as their history). ``stop_signal``:
    the signal the launcher got and passed on to the ranks as SIGUSR1 (the line names the one sent).
    """
    died = [(rank, how) for rank, how, by_signal in failures if by_signal]
    records = read_failures(run_dir, latest_attempt=True)
    failure = decide(records, died, interrupted=interrupted)
    if failure.kind == "signal" and stop_signal:
        passed_on = f"stopped by {stop.signal_name(signal.SIGUSR1)} "
        failure.cause = failure.cause.replace(passed_on, f"stopped by {stop.signal_name(stop_signal)} ", 1)
    if failure.kind == "peer":
        failure.cause = hosts.name_lost_host(run_dir, failure.cause)
    if failure.kind == "unknown" and not records and failures:
        rank, how, _ = failures[0]
        failure.cause = f"rank {rank} stopped ({how})"
    print_failure(failure, run_dir, resume=resume)
    mark_ended(run_dir, failure, exit_code=failure.exit_code)
    return failure.exit_code


def report_restart(run_dir: Path, failures: list[tuple[int, str, bool]], *, restart: int, limit: int) -> None:
    """A restart (``--max-restarts``) begins: one line naming what died, and its failure record.

    ``failures`` are (rank, how, killed by a signal) of the attempt that just failed; ``restart`` counts
    from 1. A rank that said why it stopped keeps its own record and cause.
    """
    if not failures:
        return
    rank, how, by_signal = failures[0]
    own = {f.rank: f for f in read_failures(run_dir) if f.attempt == restart - 1}
    if by_signal or rank not in own:
        failure = Failure(
            "peer",
            f"rank {rank} on {socket.gethostname()} died ({how})"
            if by_signal
            else f"rank {rank} stopped ({how})",
            resumable=True,
            rank=rank,
            host=socket.gethostname(),
            time=time.time(),
            attempt=restart - 1,
        )
        write_record(run_dir, failure)
        cause = failure.cause
    elif own[rank].kind == "peer":
        cause = hosts.name_lost_host(run_dir, own[rank].cause)
    else:
        cause = f"rank {rank} failed: {own[rank].cause}"
    newest = newest_checkpoint_step(run_dir)
    start = f"checkpoint step {newest}" if newest is not None else "step 0 (no checkpoint yet)"
    print(
        f"kaisoku: {cause}; restart {restart} of {limit} continues from {start}", file=sys.stderr, flush=True
    )
    mark_run(run_dir, restarts=restart, last_restart_cause=cause)


def clear_records(run_dir: Path) -> None:
    """Remove failure records of an earlier launch in this run folder."""
    if log_dir(run_dir).is_dir():
        for path in log_dir(run_dir).glob("failure-rank-*.json"):
            path.unlink(missing_ok=True)
