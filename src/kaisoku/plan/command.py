"""``kaisoku plan``: which staging and shuffle to use on a cluster, from the model in :mod:`kaisoku.plan.model`.

Prints a table of every strategy's predicted first and steady epoch time, AU, local footprint, network
volume and shuffle quality, the recommendation with its reason, and the exact ``kaisoku train`` flags;
``--json`` prints the same as JSON; ``--plot FILE.png`` draws the predicted steady epoch time against the
node count (1 to 4,096) per strategy (matplotlib, from the ``plot`` extra).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.command_parser import CommandParser
from kaisoku.data.order.quality import shuffle_quality
from kaisoku.data.order.shuffle import ShuffleSpec, epoch_order, partial_plan
from kaisoku.errors import ConfigError
from kaisoku.plan.cluster import load_cluster, load_dataset
from kaisoku.plan.model import (
    Cluster,
    Dataset,
    Prediction,
    Strategy,
    predict,
    predict_all,
    recommend,
    run_au,
    run_seconds,
    strategies,
)
from kaisoku.units import format_bytes

PLOT_NODES = tuple(2**k for k in range(13))  # 1 .. 4096
BLOCK_SHARDS = 8
"""The block shuffle's shards per block, as the model prices it and the printed flags set it."""


@lru_cache(maxsize=256)
def _quality(
    shuffle: str, exchange: float, shards: int, per_shard: int, nodes: int, node_batch: int
) -> float:
    sizes = np.full(shards, per_shard, dtype=np.int64)
    global_batch = node_batch * nodes
    if shuffle == "partial":
        plan = partial_plan(sizes, 0, 1, num_nodes=nodes, exchange=exchange, global_batch=global_batch)
        return shuffle_quality(plan.node_orders[0], sizes, node_batch)
    spec = ShuffleSpec(name=shuffle, block_shards=BLOCK_SHARDS)
    return shuffle_quality(epoch_order(sizes, 0, 1, spec, global_batch), sizes, global_batch)


