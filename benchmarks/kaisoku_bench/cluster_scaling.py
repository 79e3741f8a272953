"""Weak scaling of loading and exchange in a cluster in a box, for ``kaisoku bench cluster``.

Hosts 0 to H-1 of a box (:class:`~kaisoku.testing.cluster.ClusterBox`) each mount the shared folder over
sshfs from a storage host (host H, its link unshaped; :class:`~kaisoku.testing.sshfs.SshfsMount` with the
client's ``ssh`` on the host), so that every byte a host stages crosses its own link, shaped to
:attr:`ScalingPlan.rate_mbit` each way, and so does every byte it exchanges. A cell is one epoch of the
``ShardLoader`` ``kaisoku train`` builds (:func:`kaisoku.engine.data_build.shard_loader`) on ``n`` hosts
at a fixed batch per host over a set of ``n`` times :attr:`ScalingPlan.per_host` samples: staging the
host's partition from the mount and the partial shuffle's exchange (``data.exchange``), with no model
(images stay encoded, :class:`~kaisoku_bench.slowfs_readers.EncodedSize`), so that the cell measures the
I/O path and not the 2 shared cores of the machine. An epoch's time is its slowest host's.

A plan with :attr:`ScalingPlan.strategy_hosts` also measures, at that host count, every data strategy
``kaisoku plan`` compares (:func:`kaisoku.plan.model.strategies`; the scaling cells already measure two of
them), each through the loader ``kaisoku train`` builds for it: the ``ShardLoader`` for a staged one, the
image folder's loader (:func:`kaisoku.engine.data_build.build_data`) for ``per-file``, which reads the
set's images one file at a time from the mount. :func:`strategy_plan` is the planner's table for that
cell, against which ``kaisoku bench cluster`` judges its recommendation.

One rank process per host (``python -m kaisoku_bench.cluster_scaling --plan FILE --rank R``, in the host's
network namespace) is started once and measures every (repeat, hosts) cell, the hosts of a smaller cell
joined by a gloo subgroup while the others wait at a barrier: process starts stay out of the cells.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from kaisoku.fsutil import atomic_write_text
from kaisoku.testing.cluster import ClusterBox, Link
from kaisoku.testing.sshfs import SshfsMount
from kaisoku_bench.common import python_path

MODULE = "kaisoku_bench.cluster_scaling"
#: The port of the ranks' TCP store on host 0.
STORE_PORT = 29500
PROBE_PORT = 29507
"""Where host 0's torchrun agent serves the probe's rendezvous (the cells' store is gone by then)."""


@dataclass(frozen=True)
class ScalingPlan:
    """What the rank processes measure and where (written as JSON for them)."""

    sizes: tuple[int, ...]
    """Host counts of the cells (each a prefix of the hosts)."""
    repeats: int
    per_host: int
    """Samples per host (the set of an ``n``-host cell has ``n`` times as many)."""
    batch: int
    """Samples per host per batch."""
    exchanges: tuple[float, ...]
    """The partial shuffle's Q (``data.exchange``) of the cells of several hosts, each a cell of its own
    (one host has no peer: its cell stages the whole set, as any Q would)."""
    rate_mbit: float
    """Each host's link, each way."""
    image_size: int
    shard_bytes: int
    mounts: tuple[str, ...]
    """Where host ``r`` sees the shared folder (its own sshfs mount)."""
    sample_bytes: float
    """Mean bytes of a packed sample (known once the sets are packed)."""
    work: str
    """Cache folders and results."""
    master: str
    """HOST:PORT of the ranks' TCP store (on host 0)."""
    slow_links: tuple[tuple[int, float], ...] = ()
    """(host, Mbit/s) of hosts whose link differs from :attr:`rate_mbit` (an asymmetric cluster)."""
    probe_seconds: float = 0.0
    """> 0: ``kaisoku probe`` measures every host's mount for this long before the cells (the planner's
    input, :func:`probed_epoch_s`); 0: no probe."""
    strategy_hosts: int = 0
    """> 0: every strategy ``kaisoku plan`` compares at this many hosts is measured as a cell too (the
    planner's recommendation is judged against them); 0: none."""
    fs_delay_s: float = 0.0
    """Seconds the storage's delay proxy holds every chunk of each host's sshfs traffic, each way (a file
    system farther away: its round trip grows by twice this); 0: none."""
    queue_ms: float = 500.0
    """How long a packet may wait in a shaped link's queue before it is dropped (``tbf latency``). At 50 ms
    (the box's default) a 4 Mbit/s link dropped packets of every burst and TCP's retransmission timeouts
    spread a 1-host epoch over 3.2-4.7 s (4 repeats); at 500 ms it lies within 3.01-3.07 s."""

    def rate_of(self, host: int) -> float:
        """Host ``host``'s link rate in Mbit/s."""
        return dict(self.slow_links).get(host, self.rate_mbit)

    @property
    def hosts(self) -> int:
        """The rank processes started: one per host of the largest cell."""
        return max(self.sizes)

    def pack(self, hosts: int) -> str:
        """The name of the ``hosts``-host cell's packed set in the shared folder."""
        return f"pack-{hosts}"

    def images(self, hosts: int) -> str:
        """The name of the ``hosts``-host cell's image folder in the shared folder (the ``per-file``
        strategy's set: the files the pack holds, kept when :attr:`strategy_hosts` is ``hosts``)."""
        return f"images-{hosts}"


#: A cell: (hosts, Q, the ``kaisoku plan`` strategy it runs).
Cell = tuple[int, float, str]


def scaling_strategy(hosts: int, exchange: float) -> str:
    """The planner's name of a scaling cell's strategy: global staging on one host, the partial shuffle
    exchanging ``exchange`` (local-only at 0) on several."""
    if hosts == 1:
        return "staged-global"
    return f"partial-Q{exchange:g}" if exchange > 0 else "local-only"


def _strategy(hosts: int, name: str) -> Any:
    """The :class:`~kaisoku.plan.model.Strategy` ``kaisoku plan`` compares at ``hosts`` hosts by ``name``."""
    # The driver's start-up stays free of the planner until a strategy is asked for.
    from kaisoku.plan.model import strategies  # noqa: PLC0415

    found = {s.name: s for s in strategies(hosts)}
    if name not in found:
        raise ValueError(f"kaisoku plan has no strategy {name!r} at {hosts} hosts (it has {list(found)})")
    return found[name]


def strategy_cells(plan: ScalingPlan) -> list[Cell]:
    """The cells of the strategies at :attr:`ScalingPlan.strategy_hosts` that no scaling cell measures."""
    if plan.strategy_hosts <= 0:
        return []
    # The driver's start-up stays free of the planner until it is asked for.
    from kaisoku.plan.model import strategies  # noqa: PLC0415

    n = plan.strategy_hosts
    scaled = {scaling_strategy(n, q) for q in plan.exchanges} if n in plan.sizes else set()
    return [(n, s.exchange, s.name) for s in strategies(n) if s.name not in scaled]


def _cell_order(plan: ScalingPlan, repeat: int) -> list[Cell]:
    """(hosts, Q, strategy) of every cell of one repeat."""
    order = [
        (n, q, scaling_strategy(n, q)) for n in plan.sizes for q in (plan.exchanges if n > 1 else (0.0,))
    ]
    order += strategy_cells(plan)
    # Rotated per repeat, so that a drift of the machine's load does not always fall on the same cell.
    shift = repeat % len(order)
    return order[shift:] + order[:shift]


def _loader(plan: ScalingPlan, cell: Cell, rank: int, root: Path) -> Any:
    """The training loader of host ``rank`` in a cell, as ``kaisoku train`` builds it for the cell's
    strategy at ``hosts`` times the per-host batch: a staged strategy's ShardLoader over the cell's pack
    (its node cache under ``root``, built as :func:`kaisoku_bench.slowfs_readers.node_loader` builds it),
    ``per-file``'s image-folder loader over the cell's images."""
    # Only the rank side needs these: the driver side of this module runs without torch's start-up.
    import torch  # noqa: PLC0415

    from kaisoku.config import Config  # noqa: PLC0415
    from kaisoku.config_sections import ByteSize  # noqa: PLC0415
    from kaisoku.data.loading.dataset import ShardedDataset  # noqa: PLC0415
    from kaisoku.distributed.env import World  # noqa: PLC0415
    from kaisoku.engine.data_build import build_data, shard_loader  # noqa: PLC0415
    from kaisoku.run_facts import plan_run  # noqa: PLC0415
    from kaisoku.run_plan import WorldShape  # noqa: PLC0415
    from kaisoku_bench.slowfs_readers import EncodedSize  # noqa: PLC0415

    hosts, _, name = cell
    strategy = _strategy(hosts, name)
    cfg = Config()
    cfg.data.global_batch = hosts * plan.batch
    cfg.data.workers = 1
    cfg.data.image_size = plan.image_size
    cfg.train.seed, cfg.train.epochs = 0, 1
    world = World(rank=rank, world_size=hosts, local_world_size=1, node=rank, num_nodes=hosts)
    if not strategy.staged:
        # kaisoku plan's per-file flags: the image folder, a global order, the readers it priced.
        cfg.data.path = str(Path(plan.mounts[rank]) / plan.images(hosts))
        cfg.data.shuffle = "global"
        return build_data(plan_run(cfg, WorldShape(hosts, 1)), world, torch.device("cpu")).train
    pack = str(Path(plan.mounts[rank]) / plan.pack(hosts) / "train")
    capacity = ByteSize(int(4 * hosts * plan.per_host * plan.sample_bytes) + (16 << 20))
    cfg.data.path = pack
    cfg.data.shuffle = strategy.shuffle
    cfg.data.exchange = strategy.exchange
    cfg.data.local_cache, cfg.data.local_capacity = str(root / "local"), capacity
    cfg.data.ram_dir, cfg.data.ram_capacity = str(root / "ram"), capacity
    dataset = ShardedDataset(pack, transform=EncodedSize(), decode_images=False)
    return shard_loader(plan_run(cfg, WorldShape(hosts, 1)), world, torch.device("cpu"), dataset)


def _epoch(plan: ScalingPlan, cell: Cell, rank: int, repeat: int, group: Any) -> dict[str, Any]:
    """One cold epoch of host ``rank`` in a cell: seconds from the cell's start to the last batch
    (staging, exchange, the loop), the bytes delivered and the loader's counters."""
    import torch.distributed as dist  # noqa: PLC0415 - see _loader

    hosts, exchange, name = cell
    root = Path(plan.work) / f"cache-h{rank}"
    loader = _loader(plan, cell, rank, root)
    staged = hasattr(loader, "connect")
    if staged:
        loader.connect(run_token=f"scaling-{hosts}-{name}-{repeat}", exchange_group=group)
    try:
        if hosts > 1:
            dist.barrier(group=group)
        start = time.perf_counter()
        loader.set_epoch(0, 0)  # starts the node cache and exchanges (a collective of the cell's hosts)
        # Staged cells deliver encoded sizes (EncodedSize); per-file ones decoded images, counted by the
        # loader's source bytes instead.
        delivered = sum(int(images.sum()) if staged else 0 for images, _ in loader)
        seconds = time.perf_counter() - start
        stats = loader.epoch_stats() or {}
    finally:
        loader.close()
        shutil.rmtree(root, ignore_errors=True)  # the next cell starts cold
    return {
        "repeat": repeat,
        "hosts": hosts,
        "exchange": exchange,
        "strategy": name,
        "rank": rank,
        "seconds": seconds,
        "delivered_bytes": delivered if staged else int(stats.get("source_bytes", 0)),
        "source_bytes": int(stats.get("source_bytes", 0)),
        "exchanged_bytes": int(stats.get("exchanged_bytes", 0)),
    }


def rank_main(plan: ScalingPlan, rank: int) -> list[dict[str, Any]]:
    """Every cell this host takes part in (run on host ``rank``); rank 0 holds the TCP store."""
    import torch  # noqa: PLC0415 - see _loader
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{plan.master}",
        rank=rank,
        world_size=plan.hosts,
        timeout=timedelta(seconds=300),
    )
    try:
        # Every rank creates every subgroup, in one order (torch's rule), members or not.
        sizes = sorted({*plan.sizes, plan.strategy_hosts} - {0})
        groups = {n: dist.new_group(list(range(n))) for n in sizes if n > 1}
        out = []
        for repeat in range(plan.repeats):
            for cell in _cell_order(plan, repeat):
                dist.barrier()
                if rank < cell[0]:
                    out.append(_epoch(plan, cell, rank, repeat, groups.get(cell[0])))
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def _row_strategy(row: dict[str, Any]) -> str:
    """A row's strategy (a record without one is its scaling cell's)."""
    return row.get("strategy") or scaling_strategy(row["hosts"], row["exchange"])


