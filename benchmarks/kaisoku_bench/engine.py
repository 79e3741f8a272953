"""``kaisoku bench engine``: step time of kaisoku's trainer against a minimal DDP loop on the same data path.

kaisoku is the trainer :func:`~kaisoku.engine.build.build_trainer` builds; the baseline (:class:`MinimalLoop`)
its own loader from a second ``build_data`` call, the same model, DDP with PyTorch's default buckets, the
same optimizer and nothing else. The sides alternate in chunks of one log interval, in rounds, for a
fixed budget of measured time; the goal is judged on a distribution-free 95% confidence interval of the
median per-round ratio. Rows, repeats and limits: ``benchmarks/README.md``, section engine.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kaisoku.config import Config
from kaisoku.data.datagen import generate
from kaisoku.data.loading.loader import ShardLoader
from kaisoku.data.loading.transforms import normalize
from kaisoku.data.shards.writer import pack
from kaisoku.distributed.data_parallel import BucketPlan, wrap_ddp
from kaisoku.distributed.env import World, pick_device
from kaisoku.distributed.spawn import run_ranks
from kaisoku.engine.build import build_trainer
from kaisoku.engine.compile import synthetic_batch
from kaisoku.engine.data_build import build_data
from kaisoku.models.zoo import build_model
from kaisoku.optim.factory import build_optimizer
from kaisoku.run_facts import plan_run
from kaisoku.run_plan import WorldShape
from kaisoku_bench.common import goal, median_iqr, print_table, slowest_rank_seconds, write_result
from kaisoku_bench.goals import Interval

NAME = "engine"
WORLD_SIZE = 2
GOAL = 1.03
"""kaisoku's time per step may be at most 3% above the minimal loop's."""
CONFIDENCE = 0.95
"""The goal is met only when this confidence interval of the median per-round ratio lies at or below it."""


def settings(quick: bool) -> dict[str, int]:
    """Minimum and maximum rounds, chunk pairs per round, measured seconds per row after which no further
    round starts (once the minimum is reached), images in the generated set, global batch."""
    if quick:
        return {
            "min_rounds": 3,
            "max_rounds": 3,
            "chunks_per_round": 1,
            "row_seconds": 0,
            "count": 320,
            "global_batch": 32,
        }
    return {
        "min_rounds": 9,
        "max_rounds": 25,
        "chunks_per_round": 6,
        "row_seconds": 300,
        "count": 2000,
        "global_batch": 128,
    }


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free ``confidence`` interval of the median of ``values``: the order statistics
    ``[x(k), x(n+1-k)]`` with the largest ``k`` whose coverage, ``P(k <= B <= n-k)`` for ``B ~ Bin(n, 1/2)``,
    is at least ``confidence``. None when ``values`` are too few for any (fewer than 6 at 95%)."""
    n = len(values)
    ordered = sorted(values)
    k, below = 0, 0.0  # below: P(B <= k - 1)
    while k < n // 2:
        next_below = below + math.comb(n, k) / 2**n
        if 1 - 2 * next_below < confidence:
            break
        k, below = k + 1, next_below
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]


def config(data: Path, run_dir: Path, global_batch: int) -> Config:
    """The run both sides build from."""
    cfg = Config(run_dir=str(run_dir))
    cfg.data.path = str(data)
    cfg.data.image_size = 32
    cfg.data.global_batch = global_batch
    cfg.data.workers = 1
    cfg.model.name = "resnet10"
    cfg.train.epochs = 100  # never reached: the benchmark drives the steps itself
    cfg.train.log_every = 5
    cfg.train.val_every = 10**9
    cfg.checkpoint.every_steps = 10**9
    cfg.metrics.progress = True
    cfg.sched.name = "constant"
    cfg.sched.warmup_epochs = 0
    return cfg


