"""``kaisoku bench plan``: the I/O model of ``kaisoku plan`` against measured epochs, plus projections.

Per link setting of the slow mount (:class:`kaisoku_bench.netfs.SlowMount`), ``kaisoku probe`` measures the
mount and the model predicts every strategy; each (strategy, nodes) cell is then measured on gloo ranks
(per-file reads, or the ``ShardLoader`` ``kaisoku train`` builds, through
:func:`kaisoku_bench.slowfs_readers.node_epochs`), two epochs from a dropped page cache, an epoch's time
being the slowest node's. No DataLoader worker process is started: a worker started from a rank boots a
fresh interpreter (the ranks are forkserver children), 6-15 s of imports that ``kaisoku train``'s default
thread path does not pay. Projections of ``examples/clusters/`` are model
output only. Setup and goals: ``benchmarks/README.md``, section plan.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kaisoku.data.order.shuffle import ShuffleSpec
from kaisoku.data.shards.format import read_index
from kaisoku.distributed.spawn import run_ranks
from kaisoku.plan.cluster import cluster_from_dict, load_cluster, load_dataset
from kaisoku.plan.model import BLOCK_SHARDS, Dataset, predict, recommend, run_seconds, strategies
from kaisoku.plan.probe import probe
from kaisoku_bench import netfs
from kaisoku_bench.common import goal, record_and_show
from kaisoku_bench.imagesets import BATCH, SEED, data_root, image_set, log
from kaisoku_bench.slowfs_readers import (
    CacheDirs,
    KaisokuRun,
    drop_caches_together,
    merge_nodes,
    node_epochs,
    read_files,
)

NAME = "plan"
THREADS = 2
"""Decoding threads per node (``data.workers``) in the staged cells."""
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
PROJECTIONS = (
    ("abci-class.toml", "dataset-imagenet-1k.toml", 512, "ImageNet-1k, 2,048 GPUs (512 nodes x 4)"),
    ("fugaku-class.toml", "dataset-cosmoflow.toml", 512, "CosmoFlow 1.7 TB, 512 nodes"),
    ("fugaku-class.toml", "dataset-cosmoflow.toml", 8192, "CosmoFlow 1.7 TB, 8,192 nodes"),
)


def _spec(name: str, nodes: int) -> ShuffleSpec:
    if name == "staged-block":
        return ShuffleSpec(name="block", block_shards=BLOCK_SHARDS)
    if name == "partial-Q0.25":
        return ShuffleSpec(name="partial", exchange=0.25, num_nodes=nodes)
    if name == "local-only":
        return ShuffleSpec(name="partial", exchange=0.0, num_nodes=nodes)
    return ShuffleSpec(name="global")


def measured_strategies(nodes: int) -> tuple[str, ...]:
    """The strategies measured at ``nodes`` nodes."""
    if nodes == 1:
        return ("per-file", "staged-global", "staged-block")
    return ("per-file", "staged-global", "partial-Q0.25", "local-only")


def _perfile_node(rank: int, world_size: int, tmp: Path, paths: list[str]) -> list[float]:
    """Two epochs of one node reading its share of ``paths`` (keyed random order) with 8 threads."""

    out = []
    for epoch in range(2):
        drop_caches_together(rank)
        order = np.random.Generator(np.random.PCG64([SEED, epoch, 0x9F])).permutation(len(paths))
        mine = [paths[i] for i in order[rank::world_size]]
        start = time.perf_counter()
        read_files(mine, 8)
        out.append(time.perf_counter() - start)
    return out


def measure_cell(strategy: str, nodes: int, pack: Path, paths: list[str], work: Path) -> list[float]:
    """First and second epoch seconds (the slowest node's) of ``strategy`` on ``nodes`` nodes."""
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-plan-", dir=work) as tmp:
        if strategy == "per-file":
            per_node = run_ranks(
                _perfile_node, nodes, Path(tmp), paths, timeout=900.0, collective_timeout=600.0
            )
            return [max(node[e] for node in per_node) for e in range(2)]
        index_bytes = sum(p.stat().st_size for p in pack.glob("*") if p.is_file())
        dirs = CacheDirs(
            ram=Path("/dev/shm") / f"kaisoku-bench-plan-{Path(tmp).name}",
            local=Path(tmp) / "local",
            capacity=int(index_bytes * 1.05) + (1 << 20),
        )
        # Each node: the ShardLoader kaisoku train builds (its default thread path, the node cache, the
        # exchange), two epochs each timed from a barrier with the page cache dropped to its last batch.
        run = KaisokuRun(str(pack), _spec(strategy, nodes), 64, dirs, 1, modes=("e2e",), workers=THREADS)
        try:
            per_node = run_ranks(node_epochs, nodes, Path(tmp), run, timeout=900.0, collective_timeout=600.0)
        finally:
            shutil.rmtree(dirs.ram, ignore_errors=True)
        return [record["seconds"] for record in merge_nodes(per_node)]


def _machine(profile: dict[str, Any], nodes: int, loader_rate: float, capacity: float) -> dict[str, Any]:
    """The probe's profile as a cluster description of ``nodes`` nodes on this machine."""
    data = {k: dict(v) for k, v in profile.items() if isinstance(v, dict)}
    data["cluster"].update(nodes=nodes, ranks_per_node=1, readers_per_node=8)
    data["local"]["capacity"] = int(capacity)
    data["ram"]["capacity"] = int(capacity)
    data["compute"] = {
        "step_seconds": 0.0,
        "batch_per_rank": BATCH // nodes,
        "loader_samples_per_s": loader_rate,
    }
    return data


def _loader_rate(pack: Path, nodes: int, work: Path) -> float:
    """Samples/s of one node's loader from its RAM tier with ``nodes`` nodes running (second epoch,
    unthrottled; the median of 3 runs)."""
    seconds = statistics.median(measure_cell("staged-global", nodes, pack, [], work)[1] for _ in range(3))
    return read_index(pack).num_samples / nodes / seconds


def _projections() -> list[dict[str, Any]]:
    rows = []
    for cluster_file, dataset_file, nodes, label in PROJECTIONS:
        if not (EXAMPLES / cluster_file).is_file():
            rows.append(
                {"row": "projection (model only)", "case": label, "skipped": f"no {EXAMPLES / cluster_file}"}
            )
            continue
        cluster, dataset = load_cluster(EXAMPLES / cluster_file), load_dataset(EXAMPLES / dataset_file)
        preds = [predict(cluster, dataset, s, nodes) for s in strategies(nodes)]
        best, why = recommend(preds, cluster, 0.9, 90)
        for p in preds:
            rows.append(
                {
                    "row": "projection (model only, not measured)",
                    "case": label,
                    "strategy": p.strategy.name + (" *" if p is best else ""),
                    "predicted_e1_s": round(p.first_epoch_s, 2),
                    "predicted_steady_s": round(p.steady_epoch_s, 3),
                    "au_90_epochs": round(90 * p.compute_s / run_seconds(p, 90), 3),
                    "bound": p.bound,
                    **({"recommended_because": why} if p is best else {}),
                }
            )
    return rows


def _summary(cells: list[dict[str, Any]], groups: list[dict[str, Any]], reason: str) -> dict[str, Any]:
    errors = [abs(c["error_e1"]) for c in cells]
    if reason or not errors:
        why = reason or "no cell measured"
        return {
            "epoch_time_median_abs_error": goal(None, "<= 0.15", reason=why),
            "epoch_time_worst_abs_error": goal(None, "<= 0.30", reason=why),
            "recommendation_within_10pct_of_fastest": goal(None, "<= 1.10", reason=why),
        }
    steady = [abs(c["error_e2"]) for c in cells]
    return {
        "epoch_time_median_abs_error": goal(
            statistics.median(errors),
            "<= 0.15",
            samples=errors,
            unit="cells (each measured once)",
            cells=len(cells),
            steady_epoch_median_abs_error=round(statistics.median(steady), 3),
        ),  # fmt: skip
        "epoch_time_worst_abs_error": goal(
            max(errors), "<= 0.30", steady_epoch_worst_abs_error=round(max(steady), 3)
        ),
        "recommendation_within_10pct_of_fastest": goal(
            max(g["recommended_vs_fastest"] for g in groups),
            "<= 1.10",
            per_group={f"{g['setup']} x{g['nodes']}": g["recommended_vs_fastest"] for g in groups},
        ),  # fmt: skip
    }


def _probe_files(folder: Path) -> Path:
    """Files for ``kaisoku probe`` to read through the mount (which it cannot write): 32 of 512 KiB and
    2,000 of 1.5 KB in 16 folders (as a dataset's class folders), written once on the serving side."""
    if not (folder / "done").exists():
        rng = np.random.Generator(np.random.PCG64([SEED, 0x9E]))
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(32):
            (folder / f"seq-{i:02d}.bin").write_bytes(rng.bytes(512 << 10))
        for i in range(2000):
            sub = folder / "small" / f"d{i % 16:02d}"
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"{i:04d}.bin").write_bytes(rng.bytes(1536))
        (folder / "done").write_text("ok")
    return folder


