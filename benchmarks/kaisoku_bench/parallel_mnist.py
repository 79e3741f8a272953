"""Part (c) of ``kaisoku bench parallel``: dp only, hybrid only and switch-parallel on MNIST, each built by
``kaisoku train``'s builder (:func:`~kaisoku.engine.build.build_trainer`) and trained by ``Trainer.fit``.

dp only is ``parallel.pp 1`` on 4 ranks: DDP with kaisoku's bucket plan, exactly what ``kaisoku train``
builds for plain data parallelism. Speed figures are paired per seed (a configuration's samples/s over
dp-only's of the same seed), summarised by their median and range.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kaisoku.config import Config
from kaisoku.data.shards.writer import pack
from kaisoku.distributed.env import World
from kaisoku.distributed.spawn import run_ranks
from kaisoku.engine.build import build_trainer
from kaisoku_bench.common import goal
from kaisoku_bench.goals import resolution

WORLD_SIZE = 4
EPOCHS = 2
GLOBAL_BATCH = 128
#: The goal on switch's accuracy: at most this many points below dp-only's of the same seed, fixed in advance.
GAP_GOAL_POINTS = 1.0
#: Configuration name -> ``parallel.*`` settings.
CONFIGS: dict[str, dict[str, Any]] = {
    "dp-only": {"dp": 4, "pp": 1, "switch": ""},
    "hybrid-only": {"dp": 2, "pp": 2, "switch": ""},
    "switch": {"dp": -1, "pp": 1, "switch": f"dp2xpp2:0-{EPOCHS // 2},dp4:{EPOCHS // 2}-"},
}


def mnist_config(data: Path, run_dir: Path, seed: int, parallel: dict[str, Any]) -> Config:
    """The ``kaisoku train`` config of one run: small-cnn, SGD lr 0.05, constant schedule, no mid-run
    validation or checkpoints (``fit`` validates on the test split at the end)."""
    cfg = Config(run_dir=str(run_dir))
    cfg.data.path = str(data)
    cfg.data.image_size = 28
    cfg.data.crop_scale_min = 1.0
    cfg.data.global_batch = GLOBAL_BATCH
    cfg.data.workers = 0
    cfg.model.name = "small-cnn"
    cfg.optim.name = "sgd"
    cfg.optim.lr = 0.05
    cfg.sched.name = "constant"
    cfg.sched.warmup_epochs = 0
    cfg.train.seed = seed
    cfg.train.epochs = EPOCHS
    cfg.train.val_every = 10**9
    cfg.train.device = "cpu"
    cfg.checkpoint.every_steps = 10**9
    cfg.metrics.progress = False
    cfg.parallel.dp = parallel["dp"]
    cfg.parallel.pp = parallel["pp"]
    cfg.parallel.switch = parallel["switch"]
    cfg.parallel.microbatches = 4
    return cfg


def _mnist_rank(rank: int, world_size: int, tmp: Path, data: str, seeds: list[int]) -> list[dict[str, Any]]:
    world = World(rank=rank, world_size=world_size, local_world_size=world_size)
    rows = []
    names = list(CONFIGS)
    for seed_index, seed in enumerate(seeds):
        # Rotate the order of the configurations so that none always runs first.
        shift = seed_index % len(names)
        for name in names[shift:] + names[:shift]:
            cfg = mnist_config(Path(data), tmp / f"run-{name}-{seed}", seed, CONFIGS[name])
            trainer = build_trainer(cfg, world, resume="")
            summary = trainer.fit()
            trainer.metrics.close()
            speed = torch.tensor([summary["samples_per_s"]], dtype=torch.float64)
            dist.all_reduce(speed, op=dist.ReduceOp.MIN)  # the slowest rank's rate
            rows.append(
                {
                    "config": name,
                    "seed": seed,
                    "accuracy": summary["val_accuracy"],
                    "samples_per_s": float(speed.item()),
                    "train_seconds": summary["train_seconds"],
                    "final_loss": summary["final_loss"],
                }
            )
    return rows


def packed_mnist(path: Path, work: Path, train_limit: int | None, test_limit: int | None) -> Path:
    """``path`` packed into ``work`` (train and test splits), cut to the limits for quick runs."""
    source = path
    if train_limit is not None or test_limit is not None:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {
                "x_train": archive["x_train"][:train_limit],
                "y_train": archive["y_train"][:train_limit],
                "x_test": archive["x_test"][:test_limit],
                "y_test": archive["y_test"][:test_limit],
            }
        source = work / "mnist-subset.npz"
        np.savez(source, **arrays)
    packed = work / "mnist-packed"
    pack(source, packed, progress=False, workers=1)
    return packed


def bench_mnist(quick: bool, path: Path | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of (c), one per (configuration, seed), and the per-configuration aggregates ({} without MNIST)."""
    if path is None:
        return [{"part": "mnist", "config": "all", "skipped": "mnist.npz not found"}], {}
    seeds = [0, 1, 2]
    train_limit, test_limit = (512, 1000) if quick else (None, None)
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-mnist-") as tmp:
        packed = packed_mnist(path, Path(tmp), train_limit, test_limit)
        raw = run_ranks(
            _mnist_rank, WORLD_SIZE, Path(tmp), str(packed), seeds, timeout=3600.0, collective_timeout=300.0
        )[0]
    rows = [
        {"part": "mnist", **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}}
        for r in raw
    ]
    speed = {(r["config"], r["seed"]): r["samples_per_s"] for r in raw}
    aggregate: dict[str, Any] = {}
    for name in CONFIGS:
        accuracy = {r["seed"]: r["accuracy"] for r in raw if r["config"] == name}
        accuracies = [accuracy[seed] for seed in seeds]
        ratios = [speed[(name, seed)] / speed[("dp-only", seed)] for seed in seeds]
        aggregate[name] = {
            "parallel": CONFIGS[name],
            "accuracy_mean": statistics.mean(accuracies),
            "accuracy_per_seed": accuracies,
            "accuracy_std": statistics.stdev(accuracies),
            "samples_per_s_median": statistics.median(speed[(name, seed)] for seed in seeds),
            "speed_vs_dp_per_seed": [round(x, 4) for x in ratios],
            "speed_vs_dp_median": statistics.median(ratios),
            "speed_vs_dp_range": [min(ratios), max(ratios)],
            "seeds": seeds,
            "epochs": EPOCHS,
            "train_samples": train_limit or 60000,
        }
    return rows, aggregate


