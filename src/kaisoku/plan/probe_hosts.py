"""``kaisoku probe`` on every host of a job (under torchrun or srun): one profile of the whole cluster.

Each host (the rank of local rank 0 on it) runs :func:`kaisoku.plan.probe.probe` on its own view of the
shared folder, all hosts in step, so that every read pass runs on every host at once and each host's
figure is what it gets while all of them read, as in a synchronous epoch. Then the hosts time transfers
over every ordered pair of hosts (:class:`kaisoku.distributed.host_group.HostGroup`). Host 0 merges the
measurements (:func:`merge_profiles`, pure) into one cluster description:

* ``[shared_fs]``: the aggregate of all hosts at ``hosts x readers`` readers (each pass's sum), its range
  the sums of the slowest and of the fastest passes;
* ``[[host]]``: each host's own rates at the same points, its local tiers; ``kaisoku plan`` bounds a
  synchronous epoch by the slowest host in it;
* ``[network]``: ``links_MBps[i][j]``, host ``i`` to host ``j`` (median of the transfers), with
  ``_low``/``_high`` matrices; ``node_bandwidth_MBps`` the median link;
* ``[local]`` and ``[ram]``: the smallest and slowest of the hosts'.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kaisoku.errors import ConfigError
from kaisoku.plan.probe import REPEATS, is_writable, probe


def _summed(profiles: Sequence[dict[str, Any]], key: str, digits: int) -> list[float]:
    """Per reader count: the sum over hosts of each host's ``shared_fs[key]``."""
    columns = zip(*(p["shared_fs"][key] for p in profiles), strict=True)
    return [round(sum(column), digits) for column in columns]


def merge_profiles(
    profiles: Sequence[dict[str, Any]], links: Sequence[Sequence[Sequence[float]]], names: Sequence[str]
) -> dict[str, Any]:
    """One cluster profile from the hosts' own profiles (measured together, in host order), the link
    transfers ``links[i][j]`` (bytes/s of each transfer from host ``i`` to ``j``; empty on the diagonal)
    and the hosts' names. See the module docstring for what goes where."""
    hosts = len(profiles)
    if hosts < 1 or len(links) != hosts or len(names) != hosts:
        raise ValueError(f"{hosts} profiles, {len(links)} link rows and {len(names)} names must agree")
    first = profiles[0]
    per_host_readers = first["shared_fs"]["readers"]
    shared = {
        "readers": [hosts * r for r in per_host_readers],
        **{
            key: _summed(profiles, key, digits)
            for base, digits in (("seq_read_MBps", 2), ("small_reads_per_s", 1))
            for key in (base, f"{base}_low", f"{base}_high")
        },
        "small_file_bytes": first["shared_fs"]["small_file_bytes"],
    }

    def matrix(pick: Callable[[Sequence[float]], float]) -> list[list[float]]:
        return [
            [0.0 if i == j or not links[i][j] else round(pick(links[i][j]) / 1e6, 3) for j in range(hosts)]
            for i in range(hosts)
        ]

    network: dict[str, Any] = dict(first["network"])
    if hosts > 1:
        middle, low, high = matrix(statistics.median), matrix(min), matrix(max)
        off = [(i, j) for i in range(hosts) for j in range(hosts) if i != j]
        network = {
            "node_bandwidth_MBps": round(statistics.median(middle[i][j] for i, j in off), 3),
            "node_bandwidth_MBps_low": min(low[i][j] for i, j in off),
            "node_bandwidth_MBps_high": max(high[i][j] for i, j in off),
            "links_MBps": middle,
            "links_MBps_low": low,
            "links_MBps_high": high,
        }
    host_tables = [
        {
            "name": name,
            "seq_read_MBps": p["shared_fs"]["seq_read_MBps"],
            "small_reads_per_s": p["shared_fs"]["small_reads_per_s"],
            "local_read_MBps": p["local"]["read_MBps"],
            "local_write_MBps": p["local"]["write_MBps"],
            "ram_bandwidth_MBps": p["ram"]["bandwidth_MBps"],
        }
        for name, p in zip(names, profiles, strict=True)
    ]
    probe_notes = dict(first["probe"])
    probe_notes.update(
        hosts=list(names),
        host_method=(
            f"every host probed its own view of {first['probe']['path']} at once, each read pass started "
            "together (a barrier): a host's figure is its rate while every host reads; shared_fs is their "
            "sum at hosts x readers readers"
        ),
        network_method=(
            f"host i sends to host j, one ordered pair at a time, {REPEATS} timed transfers per pair sized "
            "by a 64 KiB one (torch.distributed send/recv over gloo), timed on the receiver from its "
            "request to the last byte"
        ),
    )
    probe_notes.pop("host", None)
    return {
        "cluster": {**first["cluster"], "name": f"probe of {first['probe']['path']} on {hosts} hosts",
                    "nodes": hosts},
        "shared_fs": shared,
        "network": network,
        "local": {
            "path": first["local"]["path"],
            "capacity": min(p["local"]["capacity"] for p in profiles),
            "read_MBps": min(p["local"]["read_MBps"] for p in profiles),
            "write_MBps": min(p["local"]["write_MBps"] for p in profiles),
        },
        "ram": {
            "capacity": min(p["ram"]["capacity"] for p in profiles),
            "bandwidth_MBps": min(p["ram"]["bandwidth_MBps"] for p in profiles),
        },
        "host": host_tables,
        "probe": probe_notes,
    }  # fmt: skip


def probe_job(
    path: str | Path,
    *,
    seconds: float,
    local: str | Path | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> dict[str, Any] | None:
    """Probe every host of this torchrun or srun job (see the module docstring); the merged profile on
    host 0, None on every other rank. ``seconds``: each host's budget for the file system and tiers; the
    links take up to a quarter more."""
    # start-up: torch.distributed loads only when a probe runs across hosts
    from kaisoku.distributed.host_group import HostGroup

    root = Path(path)
    # Every collective waits for the slowest host's probe, which runs up to about twice its budget.
    with HostGroup(timeout_s=max(300.0, 4 * seconds)) as hosts:
        if not hosts.leads:
            return None
        writable = hosts.all_hosts(root.is_dir() and is_writable(root))
        if len(set(writable)) > 1:
            differ = ", ".join(f"{n} {'can' if w else 'cannot'}" for n, w in zip(hosts.names, writable))
            raise ConfigError(f"kaisoku probe: the hosts do not all see {root} alike ({differ} write there)")
        own = probe(root, seconds=seconds, local=local, progress=progress, sync=hosts.barrier)
        links = hosts.link_rates(seconds / 4, REPEATS) if hosts.hosts > 1 else [[[]]]
        profiles = hosts.all_hosts(own)
        return merge_profiles(profiles, links, hosts.names) if hosts.host == 0 else None