def _setup_rows(
    mount: netfs.SlowMount, setting: netfs.LinkSetting, images: Any, work: Path, rates: dict[int, float],
    probe_seconds: float,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    pack = mount.path(images.pack_dir)
    paths = [str(mount.path(Path(p))) for p in images.files.files]
    scratch = _probe_files(data_root() / "plan-probe-16")
    log(f"plan: probing {setting.label()}")
    profile = probe(mount.path(scratch), seconds=probe_seconds, readers=(1, 2, 4, 8, 16, 32), local=work)
    index = images.index
    dataset = Dataset(
        name=images.name, samples=index.num_samples, sample_bytes=index.nbytes / index.num_samples,
        samples_per_file=1, shard_bytes=float(index.shard_nbytes().mean()),
    )  # fmt: skip
    dataset_perfile = Dataset(
        name=images.name, samples=index.num_samples, sample_bytes=images.file_bytes / index.num_samples,
        samples_per_file=1, shard_bytes=dataset.shard_bytes,
    )  # fmt: skip
    cells, groups = [], []
    for nodes in (1, 2, 4):
        capacity = index.nbytes * 1.05 + (1 << 20)
        cluster = cluster_from_dict(_machine(profile, nodes, rates[nodes], capacity), "probe")
        by_name = {s.name: s for s in strategies(nodes)}
        group = []
        for name in measured_strategies(nodes):
            if name == "per-file":  # threads reading whole files, no loader in the measured path
                pred = predict(replace(cluster, loader_rate=0.0), dataset_perfile, by_name[name], nodes)
            else:
                pred = predict(cluster, dataset, by_name[name], nodes)
            e1, e2 = measure_cell(name, nodes, pack, paths, work)
            cell = {
                "setup": setting.label(), "nodes": nodes, "strategy": name,
                "predicted_e1_s": round(pred.first_epoch_s, 3), "measured_e1_s": round(e1, 3),
                "error_e1": round(pred.first_epoch_s / e1 - 1, 3),
                "predicted_e2_s": round(pred.steady_epoch_s, 3), "measured_e2_s": round(e2, 3),
                "error_e2": round(pred.steady_epoch_s / e2 - 1, 3), "bound": pred.bound,
                "randomness_rank": by_name[name].randomness, "_pred": pred,
            }  # fmt: skip
            log(f"  x{nodes} {name}: predicted {pred.first_epoch_s:.2f} s, measured {e1:.2f} s (epoch 1)")
            group.append(cell)
        best, _ = recommend([c["_pred"] for c in group], cluster, 0.9, epochs=2)
        chosen = next(c for c in group if c["strategy"] == best.strategy.name)
        rival = [c for c in group if c["randomness_rank"] <= chosen["randomness_rank"]]
        fastest = min(c["measured_e1_s"] + c["measured_e2_s"] for c in rival)
        ratio = (chosen["measured_e1_s"] + chosen["measured_e2_s"]) / fastest
        groups.append({"setup": setting.label(), "nodes": nodes, "recommended": chosen["strategy"],
                       "recommended_vs_fastest": round(ratio, 3)})  # fmt: skip
        for c in group:
            c["recommended"] = c is chosen
            del c["_pred"]
        cells += group
    return cells, groups


def _configure(mount: netfs.SlowMount, setting: netfs.LinkSetting, tries: int = 3) -> None:
    """``mount.configure(setting)``, tried again when a helper process starts too slowly on a busy machine."""
    for attempt in range(tries):
        try:
            mount.configure(setting)
            return
        except RuntimeError as error:
            if attempt == tries - 1:
                raise
            log(f"plan: {error}; trying again")


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Validation cells (full runs, when the slow-file-system setup is available) and projections."""
    import torch

    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    cells: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []
    notes = [
        "error = predicted / measured - 1; goals judge the first epoch (cold: page cache dropped, empty node "
        "caches); steady-epoch errors are reported beside them (the loader rate they depend on is measured "
        "on this machine, unthrottled, per node count)",
        "projection rows are model output for the example clusters, not measurements",
    ]
    reason = "not measured in --quick (the validation runs in full runs only)" if quick else ""
    if not quick:
        unavailable = netfs.unavailable_reason()
        if unavailable:
            reason = f"slow-file-system setup unavailable: {unavailable}"
    if not reason:
        images = image_set(2048, 64, "256KiB")
        with tempfile.TemporaryDirectory(prefix="kaisoku-bench-plan-work-") as tmp:
            work = Path(tmp)
            rates = {n: _loader_rate(images.pack_dir, n, work) for n in (1, 2, 4)}
            log(f"plan: loader samples/s per node, unthrottled: {rates}")
            settings = [netfs.LinkSetting(100 * 10**6, 0.001), netfs.LinkSetting(30 * 10**6, 0.0)]
            with netfs.SlowMount(data_root(), timeout=90.0) as mount:
                for setting in settings:
                    _configure(mount, setting)
                    c, g = _setup_rows(mount, setting, images, work, rates, probe_seconds=30.0)
                    cells += c
                    groups += g
            notes.append(f"loader samples/s per node by node count (measured, unthrottled): {rates}")
    summary = _summary(cells, groups, reason)
    rows = cells + groups + _projections()
    return record_and_show(
        NAME, out_dir, summary, rows, columns=_COLUMNS, quick=quick, notes=" | ".join(notes), cell=_short
    )


_COLUMNS = {
    "setup": "setup", "nodes": "nodes", "case": "case", "strategy": "strategy",
    "predicted_e1_s": "pred e1 s", "measured_e1_s": "meas e1 s", "error_e1": "err e1",
    "predicted_e2_s": "pred e2 s", "measured_e2_s": "meas e2 s", "error_e2": "err e2",
    "predicted_steady_s": "pred steady s", "au_90_epochs": "AU 90 ep", "bound": "bound",
    "recommended": "rec", "recommended_vs_fastest": "rec/fastest", "row": "row",
}  # fmt: skip


def _short(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("projection (model only, not measured)", "PROJECTION").replace("Mbit/s", "M")
    return value
