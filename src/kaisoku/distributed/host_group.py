"""The job's hosts as ``kaisoku probe`` sees them under torchrun or srun: one rank per host leads.

Every rank of the job joins the default process group (gloo: the probe moves bytes between hosts, never
tensors on a device); the ranks of local rank 0, one per host, form the hosts' group. The hosts measure
in step (:meth:`HostGroup.barrier`), time point-to-point transfers over every ordered pair of hosts, one
pair at a time (:meth:`HostGroup.link_rates`), and gather what they measured on host 0.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from kaisoku.distributed.env import ProcessGroupInit, world_from_env

_CALIBRATE_BYTES = 64 << 10
_MIN_BYTES, _MAX_BYTES = 128 << 10, 64 << 20


class HostGroup:
    """The hosts of a torchrun or srun job, joined for the probe (see the module docstring).

    ``timeout_s`` bounds every collective: a host that never arrives stops the others with torch's error
    after that long. Use as a context manager; leaving it leaves the process group.
    """

    def __init__(self, timeout_s: float) -> None:
        self.world = world_from_env()
        ProcessGroupInit(self.world, torch.device("cpu"), timeout_s, background=False).wait()
        seats = [None] * self.world.world_size
        dist.all_gather_object(seats, (self.world.local_rank, socket.gethostname()))
        self.leaders: list[int] = [rank for rank, (local, _) in enumerate(seats) if local == 0]  # type: ignore[misc]
        names = [seats[rank][1] for rank in self.leaders]  # type: ignore[index]
        # Hosts that share a name (containers, one machine in a test) are told apart by their index.
        self.names: list[str] = [
            f"{name}#{i}" if names.count(name) > 1 else name for i, name in enumerate(names)
        ]
        # Every rank takes part in creating a group, member or not (torch's rule).
        self._group = dist.new_group(self.leaders)
        self.host = self.leaders.index(self.world.rank) if self.world.rank in self.leaders else -1

    @property
    def leads(self) -> bool:
        """Whether this rank measures for its host (its local rank is 0)."""
        return self.host >= 0

    @property
    def hosts(self) -> int:
        """Hosts in the job."""
        return len(self.leaders)

    def barrier(self) -> None:
        """Wait for every host (hosts only)."""
        dist.barrier(group=self._group)

    def all_hosts(self, obj: object) -> list[Any]:
        """Every host's ``obj``, in host order (hosts only)."""
        out: list[Any] = [None] * self.hosts
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _transfer(self, sender: int, receiver: int, nbytes: int) -> float:
        """Seconds, on the receiver, from asking for ``nbytes`` to holding them (0.0 on the sender)."""
        src, dst = self.leaders[sender], self.leaders[receiver]
        if self.host == receiver:
            start = time.perf_counter()
            dist.send(torch.tensor([nbytes], dtype=torch.int64), dst=src)
            dist.recv(torch.empty(nbytes, dtype=torch.uint8), src=src)
            return time.perf_counter() - start
        ask = torch.empty(1, dtype=torch.int64)
        dist.recv(ask, src=dst)
        dist.send(torch.zeros(int(ask.item()), dtype=torch.uint8), dst=dst)
        return 0.0

    def link_rates(self, seconds: float, repeats: int) -> list[list[list[float]]]:
        """Bytes/s from host ``i`` to host ``j`` in each of ``repeats`` transfers, as ``rates[i][j]`` (empty
        on the diagonal), on every host (hosts only).

        The pairs go one at a time in a fixed order, each in ``seconds / pairs`` or a little more: a
        64 KiB transfer first sizes the timed ones (128 KiB to 64 MiB each); the receiver times each one
        from its request to the last byte, so a link's round trip is in the figure as a sender sees it.
        """
        n = self.hosts
        pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
        share = seconds / max(1, len(pairs)) / (repeats + 1)
        mine: dict[tuple[int, int], list[float]] = {}
        for sender, receiver in pairs:
            self.barrier()
            if self.host not in (sender, receiver):
                continue
            first = self._transfer(sender, receiver, _CALIBRATE_BYTES)
            # The receiver decides the size; the sender learns it with each request.
            size = int(min(_MAX_BYTES, max(_MIN_BYTES, _CALIBRATE_BYTES / max(first, 1e-6) * share)))
            rates = []
            for _ in range(repeats):
                taken = self._transfer(sender, receiver, size)
                if self.host == receiver:
                    rates.append(size / taken)
            if rates:
                mine[(sender, receiver)] = rates
        gathered = self.all_hosts(mine)
        table: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(n)]
        for measured in gathered:
            for (i, j), rates in measured.items():
                table[i][j] = rates
        return table

    def close(self) -> None:
        """Wait for every rank, then leave the process group."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def __enter__(self) -> HostGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif dist.is_initialized():
            dist.destroy_process_group()
