"""``kaisoku bench kfac``: time to a stated test accuracy for SGD, LARS and K-FAC, trained by the engine.

The runs (:mod:`kaisoku_bench.kfac_runs`) are :class:`~kaisoku.config.Config` s trained by
:func:`~kaisoku.engine.build.build_trainer`, the engine ``kaisoku train`` runs. Two cases:

- ``mnist``: the zoo's ``small-cnn`` (width 16) on MNIST at global batch 2,048 on 2 gloo CPU ranks
  (:data:`~kaisoku_bench.kfac_runs.FULL_PLAN`).
- ``resnet10-shapes``: the zoo's resnet10 with the compact stem on 16 px RGB images drawn by the shapes
  generator (16,384 training, 2,048 validation and 2,048 test images; raw pixels, no JPEG round trip) at
  batch 1,024 on one GPU (one rank: the engine wraps no DDP). K-FAC runs with its measured-cost intervals
  (``overhead_target`` 0.25). On a machine without a GPU the case is not run: one resnet10 step at batch
  1,024 takes seconds on 2 CPU cores and the grids need thousands of steps; its goal is then recorded
  unmeasured, with that reason.

Both cases run one procedure: a target stated in the plan before any run; every method tunes its step size
(SGD and LARS: lr; K-FAC: kl_clip) and its cosine's horizon on the same grids' sizes, each grid run racing
to the target on the validation split; then, per seed, the tuned methods race to the target on the test
split, interleaved chunk by chunk. This module turns the runs into rows and goals: a method's time to target
is its steps to the target times the forward/backward time per step common to the seed's runs plus its own
optimizer work per step (:func:`seed_figures`); the measured wall time of the interleaved runs is recorded
beside it. ASDL's K-FAC runs single-process beside it where installed (:mod:`kaisoku_bench.kfac_peers`).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kaisoku.errors import ConfigError
from kaisoku_bench import CASES
from kaisoku_bench.common import (
    check_record_dir,
    goal,
    locate_mnist,
    print_table,
    selected_case,
    write_result,
)
from kaisoku_bench.goals import bootstrap_interval
from kaisoku_bench.kfac_peers import asdl_row, plot_curves
from kaisoku_bench.kfac_runs import (
    FULL_PLAN,
    QUICK_PLAN,
    QUICK_SHAPES,
    RESNET_PLAN,
    RESNET_QUICK_PLAN,
    SHAPES_COUNTS,
    SHAPES_SIZE,
    Plan,
    run_on_ranks,
    second_method,
    write_shapes,
)
from kaisoku_bench.training import CHANCE_CEILING

#: Summary goal -> target. Every one is always recorded (null with a reason where not measured).
GOALS = {
    "kfac_time_to_target_vs_best_mnist": "<= 0.75",
    "kfac_time_to_target_vs_best_resnet10_shapes": "<= 0.75",
    "kfac_time_to_target_vs_sgd": "<= 0.75",
    "kfac_step_time_vs_sgd": "<= 1.3",
}


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def seed_figures(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per method, per seed (repeat, as text): the figures of that seed's race.

    ``steps``: interpolated steps to the target (None: not reached); ``time_s``: the time to target,
    ``steps * (common + own) / 1000`` with ``common`` the median over the seed's methods of their
    forward/backward milliseconds per step (the same work in every method, measured in interleaved runs)
    and ``own`` the method's own milliseconds per step (optimizer step, K-FAC's statistics, decompositions,
    communication and preconditioning); ``wall_s``: the measured wall time to the target.
    """
    by_seed: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_seed.setdefault(str(run["repeat"]), {})[run["method"]] = run
    figures: dict[str, dict[str, dict[str, Any]]] = {}
    for seed, methods in sorted(by_seed.items()):
        passes = {m: r["step_split_ms"].get("forward_backward", 0.0) for m, r in methods.items()}
        common = float(np.median(list(passes.values())))
        for method, run in methods.items():
            own = sum(v for k, v in run["step_split_ms"].items() if k != "forward_backward")
            reached = run["reached"]
            steps = float(reached["step"]) if reached else None
            figures.setdefault(method, {})[seed] = {
                "steps": steps,
                "epochs": float(reached["epochs"]) if reached else None,
                "time_s": steps * (common + own) / 1000.0 if steps is not None else None,
                "wall_s": float(reached["wall_s"]) if reached else None,
                "common_forward_backward_ms": round(common, 2),
                "forward_backward_ms": passes[method],
                "own_ms": own,
            }
    return figures


