"""Atomic checkpoints, the newest K kept, and resume from the newest valid one.

Two kinds, told apart by their names: ``step-XXXXXXXX.pt``, one file written by rank 0 (data parallel,
unsharded pipeline stages), and ``step-XXXXXXXX/``, a folder of shards every rank writes (``parallel.shard``,
with or without pipeline stages: model and optimizer through :mod:`kaisoku.distributed.sharded_checkpoint`,
the rest of the trainer's state in ``trainer.pt`` by rank 0). A folder is written as ``.step-XXXXXXXX.tmp/``
and renamed once its metadata and ``trainer.pt`` are on disk, so a listed folder is always complete; older
ones are removed only after.
Shards may be written in the background while training goes on (``checkpoint.async_save``): the folder is
then renamed when the next save, a rollback or the end of training finds the write complete.
Either kind loads into any engine.
Every checkpoint carries content checksums (:mod:`kaisoku.engine.checksums`): per tensor in a file, per file
in a folder (``checksums.json``, written just before the folder's rename). A load checks them, so that bytes
changed on disk are found before they are trained on; :meth:`CheckpointManager.latest_valid` skips such a
checkpoint and says why.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kaisoku.distributed import env
from kaisoku.distributed.sharded_checkpoint import (
    METADATA_FILE,
    BackgroundSaver,
    UnreadableCheckpointError,
    check_shard_files,
    save_failure,
    save_sharded,
)
from kaisoku.engine import checksums
from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_open, fsync_dir

_NAME = re.compile(r"^step-(\d{8})(\.pt)?$")
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "data", "rng", "format")
#: What ``trainer.pt`` of a sharded checkpoint holds (model and optimizer are the shards beside it).
SHARDED_REQUIRED_KEYS = ("scheduler", "step", "data", "rng", "format")
#: The file of a sharded checkpoint holding everything but the model and optimizer shards.
TRAINER_FILE = "trainer.pt"
FORMAT_VERSION = 1
_log = logging.getLogger("kaisoku.checkpoint")


class CheckpointManager:
    """Saves and finds checkpoints in ``<run_dir>/checkpoints/step-XXXXXXXX.pt``.

    Args:
        directory: where the checkpoint files go (created on the first save).
        keep: how many of the newest checkpoints ``save`` leaves on disk.
        before_rename: called with the temp file's path once the checkpoint is completely written and
            fsynced, just before it is renamed into place; an exception it raises aborts the save and
            removes the temp file. Tests use it to stop or kill a writer at that moment.
        sharded: every rank writes its own shards (a folder per checkpoint).
        background: sharded saves write their shards while training goes on (``checkpoint.async_save``).
    """

    def __init__(
        self,
        directory: Path,
        *,
        keep: int,
        before_rename: Callable[[Path], None] | None = None,
        sharded: bool = False,
        background: bool = False,
    ) -> None:
        self.directory = directory
        self.keep = keep
        self.before_rename = before_rename
        self.sharded = sharded
        """Every rank writes its shards (:meth:`save` is then a collective), else rank 0 writes one file."""
        self.background = background and sharded
        """Sharded saves write in the background; :meth:`wait` publishes them."""
        self._saver: BackgroundSaver | None = None
        self._pending: _PendingSave | None = None

    def path_for(self, step: int) -> Path:
        """The file (or, sharded, the folder) of the checkpoint taken after optimizer step ``step``."""
        return self.directory / (f"step-{step:08d}" if self.sharded else f"step-{step:08d}.pt")

    def list(self) -> list[Path]:
        """Complete checkpoints (files and folders), oldest first (temp files and folders are never listed)."""
        if not self.directory.is_dir():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if _NAME.match(p.name) and p.is_dir() != p.name.endswith(".pt")
        ]
        return sorted(found, key=lambda p: (_step(p), p.name))

    def remove_partial(self) -> None:
        """Delete temp files and folders that a killed writer left behind (a save of this process still in
        flight is finished first)."""
        self.wait()
        if self.directory.is_dir():
            for path in self.directory.glob(".step-*.tmp"):
                remove(path)

    def save(self, state: dict[str, Any], *, is_main: bool = True) -> Path:
        """Write ``state`` atomically, then drop all but the newest K; the checkpoint's path.

        One file: rank 0 alone calls it (temp file + fsync + rename). Sharded: every rank calls it with its
        own shards, ``is_main`` on rank 0 (see :meth:`_save_sharded`); with :attr:`background` the shards are
        written while training goes on and the path appears once :meth:`wait` has seen them complete.
        """
        state = {**state, "format": FORMAT_VERSION}
        if self.sharded:
            return self._save_sharded(state, is_main, self.background)
        path = self.path_for(int(state["step"]))
        try:
            write_checkpoint_file(path, state, before_rename=self.before_rename)
        except OSError as error:
            raise _write_error(path, error) from None
        self._prune()
        return path

    def _prune(self) -> None:
        for old in self.list()[: -self.keep]:
            remove(old)

    def _save_sharded(self, state: dict[str, Any], main: bool, background: bool) -> Path:
        """Every rank writes its shards into ``.step-X.tmp/``; DCP writes the metadata once all are in; rank 0
        adds ``trainer.pt`` (the rest of the state), fsyncs, renames the folder to ``step-X`` and prunes.

        ``background``: the shards are written by a thread while training goes on; the folder is renamed
        by :meth:`wait` (at the next save, a rollback or the end of training).
        """
        self.wait()  # one save at a time: the one in flight is published first
        path = self.path_for(int(state["step"]))
        tmp = self.directory / f".{path.name}.tmp"
        if main:
            remove(tmp)  # a killed writer's leftovers under this step's name
            tmp.mkdir(parents=True)
        env.barrier()
        shards = {"model": state["model"], "optimizer": state["optimizer"]}
        if background:
            if main:  # the trainer's state is small: written now, as it is at this step
                write_trainer_file(tmp, state)
            if self._saver is None:
                self._saver = BackgroundSaver()
            self._pending = _PendingSave(path, tmp, main, self._saver.start(shards, tmp))
            return path
        try:
            save_sharded(shards, tmp)
            if main:
                write_trainer_file(tmp, state)
        except Exception as error:
            cause = _write_cause(error, tmp)
            if cause is None:
                raise
            if main:
                remove(tmp)  # give the space back: the previous checkpoints stay whole
            raise _write_error(path, cause) from None
        if main:
            self._publish(path, tmp)
        return path

    def wait(self) -> None:
        """Finish the background save in flight, if any: wait until its shards and metadata are written, then
        (rank 0) rename its folder into place and prune. Every rank calls it before its process ends."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            try:
                pending.done.result()
            except BaseException as error:  # DCP's failure is a BaseException: made an ordinary one
                raise save_failure(error) from error
        except Exception as error:
            cause = _write_cause(error, pending.tmp)
            if cause is None:
                raise
            if pending.main:
                remove(pending.tmp)
            raise _write_error(pending.path, cause) from None
        if pending.main:
            self._publish(pending.path, pending.tmp)

    def _publish(self, path: Path, tmp: Path) -> None:
        """Checksum the complete folder ``tmp``, rename it to ``path`` (replacing an older one of the same
        step), prune."""
        try:
            checksums.write_folder_checksums(tmp)
        except OSError as error:
            raise _write_error(path, error) from None
        fsync_dir(tmp)
        if self.before_rename is not None:
            self.before_rename(tmp)
        replaced = self.directory / f".{path.name}.old.tmp"
        if path.exists():  # the same step written again (after a rollback): move the old one aside
            os.replace(path, replaced)
        os.replace(tmp, path)
        fsync_dir(self.directory)
        remove(replaced)
        self._prune()

    @staticmethod
    def load(path: Path, *, verify: bool = True) -> dict[str, Any]:
        """Load and check one checkpoint; KaisokuError naming the file when it is corrupt or foreign
        (UnreadableCheckpointError when damaged: its checksums differ, it does not load, it is cut short).

        A sharded checkpoint gives its ``trainer.pt`` with ``sharded_dir`` naming the folder; the engine
        reads the model and optimizer shards from there. ``verify``: check the content checksums (a
        sharded folder's files are read whole for it; ranks that load what rank 0 verified skip it).
        """
        if path.is_dir():
            state = _load_sharded(path)  # first: a missing or short file is named more precisely there
            if verify:
                _verify(path, checksums.verify_folder)
            return state
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise KaisokuError(f"checkpoint {path} does not exist") from None
        except Exception as error:  # torch raises several types for a damaged file
            raise UnreadableCheckpointError(
                f"checkpoint {path} is corrupt or unreadable ({type(error).__name__})"
            ) from None
        missing = [key for key in REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
        if missing:
            raise KaisokuError(
                f"checkpoint {path} is not a kaisoku checkpoint (missing {', '.join(missing)})"
            )
        if state["format"] != FORMAT_VERSION:
            raise KaisokuError(
                f"checkpoint {path} has format {state['format']}, this kaisoku reads {FORMAT_VERSION}"
            )
        if verify:
            _verify(path, lambda _: checksums.verify_state(state))
        return state

    def latest_valid(
        self, *, older_than: Path | None = None, on_skip: Callable[[str], None] | None = None
    ) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that loads and checks out; damaged newer ones are skipped, each said in one
        line to ``on_skip`` (default: stderr).

        ``older_than``: only checkpoints of earlier steps (the one named was found damaged while loading).
        """
        for path in reversed(self.list()):
            if older_than is not None and _step(path) >= _step(older_than):
                continue
            try:
                return path, self.load(path)
            except KaisokuError as error:
                line = f"{error}; skipped"
                if on_skip is None:
                    print(f"kaisoku: {line}", file=sys.stderr)
                else:
                    on_skip(line)
        return None


def newest_step(directory: Path) -> int | None:
    """The step of the newest complete checkpoint (file or sharded folder) in ``directory``, if any: the one
    lookup behind every message that names it (failures, restarts, refusals)."""
    found = CheckpointManager(directory, keep=1).list()
    return _step(found[-1]) if found else None


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint's name says (``step-00000027.pt`` or ``step-00000027/``); -1 for another name."""
    return _step(path)


def write_checkpoint_file(
    path: Path, state: dict[str, Any], *, before_rename: Callable[[Path], None] | None = None
) -> None:
    """Write ``state`` with its tensors' checksums as the single-file checkpoint ``path`` (temp file + fsync
    + rename). Serialised in memory first: a full disk then fails as a plain write error, not inside torch's
    zip writer, and the temp file is removed."""
    buffer = io.BytesIO()
    torch.save({**state, checksums.STATE_KEY: checksums.state_checksums(state)}, buffer)
    with atomic_open(path, "wb", before_rename=before_rename) as handle:
        handle.write(buffer.getbuffer())


def _verify(path: Path, check: Callable[[Path], bool]) -> None:
    """Run one checksum check on ``path``: UnreadableCheckpointError when the content differs; a warning
    when the checkpoint has no checksums (written by an older kaisoku)."""
    try:
        verified = check(path)
    except checksums.ChecksumMismatch as mismatch:
        step = _step(path)
        what = f"checkpoint step {step}" if step >= 0 else f"checkpoint {path}"
        raise UnreadableCheckpointError(f"{what} is damaged ({mismatch})") from None
    except OSError as error:
        raise UnreadableCheckpointError(f"checkpoint {path} is unreadable ({error.strerror})") from None
    if not verified:
        _log.warning(
            "checkpoint %s has no checksums (written by an older kaisoku): it cannot be verified", path
        )


def write_trainer_file(folder: Path, state: dict[str, Any]) -> None:
    """Write ``TRAINER_FILE`` (``state`` but its model and optimizer, marked sharded) into the sharded
    checkpoint folder ``folder`` atomically, then fsync the folder: the step before its rename."""
    rest = {
        key: value
        for key, value in state.items()
        if key not in ("model", "optimizer", "sharded_dir", checksums.STATE_KEY)
    }
    buffer = io.BytesIO()
    torch.save({**rest, "sharded": True}, buffer)
    with atomic_open(folder / TRAINER_FILE, "wb") as handle:
        handle.write(buffer.getbuffer())
    fsync_dir(folder)


def _load_sharded(path: Path) -> dict[str, Any]:
    """A sharded checkpoint's ``trainer.pt``, checked, with ``sharded_dir`` set to the folder."""
    if not (path / METADATA_FILE).is_file() and not (path / TRAINER_FILE).is_file():
        raise KaisokuError(
            f"{path} is not a kaisoku checkpoint (a folder without {METADATA_FILE} or {TRAINER_FILE})"
        )
    if not (path / METADATA_FILE).is_file():
        raise UnreadableCheckpointError(f"checkpoint {path} is incomplete (no {METADATA_FILE})")
    try:
        state = torch.load(path / TRAINER_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UnreadableCheckpointError(f"checkpoint {path} is incomplete (no {TRAINER_FILE})") from None
    except Exception as error:  # torch raises several types for a damaged file
        raise UnreadableCheckpointError(
            f"checkpoint {path} is corrupt or unreadable ({type(error).__name__})"
        ) from None
    missing = [key for key in SHARDED_REQUIRED_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise KaisokuError(f"checkpoint {path} is not a kaisoku checkpoint (missing {', '.join(missing)})")
    if state["format"] != FORMAT_VERSION:
        raise KaisokuError(
            f"checkpoint {path} has format {state['format']}, this kaisoku reads {FORMAT_VERSION}"
        )
    # Shard files cut short or missing are found here, before any rank starts reading them (a tensor
    # damaged inside a file is found by the load itself).
    check_shard_files(path)
    return {**state, "sharded_dir": str(path)}


@dataclass(frozen=True)
class _PendingSave:
    """A background save in flight: its final path, its temp folder, whether this rank renames it."""

    path: Path
    tmp: Path
    main: bool
    done: Future


#: How torch's file writer reports a write that failed part-way (the OSError behind it is not kept).
_TORCH_WRITE_FAILED = ("unexpected pos", "failed writing file")


def _write_cause(error: BaseException, folder: Path) -> OSError | None:
    """The file-system error behind a failed sharded save: an OSError in its chain, or a full disk where
    torch's writer only says that its write stopped part-way; None for anything else (a bug: keep its
    traceback)."""
    pending: list[BaseException] = [error]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    if any(sign in str(error) for sign in _TORCH_WRITE_FAILED):
        try:
            usage = os.statvfs(folder if folder.exists() else folder.parent)
        except OSError:
            return None
        if usage.f_bavail * usage.f_frsize < _NEARLY_FULL_BYTES:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


#: Free space under which a write that stopped part-way is taken for a full disk.
_NEARLY_FULL_BYTES = 1 << 20


def _write_error(path: Path, error: OSError) -> KaisokuError:
    newest = newest_step(path.parent)
    kept = (
        f"; --resume auto then continues from checkpoint step {newest}, the newest written"
        if newest is not None
        else ""
    )
    return KaisokuError(
        f"could not write checkpoint {path}: {error.strerror}; free space or change --run-dir{kept}"
    )


def _step(path: Path) -> int:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def remove(path: Path) -> None:
    """Delete a checkpoint file or folder (or a temp one); nothing if it is gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
