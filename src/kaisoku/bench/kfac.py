"""``kaisoku bench kfac``: wall time to a target test accuracy for SGD, LARS and K-FAC, trained by the engine.

Every run is a :class:`~kaisoku.config.Config` trained by :func:`~kaisoku.engine.build.build_trainer` (the
engine ``kaisoku train`` runs: its DDP, data order, optimizer, warmup-then-cosine schedule and K-FAC from
``optim.kfac``), driven in chunks by :class:`~kaisoku.bench.training.EngineRun`. Two cases:

- ``mnist``: the zoo's ``small-cnn`` (width 16) on MNIST at global batch 2,048 on 2 gloo CPU ranks
  (:data:`FULL_PLAN`).
- ``resnet10-shapes``: the zoo's resnet10 with the compact stem on 16 px RGB images drawn by the shapes
  generator (16,384 training, 2,048 validation and 2,048 test images; raw pixels, no JPEG round trip) at
  batch 1,024 on one GPU (one rank: the engine wraps no DDP). K-FAC runs with its measured-cost intervals
  (``overhead_target`` 0.25). On a machine without a GPU the case is not run: one resnet10 step at batch
  1,024 takes seconds on 2 CPU cores and the grids need thousands of steps; its goal is then recorded
  unmeasured, with that reason.

Each case runs the same protocol (:func:`_worker`): SGD and LARS tune the learning rate over a 3-point grid,
K-FAC (in front of momentum SGD, factor statistics on a quarter of the batch) tunes kl_clip, its step size,
over 3 points; every grid is extended while its best point is at an edge. Per seed (initial weights and data
order), SGD trains the whole cap; the target is its best test accuracy less half a point; the other methods
train until they reach it. Time to target is interpolated between evaluations (the trainer's validation,
excluded from the time); medians over the seeds count. The step time is split into the optimizer's step,
K-FAC's statistics, decomposition, communication and preconditioning, and the rest of the engine's step.
ASDL's K-FAC runs single-process beside it where installed (:mod:`kaisoku.bench.kfac_peers`).
"""

from __future__ import annotations

import math
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kaisoku.bench import CASES
from kaisoku.bench.common import (
    check_record_dir,
    fast_bf16,
    goal,
    locate_mnist,
    median_iqr,
    print_table,
    selected_case,
    write_result,
)
from kaisoku.bench.kfac_peers import asdl_row, plot_curves
from kaisoku.bench.training import (
    CHANCE_CEILING,
    EngineRun,
    bench_config,
    crossing,
    first_crossing,
    learned,
    npz_splits,
    tune,
)
from kaisoku.config import Config
from kaisoku.data.datagen import CLASSES, draw_sample, sample_rng
from kaisoku.distributed.env import World
from kaisoku.distributed.spawn import run_ranks
from kaisoku.errors import ConfigError
from kaisoku.parts import UserParts

WORLD_SIZE = 2
GLOBAL_BATCH = 2048


@dataclass(frozen=True)
class Plan:
    """What one invocation measures."""

    lr_grid: tuple[float, ...]
    """Learning rates SGD and LARS are tuned over (extended while the best is at an edge)."""
    grid_steps: int
    max_epochs: float
    eval_every: int
    repeats: int
    target: float
    global_batch: int = GLOBAL_BATCH
    train_limit: int | None = None
    eval_limit: int | None = None
    warmup_steps: int = 4
    seed: int = 0
    kfac_options: dict[str, Any] = field(default_factory=dict)
    """``optim.kfac.*`` settings of the K-FAC runs."""
    kfac_grid: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    """K-FAC's kl_clip values (its step size under KL clipping): as many points as the others' lr grid."""
    kfac_lr: float = 0.2
    extend_limit: int = 2
    """Points added beyond an edge of a grid whose best point sits on that edge, at most."""
    target_drop: float = 0.005
    """The target is the best test accuracy SGD reaches within the cap, minus this."""
    case: str = "mnist"
    """mnist (small-cnn on MNIST) or resnet10-shapes (resnet10 on the generated shapes set)."""
    world_size: int = WORLD_SIZE
    device: str = "cpu"
    """cpu (gloo ranks) or cuda (NCCL, one GPU per rank)."""


FULL_PLAN = Plan(
    lr_grid=(0.1, 0.2, 0.4),
    grid_steps=12,
    max_epochs=4,
    eval_every=6,
    repeats=3,
    target=0.98,
    kfac_options={
        "factor_update_steps": 3,
        "inv_update_steps": 6,
        "damping": 3e-3,
        "factor_decay": 0.95,
        "bn": "unit",
        "stat_fraction": 0.25,
        # K-FAC's fastest factor arithmetic on this machine: bf16 products where bf16 is native.
        "factor_dtype": "bfloat16" if fast_bf16(torch.device("cpu")) else "float32",
    },
)


