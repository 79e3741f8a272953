"""Training runs of the accuracy benchmarks (``largebatch``, ``kfac``) through the engine ``kaisoku train`` runs.

Each run is a :class:`~kaisoku.config.Config` built by :func:`~kaisoku.engine.build.build_trainer` with the
benchmark's in-memory tensors as the user's dataset (:class:`~kaisoku.parts.UserParts`, the path of
:func:`kaisoku.fit`): the engine's data order, DDP, optimizer, schedule, K-FAC and step. :class:`EngineRun`
drives the trainer in chunks and validates between them with the trainer's own validation, so that time to a
target counts training steps only; :func:`tune` is the grid search both benchmarks share, :func:`tune_pair` the
search over two settings built on it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from kaisoku.config import Config
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from kaisoku.errors import KaisokuError
from kaisoku.parts import UserParts

#: Accuracy (fraction) at or below which a run counts as diverged (chance is 0.1 on ten classes).
CHANCE_CEILING = 0.2


def npz_splits(path: Path, limits: dict[str, int | None]) -> dict[str, TensorDataset]:
    """The archive's splits (``x_<split>``, ``y_<split>`` for each split in ``limits``, cut to its limit) as
    datasets of normalised float images and int64 labels: MNIST's ``(N, 28, 28)`` with its usual constants,
    ``(N, C, H, W)`` uint8 images with the training split's per-channel mean and std."""
    arrays = np.load(path, allow_pickle=False)
    images: dict[str, torch.Tensor] = {}
    for split, limit in limits.items():
        x = torch.from_numpy(np.ascontiguousarray(arrays[f"x_{split}"][:limit])).float().div_(255.0)
        images[split] = x if x.ndim == 4 else x.unsqueeze(1)
    mean, std = torch.tensor(0.1307), torch.tensor(0.3081)
    if arrays["x_train"].ndim == 4:
        train = images["train"]
        mean, std = train.mean(dim=(0, 2, 3), keepdim=True), train.std(dim=(0, 2, 3), keepdim=True)
    return {
        split: TensorDataset(
            ((x - mean) / std).contiguous(),
            torch.from_numpy(arrays[f"y_{split}"][: limits[split]].astype(np.int64)),
        )
        for split, x in images.items()
    }


