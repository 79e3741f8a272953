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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kaisoku.data.shuffle import shard_of
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
    def num_sent(self) -> int:
        """Records this rank sends."""
        return sum(int(x.size) for x in self.send)

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

    ``fetch_record(index)`` gives a record's raw bytes (from the node cache). The exchange goes in rounds
    of at most ``round_records`` records per pair of ranks, two ``all_to_all_single`` calls each (lengths,
    then bytes), so its transient memory stays bounded; the received records stay in RAM.
    """
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
