"""The I/O trade-off model behind ``kaisoku plan``: pure functions of a cluster and a dataset description.

For each data strategy it predicts the first-epoch and steady-epoch time, the accelerator utilisation
(AU = compute time / epoch time), the node-local capacity used, the network volume per epoch and the
randomness of the sample order. Every number comes from the description; nothing is measured here.

The shared file system is described as NoPFS does, by tables over the number of concurrent readers
across all nodes (contention): the aggregate sequential bandwidth and the aggregate rate of small-file
reads (open + read of a file of ``small_file_bytes``). Between table points the rate is interpolated
linearly in log2(readers); above the last point it stays at the last value (saturated); below the
first it scales down in proportion to the readers.

Strategies and their cost (D: dataset bytes, N: nodes, M: samples, C: a node's local + RAM capacity)::

    per-file      every epoch: M open+reads by N * readers_per_node readers,
                  M / small(R) + M * max(0, b - small_file_bytes) / seq(R)
    staged-global each node stages every shard (a global order draws from all of them): N * D bytes
                  from the shared FS by N stagers in epoch 1, written to local disk on the way; later
                  epochs read the node's D / N share from RAM/local disk. C < D: the share C / D is kept,
                  the rest is read record by record from the shared FS every epoch (per-file cost)
    staged-block  as staged-global when C >= D; C < D: shards stream through a small window, N * D
                  sequential bytes from the shared FS every epoch
    partial Q     each node stages its own D / N (D from the shared FS in all, N readers) and exchanges
                  Q * D / N bytes with the other nodes every epoch (before the epoch's loop)
    local-only    partial with Q = 0

A cluster probed host by host (``kaisoku probe`` under torchrun or srun) also carries each host's share of
the shared FS's per-node rate and the rate of every link between hosts. A synchronous epoch waits for its
slowest host: staging and per-file reads run at the aggregate's per-node rate times the slowest share in
the job, and the exchange takes the slowest node's sum over its links of the bytes it sends each peer.

An epoch overlaps I/O with compute: epoch = exchange + max(compute, I/O), AU = compute / epoch. The
first epoch of a staged strategy also waits, before its first batch, for the staging of the shards that
batch touches (:func:`first_batch_fraction`: all of them for a global order whose node batch is larger
than the shard count, one block for the block shuffle, the whole node partition before a partial
shuffle's exchange); the rest of the staging overlaps the epoch (:func:`staged_first_epoch`).
Randomness: global (per-file, staged-global) > partial Q=1 > 0.5 > 0.25 > 0.1 > block > local-only
(:data:`RANDOMNESS`, lower is more random); ``kaisoku plan`` also reports kaisoku's shuffle quality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

MB = 1e6

#: Exchange fractions of the partial strategies.
PARTIAL_Q = (1.0, 0.5, 0.25, 0.1)

#: Shards per block of the block shuffle (``kaisoku plan`` recommends ``--data.block-shards`` this).
BLOCK_SHARDS = 8


@dataclass(frozen=True)
class RateTable:
    """An aggregate rate (bytes/s or reads/s) at each count of concurrent readers (strictly increasing)."""

    readers: tuple[int, ...]
    values: tuple[float, ...]

    def at(self, readers: float) -> float:
        """The aggregate rate at ``readers`` concurrent readers (log-linear interpolation, saturating)."""
        xs, ys = self.readers, self.values
        if readers <= xs[0]:
            return ys[0] * max(readers, 1e-9) / xs[0]
        if readers >= xs[-1]:
            return ys[-1]
        for i in range(1, len(xs)):
            if readers <= xs[i]:
                lo, hi = math.log2(xs[i - 1]), math.log2(xs[i])
                t = (math.log2(readers) - lo) / (hi - lo)
                return ys[i - 1] + t * (ys[i] - ys[i - 1])
        return ys[-1]  # unreachable

    def scaled(self, factor: float) -> RateTable:
        """Every value times ``factor``."""
        return RateTable(self.readers, tuple(v * factor for v in self.values))


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A cluster's I/O and compute figures (SI units: bytes, bytes/s, seconds)."""

    name: str = "cluster"
    nodes: int
    """Node count (``kaisoku plan --nodes`` overrides it)."""
    ranks_per_node: int = 1
    readers_per_node: int = 8
    """Concurrent per-file readers a node runs (loader threads or workers)."""
    fs_seq: RateTable
    """Shared FS aggregate sequential read bandwidth (bytes/s) vs concurrent readers over all nodes."""
    fs_small: RateTable
    """Shared FS aggregate small-file reads per second vs concurrent readers over all nodes."""
    small_file_bytes: float = 1500.0
    network_bw: float
    """Node-to-node bandwidth per node and direction (bytes/s)."""
    local_capacity: float = 0.0
    local_read_bw: float = 1.0
    local_write_bw: float = 1.0
    local_path: str = ""
    ram_capacity: float = 0.0
    ram_bw: float = 1.0
    step_seconds: float = 0.0
    """Compute time of one training step (forward, backward, update)."""
    batch_per_rank: int = 32
    loader_rate: float = 0.0
    """Samples per second one node's loader delivers from its RAM tier (reading, decoding, batching);
    0: not a limit."""
    fs_seq_range: tuple[RateTable, RateTable] | None = None
    """The slowest and the fastest of the probe's passes behind ``fs_seq`` (None: one figure, no spread)."""
    fs_small_range: tuple[RateTable, RateTable] | None = None
    """The slowest and the fastest of the probe's passes behind ``fs_small``."""
    network_range: tuple[float, float] | None = None
    """The slowest and the fastest measurement behind ``network_bw``."""
    host_names: tuple[str, ...] = ()
    """The probed hosts, in the job's order (empty: the cluster is described as one kind of node)."""
    host_seq_share: tuple[float, ...] = ()
    """Each probed host's sequential read rate from the shared FS over the hosts' mean (1.0: average)."""
    host_small_share: tuple[float, ...] = ()
    """Each probed host's small-file read rate over the hosts' mean."""
    links: tuple[tuple[float, ...], ...] = ()
    """``links[i][j]``: bytes/s from probed host ``i`` to host ``j`` (empty: every link is ``network_bw``)."""
    links_range: tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]] | None = None
    """The slowest and the fastest transfer behind each of ``links``."""

    @property
    def has_spread(self) -> bool:
        """Whether any figure comes with the spread of its measurements."""
        return any(
            r is not None
            for r in (self.fs_seq_range, self.fs_small_range, self.network_range, self.links_range)
        )

    def at_end(self, end: int) -> Cluster:
        """This cluster with every figure at the slow (``end`` 0) or fast (1) end of its measured spread
        (a figure measured once stays as it is)."""
        return replace(
            self,
            fs_seq=self.fs_seq_range[end] if self.fs_seq_range else self.fs_seq,
            fs_small=self.fs_small_range[end] if self.fs_small_range else self.fs_small,
            network_bw=self.network_range[end] if self.network_range else self.network_bw,
            links=self.links_range[end] if self.links_range else self.links,
        )

    def in_job(self, nodes: int) -> range:
        """The probed hosts a job of ``nodes`` nodes runs on: the first ``nodes`` of them, or all of them
        when the job is larger (its other nodes are taken to be like the probed ones, the slowest included)."""
        return range(min(nodes, len(self.host_names)))

    def slowest_share(self, shares: tuple[float, ...], nodes: int) -> tuple[float, str]:
        """The smallest of ``shares`` (a per-host table) among the job's hosts, and that host's name;
        (1.0, "") where the cluster has no per-host figures. A synchronous epoch waits for that host."""
        hosts = self.in_job(nodes)
        if not shares or not hosts:
            return 1.0, ""
        slowest = min(hosts, key=lambda h: shares[h])
        return shares[slowest], self.host_names[slowest]

    def exchange_seconds(self, nbytes: float, nodes: int) -> float:
        """Seconds for every node to send ``nbytes`` spread evenly over the other nodes: the slowest node's
        sum over its links (each link at its probed rate), or ``nbytes / network_bw`` without them."""
        hosts = self.in_job(nodes)
        if nbytes <= 0 or nodes < 2:
            return 0.0
        if not self.links or len(hosts) < 2:
            return nbytes / self.network_bw
        each = nbytes / (len(hosts) - 1)
        return max(sum(each / self.links[i][j] for j in hosts if j != i) for i in hosts)


