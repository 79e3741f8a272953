"""``kaisoku bench vit``: vit-tiny on the generated shapes set at 32 px, 2 CPU ranks.

(a) accuracy and time to 60% of the ``vit-tiny-shapes`` preset through ``build_trainer``; (b) switch
against data parallel on short runs over 3 seeds; (c) the 1F1B bubble of vit-tiny in 2 stages, measured by
:func:`kaisoku.bench.parallel.bubble_rank`. All three run in one group of 2 gloo ranks. Setup and goals:
``benchmarks/README.md``, section vit.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kaisoku.bench.common import goal, print_table, write_result
from kaisoku.bench.parallel import bubble_goal, bubble_rank, bubble_rows
from kaisoku.config import Config
from kaisoku.data.datagen import ensure_demo_dataset, generate
from kaisoku.distributed.env import World
from kaisoku.distributed.spawn import run_ranks
from kaisoku.engine.build import build_trainer
from kaisoku.models.zoo import build_model
from kaisoku.presets import vit_tiny_shapes

NAME = "vit"
WORLD_SIZE = 2
SEEDS = [0, 1, 2]
#: (a): epochs of the accuracy run.
EPOCHS = 5
#: (b): optimizer steps of each short run (global batch 128).
SHORT_STEPS = 8
#: (c): images per micro-batch.
BUBBLE_MICRO = 8
#: The configurations of (b); their ``parallel.*`` settings come from :func:`_parallel`.
SWITCH_CONFIGS = ("dp-only", "switch")


class _ViTFactory:
    """A picklable model factory: vit-tiny for 10 classes at ``size`` px, seeded."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self) -> torch.nn.Module:
        """A fresh vit-tiny."""
        torch.manual_seed(0)
        return build_model("vit-tiny", num_classes=10, size=self.size)


def vit_config(
    data: Path,
    run_dir: Path,
    *,
    seed: int,
    epochs: float,
    size: int,
    batch: int,
    validate: bool,
    quick: bool = False,
) -> Config:
    """The ``vit-tiny-shapes`` preset pointed at ``data``, with no checkpoints; ``validate`` every epoch."""
    cfg = vit_tiny_shapes()
    cfg.run_dir = str(run_dir)
    cfg.data.path = str(data)
    cfg.data.image_size = size
    cfg.data.global_batch = batch
    cfg.sched.warmup_epochs = min(cfg.sched.warmup_epochs, epochs / 4)  # short runs: a quarter of them
    if quick:
        cfg.data.workers = 0
    cfg.train.seed = seed
    cfg.train.epochs = epochs
    cfg.train.device = "cpu"
    cfg.train.val_every = 0 if validate else 10**9
    cfg.checkpoint.every_steps = 10**9
    cfg.metrics.progress = False
    return cfg


def _parallel(cfg: Config, name: str, steps: int) -> None:
    if name == "dp-only":
        cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.switch = WORLD_SIZE, 1, ""
    else:
        cfg.parallel.dp, cfg.parallel.pp = -1, 1
        cfg.parallel.switch = f"pp2:0-{steps // 2},dp2:{steps // 2}-"
        cfg.parallel.switch_unit = "step"
        cfg.parallel.microbatches = 4


def _fit(cfg: Config, world: World) -> dict[str, Any]:
    trainer = build_trainer(cfg, world, resume="")
    summary = trainer.fit()
    trainer.metrics.close()
    speed = torch.tensor([summary["samples_per_s"]], dtype=torch.float64)
    dist.all_reduce(speed, op=dist.ReduceOp.MIN)  # the slowest rank's rate
    return {**summary, "samples_per_s": float(speed.item())}


def _validations(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {"epoch": round(r["epoch"], 3), "val_accuracy": r["val_accuracy"], "elapsed_s": r["elapsed_s"]}
        for r in rows
        if r.get("event") == "validation"
    ]


