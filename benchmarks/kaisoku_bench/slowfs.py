"""``kaisoku bench slowfs``: a slow shared file system (sshfs from the storage host of a cluster in a box, over a capped, delayed link): kaisoku's training
data path against random per-file reads and the packed peers.

Rows: per-file reads (:mod:`kaisoku_bench.slowfs_readers`; the threaded reader's thread count tuned per
group, :func:`tune_threads`), kaisoku's ``ShardLoader`` as ``kaisoku train`` builds it under the global,
block and partial shuffles (and once with a node cache smaller than the set, :class:`Undersized`), and the
packed peers (:mod:`kaisoku_bench.slowfs_peers`) on the mount of :mod:`kaisoku_bench.netfs`; every
figure is the median of :data:`REPEATS` runs from empty caches; rows and goals are
:mod:`kaisoku_bench.slowfs_rows`. Setup, goals and limits: ``benchmarks/README.md``, section slowfs.
Without root, sshfs or sshd every goal is recorded unmet with the reason.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kaisoku.data.order.quality import shuffle_quality
from kaisoku.data.order.sampler import EpochSampler
from kaisoku.data.order.shuffle import ShuffleSpec, epoch_order
from kaisoku.data.shards.format import Index
from kaisoku.plan.probe import drop_caches
from kaisoku_bench import loader_peers, netfs, slowfs_peers
from kaisoku_bench.common import record_and_show
from kaisoku_bench.imagesets import (
    BATCH,
    SEED,
    ImageSet,
    data_root,
    image_set,
    log,
)
from kaisoku_bench.slowfs_readers import CacheDirs, KaisokuRun, kaisoku_epochs, perfile_epoch, perfile_window
from kaisoku_bench.slowfs_rows import (
    finish_group,
    kaisoku_row,
    peer_row,
    perfile_row,
    summary_b,
    undersized_row,
)
from kaisoku_bench.training import tune

NAME = "slowfs"
REPEATS = 3
"""Runs per row; every figure of a row is their median."""
SPECS = {
    "global": ShuffleSpec(name="global"),
    "block": ShuffleSpec(name="block", block_shards=4),
    "partial": ShuffleSpec(name="partial", exchange=0.25, num_nodes=2),
}
"""kaisoku's rows: the shuffle of each (the partial one on 2 nodes)."""
TUNED = "tuned threads"
"""The per-file reader whose thread count is tuned over a :class:`ThreadGrid` in each group."""


@dataclass(frozen=True)
class ThreadGrid:
    """How the tuned per-file reader's thread count is chosen in each group: one timed window of random
    per-file reads (:func:`~kaisoku_bench.slowfs_readers.perfile_window`) per thread count of ``threads``,
    extended by :func:`kaisoku_bench.training.tune`'s rule (up to ``extend_limit`` more points, doubling or
    halving) until the best has a tried lower and a tried higher neighbour falling off."""

    threads: tuple[int, ...] = (4, 8, 16, 32, 64)
    extend_limit: int = 3
    window_s: float = 2.0


@dataclass(frozen=True)
class Undersized:
    """The row whose node cache holds less than the set: kaisoku under ``shuffle`` with a node-local
    folder of ``fraction`` of the set's bytes and no RAM tier, I/O runs, in the first link's group of the
    set ``set_name``.

    The set is repacked in shards of ``shard_bytes`` so that a block's shards fit the folder and no access
    bypasses it: with the set's own 8 MiB shards a block of 4 is about half the set, the plan bypasses
    accesses, and the readers read those from the source unless they still hold a copy (up to 256 MiB a
    process), which makes the count inexact."""

    shuffle: str = "block"
    fraction: float = 0.5
    shard_bytes: str = "1MiB"
    set_name: str = "64px"
    """The set it runs on (the 400px set's 1,024 samples give blocks of about a step: its plan bypasses)."""


@dataclass(frozen=True)
class SlowSet:
    """A file set and how many of its files the per-file rows read."""

    image_set: ImageSet
    perfile_count: dict[float, int]  # delay -> files read per per-file pass


def _quality(order: np.ndarray, index: Index) -> float:
    return round(shuffle_quality(order, index.shard_sizes(), BATCH), 3)


