"""Real file systems that refuse writes, for one-line-error tests: a tiny tmpfs (full), a read-only tmpfs,
and an immutable folder. Mounting needs root (chmod stops no root process); elsewhere the tests skip."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REFUSALS = ("full", "read-only", "immutable")
"""The kinds of destination :func:`refusing_folder` makes."""


@contextlib.contextmanager
def refusing_folder(mount_point: Path, kind: str) -> Iterator[Path]:
    """A folder under ``mount_point`` (a tmpfs mounted there for the test) that refuses writes as ``kind``
    says: ``full`` (a 48 KiB tmpfs; the folder itself can be made), ``read-only`` (mounted ro; the folder
    exists, empty), ``immutable`` (an empty folder with ``chattr +i``). Unmounted on exit."""
    mount_point.mkdir(parents=True, exist_ok=True)
    size = "48k" if kind == "full" else "1m"
    _run_or_skip(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)])
    folder = mount_point / "dest"
    try:
        if kind != "full":
            folder.mkdir()
        if kind == "read-only":  # remounted once the empty folder is there
            _run_or_skip(["mount", "-o", "remount,ro", str(mount_point)])
        if kind == "immutable":
            _run_or_skip(["chattr", "+i", str(folder)])
        yield folder
    finally:
        if kind == "immutable":
            subprocess.run(["chattr", "-i", str(folder)], check=False, capture_output=True)
        subprocess.run(["umount", str(mount_point)], check=False, capture_output=True)


def _run_or_skip(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"{' '.join(command[:2])} failed here ({result.stderr.strip()}); needs root")
