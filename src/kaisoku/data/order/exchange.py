"""Inter-node sample exchange for the ``partial`` shuffle: records travel as bytes between ranks.

Each epoch of ``partial`` deals some samples to nodes that do not hold their shards. Before the epoch, the
ranks swap those records over torch.distributed (``all_to_all_single`` on uint8 tensors, which gloo and
NCCL both support with uneven splits; gloo's list ``all_to_all`` needs equal sizes), and the receiving rank
keeps them in RAM for the epoch. Nobody reads them from the source: the sender reads them from its node's
cache, where its home shards are staged.

Who sends what (:func:`plan_exchange`, pure): a sample consumed by rank ``d`` whose shard lives on another
node ``h`` is sent by rank ``h * R + d % R`` (the rank with ``d``'s local index on the home node; ``R`` ranks
per node, contiguous rank numbers per node). Every rank computes the same plan from the epoch's order.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kaisoku.data.order.sampler import EpochSampler
from kaisoku.data.order.shuffle import shard_of
from kaisoku.errors import KaisokuError


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's part of an epoch's exchange.

    ``send[d]``: sample indices this rank sends to rank ``d``, in order; ``recv[s]``: those it receives
    from rank ``s``, in the order ``s`` sends them.
    """

    rank: int
    send: tuple[np.ndarray, ...]
    recv: tuple[np.ndarray, ...]

    @property
    def num_received(self) -> int:
        """Records this rank receives."""
        return sum(int(x.size) for x in self.recv)


def plan_exchange(
    order: np.ndarray,
    *,
    global_batch: int,
    world_size: int,
    ranks_per_node: int,
    home_of_shard: np.ndarray,
    shard_sizes: Any,
    rank: int,
    start_step: int = 0,
) -> ExchangePlan:
    """Which records ``rank`` sends and receives for the steps from ``start_step`` of ``order``.

    ``home_of_shard[s]`` is the node holding shard ``s`` (``PartialPlan.home_of_shard``).
    """
    if world_size % ranks_per_node or global_batch % world_size:
        raise KaisokuError(
            f"world size {world_size} must be a multiple of ranks per node {ranks_per_node}, and the global "
            f"batch {global_batch} a multiple of the world size"
        )
    local = global_batch // world_size
    steps = len(order) // global_batch
    grid = np.asarray(order[: steps * global_batch]).reshape(steps, global_batch)[start_step:]
    home_of_shard = np.asarray(home_of_shard, dtype=np.int64)
    if int(home_of_shard.max()) >= world_size // ranks_per_node:
        raise KaisokuError(
            f"the epoch's partition has {int(home_of_shard.max()) + 1} nodes but the world has "
            f"{world_size // ranks_per_node}; skip the exchange for an epoch resumed on another node count"
        )
    my_node = rank // ranks_per_node
    send: list[np.ndarray] = []
    for dest in range(world_size):
        samples = grid[:, dest * local : (dest + 1) * local].reshape(-1)
        home = home_of_shard[shard_of(samples, shard_sizes)]
        sender = home * ranks_per_node + dest % ranks_per_node
        foreign = home != dest // ranks_per_node
        send.append(samples[foreign & (sender == rank)] if home.size else samples[:0])
    mine = grid[:, rank * local : (rank + 1) * local].reshape(-1)
    home = home_of_shard[shard_of(mine, shard_sizes)]
    sender = home * ranks_per_node + rank % ranks_per_node
    foreign = home != my_node
    recv = tuple(mine[foreign & (sender == src)] for src in range(world_size))
    return ExchangePlan(rank, tuple(send), recv)


