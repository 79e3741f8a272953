"""``kaisoku bench precision``: test accuracy of each ``precision.mode`` against fp32, and its step-time cost.

Two tasks (MNIST with ``small-cnn``, the shapes set with ``resnet10``; see :func:`plan`), each trained by
``build_trainer`` and ``Trainer.fit`` for the same steps from the same seeds in every mode, two runs at a
time in worker processes of one thread. bf16 autocast runs only where the device has fast bf16 (on other
CPUs it is 30-40 times slower than fp32 and its row says so). Figures and goals: ``benchmarks/README.md``,
section precision.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kaisoku.config import Config
from kaisoku.data.datagen import generate
from kaisoku.data.shards.writer import pack
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from kaisoku.errors import KaisokuError
from kaisoku.run_facts import check_config
from kaisoku_bench.common import fast_bf16, goal, locate_mnist, record_and_show
from kaisoku_bench.goals import resolution
from kaisoku_bench.parallel_mnist import packed_mnist

#: Mode label -> ``precision.*`` settings.
MODES: dict[str, dict[str, Any]] = {
    "fp32": {"mode": "fp32"},
    "bf16": {"mode": "bf16"},
    "int8-stats": {"mode": "int8-stats"},
    "int16-stats": {"mode": "int16-stats"},
    "fp8-stats": {"mode": "fp8-stats"},
    "int8-fixed": {"mode": "int8-stats", "exponent": "fixed", "fixed_exponent": 0},
}
#: Below this mean fp32 accuracy a task counts as not learned (ten classes: chance is 0.1).
LEARNED = 0.2
#: Goal per mode: the mean signed accuracy gap to fp32 must be at least minus this many points.
GOAL_POINTS = {"int8-stats": 0.5, "fp8-stats": 0.5, "int16-stats": 0.2}


@dataclass(frozen=True)
class Task:
    """One dataset and model, its steps and batch, its validation images and seeds."""

    name: str
    model: str
    stem: str
    image_size: int
    batch: int
    steps: int
    lr: float
    val_count: int
    optim: str = "sgd"
    weight_decay: float = 5e-5
    warmup_epochs: float = 0.05
    crop_scale_min: float = 1.0
    seeds: tuple[int, ...] = (0,)


#: The shapes task's steps and AdamW learning rate in the full run.
SHAPES_STEPS = 200
SHAPES_LR = 6e-3
#: Validation images and seeds of the full run, sized so that sampling alone leaves the interval of the mean
#: gap narrower than the goals (``benchmarks/README.md``, precision, "Sizing"): all of MNIST's 10,000 test
#: images, 8 seeds; 20,000 generated shapes images, 16 seeds. Training's own spread can still widen it (each
#: entry's ``resolves_goal`` says).
MNIST_VAL, MNIST_SEEDS = 10_000, tuple(range(8))
SHAPES_VAL, SHAPES_SEEDS = 20_000, tuple(range(16))


def plan(quick: bool) -> dict[str, Any]:
    """What one invocation runs: the tasks, each with its validation images and seeds.

    MNIST: small-cnn, SGD momentum 0.9. Shapes: resnet10 (compact stem) at 12 px (1x1 maps in layer4),
    AdamW (the optimizer of the ``vit-tiny-shapes`` preset) lr 6e-3, weight decay 0.05: ``kaisoku
    train``'s default SGD at lr 0.2 sits at chance for its first ~20k samples on this set (it reaches ~63%
    after 48k), AdamW leaves chance within a few thousand. No random crops: every sample is seen once.
    """
    if quick:
        return {
            "tasks": [
                Task("mnist", "small-cnn", "small", 28, 32, 3, 0.05, 64),
                Task("shapes", "resnet10", "compact", 12, 16, 3, 3e-3, 20, "adamw", 0.05, 0.1),
            ],
        }
    return {
        "tasks": [
            Task("mnist", "small-cnn", "small", 28, 64, 150, 0.1, MNIST_VAL, seeds=MNIST_SEEDS),
            Task(
                "shapes",
                "resnet10",
                "compact",
                12,
                32,
                SHAPES_STEPS,
                SHAPES_LR,
                SHAPES_VAL,
                "adamw",
                0.05,
                0.1,
                seeds=SHAPES_SEEDS,
            ),
        ],
    }


def train_config(task: Task, data: Path, run_dir: Path, seed: int, mode: str) -> Any:
    """The ``kaisoku train`` config of one run: the task's optimizer, cosine over exactly one epoch of
    ``task.steps`` steps, validation only at the end, no checkpoints in between."""
    cfg = Config(run_dir=str(run_dir))
    cfg.data.path = str(data)
    cfg.data.image_size = task.image_size
    cfg.data.global_batch = task.batch
    cfg.data.workers = 0
    cfg.data.crop_scale_min = task.crop_scale_min
    cfg.model.name = task.model
    cfg.model.stem = task.stem  # type: ignore[assignment]
    cfg.optim.name = task.optim  # type: ignore[assignment]
    cfg.optim.lr = task.lr
    cfg.optim.weight_decay = task.weight_decay
    cfg.sched.name = "cosine"
    cfg.sched.warmup_epochs = task.warmup_epochs
    cfg.train.seed = seed
    cfg.train.epochs = 1
    cfg.train.max_steps = task.steps
    cfg.train.val_every = 10**9
    cfg.train.log_every = max(1, task.steps // 3)
    cfg.train.device = "cpu"
    cfg.checkpoint.every_steps = 10**9
    cfg.metrics.progress = False
    for key, value in MODES[mode].items():
        setattr(cfg.precision, key, value)
    return cfg


def _one_run(task: Task, data: str, work: str, seed: int, mode: str) -> dict[str, Any]:
    """Train one (task, seed, mode) in this worker process; its row. A run that stops on a known failure (a
    loss gone non-finite, ...) is a row with no accuracy and its ``error``: one run does not end the record,
    and the goals its seed enters say it failed."""
    import contextlib
    import io

    torch.set_num_threads(1)
    cfg = train_config(task, Path(data), Path(work) / f"{task.name}-{mode}-{seed}", seed, mode)
    check_config(cfg, 1)
    row: dict[str, Any] = {"task": task.name, "mode": mode, "seed": seed}
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = build_trainer(cfg, World())
        try:
            summary = trainer.fit()
        except KaisokuError as exc:
            return {**row, "accuracy": None, "step_s": None, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            trainer.metrics.close()
    totals = trainer.precision.monitor.totals() if trainer.precision.monitor is not None else {}
    return {
        **row,
        "steps": summary["steps"],
        "accuracy": summary.get("val_accuracy"),
        "final_loss": summary["final_loss"],
        "step_s": summary["train_seconds"] / max(1, summary["steps"]),
        "grad_underflow_mean": _mean_of(totals, "gradients", "underflow_fraction"),
        "act_overflow_mean": _mean_of(totals, "activations", "overflow_rate"),
    }


def _mean_of(totals: dict[str, Any], tensor: str, key: str) -> float | None:
    values = [entry[tensor][key] for entry in totals.values() if tensor in entry]
    return round(statistics.mean(values), 6) if values else None


def _prepare(task: Task, work: Path, mnist: Path | None) -> Path | None:
    """The packed dataset of ``task`` under ``work`` (None: MNIST absent)."""
    if task.name == "mnist":
        if mnist is None:
            return None

        sub = work / "mnist"
        sub.mkdir(parents=True, exist_ok=True)
        return packed_mnist(mnist, sub, task.steps * task.batch, task.val_count)
    folder = generate(
        work / "shapes",
        count=task.steps * task.batch,
        size=task.image_size,
        val_count=task.val_count,
        workers=2,
    )
    packed = work / "shapes-packed"
    pack(folder, packed, shard_bytes="4MiB", progress=False, workers=1)
    return packed


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Every task, mode and seed; goals, table and ``precision.json``."""
    settings = plan(quick)
    bf16 = fast_bf16(torch.device("cpu"))
    modes = [m for m in MODES if m != "bf16" or bf16]
    rows: list[dict[str, Any]] = []
    missing: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-precision-") as tmp:
        work = Path(tmp)
        jobs = []
        for task in settings["tasks"]:
            data = _prepare(task, work, locate_mnist())
            if data is None:
                missing[task.name] = "mnist.npz not found (pass --mnist or set KAISOKU_MNIST)"
                continue
            for index, seed in enumerate(task.seeds):
                shift = index % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    jobs.append((task, str(data), str(work), seed, mode))
        jobs.sort(key=lambda job: job[0].name != "shapes")  # the long runs first: a shorter tail
        with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_one_run, *job) for job in jobs]
            rows = [f.result() for f in futures]
    summary, aggregates = _summarise(rows, settings, missing, quick)
    if not bf16:
        aggregates.append(
            {
                "task": "all",
                "mode": "bf16",
                "note": "not run: this CPU has no native bf16 (AVX512-BF16/AMX); bf16 autocast runs resnet10 "
                "about 30-40x slower than fp32 here (3 vs 90-130 samples/s at 16 px), far past this benchmark's time",
            }
        )
    notes = (
        "CPU, worker processes of 1 thread, two runs at a time. Each run: build_trainer + Trainer.fit, cosine over "
        "one epoch of the task's steps (MNIST: SGD momentum 0.9; shapes: AdamW), test accuracy at the end. Gap = accuracy - fp32's "
        "accuracy of the same seed, in points; signed; the goal figure is the mean gap over seeds, "
        "judged by its bootstrap interval (interval_half_width against the goal; seeds_needed: seeds for an "
        "interval that narrow at the measured seed spread). step_time_vs_fp32: "
        "median over seeds of seconds per step over fp32's (emulation on the CPU: extra work, not a goal). "
        "int8-fixed: int8 with every exponent fixed at 0 (no statistics)."
    )
    return record_and_show(
        "precision",
        out_dir,
        summary,
        rows + aggregates,
        columns={
            "task": "task",
            "mode": "mode",
            "seed": "seed",
            "accuracy": "accuracy",
            "gap_points_mean": "gap (points)",
            "step_time_vs_fp32": "step time vs fp32",
            "grad_underflow_mean": "grad underflow",
            "note": "note",
            "error": "error",
        },
        quick=quick,
        notes=notes,
        extra={
            "seeds": {t.name: list(t.seeds) for t in settings["tasks"]},
            "tasks": [t.__dict__ for t in settings["tasks"]],
        },
    )


