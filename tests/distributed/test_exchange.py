"""Partial shuffle's exchange: records travel between "nodes" as bytes; no source reads for them."""

from __future__ import annotations

import json
import os
import pickle
import shutil
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


# ------------------------------------------------------------------ two network namespaces joined by a veth

REPO = Path(__file__).resolve().parents[2]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, check=False)


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two network namespaces joined by a veth pair: (namespace, interface, address) for each."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"ks{tag}a", f"ks{tag}a", "10.213.7.1"), (f"ks{tag}b", f"ks{tag}b", "10.213.7.2")]
    created: list[str] = []
    etc_existed = Path("/etc/netns").exists()
    try:
        for namespace, _, _ in hosts:
            result = _run("ip", "netns", "add", namespace)
            if result.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {result.stderr.strip()}")
            created.append(namespace)
            # `ip netns exec` mounts these over /etc: names resolve locally instead of waiting on a DNS
            # server the namespace cannot reach.
            etc = Path("/etc/netns") / namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, _, a in hosts))
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        steps = [("ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])]
        for namespace, interface, address in hosts:
            steps += [
                ("ip", "link", "set", interface, "netns", namespace),
                ("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", interface),
                ("ip", "-n", namespace, "link", "set", interface, "up"),
                ("ip", "-n", namespace, "link", "set", "lo", "up"),
            ]
        for step in steps:
            result = _run(*step)
            if result.returncode != 0:
                pytest.skip(
                    f"cannot join namespaces with a veth pair: {' '.join(step)}: {result.stderr.strip()}"
                )
        yield hosts
    finally:
        for namespace in created:
            _run("ip", "netns", "del", namespace)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
        if not etc_existed and Path("/etc/netns").exists():
            Path("/etc/netns").rmdir()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_hosts_over_veth_with_torchrun(tmp_path: Path, ram_root: Path, two_hosts: list) -> None:
    make_source(tmp_path / "source", SIZES)
    work = tmp_path / "ranks"
    work.mkdir()
    master = two_hosts[0][2]
    procs = []
    for node, (namespace, interface, _) in enumerate(two_hosts):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=interface, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        command = [
            "ip", "netns", "exec", namespace,
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
            f"--master-addr={master}", "--master-port=29531",
            "-m", "tests.distributed.test_exchange", str(work), str(ram_root),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        outputs.append(out.decode(errors="replace")[-3000:])

    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    results = [json.loads((work / f"result_{rank}.json").read_text()) for rank in range(2)]
    assert [r["interface"] for r in results] == [two_hosts[0][1], two_hosts[1][1]]
    _check(results, 2, 1)


def _torchrun_main(work: Path, ram_root: str) -> None:
    """A rank started by torchrun inside one namespace: the two-node exchange over the veth."""
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    result = _two_nodes(rank, world_size, work, 1, 0.5, ram_root)
    result["interface"] = os.environ["GLOO_SOCKET_IFNAME"]
    dist.barrier()
    dist.destroy_process_group()
    (work / f"result_{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _torchrun_main(Path(sys.argv[1]), sys.argv[2])
