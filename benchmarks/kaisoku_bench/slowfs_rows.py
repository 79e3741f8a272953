"""The rows and goals of ``kaisoku bench slowfs`` from its measurements: pure functions of the records the
readers return (:mod:`kaisoku_bench.slowfs_readers`, :mod:`kaisoku_bench.slowfs_peers`), tested without
a mount or processes. Every figure of a row is the median over its runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from kaisoku_bench.common import goal
from kaisoku_bench.goals import Interval, ratio_interval, worst_of
from kaisoku_bench.imagesets import log


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _epochs(records: Sequence[dict[str, Any]], mode: str | None, epoch: int) -> list[dict[str, Any]]:
    return [r for r in records if r.get("mode") == mode and r["epoch"] == epoch]


def perfile_row(
    base: dict[str, Any],
    readers: str,
    timings: dict[tuple[str, int], list[float]],
    *,
    files: int,
    nbytes: int,
    set_files: int,
    rate_bytes: float,
    quality: float,
    grid: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A per-file row from ``timings[(mode, epoch)]`` (seconds per repeat): medians over the repeats.
    ``grid``: how its thread count was tuned (``threads_tuned``, ``threads_inside``, ``thread_grid``...),
    for the tuned row."""
    io1, io2 = _median(timings[("io", 0)]), _median(timings[("io", 1)])
    e2e1, e2e2 = _median(timings[("e2e", 0)]), _median(timings[("e2e", 1)])
    return {
        **base,
        "row": f"per-file random reads, {readers}" + (" (tuned)" if grid is not None else ""),
        **(grid or {}),
        "shuffle": "global (per file)",
        "quality": quality,
        "repeats": len(timings[("io", 0)]),
        "files_measured": files,
        "bytes_measured": nbytes,
        "link_bound_s": round(nbytes / rate_bytes, 3),
        "io_e1_s": round(io1, 3),
        "io_e2_s": round(io2, 3),
        "io_e1_runs_s": [round(t, 3) for t in timings[("io", 0)]],
        "io_e1_samples_per_s": round(files / io1, 1),
        "io_e2_samples_per_s": round(files / io2, 1),
        "io_e1_MBps": round(nbytes / io1 / 1e6, 2),
        "e2e_e1_samples_per_s": round(files / e2e1, 1),
        "e2e_e2_samples_per_s": round(files / e2e2, 1),
        "epoch_e1_s_extrapolated": round(io1 * set_files / files, 1),
        "_io_rate": nbytes / io1,
    }


def kaisoku_row(
    base: dict[str, Any],
    name: str,
    spec_text: str,
    records: Sequence[dict[str, Any]],
    *,
    quality: float,
    nbytes: int,
    rate_bytes: float,
) -> dict[str, Any]:
    """A kaisoku row from :func:`~kaisoku_bench.slowfs_readers.kaisoku_epochs`'s records: each figure the
    median over the repeats; epoch-2 source reads the largest over repeats and modes."""
    io1, io2 = _epochs(records, "io", 0), _epochs(records, "io", 1)
    e2e1, e2e2 = _epochs(records, "e2e", 0), _epochs(records, "e2e", 1)
    samples = int(_median([r["total"] for r in e2e1]))
    delivered = _median([r["total"] for r in io1])  # image bytes handed to decoding per epoch
    io1_s, io2_s = _median([r["seconds"] for r in io1]), _median([r["seconds"] for r in io2])
    e2e1_s, e2e2_s = _median([r["seconds"] for r in e2e1]), _median([r["seconds"] for r in e2e2])
    row = {
        **base,
        "row": f"kaisoku {name}",
        "shuffle": spec_text,
        "quality": quality,
        "repeats": len(io1),
        "samples": samples,
        "bytes_read": int(_median([r["source_bytes"] for r in io1])),
        "link_bound_s": round(nbytes / rate_bytes, 3),
        "io_e1_s": round(io1_s, 3),
        "io_e2_s": round(io2_s, 3),
        "io_e1_runs_s": [round(r["seconds"], 3) for r in io1],
        "io_e1_samples_per_s": round(samples / io1_s, 1),
        "io_e2_samples_per_s": round(samples / io2_s, 1),
        "io_e1_MBps": round(delivered / io1_s / 1e6, 2),
        "e2e_e1_s": round(e2e1_s, 3),
        "e2e_e2_s": round(e2e2_s, 3),
        "e2e_e1_samples_per_s": round(samples / e2e1_s, 1),
        "e2e_e2_samples_per_s": round(samples / e2e2_s, 1),
        "e2e_e1_runs_s": [round(r["seconds"], 3) for r in e2e1],
        "source_reads_e1": int(_median([r["source_reads"] for r in io1])),
        "source_reads_e2": max(r["source_reads"] for r in io2 + e2e2),
        "_io_rate": delivered / io1_s,
    }
    if any(r["exchanged_bytes"] for r in io1):
        row["exchanged_bytes_per_epoch"] = int(_median([r["exchanged_bytes"] for r in io1]))
    return row