def shuffle_quality_estimate(strategy: Strategy, dataset: Dataset, cluster: Cluster, nodes: int) -> float:
    """kaisoku's shuffle quality of the strategy's order, on a proxy of the dataset's shard layout.

    Evaluated with the same functions training uses (:mod:`kaisoku.data.order.shuffle`, ``quality``) on at
    most 32 nodes, 2,048 shards, 1,000 samples per shard and 2^18 samples, keeping shards per node and the node batch
    where that fits (partial: node 0's batches; others: global batches). Within [0, 1]; a block shuffle
    whose block holds every shard is a global one and scores as such.
    """
    if strategy.shuffle == "block" and dataset.num_shards <= BLOCK_SHARDS:
        # One block spans every shard: the order is a full shuffle, as random as global.
        strategy = dataclasses.replace(strategy, shuffle="global")
    q_nodes = min(nodes, 32) if strategy.shuffle == "partial" else 1
    shards_per_node = (
        max(1, dataset.num_shards // nodes) if strategy.shuffle == "partial" else dataset.num_shards
    )
    shards = max(2, min(2048, shards_per_node * q_nodes))
    per_shard = max(1, min(dataset.samples_per_shard, 1000, (1 << 18) // shards))
    node_batch = cluster.ranks_per_node * cluster.batch_per_rank
    if strategy.shuffle != "partial":
        node_batch *= nodes
    node_batch = max(1, min(node_batch, shards * per_shard // (2 * q_nodes)))
    quality = _quality(strategy.shuffle, strategy.exchange, shards, per_shard, q_nodes, node_batch)
    # The metric is measured against a random order's expectation; a finite sample can land above it.
    return round(min(1.0, max(0.0, quality)), 3)


def train_flags(strategy: Strategy, cluster: Cluster, dataset: Dataset) -> str:
    """The ``kaisoku train`` flags of ``strategy`` on ``cluster``: the readers the model priced, and tiers
    no larger than the dataset (a node never stages more than all of it) nor the node's capacity."""
    local = cluster.local_path or "/local/kaisoku"
    if not strategy.staged:
        workers = max(1, cluster.readers_per_node // max(1, cluster.ranks_per_node))
        return (
            f"--data.path <image folder> --data.shuffle global --data.workers {workers}"
            "   # files read one by one, no staging"
        )
    flags = [f"--data.shuffle {strategy.shuffle}"]
    if strategy.shuffle == "block":
        flags.append(f"--data.block-shards {BLOCK_SHARDS}")
    if strategy.shuffle == "partial":
        flags.append(f"--data.exchange {strategy.exchange:g}")
    if cluster.local_capacity > 0:
        size = _size(min(cluster.local_capacity, _at_least(dataset.nbytes)))
        flags += [f"--data.local-cache {local}", f"--data.local-capacity {size}"]
    if cluster.ram_capacity > 0:
        flags.append(f"--data.ram-capacity {_size(min(cluster.ram_capacity, _at_least(dataset.nbytes)))}")
    return "--data.path <packed dataset> " + " ".join(flags)


def _size(nbytes: float) -> str:
    """Whole GiB, rounded down (a flag must never promise more than the node has); MiB below 1 GiB."""
    if nbytes >= 2**30:
        return f"{int(nbytes // 2**30)}GiB"
    return f"{max(1, int(nbytes // 2**20))}MiB"


def _at_least(nbytes: float) -> float:
    """``nbytes`` rounded up to whole MiB (GiB from 1 GiB up), so that :func:`_size` of it holds it."""
    unit = 2**30 if nbytes >= 2**30 else 2**20
    return float(-(-int(nbytes) // unit) * unit)


def plan_record(
    cluster: Cluster, dataset: Dataset, nodes: int, au: float, epochs: int = 90
) -> dict[str, Any]:
    """Everything ``kaisoku plan`` shows, as plain values (the ``--json`` output)."""
    predictions = predict_all(cluster, dataset, nodes)
    # The ends of the probe's measured spread: every figure with its range, the choice made at the slow end.
    ends = (
        [predict_all(cluster.at_end(end), dataset, nodes) for end in (0, 1)] if cluster.has_spread else None
    )
    best, why = recommend(predictions, cluster, au, epochs, slow=ends[0] if ends else None)
    rows = [_row(p, cluster, dataset, nodes, epochs) for p in predictions]
    if ends:
        for row, slow, fast in zip(rows, *ends, strict=True):
            row["range"] = {
                "first_epoch_s": [round(fast.first_epoch_s, 3), round(slow.first_epoch_s, 3)],
                "steady_epoch_s": [round(fast.steady_epoch_s, 3), round(slow.steady_epoch_s, 3)],
                "run_s": [round(run_seconds(fast, epochs), 3), round(run_seconds(slow, epochs), 3)],
                "au_run": [round(run_au(slow, epochs), 3), round(run_au(fast, epochs), 3)],
            }
    return {
        "cluster": cluster.name,
        "dataset": dataset.name,
        "nodes": nodes,
        "ranks": nodes * cluster.ranks_per_node,
        "dataset_bytes": dataset.nbytes,
        "au_target": au,
        "epochs": epochs,
        "strategies": rows,
        "recommendation": {
            "strategy": best.strategy.name,
            "why": why,
            "flags": train_flags(best.strategy, cluster, dataset),
        },
        "model": "kaisoku.plan.model (see its docstring); figures are predictions, not measurements",
        "spread": (
            "each row's range: the predictions at the slowest and the fastest of the probe's passes"
            if ends
            else "none: the cluster file gives one figure per rate (kaisoku probe writes their spread)"
        ),
        **({"hosts": hosts_record(cluster, nodes)} if cluster.host_names else {}),
    }


def hosts_record(cluster: Cluster, nodes: int) -> dict[str, Any]:
    """The probed hosts a job of ``nodes`` nodes runs on, its slowest reader and its slowest link."""
    job = cluster.in_job(nodes)
    share, slowest = cluster.slowest_share(cluster.host_seq_share, nodes)
    out: dict[str, Any] = {
        "probed": list(cluster.host_names),
        "in_job": [cluster.host_names[h] for h in job],
        "slowest_reader": {"host": slowest, "share_of_mean": round(share, 3)},
    }
    if cluster.links and len(job) > 1:
        rate, i, j = min((cluster.links[i][j], i, j) for i in job for j in job if i != j)
        out["slowest_link"] = {
            "from": cluster.host_names[i], "to": cluster.host_names[j], "MBps": round(rate / 1e6, 3),
        }  # fmt: skip
    return out


def _row(p: Prediction, cluster: Cluster, dataset: Dataset, nodes: int, epochs: int) -> dict[str, Any]:
    return {
        "strategy": p.strategy.name,
        "first_epoch_s": round(p.first_epoch_s, 3),
        "steady_epoch_s": round(p.steady_epoch_s, 3),
        "compute_s": round(p.compute_s, 3),
        "au_first": round(p.au_first, 3),
        "au_steady": round(p.au_steady, 3),
        "run_s": round(run_seconds(p, epochs), 3),
        "au_run": round(run_au(p, epochs), 3),
        "local_bytes_per_node": round(p.local_bytes),
        "network_bytes_per_epoch": round(p.network_bytes),
        "fs_bytes_first_epoch": round(p.fs_bytes_first),
        "fs_bytes_steady_epoch": round(p.fs_bytes_steady),
        "bound": p.bound,
        "quality": shuffle_quality_estimate(p.strategy, dataset, cluster, nodes),
        "randomness_rank": p.strategy.randomness,
        "flags": train_flags(p.strategy, cluster, dataset),
        "notes": p.notes,
    }


def _seconds(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:.1f} h"
    if value >= 60:
        return f"{value / 60:.1f} min"
    return f"{value:.2f} s" if value < 10 else f"{value:.0f} s"


def _ranged(row: dict[str, Any], key: str, text: Callable[[float], str]) -> str:
    """Figure ``key`` of a plan row as text, followed by its range where the probe measured a spread that
    shows at this precision: ``12 s (10 s-16 s)``."""
    low, high = row.get("range", {}).get(key, (row[key], row[key]))
    if text(low) == text(high):
        return text(row[key])
    return f"{text(row[key])} ({text(low)}-{text(high)})"


def show(record: dict[str, Any]) -> None:
    """Print the record as a rich table, the recommendation and its flags."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140) if not sys.stdout.isatty() else None)
    table = Table(
        title=(
            f"kaisoku plan: {record['dataset']} ({format_bytes(int(record['dataset_bytes']))}) on "
            f"{record['cluster']}, {record['nodes']} nodes ({record['ranks']} ranks), predicted"
        )
    )
    for title in (
        "strategy",
        "epoch 1",
        "steady epoch",
        f"{record['epochs']} epochs",
        "AU",
        "local/node",
        "network/epoch",
        "quality",
        "bound",
    ):
        table.add_column(title, justify="left" if title in ("strategy", "bound") else "right")
    chosen = record["recommendation"]["strategy"]
    for row in record["strategies"]:
        mark = " *" if row["strategy"] == chosen else ""
        table.add_row(
            row["strategy"] + mark,
            _ranged(row, "first_epoch_s", _seconds),
            _ranged(row, "steady_epoch_s", _seconds),
            _ranged(row, "run_s", _seconds),
            _ranged(row, "au_run", lambda value: f"{value:.2f}"),
            format_bytes(row["local_bytes_per_node"]),
            format_bytes(row["network_bytes_per_epoch"]),
            f"{row['quality']:.2f}",
            row["bound"],
        )
    console.print(table)
    hosts = record.get("hosts")
    if hosts:
        line = (
            f"hosts: {len(hosts['in_job'])} of {len(hosts['probed'])} probed in the job; the slowest reader, "
            f"{hosts['slowest_reader']['host']}, reads at {hosts['slowest_reader']['share_of_mean']:.2f} of "
            "their mean"
        )
        link = hosts.get("slowest_link")
        if link:
            line += f"; the slowest link, {link['from']} to {link['to']}, carries {link['MBps']:g} MB/s"
        console.print(line, highlight=False)
    rec = record["recommendation"]
    console.print(f"recommended: [bold]{rec['strategy']}[/bold]: {rec['why']}", highlight=False)
    console.print(f"kaisoku train {rec['flags']}", highlight=False, soft_wrap=True)


def curve(
    cluster: Cluster, dataset: Dataset, nodes: Sequence[int] = PLOT_NODES
) -> dict[str, list[float | None]]:
    """Predicted steady epoch seconds per strategy at each node count (None where it does not apply)."""
    names = [s.name for s in strategies(2)]
    out: dict[str, list[float | None]] = {name: [] for name in names}
    for n in nodes:
        by_name = {s.name: s for s in strategies(n)}
        for name in names:
            strategy = by_name.get(name)
            out[name].append(
                None if strategy is None else predict(cluster, dataset, strategy, n).steady_epoch_s
            )
    return out


def plot(cluster: Cluster, dataset: Dataset, path: Path) -> bool:
    """Draw predicted steady epoch time vs node count per strategy; False (and one line) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "kaisoku plan: --plot needs matplotlib (pip install 'kaisoku[plot]'); no plot written",
            file=sys.stderr,
        )
        return False
    data = curve(cluster, dataset)
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, values in data.items():
        xs = [n for n, v in zip(PLOT_NODES, values) if v is not None]
        ax.plot(xs, [v for v in values if v is not None], marker="o", markersize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes")
    ax.set_ylabel("predicted steady epoch time (s)")
    ax.set_title(f"{dataset.name} on {cluster.name} (model prediction)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def cmd_plan(argv: Sequence[str]) -> int:
    """``kaisoku plan --cluster C.toml --dataset D [--nodes N] [--au 0.9] [--json] [--plot FILE.png]``."""
    parser = CommandParser(
        prog="kaisoku plan",
        description=(
            "Predict first and steady epoch time, accelerator utilisation (AU), local footprint and network "
            "volume of each data strategy on a cluster; recommend the most random one that keeps AU at the "
            "target and print its kaisoku train flags. Figures come from a model, not from measurement."
        ),
    )
    parser.add_argument("--cluster", required=True, help="cluster description (TOML; see examples/clusters/)")
    parser.add_argument(
        "--dataset",
        required=True,
        help="dataset description (.toml with [dataset]) or a packed dataset folder",
    )
    parser.add_argument("--nodes", type=int, default=0, help="node count (default: the cluster file's)")
    parser.add_argument("--au", type=float, default=0.9, help="target accelerator utilisation (default 0.9)")
    parser.add_argument(
        "--epochs", type=int, default=90, help="epochs of the run AU is judged over (default 90)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", default="", help="write a PNG of epoch time vs nodes (1..4096)")
    args = parser.parse_args(list(argv))
    if args.nodes < 0 or (args.nodes == 0 and "--nodes" in " ".join(argv)):
        raise ConfigError(f"--nodes must be >= 1 (got {args.nodes})")
    if not 0.0 < args.au <= 1.0:
        raise ConfigError(f"--au must be in (0, 1] (got {args.au})")
    cluster = load_cluster(args.cluster)
    dataset = load_dataset(args.dataset)
    nodes = args.nodes or cluster.nodes
    if args.epochs < 1:
        raise ConfigError(f"--epochs must be >= 1 (got {args.epochs})")
    record = plan_record(cluster, dataset, nodes, args.au, args.epochs)
    if args.json:
        print(json.dumps(record, indent=1))
    else:
        show(record)
    if args.plot and plot(cluster, dataset, Path(args.plot)) and not args.json:
        print(f"wrote {args.plot}")
    return 0
