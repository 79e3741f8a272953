"""Running a built trainer: starting a node's ranks, and one rank's whole life (build, fit, summary)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from kaisoku.config import Config, to_toml
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.data.node_cache.tier_dirs import claim_tier, reclaim_dead_tiers, remove_tier
from kaisoku.distributed import env
from kaisoku.distributed.launch import (
    DEFAULT_TIMING,
    Rendezvous,
    RendezvousTiming,
    adopt_rendezvous_round,
    die_with_launcher,
    launch_local,
    rendezvous_for,
)
from kaisoku.engine import failures, hosts, stop
from kaisoku.engine import run_dir as run_dir_lock
from kaisoku.engine.build import build_trainer
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.engine.data_build import dataset_root
from kaisoku.engine.metrics import print_summary
from kaisoku.engine.report import finish_line, write_report
from kaisoku.engine.trainer import Trainer
from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_write_text
from kaisoku.parts import UserParts
from kaisoku.run_plan import RunPlan

log = logging.getLogger("kaisoku.engine.run")

#: Set in the ranks of a run over several hosts, each with a launcher of its own: rank 0 holds the run
#: folder (no single launcher can), as in a run started by torchrun or srun.
MULTIHOST_ENV = "KAISOKU_MULTIHOST"


def rendezvous_of(cfg: Config, timing: RendezvousTiming = DEFAULT_TIMING) -> Rendezvous | None:
    """The rendezvous of ``cfg.dist`` (None on one host); its id is the run folder's, alike on every host."""
    run_id = "kaisoku-" + hashlib.sha256(str(Path(cfg.run_dir).expanduser()).encode()).hexdigest()[:12]
    return rendezvous_for(
        cfg.dist.nnodes,
        cfg.dist.node_rank,
        cfg.dist.rdzv_endpoint,
        run_id=run_id,
        join_timeout=cfg.dist.timeout,
        timing=timing,
    )


def train_on_local_ranks(
    cfg: Config,
    nproc: int,
    *,
    rank_entry: Sequence[str] | None = None,
    timing: RendezvousTiming = DEFAULT_TIMING,
) -> int:
    """Start ``nproc`` ranks on this node that train ``cfg``; the exit code for ``kaisoku train``.

    The run folder is claimed first (its lock, held until the ranks end; see :mod:`kaisoku.engine.run_dir`).
    The config goes to ``RUN_DIR/config.toml`` and each rank runs ``kaisoku train --config`` on it (or
    ``rank_entry``, a script and its arguments, which tests use to wrap :func:`run_training`; ``timing``, the
    rendezvous's clocks, which a cluster in a box shortens). A failed
    rank is reported in one line; only complete checkpoints are left, and no RAM tier of a rank that died.

    With ``dist.nnodes`` > 1 every host runs this with the same config; torchrun's rendezvous joins them
    (:func:`rendezvous_of`) and rank 0, wherever it lands, holds the run folder.
    """

    rendezvous = rendezvous_of(cfg, timing)
    dataset_root(cfg)  # generate the demo set once, before the ranks start
    run_dir = Path(cfg.run_dir).expanduser()
    # Across hosts rank 0 takes the folder's lock once the ranks run; each host checks the folder now, so
    # that a run it would refuse stops here with one line.
    lock: run_dir_lock.RunFolderLock | None = run_dir_lock.claim(cfg, lock=rendezvous is None)
    if rendezvous is not None and lock is not None:
        lock.release()
        lock = None
    try:
        _reclaim_ram_tiers(cfg)
        config_path = run_dir / "config.toml"
        try:
            atomic_write_text(config_path, to_toml(cfg))
        except OSError as error:
            raise run_dir_lock.unwritable(run_dir, error) from None
        entry = list(rank_entry) if rank_entry is not None else ["-m", "kaisoku", "train"]
        failures.clear_records(run_dir)
        if rendezvous is None:
            failures.start_run(run_dir, world_size=nproc, **run_dir_lock.owner_fields())

        def on_restart(failed: Sequence[Any], restart: int) -> None:
            seen = [(f.rank, f.how, f.signal) for f in failed]
            failures.report_restart(run_dir, seen, restart=restart, limit=cfg.dist.max_restarts)

        result = launch_local(
            [*entry, "--config", str(config_path)],
            nproc=nproc,
            max_restarts=cfg.dist.max_restarts,
            env={failures.LAUNCHER_ENV: "1", MULTIHOST_ENV: "1" if rendezvous is not None else ""},
            on_restart=on_restart,
            rendezvous=rendezvous,
        )
        _reclaim_ram_tiers(cfg)  # what ranks killed without a word left behind
        signalled = any(r.kind == "signal" for r in failures.read_failures(run_dir, latest_attempt=True))
        if result.ok and not signalled:
            failures.mark_run(run_dir, status="completed", ended=time.time())
            return 0
        CheckpointManager(run_dir / "checkpoints", keep=cfg.checkpoint.keep).remove_partial()
        seen = [(f.rank, f.how, f.signal) for f in result.failures]
        code = failures.report_launch(
            run_dir,
            seen,
            interrupted=result.interrupted,
            resume=cfg.checkpoint.resume,
            stop_signal=result.stop_signal,
        )
        # The crashed run's page, for a look at what led up to it; a convenience that must not bury the
        # two lines above under a traceback of its own (e.g. a full disk, which may be why the run failed).
        with contextlib.suppress(KaisokuError, OSError, RuntimeError, ValueError):
            write_report(run_dir)
        return code
    finally:
        if lock is not None:
            lock.release()


