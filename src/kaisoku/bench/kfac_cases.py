"""``kaisoku bench kfac``'s entry (:func:`run`): its cases, summary and record.

- ``mnist``: ``SmallCNN`` on MNIST at global batch 2,048 on 2 gloo CPU ranks
  (:data:`kaisoku.bench.kfac.FULL_PLAN`).
- ``resnet10-shapes``: torchvision's resnet10 layout with the compact stem on 16 px RGB images drawn by the
  shapes generator (16,384 training, 2,048 validation and 2,048 test images; raw pixels, no JPEG round
  trip) at batch 1,024, on one GPU (DDP over NCCL at world size 1). K-FAC runs with its measured-cost
  intervals (``overhead_target`` 0.25). On a machine without a GPU the case is not run: one resnet10 step
  at batch 1,024 takes seconds on 2 CPU cores and the grids need thousands of steps; its goal is then
  recorded unmeasured, with that reason.

Each case runs the same protocol (:func:`kaisoku.bench.kfac._worker`): the same tuning budget per method,
SGD's whole cap per seed to set the target, the others until they reach it, medians over the seeds.
"""

from __future__ import annotations

import math
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kaisoku.bench import CASES
from kaisoku.bench.common import goal, locate_mnist, median_iqr, print_table, selected_case, write_result
from kaisoku.bench.kfac import (
    CHANCE_CEILING,
    FULL_PLAN,
    QUICK_PLAN,
    SHAPES_SIZE,
    Plan,
    _run_ranks,
    quick_plan,
    second_method,
)
from kaisoku.bench.kfac_peers import asdl_row, plot_curves
from kaisoku.data.datagen import CLASSES, draw_sample, sample_rng
from kaisoku.errors import ConfigError

#: Images per split of the resnet10 case (their size: :data:`kaisoku.bench.kfac.SHAPES_SIZE`).
SHAPES_COUNTS = {"train": 16384, "val": 2048, "test": 2048}

RESNET_PLAN = Plan(
    case="resnet10-shapes",
    # Linear scaling of kaisoku train's 0.2 at batch 128 gives 1.6 at 1,024: the grid brackets it.
    lr_grid=(0.4, 0.8, 1.6),
    # Ten epochs: after two (32 steps) every learning rate was still at chance on this set.
    grid_steps=160,
    max_epochs=30,
    eval_every=8,
    repeats=3,
    target=0.9,
    global_batch=1024,
    warmup_steps=16,
    kfac_options={
        "factor_update_steps": 4,
        "inv_update_steps": 16,
        "damping": 3e-3,
        "factor_decay": 0.95,
        "bn": "unit",
        "stat_fraction": 0.25,
        "overhead_target": 0.25,
    },
    kfac_grid=(3e-4, 1e-3, 3e-3),
    kfac_lr=0.2,
    extend_limit=4,  # LARS's best was still on the grid's top edge after two extensions
    world_size=1,
    device="cuda",
)

#: The resnet10 case in --quick: a few steps on 8 px images on the CPU (it checks the path, not the goal).
RESNET_QUICK_PLAN = quick_plan(
    RESNET_PLAN,
    max_epochs=2,
    eval_every=2,
    target=0.3,
    global_batch=64,
    warmup_steps=1,
    # Inverses, not eigendecompositions: a 4,608-wide eigh takes tens of seconds on one CPU thread.
    kfac_options={
        **RESNET_PLAN.kfac_options,
        "factor_update_steps": 1,
        "inv_update_steps": 2,
        "method": "inverse",
    },
    device="cpu",
)
QUICK_SHAPES = ({"train": 256, "val": 128, "test": 128}, 8)

#: Summary goal -> target. Every one is always recorded (null with a reason where not measured).
GOALS = {
    "kfac_time_to_target_vs_best_mnist": "<= 0.75",
    "kfac_time_to_target_vs_best_resnet10_shapes": "<= 0.75",
    "kfac_time_to_target_vs_sgd": "<= 0.75",
    "kfac_step_time_vs_sgd": "<= 1.3",
}