def bench_config(run_dir: Path, *, seed: int, device: str = "cpu") -> Config:
    """What every benchmark training run shares: in-process data (no workers), ten classes, no progress bar,
    no validation or checkpoints of the trainer's own (the benchmark validates between chunks)."""
    cfg = Config(run_dir=str(run_dir))
    cfg.data.workers = 0
    cfg.model.num_classes = 10
    cfg.train.seed = seed
    cfg.train.device = device  # type: ignore[assignment]
    cfg.train.val_every = 10**9
    cfg.checkpoint.every_steps = 10**9
    cfg.metrics.progress = False
    return cfg


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a wall-clock reading includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class EngineRun:
    """One run of the trainer ``build_trainer`` builds, trained in chunks and validated between them.

    ``seconds`` sums the chunks (the slowest rank's, validation excluded); ``phase_seconds`` splits them into
    the optimizer's step (timed by the optimizer's own step hooks), K-FAC's phases where it runs, and
    ``forward_backward``: the rest of the engine's step (data, forward, backward with DDP's all-reduce,
    the loop's bookkeeping).
    """

    cfg: Config
    world: World
    parts: UserParts
    seconds: float = 0.0
    diverged: bool = False
    optimizer_seconds: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.trainer = build_trainer(self.cfg, self.world, parts=self.parts)
        self.device = self.trainer.device
        self._opened = 0.0
        self.trainer.optimizer.register_step_pre_hook(self._optimizer_begins)
        self.trainer.optimizer.register_step_post_hook(self._optimizer_ends)

    def _optimizer_begins(self, *_: Any) -> None:
        _sync(self.device)
        self._opened = time.perf_counter()

    def _optimizer_ends(self, *_: Any) -> None:
        _sync(self.device)
        self.optimizer_seconds += time.perf_counter() - self._opened

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.trainer.state.step

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of one epoch."""
        return self.trainer.train_data.steps_per_epoch

    @property
    def total_steps(self) -> int:
        """The run's steps (``train.epochs``, capped by ``train.max_steps``)."""
        return self.trainer.settings.total_steps

    def train(self, steps: int) -> bool:
        """Train ``steps`` more steps (at most to the run's end); False once the run diverged (the policy
        ``stop`` raised on a non-finite loss or gradient)."""
        if self.diverged:
            return False
        if self.world.distributed:
            dist.barrier()
        _sync(self.device)
        start = time.perf_counter()
        try:
            self.trainer.run(min(self.step + steps, self.total_steps))
        except KaisokuError:  # every rank sees the same agreed non-finite flag
            self.diverged = True
        _sync(self.device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if self.world.distributed:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        self.seconds += float(elapsed.item())
        return not self.diverged

    def accuracy(self, dataset: TensorDataset | None = None) -> float:
        """Top-1 accuracy by the trainer's validation: on the run's validation set, or on ``dataset`` (every
        rank reads all of it; the sums over ranks give the same fraction)."""
        if self.diverged:
            return float("nan")
        loader = self.trainer.val_loader
        if dataset is not None:
            self.trainer.val_loader = DataLoader(dataset, batch_size=2000)
        try:
            return float(self.trainer.validate()["val_accuracy"])
        finally:
            self.trainer.val_loader = loader

    def phase_ms_per_step(self) -> dict[str, float]:
        """Milliseconds per step in each phase (see the class)."""
        steps = max(1, self.step)
        phases = {"optimizer": self.optimizer_seconds}
        kfac = getattr(self.trainer.engine, "preconditioner", None)
        if kfac is not None:
            for phase in ("factor", "decomposition", "communication", "precondition"):
                phases[phase] = kfac.timings.get(phase, 0.0)
        phases = {"forward_backward": max(0.0, self.seconds - sum(phases.values())), **phases}
        return {name: 1000.0 * value / steps for name, value in phases.items()}

    def close(self) -> None:
        """Release the trainer's data and metrics files."""
        self.trainer.metrics.close()
        self.trainer.train_data.close()


def crossing(previous: dict[str, float] | None, point: dict[str, float], target: float) -> dict[str, float]:
    """Where the accuracy curve crosses ``target`` between two evaluations, linearly interpolated."""
    if previous is None or point["acc"] <= previous["acc"]:
        return dict(point)
    share = min(1.0, max(0.0, (target - previous["acc"]) / (point["acc"] - previous["acc"])))
    return {
        key: previous[key] + share * (point[key] - previous[key]) if key != "acc" else target for key in point
    }


def first_crossing(curve: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """The interpolated point where ``curve`` first reaches ``target``, or None."""
    previous = None
    for point in curve:
        if point["acc"] >= target:
            return crossing(previous, point, target)
        previous = point
    return None


def _side_settled(scores: dict[float, float], side: list[float], failed_score: float | None) -> bool:
    """Whether one side of the best point shows the fall-off an interior optimum needs: its nearest tried
    point failed (diverged), or it holds two tried points and the outermost scores no higher than the
    nearest. One point alone is not enough: a single dip (a noisy or unstable run) next to the best says
    nothing about the points beyond it."""
    if not side:
        return False
    nearest, outermost = side[0], side[-1]
    if failed_score is not None and scores[nearest] <= failed_score:
        return True
    return len(side) >= 2 and scores[outermost] <= scores[nearest]


def tune(
    grid: tuple[float, ...], score: Any, extend_limit: int, *, failed_score: float | None = None
) -> tuple[float, list[dict[str, Any]], bool]:
    """The best setting of a log-spaced ``grid`` by ``score(setting)`` (higher is better).

    The best is inside the grid only when both of its sides are settled (:func:`_side_settled`): a tried
    lower and a tried higher neighbour, each side falling off over two points (or its nearest point
    scoring ``failed_score`` or less: diverged). While a side is not, one more point is added beyond that
    side's edge at the grid's ratio (the side with fewer points first), up to ``extend_limit`` points in
    all. Returns the best setting, every point tried, and whether the best is inside; a grid of one point
    is never inside.
    """
    scores = {value: score(value) for value in grid}
    ratio = grid[1] / grid[0] if len(grid) > 1 else 2.0

    def sides() -> tuple[float, list[float], list[float]]:
        values = sorted(scores)
        best = max(values, key=scores.__getitem__)
        lower = [v for v in reversed(values) if v < best]  # nearest first
        higher = [v for v in values if v > best]
        return best, lower, higher

    for _ in range(extend_limit if len(grid) > 1 else 0):
        best, lower, higher = sides()
        unsettled = [
            (len(side), -1 if side is lower else 1)
            for side in (lower, higher)
            if not _side_settled(scores, side, failed_score)
        ]
        if not unsettled:
            break
        direction = min(unsettled)[1]
        edge = min(scores) / ratio if direction < 0 else max(scores) * ratio
        scores[edge] = score(edge)
    best, lower, higher = sides()
    inside = _side_settled(scores, lower, failed_score) and _side_settled(scores, higher, failed_score)
    return best, [{"setting": v, "val_acc": scores[v]} for v in sorted(scores)], inside


def tune_pair(
    first: tuple[float, ...],
    second: tuple[float, ...],
    score: Callable[[float, float], float],
    extend_limit: int,
    *,
    failed_score: float | None = None,
) -> tuple[tuple[float, float], list[dict[str, float]], tuple[bool, bool]]:
    """The best pair of two settings by ``score(a, b)`` (higher is better), one coordinate pass of
    :func:`tune`: ``a`` over ``first`` at the middle point of ``second``, then ``b`` over ``second`` at that
    best ``a``; each grid extended by :func:`tune`'s rule, up to ``extend_limit`` points each.

    Every pair is scored once (the middle point of ``second`` is shared by both passes). Returns the best
    pair, every pair tried (``{"first", "second", "score"}``, sorted) and whether each best is inside.
    """
    scores: dict[tuple[float, float], float] = {}

    def scored(a: float, b: float) -> float:
        if (a, b) not in scores:
            scores[(a, b)] = score(a, b)
        return scores[(a, b)]

    middle = second[len(second) // 2]
    best_a, _, inside_a = tune(first, lambda a: scored(a, middle), extend_limit, failed_score=failed_score)
    best_b, _, inside_b = tune(second, lambda b: scored(best_a, b), extend_limit, failed_score=failed_score)
    points = [{"first": a, "second": b, "score": value} for (a, b), value in sorted(scores.items())]
    return (best_a, best_b), points, (inside_a, inside_b)


def learned(accuracy: float) -> bool:
    """Whether a final accuracy is above chance (a finite value above :data:`CHANCE_CEILING`)."""
    return math.isfinite(accuracy) and accuracy > CHANCE_CEILING
