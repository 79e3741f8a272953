"""``kaisoku bench throughput``: ``kaisoku train``'s images/s on one GPU against hand-written torch loops.

ResNet-50 at 224 px in bf16 autocast, channels-last, on one CUDA device (a world of one NCCL rank). Three
sides run in alternating chunks of one log interval, in rounds (:func:`kaisoku_bench.engine.alternating_rounds`):

- ``kaisoku``: the trainer ``build_trainer`` builds, reading a packed set of generated JPEGs through
  kaisoku's loader (``data.workers`` decoding threads);
- ``loop``: a hand-written loop (:class:`kaisoku_bench.engine.MinimalLoop`: the same model and optimizer,
  bf16 autocast and channels-last, no DDP on one rank, as the trainer) fed by a kaisoku loader of its own
  over the same set;
- ``synthetic``: the same hand-written loop on one fixed batch already on the GPU: the compute ceiling.

Goals, each the median over rounds judged on its distribution-free 95% interval: kaisoku's time per step
at most 3% above the loop's with the loader (what the engine adds), and kaisoku's images/s at least 0.9 of
the synthetic loop's (the loader keeps the GPU fed). A full run needs a CUDA device (``kaisoku bench gpu``
runs it); ``--quick`` runs resnet10 at 32 px on the CPU: the machinery, not the figures. Setup and limits:
``benchmarks/README.md``, section throughput.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kaisoku.config import Config
from kaisoku.data.datagen import generate
from kaisoku.data.shards.writer import pack
from kaisoku.distributed.env import World, pick_device
from kaisoku.distributed.spawn import run_ranks
from kaisoku.engine.build import build_trainer
from kaisoku.errors import ConfigError
from kaisoku_bench.common import print_table, write_result
from kaisoku_bench.engine import MinimalLoop, alternating_rounds, config, median_ratio_goal

NAME = "throughput"
#: kaisoku's time per step may be at most this much of the hand-written loop's on the same loader.
STEP_GOAL = 1.03
#: kaisoku's images/s must be at least this share of the synthetic loop's.
FEED_GOAL = 0.9
#: Images/s per GPU, end to end, of the large-batch ImageNet record this project starts from (ResNet-50,
#: 90 epochs in 74.7 s on 2,048 V100s): context for the absolute figure, not a goal.
REFERENCE_IMAGES_PER_S = 750.0


def settings(quick: bool) -> dict[str, Any]:
    """The model and its stem, image sizes, set size, batch, loader threads, device, precision and the
    rounds."""
    if quick:
        return {
            "model": "resnet10",
            "stem": "compact",
            "size": 32,
            "source_size": 40,
            "count": 160,
            "global_batch": 16,
            "workers": 1,
            "log_every": 2,
            "device": "cpu",
            "precision": "fp32",
            "min_rounds": 3,
            "max_rounds": 3,
            "chunks_per_round": 1,
            "row_seconds": 0,
        }
    return {
        "model": "resnet50",
        "stem": "imagenet",
        "size": 224,
        "source_size": 256,
        "count": 10_240,
        "global_batch": 256,
        "workers": max(1, len(os.sched_getaffinity(0)) - 2),  # the cores less the training process's
        "log_every": 10,
        "device": "cuda",
        "precision": "bf16",
        "min_rounds": 7,
        "max_rounds": 12,
        "chunks_per_round": 2,
        "row_seconds": 90,
    }


def throughput_config(data: Path, run_dir: Path, plan: dict[str, Any]) -> Config:
    """``kaisoku bench engine``'s run at this benchmark's model, size, batch, threads, device and precision."""
    cfg = config(data, run_dir, plan["global_batch"])
    cfg.model.name = plan["model"]
    cfg.model.stem = plan["stem"]
    cfg.data.image_size = plan["size"]
    cfg.data.workers = plan["workers"]
    cfg.precision.mode = plan["precision"]
    cfg.train.device = plan["device"]
    cfg.train.log_every = plan["log_every"]
    return cfg


def seconds_per_step(block: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds per step of ``block`` (``steps`` steps), the device's queued work finished on both ends."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    block()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps


def _rank_main(rank: int, world_size: int, tmp: Path, data: str, plan: dict[str, Any]) -> dict[str, Any]:
    world = World(rank=rank, world_size=world_size, local_world_size=world_size)
    cfg = throughput_config(Path(data), tmp / "run", plan)
    device = pick_device(cfg.train.device, world)
    trainer = build_trainer(cfg, world, resume="")
    loop = MinimalLoop(cfg, world, device)
    synthetic = MinimalLoop(cfg, world, device, synthetic=True)
    if loop.loader.steps_per_epoch != trainer.train_data.steps_per_epoch:
        raise RuntimeError("the trainer's and the loop's epochs differ in steps")
    chunk = cfg.train.log_every
    blocks: dict[str, Callable[[], float]] = {
        "kaisoku": lambda: seconds_per_step(lambda: trainer.run(trainer.state.step + chunk), chunk, device),
        "loop": lambda: seconds_per_step(lambda: loop.run(chunk), chunk, device),
        "synthetic": lambda: seconds_per_step(lambda: synthetic.run(chunk), chunk, device),
    }
    rounds, spent = alternating_rounds(blocks, chunk, plan)
    trainer.metrics.close()
    for loader in (trainer.train_data, loop.loader):
        loader.close()
    return {
        "rounds": rounds,
        "measured_seconds": spent,
        "steps_per_block": chunk * plan["chunks_per_round"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "channels_last": loop.channels_last,
    }


def summarize(result: dict[str, Any], plan: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows and the goals of one run's rounds (seconds per step of each side)."""
    rounds = result["rounds"]
    step_fields, step_entry = median_ratio_goal([r["kaisoku"] / r["loop"] for r in rounds], f"<= {STEP_GOAL}")
    feed_fields, feed_entry = median_ratio_goal(
        [r["synthetic"] / r["kaisoku"] for r in rounds], f">= {FEED_GOAL}"
    )
    batch = plan["global_batch"]
    rows = [
        {
            "side": side,
            "images_per_s_median": round(batch / statistics.median(r[side] for r in rounds), 1),
            "ms_per_step": [round(1000 * r[side], 2) for r in rounds],
        }
        for side in ("kaisoku", "loop", "synthetic")
    ]
    rows.append({"side": "kaisoku / loop, time per step", **step_fields})
    rows.append({"side": "kaisoku / synthetic, images per s", **feed_fields})
    summary = {
        "kaisoku_step_time_vs_loop_with_loader": step_entry,
        "kaisoku_images_per_s_vs_synthetic_loop": feed_entry,
    }
    return rows, summary


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Measure the three sides and record ``throughput.json`` (a full run needs a CUDA device)."""
    if not quick and not torch.cuda.is_available():
        raise ConfigError(
            "kaisoku bench throughput measures kaisoku train on a CUDA GPU and this machine has none; run it "
            "(or kaisoku bench gpu) on a GPU machine, or --quick for the machinery on the CPU"
        )
    plan = settings(quick)
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-throughput-") as tmp:
        workers = max(1, min(plan["workers"], len(os.sched_getaffinity(0))))
        folder = generate(
            Path(tmp) / "shapes", count=plan["count"], size=plan["source_size"], val_count=10, workers=workers
        )
        packed = Path(tmp) / "shapes-packed"
        pack(folder, packed, shard_bytes="16MiB", progress=False, workers=workers)
        result = run_ranks(
            _rank_main,
            1,
            Path(tmp),
            str(packed),
            plan,
            timeout=1800.0,
            collective_timeout=300.0,
            backend="nccl" if plan["device"] == "cuda" else "gloo",
        )[0]
    rows, summary = summarize(result, plan)
    kaisoku_rate = rows[0]["images_per_s_median"]
    extra = {
        "device": result["device"],
        "reference_images_per_s": REFERENCE_IMAGES_PER_S,
        "kaisoku_vs_reference": round(kaisoku_rate / REFERENCE_IMAGES_PER_S, 3),
    }
    notes = (
        f"one rank on {result['device']}, {plan['model']} at {plan['size']} px ({plan['count']} generated "
        f"{plan['source_size']} px JPEGs, packed), global batch {plan['global_batch']}, precision "
        f"{plan['precision']}, channels-last {result['channels_last']}, {plan['workers']} loader threads per "
        f"loader; sides kaisoku (build_trainer), loop (hand-written: MinimalLoop on its own kaisoku loader) and "
        f"synthetic (the loop on one fixed batch on the device) alternate in chunks of {plan['log_every']} "
        f"steps, the order reversed every other pass, {plan['chunks_per_round']} passes a round, at least "
        f"{plan['min_rounds']} and at most {plan['max_rounds']} rounds; each figure is the median per-round "
        "ratio, met only when its distribution-free 95% interval clears the goal; the reference images/s "
        "(750 a V100, ResNet-50 end to end in the 74.7 s ImageNet record) is context, not a goal"
    )
    record = write_result(NAME, out_dir, summary, rows, quick=quick, notes=notes, extra=extra)
    shown = [{k: v for k, v in row.items() if not isinstance(v, list)} for row in rows]
    print_table("throughput", shown, summary)
    return record
