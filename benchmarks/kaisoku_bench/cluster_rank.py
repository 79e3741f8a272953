"""The ``kaisoku train`` that ``kaisoku bench cluster`` runs on each host of a cluster in a box:
``python -m kaisoku_bench.cluster_rank [--hold-below RANKS:STEPS] [--clocks S:N:L] --config FILE``.

``--hold-below RANKS:STEPS`` makes a rank of a world with fewer than RANKS ranks, once it has trained and
checkpointed STEPS steps after its start (``--checkpoint.every-steps STEPS``), train one step more and
wait for torchrun to restart it: a run that lost a host stays at work until the host comes back,
however fast its steps are (it fails after :data:`HOLD_S` seconds).

``--clocks S:N:L`` sets the launcher's c10d rendezvous clocks (a heartbeat every S seconds, a host dropped
after N missed, a last call of L seconds; :class:`~kaisoku.distributed.launch.RendezvousTiming`) in place
of the defaults ``kaisoku train`` uses.
"""

from __future__ import annotations

import functools
import sys
import time

from kaisoku.config import Config, apply_mapping, load_toml, validate
from kaisoku.distributed.env import inside_torchrun
from kaisoku.distributed.launch import RendezvousTiming
from kaisoku.engine.run import train_on_local_ranks, train_rank_then_leave
from kaisoku.engine.trainer import Trainer

HOLD_S = 300.0
HOLD_FLAG = "--hold-below"
CLOCKS_FLAG = "--clocks"
MODULE = "kaisoku_bench.cluster_rank"


def hold_smaller_world(ranks: int, steps: int, trainer: Trainer) -> None:
    """Make ``trainer`` wait after ``steps`` + 1 steps when its world has fewer than ``ranks`` ranks."""
    if trainer.world.world_size < ranks:
        trainer.on_step = functools.partial(_hold, trainer.state.step + steps + 1)


def _hold(at_step: int, step: int) -> None:
    # Called after each step, before its checkpoint: the step after the checkpoint is the one held.
    if step >= at_step:
        time.sleep(HOLD_S)  # the launcher's SIGTERM ends it when the world grows again
        raise RuntimeError(f"held {HOLD_S:g} s after step {step}; no host joined")


def split_hold(argv: list[str]) -> tuple[tuple[int, int] | None, list[str], list[str]]:
    """(RANKS, STEPS) of a leading ``--hold-below``, those two arguments, and the rest."""
    if argv[:1] != [HOLD_FLAG]:
        return None, [], argv
    ranks, _, steps = argv[1].partition(":")
    return (int(ranks), int(steps)), argv[:2], argv[2:]


def split_clocks(argv: list[str]) -> tuple[RendezvousTiming, list[str]]:
    """The clocks of a leading ``--clocks S:N:L`` (the defaults without one) and the rest."""
    if argv[:1] != [CLOCKS_FLAG]:
        return RendezvousTiming(), argv
    heartbeat, misses, last_call = (int(part) for part in argv[1].split(":"))
    return RendezvousTiming(heartbeat, misses, last_call), argv[2:]


def main(argv: list[str]) -> int:
    """Train like ``kaisoku train --config FILE`` (ranks included), holding a smaller world where asked."""
    hold, own, rest = split_hold(argv)
    timing, rest = split_clocks(rest)
    if len(rest) != 2 or rest[0] != "--config":
        usage = f"[{HOLD_FLAG} RANKS:STEPS] [{CLOCKS_FLAG} S:N:L] --config FILE"
        print(f"usage: python -m {MODULE} {usage}", file=sys.stderr)
        return 2
    cfg = Config()
    apply_mapping(cfg, load_toml(rest[1]))
    validate(cfg)
    if inside_torchrun():
        customize = functools.partial(hold_smaller_world, *hold) if hold is not None else None
        train_rank_then_leave(cfg, customize=customize)
    return train_on_local_ranks(cfg, max(1, cfg.dist.nproc), rank_entry=["-m", MODULE, *own], timing=timing)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
