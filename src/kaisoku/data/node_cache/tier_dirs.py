"""The node cache's directories: the local tier's capacity, and who owns each run's RAM directory.

A run's RAM directory (under ``data.ram_dir``, on /dev/shm) holds its RAM tier, the node's control files
and exchanged samples; it names its owning process, so that a later start on the host removes the
directories of runs that ended without cleaning up (killed, out of memory). The local tier's capacity,
when only its directory is given, is the free space of its file system less a margin. The other ranks of
a node wait for local rank 0 to prepare the node cache in the RAM directory (its ``ready`` file).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from kaisoku.errors import KaisokuError
from kaisoku.fsutil import atomic_write_text
from kaisoku.owner import describe, is_gone, this_process

log = logging.getLogger(__name__)

LOCAL_MARGIN_FRACTION = 0.05
"""Share of the local file system's size left free when ``data.local_capacity`` is not given."""
LOCAL_MARGIN_MIN = 1 << 30
"""At least this many bytes are left free on it (1 GiB)."""


def auto_local_capacity(local_dir: str | os.PathLike[str], *, announce: bool = True) -> int:
    """The local tier's capacity when only its directory is given: free space minus a margin.

    The margin is the larger of :data:`LOCAL_MARGIN_FRACTION` of the file system and
    :data:`LOCAL_MARGIN_MIN`; ``announce`` logs the one line that says what was chosen and why.
    """
    probe = Path(local_dir).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    margin = max(int(usage.total * LOCAL_MARGIN_FRACTION), LOCAL_MARGIN_MIN)
    capacity = max(0, int(usage.free) - margin)
    gib = 1 << 30
    if announce and capacity > 0:
        log.warning(
            "data.local_cache %s has no data.local_capacity: using its file system's free space "
            "%.1f GiB minus a margin of %.1f GiB = %.1f GiB (set data.local_capacity to choose)",
            local_dir, usage.free / gib, margin / gib, capacity / gib,
        )  # fmt: skip
    elif announce:
        log.warning(
            "data.local_cache %s has no data.local_capacity and its file system has only %.1f GiB "
            "free (margin %.1f GiB): the local tier stays off; free space or set data.local_capacity",
            local_dir, usage.free / gib, margin / gib,
        )  # fmt: skip
    return capacity


class NodeCacheError(KaisokuError):
    """A directory of the node cache cannot be used (not the dataset: the data itself is fine)."""


TIER_OWNER = "owner.json"
"""The file in a run's RAM directory that names the process owning it (host, pid, start time)."""


def claim_tier(directory: str | os.PathLike[str]) -> None:
    """Record this process as the owner of a run's RAM directory, so that a later start can reclaim it
    once this process is gone (:func:`reclaim_dead_tiers`); NodeCacheError when it cannot be written."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path / TIER_OWNER, json.dumps(this_process()))
    except OSError as error:
        raise unwritable_ram_dir(path, error) from None


def remove_tier(directory: str | os.PathLike[str]) -> None:
    """Delete a run's RAM directory (its tier, control files, exchanged samples and owner record)."""
    shutil.rmtree(directory, ignore_errors=True)


def reclaim_dead_tiers(root: str | os.PathLike[str]) -> list[tuple[Path, str]]:
    """Delete the run directories under ``root`` (``data.ram_dir``) whose owner has ended on this host.

    Returns (directory, owner) of each one removed. Directories owned by a live process, by another
    host, or without an owner record are left alone.
    """
    removed: list[tuple[Path, str]] = []
    try:
        entries = sorted(Path(root).expanduser().iterdir())
    except OSError:
        return removed
    for entry in entries:
        try:
            owner = json.loads((entry / TIER_OWNER).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict) and is_gone(owner) is True:
            remove_tier(entry)
            removed.append((entry, describe(owner)))
    return removed


def unwritable_ram_dir(path: Path, error: OSError) -> NodeCacheError:
    """The one-line error for a RAM directory that cannot be written, naming the setting to change."""
    return NodeCacheError(
        f"cannot write to data.ram_dir {path} ({error.strerror or error}); "
        "set --data.ram-dir to a writable directory (e.g. under /dev/shm)"
    )


def wait_until_prepared(ram_dir: Path, run_token: str, timeout: float) -> None:
    """Wait until local rank 0 has prepared the node cache in ``ram_dir`` for the run ``run_token`` (its
    ``ready`` file names the run); ``KaisokuError`` after ``timeout`` seconds."""
    ready = ram_dir / "ready"
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        try:
            if ready.read_text() == run_token:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise KaisokuError(
                f"the node cache in {ram_dir} was not prepared by local rank 0 within "
                f"{timeout:.0f} s; every rank of a node must use the same data.ram_dir and run"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