@dataclass(frozen=True, kw_only=True)
class Dataset:
    """A dataset: sample count, mean and spread of sample bytes, samples per source file, shard size."""

    name: str = "dataset"
    samples: int
    sample_bytes: float
    sample_bytes_std: float = 0.0
    samples_per_file: int = 1
    shard_bytes: float = 64 * 2**20

    @property
    def nbytes(self) -> float:
        """Total bytes."""
        return self.samples * self.sample_bytes

    @property
    def samples_per_shard(self) -> int:
        """Samples in one packed shard."""
        return max(1, int(self.shard_bytes // max(self.sample_bytes, 1.0)))

    @property
    def num_shards(self) -> int:
        """Packed shards."""
        return max(1, math.ceil(self.samples / self.samples_per_shard))


@dataclass(frozen=True)
class Strategy:
    """A data strategy: its name, the shuffle it trains with and its randomness rank (lower: more random)."""

    name: str
    shuffle: str  # global | block | partial
    exchange: float = 0.0
    staged: bool = True
    randomness: int = 0


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The model's figures for one strategy on one cluster and dataset."""

    strategy: Strategy
    first_epoch_s: float
    steady_epoch_s: float
    compute_s: float
    au_first: float
    au_steady: float
    local_bytes: float
    """Node-local (disk + RAM) bytes the strategy uses per node."""
    network_bytes: float
    """Bytes exchanged between nodes per epoch, all nodes together."""
    fs_bytes_first: float
    fs_bytes_steady: float
    bound: str
    """What limits the steady epoch: compute, shared FS, local tier or network."""
    notes: list[str] = field(default_factory=list)


def strategies(nodes: int) -> list[Strategy]:
    """The strategies compared at ``nodes`` nodes (partial and local-only need at least 2)."""
    out = [
        Strategy("per-file", "global", staged=False, randomness=0),
        Strategy("staged-global", "global", randomness=0),
    ]
    if nodes > 1:
        out += [
            Strategy(f"partial-Q{q:g}", "partial", exchange=q, randomness=1 + i)
            for i, q in enumerate(PARTIAL_Q)
        ]
    out.append(Strategy("staged-block", "block", randomness=1 + len(PARTIAL_Q)))
    if nodes > 1:
        out.append(Strategy("local-only", "partial", exchange=0.0, randomness=2 + len(PARTIAL_Q)))
    return out


def perfile_seconds(cluster: Cluster, files: float, file_bytes: float, readers: float, nodes: int) -> float:
    """Seconds for ``readers`` concurrent readers over ``nodes`` nodes to open and read ``files`` files of
    ``file_bytes`` each, each node its share; the slowest probed host's share bounds it."""
    if files <= 0:
        return 0.0
    extra = max(0.0, file_bytes - cluster.small_file_bytes)
    small, _ = cluster.slowest_share(cluster.host_small_share, nodes)
    seq, _ = cluster.slowest_share(cluster.host_seq_share, nodes)
    return files / (cluster.fs_small.at(readers) * small) + files * extra / (cluster.fs_seq.at(readers) * seq)


def tier_read_seconds(cluster: Cluster, nbytes: float, resident: float) -> float:
    """Seconds for a node to read ``nbytes`` of a working set of ``resident`` bytes from RAM, then disk."""
    if nbytes <= 0:
        return 0.0
    in_ram = min(1.0, cluster.ram_capacity / resident) if resident > 0 else 1.0
    return nbytes * in_ram / cluster.ram_bw + nbytes * (1.0 - in_ram) / cluster.local_read_bw


def staging_write_seconds(cluster: Cluster, nbytes: float) -> float:
    """Seconds for a node to write ``nbytes`` staged bytes (RAM first, then the local disk)."""
    to_disk = max(0.0, nbytes - cluster.ram_capacity)
    return (nbytes - to_disk) / cluster.ram_bw + to_disk / cluster.local_write_bw


def compute_seconds(cluster: Cluster, dataset: Dataset, nodes: int) -> float:
    """Compute time of one epoch: whole global batches times the step time."""
    global_batch = nodes * cluster.ranks_per_node * cluster.batch_per_rank
    return (dataset.samples // max(global_batch, 1)) * cluster.step_seconds


def first_batch_fraction(shards: float, batch: float) -> float:
    """Expected fraction of ``shards`` equally likely shards that a random batch of ``batch`` samples
    touches: ``1 - (1 - 1/shards)^batch``. A node's first batch cannot start before these are staged."""
    if shards <= 1:
        return 1.0
    return 1.0 - (1.0 - 1.0 / shards) ** max(batch, 1.0)


def staged_first_epoch(lead: float, stage_s: float, overlapped: float) -> float:
    """First-epoch I/O time of a staged strategy: the staging the first batch waits for (fraction
    ``lead`` of ``stage_s``), then the rest of the staging overlapped with ``overlapped`` (the epoch's
    reading, decoding and compute).

    ``lead * stage_s + max((1 - lead) * stage_s, overlapped)``
    """
    lead = min(max(lead, 0.0), 1.0)
    return lead * stage_s + max((1.0 - lead) * stage_s, overlapped)


def _bound(compute: float, parts: dict[str, float]) -> str:
    name, worst = max(parts.items(), key=lambda item: item[1])
    return "compute" if compute >= worst else name


def predict(cluster: Cluster, dataset: Dataset, strategy: Strategy, nodes: int | None = None) -> Prediction:
    """The model's prediction for ``strategy`` at ``nodes`` nodes (default: the cluster's)."""
    n = nodes or cluster.nodes
    d, m, b = dataset.nbytes, dataset.samples, dataset.sample_bytes
    capacity = cluster.local_capacity + cluster.ram_capacity
    compute = compute_seconds(cluster, dataset, n)
    readers = n * cluster.readers_per_node
    loader_s = m / n / cluster.loader_rate if cluster.loader_rate > 0 else 0.0
    node_batch = cluster.ranks_per_node * cluster.batch_per_rank
    notes: list[str] = []
    # A staging node reads its share at the aggregate's per-node rate times its host's share; the
    # slowest host in the job finishes last, and a synchronous epoch waits for it.
    share_seq, slow_host = cluster.slowest_share(cluster.host_seq_share, n)
    fs_node_seq = cluster.fs_seq.at(n) * share_seq
    if share_seq < 0.9:
        notes.append(
            f"host {slow_host} reads the shared FS at {share_seq:.2f} of the hosts' mean: it bounds staging"
        )
    network = 0.0
    lead, stage_first = 0.0, 0.0  # staging the first batch waits for (a fraction of stage_first seconds)
    if not strategy.staged:
        files = m / dataset.samples_per_file
        io = perfile_seconds(cluster, files, b * dataset.samples_per_file, readers, n)
        first_io = steady_io = io
        local, fs_first, fs_steady = 0.0, d, d
        exchange_s = 0.0
        steady_parts = {"shared FS": io}
    elif strategy.shuffle in ("global", "block"):
        kept = min(capacity, d)
        frac = kept / d if d > 0 else 1.0
        share = d / n
        stage_s = n * kept / fs_node_seq
        write_s = staging_write_seconds(cluster, kept)
        local_s = tier_read_seconds(cluster, share * frac, kept)
        exchange_s = 0.0
        if strategy.shuffle == "global":
            lead = first_batch_fraction(dataset.num_shards, node_batch)
        else:
            block = min(BLOCK_SHARDS, dataset.num_shards)
            lead = block / dataset.num_shards * first_batch_fraction(block, node_batch)
        if frac >= 1.0:
            stage_first, first_io = max(stage_s, write_s), local_s
            steady_io = local_s
            local, fs_first, fs_steady = d, n * d, 0.0
            steady_parts = {"local tier": local_s}
        elif strategy.shuffle == "block":
            stream_s = n * d / fs_node_seq
            first_io = steady_io = stream_s
            lead = 0.0
            window = min(d, 2 * BLOCK_SHARDS * dataset.shard_bytes)
            local, fs_first, fs_steady = window, n * d, n * d
            steady_parts = {"shared FS": stream_s}
            notes.append(f"local capacity {capacity:.3g} B < dataset {d:.3g} B: shards stream every epoch")
        else:
            rest = perfile_seconds(cluster, m * (1.0 - frac), b, readers, n)
            stage_first, first_io = max(stage_s, write_s), local_s + rest
            steady_io = local_s + rest
            local, fs_first, fs_steady = kept, n * kept + d * (1 - frac), d * (1 - frac)
            steady_parts = {"shared FS": rest, "local tier": local_s}
            notes.append(f"only {100 * frac:.0f}% of the dataset fits a node: the rest is read per record")
    else:  # partial / local-only
        home = d / n
        q = strategy.exchange
        stage_s = d / fs_node_seq
        local_s = tier_read_seconds(cluster, home, home * (1 + q))
        write_s = staging_write_seconds(cluster, home)
        exchange_s = cluster.exchange_seconds(q * home, n)
        network = q * d
        # Q > 0: the exchange reads the records it sends, spread over the node's shards, before the loop.
        lead = 1.0 if q > 0 else first_batch_fraction(dataset.num_shards / n, node_batch)
        stage_first, first_io = max(stage_s, write_s), local_s
        steady_io = local_s
        local, fs_first, fs_steady = home * (1 + q), d, 0.0
        steady_parts = {"local tier": local_s, "network": exchange_s}
        if home * (1 + q) > capacity:
            notes.append("the node's partition does not fit its local capacity")
    if loader_s > 0:
        steady_parts["loader"] = loader_s
    first = exchange_s + staged_first_epoch(lead, stage_first, max(compute, first_io, loader_s))
    steady = exchange_s + max(compute, steady_io, loader_s)
    return Prediction(
        strategy=strategy,
        first_epoch_s=first,
        steady_epoch_s=steady,
        compute_s=compute,
        au_first=compute / first if first > 0 else 1.0,
        au_steady=compute / steady if steady > 0 else 1.0,
        local_bytes=local,
        network_bytes=network,
        fs_bytes_first=fs_first,
        fs_bytes_steady=fs_steady,
        bound=_bound(compute, steady_parts),
        notes=notes,
    )


def predict_all(cluster: Cluster, dataset: Dataset, nodes: int | None = None) -> list[Prediction]:
    """Predictions for every strategy at ``nodes`` nodes."""
    n = nodes or cluster.nodes
    return [predict(cluster, dataset, s, n) for s in strategies(n)]


def feasible(prediction: Prediction, cluster: Cluster) -> bool:
    """Whether the strategy's local footprint fits a node's local + RAM capacity (per-file always does)."""
    return prediction.local_bytes <= cluster.local_capacity + cluster.ram_capacity + 1.0


def run_seconds(prediction: Prediction, epochs: int) -> float:
    """Predicted time of a run of ``epochs`` epochs: the first, then steady ones."""
    return prediction.first_epoch_s + max(0, epochs - 1) * prediction.steady_epoch_s


def run_au(prediction: Prediction, epochs: int) -> float:
    """AU over a run of ``epochs`` epochs."""
    total = run_seconds(prediction, epochs)
    return epochs * prediction.compute_s / total if total > 0 else 1.0


def recommend(
    predictions: list[Prediction],
    cluster: Cluster,
    au_target: float,
    epochs: int = 90,
    slow: list[Prediction] | None = None,
) -> tuple[Prediction, str]:
    """The most random feasible strategy whose AU over ``epochs`` epochs reaches ``au_target`` (ties: the
    faster run), and why. When none reaches it: the feasible strategy with the fastest run, and that reason.

    ``slow``: the same strategies' predictions at the slow end of the cluster's measured spread
    (:meth:`Cluster.at_end`); the target must then hold, and runs are compared, at that end, so that the
    choice stands anywhere in the range the probe measured.
    """
    worst = {p.strategy.name: p for p in (slow if slow is not None else predictions)}
    at = " at the slow end of the measured range" if slow is not None else ""

    def au(p: Prediction) -> float:
        return run_au(worst[p.strategy.name], epochs)

    def seconds(p: Prediction) -> float:
        return run_seconds(worst[p.strategy.name], epochs)

    usable = [p for p in predictions if feasible(p, cluster)] or list(predictions)
    meeting = [p for p in usable if au(p) >= au_target]
    if meeting:
        best = min(meeting, key=lambda p: (p.strategy.randomness, seconds(p)))
        faster = [p for p in usable if seconds(p) < seconds(best)]
        why = (
            f"the most random strategy that keeps AU >= {au_target:g} over {epochs} epochs{at} "
            f"(AU {au(best):.2f}, steady epoch bound by {worst[best.strategy.name].bound})"
        )
        if faster:
            quickest = min(faster, key=seconds)
            why += f"; {quickest.strategy.name} is faster but shuffles less"
        return best, why
    best = min(usable, key=lambda p: (seconds(p), p.strategy.randomness))
    return best, (
        f"no strategy reaches AU {au_target:g}{at or ' here'}; {best.strategy.name} has the fastest "
        f"{epochs}-epoch run (AU {au(best):.2f}, steady epoch bound by {worst[best.strategy.name].bound})"
    )


def strategy_hint(
    wait_fraction: float, *, staged: bool, shuffle: str, exchange: float, local_cache: bool
) -> str | None:
    """One line when a run's measured data-wait fraction says, by this model, that another strategy is faster.

    The model's epoch is ``max(compute, I/O)``; a run that waited for data a fraction ``w`` of its time
    would take ``1 - w`` of it with a strategy whose I/O hides under compute. None below 10% wait.
    """
    if not 0.1 <= wait_fraction < 1.0:
        return None
    if not staged:
        change = "packing the data (kaisoku pack) and staging it (--data.local-cache DIR)"
    elif shuffle == "partial" and exchange > 0:
        change = f"a smaller exchange (--data.exchange {exchange / 2:g})"
    elif not local_cache:
        change = "staging shards on node-local disk (--data.local-cache DIR)"
    else:
        change = "another strategy (kaisoku probe, then kaisoku plan, compares them)"
    return (
        f"kaisoku: hint: training waited for data {100 * wait_fraction:.0f}% of the time; by kaisoku plan's "
        f"model {change} could make epochs up to {1 / (1 - wait_fraction):.1f}x faster"
    )