def run_training(
    cfg: Config,
    *,
    parts: UserParts | None = None,
    plan: RunPlan | None = None,
    customize: Callable[[Trainer], None] | None = None,
) -> dict[str, Any]:
    """Train on the world this process belongs to; rank 0 prints the summary. Returns the summary.

    ``parts`` are the user's own model, dataset and loss given from Python, ``plan`` the run plan where the
    caller resolved it on this world already. ``customize`` is called with
    the built trainer before training starts (tests use it to hook into a run, e.g. to pause a checkpoint
    write).
    """
    world = env.world_from_env()
    run_dir = Path(cfg.run_dir).expanduser()
    launched = os.environ.get(failures.LAUNCHER_ENV) == "1"
    multihost = os.environ.get(MULTIHOST_ENV) == "1"
    restart = adopt_rendezvous_round()  # alike on every host, a host that rejoined included
    resume = cfg.checkpoint.resume
    if restart > 0:
        resume = "auto"  # a rank restarted by torchrun continues from the newest checkpoint
    lock: run_dir_lock.RunFolderLock | None = None
    # Ranks started by launch_local (kaisoku train, kaisoku.launch) stop when their launcher is killed.
    die_with_launcher()
    if launched:
        failures.redirect_to_log(run_dir, world.rank, keep_stdout=world.is_main)
    if not launched or multihost:  # no single kaisoku launcher holds the run folder and run.json: rank 0 does
        claimed = cfg
        if resume != cfg.checkpoint.resume:
            claimed = copy.deepcopy(cfg)
            claimed.checkpoint.resume = resume
        lock = run_dir_lock.claim(claimed, lock=world.is_main)
        if world.is_main and restart == 0:
            failures.start_run(run_dir, world_size=world.world_size, **run_dir_lock.owner_fields())
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "0")) or _threads_per_rank(world)))
    if world.local_rank == 0:
        _reclaim_ram_tiers(cfg)  # e.g. the tier of this node's rank 0 in the attempt that was restarted
    # torchrun stops the other ranks with SIGTERM when one fails: exit through Python so that
    # a checkpoint being written removes its temp file instead of leaving it behind.
    signal.signal(signal.SIGTERM, failures.on_stop_signal)
    # SIGUSR1 (and SIGTERM from Slurm to a rank srun started) asks for a stop with a checkpoint.
    stop.install(sigterm=stop.sigterm_means_time_limit())
    built: list[Trainer] = []
    try:
        with failures.rank_failures(
            run_dir,
            world.rank,
            step=lambda: built[0].state.step if built else None,
            device=lambda: str(built[0].device) if built else cfg.train.device,
            skip_corrupt=cfg.data.skip_corrupt,
            data=cfg.data.path,
            on_nonfinite=cfg.train.on_nonfinite,
            resume=cfg.checkpoint.resume,
        ):
            trainer = build_trainer(cfg, world, parts=parts, plan=plan, resume=resume)
            built.append(trainer)
            ram_tier = _claim_ram_tier(trainer, cfg, world)
            finished = False
            try:
                if resume:
                    trainer.metrics.continue_from(trainer.state.step, restart=restart)
                _record_world(trainer, run_dir, world, restart)
                if customize is not None:
                    customize(trainer)
                try:
                    summary = trainer.fit()
                finally:
                    trainer.metrics.close()
                hosts.record_end(run_dir, world, _data_counters(trainer))
                env.barrier()  # no rank may still read staged shards when the node cache deletes them
                finished = True
            finally:
                # Every exit path this process survives (an error, Ctrl-C, the launcher's SIGTERM)
                # removes the RAM tier; after a failure without the barrier: the other ranks are stopping.
                with failures.stop_held():
                    _close_data(trainer, ram_tier, after_barrier=finished)
            if world.is_main:
                staging, exchange = _data_paths(trainer)
                print_summary(summary, staging=staging, exchange=exchange)
                if trainer.precision.monitor is not None:
                    trainer.precision.monitor.print_table()
                print(finish_line(summary, run_dir), flush=True)
                if not launched or multihost:
                    failures.mark_run(run_dir, status="completed", ended=time.time())
            env.shutdown()
    finally:
        if lock is not None:
            lock.release()
    return summary


