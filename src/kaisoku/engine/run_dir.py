"""One run per folder: the run folder's lock, no new run mixed into another run's files, and ``--resume auto``
only for a checkpoint of the same run.

:func:`claim` is called once per run before anything is written into the folder: by kaisoku's launcher,
or by rank 0 of a run started by torchrun or srun. It takes the folder's lock (held until the run
ends), marks a ``running`` run.json whose owner is gone as ``failed``, refuses a fresh run into a
folder that holds another run's checkpoints or metrics, and refuses ``--resume auto`` when the newest
checkpoint was written under a config that differs in a key that changes the trajectory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kaisoku.config import Config, to_dict
from kaisoku.engine import failures
from kaisoku.engine.checkpoint import TRAINER_FILE, CheckpointManager
from kaisoku.errors import ConfigError
from kaisoku.owner import describe, is_gone, this_process

LOCK_NAME = "run.lock"
"""The lock file inside the run folder; it holds the owner (host, pid) while a run is on."""

NON_TRAJECTORY_KEYS: frozenset[str] = frozenset(
    {
        # where things go and how often they are written or shown
        "run_dir",
        "checkpoint.resume",
        "checkpoint.keep",
        "checkpoint.every_steps",
        "checkpoint.async_save",  # when shards are written, not what they hold
        "train.max_steps",  # stops early only: the schedule spans train.epochs
        "train.log_every",
        "train.val_every",  # validation reads the model, it does not change it
        "metrics.progress",
        "metrics.tensorboard",
        # where the run executes: the sample order and the schedule do not depend on it
        "train.device",
        "train.compile",
        "dist.nproc",
        "dist.nnodes",
        "dist.node_rank",
        "dist.rdzv_endpoint",
        "dist.timeout",
        "dist.max_restarts",
        "dist.eager_init",
        "dist.buckets",
        "dist.first_bucket_mb",
        "dist.bucket_cap_mb",
        "dist.bucket_growth",
        # where the data is read and staged, and by how many workers (same batches either way)
        "data.path",  # a moved dataset; its content is checked by its index
        "data.cache_dir",
        "data.workers",
        "data.loader",
        "data.decode",  # the same crops and flips; nvJPEG's pixels within a level or two of the host's
        "data.local_cache",
        "data.local_capacity",
        "data.ram_capacity",
        "data.ram_dir",
        # what the failure hints suggest before "rerun with --resume auto"
        "data.skip_corrupt",
        "train.on_nonfinite",
        "train.max_skips",
        "train.rollback_lr_scale",
        "train.max_rollbacks",
        "train.grad_accum",  # same global batch in smaller micro-batches (the out-of-memory remedy)
        "memory.recompute",
        "memory.blocks",
        "memory.update_in_backward",
        "memory.offload",
        "memory.offload_dir",
        "memory.budget",
        "memory.allow_shard",  # either engine loads the other's checkpoints
        "memory.policy",
    }
)
"""Config keys that may differ between a checkpoint and the run that continues it with ``--resume auto``.