class MinimalLoop:
    """The baseline: its own loader and sampler, the same model, default DDP, the same optimizer.

    What a hand-written loop does on a GPU as well: channels-last images on CUDA and, under
    ``precision.mode bf16``, the forward pass in bf16 autocast. DDP only with more than one rank, as
    ``build_trainer`` does. ``synthetic``: no loader, one fixed batch of the rank's size already on the
    device, already normalised and in the model's memory format (the compute ceiling)."""

    def __init__(self, cfg: Config, world: World, device: torch.device, *, synthetic: bool = False) -> None:
        torch.manual_seed(cfg.train.seed)
        plan = plan_run(cfg, WorldShape(world.world_size, world.local_world_size))
        # The trainer's rule (engine.build): channels-last for images on CUDA.
        self.channels_last = device.type == "cuda" and len(plan.sample_shape) == 3 and bool(plan.mean)
        self.loader: Any = None
        self._fixed: tuple[torch.Tensor, torch.Tensor] | None = None
        if synthetic:
            shape = (plan.rank_batch, *plan.sample_shape)
            images, labels = synthetic_batch(shape, plan.model.spec.num_classes, device, seed=cfg.train.seed)
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            self._fixed = images, labels
        else:
            data = build_data(plan, world, device)
            if isinstance(data.train, ShardLoader):
                data.train.connect(run_token="minimal-baseline")
            self.loader = data.train
        model = build_model(
            cfg.model.name,
            num_classes=plan.model.spec.num_classes,
            stem=cfg.model.stem,
            in_channels=plan.model.spec.in_channels,
        ).to(device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.bf16 = cfg.precision.mode == "bf16"
        self.optimizer = build_optimizer(model, cfg.optim)
        self.model: nn.Module = (
            wrap_ddp(model, device, plan=BucketPlan(mode="uniform")) if world.world_size > 1 else model
        )
        self.device = device
        self.mean, self.std = plan.mean, plan.std
        self._batches: Any = None
        self._epoch = 0

    def _next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fixed is not None:
            return self._fixed
        while True:
            if self._batches is None:
                self.loader.set_epoch(self._epoch)
                self._batches = iter(self.loader)
            try:
                return next(self._batches)
            except StopIteration:
                self._batches = None
                self._epoch += 1

    def run(self, steps: int) -> None:
        """Run ``steps`` optimizer steps (the last loss read back: the device has finished them)."""
        self.model.train()
        for _ in range(steps):
            images, labels = self._next()
            if self._fixed is None:
                images = normalize(images.to(self.device, non_blocking=True), self.mean, self.std)
                labels = labels.to(self.device, non_blocking=True)
                if self.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                loss = nn.functional.cross_entropy(self.model(images), labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        loss.item()


def alternating_rounds(
    blocks: dict[str, Callable[[], float]], chunk: int, plan: dict[str, int]
) -> tuple[list[dict[str, float]], float]:
    """Rounds of the sides in ``blocks``, each call of which runs ``chunk`` steps and returns its seconds
    per step: two warm-up passes, then ``chunks_per_round`` passes a round, the order reversed every other
    pass; at least ``min_rounds``, then until ``row_seconds`` of measured time are spent or ``max_rounds``
    are done. Returns each round's mean seconds per step of every side, and the measured seconds.

    The rounds' count never depends on the ratios seen (no stopping when the interval looks decided):
    the interval keeps its coverage. The budget is counted in the measured chunk times, which every rank
    holds alike, so that every rank decides the same.
    """
    for _ in range(2):  # warm-up: loader workers, allocator, DDP bucket rebuild
        for block in blocks.values():
            block()
    rounds: list[dict[str, float]] = []
    spent = 0.0
    passes = plan["chunks_per_round"]
    while len(rounds) < plan["max_rounds"]:
        totals = dict.fromkeys(blocks, 0.0)
        for index in range(passes):
            order = list(blocks) if index % 2 == 0 else list(reversed(blocks))
            for name in order:
                totals[name] += blocks[name]()
        spent += chunk * sum(totals.values())
        rounds.append({name: total / passes for name, total in totals.items()})
        if len(rounds) >= plan["min_rounds"] and spent >= plan["row_seconds"]:
            break
    return rounds, spent


def median_ratio_goal(ratios: Sequence[float], target: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The per-round ``ratios``' statistics (row fields) and their median's goal entry against ``target``,
    judged on the distribution-free 95% interval of the median (:func:`median_interval`)."""
    median, iqr = median_iqr(ratios)
    rounds = len(ratios)
    interval = median_interval(list(ratios))
    level = f"{100 * CONFIDENCE:.0f}%"
    reason = ""
    if interval is None:
        reason = f"{rounds} rounds give no {level} interval of the median ratio: not precise enough to judge"
    fields = {
        "rounds": rounds,
        "ratio_median": round(median, 4),
        "ratio_ci95": [round(v, 4) for v in interval] if interval is not None else None,
        "ratio_iqr": round(iqr, 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
        "ratios": [round(r, 4) for r in ratios],
    }
    # goal() judges the interval: met only when all of it clears the target, else "within noise".
    judged = (
        Interval(
            interval[0], interval[1], f"distribution-free {level} interval of the median over {rounds} rounds"
        )
        if interval is not None
        else None
    )
    entry = goal(median, target, interval=judged, reason=reason, iqr=round(iqr, 4), rounds=rounds)
    return fields, entry


def measure_row(cfg: Config, world: World, plan: dict[str, int]) -> dict[str, Any]:
    """Rounds of kaisoku and the minimal loop on ``cfg``'s data (:func:`alternating_rounds`)."""
    trainer = build_trainer(cfg, world, resume="")
    baseline = MinimalLoop(cfg, world, pick_device(cfg.train.device, world))
    if baseline.loader.steps_per_epoch != trainer.train_data.steps_per_epoch:
        raise RuntimeError("the two sides' epochs differ in steps")
    # One chunk is one log interval: kaisoku writes its metrics line once per chunk, as in training.
    chunk = cfg.train.log_every
    blocks: dict[str, Callable[[], float]] = {
        "kaisoku": lambda: slowest_rank_seconds(lambda: trainer.run(trainer.state.step + chunk), chunk),
        "minimal": lambda: slowest_rank_seconds(lambda: baseline.run(chunk), chunk),
    }
    rounds, spent = alternating_rounds(blocks, chunk, plan)
    for r in rounds:
        r["ratio"] = r["kaisoku"] / r["minimal"]
    trainer.metrics.close()
    for loader in (trainer.train_data, baseline.loader):
        loader.close()
    steps = chunk * plan["chunks_per_round"]
    return {"rounds": rounds, "steps_per_block": steps, "measured_seconds": spent}


def _rank_main(rank: int, world_size: int, tmp: Path, data: dict[str, str], plan: dict[str, int]) -> Any:
    world = World(rank=rank, world_size=world_size, local_world_size=world_size)
    return {
        name: measure_row(config(Path(path), tmp / f"run-{name}", plan["global_batch"]), world, plan)
        for name, path in data.items()
    }


def _row(name: str, result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON row of one data path and its summary entry."""
    fields, entry = median_ratio_goal([r["ratio"] for r in result["rounds"]], f"<= {GOAL}")
    row = {
        "data": name,
        "rounds": fields.pop("rounds"),
        "steps_per_block": result["steps_per_block"],
        "measured_seconds": round(result["measured_seconds"], 1),
        **{k: v for k, v in fields.items() if k != "ratios"},
        "kaisoku_ms_per_step": [round(1000 * r["kaisoku"], 2) for r in result["rounds"]],
        "minimal_ms_per_step": [round(1000 * r["minimal"], 2) for r in result["rounds"]],
        "ratios": fields["ratios"],
    }
    return row, entry


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Measure both data paths and record ``engine.json``."""
    plan = settings(quick)
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-engine-") as tmp:
        folder = generate(Path(tmp) / "shapes", count=plan["count"], size=40, val_count=100)
        packed = Path(tmp) / "shapes-packed"
        pack(folder, packed, shard_bytes="4MiB", progress=False, workers=1)
        data = {"packed": str(packed), "image-folder": str(folder)}
        results = run_ranks(
            _rank_main, WORLD_SIZE, Path(tmp), data, plan, timeout=3600.0, collective_timeout=300.0
        )[0]
    rows, summary = [], {}
    for name, suffix in (("packed", ""), ("image-folder", "_image_folder")):
        row, entry = _row(name, results[name])
        rows.append(row)
        summary[f"engine_step_time_vs_minimal_ddp{suffix}"] = entry
    notes = (
        f"2 gloo ranks x 1 thread, resnet10 at 32 px, {plan['count']} generated images, global batch "
        f"{plan['global_batch']}, 1 loader worker per side per rank; the sides alternate in chunks of 5 steps "
        f"(one log interval), order flipping every pair; a round is {plan['chunks_per_round']} pairs and its "
        "ratio is the summed kaisoku time over the summed minimal time; rounds repeat until "
        f"{plan['row_seconds']} s of measured time are spent (at least {plan['min_rounds']}, at most "
        f"{plan['max_rounds']} rounds; never stopped on the ratios seen); ratio = kaisoku / minimal time per "
        "step on the slower rank; the figure is the median over rounds, the goal met only when the "
        "distribution-free 95% interval of that median (order statistics) lies at or below it. kaisoku: "
        "build_trainer with progress bar, JSONL every 5 steps, kaisoku's layer-group DDP buckets. minimal: "
        "its own build_data loader and sampler, build_model, DDP with uniform 25 MiB buckets, build_optimizer, "
        "cross-entropy. The summary's main figure is the packed row (ShardLoader)."
    )
    record = write_result(NAME, out_dir, summary, rows, quick=quick, notes=notes)
    print_table(
        "engine",
        [{k: v for k, v in row.items() if not isinstance(v, list)} for row in rows],
        summary,
    )
    return record