def cells(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The ranks' records as one row per (repeat, hosts, strategy): the slowest host's seconds, bytes
    summed."""
    merged: dict[tuple[int, int, float, str], dict[str, Any]] = {}
    for record in (r for records in per_rank for r in records):
        key = (record["repeat"], record["hosts"], record["exchange"], _row_strategy(record))
        row = merged.setdefault(
            key,
            {"repeat": key[0], "hosts": key[1], "exchange": key[2], "strategy": key[3], "seconds": 0.0,
             "delivered_bytes": 0, "source_bytes": 0, "exchanged_bytes": 0},
        )  # fmt: skip
        row["seconds"] = max(row["seconds"], round(record["seconds"], 3))
        for name in ("delivered_bytes", "source_bytes", "exchanged_bytes"):
            row[name] += record[name]
    return [merged[key] for key in sorted(merged)]


def efficiencies(rows: list[dict[str, Any]], hosts: int, exchange: float) -> list[float]:
    """Per repeat: the 1-host epoch's seconds over the ``hosts``-host epoch's at Q ``exchange`` (ideal 1)."""
    by_cell = {(row["repeat"], row["hosts"], _row_strategy(row)): row["seconds"] for row in rows}
    repeats = sorted({row["repeat"] for row in rows})
    one, many = (1, scaling_strategy(1, 0.0)), (hosts, scaling_strategy(hosts, exchange))
    return [
        round(by_cell[(r, *one)] / by_cell[(r, *many)], 4)
        for r in repeats
        if (r, *one) in by_cell and (r, *many) in by_cell
    ]


#: The target AU :func:`strategy_plan` asks the planner for (``kaisoku plan``'s default).
PLANNER_AU = 0.9


def _cell_dataset(plan: ScalingPlan, hosts: int) -> Any:
    """The planner's description of the ``hosts``-host cell's set."""
    # The driver's start-up stays free of the planner until a prediction is asked for.
    from kaisoku.plan.model import Dataset  # noqa: PLC0415

    return Dataset(
        samples=hosts * plan.per_host, sample_bytes=plan.sample_bytes, shard_bytes=plan.shard_bytes
    )


def _cell_first_epoch_s(plan: ScalingPlan, cluster: Any, hosts: int, exchange: float, strategy: str) -> float:
    """The model's first epoch of a cell on ``cluster``: the cell's set, its strategy (empty: the scaling
    cell's, :func:`scaling_strategy`)."""
    # The driver's start-up stays free of the planner until it is asked for.
    from kaisoku.plan.model import predict  # noqa: PLC0415

    chosen = _strategy(hosts, strategy or scaling_strategy(hosts, exchange))
    return predict(cluster, _cell_dataset(plan, hosts), chosen, hosts).first_epoch_s


def _nominal_cluster(plan: ScalingPlan, hosts: int) -> Any:
    """The box as its links are set: the shared storage at each host's link rate per reading host (each
    host's own link, the storage's unshaped), the network at the link rate, no compute."""
    # The driver's start-up stays free of the planner until it is asked for.
    from kaisoku.plan.model import Cluster, RateTable  # noqa: PLC0415

    rate = plan.rate_mbit * 1e6 / 8
    readers = (1, 2, 4, 8, 16)
    return Cluster(
        nodes=hosts,
        readers_per_node=1,
        fs_seq=RateTable(readers, tuple(rate * r for r in readers)),
        fs_small=RateTable((1,), (1e4,)),
        network_bw=rate,
        local_capacity=1e12,
        local_read_bw=1e9,
        local_write_bw=1e9,
        ram_capacity=1e12,
        ram_bw=1e10,
        batch_per_rank=plan.batch,
    )


def predicted_epoch_s(plan: ScalingPlan, hosts: int, exchange: float, strategy: str = "") -> float:
    """The first epoch ``kaisoku plan``'s model predicts for a cell on the box's nominal links
    (:func:`_nominal_cluster`; the cells train no model)."""
    return _cell_first_epoch_s(plan, _nominal_cluster(plan, hosts), hosts, exchange, strategy)


def make_packs(plan: ScalingPlan, shared: Path) -> float:
    """The set of every cell size in ``shared``: images generated once for the largest cell, the smaller
    cells' sets packed from a hard-linked prefix of each class (raw codec: the bytes stay as generated);
    the mean bytes of a packed sample. The images of :attr:`ScalingPlan.strategy_hosts`' cell stay, as
    :meth:`ScalingPlan.images` (the ``per-file`` strategy reads them)."""
    # The driver's start-up stays free of torch and the image codecs until the sets are made.
    from kaisoku.data.datagen import generate  # noqa: PLC0415
    from kaisoku.data.shards.format import read_index  # noqa: PLC0415
    from kaisoku.data.shards.writer import pack  # noqa: PLC0415

    largest = plan.hosts
    images = generate(
        shared / "images", count=largest * plan.per_host, size=plan.image_size, val_count=16, workers=1
    )
    for hosts in sorted({*plan.sizes, plan.strategy_hosts} - {0}):
        folder = images
        if hosts < largest:
            folder = shared / plan.images(hosts)
            for split in ("train", "val"):
                for klass in sorted((images / split).iterdir()):
                    files = sorted(klass.iterdir())
                    keep = files if split == "val" else files[: len(files) * hosts // largest]
                    (folder / split / klass.name).mkdir(parents=True)
                    for file in keep:
                        os.link(file, folder / split / klass.name / file.name)
        pack(folder, shared / plan.pack(hosts), shard_bytes=plan.shard_bytes, codec="raw", workers=1)
    if plan.strategy_hosts == largest:
        images.rename(shared / plan.images(largest))
    for folder in shared.glob("images*"):
        if folder.name != plan.images(plan.strategy_hosts):
            shutil.rmtree(folder)
    train = shared / plan.pack(largest) / "train"
    shard_bytes = sum(path.stat().st_size for path in train.glob("*.kshard"))
    return shard_bytes / read_index(train).num_samples


def _on_every_host(
    box: Any,
    plan: ScalingPlan,
    env: dict[str, str],
    argv_of: Callable[[int], list[str]],
    log: str,
    timeout: float,
    what: str,
) -> None:
    """Start ``argv_of(host)`` on every host of ``box`` (its network only: the sshfs mounts are this
    process's), output to ``WORK/<log with {} as the host>``, and wait for all of them within ``timeout``;
    RuntimeError naming the log of one that failed or ran over."""
    work = Path(plan.work)
    procs = []
    for host in range(plan.hosts):
        with (work / log.format(host)).open("w") as out:
            procs.append(
                box.popen(
                    host, argv_of(host), env=env, cwd=work, mount=False, stdout=out, stderr=subprocess.STDOUT
                )
            )
    deadline = time.monotonic() + timeout
    for host, proc in enumerate(procs):
        try:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what} ran over {timeout:g} s; see {work / log.format(host)}") from None
        if code != 0:
            raise RuntimeError(f"{what} on host {host} exited with {code}; see {work / log.format(host)}")


def run_cells(box: Any, plan: ScalingPlan, env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    """Start a rank on each host of ``box``, wait for them and return their merged rows; RuntimeError
    naming the log of a rank that failed."""
    work = Path(plan.work)
    plan_file = work / "plan.json"
    atomic_write_text(plan_file, json.dumps(asdict(plan)))

    def argv_of(rank: int) -> list[str]:
        return [sys.executable, "-m", MODULE, "--plan", str(plan_file), "--rank", str(rank)]

    _on_every_host(box, plan, env, argv_of, "rank-{}.log", timeout, "a scaling rank")
    per_rank = [json.loads((work / f"rank-{rank}.json").read_text()) for rank in range(plan.hosts)]
    return cells(per_rank)


def scaling_rows(rows: list[dict[str, Any]], plan: ScalingPlan) -> list[dict[str, Any]]:
    """``rows`` with the planner's predicted seconds of each cell on the nominal links."""
    return [
        {
            **row,
            "predicted_s": round(predicted_epoch_s(plan, row["hosts"], row["exchange"], row["strategy"]), 3),
        }
        for row in rows
    ]


def predicted_efficiency(plan: ScalingPlan, hosts: int, exchange: float) -> float:
    """The planner's 1-host first epoch over its ``hosts``-host one at Q ``exchange``."""
    return predicted_epoch_s(plan, 1, 0.0) / predicted_epoch_s(plan, hosts, exchange)


def probe_hosts(box: Any, plan: ScalingPlan, env: dict[str, str]) -> dict[str, Any]:
    """``kaisoku probe`` of every host's mount under torchrun (one agent per host, one rank each, as a
    user runs it across a job's nodes): each host reads its own mount, all at once, and the links between
    every pair of hosts are timed; the one profile host 0 wrote. RuntimeError naming a log when one fails."""
    import tomllib  # noqa: PLC0415 - only the probe's profile is read here

    work = Path(plan.work)
    out = work / "probe.toml"

    def argv_of(host: int) -> list[str]:
        local = work / f"probe-h{host}-local"
        local.mkdir(exist_ok=True)
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(plan.hosts),
                "--nproc-per-node", "1", "--node-rank", str(host), "--master-addr", box.members[0].address,
                "--master-port", str(PROBE_PORT), "-m", "kaisoku", "probe", plan.mounts[host],
                "--out", str(out), "--seconds", f"{plan.probe_seconds:g}", "--local-dir", str(local)]  # fmt: skip

    _on_every_host(box, plan, env, argv_of, "probe-h{}.log", 180 + 6 * plan.probe_seconds, "kaisoku probe")
    for host in range(plan.hosts):
        shutil.rmtree(work / f"probe-h{host}-local", ignore_errors=True)
    return tomllib.loads(out.read_text())


def _probed_cluster(plan: ScalingPlan, profile: dict[str, Any], hosts: int) -> Any:
    """The cluster ``kaisoku plan`` reads from the probe of every host (:func:`probe_hosts`), at ``hosts``
    hosts (the first ``hosts`` of the box): its shared storage, hosts and links as measured; one reader
    per host (a cell's loader runs one worker), the cell's batch, room for every set and no compute."""
    # The driver's start-up stays free of the planner until a prediction is asked for.
    from kaisoku.plan.cluster import cluster_from_dict  # noqa: PLC0415

    probed = cluster_from_dict({**profile, "cluster": {**profile["cluster"], "nodes": hosts}}, "probe")
    return replace(
        probed,
        ranks_per_node=1,
        readers_per_node=1,
        local_capacity=1e12,
        ram_capacity=1e12,
        step_seconds=0.0,
        batch_per_rank=plan.batch,
        loader_rate=0.0,
    )


def probed_epoch_s(plan: ScalingPlan, profile: dict[str, Any], row: dict[str, Any]) -> float:
    """The first epoch ``kaisoku plan``'s model predicts for ``row``'s cell from the probe of every host
    (:func:`_probed_cluster`)."""
    hosts, exchange = row["hosts"], row["exchange"]
    cluster = _probed_cluster(plan, profile, hosts)
    return _cell_first_epoch_s(plan, cluster, hosts, exchange, row.get("strategy", ""))


def strategy_plan(plan: ScalingPlan, profile: dict[str, Any] | None) -> dict[str, Any]:
    """``kaisoku plan --json --epochs 1`` for the cell of :attr:`ScalingPlan.strategy_hosts` hosts: every
    strategy's predicted first epoch and shuffle quality, and the recommendation, from the probe of every host
    (the box's nominal links without one). One epoch, because a cell times one epoch; the default target
    AU (:data:`PLANNER_AU`)."""
    # The planner's table (numpy, the shuffle-quality functions) loads only once a run asks for it.
    # The driver's start-up stays free of the planner until it is asked for.
    from kaisoku.plan.command import plan_record  # noqa: PLC0415

    hosts = plan.strategy_hosts
    cluster = _probed_cluster(plan, profile, hosts) if profile else _nominal_cluster(plan, hosts)
    record = plan_record(cluster, _cell_dataset(plan, hosts), hosts, PLANNER_AU, epochs=1)
    return {**record, "cluster": "probe of every host" if profile else "the box's nominal links"}


def unseen_plan(work: Path) -> ScalingPlan:
    """The planner's cells on a box it was never built on: 3 hosts at 8 Mbit/s, host 2 at 4 (asymmetric),
    2 hosts (both fast) and 3, Q = 0.25 and 0, and every strategy ``kaisoku plan`` compares at 2 hosts;
    every host's mount probed first.

    Frozen (``tests/bench/test_cluster_helpers.py`` pins it): the planner was never built or tuned on these
    cells; the scaling box (:func:`plan_for`) is the one its terms were written against."""
    return replace(
        plan_for(False, work),
        sizes=(2, 3),
        rate_mbit=8.0,
        slow_links=((2, 4.0),),
        exchanges=(0.25, 0.0),
        probe_seconds=8.0,
        strategy_hosts=2,
    )


def unseen_far_plan(work: Path) -> ScalingPlan:
    """The planner's second unseen box, frozen before the model is changed again: 4 hosts at 16 Mbit/s
    whose shared file system is 10 ms farther away (the proxy holds each chunk 5 ms each way), 64-px
    images (samples about 3x the other boxes'), 500 samples a host; 1 host and 4 hosts, Q 0.5 and 0 (a
    Q no other box uses); every host's mount probed first."""
    return replace(
        plan_for(False, work),
        sizes=(1, 4),
        per_host=500,
        rate_mbit=16.0,
        image_size=64,
        fs_delay_s=0.005,
        exchanges=(0.5, 0.0),
        probe_seconds=8.0,
    )


def plan_for(quick: bool, work: Path) -> ScalingPlan:
    """The cells of a full run (1, 2 and 4 hosts, 3 repeats) or of ``--quick`` (1 and 2 hosts, once, a
    smaller set on faster links, and every strategy ``kaisoku plan`` compares at 2 hosts); mounts and store
    address are filled in once the box stands."""
    return ScalingPlan(
        sizes=(1, 2) if quick else (1, 2, 4),
        repeats=1 if quick else 3,
        per_host=256 if quick else 1000,
        batch=32,
        exchanges=(0.25,) if quick else (0.25, 0.0),
        rate_mbit=8.0 if quick else 4.0,
        image_size=32,
        shard_bytes=128 * 1024,
        mounts=(),
        sample_bytes=0.0,
        probe_seconds=0.0 if quick else 8.0,
        work=str(work),
        master="",
        strategy_hosts=2 if quick else 0,
    )


def measure(
    plan: ScalingPlan, *, timeout: float
) -> tuple[list[dict[str, Any]], ScalingPlan, dict[str, Any] | None]:
    """Build the box (the plan's hosts, each link shaped, and a storage host serving the packed sets over
    sshfs to each host), probe every host's mount where the plan asks, run every cell; the rows with the
    planner's predictions, the plan as run and the probe's profile (None without a probe)."""
    work = Path(plan.work)
    shared = work / "shared"
    shared.mkdir(parents=True)
    plan = replace(plan, sample_bytes=make_packs(plan, shared))
    hosts = plan.hosts
    # The storage host's link is unshaped: each host's own link is the only one it reads through.
    links = {host: Link(rate_mbit=plan.rate_of(host), queue_ms=plan.queue_ms) for host in range(hosts)}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    env["PYTHONPATH"] = python_path(env.get("PYTHONPATH", ""))
    with ClusterBox(hosts + 1, link=links) as box, contextlib.ExitStack() as mounts:
        where = []
        for client in range(hosts):
            mount = mounts.enter_context(SshfsMount(box, shared, storage=hosts, client=client))
            mount.remount(plan.fs_delay_s)
            where.append(str(mount.mount))
        ready = replace(plan, mounts=tuple(where), master=f"{box.members[0].address}:{STORE_PORT}")
        profile = probe_hosts(box, ready, env) if plan.probe_seconds > 0 else None
        extra = strategy_cells(ready)
        rows = [
            {
                **row,
                "cell": "strategy"
                if (row["hosts"], row["exchange"], row["strategy"]) in extra
                else "scaling",
            }
            for row in scaling_rows(run_cells(box, ready, env, timeout), ready)
        ]
        if profile is not None:
            rows = [{**row, "probed_s": round(probed_epoch_s(ready, profile, row), 3)} for row in rows]
        return rows, ready, profile


def main(argv: list[str] | None = None) -> int:
    """``python -m kaisoku_bench.cluster_scaling --plan FILE --rank R``: one host's cells into
    ``WORK/rank-R.json``."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    fields = json.loads(args.plan.read_text())
    plan = ScalingPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    records = rank_main(plan, args.rank)
    atomic_write_text(Path(plan.work) / f"rank-{args.rank}.json", json.dumps(records))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    sys.exit(main())
