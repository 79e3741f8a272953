"""Partial shuffle's exchange: records travel between "nodes" as bytes; no source reads for them."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from kaisoku.data.cache import NodeCache, StagingSchedule, sampler_trace_fn
from kaisoku.data.exchange import exchange_records, plan_exchange
from kaisoku.data.sampler import EpochSampler, rank_batches
from kaisoku.data.shuffle import ShuffleSpec, partial_plan, shard_of
from tests.data.test_cache import RECORD, make_source, read_record, record_bytes
from tests.dist_harness import run_ranks

SIZES = np.full(12, 40, dtype=np.int64)
BATCH = 24


def test_plans_of_all_ranks_pair_up() -> None:
    plan = partial_plan(SIZES, 2, 1, num_nodes=2, exchange=0.5, global_batch=BATCH)
    order = plan.global_order()
    world, per_node = 4, 2
    plans = [
        plan_exchange(
            order,
            global_batch=BATCH,
            world_size=world,
            ranks_per_node=per_node,
            home_of_shard=plan.home_of_shard,
            shard_sizes=SIZES,
            rank=r,
            start_step=1,
        )
        for r in range(world)
    ]
    for src in range(world):
        for dst in range(world):
            assert np.array_equal(plans[src].send[dst], plans[dst].recv[src])
            homes = plan.home_of_shard[shard_of(plans[src].send[dst], SIZES)]
            assert (homes == src // per_node).all() and (homes != dst // per_node).all()
    for rank in range(world):
        mine = rank_batches(order, BATCH, rank, world, start_step=1).reshape(-1)
        foreign = mine[plan.home_of_shard[shard_of(mine, SIZES)] != rank // per_node]
        received = np.concatenate(plans[rank].recv)
        assert sorted(received.tolist()) == sorted(foreign.tolist())
        assert plans[rank].num_received > 0


def _two_nodes(rank: int, world_size: int, tmp: Path, per_node: int, exchange: float, ram_root: str) -> dict:
    node, local_rank = divmod(rank, per_node)
    num_nodes = world_size // per_node
    paths = sorted((tmp.parent / "source").glob("shard-*.bin"))
    spec = ShuffleSpec(name="partial", exchange=exchange, num_nodes=num_nodes)
    sampler = EpochSampler(SIZES, global_batch=BATCH, rank=rank, world_size=world_size, seed=4, shuffle=spec)
    trace_of = sampler_trace_fn(sampler, node=node, ranks_per_node=per_node)
    cache = NodeCache(
        paths,
        ram_dir=Path(ram_root) / f"node{node}",
        ram_capacity=int(SIZES.sum()) * RECORD,
        local_dir=tmp / f"local-node{node}",
        local_capacity=int(SIZES.sum()) * RECORD,
        local_rank=local_rank,
        ranks_per_node=per_node,
        schedule=StagingSchedule(trace_of, num_epochs=2),
        run_token=f"{tmp}-{node}",
    )
    result: dict = {"consumed": [], "received": [], "source_reads": []}
    before = 0  # counters start at zero when local rank 0 prepares the node cache
    for epoch in range(2):
        sampler.set_epoch(epoch)
        cache.mark_progress(epoch, 0)
        plan = plan_exchange(
            sampler.epoch_order(epoch),
            global_batch=BATCH,
            world_size=world_size,
            ranks_per_node=per_node,
            home_of_shard=sampler.partial_plan(epoch).home_of_shard,
            shard_sizes=SIZES,
            rank=rank,
        )
        received = exchange_records(plan, lambda i: read_record(cache, i, SIZES), round_records=7)
        consumed = []
        for step, batch in enumerate(sampler):
            for index in batch:
                data = received[index] if index in received else read_record(cache, index, SIZES)
                assert data == record_bytes(index), f"record {index} corrupted"
                consumed.append(index)
            cache.mark_progress(epoch, step + 1)
        dist.barrier()
        result["consumed"].append(consumed)
        result["received"].append(len(received))
        reads = cache.node_stats()["source_reads"]
        result["source_reads"].append(reads - before)
        before = reads
    dist.barrier()
    cache.close()
    result["home_shards"] = int((sampler.partial_plan(0).home_of_shard == node).sum())
    return result


def _check(results: list[dict], world: int, per_node: int) -> None:
    for epoch in range(2):
        sampler = EpochSampler(
            SIZES,
            global_batch=BATCH,
            rank=0,
            world_size=world,
            seed=4,
            shuffle=ShuffleSpec(name="partial", exchange=0.5, num_nodes=world // per_node),
        )
        consumed = [i for r in results for i in r["consumed"][epoch]]
        assert sorted(consumed) == sorted(sampler.epoch_order(epoch).tolist())
        assert all(r["received"][epoch] > 0 for r in results)
    for node in range(world // per_node):
        first = results[node * per_node]
        # Epoch 0: each home shard read from the source once (by the node's stager), foreign ones never.
        assert first["source_reads"][0] == first["home_shards"]
        # Epoch 1 exchanges again, served from the node's tiers and the exchanged bytes: no source reads.
        assert first["source_reads"][1] == 0


@pytest.fixture
def ram_root() -> Path:
    path = Path("/dev/shm") / f"kaisoku-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(120)
def test_two_nodes_one_rank_each(tmp_path: Path, ram_root: Path) -> None:
    make_source(tmp_path / "source", SIZES)
    results = run_ranks(_two_nodes, 2, tmp_path, 1, 0.5, str(ram_root), timeout=100)
    _check(results, 2, 1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_nodes_two_ranks_each(tmp_path: Path, ram_root: Path) -> None:
    make_source(tmp_path / "source", SIZES)
    results = run_ranks(_two_nodes, 4, tmp_path, 2, 0.5, str(ram_root), timeout=150)
    _check(results, 4, 2)