def part_b(
    slow_sets: Sequence[SlowSet],
    settings: Sequence[netfs.LinkSetting],
    work: Path,
    *,
    ceiling_bytes: int,
    budget_s: float,
    repeats: int = REPEATS,
    readers: Sequence[str] = ("2 workers", TUNED),
    shuffles: Sequence[str] = ("global", "block", "partial"),
    peers: Sequence[str] = slowfs_peers.PEERS,
    grid: ThreadGrid = ThreadGrid(),
    undersized: Undersized | None = Undersized(),
) -> tuple[list[dict], dict, list[str]]:
    """Rows, summary entries and notes of the slow-file-system rows (the setup must be available).

    ``readers``: the per-file rows ("2 workers", "<n> threads", :data:`TUNED` over ``grid``); ``shuffles``:
    kaisoku's rows; ``peers``: the packed peers' rows; ``undersized``: the row with a node cache smaller
    than the set (None: none); each figure of a row is the median of ``repeats`` runs.
    """
    served = data_root()
    ceiling_file = served / f"ceiling-{ceiling_bytes}.bin"
    if not ceiling_file.exists() or ceiling_file.stat().st_size != ceiling_bytes:
        ceiling_file.write_bytes(np.random.Generator(np.random.PCG64(SEED)).bytes(ceiling_bytes))
    specs = {name: SPECS[name] for name in shuffles}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    missing = _prepare_peers(slow_sets, peers)
    repacked = {}
    if undersized is not None:  # packed on the serving side once, kept between runs
        repacked = {s.image_set.name: image_set(s.image_set.count, s.image_set.size, undersized.shard_bytes)
                    for s in slow_sets if s.image_set.name == undersized.set_name}  # fmt: skip
    deadline = time.monotonic() + budget_s
    ram_root = Path("/dev/shm") / f"kaisoku-bench-{os.getpid()}"
    plan = _Group(
        specs=specs, readers=tuple(readers), peers=tuple(peers), missing=missing, repeats=repeats, grid=grid,
        undersized=undersized, repacked=repacked,
    )  # fmt: skip
    with netfs.SlowMount(served) as mount:
        try:
            for number, setting in enumerate(settings):
                mount.configure(setting)
                if number == 1:  # the undersized row runs in the first link's group only
                    plan = replace(plan, undersized=None)
                for slow in slow_sets:
                    if time.monotonic() > deadline:
                        notes.append(f"time budget spent before {setting.label()} {slow.image_set.name}")
                        continue
                    rows.extend(_slow_group(mount, setting, slow, plan, ceiling_file, work, ram_root))
        finally:
            shutil.rmtree(ram_root, ignore_errors=True)
    return rows, summary_b(rows), notes


@dataclass(frozen=True)
class _Group:
    """What every (link, set) group measures."""

    specs: dict[str, ShuffleSpec]
    readers: tuple[str, ...]
    peers: tuple[str, ...]
    missing: dict[tuple[str, str], str]  # (set name, peer) -> why the peer has no row
    repeats: int
    grid: ThreadGrid
    undersized: Undersized | None
    repacked: dict[str, ImageSet]  # set name -> the set in the undersized row's shard size


def _prepare_peers(slow_sets: Sequence[SlowSet], peers: Sequence[str]) -> dict[tuple[str, str], str]:
    """Write every peer's format of every set on the serving side; return why a peer cannot run."""
    missing: dict[tuple[str, str], str] = {}
    for slow in slow_sets:
        for name in peers:
            log(f"slowfs: {name}'s format of {slow.image_set.name} (written once, kept between runs)")
            try:
                slowfs_peers.write_format(slow.image_set, data_root() / "peers", name)
            except loader_peers.PeerMissing as error:
                missing[(slow.image_set.name, name)] = str(error)
    return missing


def _ceiling(mount: netfs.SlowMount, ceiling_file: Path) -> float:
    drop_caches()
    seconds, nbytes = netfs.sequential_read_seconds(mount.path(ceiling_file))
    return nbytes / seconds