def _vit_rank(rank: int, world_size: int, tmp: Path, plan: dict[str, Any]) -> dict[str, Any]:
    world = World(rank=rank, world_size=world_size, local_world_size=world_size)
    data, size = Path(plan["data"]), plan["size"]
    # (a) the accuracy run.
    run_dir = tmp / "accuracy"
    batch = plan["batch"]
    quick = plan["quick"]
    cfg = vit_config(
        data, run_dir, seed=0, epochs=plan["epochs"], size=size, batch=batch, validate=True, quick=quick
    )
    accuracy = _fit(cfg, world)
    curve = _validations(run_dir) if rank == 0 else []
    # (b) short runs, dp-only and switch, the order rotating per seed.
    short: list[dict[str, Any]] = []
    for index, seed in enumerate(plan["seeds"]):
        names = SWITCH_CONFIGS[index % 2 :] + SWITCH_CONFIGS[: index % 2]
        for name in names:
            cfg = vit_config(
                data,
                tmp / f"{name}-{seed}",
                seed=seed,
                epochs=plan["short_steps"] / (plan["train_samples"] // batch),
                size=size,
                batch=batch,
                validate=False,
                quick=quick,
            )
            _parallel(cfg, name, plan["short_steps"])
            summary = _fit(cfg, world)
            short.append(
                {
                    "config": name,
                    "seed": seed,
                    "steps": summary["steps"],
                    "accuracy": summary["val_accuracy"],
                    "final_loss": summary["final_loss"],
                    "samples_per_s": summary["samples_per_s"],
                }
            )
    # (c) the bubble, with the machinery of ``kaisoku bench parallel``.
    bubble = bubble_rank(
        rank,
        world_size,
        tmp,
        0,
        0,
        plan["bubble_micro"],
        [2, 4, 8],
        plan["bubble_rounds"],
        make_model=_ViTFactory(size),
        sample_shape=(3, size, size),
    )
    return {"accuracy": accuracy, "curve": curve, "short": short, "bubble": bubble}


def _plan(quick: bool, work: Path) -> dict[str, Any]:
    if quick:
        # A few steps of everything on a small set: the machinery, not the figures.
        data = generate(work / "shapes", count=64, size=20, val_count=20, workers=1)
        return {
            "quick": True,
            "seeds": SEEDS[:2],
            "data": str(data),
            "size": 16,
            "train_samples": 64,
            "batch": 16,
            "epochs": 1,
            "short_steps": 2,
            "bubble_micro": 2,
            "bubble_rounds": 1,
        }
    data = ensure_demo_dataset(Config().data.cache_dir)
    train = 8000
    return {
        "quick": False,
        "seeds": SEEDS,
        "data": str(data),
        "size": 32,
        "train_samples": train,
        "batch": 128,
        "epochs": EPOCHS,
        "short_steps": SHORT_STEPS,
        "bubble_micro": BUBBLE_MICRO,
        "bubble_rounds": 6,
    }


def _switch_summary(short: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SWITCH_CONFIGS:
        accuracies = [r["accuracy"] for r in short if r["config"] == name]
        out[name] = {
            "accuracy_mean": statistics.mean(accuracies),
            "accuracy_std": statistics.stdev(accuracies),
            "accuracy_per_seed": [round(a, 4) for a in accuracies],
            "samples_per_s_median": statistics.median(
                r["samples_per_s"] for r in short if r["config"] == name
            ),
        }
    return out


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Measure (a), (b) and (c); write ``vit.json`` into ``out_dir``."""
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-vit-") as tmp:
        plan = _plan(quick, Path(tmp))
        per_rank = run_ranks(_vit_rank, WORLD_SIZE, Path(tmp), plan, timeout=3600.0, collective_timeout=300.0)
    first = per_rank[0]
    accuracy, curve = first["accuracy"], first["curve"]
    reached = next((v["elapsed_s"] for v in curve if v["val_accuracy"] >= 0.6), None)
    switch = _switch_summary(first["short"])
    bubble = bubble_rows([r["bubble"] for r in per_rank])
    dp, sw = switch["dp-only"], switch["switch"]
    # Signed, paired by seed (the same samples in the same order): below 0, switch is worse than dp-only.
    std = max(dp["accuracy_std"], 1e-9)
    gaps = [(a - b) / std for a, b in zip(sw["accuracy_per_seed"], dp["accuracy_per_seed"])]
    summary = {
        "val_accuracy": goal(accuracy["val_accuracy"], ">= 0.6", epochs=plan["epochs"]),
        "seconds_to_60pct": goal(
            reached,
            "< 600",
            reason="" if reached is not None else "validation accuracy never reached 60%",
            train_seconds=round(accuracy["train_seconds"], 1),
        ),
        "switch_accuracy_gap_in_dp_stds": goal(
            None,
            ">= -1.0",
            samples=gaps,
            statistic="mean",
            unit="seeds",
            switch_accuracy=sw["accuracy_mean"],
            dp_accuracy=dp["accuracy_mean"],
            dp_std=dp["accuracy_std"],
            switch_minus_dp_per_seed=[
                round(a - b, 4) for a, b in zip(sw["accuracy_per_seed"], dp["accuracy_per_seed"])
            ],
        ),
        "bubble_1f1b_worst_relative_gap": bubble_goal(bubble),
    }
    rows = [
        *({"part": "accuracy", **v} for v in curve),
        *({"part": "switch", **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}}
          for r in first["short"]),
        *bubble,
    ]  # fmt: skip
    setup = {
        "accuracy": f"vit-tiny-shapes preset (vit-tiny, AdamW lr 2e-3 wd 0.05, warmup 0.5 epoch + cosine, "
        f"label smoothing 0.1, batch 128) at {plan['size']} px, dp2 (DDP), {plan['epochs']} epochs of "
        f"{plan['train_samples']} images, validated after each epoch",
        "switch": f"same preset, {plan['short_steps']} steps each (schedule over those steps), seeds "
        f"{plan['seeds']}; "
        f"dp-only: dp2; switch: pp2 (1f1b, 4 micro-batches) for steps 0-{plan['short_steps'] // 2}, "
        "then dp2; accuracy on the validation split after the last step",
        "bubble": f"vit-tiny at {plan['size']} px split in 2 stages by parameters, {plan['bubble_micro']} "
        f"images a micro-batch, {plan['bubble_rounds']} rounds; bench.parallel.bubble_rank",
    }
    extra = {"setup": setup, "switch": switch, "accuracy_run": {k: accuracy[k] for k in sorted(accuracy)}}
    notes = (
        "2 ranks share the machine's 2 cores; bubble = blocked / step seconds as in kaisoku bench parallel; "
        "the switch goal compares short runs (see setup.switch), not the accuracy run"
    )
    record = write_result(NAME, out_dir, summary, rows, quick=quick, notes=notes, extra=extra)
    print_table("vit (a) accuracy", [r for r in rows if r["part"] == "accuracy"], {})
    print_table("vit (b) switch vs dp", [{"config": k, **v} for k, v in switch.items()], {})
    print_table("vit (c) bubble, pp=2", [r for r in rows if r["part"] == "bubble"], summary)
    return record
