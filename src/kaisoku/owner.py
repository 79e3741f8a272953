"""Who owns a file or folder: host, pid and the process's start time, and whether that process is gone.

A run records its owner in ``run.json``, its run folder's lock and its RAM tier, so that a later run can
tell a folder whose owner still runs from one a killed run left behind. The start time (in clock ticks
since boot, from ``/proc/PID/stat``) guards against a pid reused by an unrelated process.
"""

from __future__ import annotations

import os
import socket
from typing import Any


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot; None if it does not exist."""
    try:
        stat = open(f"/proc/{pid}/stat", encoding="ascii", errors="replace").read()  # noqa: SIM115
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after its last ")".
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19])  # field 22 of stat(5), the 20th after the name
    except (IndexError, ValueError):
        return None


def this_process(pid: int | None = None) -> dict[str, Any]:
    """The owner record of process ``pid`` (default: this one): host, pid, start."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "pid": pid, "start": _start_ticks(pid)}


def describe(owner: dict[str, Any]) -> str:
    """``pid N on HOST``."""
    return f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}"


def is_gone(owner: dict[str, Any]) -> bool | None:
    """True when the owner's process has ended (on this host), False while it runs, None when the owner
    is on another host (it cannot be checked from here)."""
    if owner.get("host") != socket.gethostname():
        return None
    try:
        pid = int(owner["pid"])
    except (KeyError, TypeError, ValueError):
        return True  # no owner to wait for
    start = _start_ticks(pid)
    if start is None:
        return True
    recorded = owner.get("start")
    return recorded is not None and start != recorded  # the pid now belongs to another process