def _slow_group(
    mount: netfs.SlowMount,
    setting: netfs.LinkSetting,
    slow: SlowSet,
    plan: _Group,
    ceiling_file: Path,
    work: Path,
    ram_root: Path,
) -> list[dict[str, Any]]:
    image_set = slow.image_set
    index = image_set.index
    mounted_pack = mount.path(image_set.pack_dir)
    paths = [str(mount.path(Path(p))) for p in image_set.files.files]
    labels = image_set.files.labels
    set_label = (
        f"{image_set.name} ({image_set.file_bytes / len(paths) / 1024:.1f} KiB/file, {len(paths)} files)"
    )
    group = f"{setting.label()} | {set_label}"
    log(f"slowfs {group}")
    ceilings = [_ceiling(mount, ceiling_file)]
    rows: list[dict[str, Any]] = []
    base = {"link": setting.label(), "set": set_label}

    # Random per-file reads over a random subset (the whole set would take minutes per pass at 2 ms RTT).
    count = min(slow.perfile_count[setting.delay], len(paths))
    subset = np.random.Generator(np.random.PCG64([SEED, 0x51])).permutation(len(paths))[:count]
    subset = subset[: (count // BATCH) * BATCH]
    subset_bytes = int(sum(os.path.getsize(image_set.files.files[i]) for i in subset))
    global_quality = _quality(epoch_order(index.shard_sizes(), SEED, 0, ShuffleSpec(), BATCH), index)
    for readers in plan.readers:
        tuned = None
        if readers == TUNED:
            tune_order = np.random.Generator(np.random.PCG64([SEED, 0x7E])).permutation(len(paths))
            tuned = tune_threads(
                plan.grid, lambda n, o=tune_order: perfile_window(paths, o, n, plan.grid.window_s)
            )
            readers = f"{tuned['threads_tuned']} threads"
        timings: dict[tuple[str, int], list[float]] = {}
        for _ in range(plan.repeats):
            for mode in ("io", "e2e"):
                for epoch in range(2):
                    seconds, _ = perfile_epoch(
                        paths, labels, subset, mode=mode, readers=readers, size=image_set.size, epoch=epoch
                    )
                    timings.setdefault((mode, epoch), []).append(seconds)
        rows.append(
            perfile_row(
                base,
                readers,
                timings,
                files=int(subset.size),
                nbytes=subset_bytes,
                set_files=len(paths),
                rate_bytes=setting.rate_bytes,
                quality=global_quality,
                grid=tuned,
            )
        )
        log(f"  {rows[-1]['row']}: {rows[-1]['io_e1_samples_per_s']:.0f} files/s (I/O, epoch 1, median)")

    dirs = CacheDirs(ram=ram_root, local=work / "local-cache", capacity=int(index.nbytes * 1.05) + (1 << 20))
    for name, spec in plan.specs.items():
        records = kaisoku_epochs(KaisokuRun(str(mounted_pack), spec, image_set.size, dirs, plan.repeats))
        ceilings.append(_ceiling(mount, ceiling_file))
        if name == "partial":  # node 0's share at its per-node batch
            sampler = EpochSampler(
                index.shard_sizes(), global_batch=BATCH, rank=0, world_size=2, seed=SEED, shuffle=spec
            )
            node_order = sampler.partial_plan(0).node_orders[0]
            quality = round(shuffle_quality(node_order, index.shard_sizes(), BATCH // 2), 3)
        else:
            quality = _quality(epoch_order(index.shard_sizes(), SEED, 0, spec, BATCH), index)
        rows.append(
            kaisoku_row(
                base,
                name,
                _spec_text(spec),
                records,
                quality=quality,
                nbytes=index.nbytes,
                rate_bytes=setting.rate_bytes,
            )
        )
        row = rows[-1]
        log(
            f"  kaisoku {name}: I/O {row['io_e1_MBps']} MB/s epoch 1, {row['io_e2_s']} s epoch 2; "
            f"e2e {row['e2e_e1_samples_per_s']} / {row['e2e_e2_samples_per_s']} samples/s (medians)"
        )
    if plan.undersized is not None and image_set.name in plan.repacked:
        repacked = plan.repacked[image_set.name]
        rows.append(_undersized_row(plan, str(mount.path(repacked.pack_dir)), repacked, base, work, ram_root))

    for name in plan.peers:
        why = plan.missing.get((image_set.name, name))
        if why is None:
            folder = mount.path(slowfs_peers.peer_folder(image_set, data_root() / "peers", name))
            try:
                records = slowfs_peers.peer_epochs(
                    lambda cache, n=name, f=folder: slowfs_peers.mounted_reader(n, f, cache),
                    work / f"peer-{name}",
                    plan.repeats,
                )
            except Exception as error:  # a peer failing on this setup is a finding, not the run's end
                why = f"failed: {type(error).__name__}: {error}"[:400]
            else:
                ceilings.append(_ceiling(mount, ceiling_file))
                rows.append(peer_row(base, name, records, cache=slowfs_peers.CACHE[name]))
                log(f"  peer {name}: e2e {rows[-1]['e2e_e1_samples_per_s']} samples/s epoch 1 (median)")
        if why is not None:
            rows.append({**base, "row": f"peer {name}", "skipped": why})
            log(f"  peer {name}: skipped ({why})")
    return finish_group(rows, ceilings)


def tune_threads(grid: ThreadGrid, measure: Callable[[int], dict[str, float]]) -> dict[str, Any]:
    """The per-file reader's best thread count by files/s over ``grid``, ``measure(threads)`` giving one
    point (:func:`~kaisoku_bench.slowfs_readers.perfile_window`'s ``{"threads", "files_per_s", ...}``);
    whether it is inside the grid (:func:`kaisoku_bench.training.tune`'s rule) and the points tried. Fewer
    than one thread reads nothing (0 files/s, not measured), which settles the lower side."""
    points: list[dict[str, float]] = []

    def files_per_s(setting: float) -> float:
        threads = int(round(setting))
        if threads < 1:
            return 0.0
        points.append(measure(threads))
        return points[-1]["files_per_s"]

    best, _, inside = tune(
        tuple(float(t) for t in grid.threads), files_per_s, grid.extend_limit, failed_score=0.0
    )
    points.sort(key=lambda p: p["threads"])
    tried = ", ".join(f"{p['threads']}: {p['files_per_s']:g}/s" for p in points)
    log(f"  per-file thread grid (best {best:g}, inside: {inside}): {tried}")
    return {
        "threads_tuned": int(round(best)),
        "threads_inside": inside,
        "thread_grid": points,
        "grid_window_s": grid.window_s,
    }


def _undersized_row(
    plan: _Group,
    mounted_pack: str,
    image_set: ImageSet,
    base: dict[str, Any],
    work: Path,
    ram_root: Path,
) -> dict[str, Any]:
    """kaisoku with a node cache smaller than the set (:class:`Undersized`): I/O runs of 2 epochs."""
    assert plan.undersized is not None
    spec = SPECS[plan.undersized.shuffle]
    index = image_set.index
    capacity = int(index.nbytes * plan.undersized.fraction)
    dirs = CacheDirs(ram=ram_root, local=work / "local-cache", capacity=capacity, ram_capacity=0)
    records = kaisoku_epochs(
        KaisokuRun(mounted_pack, spec, image_set.size, dirs, plan.repeats, modes=("io",))
    )
    row = undersized_row(
        base,
        spec.name,
        _spec_text(spec),
        records,
        cache_fraction=plan.undersized.fraction,
        nbytes=index.nbytes,
    )
    log(
        f"  {row['row']}: source reads vs the cache's plan per run: "
        + ", ".join(f"{r['source_reads']}/{r['planned_reads']}" for r in row["cache_runs"])
    )
    return row


def _spec_text(spec: ShuffleSpec) -> str:
    if spec.name == "block":
        return f"block ({spec.block_shards} shards/block, buffer {spec.buffer_size})"
    if spec.name == "partial":
        return f"partial (Q={spec.exchange}, {spec.num_nodes} nodes)"
    return spec.name


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "skipped" not in r and "link" in r]
    io_rows = [r for r in measured if "io_e1_vs_ceiling" in r]
    if not io_rows:
        return
    e2e_rows = [r for r in measured if "e2e_e1_samples_per_s" in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    _bars(axes[0], io_rows, "io_e1_vs_ceiling")
    axes[0].axhline(0.8, color="black", linewidth=0.8, linestyle="--")
    axes[0].set_ylabel("epoch-1 I/O rate / sequential-read ceiling")
    axes[0].set_title("sshfs source, page cache dropped (goal line 0.8; medians)")
    axes[0].set_ylim(0, 1.3)
    _bars(axes[1], e2e_rows, "e2e_e1_samples_per_s")
    axes[1].set_ylabel("epoch-1 end-to-end samples/s (median)")
    axes[1].set_yscale("log")
    axes[1].set_ylim(top=10 * max(r["e2e_e1_samples_per_s"] for r in e2e_rows))  # room for the legend
    axes[1].set_title("end to end, epoch 1: kaisoku, packed peers, per-file reads (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _bars(ax: Any, rows: list[dict[str, Any]], key: str) -> None:
    groups = list(dict.fromkeys((r["link"], r["set"]) for r in rows))
    names = list(dict.fromkeys(r["row"] for r in rows))
    bar = 0.8 / len(names)
    for k, name in enumerate(names):
        values = [
            next((r[key] for r in rows if (r["link"], r["set"]) == g and r["row"] == name), 0) for g in groups
        ]
        ax.bar(np.arange(len(groups)) + k * bar, values, bar, label=_short(name))
    ax.set_xticks(
        np.arange(len(groups)) + bar * (len(names) - 1) / 2,
        [f"{_short(link)}\n{_short(set_label)}" for link, set_label in groups],
        fontsize=8,
    )
    ax.legend(fontsize=7, ncol=3, loc="upper center")


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Measure the slow-file-system rows; write ``slowfs.json`` (and ``slowfs.png``) under ``out_dir``."""
    torch.set_num_threads(1)
    unavailable = netfs.unavailable_reason()
    if unavailable is not None:
        rows = [{"row": "slow shared file system", "skipped": unavailable}]
        summary = summary_b([], unavailable=f"setup unavailable: {unavailable}")
        return _finish(out_dir, summary, rows, [f"skipped: {unavailable}"], quick)
    root = data_root()
    root.mkdir(parents=True, exist_ok=True)
    small = image_set(1024, 64, "1MiB") if quick else image_set(20000, 64, "8MiB")
    options: dict[str, Any]
    if quick:  # a smoke run of the setup: one link, the tuned per-file row, kaisoku global, WebDataset
        slow_sets = [SlowSet(small, {0.001: 256, 0.0: 256})]
        settings = [netfs.LinkSetting(10**9, 0.001)]
        options = {
            "ceiling_bytes": 4 << 20,
            "budget_s": 30.0,
            "grid": ThreadGrid(window_s=0.3, extend_limit=2),
        }
        options.update(readers=(TUNED,), shuffles=("global",), peers=("webdataset",))
        options["undersized"] = Undersized(shard_bytes="256KiB")
    else:
        large = image_set(1024, 400, "8MiB")  # 4 whole batches: no dropped tail
        slow_sets = [
            SlowSet(small, {0.001: 1024, 0.0: 4096}),
            SlowSet(large, {0.001: 256, 0.0: 256}),
        ]
        settings = [
            netfs.LinkSetting(10**9, 0.001),
            netfs.LinkSetting(200 * 10**6, 0.001),
            netfs.LinkSetting(10**9, 0.0),
            netfs.LinkSetting(200 * 10**6, 0.0),
        ]
        options = {"ceiling_bytes": 32 << 20, "budget_s": 5400.0}
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-slowfs-") as tmp:
        rows, summary, notes = part_b(slow_sets, settings, Path(tmp), **options)
    notes.append(
        f"every figure of a row is the median of {REPEATS} runs (repeats), each from empty caches; "
        "*_runs_s list the runs; source_reads_e2 is the largest over runs and modes"
    )
    notes.append(
        "kaisoku rows: the ShardLoader kaisoku train iterates, built from a Config by "
        "engine.data_build.shard_loader (data.workers 2 decoding threads, batch 256, 2 epochs), its node "
        "cache with a node-local folder and a /dev/shm RAM tier each sized to hold the whole set (but the "
        "undersized-cache row's); epoch 1 "
        "includes starting the cache and all staging; I/O runs leave images encoded (a transform that "
        "returns each record's image byte count), end-to-end runs decode and flip; block = 4 shards per "
        "block; partial = 2 nodes (gloo ranks, own cache folders) exchanging Q=0.25 through RecordStore, "
        "epoch time = the slower node, quality = node 0's batches of 128; source reads are the loader's "
        "own epoch_stats()."
    )
    notes.append(
        "peer rows: LitData (local: + the mounted folder, its cache in a local folder), MDS (remote = the "
        "mounted folder, local = a local folder), WebDataset (tar shards read in place: no cache); 2 "
        "DataLoader workers decoding with simplejpeg, as in kaisoku bench loader; their shuffles are their "
        "own (chunk/shard shuffles with buffers: less random than kaisoku global). kaisoku_vs_best_packed_"
        "peer compares end-to-end epoch-1 samples/s (the cold epoch, where the mount decides)."
    )
    notes.append(
        "sshfs 3.7.3 calls sshfs 2.x's cache=no dir_cache=no (cache=no is accepted but not in "
        "its option table), used here; the page cache is dropped (echo 3 > /proc/sys/vm/drop_caches) "
        "before every epoch of every run. Per-file rows read a random subset of the files "
        "(files_measured) and report files/s; epoch_e1_s_extrapolated scales that to the whole set."
    )
    grid = options.get("grid", ThreadGrid())
    notes.append(
        f"tuned per-file row: per group, one timed window of {grid.window_s:g} s of random per-file reads "
        f"(whole files, a dropped page cache) per thread count of {list(grid.threads)}, extended by "
        f"doubling or halving (up to {grid.extend_limit} more points) until the best has a tried lower "
        "and a tried higher neighbour falling off (bench.training.tune's rule); the best thread count is "
        "then measured like every row (I/O: n threads; end to end: n/2 threads in each of 2 DataLoader "
        "workers). The kaisoku_*_io_vs_tuned_perfile goals are unmet when that grid is one-sided "
        "(threads_inside false; thread_grid lists the points)."
    )
    undersized = options.get("undersized", Undersized())
    notes.append(
        f"undersized-cache row (the first link's {undersized.set_name} group): kaisoku {undersized.shuffle} with its node-local "
        f"folder capped at {undersized.fraction:g} of the set's bytes and no RAM tier, I/O runs, on the set "
        f"repacked in {undersized.shard_bytes} shards (a block's shards fit the folder: no access bypasses "
        "it; a bypassed shard's copy kept by the reader, up to 256 MiB a process, would hide re-reads); "
        "kaisoku_rereads_minus_evicted_undersized_cache is, per run, the source bytes the loader's "
        "epoch_stats() counted over both epochs minus those the node cache's own stager log accounts for "
        "(each shard's first load, loads of shards it had evicted, bypassed accesses), the largest in size "
        "(the stager reads ahead across the epoch boundary, so the comparison is over the run; cache_runs "
        "also gives epoch 2's counted reads and the evictions)."
    )
    return _finish(out_dir, summary, rows, notes, quick)


def _finish(
    out_dir: Path,
    summary: dict[str, dict[str, Any]],
    rows: list[dict[str, Any]],
    notes: list[str],
    quick: bool,
) -> dict[str, Any]:
    """Write the record and the plot; print the tables."""
    return record_and_show(
        NAME,
        out_dir,
        summary,
        rows,
        columns=_COLUMNS,
        quick=quick,
        notes=" | ".join(notes),
        plot=_plot,
        cell=_short,
    )


_COLUMNS = {
    "link": "link", "set": "set", "row": "row", "repeats": "runs", "quality": "quality",
    "io_e1_samples_per_s": "I/O e1 /s",
    "io_e1_vs_ceiling": "vs ceiling", "ceiling_MBps": "ceiling MB/s", "io_e2_s": "I/O e2 s",
    "e2e_e1_samples_per_s": "e2e e1 /s", "e2e_e2_samples_per_s": "e2e e2 /s", "source_reads_e2": "src e2",
    "skipped": "skipped",
}  # fmt: skip
_SHORT = {"per-file random reads, ": "per-file ", "peer ": "", "Gbit/s": "G", "Mbit/s": "M", ", RTT+": "/"}


def _short(value: Any) -> Any:
    if isinstance(value, str):
        for long, short in _SHORT.items():
            value = value.replace(long, short)
        return value.split(" (")[0] if value[:1].isdigit() and "px" in value else value
    return value