def _summarise(
    rows: list[dict[str, Any]], settings: dict[str, Any], missing: dict[str, str], quick: bool
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Goal entries and one aggregate row per (task, mode)."""
    summary: dict[str, dict[str, Any]] = {}
    aggregates: list[dict[str, Any]] = []
    base = {(r["task"], r["seed"]): r for r in rows if r["mode"] == "fp32"}
    quick_reason = (
        "--quick: a few steps, far from converged; accuracy gaps mean nothing here" if quick else ""
    )
    for task in settings["tasks"]:
        label = "mnist_small_cnn" if task.name == "mnist" else "shapes_resnet10"
        fp32_accuracy = [
            r["accuracy"] for (name, _), r in base.items() if name == task.name and r["accuracy"] is not None
        ]
        reason = quick_reason
        if not quick and fp32_accuracy and statistics.mean(fp32_accuracy) < LEARNED:
            reason = (
                f"fp32 did not learn this task in {task.steps} steps (mean accuracy "
                f"{statistics.mean(fp32_accuracy):.3f}, chance 0.1): the comparison says nothing"
            )
        mode_rows: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            if r["task"] == task.name and r["mode"] != "fp32":
                mode_rows.setdefault(r["mode"], []).append(r)
        for mode, group in mode_rows.items():
            pairs = [(r, base[(task.name, r["seed"])]) for r in group]
            # A seed whose run (of the mode or of fp32) failed has no gap: NaN, which the goal counts as
            # unmeasured; its reason names the failed runs.
            gaps = [
                math.nan
                if r["accuracy"] is None or b["accuracy"] is None
                else 100.0 * (r["accuracy"] - b["accuracy"])
                for r, b in pairs
            ]
            times = [r["step_s"] / b["step_s"] for r, b in pairs if r["step_s"] and b["step_s"]]
            failed = [
                f"{x['mode']} seed {x['seed']} ({x['error']})"
                for pair in pairs
                for x in pair
                if x.get("error")
            ]
            mode_reason = reason or (f"runs failed: {'; '.join(failed)}" if failed else "")
            finite_gaps = [g for g in gaps if math.isfinite(g)]
            per_seed = [round(g, 3) if math.isfinite(g) else None for g in gaps]
            step_time = round(statistics.median(times), 3) if times else None
            aggregates.append(
                {
                    "task": task.name,
                    "mode": mode,
                    "gap_points_mean": round(statistics.mean(finite_gaps), 3) if finite_gaps else None,
                    "gap_points_per_seed": per_seed,
                    "step_time_vs_fp32": step_time,
                }
            )
            if mode in GOAL_POINTS:
                # Signed (below 0: the mode is worse than fp32), never the absolute value of a mean.
                entry = summary[f"{mode.replace('-', '_')}_gap_points_{label}"] = goal(
                    None,
                    f">= -{GOAL_POINTS[mode]}",
                    samples=gaps,
                    statistic="mean",
                    unit="seeds",
                    reason=mode_reason,
                    per_seed=per_seed,
                    step_time_vs_fp32=step_time,
                )
                entry.update(resolution(entry, GOAL_POINTS[mode]))
            if mode == "int8-fixed":
                summary[f"int8_fixed_control_gap_points_{label}"] = goal(
                    None,
                    "< -0.5",
                    samples=gaps,
                    statistic="mean",
                    unit="seeds",
                    reason=mode_reason,
                    note="the control: expected much worse than fp32",
                    per_seed=per_seed,
                    step_time_vs_fp32=step_time,
                )
        for mode in [*GOAL_POINTS, "int8-fixed"]:
            prefix = (
                f"{mode.replace('-', '_')}_gap_points"
                if mode != "int8-fixed"
                else "int8_fixed_control_gap_points"
            )
            key = f"{prefix}_{label}"
            if key not in summary:
                target = "< -0.5" if mode == "int8-fixed" else f">= -{GOAL_POINTS[mode]}"
                summary[key] = goal(None, target, reason=missing.get(task.name, "not measured"))
    return summary, aggregates


#: Every goal name the summary holds.
GOALS = {
    f"{prefix}_{label}"
    for label in ("mnist_small_cnn", "shapes_resnet10")
    for prefix in (
        "int8_stats_gap_points",
        "fp8_stats_gap_points",
        "int16_stats_gap_points",
        "int8_fixed_control_gap_points",
    )
}