def case_rows(record: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    """One row per method of a case's races: its tuned settings, and its medians over the seeds (times to
    target only when every seed reached it)."""
    runs: list[dict[str, Any]] = record["runs"]
    figures = seed_figures(runs)
    rows: list[dict[str, Any]] = []
    for method in ["sgd", second_method()[0], "kfac"]:
        mine = [r for r in runs if r["method"] == method]
        tuned = record.get("best", {}).get(method)
        if not mine or tuned is None:
            rows.append({"case": plan.case, "method": method, "status": "not run: the time limit stopped it"})
            continue
        per_seed = figures[method]
        unreached = sorted(int(seed) for seed, f in per_seed.items() if f["steps"] is None)
        all_reached = not unreached

        medians = {
            key: _median([f[key] for f in per_seed.values()]) if all_reached else None
            for key in ("steps", "epochs", "time_s", "wall_s")
        }
        split = {
            key: float(np.median([r["step_split_ms"].get(key, 0.0) for r in mine]))
            for key in mine[0]["step_split_ms"]
        }
        rows.append(
            {
                "case": plan.case,
                "method": method,
                "setting": f"{'kl_clip' if method == 'kfac' else 'lr'} {tuned['setting']:g}",
                "horizon_epochs": tuned["horizon"],
                "grid_best_inside": tuned["inside"]["setting"] and tuned["inside"]["horizon"],
                "inside": tuned["inside"],
                "diverged_repeats": sum(bool(r["diverged"]) for r in mine),
                "step_ms": round(sum(split.values()), 2),
                "reached_target": all_reached,
                "unreached_seeds": unreached,
                "steps_to_target": medians["steps"],
                "epochs_to_target": medians["epochs"],
                "time_s_to_target": medians["time_s"],
                "measured_wall_s_to_target": medians["wall_s"],
                "repeats": len(mine),
                "final_test_acc": float(np.median([r["final_acc"] for r in mine])),
                "per_seed": per_seed,
                **{f"{key}_ms_per_step": round(value, 2) for key, value in split.items()},
            }
        )
    return rows


def step_time_ratio(case_rows: list[dict[str, Any]]) -> tuple[float | None, dict[str, Any]]:
    """K-FAC's amortised step time over SGD's, and the figures behind it (with the per-seed ratios).

    Every method's forward and backward pass is the same work, yet the medians of different methods'
    runs differ with the machine's load (on a shared 2-core machine by up to half). The ratio therefore
    takes the forward/backward time common to all (the median over the methods) and adds each method's
    own phases: ``(common + K-FAC's statistics, decompositions, communication, preconditioning and
    optimizer) / (common + SGD's optimizer)``; per seed the same with that seed's runs. The plain ratio of
    the rows' step times is kept beside it.
    """
    rows = {row["method"]: row for row in case_rows if "step_ms" in row}
    if "kfac" not in rows or "sgd" not in rows:
        return None, {}
    passes = {m: row["forward_backward_ms_per_step"] for m, row in rows.items()}
    common = float(np.median(list(passes.values())))
    own = {m: row["step_ms"] - passes[m] for m, row in rows.items()}
    ratio = (common + own["kfac"]) / (common + own["sgd"])
    per_seed: list[float] = []
    seeds = set.intersection(*(set(row.get("per_seed", {})) for row in rows.values()))
    for seed in sorted(seeds):
        runs = {m: row["per_seed"][seed] for m, row in rows.items()}
        seed_common = float(np.median([run["forward_backward_ms"] for run in runs.values()]))
        per_seed.append((seed_common + runs["kfac"]["own_ms"]) / (seed_common + runs["sgd"]["own_ms"]))
    return ratio, {
        "forward_backward_ms": {m: round(v, 2) for m, v in passes.items()},
        "plain_step_ratio": round(rows["kfac"]["step_ms"] / rows["sgd"]["step_ms"], 4),
        "per_seed_ratios": per_seed,
    }


def seed_ratios(case_rows: list[dict[str, Any]], method: str, peer: str, key: str) -> list[float]:
    """``method``'s ``key`` (``time_s`` or ``wall_s``) over ``peer``'s, per seed where both reached the
    target (paired by seed)."""
    rows = {row["method"]: row for row in case_rows if "per_seed" in row}
    if method not in rows or peer not in rows:
        return []
    mine, theirs = rows[method]["per_seed"], rows[peer]["per_seed"]
    return [
        mine[seed][key] / theirs[seed][key]
        for seed in sorted(set(mine) & set(theirs))
        if mine[seed][key] and theirs[seed][key]
    ]


def _unfair_reason(case_rows: list[dict[str, Any]], methods: list[str], plan: Plan) -> str:
    """Why a figure comparing ``methods`` has no value to judge ("" when none): a method that did not run,
    did not reach the target in every seed, or whose tuned setting or horizon lacks tried neighbours."""
    rows = {row["method"]: row for row in case_rows}
    reasons: list[str] = []
    for method in methods:
        row = rows.get(method)
        if row is None or "per_seed" not in row:
            reasons.append(f"{method} did not run (the time limit stopped it)")
        elif not row["reached_target"]:
            reasons.append(
                f"{method} did not reach the target {plan.target:.1%} within the {plan.max_epochs:g}-epoch cap "
                f"in seed(s) {row['unreached_seeds']}: it has no time to target"
            )
    edge = [
        f"{row['method']} ({', '.join(k for k, inside in row['inside'].items() if not inside)})"
        for row in case_rows
        if row.get("method") in methods and "inside" in row and not row["grid_best_inside"]
    ]
    if edge:
        reasons.append(
            f"the best setting of {', '.join(edge)} has no tried neighbour falling off on each side: not tuned"
        )
    return "; ".join(reasons)


def _measured(ratios: list[float]) -> dict[str, Any]:
    """The measured-wall-time ratio beside a goal: median, per-seed samples and their interval."""
    value = _median(ratios)
    entry: dict[str, Any] = {
        "value": None if value is None else round(value, 4),
        "samples": [round(x, 4) for x in ratios],
    }
    if len(ratios) >= 2:
        interval = bootstrap_interval(ratios, unit="seeds")
        entry |= {"interval": [round(interval.low, 4), round(interval.high, 4)], "method": interval.method}
    return entry


def time_goal(name: str, case_rows: list[dict[str, Any]], plan: Plan, peers: list[str]) -> dict[str, Any]:
    """K-FAC's time to target over the fastest of ``peers`` (by median time), per seed: the goal ``name``
    with the measured wall-time ratio beside it (``measured_wall_ratio``)."""
    rows = {row["method"]: row for row in case_rows}
    times = {p: rows[p]["time_s_to_target"] for p in peers if rows.get(p, {}).get("time_s_to_target")}
    peer = min(times, key=times.__getitem__) if times else peers[0]
    reason = _unfair_reason(case_rows, ["kfac", *peers], plan)
    samples = seed_ratios(case_rows, "kfac", peer, "time_s")
    return goal(
        None if not samples else float(np.median(samples)),
        GOALS[name],
        samples=samples or None,
        unit="seeds",
        reason=reason if samples else reason or "no seed where K-FAC and its peer both reached the target",
        best_peer=peer,
        measured_wall_ratio=_measured(seed_ratios(case_rows, "kfac", peer, "wall_s")),
    )


def summary_of(
    rows: dict[str, list[dict[str, Any]]], plans: dict[str, Plan], skipped: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """The goals from each case's rows; ``skipped``: case -> why not run."""
    second = second_method()[0]
    summary: dict[str, dict[str, Any]] = {}
    for case, name in (
        ("mnist", "kfac_time_to_target_vs_best_mnist"),
        ("resnet10-shapes", "kfac_time_to_target_vs_best_resnet10_shapes"),
    ):
        if case in skipped:
            summary[name] = goal(None, GOALS[name], reason=skipped[case])
            continue
        summary[name] = time_goal(name, rows[case], plans[case], ["sgd", second])
        if case == "resnet10-shapes":
            summary[name]["step_time_vs_sgd"] = step_time_ratio(rows[case])[0]
    if "mnist" in skipped:
        for name in ("kfac_time_to_target_vs_sgd", "kfac_step_time_vs_sgd"):
            summary[name] = goal(None, GOALS[name], reason=skipped["mnist"])
        return summary
    summary["kfac_time_to_target_vs_sgd"] = time_goal(
        "kfac_time_to_target_vs_sgd", rows["mnist"], plans["mnist"], ["sgd"]
    )
    ratio, behind = step_time_ratio(rows["mnist"])
    per_seed_steps = behind.pop("per_seed_ratios", None)
    summary["kfac_step_time_vs_sgd"] = goal(
        ratio,
        GOALS["kfac_step_time_vs_sgd"],
        samples=per_seed_steps or None,
        unit="seeds",
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
    second_note = second_method()[1]
    cases, skipped = _cases(quick)
    started = time.perf_counter()
    rows: dict[str, list[dict[str, Any]]] = {}
    plans: dict[str, Plan] = {}
    records: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kaisoku-kfac-data-") as tmp:
        for case in cases:
            if case == "mnist":
                # A stop for a run that hangs, not a budget: about 35 minutes on 2 AVX2 cores (a 30-minute
                # stop cut the third seed's race there).
                plan, data_path, limit_s = (QUICK_PLAN if quick else FULL_PLAN), locate_mnist(), 90 * 60.0
            else:
                plan = RESNET_QUICK_PLAN if quick else RESNET_PLAN
                counts, size = QUICK_SHAPES if quick else (SHAPES_COUNTS, SHAPES_SIZE)
                data_path, limit_s = write_shapes(Path(tmp) / "shapes.npz", counts, size), 15 * 60.0
            assert data_path is not None
            record = run_on_ranks(plan, data_path, timeout_s=45.0 if quick else limit_s)
            for item in record["runs"]:
                item["batch"] = plan.global_batch
            rows[case] = case_rows(record, plan)
            if case == "mnist":
                rows[case].append(asdl_row(asdict(plan), data_path, plan.kfac_lr, quick, plan.target))
            plans[case], records[case] = plan, record
    summary = summary_of(rows, plans, skipped)
    check_record_dir(out_dir, quick)  # before the plot goes there
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_path = out_dir / "kfac.png"
    if "mnist" in records:
        plot_curves(records["mnist"]["runs"], plot_path)
    notes = [_notes(case, plans[case], records[case], second_note, quick) for case in cases]
    notes += [f"{case}: {why}" for case, why in skipped.items()]
    extra = {
        "plans": {case: asdict(plan) for case, plan in plans.items()},
        "grid": {case: record["grid"] for case, record in records.items()},
        "tuned": {case: record["best"] for case, record in records.items()},
        "curves": {
            case: [
                {
                    "method": r["method"],
                    "repeat": r["repeat"],
                    "lr": r["lr"],
                    "horizon": r["horizon"],
                    "order": r["order"],
                    "curve": r["curve"],
                }
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
    where = (
        f"{plan.world_size} gloo CPU ranks (1 thread each, DDP)"
        if plan.device == "cpu"
        else f"{plan.world_size} GPU (one rank: no DDP)"
    )
    text = (
        f"{case}: every run is build_trainer's engine (kaisoku train's) on the in-memory splits as the user's "
        f"dataset; global batch {plan.global_batch} on {where}; target {plan.target:.1%} accuracy, stated in "
        f"the plan before any run; every run stops at the target, at its schedule's end or at the "
        f"{plan.max_epochs:g}-epoch cap; {plan.warmup_steps} warmup steps then cosine decay over the horizon; "
        f"tuning (one coordinate pass, the same for every method, seed {plan.seed}, on x_val): the step size "
        f"(SGD lr over {list(plan.lr_grid)}, LARS lr over {list(plan.grid('lars'))}, K-FAC kl_clip over "
        f"{list(plan.kfac_grid)} at lr "
        f"{plan.kfac_lr}, factors in {plan.kfac_options.get('factor_dtype', 'float32')}) at the middle "
        f"horizon, then the horizon over {list(plan.horizons)} epochs at that step size, each grid extended "
        f"up to {plan.extend_limit} times while its best lacks a falling-off pair of tried neighbours on a "
        f"side; a grid run scores minus its epochs to the target (evaluated every {plan.eval_every} steps, "
        f"interpolated), one that never reaches it minus the cap less its gap, one ending at <= "
        f"{CHANCE_CEILING} accuracy counts as diverged; {second_note}; races: per seed ({plan.repeats} seeds: "
        "init and order) the tuned methods train interleaved, eval_every steps each in turn, the first "
        "rotating with the seed, until each reaches the target on x_test; time to target = interpolated "
        "steps to it x (the seed's common forward/backward ms per step, the median over its methods, + the "
        "method's own optimizer, statistics, decomposition, communication and preconditioning ms per step); "
        "the measured wall time (evaluation excluded) is recorded beside it (measured_wall_s_to_target, "
        "measured_wall_ratio); forward_backward: the rest of the engine's step (data, forward, backward "
        "with DDP's all-reduce, the loop); K-FAC communication is the factor all-reduce and decomposition "
        "broadcast."
    )
    if not record.get("complete", True):
        text = "INCOMPLETE: the time limit stopped the ranks; the rows hold the runs finished before. " + text
    if quick:
        text = f"QUICK ({case}): a subset, one setting per method; no claim about the goals. " + text
    return text
