"""A rank entry for tests: ``kaisoku train`` whose checkpoint writer pauses before its rename.

Run as a script (``python tests/engine/paused_save_entry.py [kaisoku train arguments]``): it launches
the ranks through :func:`kaisoku.engine.run.train_on_local_ranks` with itself as their entry; on a
rank (inside torchrun) it trains with a ``before_rename`` callback that writes ``PAUSED`` beside the temp
file and sleeps, so a test can kill the writer with a complete temp file that is not yet renamed. With
``PAUSE_AT_STEP`` in the environment only the checkpoint of that step pauses (the others are published).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from kaisoku.cli import resolve_config
from kaisoku.distributed.env import inside_torchrun
from kaisoku.engine.run import train_on_local_ranks, train_rank_then_leave
from kaisoku.engine.trainer import Trainer

PAUSE_SECONDS = 120.0


def _pause(tmp: Path) -> None:
    step = os.environ.get("PAUSE_AT_STEP")
    if step and not tmp.name.startswith(f".step-{int(step):08d}."):
        return
    (tmp.parent / "PAUSED").write_text(str(tmp))
    time.sleep(PAUSE_SECONDS)


def _hook(trainer: Trainer) -> None:
    assert trainer.checkpoints is not None
    trainer.checkpoints.before_rename = _pause


def main(argv: list[str]) -> int:
    """Launch the ranks (outside torchrun) or train as one of them (inside)."""
    cfg, _ = resolve_config(argv)
    if inside_torchrun():
        train_rank_then_leave(cfg, customize=_hook)
    return train_on_local_ranks(cfg, cfg.dist.nproc, rank_entry=[__file__])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
