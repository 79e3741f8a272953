"""Atomic checkpoints written by rank 0, the newest K kept, and resume from the newest valid one."""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_open

_NAME = re.compile(r"^step-(\d{8})\.pt$")
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "step", "data", "rng", "format")
FORMAT_VERSION = 1


class CheckpointManager:
    """Saves and finds checkpoints in ``<run_dir>/checkpoints/step-XXXXXXXX.pt``.

    Args:
        directory: where the checkpoint files go (created on the first save).
        keep: how many of the newest checkpoints ``save`` leaves on disk.
        before_rename: called with the temp file's path once the checkpoint is completely written and
            fsynced, just before it is renamed into place; an exception it raises aborts the save and
            removes the temp file. Tests use it to stop or kill a writer at that moment.
    """

    def __init__(
        self, directory: Path, *, keep: int, before_rename: Callable[[Path], None] | None = None
    ) -> None:
        self.directory = directory
        self.keep = keep
        self.before_rename = before_rename

    def path_for(self, step: int) -> Path:
        """The file of the checkpoint taken after optimizer step ``step``."""
        return self.directory / f"step-{step:08d}.pt"

    def list(self) -> list[Path]:
        """Complete checkpoint files, oldest first (temp files are never listed)."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if _NAME.match(p.name))

    def remove_partial(self) -> None:
        """Delete temp files that a killed writer left behind."""
        if self.directory.is_dir():
            for path in self.directory.glob(".step-*.tmp"):
                path.unlink(missing_ok=True)

    def save(self, state: dict[str, Any]) -> Path:
        """Write ``state`` atomically (temp file + fsync + rename), then drop all but the newest K."""
        state = {**state, "format": FORMAT_VERSION}
        path = self.path_for(int(state["step"]))
        # Serialise in memory first: a full disk then fails as a plain write error, not inside torch's
        # zip writer, and the temp file is removed by atomic_open.
        buffer = io.BytesIO()
        torch.save(state, buffer)
        try:
            with atomic_open(path, "wb", before_rename=self.before_rename) as handle:
                handle.write(buffer.getbuffer())
        except OSError as error:
            raise KaisokuError(
                f"could not write checkpoint {path}: {error.strerror}; free space or change --run-dir"
            ) from None
        for old in self.list()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    @staticmethod
    def load(path: Path) -> dict[str, Any]:
        """Load and check one checkpoint; KaisokuError naming the file when it is corrupt or foreign."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise KaisokuError(f"checkpoint {path} does not exist") from None
        except Exception as error:  # torch raises several types for a damaged file
            raise KaisokuError(
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
        return state

    def latest_valid(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that loads and checks out; damaged newer ones are reported and skipped."""
        for path in reversed(self.list()):
            try:
                return path, self.load(path)
            except KaisokuError as error:
                print(f"kaisoku: skipping {error}", file=sys.stderr)
        return None
