"""``kaisoku bench engine``: step time of kaisoku's engine against a hand-written minimal DDP loop.

Both run inside the same two gloo ranks, on the same model, precision, global batch and loader
(the demo JPEG set decoded by a DataLoader worker per rank), alternating block by block (A/B, the order
rotating each round). kaisoku runs with its progress bar and JSONL logging on. The figure is the
median over rounds of kaisoku's time per step divided by the minimal loop's, with its IQR.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from kaisoku.bench.common import goal, median_iqr, print_table, write_result
from kaisoku.config import Config
from kaisoku.data.datagen import generate
from kaisoku.data.transforms import normalize
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from kaisoku.engine.trainer import Trainer

WORLD_SIZE = 2


def _config(data: Path, run_dir: Path, quick: bool) -> Config:
    cfg = Config(run_dir=str(run_dir))
    cfg.data.path = str(data)
    cfg.data.image_size = 32
    cfg.data.global_batch = 64 if quick else 128
    cfg.data.workers = 1
    cfg.model.name = "resnet10"
    cfg.train.epochs = 100  # never reached: the bench drives the steps itself
    cfg.train.log_every = 5
    cfg.train.val_every = 10**9
    cfg.checkpoint.every_steps = 10**9
    cfg.metrics.progress = True
    cfg.sched.name = "constant"
    cfg.sched.warmup_epochs = 0
    return cfg


class MinimalLoop:
    """The baseline: DDP with default buckets, SGD, cross-entropy, the same loader; nothing else."""

    def __init__(self, trainer: Trainer, cfg: Config) -> None:
        from kaisoku.models.zoo import build_model

        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model.name, num_classes=10, stem=cfg.model.stem)
        self.model = nn.parallel.DistributedDataParallel(model)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(),
            lr=cfg.optim.lr,
            momentum=cfg.optim.momentum,
            weight_decay=cfg.optim.weight_decay,
        )
        self.loader = trainer.train_loader  # same dataset, sampler and worker: the same bytes decoded
        self.sampler = trainer.train_sampler
        self._batches: Any = None
        self._epoch = 1000

    def _next(self) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            if self._batches is None:
                self.sampler.set_epoch(self._epoch)
                self._batches = iter(self.loader)
            try:
                return next(self._batches)
            except StopIteration:
                self._batches = None
                self._epoch += 1

    def run(self, steps: int) -> None:
        """Run ``steps`` optimizer steps."""
        for _ in range(steps):
            images, labels = self._next()
            loss = nn.functional.cross_entropy(self.model(normalize(images)), labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        loss.item()


def _rank_main(rank: int, tmp: str, data: str, quick: bool, rounds: int, steps: int, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=120),
        )
        cfg = _config(Path(data), Path(tmp) / "run", quick)
        world = World(rank=rank, world_size=WORLD_SIZE, local_world_size=WORLD_SIZE)
        trainer = build_trainer(cfg, world)
        baseline = MinimalLoop(trainer, cfg)

        def timed(run: Any) -> float:
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            return (time.perf_counter() - start) / steps

        def kaisoku_block() -> None:
            trainer.run(trainer.state.step + steps)

        def baseline_block() -> None:
            baseline.run(steps)

        timed(kaisoku_block)  # warm-up: loader workers, allocator, DDP bucket rebuild
        timed(baseline_block)
        rows = []
        for round_index in range(rounds):
            order = [("kaisoku", kaisoku_block), ("minimal", baseline_block)]
            if round_index % 2:
                order.reverse()
            times = {name: timed(block) for name, block in order}
            rows.append({"round": round_index, **times, "ratio": times["kaisoku"] / times["minimal"]})
        trainer.metrics.close()
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            queue.put(("ok", rows))
    except BaseException:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))
        raise


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Measure and record ``engine.json``."""
    rounds, steps = (3, 4) if quick else (9, 12)
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-engine-") as tmp:
        count = 1200 if quick else 4000
        data = generate(Path(tmp) / "shapes", count=count, size=40, val_count=100)
        context = mp.get_context("spawn")
        queue = context.Queue()
        procs = [
            context.Process(target=_rank_main, args=(rank, tmp, str(data), quick, rounds, steps, queue))
            for rank in range(WORLD_SIZE)
        ]
        for proc in procs:
            proc.start()
        status, payload = queue.get(timeout=1800)
        for proc in procs:
            proc.join(60)
    if status != "ok":
        raise RuntimeError(payload)
    rows: list[dict[str, Any]] = payload
    ratios = [row["ratio"] for row in rows]
    median, iqr = median_iqr(ratios)
    for row in rows:
        row["kaisoku_ms_per_step"] = round(1000 * row.pop("kaisoku"), 2)
        row["minimal_ms_per_step"] = round(1000 * row.pop("minimal"), 2)
        row["ratio"] = round(row["ratio"], 4)
    summary = {"engine_step_time_vs_minimal_ddp": goal(median, "<= 1.03")}
    record = write_result(
        "engine",
        out_dir,
        summary,
        rows,
        quick=quick,
        notes=(
            f"2 gloo ranks x 1 thread, resnet10 at 32 px, global batch {_config(Path(), Path(), quick).data.global_batch}, "
            f"{rounds} interleaved rounds of {steps} steps; ratio = kaisoku / minimal per-step time; "
            f"median {median:.4f}, IQR {iqr:.4f}; kaisoku with progress bar, JSONL every 5 steps, "
            "layer-group buckets; minimal loop: DDP defaults, same loader"
        ),
        extra={
            "ratio_median": median,
            "ratio_iqr": iqr,
            "median_kaisoku_ms": float(np.median([r["kaisoku_ms_per_step"] for r in rows])),
        },
    )
    print_table("engine", rows, summary)
    return record
