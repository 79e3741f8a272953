"""Which host did what: ``RUN_DIR/hosts.json`` records every attempt's ranks and hosts, and a world that
changed size since the previous attempt (a host lost, or one joining at an elastic restart) is said in
one line, kept in the attempt as ``change``.

``hosts.json``::

    {"attempts": [{"attempt": 0, "world_size": 4, "num_nodes": 2, "start_step": 0,
                   "hosts": {"kbox-node0": [0, 1], "kbox-node1": [2, 3]},
                   "change": "world size 2 -> 4 (joined kbox-node1); 2 hosts continue from step 40",
                   "ranks": [{"rank": 0, "node": 0, "local_rank": 0, "host": "kbox-node0", "pid": 81}, ...],
                   "data": {"0": {"source_reads": 3, ...}, ...}}, ...]}

``data`` (filled when the attempt ends) holds each rank's node-cache counters: what it read from the shared
source and from its host's tiers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from pathlib import Path
from typing import Any

from kaisoku.distributed import env
from kaisoku.fsutil import atomic_write_text

HOSTS_FILE = "hosts.json"
_ADDRESS = re.compile(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])")
_LOST_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Connection refused", "Broken pipe")


def host_address() -> str:
    """This host's address as its name resolves (what peers see in a connection error); "" if none."""
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return ""


def _read(run_dir: Path) -> dict[str, Any]:
    try:
        state = json.loads((run_dir / HOSTS_FILE).read_text())
    except (OSError, ValueError):
        return {"attempts": []}
    return state if isinstance(state.get("attempts"), list) else {"attempts": []}


def hosts_of(ranks: list[dict[str, Any]]) -> dict[str, list[int]]:
    """``{host: [ranks]}`` in node order."""
    out: dict[str, list[int]] = {}
    for entry in sorted(ranks, key=lambda e: (e["node"], e["rank"])):
        out.setdefault(str(entry["host"]), []).append(int(entry["rank"]))
    return out


def world_change(previous: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """What changed when the world size differs from the previous attempt's, naming the hosts lost and
    gained (``world size 2 -> 1 (lost NAME); 1 host continue from step S``); None when it did not."""
    if previous is None or previous["world_size"] == current["world_size"]:
        return None
    before, after = set(previous["hosts"]), set(current["hosts"])
    changes = []
    if before - after:
        changes.append(f"lost {', '.join(sorted(before - after))}")
    if after - before:
        changes.append(f"joined {', '.join(sorted(after - before))}")
    said = f" ({'; '.join(changes)})" if changes else ""
    return (
        f"world size {previous['world_size']} -> {current['world_size']}{said}; "
        f"{current['num_nodes']} host{'s' if current['num_nodes'] != 1 else ''} continue from step "
        f"{current['start_step']}"
    )


def record_start(run_dir: Path, world: env.World, *, attempt: int, start_step: int) -> str | None:
    """Gather every rank's host (a collective: call on every rank); rank 0 appends the attempt to
    ``hosts.json``. Returns, on rank 0, what changed when the world changed size (None otherwise)."""
    mine = {
        "rank": world.rank,
        "node": world.node,
        "local_rank": world.local_rank,
        "host": socket.gethostname(),
        "address": host_address(),
        "pid": os.getpid(),
    }
    ranks = [dict(entry) for entry in env.all_gather_object(mine)]  # type: ignore[call-overload]
    if not world.is_main:
        return None
    state = _read(run_dir)
    previous = state["attempts"][-1] if state["attempts"] else None
    current = {
        "attempt": attempt,
        "world_size": world.world_size,
        "num_nodes": world.num_nodes,
        "start_step": start_step,
        "hosts": hosts_of(ranks),
        "ranks": ranks,
    }
    change = world_change(previous, current)
    if change is not None:
        current["change"] = change
    state["attempts"].append(current)
    atomic_write_text(run_dir / HOSTS_FILE, json.dumps(state, indent=1))
    return change


def name_lost_host(run_dir: Path, cause: str) -> str:
    """``cause`` (a rank's lost-peer line) as ``lost host NAME (ranks ...): how`` when the peer's address in
    it is a host of the newest attempt in ``hosts.json``; ``cause`` unchanged otherwise."""
    ranks = newest_attempt(run_dir).get("ranks", [])
    here = socket.gethostname()
    for address in _ADDRESS.findall(cause):
        lost = [entry for entry in ranks if entry.get("address") == address and entry.get("host") != here]
        if lost:
            name = lost[0]["host"]
            numbers = ", ".join(str(entry["rank"]) for entry in lost)
            how = next((sign.lower() for sign in _LOST_SIGNS if sign in cause), "no answer")
            return f"lost host {name} (rank{'s' if len(lost) > 1 else ''} {numbers}): {how} from {address}"
    return cause


def newest_attempt(run_dir: Path) -> dict[str, Any]:
    """The newest attempt recorded in ``hosts.json`` (empty when there is none)."""
    attempts = _read(run_dir)["attempts"]
    return attempts[-1] if attempts else {}


def record_end(run_dir: Path, world: env.World, data: dict[str, int]) -> None:
    """Gather every rank's data counters (a collective) into the newest attempt of ``hosts.json``."""
    gathered = env.all_gather_object(data)
    if not world.is_main:
        return
    state = _read(run_dir)
    if state["attempts"]:
        state["attempts"][-1]["data"] = {str(rank): counters for rank, counters in enumerate(gathered)}
        atomic_write_text(run_dir / HOSTS_FILE, json.dumps(state, indent=1))
