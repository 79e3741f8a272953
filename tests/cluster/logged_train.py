"""``kaisoku train`` whose ranks log the sample ids of every batch they are handed, for tests of exact
sample coverage across a lost host: ``python tests/cluster/logged_train.py TRAIN-ARGS...``.

Each rank appends ``{"attempt", "rank", "epoch", "step", "ids"}`` lines to
``RUN_DIR/logs/ids-rank<R>-attempt<A>.jsonl``; with ``--data.workers 0`` a batch is handed out when the
trainer asks for it, so the lines are the batches trained (and at most the one in flight at a kill).

``--hold-below RANKS:STEPS`` (before the train arguments) holds a world with fewer than RANKS ranks after
its first STEPS steps, as in ``kaisoku bench cluster`` (:func:`kaisoku_bench.cluster_rank.hold_smaller_world`):
a run that lost a host stays at work until the host comes back, however fast the steps are.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from kaisoku.cli import resolve_config
from kaisoku.data.order.sampler import EpochSampler
from kaisoku.distributed.env import inside_torchrun, world_from_env
from kaisoku.engine import failures
from kaisoku.engine.run import train_on_local_ranks, train_rank_then_leave
from kaisoku.engine.trainer import Trainer
from kaisoku_bench.cluster_rank import hold_smaller_world, split_hold


class _LoggingSampler(EpochSampler):
    log_path: Path
    attempt: int

    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            line = {"attempt": self.attempt, "rank": self.rank, "epoch": self.epoch, "step": self.step - 1}
            with self.log_path.open("a") as handle:
                handle.write(json.dumps({**line, "ids": batch}) + "\n")
            yield batch


def _log_ids(run_dir: Path, hold: tuple[int, int] | None, trainer: Trainer) -> None:
    sampler = trainer.train_data.sampler  # type: ignore[attr-defined]
    sampler.__class__ = _LoggingSampler
    attempt = failures.restart_attempt()
    sampler.attempt = attempt
    rank = world_from_env().rank
    sampler.log_path = run_dir / "logs" / f"ids-rank{rank}-attempt{attempt}.jsonl"
    if hold is not None:
        hold_smaller_world(*hold, trainer)


def main(argv: list[str]) -> int:
    hold, own, argv = split_hold(argv)
    cfg, _ = resolve_config(argv)
    if inside_torchrun():
        train_rank_then_leave(
            cfg, customize=functools.partial(_log_ids, Path(cfg.run_dir).expanduser(), hold)
        )
    return train_on_local_ranks(cfg, max(1, cfg.dist.nproc), rank_entry=[__file__, *own])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