def train_rank_then_leave(
    cfg: Config,
    *,
    parts: UserParts | None = None,
    plan: RunPlan | None = None,
    customize: Callable[[Trainer], None] | None = None,
) -> NoReturn:
    """Train as one rank of a launched world (inside torchrun or a Slurm step), then leave as a finished
    rank leaves (:func:`~kaisoku.engine.failures.leave_finished_rank`): what every rank that ``kaisoku
    train`` starts runs. The arguments are :func:`run_training`'s."""
    run_training(cfg, parts=parts, plan=plan, customize=customize)
    failures.leave_finished_rank()


def _record_world(trainer: Trainer, run_dir: Path, world: env.World, restart: int) -> None:
    """Which host runs which rank (``hosts.json``, a ``world`` metrics line); when the world changed size
    since the previous attempt, one line and a ``change`` in both. A collective: every rank calls it once
    the group is up."""
    step = trainer.state.step
    change = hosts.record_start(run_dir, world, attempt=restart, start_step=step)
    if world.is_main:
        attempt = hosts.newest_attempt(run_dir)
        said = {"change": change} if change is not None else {}
        trainer.metrics.log(
            {
                "step": step,
                "event": "world",
                "world_size": world.world_size,
                "hosts": attempt.get("hosts", {}),
                **said,
            }
        )
    if change is not None:
        trainer.metrics.message(f"kaisoku: {change}")


def _data_counters(trainer: Trainer) -> dict[str, int]:
    """This rank's node-cache counters (reads of the shared source, tier hits); empty without a cache."""
    loader = trainer.train_data
    return loader.stats() if isinstance(loader, ShardLoader) else {}


def _data_paths(trainer: Trainer) -> tuple[bool, bool]:
    """Whether the run stages shards in a node cache, and whether it exchanges samples between nodes."""
    loader = trainer.train_data
    if not isinstance(loader, ShardLoader):
        return False, False
    return loader.cache_settings.enabled, loader.needs_exchange


def _claim_ram_tier(trainer: Trainer, cfg: Config, world: env.World) -> Path | None:
    """On a node's local rank 0: this run's directory under ``data.ram_dir``, recorded as owned by this
    process (so a later start reclaims it if this process is killed); None where the run keeps none."""
    staging, exchange = _data_paths(trainer)
    if world.local_rank != 0 or not (staging or exchange):
        return None
    assert isinstance(trainer.train_data, ShardLoader)
    tier = Path(cfg.data.ram_dir).expanduser() / trainer.train_data.run_token
    claim_tier(tier)
    return tier


def _close_data(trainer: Trainer, ram_tier: Path | None, *, after_barrier: bool) -> None:
    """Stop staging and delete the run's RAM directory (never raises: it runs on failure paths)."""
    with contextlib.suppress(Exception):
        trainer.train_data.close()
    if ram_tier is not None:
        remove_tier(ram_tier)


def _reclaim_ram_tiers(cfg: Config) -> None:
    """Delete the RAM directories of runs that ended without removing theirs (killed), one line each."""
    for tier, owner in reclaim_dead_tiers(Path(cfg.data.ram_dir).expanduser()):
        text = f"removed RAM directory {tier} of a run that ended without removing it ({owner})"
        if os.environ.get(failures.LAUNCHER_ENV) == "1":
            log.warning("%s", text)  # a rank: to its log, and on rank 0 to the terminal
        else:
            print(f"kaisoku: warning: {text}", file=sys.stderr)


def _threads_per_rank(world: env.World) -> int:
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // max(1, world.local_world_size))