def undersized_row(
    base: dict[str, Any],
    name: str,
    spec_text: str,
    records: Sequence[dict[str, Any]],
    *,
    cache_fraction: float,
    nbytes: int,
) -> dict[str, Any]:
    """The row of kaisoku I/O runs whose node cache held ``cache_fraction`` of the set's ``nbytes``: epoch
    times (medians), the source reads the loader counted per epoch, and per run what it read from the
    source against what the cache's plan read and evicted (:func:`cache_runs`). Not a rate row: it is
    judged by :func:`rereads_goal` alone."""
    io1, io2 = _epochs(records, "io", 0), _epochs(records, "io", 1)
    return {
        **base,
        "row": f"kaisoku {name}, node cache {cache_fraction:g} of the set",
        "shuffle": spec_text,
        "cache_fraction": cache_fraction,
        "cache_bytes": int(nbytes * cache_fraction),
        "repeats": len(io1),
        "io_e1_s": round(_median([r["seconds"] for r in io1]), 3),
        "io_e2_s": round(_median([r["seconds"] for r in io2]), 3),
        "source_reads_e1": int(_median([r["source_reads"] for r in io1])),
        "source_reads_e2": max(r["source_reads"] for r in io2),
        "cache_runs": cache_runs(records),
    }


def cache_runs(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (repeat, mode) run: the source reads and bytes the loader counted (``epoch_stats``) over both
    epochs against those the node cache's plan accounts for (first reads, re-reads of what it evicted,
    bypassed accesses), and epoch 2's counted reads and the evictions before it. The totals are compared
    over the run: the stager reads ahead across the epoch boundary, so a read's epoch differs between the
    loader's count and the plan."""
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for record in records:
        runs.setdefault((record["repeat"], str(record.get("mode"))), []).append(record)
    out = []
    for (repeat, mode), epochs in runs.items():
        epoch2 = [r for r in epochs if r["epoch"] == 1]
        out.append(
            {
                "repeat": repeat,
                "mode": mode,
                **{
                    key: sum(int(r.get(key, 0)) for r in epochs)
                    for key in (
                        "source_reads",
                        "planned_reads",
                        "source_bytes",
                        "planned_bytes",
                        "stager_reads",
                        "reader_reads",
                        "planned_bypasses",
                    )
                },
                "source_reads_e2": sum(int(r["source_reads"]) for r in epoch2),
                "planned_reads_e2": sum(int(r.get("planned_reads", 0)) for r in epoch2),
                "evictions_e1": sum(int(r.get("evictions", 0)) for r in epochs if r["epoch"] == 0),
                "evictions": sum(int(r.get("evictions", 0)) for r in epochs),
                "evicted_bytes": sum(int(r.get("evicted_bytes", 0)) for r in epochs),
            }
        )
    return out


def peer_row(
    base: dict[str, Any], name: str, records: Sequence[dict[str, Any]], *, cache: str
) -> dict[str, Any]:
    """A packed peer's row from :func:`~kaisoku_bench.slowfs_peers.peer_epochs`'s records (medians)."""
    e1, e2 = _epochs(records, None, 0), _epochs(records, None, 1)
    samples = int(_median([r["total"] for r in e1]))
    e1_s, e2_s = _median([r["seconds"] for r in e1]), _median([r["seconds"] for r in e2])
    return {
        **base,
        "row": f"peer {name}",
        "shuffle": "the peer's own",
        "cache": cache,
        "repeats": len(e1),
        "samples": samples,
        "e2e_e1_s": round(e1_s, 3),
        "e2e_e2_s": round(e2_s, 3),
        "e2e_e1_samples_per_s": round(samples / e1_s, 1),
        "e2e_e2_samples_per_s": round(samples / e2_s, 1),
        "e2e_e1_runs_s": [round(r["seconds"], 3) for r in e1],
    }


def finish_group(rows: list[dict[str, Any]], ceilings: Sequence[float]) -> list[dict[str, Any]]:
    """Add the group's ceiling (median of ``ceilings``, bytes/s) to its rows, and each I/O row's epoch-1
    rate over it."""
    ceiling = _median(ceilings)
    for row in rows:
        if "skipped" in row:
            continue
        row["ceiling_MBps"] = round(ceiling / 1e6, 2)
        row["ceiling_runs_MBps"] = [round(c / 1e6, 2) for c in ceilings]
        rate = row.pop("_io_rate", None)
        if rate is None:
            continue
        row["io_e1_vs_ceiling"] = round(rate / ceiling, 3)
        row["link_bound_note"] = (
            "link-bound" if row["link_bound_s"] >= 0.8 * row["io_e1_s"] else "latency/CPU-bound"
        )
    return rows


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in rows:
        if "skipped" not in row and "link" in row:
            groups.setdefault((row["link"], row["set"]), {})[row["row"]] = row
    return groups


