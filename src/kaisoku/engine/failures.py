"""One voice for failures: each rank records why it stopped; the launcher prints one cause and one hint.

A rank started by kaisoku's launcher sends its stderr (and, off rank 0, its stdout) to
``RUN_DIR/logs/rank-N.log``; when it fails it writes the traceback there and a small JSON record
(``failure-rank-N.json``: class, cause, hint, step, time). The launcher picks the failure that
decided the run (the first rank to fail for a reason of its own; a rank that only lost its peer
yields to the peer that died), prints two lines and exits with the class's code. Without kaisoku's
launcher (one process, or an outside torchrun or srun) the rank prints the two lines itself.
"""

from __future__ import annotations

import json
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
from typing import Any

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


@dataclass
class Failure:
    """Why one rank stopped, as the user is told."""

    kind: str
    """Class: data, nonfinite, oom, peer, interrupt, stopped, error or unknown."""
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


def classify(
    error: BaseException, *, device: str = "", skip_corrupt: bool = False, data: str = ""
) -> Failure:
    """The failure class, cause line and hint of an exception raised on a rank."""
    message = str(error).strip()
    first = message.splitlines()[0] if message else ""
    if isinstance(error, KeyboardInterrupt):
        return Failure("interrupt", "interrupted")
    if isinstance(error, SystemExit):
        return Failure("stopped", "stopped by the launcher after another rank failed")
    if isinstance(error, NonFiniteError):
        return Failure(
            "nonfinite",
            message,
            "lower --optim.lr (or lengthen --sched.warmup-epochs), or set --train.on-nonfinite rollback",
            resumable=True,
        )
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
            "lower --data.global-batch, or raise --train.grad-accum (same global batch, smaller "
            "micro-batches)",
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


def redirect_to_log(run_dir: Path, rank: int, *, keep_stdout: bool) -> Path:
    """Send this process's stderr (and stdout unless ``keep_stdout``) to ``RUN_DIR/logs/rank-N.log``.

    File descriptors are redirected, so C++ messages (gloo, ``terminate called ...``) land there too.
    """
    path = log_dir(run_dir) / f"rank-{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
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


@contextmanager
def rank_failures(
    run_dir: Path,
    rank: int,
    *,
    step: Callable[[], int | None],
    device: Callable[[], str] = lambda: "",
    skip_corrupt: bool = False,
    data: str = "",
) -> Iterator[None]:
    """Record why this rank stops (traceback to its log, a failure record), then exit with the class's code.

    Under kaisoku's launcher the rank prints nothing on the terminal; else it prints the two lines.
    """
    record_path(run_dir, rank).unlink(missing_ok=True)
    try:
        yield
    except BaseException as error:
        failure = classify(error, device=device(), skip_corrupt=skip_corrupt, data=data)
        failure.rank, failure.host, failure.time = rank, socket.gethostname(), time.time()
        try:
            failure.step = step()
        except Exception:  # noqa: BLE001 - the step is a detail; the failure must still be recorded
            failure.step = None
        launched = os.environ.get(LAUNCHER_ENV) == "1"
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
            print_failure(failure, run_dir)
            if rank == 0:
                mark_run(
                    run_dir, status="failed", failure=failure.kind, cause=failure.cause, step=failure.step
                )
            raise SystemExit(failure.exit_code) from None
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave at once: gloo's and the loader's threads must not print or hang on the way out.
        os._exit(failure.exit_code)


def read_failures(run_dir: Path) -> list[Failure]:
    """Every rank's failure record, oldest first."""
    out: list[Failure] = []
    for path in sorted(log_dir(run_dir).glob("failure-rank-*.json")):
        try:
            out.append(Failure(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(out, key=lambda f: f.time)


def newest_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint in the run folder, if any."""
    names = sorted((run_dir / "checkpoints").glob("step-*.pt")) if (run_dir / "checkpoints").is_dir() else []
    return int(names[-1].stem.split("-")[1]) if names else None


def decide(records: list[Failure], died: list[tuple[int, str]], *, interrupted: bool) -> Failure:
    """The failure that decided the run.

    ``died`` lists (rank, how) of ranks killed by a signal, as the launcher saw them. A rank's own
    reason (data, divergence, memory, a bug) wins over a lost peer; a peer that died by a signal wins
    over the ranks that merely lost it.
    """
    if interrupted:
        steps = [r.step for r in records if r.step is not None]
        return Failure("interrupt", "interrupted", step=max(steps) if steps else None)
    own = [r for r in records if r.kind not in ("peer", "stopped", "interrupt")]
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


def print_failure(failure: Failure, run_dir: Path) -> None:
    """The two lines a user sees: the cause, then what to do (with the logs' folder)."""
    newest = newest_checkpoint_step(run_dir)
    at = f" (at step {failure.step})" if failure.step else ""
    if failure.kind == "interrupt":
        kept = f"checkpoint step {newest} is the newest" if newest is not None else "no checkpoint yet"
        cause = f"interrupted at step {failure.step}; {kept}" if failure.step else f"interrupted; {kept}"
    else:
        cause = failure.cause if failure.kind == "nonfinite" else f"{failure.cause}{at}"
    hints = [failure.hint] if failure.hint else []
    if failure.resumable or failure.kind == "interrupt":
        if newest is not None:
            hints.append(f"rerun with --resume auto to continue from checkpoint step {newest}")
        elif failure.kind in ("peer", "interrupt"):
            hints.append("rerun (there is no checkpoint to resume from yet)")
    hint = "; then ".join(hints)
    logs = f"full logs in {log_dir(run_dir)}"
    print(f"kaisoku: error: {cause}", file=sys.stderr)
    print(f"kaisoku: {hint}; {logs}" if hint else f"kaisoku: {logs}", file=sys.stderr)


def mark_run(run_dir: Path, **fields: Any) -> None:
    """Merge ``fields`` into ``RUN_DIR/run.json`` (status, cause, times), written atomically."""
    path = run_dir / "run.json"
    try:
        state = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        state = {}
    state.update(fields)
    try:
        atomic_write_text(path, json.dumps(state, indent=1))
    except OSError:
        pass  # the status file is a convenience; the exit code and the two lines carry the news


def report_launch(run_dir: Path, failures: list[tuple[int, str, bool]], *, interrupted: bool) -> int:
    """After the ranks of a launch ended badly: print the two lines, mark ``run.json``; the exit code.

    ``failures`` are (rank, how, killed by a signal) as the launcher saw them, first first.
    """
    died = [(rank, how) for rank, how, by_signal in failures if by_signal]
    failure = decide(read_failures(run_dir), died, interrupted=interrupted)
    if failure.kind == "unknown" and not read_failures(run_dir) and failures:
        rank, how, _ = failures[0]
        failure.cause = f"rank {rank} stopped ({how})"
    print_failure(failure, run_dir)
    mark_run(
        run_dir,
        status="failed",
        failure=failure.kind,
        cause=failure.cause,
        step=failure.step,
        ended=time.time(),
        exit_code=failure.exit_code,
    )
    return failure.exit_code


def clear_records(run_dir: Path) -> None:
    """Remove failure records of an earlier launch in this run folder."""
    if log_dir(run_dir).is_dir():
        for path in log_dir(run_dir).glob("failure-rank-*.json"):
            path.unlink(missing_ok=True)
