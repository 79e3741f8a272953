"""``kaisoku bench kfac``: wall time to a target test accuracy for SGD, LARS and K-FAC.

This module is the training run shared by the cases; :mod:`kaisoku.bench.kfac_cases` is the benchmark's
entry (its ``run``), with the cases, the summary and the record. In the mnist case a small BatchNorm CNN (``SmallCNN``, width 16) is trained
data-parallel (DDP, gloo, one thread per rank) at global batch 2,048 by three methods with the same tuning budget: SGD and LARS each tune the learning
rate over a 3-point grid, K-FAC (in front of momentum SGD, factor statistics on a quarter of the batch)
tunes kl_clip, its step size, over 3 points; every grid is extended while its best point is at an edge.
Every method gets warmup then cosine decay over the cap. Per seed (initial weights and data order), SGD
trains the whole cap; the target is its best test accuracy less half a point; the other methods train
until they reach it. Time to target is interpolated between evaluations (every few steps, evaluation
time excluded); medians over the seeds count. The K-FAC step time is split into forward/backward, factor
statistics, decomposition, communication and preconditioning. ASDL (``asdl``) runs single-process on the
same model where it is installed (``kaisoku.bench.kfac_peers``).
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisoku.bench.common import fast_bf16
from kaisoku.data.datagen import CLASSES
from kaisoku.distributed.spawn import run_ranks
from kaisoku.models.zoo import SmallCNN
from kaisoku.models.zoo import build_model as build_zoo_model
from kaisoku.optim import LARS
from kaisoku.optim.kfac import KFAC

WORLD_SIZE = 2
GLOBAL_BATCH = 2048
TARGET_ACCURACY = 0.98


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
    kfac_grid: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    """K-FAC's kl_clip values (its step size under KL clipping): as many points as the others' lr grid."""
    kfac_lr: float = 0.2
    extend_limit: int = 2
    """Points added beyond an edge of a grid whose best point sits on that edge, at most."""
    target_drop: float = 0.005
    """The target is the best test accuracy SGD reaches within the cap, minus this."""
    case: str = "mnist"
    """mnist (SmallCNN on MNIST) or resnet10-shapes (resnet10 on the generated shapes set)."""
    world_size: int = WORLD_SIZE
    device: str = "cpu"
    """cpu (gloo ranks) or cuda (NCCL, one GPU per rank)."""


FULL_PLAN = Plan(
    lr_grid=(0.1, 0.2, 0.4),
    grid_steps=12,
    max_epochs=4,
    eval_every=6,
    repeats=3,
    target=TARGET_ACCURACY,
    kfac_options={
        "factor_update_steps": 3,
        "inv_update_steps": 6,
        "damping": 3e-3,
        "factor_decay": 0.95,
        "kl_clip": 1e-3,
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
    global_batch=512,
    train_limit=4096,
    eval_limit=1000,
    warmup_steps=2,
)


def second_method() -> tuple[str, str]:
    """The method compared besides SGD and K-FAC, and how it is set up: ``("lars", why)``."""
    return "lars", "LARS: eta 0.02 with LARC clipping, no adaptation on BatchNorm and biases"


# ---------------------------------------------------------------------------------------------------------
# The model and the data.


#: Pixels per side of the resnet10 case's shapes images.
SHAPES_SIZE = 16


def build_model(case: str = "mnist") -> nn.Module:
    """The benchmarked model: ``SmallCNN`` of width 16 (mnist), or resnet10 with the compact stem for the
    shapes set's RGB images and classes (resnet10-shapes)."""
    if case == "resnet10-shapes":
        return build_zoo_model(
            "resnet10", num_classes=len(CLASSES), stem="compact", in_channels=3, size=SHAPES_SIZE
        )
    return SmallCNN(width=16)


