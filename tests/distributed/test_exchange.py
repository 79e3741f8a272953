"""Partial shuffle's exchange: records travel between "nodes" as bytes; no source reads for them."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from kaisoku.data.node_cache.cache import NodeCache
from kaisoku.data.order.exchange import RecordStore, exchange_for_epoch, plan_exchange
from kaisoku.data.order.sampler import EpochSampler, rank_batches
from kaisoku.data.order.shuffle import ShuffleSpec, partial_plan, shard_of
from kaisoku.testing.cluster import ClusterBox, unavailable_reason
from tests.cluster.box_runs import REPO, box_env, finish
from tests.data.node_cache.test_cache import RECORD, make_source, read_record, record_bytes
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


def test_record_store_maps_records_by_index(tmp_path: Path) -> None:
    records = {17: b"seventeen", 3: b"three", 40: b""}
    store = RecordStore.write(records, tmp_path / "received.bin")
    copy = pickle.loads(pickle.dumps(store))  # as a DataLoader worker gets it
    for index, data in records.items():
        assert index in copy and bytes(copy[index]) == data
    assert 4 not in copy and "3" not in copy and sorted(copy) == [3, 17, 40]
    with pytest.raises(KeyError):
        copy[4]
    empty = RecordStore.write({}, tmp_path / "none.bin")
    assert len(empty) == 0 and 1 not in empty
    store.remove()
    assert not (tmp_path / "received.bin").exists()


def _two_nodes(rank: int, world_size: int, tmp: Path, per_node: int, exchange: float, ram_root: str) -> dict:
    node, local_rank = divmod(rank, per_node)
    num_nodes = world_size // per_node
    paths = sorted((tmp.parent / "source").glob("shard-*.bin"))
    spec = ShuffleSpec(name="partial", exchange=exchange, num_nodes=num_nodes)
    sampler = EpochSampler(SIZES, global_batch=BATCH, rank=rank, world_size=world_size, seed=4, shuffle=spec)
    cache = NodeCache.for_sampler(
        sampler,
        paths,
        ranks_per_node=per_node,
        ram_dir=Path(ram_root) / f"node{node}",
        ram_capacity=int(SIZES.sum()) * RECORD,
        local_dir=tmp / f"local-node{node}",
        local_capacity=int(SIZES.sum()) * RECORD,
        run_token=f"{tmp}-{node}",
        num_epochs=2,
        shard_bytes=[p.stat().st_size for p in paths],
    )
    result: dict = {"consumed": [], "received": [], "source_reads": []}
    before = 0  # counters start at zero when local rank 0 prepares the node cache
    for epoch in range(2):
        sampler.set_epoch(epoch)
        cache.mark_progress(epoch, 0)
        fetch = lambda i: read_record(cache, i, SIZES)  # noqa: E731
        records = exchange_for_epoch(sampler, fetch, ranks_per_node=per_node, round_records=7)
        received = RecordStore.write(records, Path(ram_root) / f"node{node}" / f"exchange-rank{rank}.bin")
        consumed = []
        for step, batch in enumerate(sampler):
            for index in batch:
                data = bytes(received[index]) if index in received else read_record(cache, index, SIZES)
                assert data == record_bytes(index), f"record {index} corrupted"
                consumed.append(index)
            cache.mark_progress(epoch, step + 1)
        dist.barrier()
        result["consumed"].append(consumed)
        result["received"].append(len(received))
        received.remove()
        reads = cache.node_stats()["source_reads"]
        result["source_reads"].append(reads - before)
        before = reads
    result["reader_source_reads"] = cache.stats()["source_reads"]
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
        # Exact whatever the timing: a reader waits for a load the plan makes for a step it has reached.
        assert first["source_reads"][0] == first["home_shards"]
        # Epoch 1 exchanges again, served from the node's tiers and the exchanged bytes: no source reads.
        assert first["source_reads"][1] == 0
    # No rank read a record from the source itself, in either epoch (the exchange sends and the training
    # reads all came from the node's tiers).
    assert [r["reader_source_reads"] for r in results] == [0] * world


@pytest.fixture
def ram_root() -> Iterator[Path]:
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


# ------------------------------------------------------------------------- two hosts of a cluster in a box


@pytest.fixture
def two_hosts() -> Iterator[ClusterBox]:
    """Two hosts of a cluster in a box (own network, hostname and /dev/shm each) on an unshaped bridge."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with ClusterBox(2) as box:
        yield box
    assert box.leftovers() == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_hosts_over_the_network_with_torchrun(tmp_path: Path, two_hosts: ClusterBox) -> None:
    make_source(tmp_path / "source", SIZES)
    work = tmp_path / "ranks"
    work.mkdir()
    procs = [
        two_hosts.popen(
            node,
            [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
                f"--master-addr={two_hosts.members[0].name}", "--master-port=29531",
                "-m", "tests.distributed.test_exchange", str(work), "/dev/shm/kaisoku-exchange",
            ],
            env=box_env(GLOO_SOCKET_IFNAME="eth0"),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]  # fmt: skip
    outputs = finish(procs, timeout=150)
    assert all(code == 0 for code, _, _ in outputs), "\n".join(out[-3000:] for _, out, _ in outputs)
    results = [json.loads((work / f"result_{rank}.json").read_text()) for rank in range(2)]
    # Each rank ran on its own host and reached the other over the bridge (its eth0), not a shared loopback.
    assert [r["host"] for r in results] == [h.name for h in two_hosts.members]
    assert [r["interface"] for r in results] == ["eth0", "eth0"]
    _check(results, 2, 1)


def _torchrun_main(work: Path, ram_root: str) -> None:
    """A rank started by torchrun on one host of the box: the two-node exchange over the bridge."""
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    result = _two_nodes(rank, world_size, work, 1, 0.5, ram_root)
    result["interface"] = os.environ["GLOO_SOCKET_IFNAME"]
    result["host"] = socket.gethostname()
    dist.barrier()
    dist.destroy_process_group()
    (work / f"result_{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _torchrun_main(Path(sys.argv[1]), sys.argv[2])