def run_rates(row: dict[str, Any], phase: str) -> list[float]:
    """A row's samples/s of each run of ``phase`` (``io_e1``, ``e2e_e1``): the same samples every run, so
    each run's rate is the median rate scaled by the median time over that run's time."""
    times = row.get(f"{phase}_runs_s") or []
    if not times:
        return []
    middle = float(np.median(times))
    return [row[f"{phase}_samples_per_s"] * middle / t for t in times if t > 0]


def rate_ratio(top: dict[str, Any], bottom: dict[str, Any], phase: str) -> Interval | None:
    """The interval of ``top``'s over ``bottom``'s samples/s in ``phase`` (runs measured apart); None where
    either has fewer than two runs."""
    a, b = run_rates(top, phase), run_rates(bottom, phase)
    return ratio_interval(a, b) if len(a) >= 2 and len(b) >= 2 else None


def peer_goal(rows: list[dict[str, Any]], unavailable: str = "") -> dict[str, Any]:
    """``kaisoku_vs_best_packed_peer``: in every group with kaisoku global and a peer, kaisoku global's
    epoch-1 end-to-end samples/s over the best peer's; the value is the lowest group's."""
    per_group: dict[str, dict[str, Any]] = {}
    intervals: dict[str, tuple[float, Interval | None]] = {}
    for (link, set_label), group in _groups(rows).items():
        kaisoku = group.get("kaisoku global")
        peers = {name: row for name, row in group.items() if name.startswith("peer ")}
        if kaisoku is None or not peers:
            continue
        best = max(peers, key=lambda n: peers[n]["e2e_e1_samples_per_s"])
        intervals[f"{link} | {set_label.split(' (')[0]}"] = (
            kaisoku["e2e_e1_samples_per_s"] / peers[best]["e2e_e1_samples_per_s"],
            rate_ratio(kaisoku, peers[best], "e2e_e1"),
        )
        per_group[f"{link} | {set_label.split(' (')[0]}"] = {
            "best_peer": best.removeprefix("peer "),
            "e1": round(kaisoku["e2e_e1_samples_per_s"] / peers[best]["e2e_e1_samples_per_s"], 3),
            "e2_vs_best_e2": round(
                kaisoku["e2e_e2_samples_per_s"] / max(p["e2e_e2_samples_per_s"] for p in peers.values()), 3
            ),
        }
    skipped = sorted(
        {
            f"{r['row']}: {r['skipped']}"
            for r in rows
            if str(r.get("row", "")).startswith("peer ") and "skipped" in r
        }
    )
    why = unavailable or (
        "no group measured kaisoku global beside a packed peer"
        + (f" ({'; '.join(skipped)})" if skipped else "")
    )
    return worst_of(
        intervals,
        ">= 1.0",
        reason="" if intervals else why,
        per_group=per_group,
        **({"peers_skipped": skipped} if skipped and intervals else {}),
    )


def _ceiling_interval(row: dict[str, Any]) -> Interval | None:
    """The interval of a row's epoch-1 I/O rate over its group's ceiling (bytes/s against MB/s: the
    ratio's scale is the recorded median ratio's)."""
    rates, ceilings = run_rates(row, "io_e1"), row.get("ceiling_runs_MBps") or []
    if len(rates) < 2 or len(ceilings) < 2:
        return None
    raw = ratio_interval(rates, ceilings)
    scale = row["io_e1_vs_ceiling"] / (float(np.median(rates)) / float(np.median(ceilings)))
    return Interval(raw.low * scale, raw.high * scale, raw.method)


def thread_grid_reason(row: dict[str, Any]) -> str:
    """Why the tuned per-file row's thread count is not a tuned optimum (empty when it is): its best lacks
    a tried lower or higher neighbour falling off (the rule of :func:`kaisoku_bench.training.tune`)."""
    if row.get("threads_inside"):
        return ""
    tried = ", ".join(f"{p['threads']}: {p['files_per_s']:g}" for p in row.get("thread_grid", []))
    return (
        f"the per-file baseline is not tuned: its best thread count ({row.get('threads_tuned')}) lacks a "
        f"tried lower and a tried higher neighbour falling off (threads: files/s, {tried})"
    )