def _draw(split: str, start: int, stop: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    labels = np.arange(start, stop) % len(CLASSES)
    images = [
        draw_sample(int(label), size, sample_rng(0, split, index))
        for index, label in zip(range(start, stop), labels)
    ]
    return np.stack(images).transpose(0, 3, 1, 2).copy(), labels.astype(np.int64)


def write_shapes(path: Path, counts: dict[str, int], size: int, workers: int = 8) -> Path:
    """Draw the shapes splits (images keyed by (split, index), seed 0) into ``path`` as a ``.npz`` of
    ``x_<split>`` ``(N, 3, size, size)`` uint8 and ``y_<split>``."""
    arrays: dict[str, np.ndarray] = {}
    chunk = 1024
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for split, count in counts.items():
            parts = list(
                pool.map(
                    _draw, *zip(*[(split, s, min(s + chunk, count), size) for s in range(0, count, chunk)])
                )
            )
            arrays[f"x_{split}"] = np.concatenate([x for x, _ in parts])
            arrays[f"y_{split}"] = np.concatenate([y for _, y in parts])
    np.savez(path, **arrays)
    return path


def case_rows(
    record: dict[str, Any], plan: Plan, second: str
) -> tuple[list[dict[str, Any]], dict[str, tuple[float, bool]]]:
    """One row per method of a case's runs, and each method's median time to target (and whether every
    seed reached it)."""
    runs: list[dict[str, Any]] = record["runs"]
    rows: list[dict[str, Any]] = []
    walls: dict[str, tuple[float, bool]] = {}
    for method in ["sgd", second, "kfac"]:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            rows.append({"case": plan.case, "method": method, "status": "not run: the time limit stopped it"})
            walls[method] = (math.nan, False)
            continue
        all_reached = all(r["reached"] is not None for r in mine)
        # Time to target, or the whole capped run when some repeat never got there (a lower bound).
        times = [(r["reached"] or r["curve"][-1])["wall_s"] for r in mine]
        epochs = [(r["reached"] or r["curve"][-1])["epochs"] for r in mine]
        wall, iqr = median_iqr(times)
        walls[method] = (wall, all_reached)
        split = {
            key: float(np.median([r["step_split_ms"].get(key, 0.0) for r in mine]))
            for key in mine[0]["step_split_ms"]
        }
        rows.append(
            {
                "case": plan.case,
                "method": method,
                "setting": f"{'kl_clip' if method == 'kfac' else 'lr'} {record['best'][method]:g}",
                "grid_best_inside": record.get("inside", {}).get(method),
                "diverged_repeats": sum(bool(r["diverged"]) for r in mine),
                "step_ms": round(sum(split.values()), 2),
                "reached_target": all_reached,
                "epochs_to_target": float(np.median(epochs)) if all_reached else None,
                "wall_s_to_target": wall if all_reached else None,
                "wall_s_run": wall,
                "wall_iqr_s": iqr,
                "repeats": len(mine),
                "final_test_acc": float(np.median([r["final_acc"] for r in mine])),
                **{f"{key}_ms_per_step": round(value, 2) for key, value in split.items()},
            }
        )
    return rows, walls


def step_time_ratio(case_rows: list[dict[str, Any]]) -> tuple[float | None, dict[str, Any]]:
    """K-FAC's amortised step time over SGD's, and the figures behind it.

    Every method's forward and backward pass is the same work, yet the medians of different methods'
    runs differ with the machine's load (on a shared 2-core machine by up to half). The ratio therefore
    takes the forward/backward time common to all (the median over the methods) and adds each method's
    own phases: ``(common + K-FAC's statistics, decompositions, communication, preconditioning and
    optimizer) / (common + SGD's optimizer)``. The plain ratio of the rows' step times is kept beside it.
    """
    rows = {row["method"]: row for row in case_rows if "step_ms" in row}
    if "kfac" not in rows or "sgd" not in rows:
        return None, {}
    passes = {m: row["forward_backward_ms_per_step"] for m, row in rows.items()}
    common = float(np.median(list(passes.values())))
    own = {m: row["step_ms"] - passes[m] for m, row in rows.items()}
    ratio = (common + own["kfac"]) / (common + own["sgd"])
    return ratio, {
        "forward_backward_ms": {m: round(v, 2) for m, v in passes.items()},
        "plain_step_ratio": round(rows["kfac"]["step_ms"] / rows["sgd"]["step_ms"], 4),
    }


def _versus_best(walls: dict[str, tuple[float, bool]], second: str) -> tuple[float | None, str, str | None]:
    """K-FAC's time to target over the faster peer's; the reason where there is none; the peer."""
    kfac_wall, kfac_reached = walls["kfac"]
    reached = {name: wall for name, (wall, ok) in walls.items() if name in ("sgd", second) and ok}
    best = min(reached, key=reached.__getitem__) if reached else None
    if not kfac_reached:
        return None, "K-FAC did not reach the target in every seed within the cap", best
    if best is None:
        return None, "no peer reached it", None
    return kfac_wall / reached[best], "", best


def summary_of(
    walls: dict[str, dict[str, tuple[float, bool]]],
    rows: dict[str, list[dict[str, Any]]],
    second: str,
    skipped: dict[str, str],
) -> dict[str, dict[str, Any]]:
    """The goals from each case's median times to target and step times; ``skipped``: case -> why not run."""

    summary: dict[str, dict[str, Any]] = {}
    for case, name in (
        ("mnist", "kfac_time_to_target_vs_best_mnist"),
        ("resnet10-shapes", "kfac_time_to_target_vs_best_resnet10_shapes"),
    ):
        if case in skipped:
            summary[name] = goal(None, GOALS[name], reason=skipped[case])
            continue
        value, reason, peer = _versus_best(walls[case], second)
        edge = [row["method"] for row in rows[case] if row.get("grid_best_inside") is False]
        if value is not None and edge:
            reason = f"the best setting of {', '.join(edge)} is on an edge of its grid: not a fair comparison"
        details: dict[str, Any] = {"best_peer": peer}
        if case == "resnet10-shapes":
            details["step_time_vs_sgd"] = step_time_ratio(rows[case])[0]
        summary[name] = goal(value, GOALS[name], reason=reason, **details)
    if "mnist" in skipped:
        for name in ("kfac_time_to_target_vs_sgd", "kfac_step_time_vs_sgd"):
            summary[name] = goal(None, GOALS[name], reason=skipped["mnist"])
    else:
        kfac_wall, kfac_reached = walls["mnist"]["kfac"]
        sgd_wall, sgd_ok = walls["mnist"].get("sgd", (math.nan, False))
        vs_sgd = kfac_wall / sgd_wall if kfac_reached and sgd_ok else None
        ratio, behind = step_time_ratio(rows["mnist"])
        summary["kfac_time_to_target_vs_sgd"] = goal(
            vs_sgd,
            GOALS["kfac_time_to_target_vs_sgd"],
            reason="" if vs_sgd is not None else "K-FAC or SGD did not reach the target in every seed",
        )
        summary["kfac_step_time_vs_sgd"] = goal(
            ratio,
            GOALS["kfac_step_time_vs_sgd"],
            reason="" if ratio is not None else "a step time is missing",
            **behind,
        )
    return summary


def _cases(quick: bool) -> tuple[list[str], dict[str, str]]:
    """The cases to run here and the reasons the others are not run."""
    chosen = selected_case()
    gpu = torch.cuda.is_available()
    skipped: dict[str, str] = {}
    if chosen == "resnet10-shapes" and not gpu and not quick:
        raise ConfigError(
            "kaisoku bench kfac --case resnet10-shapes needs a CUDA device (hours on a CPU); run it on a GPU "
            "machine, or --quick for a smoke run"
        )
    cases = [chosen] if chosen else ["mnist", "resnet10-shapes"]
    if chosen:
        skipped.update(
            {c: f"not run: kaisoku bench kfac --case {chosen}" for c in CASES["kfac"] if c != chosen}
        )
    if "resnet10-shapes" in cases and not gpu and not quick:
        cases.remove("resnet10-shapes")
        skipped["resnet10-shapes"] = (
            "not run: no GPU here; one resnet10 step at batch 1,024 takes seconds on 2 CPU cores and the grids "
            "need thousands (kaisoku bench kfac --case resnet10-shapes on a GPU machine)"
        )
    if "mnist" in cases and locate_mnist() is None:
        cases.remove("mnist")
        skipped["mnist"] = "MNIST archive not found: pass --mnist PATH or set KAISOKU_MNIST"
    return cases, skipped


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Run the cases this machine can (``quick``: small and short), print the table, write ``kfac.json``."""
    second, second_note = second_method()
    cases, skipped = _cases(quick)
    started = time.perf_counter()
    rows: dict[str, list[dict[str, Any]]] = {}
    walls: dict[str, dict[str, tuple[float, bool]]] = {}
    plans: dict[str, Plan] = {}
    records: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kaisoku-kfac-data-") as tmp:
        for case in cases:
            if case == "mnist":
                plan, data_path, limit_s = (QUICK_PLAN if quick else FULL_PLAN), locate_mnist(), 40 * 60.0
            else:
                plan = RESNET_QUICK_PLAN if quick else RESNET_PLAN
                counts, size = QUICK_SHAPES if quick else (SHAPES_COUNTS, SHAPES_SIZE)
                data_path, limit_s = write_shapes(Path(tmp) / "shapes.npz", counts, size), 15 * 60.0
            assert data_path is not None
            record = _run_ranks(plan, data_path, timeout_s=45.0 if quick else limit_s)
            for item in record["runs"]:
                item["batch"] = plan.global_batch
            rows[case], walls[case] = case_rows(record, plan, second)
            if case == "mnist":
                targets = [r["target"] for r in record["runs"] if "target" in r]
                rows[case].append(
                    asdl_row(plan, data_path, plan.kfac_lr, quick, targets[0] if targets else plan.target)
                )
            plans[case], records[case] = plan, record
    summary = summary_of(walls, rows, second, skipped)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_path = out_dir / "kfac.png"
    if "mnist" in records:
        plot_curves(records["mnist"]["runs"], plot_path)
    notes = [_notes(case, plans[case], records[case], second_note, quick) for case in cases]
    notes += [f"{case}: {why}" for case, why in skipped.items()]
    extra = {
        "plans": {case: asdict(plan) for case, plan in plans.items()},
        "grid": {case: record["grid"] for case, record in records.items()},
        "curves": {
            case: [
                {"method": r["method"], "repeat": r["repeat"], "lr": r["lr"], "curve": r["curve"]}
                for r in record["runs"]
            ]
            for case, record in records.items()
        },
        "kfac_rank_loads": {
            case: next((r["loads"] for r in record["runs"] if r["loads"]), None)
            for case, record in records.items()
        },
        "plot": plot_path.name if "mnist" in records else None,
        "bench_seconds": round(time.perf_counter() - started, 1),
    }
    table = [row for case in cases for row in rows[case]]
    print_table("kfac", table, summary)
    return write_result("kfac", out_dir, summary, table, quick=quick, notes=" | ".join(notes), extra=extra)


def _notes(case: str, plan: Plan, record: dict[str, Any], second_note: str, quick: bool) -> str:
    """How a case was run, for the record."""
    targets = [r["target"] for r in record["runs"] if "target" in r]
    where = (
        f"{plan.world_size} gloo CPU ranks (1 thread each, DDP)"
        if plan.device == "cpu"
        else f"{plan.world_size} GPU (DDP over NCCL)"
    )
    text = (
        f"{case}: target per seed: SGD's best test accuracy within the cap less {plan.target_drop} (median "
        f"{float(np.median(targets)) if targets else plan.target:.4f}); global batch {plan.global_batch} on {where}; "
        f"SGD and LARS tune lr over {list(plan.lr_grid)}, K-FAC (lr {plan.kfac_lr}, "
        f"factors in {plan.kfac_options.get('factor_dtype', 'float32')}) tunes kl_clip over "
        f"{list(plan.kfac_grid)}: the same number of points, each grid extended up to {plan.extend_limit} "
        f"times while its best is at an edge, picked on x_val after {plan.grid_steps} steps; a run ending at "
        f"<= {CHANCE_CEILING} accuracy counts as diverged; {second_note}; every method: {plan.warmup_steps} "
        f"warmup steps then cosine decay over the {plan.max_epochs}-epoch cap; per seed ({plan.repeats} seeds: "
        "init and order) the others run until they reach the target; time to target is interpolated between "
        "evaluations, evaluation excluded; forward_backward includes DDP's gradient all-reduce; K-FAC "
        "communication is the factor all-reduce and decomposition broadcast."
    )
    if not record.get("complete", True):
        text = "INCOMPLETE: the time limit stopped the ranks; the rows hold the runs finished before. " + text
    if quick:
        text = f"QUICK ({case}): a subset, one setting per method; no claim about the goals. " + text
    return text
