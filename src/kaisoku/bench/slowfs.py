"""``kaisoku bench slowfs``: a slow shared file system (sshfs over a capped, delayed veth) against random
per-file reads.

The data folder is served by sshd from another network namespace (:mod:`kaisoku.bench.netfs`), mounted
with sshfs, link capped at 1 Gbit/s and 200 Mbit/s, with D = 1 ms and D = 0 held per direction by a
pipelined delay proxy; page cache dropped before every epoch of every row. Two file sets
(:mod:`kaisoku.bench.imagesets`): the 64x64 JPEGs (20,000 files) and 1,024 JPEGs of 400x400 (~95 KiB
each). Per row, epochs 1 and 2: I/O time (every sample's bytes delivered, no decode) and end-to-end loader
time (decode, flip, collate, 2 workers). Readers: random per-file reads, with 2 DataLoader workers (each
reads its batch's files one by one) and with 8 reader threads (I/O: a pool of 8 threads; end to end: 2
workers reading each batch with 4 threads), measured on a random subset of the files and reported as
files/s; kaisoku under the global, block and partial shuffles, reading through
:class:`~kaisoku.data.cache.NodeCache` (node-local directory and RAM tier, staged ahead from the source),
partial as 2 nodes (gloo ranks with their own caches; readers in :mod:`kaisoku.bench.slowfs_readers`)
exchanging Q = 0.25. Beside each row: shuffle quality, the link bound (bytes / rate) and the setup's
ceiling, one sequential read of a large file through the same mount, measured in the same group of rows.
Goals: kaisoku's epoch-1 I/O >= 10x the 8-thread per-file rate on the small files at 1 Gbit/s with 2 ms
RTT; kaisoku's epoch-1 I/O rate >= 0.8x the ceiling on every row; no source reads in epoch 2. Where the
setup cannot run (no root, sshfs or sshd), every goal is recorded unmet with the reason.

This part was measured by ``kaisoku bench loader`` before it became a benchmark of its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kaisoku.bench import netfs
from kaisoku.bench.common import goal, record_and_show
from kaisoku.bench.imagesets import (
    BATCH,
    SEED,
    ImageSet,
    data_root,
    image_set,
    log,
)
from kaisoku.bench.slowfs_readers import CacheDirs, kaisoku_partial, kaisoku_single_node, perfile_epoch
from kaisoku.data.format import Index
from kaisoku.data.quality import shuffle_quality
from kaisoku.data.sampler import EpochSampler
from kaisoku.data.shuffle import ShuffleSpec, epoch_order

NAME = "slowfs"


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
    readers: Sequence[str] = ("2 workers", "8 threads"),
    shuffles: Sequence[str] = ("global", "block", "partial"),
) -> tuple[list[dict], dict, list[str]]:
    """Rows, summary entries and notes of the slow-file-system rows (the setup must be available).

    ``readers``: the per-file rows ("2 workers", "8 threads"); ``shuffles``: kaisoku's rows.
    """
    served = data_root()
    ceiling_file = served / f"ceiling-{ceiling_bytes}.bin"
    if not ceiling_file.exists() or ceiling_file.stat().st_size != ceiling_bytes:
        ceiling_file.write_bytes(np.random.Generator(np.random.PCG64(SEED)).bytes(ceiling_bytes))
    all_specs = {
        "global": ShuffleSpec(name="global"),
        "block": ShuffleSpec(name="block", block_shards=4),
        "partial": ShuffleSpec(name="partial", exchange=0.25, num_nodes=2),
    }
    specs = {name: all_specs[name] for name in shuffles}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    deadline = time.monotonic() + budget_s
    ram_root = Path("/dev/shm") / f"kaisoku-bench-{os.getpid()}"
    with netfs.SlowMount(served, log=log) as mount:
        try:
            for setting in settings:
                mount.configure(setting)
                for slow in slow_sets:
                    if time.monotonic() > deadline:
                        notes.append(f"time budget spent before {setting.label()} {slow.image_set.name}")
                        continue
                    rows.extend(_slow_group(mount, setting, slow, specs, ceiling_file, work, ram_root))
        finally:
            shutil.rmtree(ram_root, ignore_errors=True)
    return rows, summary_b(rows), notes


def _ceiling(mount: netfs.SlowMount, ceiling_file: Path) -> float:
    netfs.drop_caches()
    seconds, nbytes = netfs.sequential_read_seconds(mount.path(ceiling_file))
    return nbytes / seconds


def _slow_group(
    mount: netfs.SlowMount,
    setting: netfs.LinkSetting,
    slow: SlowSet,
    specs: dict[str, ShuffleSpec],
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
    for readers in ("2 workers", "8 threads"):
        timings: dict[str, list[float]] = {"io": [], "e2e": []}
        for mode in ("io", "e2e"):
            for epoch in range(2):
                seconds, _ = perfile_epoch(
                    paths, labels, subset, mode=mode, readers=readers, size=image_set.size, epoch=epoch
                )
                timings[mode].append(seconds)
        files_per_s = [subset.size / s for s in timings["io"]]
        rows.append(
            {
                **base,
                "row": f"per-file random reads, {readers}",
                "shuffle": "global (per file)",
                "quality": global_quality,
                "files_measured": int(subset.size),
                "bytes_measured": subset_bytes,
                "link_bound_s": round(subset_bytes / setting.rate_bytes, 3),
                "io_e1_s": round(timings["io"][0], 3),
                "io_e2_s": round(timings["io"][1], 3),
                "io_e1_samples_per_s": round(files_per_s[0], 1),
                "io_e2_samples_per_s": round(files_per_s[1], 1),
                "io_e1_MBps": round(subset_bytes / timings["io"][0] / 1e6, 2),
                "e2e_e1_samples_per_s": round(subset.size / timings["e2e"][0], 1),
                "e2e_e2_samples_per_s": round(subset.size / timings["e2e"][1], 1),
                "epoch_e1_s_extrapolated": round(timings["io"][0] * len(paths) / subset.size, 1),
            }
        )
        log(f"  {rows[-1]['row']}: {files_per_s[0]:.0f} files/s (I/O, epoch 1)")

    dirs = CacheDirs(ram=ram_root, local=work / "local-cache", capacity=int(index.nbytes * 1.05) + (1 << 20))
    for name, spec in specs.items():
        run = kaisoku_partial if name == "partial" else kaisoku_single_node
        io = run(mounted_pack, spec, mode="io", size=image_set.size, dirs=dirs)
        ceilings.append(_ceiling(mount, ceiling_file))
        e2e = run(mounted_pack, spec, mode="e2e", size=image_set.size, dirs=dirs)
        shutil.rmtree(dirs.local, ignore_errors=True)
        shutil.rmtree(dirs.ram, ignore_errors=True)
        if name == "partial":
            sampler = EpochSampler(
                index.shard_sizes(), global_batch=BATCH, rank=0, world_size=2, seed=SEED, shuffle=spec
            )
            plan = sampler.partial_plan(0)
            node_order = plan.node_orders[0]
            quality = round(shuffle_quality(node_order, index.shard_sizes(), BATCH // 2), 3)
        else:
            quality = _quality(epoch_order(index.shard_sizes(), SEED, 0, spec, BATCH), index)
        samples = len(epoch_order(index.shard_sizes(), SEED, 0, spec, BATCH)) if name != "partial" else None
        samples = samples or e2e[0]["total"]
        io_rate = io[0]["total"] / io[0]["seconds"]
        rows.append(
            {
                **base,
                "row": f"kaisoku {name}",
                "shuffle": _spec_text(spec),
                "quality": quality,
                "samples": samples,
                "bytes_read": io[0]["source_bytes"],
                "link_bound_s": round(index.nbytes / setting.rate_bytes, 3),
                "io_e1_s": round(io[0]["seconds"], 3),
                "io_e2_s": round(io[1]["seconds"], 3),
                "io_e1_samples_per_s": round(samples / io[0]["seconds"], 1),
                "io_e2_samples_per_s": round(samples / io[1]["seconds"], 1),
                "io_e1_MBps": round(io_rate / 1e6, 2),
                "e2e_e1_s": round(e2e[0]["seconds"], 3),
                "e2e_e2_s": round(e2e[1]["seconds"], 3),
                "e2e_e1_samples_per_s": round(e2e[0]["total"] / e2e[0]["seconds"], 1),
                "e2e_e2_samples_per_s": round(e2e[1]["total"] / e2e[1]["seconds"], 1),
                "source_reads_e1": io[0]["source_reads"],
                "source_reads_e2": io[1]["source_reads"] + e2e[1]["source_reads"],
                "_io_rate": io_rate,
                **({"exchanged_per_epoch": io[0]["exchanged"]} if "exchanged" in io[0] else {}),
            }
        )
        log(
            f"  kaisoku {name}: I/O {rows[-1]['io_e1_MBps']} MB/s epoch 1, {rows[-1]['io_e2_s']} s epoch 2; "
            f"e2e {rows[-1]['e2e_e1_samples_per_s']} / {rows[-1]['e2e_e2_samples_per_s']} samples/s"
        )
    ceiling = float(np.median(ceilings))
    for row in rows:
        row["ceiling_MBps"] = round(ceiling / 1e6, 2)
        row["ceiling_runs_MBps"] = [round(c / 1e6, 2) for c in ceilings]
        rate = row.pop("_io_rate", None)
        if rate is None:
            rate = row["bytes_measured"] / row["io_e1_s"]
        row["io_e1_vs_ceiling"] = round(rate / ceiling, 3)
        row["link_bound_note"] = (
            "link-bound" if row["link_bound_s"] >= 0.8 * row["io_e1_s"] else "latency/CPU-bound"
        )
    return rows


def _spec_text(spec: ShuffleSpec) -> str:
    if spec.name == "block":
        return f"block ({spec.block_shards} shards/block, buffer {spec.buffer_size})"
    if spec.name == "partial":
        return f"partial (Q={spec.exchange}, {spec.num_nodes} nodes)"
    return spec.name


def summary_b(rows: list[dict[str, Any]], unavailable: str = "") -> dict[str, dict[str, Any]]:
    """Every goal of the benchmark from its rows; ``unavailable``: why the setup could not run at all.

    A goal whose rows were not measured (setup unavailable, time budget spent, a quick run's subset)
    is recorded unmet with the reason.
    """
    summary: dict[str, dict[str, Any]] = {}
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if "skipped" not in row:
            groups.setdefault((row["link"], row["set"]), {})[row["row"]] = row
    reference_group = next(
        (
            g
            for (link, set_label), g in groups.items()
            if link.startswith("1Gbit/s, RTT+2ms") and set_label.startswith("64px")
        ),
        {},
    )
    reference = reference_group.get("per-file random reads, 8 threads")
    for name in ("global", "block", "partial"):
        row = reference_group.get(f"kaisoku {name}")
        why = unavailable or (
            "the 1 Gbit/s, 2 ms RTT, 64px group with this row and the 8-thread per-file row was not measured "
            "in this run"
        )
        value = row["io_e1_samples_per_s"] / reference["io_e1_samples_per_s"] if row and reference else None
        summary[f"kaisoku_{name}_io_vs_8readers_1G_2msRTT_64px"] = goal(
            value, ">= 10", reason="" if value is not None else why
        )
    kaisoku_rows = [r for r in rows if str(r.get("row", "")).startswith("kaisoku")]
    why = unavailable or "no kaisoku row was measured"
    if kaisoku_rows:
        met = sum(r["io_e1_vs_ceiling"] >= 0.8 for r in kaisoku_rows)
        log(f"kaisoku rows at >= 0.8 of the ceiling: {met} of {len(kaisoku_rows)}")
    summary["kaisoku_io_vs_ceiling_min"] = goal(
        min((r["io_e1_vs_ceiling"] for r in kaisoku_rows), default=None),
        ">= 0.8",
        reason="" if kaisoku_rows else why,
    )
    summary["kaisoku_epoch2_source_reads_max"] = goal(
        max((r["source_reads_e2"] for r in kaisoku_rows), default=None),
        "<= 0",
        reason="" if kaisoku_rows else why,
    )
    return summary


# --------------------------------------------------------------------------------------------------- plot


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b_rows = [r for r in rows if "io_e1_samples_per_s" in r]
    if not b_rows:
        return
    fig, ax = plt.subplots(1, 1, figsize=(7, 4.5))
    groups = list(dict.fromkeys((r["link"], r["set"]) for r in b_rows))
    readers = list(dict.fromkeys(r["row"] for r in b_rows))
    bar = 0.8 / len(readers)
    for k, reader in enumerate(readers):
        values = [
            next(
                (r["io_e1_vs_ceiling"] for r in b_rows if (r["link"], r["set"]) == g and r["row"] == reader),
                0,
            )
            for g in groups
        ]
        ax.bar(np.arange(len(groups)) + k * bar, values, bar, label=_short(reader))
    ax.axhline(0.8, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(
        np.arange(len(groups)) + bar * (len(readers) - 1) / 2,
        [f"{_short(link)}\n{_short(set_label)}" for link, set_label in groups],
        fontsize=8,
    )
    ax.set_ylabel("epoch-1 I/O rate / sequential-read ceiling")
    ax.set_title("(b) sshfs source, page cache dropped (goal line 0.8)")
    ax.set_ylim(0, 1.3)
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


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
    if quick:  # a smoke run of the setup: one link, the 8-thread per-file row and kaisoku global
        slow_sets = [SlowSet(small, {0.001: 256, 0.0: 256})]
        settings = [netfs.LinkSetting(10**9, 0.001)]
        options: dict[str, Any] = {"ceiling_bytes": 4 << 20, "budget_s": 30.0}
        options.update(readers=("8 threads",), shuffles=("global",))
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
        options = {"ceiling_bytes": 32 << 20, "budget_s": 900.0}
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-loader-") as tmp:
        rows, summary, notes = part_b(slow_sets, settings, Path(tmp), **options)
    notes.append(
        "kaisoku rows: NodeCache with a node-local directory and a /dev/shm RAM tier, each sized to "
        "hold the whole set (the stager writes each shard locally, then copies it to RAM); I/O epochs read "
        "every record through 2 DataLoader workers with images left encoded; block = 4 shards per block; "
        "partial = 2 node processes, each with its own NodeCache and 1 DataLoader worker, exchanging Q=0.25 "
        "over gloo, epoch time = the slower node, quality = node 0's batches of 128."
    )
    notes.append(
        "sshfs 3.7.3 calls sshfs 2.x's cache=no dir_cache=no (cache=no is accepted but not in "
        "its option table), used here; the page cache is dropped (echo 3 > /proc/sys/vm/drop_caches) "
        "before every epoch of every row. Per-file rows read a random subset of the files "
        "(files_measured) and report files/s; epoch_e1_s_extrapolated scales that to the whole set."
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
    "link": "link", "set": "set", "row": "row", "quality": "quality", "io_e1_samples_per_s": "I/O e1 /s",
    "io_e1_vs_ceiling": "vs ceiling", "ceiling_MBps": "ceiling MB/s", "io_e2_s": "I/O e2 s",
    "e2e_e1_samples_per_s": "e2e e1 /s", "e2e_e2_samples_per_s": "e2e e2 /s", "source_reads_e2": "src e2",
    "skipped": "skipped",
}  # fmt: skip
_SHORT = {"per-file random reads, ": "per-file ", "Gbit/s": "G", "Mbit/s": "M", ", RTT+": "/"}


def _short(value: Any) -> Any:
    if isinstance(value, str):
        for long, short in _SHORT.items():
            value = value.replace(long, short)
        return value.split(" (")[0] if value[:1].isdigit() and "px" in value else value
    return value
