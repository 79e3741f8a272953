"""The collectives K-FAC needs: bucketed asynchronous all-reduce and broadcasts from owners."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kaisoku.optim.kfac.assignment import bucket_plan


@dataclass(frozen=True)
class Communicator:
    """The process group K-FAC's collectives run on, with this process's rank and the group's size.

    ``group`` is handed to every collective as is: ``None`` there means torch.distributed's default
    group. ``rank`` and ``world_size`` are this process's rank in ``group`` and the group's size; a
    single process (torch.distributed not initialized) is rank 0 of 1 and runs no collective.
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int

    @property
    def distributed(self) -> bool:
        """True when there is more than one rank to talk to."""
        return self.world_size > 1


def resolve_group(process_group: dist.ProcessGroup | None) -> Communicator:
    """The communicator for ``process_group``, with rank and size taken from that group.

    ``None`` means what it means to torch.distributed: the default group when torch.distributed is
    initialized, else a single process. Raises ``ValueError`` when this process is not a member of the
    group passed in.
    """
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return Communicator(None, 0, 1)
    rank = dist.get_rank(group=process_group)
    if rank < 0:
        raise ValueError("this process is not a member of the process group handed to K-FAC")
    return Communicator(process_group, rank, dist.get_world_size(group=process_group))


class BucketedAllReduce:
    """Sum lists of tensors over the ranks, flattened into few buffers, all in flight at once.

    ``items[i]`` is the list of tensors of item ``i`` (say, one layer's factor sums and counts). An
    item never spans two buckets, so iterating yields items as soon as their bucket has arrived and the
    caller can work on them while later buckets are still on the wire. The input tensors are not
    modified; the yielded ones are views into the reduced buffers.
    """

    def __init__(
        self, items: Sequence[Sequence[torch.Tensor]], comm: Communicator, bucket_elements: int
    ) -> None:
        self._items = items
        self._comm = comm
        sizes = [sum(t.numel() for t in tensors) for tensors in items]
        self._plan = bucket_plan(sizes, bucket_elements) if items else []
        self._buffers: list[torch.Tensor] = []
        self._works: list[dist.Work | None] = []
        self.wait_seconds = 0.0
        for bucket in self._plan:
            flat = torch.cat([t.reshape(-1) for i in bucket for t in items[i]])
            work = dist.all_reduce(flat, group=comm.group, async_op=True) if comm.distributed else None
            self._buffers.append(flat)
            self._works.append(work)

    def __iter__(self) -> Iterator[tuple[int, list[torch.Tensor]]]:
        for bucket, flat, work in zip(self._plan, self._buffers, self._works):
            if work is not None:
                start = time.perf_counter()
                work.wait()
                self.wait_seconds += time.perf_counter() - start
            offset = 0
            for index in bucket:
                reduced: list[torch.Tensor] = []
                for tensor in self._items[index]:
                    reduced.append(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
                yield index, reduced


def broadcast_from_owners(per_rank: Sequence[Sequence[torch.Tensor]], comm: Communicator) -> float:
    """Fill ``per_rank[r]`` on every rank with rank ``r``'s tensors; returns seconds spent waiting.

    On rank ``r`` the tensors of ``per_rank[r]`` hold the values to send; elsewhere they are buffers of
    the same shapes and dtype float32, overwritten in place. One flat broadcast per owning rank, all
    issued before any is waited on.
    """
    if not comm.distributed:
        return 0.0
    pending: list[tuple[int, torch.Tensor, dist.Work, Sequence[torch.Tensor]]] = []
    for owner, tensors in enumerate(per_rank):
        if not tensors:
            continue
        if owner == comm.rank:
            flat = torch.cat([t.reshape(-1).float() for t in tensors])
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32, device=tensors[0].device)
        work = dist.broadcast(flat, group=comm.group, async_op=True, group_src=owner)
        pending.append((owner, flat, work, tensors))
    start = time.perf_counter()
    for owner, flat, work, tensors in pending:
        work.wait()
        if owner == comm.rank:
            continue
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
    return time.perf_counter() - start


def agree_max(values: Sequence[float], comm: Communicator, device: torch.device) -> list[float]:
    """The element-wise maximum of ``values`` over the ranks (the values themselves on one process).

    Every rank gets the same floats, so a pure function of them gives the same answer everywhere.
    """
    if not comm.distributed:
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=comm.group)
    return [float(v) for v in tensor.tolist()]
