"""Stopping on a signal with a checkpoint: what a time limit or a preemption sends loses no work.

Slurm sends SIGTERM at a job's time limit (SIGKILL follows after its KillWait) and on preemption, and
``sbatch --signal=USR1@120`` sends SIGUSR1 ahead of the limit. A rank that gets either (SIGTERM only where
no launcher uses it to stop ranks: kaisoku's launcher and torchrun stop the ranks of a failed run with it)
only notes it; between steps the ranks agree that one of them was signalled (:meth:`Trainer.stop_due`), all
finish the same step, write a checkpoint and end with :data:`EXIT_CODE`, which a requeue script tells apart
from Ctrl-C's 130 and from a failure. kaisoku's launcher, signalled itself, passes SIGUSR1 on to its ranks.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

#: Exit code of ``kaisoku train`` stopped by SIGTERM or SIGUSR1 with a checkpoint of the step it stopped at
#: written (EX_TEMPFAIL: "try again later"; rerun with ``--resume auto``).
EXIT_CODE = 75

_REQUESTED: list[int] = [0]  # the signal received (0: none)


def request(signum: int, frame: FrameType | None = None) -> None:
    """Signal handler: note that a stop with a checkpoint was asked for (the loop acts between steps)."""
    _REQUESTED[0] = signum


def requested() -> int:
    """The signal that asked this process to stop (0: none)."""
    return _REQUESTED[0]


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, ..."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def install(*, sigterm: bool) -> None:
    """In a rank: SIGUSR1 (and SIGTERM with ``sigterm``) asks for a stop with a checkpoint."""
    signal.signal(signal.SIGUSR1, request)
    if sigterm:
        signal.signal(signal.SIGTERM, request)


def sigterm_means_time_limit() -> bool:
    """Whether a SIGTERM to this rank comes from the batch system (a rank started by srun itself), rather than
    from a launcher stopping the ranks of a failed run (kaisoku's launcher, torchrun)."""
    return "SLURM_PROCID" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ


class StoppedBySignal(Exception):
    """The ranks stopped together after ``step`` on ``signum`` with a checkpoint of that step written."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        kept = (
            f"checkpoint step {step} written" if checkpoint else "no checkpoint written (checkpoints are off)"
        )
        super().__init__(f"stopped by {signal_name(signum)} at step {step}; {kept}")
