"""Running a built trainer: starting a node's ranks, and one rank's whole life (build, fit, summary)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kaisoku.config import Config
from kaisoku.distributed import env
from kaisoku.engine import failures
from kaisoku.engine.build import build_trainer
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.engine.data_build import dataset_root
from kaisoku.engine.metrics import print_summary
from kaisoku.engine.report import finish_line, write_report
from kaisoku.engine.trainer import Trainer
from kaisoku.errors import KaisokuError
from kaisoku.parts import UserParts


def train_on_local_ranks(cfg: Config, nproc: int, *, rank_entry: Sequence[str] | None = None) -> int:
    """Start ``nproc`` ranks on this node that train ``cfg``; the exit code for ``kaisoku train``.

    The config goes to ``RUN_DIR/config.toml`` and each rank runs ``kaisoku train --config`` on it (or
    ``rank_entry``, a script and its arguments, which tests use to wrap :func:`run_training`). A failed
    rank is reported in one line; only complete checkpoints are left.
    """
    from kaisoku.config import to_toml
    from kaisoku.distributed.launch import launch_local
    from kaisoku.fsutil import atomic_write_text

    dataset_root(cfg)  # generate the demo set once, before the ranks start
    run_dir = Path(cfg.run_dir).expanduser()
    config_path = run_dir / "config.toml"
    atomic_write_text(config_path, to_toml(cfg))
    entry = list(rank_entry) if rank_entry is not None else ["-m", "kaisoku", "train"]
    failures.clear_records(run_dir)
    failures.mark_run(run_dir, status="running", started=time.time(), world_size=nproc, ended=None)
    result = launch_local(
        [*entry, "--config", str(config_path)],
        nproc=nproc,
        max_restarts=cfg.dist.max_restarts,
        env={failures.LAUNCHER_ENV: "1"},
    )
    if result.ok:
        failures.mark_run(run_dir, status="completed", ended=time.time())
        return 0
    CheckpointManager(run_dir / "checkpoints", keep=cfg.checkpoint.keep).remove_partial()
    seen = [(f.rank, f.how, f.signal) for f in result.failures]
    code = failures.report_launch(run_dir, seen, interrupted=result.interrupted)
    with contextlib.suppress(KaisokuError):
        write_report(run_dir)  # the crashed run's page, for a look at what led up to it
    return code


def run_training(
    cfg: Config, *, parts: UserParts | None = None, customize: Callable[[Trainer], None] | None = None
) -> dict[str, Any]:
    """Train on the world this process belongs to; rank 0 prints the summary. Returns the summary.

    ``parts`` are the user's own model, dataset and loss given from Python. ``customize`` is called with the built trainer before training starts (tests use it to hook into a
    run, e.g. to pause a checkpoint write).
    """
    world = env.world_from_env()
    run_dir = Path(cfg.run_dir).expanduser()
    launched = os.environ.get(failures.LAUNCHER_ENV) == "1"
    if launched:
        failures.redirect_to_log(run_dir, world.rank, keep_stdout=world.is_main)
    elif world.is_main:  # no kaisoku launcher to keep run.json: this rank does
        failures.mark_run(run_dir, status="running", started=time.time(), world_size=world.world_size)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or _threads_per_rank(world)))
    resume = cfg.checkpoint.resume
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"  # a rank restarted by torchrun continues from the newest checkpoint
    # torchrun stops the other ranks with SIGTERM when one fails: exit through Python so that
    # a checkpoint being written removes its temp file instead of leaving it behind.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    built: list[Trainer] = []
    with failures.rank_failures(
        run_dir,
        world.rank,
        step=lambda: built[0].state.step if built else None,
        device=lambda: str(built[0].device) if built else cfg.train.device,
        skip_corrupt=cfg.data.skip_corrupt,
        data=cfg.data.path,
    ):
        trainer = build_trainer(cfg, world, parts=parts, resume=resume)
        built.append(trainer)
        if customize is not None:
            customize(trainer)
        try:
            summary = trainer.fit()
        finally:
            trainer.metrics.close()
        env.barrier()  # no rank may still read staged shards when the node cache deletes them
        trainer.train_data.close()
        if world.is_main:
            print_summary(summary)
            if trainer.precision.monitor is not None:
                trainer.precision.monitor.print_table()
            print(finish_line(summary, run_dir), flush=True)
            if not launched:
                failures.mark_run(run_dir, status="completed", ended=time.time())
        env.shutdown()
    return summary


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _threads_per_rank(world: env.World) -> int:
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // max(1, world.local_world_size))