def exchange_records(
    plan: ExchangePlan,
    fetch_record: Callable[[int], bytes],
    *,
    group: dist.ProcessGroup | None = None,
    round_records: int = 4096,
) -> dict[int, bytes]:
    """Run ``plan`` collectively (every rank of ``group`` calls it); return the received records by index.

    ``group`` must have gloo (the records are CPU tensors): with an NCCL default group pass a gloo group.
    ``fetch_record(index)`` gives a record's raw bytes (from the node cache). The exchange goes in rounds
    of at most ``round_records`` records per pair of ranks, two ``all_to_all_single`` calls each (lengths,
    then bytes), so its transient memory stays bounded; the received records stay in RAM.
    """
    backend = str(dist.get_backend(group))
    if "gloo" not in backend:
        raise KaisokuError(
            f"the sample exchange sends CPU tensors and needs a gloo process group, got {backend}; "
            "pass group=torch.distributed.new_group(backend='gloo')"
        )
    world_size = dist.get_world_size(group)
    if len(plan.send) != world_size or plan.rank != dist.get_rank(group):
        raise KaisokuError(
            f"exchange plan for rank {plan.rank} of {len(plan.send)} used on rank {dist.get_rank(group)} "
            f"of {world_size}"
        )
    busiest = max(int(x.size) for x in (*plan.send, *plan.recv))
    rounds = torch.tensor([math.ceil(busiest / round_records)], dtype=torch.int64)
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=group)
    received: dict[int, bytes] = {}
    for round_index in range(int(rounds.item())):
        window = slice(round_index * round_records, (round_index + 1) * round_records)
        send_ids = [x[window] for x in plan.send]
        recv_ids = [x[window] for x in plan.recv]
        records = [[fetch_record(int(i)) for i in ids] for ids in send_ids]
        send_lengths = torch.tensor([len(r) for rs in records for r in rs], dtype=torch.int64)
        recv_lengths = torch.empty(sum(int(x.size) for x in recv_ids), dtype=torch.int64)
        dist.all_to_all_single(
            recv_lengths,
            send_lengths,
            output_split_sizes=[int(x.size) for x in recv_ids],
            input_split_sizes=[int(x.size) for x in send_ids],
            group=group,
        )
        payload = b"".join(r for rs in records for r in rs)
        send_bytes = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload
            else torch.empty(0, dtype=torch.uint8)
        )
        recv_bytes = torch.empty(int(recv_lengths.sum()), dtype=torch.uint8)
        lengths = recv_lengths.tolist()
        recv_splits: list[int] = []
        start = 0
        for ids in recv_ids:
            recv_splits.append(int(sum(lengths[start : start + ids.size])))
            start += ids.size
        dist.all_to_all_single(
            recv_bytes,
            send_bytes,
            output_split_sizes=recv_splits,
            input_split_sizes=[sum(len(r) for r in rs) for rs in records],
            group=group,
        )
        data = recv_bytes.numpy().tobytes()
        offset = 0
        for index, length in zip(np.concatenate(recv_ids).tolist() if recv_ids else [], lengths):
            received[int(index)] = data[offset : offset + length]
            offset += length
    return received


def exchange_for_epoch(
    sampler: EpochSampler,
    fetch_record: Callable[[int], bytes],
    *,
    ranks_per_node: int,
    group: dist.ProcessGroup | None = None,
    round_records: int = 4096,
) -> dict[int, bytes]:
    """The records this rank receives for the rest of the sampler's current epoch (collective).

    Empty, with no communication, unless the epoch is ``partial`` with Q > 0 over several nodes and was
    ordered for this world's nodes (a ``partial`` epoch resumed on another node count reads through the
    cache instead). Call it on every rank after ``set_epoch`` (or ``load_state_dict``), before iterating.
    """
    epoch = sampler.epoch
    spec = sampler.spec_for(epoch)
    if not spec.exchanges or not sampler.layout_matches(epoch):
        return {}
    plan = plan_exchange(
        sampler.epoch_order(epoch),
        global_batch=sampler.global_batch,
        world_size=sampler.world_size,
        ranks_per_node=ranks_per_node,
        home_of_shard=sampler.partial_plan(epoch).home_of_shard,
        shard_sizes=sampler.shard_sizes,
        rank=sampler.rank,
        start_step=sampler.step,
    )
    return exchange_records(plan, fetch_record, group=group, round_records=round_records)


class RecordStore(Mapping[int, memoryview]):
    """Received records in one file, by sample index: put it on /dev/shm to keep them in RAM.

    Picklable (DataLoader workers map the same file instead of holding copies); the index arrays travel
    with it, the bytes stay in the file. Build it with :meth:`write`; delete the file with :meth:`remove`.
    """

    def __init__(self, path: str | os.PathLike[str], indices: np.ndarray, offsets: np.ndarray) -> None:
        self.path = Path(path)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self._view: memoryview | None = None
        self._pid = os.getpid()

    @classmethod
    def write(cls, records: Mapping[int, bytes], path: str | os.PathLike[str]) -> RecordStore:
        """Write ``records`` to ``path`` (sorted by index) and return the store over it."""
        indices = np.array(sorted(records), dtype=np.int64)
        lengths = np.array([len(records[int(i)]) for i in indices], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        with open(tmp, "wb") as handle:
            for index in indices.tolist():
                handle.write(records[index])
        os.replace(tmp, target)
        return cls(target, indices, offsets)

    def _data(self) -> memoryview:
        if self._view is None or self._pid != os.getpid():
            self._pid = os.getpid()
            if self.offsets[-1] == 0:
                self._view = memoryview(b"")
            else:
                with open(self.path, "rb") as handle:
                    self._view = memoryview(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
        return self._view

    def _position(self, index: int) -> int:
        position = int(np.searchsorted(self.indices, index))
        if position == self.indices.size or self.indices[position] != index:
            raise KeyError(index)
        return position

    def __getitem__(self, index: int) -> memoryview:
        position = self._position(int(index))
        return self._data()[self.offsets[position] : self.offsets[position + 1]]

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, int | np.integer):
            return False
        position = int(np.searchsorted(self.indices, index))
        return position < self.indices.size and self.indices[position] == index

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices.tolist())

    def __len__(self) -> int:
        return int(self.indices.size)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "indices": self.indices, "offsets": self.offsets}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["indices"], state["offsets"])  # type: ignore[misc]

    def remove(self) -> None:
        """Delete the file (after the epoch; mappings still open stay valid until dropped)."""
        self._view = None
        self.path.unlink(missing_ok=True)