def quick_plan(plan: Plan, **changes: Any) -> Plan:
    """``plan`` for ``--quick``: one setting per method (no grid, no extension), one seed; ``changes``
    shrink the run further."""
    return replace(
        plan, lr_grid=(0.2,), grid_steps=0, repeats=1, kfac_grid=(1e-3,), extend_limit=0, **changes
    )


QUICK_PLAN = quick_plan(
    FULL_PLAN,
    max_epochs=1.5,
    eval_every=3,
    target=0.70,
    global_batch=256,
    train_limit=2048,
    eval_limit=500,
    warmup_steps=2,
)

#: Pixels per side of the resnet10 case's shapes images.
SHAPES_SIZE = 16
#: Images per split of the resnet10 case.
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
    extend_limit=4,  # LARS's best was still on the grid's top edge after two extensions
    world_size=1,
    device="cuda",
)

#: The resnet10 case in --quick: 4 steps on 8 px images on the CPU (it checks the path, not the goal).
RESNET_QUICK_PLAN = quick_plan(
    RESNET_PLAN,
    max_epochs=1,
    eval_every=2,
    target=0.3,
    global_batch=64,
    warmup_steps=1,
    # Inverses, not eigendecompositions, at fixed intervals, and layer4's 4,608-wide conv left to SGD: one
    # decomposition of that factor takes about 10 s on one loaded CPU thread (the path, not the cost).
    kfac_options={
        **RESNET_PLAN.kfac_options,
        "factor_update_steps": 1,
        "inv_update_steps": 4,
        "method": "inverse",
        "overhead_target": 0.0,
        "skip_layers": ["layer4.0.conv2"],
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


def second_method() -> tuple[str, str]:
    """The method compared besides SGD and K-FAC, and how it is set up: ``("lars", why)``."""
    return "lars", "LARS: eta 0.02 with LARC clipping, no adaptation on BatchNorm and biases"


def method_config(
    method: str,
    setting: float,
    plan: Plan,
    *,
    seed: int,
    train_samples: int,
    run_dir: Path,
    max_steps: int = 0,
) -> Config:
    """The config of one run: ``method`` (sgd, lars or kfac) at ``setting`` (the learning rate of SGD and
    LARS, K-FAC's kl_clip; its learning rate is ``plan.kfac_lr``), warmup then cosine over the cap."""
    cfg = bench_config(run_dir, seed=seed, device=plan.device)
    if plan.case == "resnet10-shapes":
        cfg.model.name, cfg.model.stem, cfg.model.num_classes = "resnet10", "compact", len(CLASSES)
    else:
        cfg.model.name, cfg.model.width = "small-cnn", 16
    cfg.data.global_batch = plan.global_batch
    cfg.train.epochs = plan.max_epochs
    cfg.train.max_steps = max_steps
    cfg.train.log_every = plan.eval_every
    cfg.sched.name = "cosine"
    cfg.sched.warmup_epochs = plan.warmup_steps / (train_samples // plan.global_batch)
    optim = cfg.optim
    optim.name = "lars" if method == "lars" else "sgd"
    optim.lr = plan.kfac_lr if method == "kfac" else setting
    optim.momentum, optim.weight_decay = 0.9, 0.0
    if method == "lars":
        optim.eta, optim.trust_clip = 0.02, True
    if method == "kfac":
        optim.kfac.enabled = True
        for key, value in {**plan.kfac_options, "kl_clip": setting}.items():
            setattr(optim.kfac, key, value)
    return cfg


def train_run(
    method: str,
    setting: float,
    plan: Plan,
    data: dict[str, Any],
    world: World,
    work: Path,
    *,
    seed: int,
    max_steps: int = 0,
    eval_split: str,
    stop_at: float | None,
) -> dict[str, Any]:
    """Train one method from the initial weights of ``seed`` through the engine; the accuracy curve (every
    ``plan.eval_every`` steps; only the end under ``max_steps``) and the step's time split.

    ``stop_at``: stop once the evaluated accuracy reaches it.
    """
    train = data["train"]
    run_dir = work / f"{method}-{setting:g}-{seed}-{eval_split}"
    cfg = method_config(
        method, setting, plan, seed=seed, train_samples=len(train), run_dir=run_dir, max_steps=max_steps
    )
    run = EngineRun(cfg, world, UserParts(train_data=train, val_data=data[eval_split]))
    curve: list[dict[str, float]] = []
    reached: dict[str, float] | None = None
    chunk = max_steps or plan.eval_every
    while run.step < run.total_steps and run.train(chunk):
        point = {
            "step": run.step,
            "epochs": run.step / run.steps_per_epoch,
            "wall_s": run.seconds,
            "acc": run.accuracy(),
        }
        previous = curve[-1] if curve else None
        curve.append(point)
        if stop_at is not None and point["acc"] >= stop_at:
            reached = crossing(previous, point, stop_at)
            break
    run.close()
    final = curve[-1]["acc"] if curve else float("nan")
    if world.rank == 0:
        print(
            f"  {method:9s} {'kl_clip' if method == 'kfac' else 'lr'} {setting:<6g} steps {run.step:4d}  "
            f"acc {final:.4f}  wall {run.seconds:7.1f} s  "
            f"reached {'yes' if reached else ('-' if stop_at is None else 'no')}",
            flush=True,
        )
    kfac = getattr(run.trainer.engine, "preconditioner", None)
    return {
        "method": method,
        "lr": setting,
        "seed": seed,
        "curve": curve,
        "reached": reached,
        "diverged": run.diverged or not learned(final),
        "final_acc": final,
        "step_split_ms": run.phase_ms_per_step(),
        "steps": run.step,
        "loads": kfac.rank_loads() if kfac is not None else None,
    }


def _worker(
    rank: int, world_size: int, out: Path, plan_dict: dict[str, Any], data_path: str
) -> dict[str, Any]:
    fields = ("lr_grid", "kfac_grid")
    plan = Plan(**{**plan_dict, **{key: tuple(plan_dict[key]) for key in fields}})
    world = World(rank=rank, world_size=world_size, local_world_size=world_size)
    limits = {"train": plan.train_limit, "val": plan.eval_limit, "test": plan.eval_limit}
    data = npz_splits(Path(data_path), limits)
    work = out / "runs"

    def train(method: str, setting: float, **options: Any) -> dict[str, Any]:
        return train_run(method, setting, plan, data, world, work, **options)

    # K-FAC right after SGD, so that a time limit cuts the peer rather than the compared pair.
    methods = ["sgd", "kfac", second_method()[0]]
    grid: list[dict[str, Any]] = []
    best: dict[str, float] = {}
    inside: dict[str, bool] = {}
    for method in methods:
        settings = plan.kfac_grid if method == "kfac" else plan.lr_grid
        if plan.grid_steps > 0 and len(settings) > 1:

            def score(value: float, method: str = method) -> float:
                run = train(
                    method, value, seed=plan.seed, max_steps=plan.grid_steps, eval_split="val", stop_at=None
                )
                return -1.0 if run["diverged"] else run["final_acc"]

            best[method], points, inside[method] = tune(settings, score, plan.extend_limit, failed_score=-1.0)
            grid += [{"method": method, **point} for point in points]
        else:
            best[method] = settings[len(settings) // 2]
            inside[method] = False  # not tuned: no tried neighbour on either side
    runs: list[dict[str, Any]] = []
    for repeat in range(plan.repeats):
        seed = plan.seed + repeat
        # SGD runs its whole cap; the target of this seed is its best accuracy less target_drop.
        sgd = train("sgd", best["sgd"], seed=seed, eval_split="test", stop_at=None)
        target = max((p["acc"] for p in sgd["curve"]), default=plan.target) - plan.target_drop
        sgd["reached"] = first_crossing(sgd["curve"], target)
        shift = repeat % (len(methods) - 1)
        others = methods[1:]
        batch_runs = [sgd] + [
            train(method, best[method], seed=seed, eval_split="test", stop_at=target)
            for method in others[shift:] + others[:shift]
        ]
        for run in batch_runs:
            run.update(repeat=repeat, target=target)
            runs.append(run)
        if rank == 0:
            # What is done so far survives a time limit that stops the ranks.
            state = {
                "ok": True,
                "complete": False,
                "grid": grid,
                "best": best,
                "inside": inside,
                "runs": runs,
            }
            torch.save(state, out / "rank0.partial.pt")
    return {"ok": True, "complete": True, "grid": grid, "best": best, "inside": inside, "runs": runs}


def _run_ranks(plan: Plan, data_path: Path, timeout_s: float) -> dict[str, Any]:
    """Every run on the ranks; after a time limit, what rank 0 finished before it."""
    with tempfile.TemporaryDirectory(prefix="kaisoku-kfac-") as tmp:
        try:
            return run_ranks(
                _worker,
                plan.world_size,
                Path(tmp),
                asdict(plan),
                str(data_path),
                timeout=timeout_s,
                collective_timeout=300.0,
                backend="nccl" if plan.device == "cuda" else "gloo",
            )[0]
        except AssertionError as error:
            partial = Path(tmp) / f"ranks{plan.world_size}" / "rank0.partial.pt"
            if not partial.exists():
                raise RuntimeError(
                    f"K-FAC benchmark ranks produced no result (limit {timeout_s:.0f} s):\n{error}"
                ) from None
            return torch.load(partial, weights_only=False)


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
        # Per repeat (seed), for the paired per-seed ratios of the goals.
        per_seed = {
            str(r["repeat"]): {
                "wall_s": (r["reached"] or {}).get("wall_s"),
                "forward_backward_ms": r["step_split_ms"].get("forward_backward", 0.0),
                "own_ms": sum(v for k, v in r["step_split_ms"].items() if k != "forward_backward"),
            }
            for r in mine
            if "repeat" in r
        }
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
                "per_seed": per_seed,
                **{f"{key}_ms_per_step": round(value, 2) for key, value in split.items()},
            }
        )
    return rows, walls


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


def time_ratios(case_rows: list[dict[str, Any]], method: str, peer: str | None) -> list[float]:
    """``method``'s time to target over ``peer``'s, per seed where both reached it (paired by seed)."""
    rows = {row["method"]: row for row in case_rows if "per_seed" in row}
    if peer is None or method not in rows or peer not in rows:
        return []
    mine, theirs = rows[method]["per_seed"], rows[peer]["per_seed"]
    return [
        mine[seed]["wall_s"] / theirs[seed]["wall_s"]
        for seed in sorted(set(mine) & set(theirs))
        if mine[seed]["wall_s"] and theirs[seed]["wall_s"]
    ]


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


def _edge_reason(case_rows: list[dict[str, Any]], methods: list[str]) -> str:
    """Why a figure comparing ``methods`` is unfair ("" when each was tuned to an interior optimum)."""
    edge = [
        row["method"]
        for row in case_rows
        if row.get("method") in methods and row.get("grid_best_inside") is False
    ]
    if not edge:
        return ""
    return f"the best setting of {', '.join(edge)} has no tried neighbour falling off on each side: not tuned"


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
        if value is not None and not reason:
            reason = _edge_reason(rows[case], ["kfac", "sgd", second])
        details: dict[str, Any] = {"best_peer": peer}
        if case == "resnet10-shapes":
            details["step_time_vs_sgd"] = step_time_ratio(rows[case])[0]
        summary[name] = goal(
            value, GOALS[name], samples=time_ratios(rows[case], "kfac", peer) or None, unit="seeds",
            reason=reason, **details,
        )  # fmt: skip
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
            samples=time_ratios(rows["mnist"], "kfac", "sgd") or None,
            unit="seeds",
            reason=_edge_reason(rows["mnist"], ["kfac", "sgd"])
            if vs_sgd is not None
            else "K-FAC or SGD did not reach the target in every seed",
        )
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
                    asdl_row(
                        asdict(plan), data_path, plan.kfac_lr, quick, targets[0] if targets else plan.target
                    )
                )
            plans[case], records[case] = plan, record
    summary = summary_of(walls, rows, second, skipped)
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
        else f"{plan.world_size} GPU (one rank: no DDP)"
    )
    text = (
        f"{case}: every run is build_trainer's engine (kaisoku train's) on the in-memory splits as the user's "
        f"dataset; target per seed: SGD's best test accuracy within the cap less {plan.target_drop} (median "
        f"{float(np.median(targets)) if targets else plan.target:.4f}); global batch {plan.global_batch} on {where}; "
        f"SGD and LARS tune lr over {list(plan.lr_grid)}, K-FAC (lr {plan.kfac_lr}, "
        f"factors in {plan.kfac_options.get('factor_dtype', 'float32')}) tunes kl_clip over "
        f"{list(plan.kfac_grid)}: the same number of points, each grid extended up to {plan.extend_limit} "
        f"times while its best is at an edge, picked on x_val after {plan.grid_steps} steps; a run ending at "
        f"<= {CHANCE_CEILING} accuracy counts as diverged; {second_note}; every method: the engine's "
        f"schedule, {plan.warmup_steps} warmup steps then cosine decay over the {plan.max_epochs}-epoch cap; per seed ({plan.repeats} seeds: "
        "init and order) the others run until they reach the target; time to target is interpolated between "
        "evaluations (the trainer's validation), evaluation excluded; optimizer: the optimizer's step by its "
        "step hooks; forward_backward: the rest of the engine's step (data, forward, backward with DDP's "
        "all-reduce, the loop); K-FAC communication is the factor all-reduce and decomposition broadcast."
    )
    if not record.get("complete", True):
        text = "INCOMPLETE: the time limit stopped the ranks; the rows hold the runs finished before. " + text
    if quick:
        text = f"QUICK ({case}): a subset, one setting per method; no claim about the goals. " + text
    return text