def mnist_goals(mnist: dict[str, Any], missing: str = "") -> dict[str, dict[str, Any]]:
    """The two goals of (c), always both; ``missing`` is why MNIST could not be measured."""
    if not mnist:
        why = missing or "MNIST was not measured"
        return {
            "switch_accuracy_gap_points": goal(None, f">= -{GAP_GOAL_POINTS}", reason=why),
            "switch_speedup_vs_dp": goal(None, "> 1.0", reason=why),
        }
    dp, hybrid, switch = mnist["dp-only"], mnist["hybrid-only"], mnist["switch"]
    # Signed, in points, paired by seed (the same data order and initial weights): below 0, switch is worse.
    gaps = [100.0 * (s - d) for s, d in zip(switch["accuracy_per_seed"], dp["accuracy_per_seed"])]
    hybrid_median = hybrid["speed_vs_dp_median"]
    reason = ""
    if hybrid_median <= 1.0:
        reason = (
            f"not applicable: hybrid-only was not faster than dp-only here (median per-seed ratio "
            f"{hybrid_median:.3f}); the goal asks switch to be faster wherever hybrid is"
        )
    gap = goal(
        None,
        f">= -{GAP_GOAL_POINTS}",
        samples=gaps,
        statistic="mean",
        unit="seeds",
        switch_accuracy=switch["accuracy_mean"],
        dp_accuracy=dp["accuracy_mean"],
        switch_minus_dp_points_per_seed=[round(g, 3) for g in gaps],
    )
    gap.update(resolution(gap, GAP_GOAL_POINTS))
    return {
        "switch_accuracy_gap_points": gap,
        "switch_speedup_vs_dp": goal(
            switch["speed_vs_dp_median"],
            "> 1.0",
            samples=switch["speed_vs_dp_per_seed"],
            unit="seeds",
            reason=reason,
            range=[round(x, 4) for x in switch["speed_vs_dp_range"]],
            per_seed=switch["speed_vs_dp_per_seed"],
            hybrid_vs_dp_median=round(hybrid_median, 4),
        ),
    }