def _load(path: Path, plan: Plan) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The splits as normalised float tensors: MNIST's ``(N, 28, 28)`` with its usual constants, or
    ``(N, C, H, W)`` uint8 images with the training split's per-channel mean and std."""
    arrays = np.load(path, allow_pickle=False)
    splits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    limits = {"train": plan.train_limit, "val": plan.eval_limit, "test": plan.eval_limit}
    for split, limit in limits.items():
        x = torch.from_numpy(arrays[f"x_{split}"][:limit].astype(np.float32)) / 255.0
        splits[split] = (
            x if x.ndim == 4 else x.unsqueeze(1),
            torch.from_numpy(arrays[f"y_{split}"][:limit].astype(np.int64)),
        )
    mean, std = torch.tensor(0.1307), torch.tensor(0.3081)
    if arrays["x_train"].ndim == 4:
        train = splits["train"][0]
        mean, std = train.mean(dim=(0, 2, 3), keepdim=True), train.std(dim=(0, 2, 3), keepdim=True)
    return {split: (((x - mean) / std).contiguous(), y) for split, (x, y) in splits.items()}


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The global sample order of ``epoch``, keyed by (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(n)


# ---------------------------------------------------------------------------------------------------------
# One training run on this rank.


def _make_optimizer(method: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if method == "lars":
        return LARS(model.named_parameters(), lr=lr, momentum=0.9, eta=0.02, trust_clip=True)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _device(plan: Plan) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if plan.device == "cuda" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a wall-clock reading includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _accuracy(model: nn.Module, split: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> float:
    model.eval()
    x, y = split
    share = math.ceil(len(x) / world)
    xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    correct = 0
    for start in range(0, len(xs), 1000):
        logits = model(xs[start : start + 1000])
        correct += int((logits.argmax(1) == ys[start : start + 1000]).sum())
    model.train()
    total = torch.tensor([correct, len(xs)], dtype=torch.float64, device=x.device)
    dist.all_reduce(total)
    return float(total[0] / total[1])


def crossing(previous: dict[str, float] | None, point: dict[str, float], target: float) -> dict[str, float]:
    """Where the accuracy curve crosses ``target`` between two evaluations, linearly interpolated."""
    if previous is None or point["acc"] <= previous["acc"]:
        return dict(point)
    share = min(1.0, max(0.0, (target - previous["acc"]) / (point["acc"] - previous["acc"])))
    return {
        key: previous[key] + share * (point[key] - previous[key]) if key != "acc" else target for key in point
    }


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup, then cosine decay to 0 at ``total_steps``: the schedule every method gets."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    return warm * 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / max(1, total_steps))))


#: Final accuracy at or below this counts as diverged (chance is 0.1 on ten classes).
CHANCE_CEILING = 0.2


def train_run(
    method: str,
    setting: float,
    plan: Plan,
    data: dict[str, tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    *,
    seed: int,
    max_steps: int | None,
    eval_split: str,
    stop_at: float | None,
) -> dict[str, Any]:
    """Train one method from the initial weights of ``seed``; return the accuracy curve and the time split.

    ``setting`` is the learning rate of SGD and LARS and K-FAC's kl_clip (its learning rate is
    ``plan.kfac_lr``). ``stop_at``: stop once the evaluated accuracy reaches it.
    """
    torch.manual_seed(seed)
    device = _device(plan)
    model = DistributedDataParallel(
        build_model(plan.case).to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    base_method = "sgd" if method == "kfac" else method
    lr = plan.kfac_lr if method == "kfac" else setting
    optimizer = _make_optimizer(base_method, model.module, lr)
    kfac = (
        KFAC(model, lr=optimizer, **{**plan.kfac_options, "kl_clip": setting}) if method == "kfac" else None
    )
    x_train, y_train = data["train"]
    per_rank = plan.global_batch // world
    steps_per_epoch = len(x_train) // plan.global_batch
    cap_steps = total_steps = int(plan.max_epochs * steps_per_epoch)
    if max_steps is not None:
        total_steps = min(total_steps, max_steps)
    split_seconds = {"forward_backward": 0.0, "optimizer": 0.0}
    curve: list[dict[str, float]] = []
    wall = 0.0
    reached: dict[str, float] | None = None
    order = np.empty(0, dtype=np.int64)
    diverged = False
    for step in range(total_steps):
        epoch, index = divmod(step, steps_per_epoch)
        if index == 0:
            order = epoch_order(seed, epoch, len(x_train))
        batch = order[index * plan.global_batch : (index + 1) * plan.global_batch]
        mine = torch.from_numpy(batch[rank * per_rank : (rank + 1) * per_rank]).to(device)
        x, y = x_train[mine], y_train[mine]
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step, plan.warmup_steps, cap_steps)
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        hooks_before = kfac.timings.get("factor", 0.0) if kfac else 0.0
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        hooks = (kfac.timings.get("factor", 0.0) - hooks_before) if kfac else 0.0
        split_seconds["forward_backward"] += (t1 - t0) - hooks
        if kfac is not None:
            kfac.step()
        _sync(device)
        t2 = time.perf_counter()
        optimizer.step()
        _sync(device)
        t3 = time.perf_counter()
        split_seconds["optimizer"] += t3 - t2
        wall += t3 - t0
        if not math.isfinite(float(loss.detach())):
            diverged = True
            break
        last = step == total_steps - 1
        if (step + 1) % plan.eval_every == 0 or last:
            # The inner module: evaluation needs no DDP buffer broadcast, so ranks may split unevenly.
            accuracy = _accuracy(model.module, data[eval_split], rank, world)
            point = {
                "step": step + 1,
                "epochs": (step + 1) / steps_per_epoch,
                "wall_s": wall,
                "acc": accuracy,
            }
            previous = curve[-1] if curve else None
            curve.append(point)
            if reached is None and stop_at is not None and accuracy >= stop_at:
                reached = crossing(previous, point, stop_at)
                break
    if rank == 0:
        print(
            f"  {method:9s} {'kl_clip' if kfac else 'lr'} {setting:<6g} steps {step + 1:4d}  acc {curve[-1]['acc'] if curve else float('nan'):.4f}"
            f"  wall {wall:7.1f} s  reached {'yes' if reached else ('-' if stop_at is None else 'no')}",
            flush=True,
        )
    if kfac is not None:
        # The statistics hooks ran inside forward/backward and were taken out of it above; "factor" is
        # the hooks plus the running averages.
        timings = kfac.timings
        for phase in ("factor", "decomposition", "communication", "precondition"):
            split_seconds[phase] = timings.get(phase, 0.0)
    steps_run = max(1, curve[-1]["step"] if curve else 1)
    final = curve[-1]["acc"] if curve else float("nan")
    return {
        "method": method,
        "lr": setting,
        "seed": seed,
        "curve": curve,
        "reached": reached,
        "diverged": diverged or not final > CHANCE_CEILING,
        "final_acc": curve[-1]["acc"] if curve else float("nan"),
        "step_split_ms": {k: 1000.0 * v / steps_run for k, v in split_seconds.items()},
        "steps": steps_run,
        "loads": kfac.rank_loads() if kfac else None,
    }


def first_crossing(curve: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """The interpolated point where ``curve`` first reaches ``target``, or None."""
    previous = None
    for point in curve:
        if point["acc"] >= target:
            return crossing(previous, point, target)
        previous = point
    return None


def tune(grid: tuple[float, ...], score: Any, extend_limit: int) -> tuple[float, list[dict[str, Any]], bool]:
    """The best setting of a log-spaced ``grid`` by ``score(setting)`` (higher is better).

    While the best point is at an edge, one more point is added beyond it at the grid's ratio, up to
    ``extend_limit`` times. Returns the best setting, every point tried, and whether the best is inside.
    """
    scores = {value: score(value) for value in grid}
    ratio = grid[1] / grid[0] if len(grid) > 1 else 2.0
    for _ in range(extend_limit if len(grid) > 1 else 0):
        values = sorted(scores)
        best = max(values, key=scores.__getitem__)
        if best == values[0]:
            scores[values[0] / ratio] = score(values[0] / ratio)
        elif best == values[-1]:
            scores[values[-1] * ratio] = score(values[-1] * ratio)
        else:
            break
    values = sorted(scores)
    best = max(values, key=scores.__getitem__)
    inside = len(values) == 1 or values[0] < best < values[-1]
    return best, [{"setting": v, "val_acc": scores[v]} for v in values], inside


def _worker(
    rank: int, world_size: int, out: Path, plan_dict: dict[str, Any], data_path: str
) -> dict[str, Any]:
    fields = ("lr_grid", "kfac_grid")
    plan = Plan(**{**plan_dict, **{key: tuple(plan_dict[key]) for key in fields}})
    device = _device(plan)
    data = {name: (x.to(device), y.to(device)) for name, (x, y) in _load(Path(data_path), plan).items()}
    # K-FAC right after SGD, so that a time limit cuts the peer rather than the compared pair.
    methods = ["sgd", "kfac", second_method()[0]]
    grid: list[dict[str, Any]] = []
    best: dict[str, float] = {}
    inside: dict[str, bool] = {}
    for method in methods:
        settings = plan.kfac_grid if method == "kfac" else plan.lr_grid
        if plan.grid_steps > 0 and len(settings) > 1:

            def score(value: float, method: str = method) -> float:
                run = train_run(
                    method, value, plan, data, rank, plan.world_size,
                    seed=plan.seed, max_steps=plan.grid_steps, eval_split="val", stop_at=None,
                )  # fmt: skip
                return -1.0 if run["diverged"] else run["final_acc"]

            best[method], points, inside[method] = tune(settings, score, plan.extend_limit)
            grid += [{"method": method, **point} for point in points]
        else:
            best[method] = settings[len(settings) // 2]
            inside[method] = len(settings) == 1
    runs: list[dict[str, Any]] = []
    for repeat in range(plan.repeats):
        seed = plan.seed + repeat
        # SGD runs its whole cap; the target of this seed is its best accuracy less target_drop.
        sgd = train_run(
            "sgd", best["sgd"], plan, data, rank, plan.world_size,
            seed=seed, max_steps=None, eval_split="test", stop_at=None,
        )  # fmt: skip
        target = max((p["acc"] for p in sgd["curve"]), default=plan.target) - plan.target_drop
        sgd["reached"] = first_crossing(sgd["curve"], target)
        shift = repeat % (len(methods) - 1)
        others = methods[1:]
        batch_runs = [sgd]
        for method in others[shift:] + others[:shift]:
            batch_runs.append(
                train_run(
                    method,
                    best[method],
                    plan,
                    data,
                    rank,
                    plan.world_size,
                    seed=seed,
                    max_steps=None,
                    eval_split="test",
                    stop_at=target,
                )  # fmt: skip
            )
        for run in batch_runs:
            run.update(repeat=repeat, target=target)
            runs.append(run)
        if rank == 0:
            # What is done so far survives a time limit that stops the ranks.
            partial = Path(out) / "rank0.partial.pt"
            state = {
                "ok": True,
                "complete": False,
                "grid": grid,
                "best": best,
                "inside": inside,
                "runs": runs,
            }
            torch.save(state, partial)
    return {"ok": True, "complete": True, "grid": grid, "best": best, "inside": inside, "runs": runs}


def _run_ranks(plan: Plan, data_path: Path, timeout_s: float) -> dict[str, Any]:
    """Every run on the gloo ranks; after a time limit, what rank 0 finished before it."""
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