Every other key (model, data shape and order, optimizer, schedule, seed, epochs, precision, parallel
layout, ...) changes what the run computes: a checkpoint written under another value belongs to another run.
"""


class RunFolderLock:
    """The exclusive lock on a run folder, held by one process for the whole run.

    ``flock`` on ``RUN_DIR/run.lock``: the kernel drops it when its holder dies, so a killed run never
    blocks the next one. The file also records the owner (host, pid) to name it in a refusal; where the
    file system has no ``flock``, that record alone decides (an owner on this host that is gone is
    taken over).
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; ConfigError naming the holder when another run has it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise unwritable(self.path.parent, error) from None
        previous = _read_owner(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(_in_use(self.path.parent, _read_owner_path(self.path) or previous)) from None
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            # No flock here: the owner record decides.
            if previous and is_gone(previous) is not True:
                os.close(fd)
                raise ConfigError(_in_use(self.path.parent, previous)) from None
        if previous:  # its holder ended without releasing it: killed, or its machine went down
            print(
                f"kaisoku: taking over run folder {self.path.parent} from {describe(previous)}, "
                "which ended without releasing it",
                file=sys.stderr,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(this_process()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Clear the owner record and drop the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _read_owner(fd: int) -> dict[str, Any] | None:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def _read_owner_path(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text()
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def _in_use(run_dir: Path, owner: dict[str, Any] | None) -> str:
    who = f" by {describe(owner)}" if owner else ""
    return f"run folder {run_dir} is in use{who} (another kaisoku train); wait for it or choose another --run-dir"


def unwritable(run_dir: Path, error: OSError) -> ConfigError:
    """The one-line error for a run folder that cannot be written."""
    return ConfigError(
        f"cannot write to run folder {run_dir} ({error.strerror or error}); choose a writable --run-dir"
    )


def mark_stale(run_dir: Path) -> bool:
    """Mark a ``running`` run.json whose owner has gone as ``failed`` (one line says so); True if it did.

    Called with the folder's lock held, so its owner cannot still be running on this folder.
    """
    path = run_dir / "run.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(state, dict) or state.get("status") != "running":
        return False
    owner = state.get("owner")
    if isinstance(owner, dict) and is_gone(owner) is False:
        return False  # a run without the lock (an older kaisoku) still writes here
    cause = (
        f"stopped without a word: {describe(owner) if isinstance(owner, dict) else 'its launcher'} is gone"
    )
    failures.mark_run(
        run_dir, status="failed", failure="unknown", cause=cause, exit_code=None, ended=last_activity(run_dir)
    )
    print(f"kaisoku: the earlier run in {run_dir} {cause}; marked failed in run.json", file=sys.stderr)
    return True


def last_activity(run_dir: Path) -> float | None:
    """When a run last wrote its metrics or a rank's log (seconds since the epoch): the end of a run whose
    launcher was killed, as the next run on its folder finds it; None where it wrote neither."""
    written = [run_dir / "metrics.jsonl", *failures.log_dir(run_dir).glob("rank-*.log")]
    times = [path.stat().st_mtime for path in written if path.exists()]
    return max(times) if times else None


def trained_steps(run_dir: Path) -> str | None:
    """What in the folder shows that a run trained there (its checkpoints, its metrics), else None."""
    newest = failures.newest_checkpoint_step(run_dir)
    if newest is not None:
        return f"checkpoints up to step {newest}"
    metrics = run_dir / "metrics.jsonl"
    last = 0
    with contextlib.suppress(OSError), metrics.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int):
                last = max(last, step)
    return f"metrics.jsonl up to step {last}" if last > 0 else None


def check_fresh(run_dir: Path, resume: str) -> None:
    """Refuse a run without ``--resume`` into a folder where another run trained (ConfigError)."""
    if resume:
        return
    held = trained_steps(run_dir)
    if held is not None:
        raise ConfigError(
            f"run folder {run_dir} holds another run ({held}); pass --resume auto to continue it, "
            "or choose a new --run-dir"
        )


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as ``{"section.key": value}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, f"{name}."))
        else:
            out[name] = value
    return out


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, current value) for each key present in both that changes the trajectory."""
    old, new = flat_config(saved), flat_config(current)
    return [
        (key, old[key], new[key])
        for key in sorted(old.keys() & new.keys())
        if key not in NON_TRAJECTORY_KEYS and old[key] != new[key]
    ]


def newest_checkpoint_config(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that opens (the one ``--resume auto`` loads) and its saved config.

    The file (a sharded folder's ``trainer.pt``) is memory-mapped, so only the config is read from it.
    """
    manager = CheckpointManager(run_dir / "checkpoints", keep=1)
    for path in reversed(manager.list()):
        try:
            state = torch.load(
                path / TRAINER_FILE if path.is_dir() else path,
                map_location="cpu",
                weights_only=True,
                mmap=True,
            )
        except Exception:  # noqa: BLE001 - a damaged file: the resume itself skips it and says so
            continue
        if isinstance(state, dict):
            config = state.get("config")
            return path, config if isinstance(config, dict) else {}
    return None


def check_resume(run_dir: Path, cfg: Config) -> None:
    """Refuse ``--resume auto`` when the newest checkpoint was trained under another config (ConfigError)."""
    if cfg.checkpoint.resume != "auto":
        return
    found = newest_checkpoint_config(run_dir)
    if found is None:
        return
    path, saved = found
    differ = config_differences(saved, to_dict(cfg))
    if differ:
        shown = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in differ[:6])
        more = f" and {len(differ) - 6} more" if len(differ) > 6 else ""
        raise ConfigError(
            f"--resume auto: checkpoint {path} belongs to a run with another config ({shown}{more}); "
            f"use those values, pass --resume {path} to continue it anyway, or choose a new --run-dir"
        )


def claim(cfg: Config, *, lock: bool = True) -> RunFolderLock:
    """Take the run folder for this run: lock, stale run.json, no mixing, matching resume; the lock.

    Raises ConfigError (exit 2) with one line when the folder is in use, holds another run (without
    ``--resume``), or its newest checkpoint does not match the config (``--resume auto``). Without
    ``lock`` (the other ranks of a run whose rank 0 holds it) only the checks run, alike on every rank,
    so that every rank refuses the same run.
    """
    run_dir = Path(cfg.run_dir).expanduser()
    folder = RunFolderLock(run_dir)
    if lock:
        folder.acquire()
    try:
        if lock:
            mark_stale(run_dir)
        check_fresh(run_dir, cfg.checkpoint.resume)
        check_resume(run_dir, cfg)
    except BaseException:
        folder.release()
        raise
    return folder


def owner_fields() -> dict[str, Any]:
    """What run.json records about who runs it (for :func:`mark_stale`), with the start time."""
    return {"owner": this_process(), "started": time.time()}