def rereads_goal(rows: list[dict[str, Any]], unavailable: str = "") -> dict[str, Any]:
    """``kaisoku_rereads_minus_evicted_undersized_cache``: over every run of every row whose node cache held
    less than the set, the bytes the loader read from the source (its ``epoch_stats``, both epochs) minus
    the bytes the cache's plan read (each shard's first read, re-reads of shards it evicted, accesses it
    bypassed), the largest in size. Zero means what was re-read is exactly what had been evicted, and
    nothing the cache held was read again. A run whose plan re-read nothing in epoch 2 or evicted nothing
    could not tell, and a plan that bypassed accesses cannot be counted exactly (its readers keep copies
    of what they read): the goal is then unmet with that reason."""
    undersized = [r for r in rows if "cache_runs" in r and "skipped" not in r]
    if not undersized:
        return goal(
            None, "<= 0", reason=unavailable or "no row with a node cache smaller than the set was measured"
        )
    per_run = {
        f"{r['link']} | {r['set'].split(' (')[0]} | {r['row']} | run {run['repeat']} {run['mode']}": run
        for r in undersized
        for run in r["cache_runs"]
    }
    differences = {case: run["source_bytes"] - run["planned_bytes"] for case, run in per_run.items()}
    worst = max(differences, key=lambda case: abs(differences[case]))
    idle = [case for case, run in per_run.items() if run["planned_reads_e2"] == 0 or run["evictions"] == 0]
    bypassing = [case for case, run in per_run.items() if run["planned_bypasses"]]
    reason = ""
    if idle:
        reason = (
            "the cache's plan re-read nothing in epoch 2 or evicted nothing (it held what epoch 2 read), so "
            f"the check could not fail ({'; '.join(idle)})"
        )
    elif bypassing:
        reason = (
            "the cache's plan bypassed accesses, which its readers read from the source unless they still "
            "hold a copy (up to 256 MiB a process): the count is not exact; give the row a set whose blocks "
            f"fit the cache ({'; '.join(bypassing)})"
        )
    return goal(
        abs(differences[worst]),
        "<= 0",
        exact="byte counts: the loader's source reads and the cache's own log of loads, bypasses and evictions",
        reason=reason,
        worst_case=worst,
        signed_difference_bytes=differences[worst],
        per_run={
            case: {k: v for k, v in run.items() if k not in ("repeat", "mode")}
            for case, run in per_run.items()
        },
    )


def summary_b(rows: list[dict[str, Any]], unavailable: str = "") -> dict[str, dict[str, Any]]:
    """Every goal of the benchmark from its rows; ``unavailable``: why the setup could not run at all.

    A goal whose rows were not measured (setup unavailable, time budget spent, a quick run's subset)
    is recorded unmet with the reason.
    """
    summary: dict[str, dict[str, Any]] = {}
    reference_group = next(
        (
            g
            for (link, set_label), g in _groups(rows).items()
            if link.startswith("1Gbit/s, RTT+2ms") and set_label.startswith("64px")
        ),
        {},
    )
    reference = next((r for r in reference_group.values() if "thread_grid" in r), None)
    untuned = "" if reference is None else thread_grid_reason(reference)
    for name in ("global", "block", "partial"):
        row = reference_group.get(f"kaisoku {name}")
        why = unavailable or (
            "the 1 Gbit/s, 2 ms RTT, 64px group with this row and the tuned per-file row was not measured "
            "in this run"
        )
        value = row["io_e1_samples_per_s"] / reference["io_e1_samples_per_s"] if row and reference else None
        interval = rate_ratio(row, reference, "io_e1") if row and reference else None
        summary[f"kaisoku_{name}_io_vs_tuned_perfile_1G_2msRTT_64px"] = goal(
            value,
            ">= 10",
            interval=interval,
            reason=untuned if value is not None else why,
            **({"perfile_threads": reference["threads_tuned"]} if reference else {}),
        )
    kaisoku_rows = [
        r
        for r in rows
        if str(r.get("row", "")).startswith("kaisoku") and "skipped" not in r and "cache_runs" not in r
    ]
    why = unavailable or "no kaisoku row was measured"
    if kaisoku_rows:
        met = sum(r["io_e1_vs_ceiling"] >= 0.8 for r in kaisoku_rows)
        log(f"kaisoku rows at >= 0.8 of the ceiling: {met} of {len(kaisoku_rows)}")
    summary["kaisoku_io_vs_ceiling_min"] = worst_of(
        {
            f"{r['link']} | {r['set'].split(' (')[0]} | {r['row']}": (
                r["io_e1_vs_ceiling"],
                _ceiling_interval(r),
            )
            for r in kaisoku_rows
        },
        ">= 0.8",
        reason="" if kaisoku_rows else why,
    )
    summary["kaisoku_rereads_minus_evicted_undersized_cache"] = rereads_goal(rows, unavailable)
    summary["kaisoku_vs_best_packed_peer"] = peer_goal(rows, unavailable)
    return summary


# --------------------------------------------------------------------------------------------------- plot
